"""PEFT on the JAX backend: LoRA, DoRA, rsLoRA, trainable tokens and QLoRA's NF4 base.

Invariants (float32, matmuls at "highest" precision):
- an adapter model's logits equal those of the plain model its adapters are merged into
  (``common.models.peft.merge_adapters``, float64) within 1e-5, for LoRA, DoRA, rsLoRA and trainable tokens, on
  llama and qwen2; the adapters move the logits (negative control: the base differs by far more);
- they equal real ``peft.PeftModel`` (torch, from a locally written HF folder and ``save_adapters``) within
  1e-5, and so do the loss (1e-6) and every adapter gradient by PEFT key (1e-5 relative): the
  parameterisation, DoRA's detached norm included, is PEFT's;
- packed (padding-free) == padded == one document at a time, with non-zero ``lora_B``: logits 1e-5,
  gradients add up (1e-5 relative); rematerialisation changes nothing;
- QLoRA computes the LoRA model on its dequantised base (logits 1e-5, loss 1e-6, gradients 1e-5 relative),
  and its compiled step (with and without rematerialisation) is smaller than LoRA's by the float32
  weights less their NF4 storage: it holds one layer's dequantised weights at most, not all of them;
- only adapters train: gradients exist for adapter keys only, and the frozen base (NF4 codes included) is
  bitwise unchanged after QLoRA steps, whose loss falls over 50 steps;
- DPO with LoRA: the reference (adapters switched off, no copy) gives the base model's log-probs, and the
  DPO loss falls;
- the trainer writes PEFT's folder, resumes bitwise from adapters + optimizer state, and refuses
  ``adamw_bf16`` and a QLoRA without qwix with errors that name the field and the fix.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from flax import nnx  # noqa: E402

from twinseq.common.data.batching import collate  # noqa: E402
from twinseq.common.config import ModelConfig, TrainConfig  # noqa: E402
from twinseq.common.errors import CheckpointError, ConfigError, MissingDependencyError  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.common.models.peft import TOKENS_KEY, PeftConfig, adapter_shapes, init_adapters  # noqa: E402
from twinseq.jax_backend import build_model, export_weights, logits, loss_and_grads  # noqa: E402
from twinseq.jax_backend import peft as jpeft  # noqa: E402

VOCAB = 512
DOCS = ([5, 6, 7, 9, 11, 300, 12, 8, 40, 41, 42], [8, 9, 100, 7, 5], [13, 14, 15, 16, 17, 18, 19])


pytestmark = pytest.mark.usefixtures("highest_precision")


def _weights(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """``init_weights`` plus noise, so that norms and biases are not their initial constants."""
    rng = np.random.default_rng(1)
    return {k: v + (rng.standard_normal(v.shape) * 0.02).astype(np.float32) for k, v in init_weights(cfg, 0).items()}


def _peft(**kw) -> PeftConfig:
    return PeftConfig(**{"use_peft": True, "lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, **kw})


def _adapters(cfg, model, peft) -> dict[str, np.ndarray]:
    """Non-trivial adapters: random ``lora_B``, magnitudes and token rows moved off their initial values."""
    adapters = init_adapters(cfg, peft, seed=1, base_weights=export_weights(model), lora_b_std=0.02)
    for key in adapters:
        if key.endswith("lora_magnitude_vector") or key == TOKENS_KEY:
            adapters[key] = adapters[key] * 1.1 + 0.01
    return adapters


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


CASES = {
    "llama-lora": ("tiny", {}),
    "llama-dora": ("tiny", {"use_dora": True}),
    "llama-tokens": ("tiny", {"trainable_token_indices": [5, 8, 9], "lora_target_modules": ["o_proj"]}),
    "qwen2-dora-tokens": ("tiny-qwen2", {"use_dora": True, "use_rslora": True, "trainable_token_indices": [7, 13]}),
}


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if "dora" in c else c for c in CASES]  # budget: dora, full tier
)
def test_adapter_model_equals_its_merged_model(case):
    preset, kw = CASES[case]
    cfg = ModelConfig.preset(preset, vocab_size=VOCAB)
    base = build_model(cfg, _weights(cfg))
    peft = _peft(**kw)
    model = jpeft.add_adapters(base, cfg, peft, _adapters(cfg, base, peft))
    batch = collate([{"input_ids": d} for d in DOCS], padding_free=True)
    adapted, merged, plain = (logits(m, batch) for m in (model, jpeft.merge_adapters(model), base))
    assert np.abs(adapted - merged).max() < 1e-5
    assert np.abs(adapted - plain).max() > 1e-2  # negative control: the adapters change the model
    with jpeft.adapters_disabled(model):  # the switch gives the base back, bitwise
        np.testing.assert_array_equal(logits(model, batch), plain)
    # export returns what was loaded, the base weights are untouched, and the caller's model has no adapters
    exported = jpeft.export_adapters(model)
    assert list(exported) == list(adapter_shapes(cfg, peft))
    assert all(np.array_equal(exported[k], v) for k, v in _adapters(cfg, base, peft).items())
    assert all(np.array_equal(export_weights(model)[k], v) for k, v in export_weights(base).items())
    loss, grads = loss_and_grads(model, batch)
    assert list(grads) == list(adapter_shapes(cfg, peft)) and all(np.abs(g).max() > 0 for g in grads.values())


@pytest.mark.parametrize("case", ["llama-dora-tokens", pytest.param("qwen2-rslora", marks=pytest.mark.slow)])
def test_logits_loss_and_grads_equal_real_peft(case, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from twinseq.common.models.peft import save_adapters
    from twinseq.jax_backend import save_pretrained

    preset, kw = {"llama-dora-tokens": ("tiny", {"use_dora": True, "trainable_token_indices": [5, 8, 9]}),
                  "qwen2-rslora": ("tiny-qwen2", {"use_rslora": True, "lora_target_modules": ["q_proj", "down_proj"]})}[case]
    cfg = ModelConfig.preset(preset, vocab_size=VOCAB)
    base = build_model(cfg, _weights(cfg))
    peft = _peft(**kw)
    adapters = _adapters(cfg, base, peft)
    model = jpeft.add_adapters(base, cfg, peft, adapters)
    save_pretrained(base, tmp_path / "base")
    save_adapters(tmp_path / "adapter", cfg, peft, adapters)

    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
                                          tmp_path / "adapter", is_trainable=True)
    reference.train()  # lora_dropout=0: train mode is deterministic, and gradients flow
    ids = DOCS[0]
    out = reference(input_ids=torch.tensor([ids]), labels=torch.tensor([ids]), use_cache=False)
    out.loss.backward()
    torch_grads = {}
    for name, param in reference.named_parameters():
        if param.requires_grad:
            key = TOKENS_KEY if "trainable_tokens_delta" in name else name.replace(".default", "")
            key = key[: -len(".weight")] if "lora_magnitude_vector" in key else key
            torch_grads[key] = param.grad.numpy()

    batch = collate([{"input_ids": ids}])
    assert np.abs(logits(model, batch)[0] - out.logits[0].detach().numpy()).max() < 1e-5
    loss, grads = loss_and_grads(model, batch)
    assert abs(loss - out.loss.item()) < 1e-6
    assert sorted(grads) == sorted(torch_grads)
    worst = max(_rel(grads[k], torch_grads[k]) for k in grads)
    assert worst < 1e-5, worst


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_packed_padded_and_separate_agree_with_remat():
    from twinseq.jax_backend.memory import apply_activation_checkpointing

    cfg = ModelConfig.preset("tiny", vocab_size=VOCAB)
    base = build_model(cfg, _weights(cfg))
    peft = _peft(use_dora=True)
    model = jpeft.add_adapters(base, cfg, peft, _adapters(cfg, base, peft))
    examples = [{"input_ids": d} for d in DOCS]
    padded, packed = collate(examples), collate(examples, padding_free=True, pad_to_multiple_of=16)
    # one shape for every document alone (padding to 16 columns), so that they share one compilation
    separate = [collate([ex], num_items_in_batch=padded.num_items_in_batch, pad_to_multiple_of=16) for ex in examples]

    lp, lk = logits(model, padded), logits(model, packed)
    offset = 0
    for row, (doc, alone) in enumerate(zip(DOCS, separate)):
        alone_logits = logits(model, alone)[0, :len(doc)]
        assert np.abs(lp[row, :len(doc)] - alone_logits).max() < 1e-5
        assert np.abs(lk[0, offset:offset + len(doc)] - alone_logits).max() < 1e-5
        offset += len(doc)

    loss_p, grads_p = loss_and_grads(model, padded, "nll")
    for loss_type in ("nll", "fused_linear"):
        loss_k, grads_k = loss_and_grads(model, packed, loss_type, chunk_size=16)
        assert abs(loss_p - loss_k) < 1e-5 and all(_rel(grads_k[k], grads_p[k]) < 1e-5 for k in grads_p)
    parts = [loss_and_grads(model, b, "chunked_nll", chunk_size=16) for b in separate]
    assert abs(sum(p[0] for p in parts) - loss_p) < 1e-5
    assert all(_rel(sum(p[1][k] for p in parts), grads_p[k]) < 1e-5 for k in grads_p)

    # rematerialisation recomputes the same numbers (the float32 grad_rel of parity_tests/tolerances.py)
    apply_activation_checkpointing(model, "full")
    loss_r, grads_r = loss_and_grads(model, packed, "fused_linear", chunk_size=16)
    assert abs(loss_r - loss_k) <= 1e-6 * loss_k and all(_rel(grads_r[k], grads_k[k]) <= 1e-5 for k in grads_k)


def _train_cfg(output_dir, **overrides) -> TrainConfig:
    values = dict(backend="jax", output_dir=str(output_dir), max_steps=4, save_steps=2, max_length=64,
                  per_device_train_batch_size=2, gradient_accumulation_steps=2, pad_to_multiple_of=64,
                  loss_type="fused_linear", loss_chunk_size=64, disable_tqdm=True, learning_rate=3e-3,
                  use_peft=True, lora_r=4, lora_alpha=8.0, lora_dropout=0.0)
    return TrainConfig.from_flat(**{**values, **overrides})


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_qlora_trains_adapters_only_on_a_frozen_nf4_base(tmp_path):
    from twinseq.jax_backend.trainer import SFTTrainer, with_adapters

    cfg = ModelConfig.preset("tiny", vocab_size=VOCAB)
    train_cfg = _train_cfg(tmp_path, max_steps=50, learning_rate=1e-2, load_in_4bit=True, use_dora=True,
                           trainable_token_indices=[5, 6])
    model = with_adapters(build_model(cfg, _weights(cfg)), train_cfg)
    codes = [m.kernel_nf4[...] for _, m in nnx.iter_modules(model) if isinstance(m, jpeft.PeftLinear)]
    assert len(codes) == 7 * cfg.num_hidden_layers and str(codes[0].dtype) == "uint4"
    trainer = SFTTrainer(model, train_cfg)
    frozen_before = jax.tree.map(np.asarray, trainer.frozen)
    adapters_before = jpeft.export_adapters(trainer.model())
    batch = collate([{"input_ids": d} for d in DOCS[:2]])
    losses = [trainer.step([batch])["loss"] for _ in range(50)]
    assert np.isfinite(losses).all() and losses[-1] < 0.6 * losses[0], losses[::10]  # 6.14 -> 3.09 here
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, trainer.frozen), frozen_before)
    after = jpeft.export_adapters(trainer.model())
    assert all(not np.array_equal(after[k], adapters_before[k]) for k in after)  # every adapter tensor moved


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_qlora_equals_lora_on_its_dequantised_base():
    # QLoRA's matmul (a custom_vjp that dequantises in the forward and again in the backward pass) computes
    # the LoRA model on the dequantised weights: DoRA too (it reads the dequantised weight for its norm)
    cfg = ModelConfig.preset("tiny", vocab_size=VOCAB)
    base = build_model(cfg, _weights(cfg))
    peft = _peft(use_dora=True)
    adapters = _adapters(cfg, base, peft)
    qlora = jpeft.add_adapters(base, cfg, dataclasses.replace(peft, load_in_4bit=True), adapters)
    dequantised = build_model(cfg, jpeft.base_weights(qlora))
    lora = jpeft.add_adapters(dequantised, cfg, peft, adapters)
    batch = collate([{"input_ids": d} for d in DOCS], padding_free=True)
    assert np.abs(logits(qlora, batch) - logits(lora, batch)).max() < 1e-5
    (loss_q, grads_q), (loss_l, grads_l) = loss_and_grads(qlora, batch), loss_and_grads(lora, batch)
    assert abs(loss_q - loss_l) < 1e-6 and all(_rel(grads_q[k], grads_l[k]) < 1e-5 for k in grads_l)


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
@pytest.mark.parametrize("remat_policy", ["none", "full"])
def test_qlora_step_holds_one_layer_of_dequantised_weights(remat_policy):
    # The compiled training step of QLoRA is smaller than LoRA's by the decoder linears' float32 weights minus
    # their NF4 storage: its temporaries hold at most one layer's dequantised weights more than LoRA's (plainly,
    # XLA:CPU merged every weight's forward and backward dequantisation and kept them all: temp +35 MiB on
    # `small`). Compilation only (abstract inputs); `small`'s 6 layers of 1.5M-weight linears, 1 x 64 tokens.
    from twinseq.jax_backend.memory import apply_activation_checkpointing
    from twinseq.jax_backend.model import grads_jit, split_trainable

    cfg = ModelConfig.preset("small", vocab_size=VOCAB)
    base = build_model(cfg, init_weights(cfg, 0))
    apply_activation_checkpointing(base, remat_policy)
    ids = jax.ShapeDtypeStruct((1, 64), np.int32)
    step = {}
    for load_in_4bit in (False, True):
        model = jpeft.add_adapters(base, cfg, _peft(load_in_4bit=load_in_4bit))
        graphdef, params, frozen = split_trainable(model)
        ma = grads_jit.lower(graphdef, params, (ids, ids, ids, ids), jax.ShapeDtypeStruct((), np.int32),
                             loss_type="fused_linear", chunk_size=64, frozen=frozen).compile().memory_analysis()
        step[load_in_4bit] = (ma.argument_size_in_bytes, ma.temp_size_in_bytes)
    linears = [m for _, m in nnx.iter_modules(model) if isinstance(m, jpeft.PeftLinear)]
    float_bytes = sum(m.kernel_nf4.shape[0] * m.kernel_nf4.shape[1] * 4 for m in linears)  # the dequantised weights
    nf4_bytes = sum(m.kernel_nf4.size // 2 + m.kernel_scale[...].nbytes for m in linears)  # XLA packs uint4
    layer_bytes = float_bytes // cfg.num_hidden_layers  # one decoder layer's dequantised weights (6 MiB)
    (arg_l, temp_l), (arg_q, temp_q) = step[False], step[True]
    assert arg_l - arg_q == float_bytes - nf4_bytes  # the base's storage: float32 -> NF4 codes + absmax scales
    assert temp_q <= temp_l + layer_bytes, (temp_l, temp_q, layer_bytes)  # not every layer's at once
    assert arg_q + temp_q <= arg_l + temp_l - (float_bytes - nf4_bytes - layer_bytes)  # 36 MiB of weights here


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_dpo_with_lora_reference_is_the_base_and_loss_falls(tmp_path):
    from twinseq.common.objectives.dpo import validate_dpo_config
    from twinseq.common.data.preference_batching import collate_preference
    from twinseq.jax_backend import compute_sequence_logps, dpo_loss_and_grads
    from twinseq.jax_backend.trainer import DPOTrainer, with_adapters

    cfg = ModelConfig.preset("tiny", vocab_size=VOCAB)
    base = build_model(cfg, _weights(cfg))
    rng = np.random.default_rng(3)
    examples = [{"prompt_input_ids": rng.integers(3, VOCAB, p).tolist(),
                 "chosen_input_ids": rng.integers(3, VOCAB, c).tolist(),
                 "rejected_input_ids": rng.integers(3, VOCAB, r).tolist()} for p, c, r in ((5, 7, 4), (3, 9, 6))]
    pbatch = collate_preference(examples, pad_to_multiple_of=64)
    config = validate_dpo_config("sigmoid", beta=0.5)
    train_cfg = _train_cfg(tmp_path, task="dpo", learning_rate=1e-2, lora_target_modules=["q_proj", "v_proj"])
    trainer = DPOTrainer(with_adapters(base, train_cfg), train_cfg, config=config, examples_per_step=2,
                         live_reference=True)
    base_c, base_r = compute_sequence_logps(base, pbatch, loss_type="nll")
    losses = []
    for _ in range(8):
        losses.append(trainer.step([pbatch])["loss"])
        from twinseq.jax_backend.dpo import preference_inputs
        ref_c, ref_r = trainer._reference(pbatch, preference_inputs(pbatch, VOCAB))
        np.testing.assert_allclose(np.asarray(ref_c), base_c, atol=1e-5)
        np.testing.assert_allclose(np.asarray(ref_r), base_r, atol=1e-5)
    assert losses[-1] < losses[0] - 0.05, losses
    policy = trainer.model()
    pol_c, _ = compute_sequence_logps(policy, pbatch, loss_type="nll")
    assert np.abs(pol_c - base_c).max() > 1e-3  # negative control: the policy moved away from its reference
    _, grads, _ = dpo_loss_and_grads(policy, pbatch, config, ref_chosen_logps=base_c, ref_rejected_logps=base_r,
                                     loss_type="nll")
    assert list(grads) == list(adapter_shapes(cfg, train_cfg.peft))


@pytest.mark.slow
def test_trainer_writes_peft_folder_and_resumes_bitwise(tmp_path):
    import twinseq.jax_backend as jb
    from twinseq.common.run.checkpoint import load_training_checkpoint
    from twinseq.common.run.report import read_metrics
    from twinseq.common.models.peft import read_adapters

    jb.train(_train_cfg(tmp_path / "full", use_dora=True))
    records = read_metrics(tmp_path / "full")
    jb.train(_train_cfg(tmp_path / "resumed", use_dora=True,
                        resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2")))
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(records[2:], resumed):
        assert (a["loss"], a["grad_norm"], a["num_tokens"]) == (b["loss"], b["grad_norm"], b["num_tokens"])
    peft, final = read_adapters(tmp_path / "full" / "final")
    _, last = load_training_checkpoint(tmp_path / "full" / "checkpoint-4")
    assert peft.use_dora and sorted(final) == sorted(last["adapters"])
    assert all(final[k].tobytes() == last["adapters"][k].tobytes() for k in final)
    start = init_adapters(ModelConfig.preset("tiny"), peft, seed=0, base_weights=init_weights(ModelConfig.preset("tiny"), 0))
    assert any(not np.array_equal(final[k], start[k]) for k in final)  # it trained
    # a full-weight run cannot resume from an adapter checkpoint
    with pytest.raises(CheckpointError, match="use_peft"):
        jb.train(_train_cfg(tmp_path / "wrong", use_peft=False, lora_r=16, lora_alpha=32.0, lora_dropout=0.05,
                            resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2")))


def test_bad_configs_are_refused_clearly(tmp_path, monkeypatch):
    import twinseq.jax_backend as jb

    with pytest.raises(ConfigError, match=r"optimizer='adamw_bf16'.*--optimizer adamw_torch"):
        jb.train(_train_cfg(tmp_path, dataset_name="/nonexistent.jsonl", optimizer="adamw_bf16"))
    cfg = ModelConfig.preset("tiny", vocab_size=VOCAB)
    base = build_model(cfg)
    with pytest.raises(ConfigError, match="use_peft=True"):
        jpeft.add_adapters(base, cfg, PeftConfig())
    with pytest.raises(CheckpointError, match="lora_r=8"):
        jpeft.add_adapters(base, cfg, _peft(lora_r=8), init_adapters(cfg, _peft(), seed=0))
    model = jpeft.add_adapters(base, cfg, _peft())
    with pytest.raises(ConfigError, match="already has adapters"):
        jpeft.add_adapters(model, cfg, _peft())
    with pytest.raises(ConfigError, match="no adapters"):
        jpeft.export_adapters(base)
    monkeypatch.setitem(sys.modules, "qwix", None)  # qwix not installed: QLoRA is refused, not faked
    with pytest.raises(MissingDependencyError, match="load_in_4bit=True.*qwix"):
        jpeft.add_adapters(base, cfg, _peft(load_in_4bit=True))
