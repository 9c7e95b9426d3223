"""LoRA on the experts of MoE layers, JAX backend: ``SparseMoeBlock``'s per-expert A/B (PEFT's ``ParamWrapper``
maths, a second pair of grouped matmuls), against its merged model, against real PEFT on torch, and through PEFT's
folder format.

Invariants (float32, matmuls at "highest" precision; bounds from parity_tests/TOLERANCES.md):
- an adapter model's logits equal its merged model's (``common.models.peft.merge_adapters``, float64) within 1e-5,
  and the adapters move them (negative control); ``adapters_disabled`` gives the base back bitwise;
- torch (``peft.PeftModel.from_pretrained`` on twinseq's folder) and JAX give equal logits (1e-5), loss (1e-6
  relative) and adapter gradients by PEFT key (1e-5 relative), with non-zero ``lora_B``;
- the torch and JAX adapter tensors round-trip bitwise through the folder, both ways.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from twinseq.common.config import ModelConfig  # noqa: E402
from twinseq.common.data.batching import collate  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.common.models.peft import (  # noqa: E402
    PeftConfig,
    adapter_shapes,
    init_adapters,
    read_adapters,
    save_adapters,
)
from twinseq.jax_backend import build_model, export_weights, logits, loss_and_grads  # noqa: E402
from twinseq.jax_backend import peft as jpeft  # noqa: E402

VOCAB = 512
DOCS = ([5, 6, 7, 9, 11, 300, 12, 8, 40, 41, 42], [8, 9, 100, 7, 5], [13, 14, 15, 16, 17, 18, 19])
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]

pytestmark = pytest.mark.usefixtures("highest_precision")


def _weights(cfg: ModelConfig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {k: v + (rng.standard_normal(v.shape) * 0.02).astype(np.float32) for k, v in init_weights(cfg, 0).items()}


def _peft(**kw) -> PeftConfig:
    base = {"use_peft": True, "lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, "lora_target_modules": ["q_proj"]}
    return PeftConfig(**{**base, "lora_target_parameters": list(EXPERTS), **kw})


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("preset, targets", [("tiny-qwen3-moe", EXPERTS), ("tiny-mixtral", EXPERTS[:1])])
def test_expert_adapter_model_equals_its_merged_model(preset, targets):
    cfg = ModelConfig.preset(preset, vocab_size=VOCAB)
    base = build_model(cfg, _weights(cfg))
    peft = _peft(lora_target_parameters=list(targets), lora_target_modules=[])
    adapters = init_adapters(cfg, peft, seed=1, lora_b_std=0.02)
    model = jpeft.add_adapters(base, cfg, peft, adapters)
    batch = collate([{"input_ids": d} for d in DOCS], padding_free=True)
    adapted, merged, plain = (logits(m, batch) for m in (model, jpeft.merge_adapters(model), base))
    assert np.abs(adapted - merged).max() < 1e-5
    assert np.abs(adapted - plain).max() > 1e-3  # negative control: the expert adapters change the model
    with jpeft.adapters_disabled(model):
        np.testing.assert_array_equal(logits(model, batch), plain)
    exported = jpeft.export_adapters(model)
    assert list(exported) == list(adapter_shapes(cfg, peft))
    assert all(np.array_equal(exported[k], v) for k, v in adapters.items())
    assert all(np.array_equal(export_weights(model)[k], v) for k, v in export_weights(base).items())
    _, grads = loss_and_grads(model, batch)
    assert list(grads) == list(adapter_shapes(cfg, peft)) and all(np.abs(g).max() > 0 for g in grads.values())


def test_expert_lora_equals_real_peft_and_round_trips_bitwise(tmp_path):
    """JAX vs ``PeftModel.from_pretrained`` (torch) on twinseq's folder: logits, loss, every adapter gradient; the
    folder PEFT saves again reads back bitwise equal to JAX's adapters."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from twinseq.jax_backend import save_pretrained

    cfg = ModelConfig.preset("tiny-qwen3-moe", vocab_size=VOCAB)
    base = build_model(cfg, _weights(cfg))
    peft = _peft()
    adapters = init_adapters(cfg, peft, seed=1, lora_b_std=0.02)
    model = jpeft.add_adapters(base, cfg, peft, adapters)
    save_pretrained(base, tmp_path / "base")
    save_adapters(tmp_path / "adapter", cfg, peft, jpeft.export_adapters(model))

    reference = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32),
        tmp_path / "adapter",
        is_trainable=True,
    ).train()
    ids = DOCS[0]
    out = reference(input_ids=torch.tensor([ids]), labels=torch.tensor([ids]), use_cache=False)
    out.loss.backward()
    torch_grads = {
        n.replace(".default", ""): p.grad.numpy() for n, p in reference.named_parameters() if p.requires_grad
    }
    batch = collate([{"input_ids": ids}])
    assert np.abs(logits(model, batch)[0] - out.logits[0].detach().numpy()).max() < 1e-5
    loss, grads = loss_and_grads(model, batch)
    assert abs(float(loss) - out.loss.item()) / out.loss.item() < 1e-6
    assert set(grads) == set(torch_grads)
    expert_keys = [k for k in grads if "experts" in k]
    assert len(expert_keys) == 8
    for key in grads:
        assert _rel(grads[key], torch_grads[key]) < 1e-5, key
    # negative control: with lora_B's columns in PEFT's expert-minor order taken expert-major, the gradients differ
    key = next(k for k in expert_keys if "lora_B" in k)
    b = grads[key]
    wrong = b.reshape(b.shape[0], cfg.num_experts, -1).transpose(0, 2, 1).reshape(b.shape)
    assert _rel(wrong, torch_grads[key]) > 1e-2

    reference.save_pretrained(tmp_path / "again")
    read_peft, read = read_adapters(tmp_path / "again", cfg)
    assert read_peft.lora_target_parameters == EXPERTS
    again = jpeft.add_adapters(base, cfg, read_peft, read)
    assert all(np.array_equal(v, adapters[k]) for k, v in jpeft.export_adapters(again).items())


def test_expert_targets_refused_where_peft_cannot_go():
    cfg = ModelConfig.preset("tiny-qwen3-moe", vocab_size=VOCAB)
    base = build_model(cfg, _weights(cfg))
    with pytest.raises(ConfigError, match="lora_dropout=0.05"):
        jpeft.add_adapters(base, cfg, _peft(lora_dropout=0.05))
    dense = ModelConfig.preset("tiny", vocab_size=VOCAB)
    with pytest.raises(ConfigError, match="no expert tensors"):
        jpeft.add_adapters(build_model(dense, _weights(dense)), dense, _peft())
    jpeft.add_adapters(base, cfg, _peft())  # control: the same config with dropout 0 on a MoE model is accepted
