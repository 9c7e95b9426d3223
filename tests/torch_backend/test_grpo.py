"""Torch GRPO: the loss against the numpy reference, completion log-probs, generation, and the trainer.

Invariants:
- ``grpo_loss_torch`` equals ``common.objectives.grpo_loss.grpo_loss`` (float64, 1e-6) for every loss type, with and without KL;
- completion log-probs of a padding-free batch equal a padded batch's (float64, 1e-6), and the chunked entropy
  equals the full-softmax entropy;
- the fused kernel never creates a ``[tokens, V]`` tensor (the ``nll`` control does, so the probe sees it);
- left-padded batched greedy generation equals each prompt generated alone;
- bad GRPO configs are refused by the CLI (exit 2); a run writes TRL's GRPO metrics; on the embedded task the
  mean reward rises.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from twinseq.common.config import ModelConfig, TrainConfig  # noqa: E402
from twinseq.common.objectives.grpo import GRPO_LOSS_TYPES, collate_completions  # noqa: E402
from twinseq.common.objectives.grpo_loss import CLIP_LOSS_TYPES, StepShare, grpo_loss  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.torch_backend import grpo as tgrpo  # noqa: E402
from twinseq.torch_backend.generation import generate  # noqa: E402
from twinseq.torch_backend.model import build_model  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the shared 2-core machine stalls on OpenMP barriers otherwise."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def tiny_model():
    cfg = ModelConfig.preset("tiny")
    return build_model(cfg, init_weights(cfg, seed=0)), cfg


def _case(seed=0, n=6, c=5):
    rng = np.random.default_rng(seed)
    logps = -rng.random((n, c)) * 3
    old = logps + rng.normal(size=(n, c)) * 0.3  # ratios spread past both clip bounds
    ref = logps + rng.normal(size=(n, c)) * 0.2
    adv = rng.normal(size=n)
    mask = (rng.random((n, c)) < 0.75).astype(np.int64)
    mask[:, 0] = 1
    return logps, old, ref, adv, mask


@pytest.mark.parametrize("loss_type", GRPO_LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("options", [{}, {"importance_sampling_level": "sequence"}, {"delta": 1.25},
                                     {"off_policy_mask_threshold": 0.0}],
                         ids=["token", "sequence", "delta", "off_policy_mask"])
def test_torch_loss_equals_the_numpy_reference(loss_type, beta, options):
    logps, old, ref, adv, mask = _case()
    kw = dict(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28, beta=beta, max_completion_length=5, **options)
    want = grpo_loss(logps, adv, mask, old_logps_NC=old, ref_logps_NC=ref, **kw)
    spec = tgrpo.LossSpec(**kw)
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    got, metrics = tgrpo.grpo_loss_torch(t(logps), t(adv), t(mask), spec, old_logps_NC=t(old), ref_logps_NC=t(ref))
    assert abs(float(got) - want.loss) <= 1e-6 * max(1.0, abs(want.loss))
    if loss_type in CLIP_LOSS_TYPES:
        assert want.metrics["clip_ratio/region_mean"] > 0  # the case exercises the clip
    for key, value in want.metrics.items():
        assert metrics[key] == pytest.approx(value, abs=1e-9), key


def _docs(seed=0, n=4, vocab=8192):
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(3, vocab, size=int(k))) for k in rng.integers(3, 12, size=n)]
    completions = [rng.integers(3, vocab, size=int(k)) for k in rng.integers(1, 9, size=n)]
    return prompts, completions


def test_padding_free_log_probs_equal_padded(tiny_model):
    model, _ = tiny_model
    model64 = model.double()
    try:
        prompts, completions = _docs()
        out = {}
        for pf in (False, True):
            cb = collate_completions(prompts, completions, padding_free=pf, pad_token_id=0, num_columns=8)
            with torch.no_grad():
                out[pf] = tgrpo.completion_logps(model64, cb, loss_type="fused_linear", chunk_size=7,
                                                 temperature=0.7, with_entropy=True)
            if pf:
                naive_logps, naive_entropy = _naive(model64, cb, temperature=0.7)
        np.testing.assert_allclose(out[True][0].numpy(), out[False][0].numpy(), atol=1e-6, rtol=0)
        np.testing.assert_allclose(out[True][1].numpy(), out[False][1].numpy(), atol=1e-6, rtol=0)
        np.testing.assert_allclose(out[True][0].numpy(), naive_logps, atol=1e-6, rtol=0)
        np.testing.assert_allclose(out[True][1].numpy(), naive_entropy, atol=1e-6, rtol=0)
        lengths = np.array([len(c) for c in completions])
        assert ((out[True][0].numpy() != 0).sum(axis=1) == lengths).all()
    finally:
        model.float()


def test_entropy_is_that_of_the_soft_capped_logits():
    """gemma2 soft-caps its logits: the entropy metric is that of the distribution it samples from (the capped
    logits, as HF's ``.logits`` and the jax backend compute it), not of the raw lm_head output."""
    cfg = ModelConfig.preset("tiny-gemma2")
    model = build_model(cfg, init_weights(cfg, seed=0)).double()
    with torch.no_grad():  # a cap that binds: scale the head up so the raw logits reach several units of the cap
        lm = model.get_output_embeddings()
        lm.weight.mul_(40.0)
    model.config.final_logit_softcapping = 2.0
    prompts, completions = _docs(vocab=cfg.vocab_size)
    cb = collate_completions(prompts, completions, padding_free=True, pad_token_id=0, num_columns=8)
    with torch.no_grad():
        got = tgrpo.completion_logps(model, cb, loss_type="fused_linear", chunk_size=7, with_entropy=True)
    naive_logps, naive_entropy = _naive(model, cb, temperature=1.0)
    # 1e-6 as in the padding-free test above: packed and per-document forwards round RoPE's float32 angles apart
    np.testing.assert_allclose(got[0].numpy(), naive_logps, atol=1e-6, rtol=0)
    np.testing.assert_allclose(got[1].numpy(), naive_entropy, atol=1e-6, rtol=0)


def _naive(model, cb, temperature):
    """Per-document forward of the plain model, full logits: the reference for the batched kernels."""
    logps = np.zeros((cb.num_docs, cb.num_columns))
    entropy = np.zeros_like(logps)
    ids = cb.batch.input_ids.reshape(-1)
    seg = cb.batch.segment_ids.reshape(-1)
    labels = cb.batch.labels.reshape(-1)
    for d in range(cb.num_docs):
        pos = np.flatnonzero(seg == d + 1)
        doc_ids, doc_labels = ids[pos], labels[pos]
        with torch.no_grad():
            logits = model(input_ids=torch.as_tensor(doc_ids[None], dtype=torch.long)).logits[0] / temperature
        logp = torch.log_softmax(logits.double(), -1)
        targets = np.flatnonzero(doc_labels != -100)
        for j, t in enumerate(targets):
            logps[d, j] = float(logp[t - 1, doc_ids[t]])
            entropy[d, j] = float(-(logp[t - 1].exp() * logp[t - 1]).sum())
    return logps, entropy


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor any aten op creates (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def _largest(model, cb, loss_type, chunk):
    with _MaxNumel() as mode:
        logps, _ = tgrpo.completion_logps(model, cb, loss_type=loss_type, chunk_size=chunk, with_entropy=True)
        logps.sum().backward()
    model.zero_grad(set_to_none=True)
    return mode.max_numel


def test_the_fused_path_never_creates_token_by_vocab_logits(tiny_model):
    model, cfg = tiny_model
    prompts, completions = _docs(seed=1, n=8)
    prompts = [p * 4 for p in prompts]  # enough tokens that [tokens, V] dwarfs every weight
    cb = collate_completions(prompts, completions, padding_free=True, pad_token_id=0)
    tokens, vocab, chunk = cb.batch.input_ids.size, cfg.vocab_size, 8
    assert tokens * vocab > 2 * vocab * cfg.hidden_size
    assert _largest(model, cb, "fused_linear", chunk) < tokens * vocab
    assert _largest(model, cb, "nll", chunk) >= tokens * vocab  # control: the probe sees full logits


def test_left_padded_greedy_equals_each_prompt_alone(tiny_model):
    model, _ = tiny_model
    prompts = [[1, 50, 60, 70, 80, 90, 100], [1, 7], [1, 300, 301, 302]]
    kw = dict(max_completion_length=6, eos_token_id=2, pad_token_id=0, greedy=True)
    batched = generate(model, prompts, **kw).completion_ids
    for i, p in enumerate(prompts):
        alone = generate(model, [p], **kw).completion_ids[0]
        assert batched[i, :len(alone)].tolist() == alone.tolist(), i
    assert model.training  # generation restores train mode


def test_bad_grpo_flags_exit_2(capsys):
    from twinseq.common.cli import main

    assert main(["train", "--task", "grpo", "--num-generations", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err
    assert main(["train", "--task", "grpo", "--num-generations", "3", "--per-device-train-batch-size", "8"]) == 2
    assert "not divisible" in capsys.readouterr().err


def _run(tmp_path, **flat):
    from twinseq.torch_backend.recipes import train

    cfg = TrainConfig.from_yaml("configs/grpo.yaml", output_dir=str(tmp_path), disable_tqdm=True, **flat)
    path = train(cfg)
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_run_logs_grpo_metrics_with_kl_and_reused_generations(tmp_path):
    rows = _run(tmp_path, max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                num_generations=4, max_completion_length=4, num_iterations=2, grpo_beta=0.04, padding_free=False,
                gradient_checkpointing=True)
    first, second = rows
    for key in ("reward", "reward_std", "rewards/format/mean", "rewards/exact_match/mean", "kl", "entropy",
                "clip_ratio/region_mean", "completions/mean_length", "generation_seconds", "training_seconds"):
        assert key in first, key
    assert first["generation_seconds"] > 0 and second["generation_seconds"] == 0.0  # μ=2 reuses the batch
    assert first["kl"] == pytest.approx(0.0, abs=1e-6) and second["kl"] > 0  # the policy moved from the reference
    assert first["reward"] == second["reward"]


@pytest.mark.slow
def test_the_embedded_task_raises_the_mean_reward(tmp_path):
    rows = _run(tmp_path, max_steps=10, per_device_train_batch_size=8, num_generations=4)
    rewards = [r["reward"] for r in rows]
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    print(f"mean reward: first 3 steps {first:.3f} -> last 3 steps {last:.3f}; entropy "
          f"{rows[0]['entropy']:.2f} -> {rows[-1]['entropy']:.2f}")
    assert last > first + 0.2, rewards


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_liger_grpo_loss_equals_twinseq(loss_type, device):
    """Liger's fused GRPO loss against the chunked path, same micro-batch and weights: Liger's chunked loss is plain
    torch, so on CPU (liger-kernel is a test dependency) as on CUDA."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("liger_kernel", reason="needs liger-kernel (a dev dependency; the gpu extra)")
    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, init_weights(cfg, seed=0)).to(device)
    prompts, completions = _docs(seed=2, n=4)
    cb = collate_completions(prompts, completions, padding_free=False, pad_token_id=0, num_columns=8)
    lengths = np.array([len(c) for c in completions])
    mask = torch.as_tensor(np.arange(8)[None, :] < lengths[:, None], dtype=torch.int64, device=device)
    adv = torch.tensor([1.0, -0.5, 0.25, -0.75], device=device)
    logps = tgrpo.completion_logps(model, cb, temperature=0.9)[0]
    old = (logps.detach() + 0.3 * torch.randn_like(logps)) * mask  # ratios past both clip bounds
    micro = tgrpo.GRPOMicroBatch(cb, mask, adv, old_logps_NC=old)
    spec = tgrpo.LossSpec(loss_type=loss_type, max_completion_length=8)
    share = StepShare(num_sequences_in_step=4, num_tokens_in_step=int(lengths.sum()))
    want, _ = tgrpo.grpo_loss_torch(logps, adv, mask, spec, share, old_logps_NC=old)
    got, _ = tgrpo.liger_grpo_loss(model, micro, spec, share, temperature=0.9)
    assert abs(float(got) - float(want)) <= 1e-5 * max(1.0, abs(float(want)))


def _conversational_jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"Repeat the last word: file {w}"}], "answer": w}
            for w in ("node", "path", "key", "size")]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_conversational_jsonl_prompts_reach_python_reward_functions(tmp_path):
    from twinseq.common.errors import DataError
    from twinseq.torch_backend.grpo import build_grpo

    seen = {}

    def spy_reward(prompts, completions, answer, **kwargs):
        seen.update(prompt=prompts[0], completion=completions[0], answer=answer[0])
        return [float(len(c[0]["content"])) for c in completions]

    cfg = TrainConfig.from_flat(task="grpo", dataset_name=str(_conversational_jsonl(tmp_path)), max_steps=1,
                                per_device_train_batch_size=4, num_generations=4, max_completion_length=3,
                                output_dir=str(tmp_path / "run"), disable_tqdm=True)
    trainer, source, _, _ = build_grpo(cfg, torch.device("cpu"), None, reward_funcs=[spy_reward])
    out = trainer.step(source.next_step())
    assert seen["prompt"][0]["role"] == "user" and seen["completion"][0]["role"] == "assistant"
    assert seen["answer"] in ("node", "path", "key", "size")
    assert "rewards/spy_reward/mean" in out and np.isfinite(out["loss"])

    def broken_reward(prompts, completions, **kwargs):
        return [1.0]

    trainer, source, _, _ = build_grpo(cfg, torch.device("cpu"), None, reward_funcs=[broken_reward])
    with pytest.raises(DataError, match="broken_reward.*1 rewards for 4 completions"):
        trainer.step(source.next_step())
