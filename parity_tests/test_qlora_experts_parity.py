"""QLoRA's NF4 experts: the torch backend (bitsandbytes' ``quantize_4bit``, ``torch_backend.moe.GroupedNF4Experts``)
and the jax backend (``common.models.nf4``, ``jax_backend.moe.grouped_experts`` over ``NF4Experts``) store and compute
the same thing from the same float weights. Invariants, float32 on CPU, the bounds of TOLERANCES.md:

- the NF4 storage of every expert tensor (codes and absmax) and its dequantised numbers are bitwise equal;
- the logits agree within ``logits_abs`` (qwen3_moe, mixtral, gpt_oss), and differ from the float model's (control);
- with LoRA on the NF4 experts (and on ``q_proj``), the loss agrees within ``loss_rel`` and every adapter gradient,
  by PEFT's saved key (the same keys on both sides), within ``grad_rel``; adapters of another seed break the bounds
  (control).

The decoder's dense linears are QLoRA's too, but quantised differently by design: bitsandbytes' ``Linear4bit``
(blocks of 64 of the flattened weight, double-quantised absmax) and qwix (blocks of ``gcd(in, 64)`` per row, float32
scales). So that the comparison is about the experts, those weights are drawn on a grid both reproduce exactly
(``_on_the_dense_grid``: NF4 values times one scale, every 32 consecutive numbers holding a ``±1``); the experts keep
their random float values, which NF4 rounds.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.inputs import rel_norm
from parity_tests.tolerances import tol
from twinseq.common.data.batching import collate
from twinseq.common.models.configs import ModelConfig
from twinseq.common.models.init import init_weights
from twinseq.common.models.nf4 import NF4_CODE
from twinseq.common.models.peft import LINEAR_MODULES, PeftConfig, init_adapters

torch = pytest.importorskip("torch")
pytest.importorskip("jax")
pytest.importorskip("qwix")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
LOGITS_ABS = tol("float32", "logits_abs")


def _peft(**kw) -> PeftConfig:
    base = {"lora_r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, "lora_target_modules": ["q_proj"]}
    return PeftConfig(use_peft=True, load_in_4bit=True, **{**base, **kw})


def _on_the_dense_grid(weights: dict[str, np.ndarray], scale: float = 0.05) -> dict[str, np.ndarray]:
    """``weights`` with every decoder linear weight replaced by ``NF4_CODE[random] * scale``, each run of 32 numbers
    of the flattened weight starting with ``+scale``: both dense quantisers' blocks then have absmax ``scale`` and
    give these numbers back (module docstring); the experts are unchanged."""
    rng = np.random.default_rng(7)
    out = dict(weights)
    for name, w in weights.items():
        if w.ndim == 2 and name.split(".")[-2] in LINEAR_MODULES:
            index = rng.integers(0, 16, w.size).reshape(-1, 32)
            index[:, 0] = 15
            out[name] = (NF4_CODE[index] * np.float32(scale)).reshape(w.shape)
    return out


def _batch(cfg: ModelConfig, n: int = 23):
    return collate([{"input_ids": np.random.default_rng(0).integers(3, cfg.vocab_size, n).tolist()}])


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-gpt-oss"])
def test_nf4_experts_are_stored_and_computed_alike(preset, exact_fp32):
    """Codes, absmax and dequantised experts bitwise equal; NF4 logits within ``logits_abs``; the float model's logits
    differ from both (control: the experts really are NF4 on both sides)."""
    import twinseq.jax_backend as jb
    import twinseq.torch_backend as tb
    from twinseq.jax_backend.model import SparseMoeBlock
    from twinseq.torch_backend.moe import experts_modules
    from twinseq.torch_backend.unwrap import causal_lm_of

    cfg = ModelConfig.preset(preset)
    weights = _on_the_dense_grid(init_weights(cfg, seed=0))
    batch = _batch(cfg)
    t_model = tb.add_adapters(tb.build_model(cfg, weights), cfg, _peft())
    j_model = jb.add_adapters(jb.build_model(cfg, weights), cfg, _peft())
    j_blocks = [j_model.model.layers[i].mlp for i in range(cfg.num_hidden_layers)]
    assert all(isinstance(b, SparseMoeBlock) and b.nf4_shapes for b in j_blocks)
    for t_experts, j_block in zip(experts_modules(causal_lm_of(t_model)), j_blocks, strict=True):
        for name in ("gate_up_proj", "down_proj"):
            t_weight = getattr(t_experts, name)
            j_codes, j_absmax = (np.asarray(j_block.experts[name + s][...]) for s in ("_nf4", "_absmax"))
            np.testing.assert_array_equal(j_codes.reshape(-1), t_weight.data.numpy().reshape(-1))
            np.testing.assert_array_equal(j_absmax.reshape(-1), t_weight.quant_state.absmax.numpy())
    t_base, j_base = tb.export_weights(t_model), jb.export_weights(j_model)
    experts = [n for n in t_base if ".mlp.experts." in n]
    assert len(experts) == (4 if cfg.expert_biases else 2) * cfg.num_hidden_layers
    for name in experts:
        np.testing.assert_array_equal(j_base[name], t_base[name])
    t_logits, j_logits = tb.logits(t_model, batch), jb.logits(j_model, batch)
    diff = float(np.abs(t_logits - j_logits).max())
    print(f"{preset}: NF4 experts bitwise equal, logits max |torch - jax| {diff:.1e}")
    assert diff <= LOGITS_ABS
    float_logits = jb.logits(jb.build_model(cfg, weights), batch)
    assert float(np.abs(float_logits - j_logits).max()) > 1e-2  # negative control


def test_lora_on_nf4_experts_loss_and_gradients_agree(exact_fp32):
    """LoRA on the NF4 experts and on ``q_proj``: the same adapter keys on both backends, the loss within
    ``loss_rel`` and every adapter gradient within ``grad_rel``; jax adapters of another seed break the bounds."""
    import twinseq.jax_backend as jb
    import twinseq.torch_backend as tb

    cfg = ModelConfig.preset("tiny-qwen3-moe")
    weights = _on_the_dense_grid(init_weights(cfg, seed=0))
    peft = _peft(lora_target_parameters=list(EXPERTS))
    adapters = init_adapters(cfg, peft, seed=1, lora_b_std=0.02)
    batch = _batch(cfg)
    t_model = tb.add_adapters(tb.build_model(cfg, weights), cfg, peft, adapters)
    j_model = jb.add_adapters(jb.build_model(cfg, weights), cfg, peft, adapters)
    assert sorted(tb.export_adapters(t_model)) == sorted(jb.export_adapters(j_model)) == sorted(adapters)
    t_loss, t_grads = tb.loss_and_grads(t_model, batch)
    j_loss, j_grads = jb.loss_and_grads(j_model, batch)
    assert set(t_grads) == set(j_grads) == set(adapters)
    assert all(np.abs(g).max() > 0 for g in t_grads.values()), "an adapter gradient is zero: the test is blind"
    grad_rel = {k: rel_norm(j_grads[k], t_grads[k]) for k in t_grads}
    worst = max(grad_rel, key=grad_rel.get)
    loss_rel = abs(j_loss - t_loss) / abs(t_loss)
    print(f"NF4 expert LoRA: loss rel {loss_rel:.1e}, worst adapter grad rel {grad_rel[worst]:.1e} ({worst})")
    assert loss_rel <= tol("float32", "loss_rel")
    assert grad_rel[worst] <= tol("float32", "grad_rel"), worst
    other = init_adapters(cfg, peft, seed=2, lora_b_std=0.02)
    o_loss, o_grads = jb.loss_and_grads(jb.add_adapters(jb.build_model(cfg, weights), cfg, peft, other), batch)
    expert_keys = [k for k in t_grads if ".experts." in k]
    assert abs(o_loss - t_loss) / abs(t_loss) > tol("float32", "loss_rel")  # negative control
    assert all(rel_norm(o_grads[k], t_grads[k]) > tol("float32", "grad_rel") for k in expert_keys)
