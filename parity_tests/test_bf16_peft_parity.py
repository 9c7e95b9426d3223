"""bfloat16 LoRA/DoRA parity: a bfloat16 frozen base with float32 adapters, what both trainers hold under
``--dtype bfloat16`` (``common.models.peft.base_dtype``), computes the same thing on torch (real ``peft``) and jax.

Both layers compute ``round_bf16(base(x) + lora(x) * scaling)``: the base matmul in bfloat16, the adapter path in
float32 (PEFT casts ``x`` to the adapters' dtype), the sum rounded to the base's dtype. The bounds are the
bfloat16 table's (TOLERANCES.md), no looser: logits within 2 bf16 ulps of each other and of the float64 reference
(the merged weights ``W_bf16 + s B A`` of ``common.models.peft.merge_adapters``), per-token NLL within 4, every
adapter gradient within 10 u. ``lora_B`` is drawn non-zero so the adapters change the logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.inputs import LAYOUTS, parity_batches, rel_norm, valid_positions
from parity_tests.tolerances import bf16_ulp, tol
from twinseq.common.models.configs import ModelConfig
from twinseq.common.models.init import init_weights
from twinseq.common.models.peft import PeftConfig, init_adapters, merge_adapters
from twinseq.common.objectives.nll import shift_labels, token_nll

torch = pytest.importorskip("torch")
pytest.importorskip("jax")
pytest.importorskip("peft")
ml_dtypes = pytest.importorskip("ml_dtypes")

VARIANTS = {"lora": dict(), "dora": dict(use_dora=True)}


def _setup(variant: str):
    cfg = ModelConfig.preset("tiny")
    peft = PeftConfig(use_peft=True, lora_r=4, lora_alpha=8.0, lora_dropout=0.0, **VARIANTS[variant])
    weights = init_weights(cfg, seed=0)
    rounded = {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in weights.items()}
    adapters = init_adapters(cfg, peft, seed=1, base_weights=rounded, lora_b_std=0.02)
    return cfg, peft, weights, rounded, adapters


def _models(cfg, peft, weights, adapters):
    import twinseq.jax_backend as jb
    import twinseq.torch_backend as tb

    out = {}
    for name, be in (("torch", tb), ("jax", jb)):
        model = be.add_adapters(be.build_model(cfg, weights, dtype="bfloat16"), cfg, peft, adapters)
        out[name] = (be, model)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_base_logits_and_token_losses(variant, exact_fp32):
    from parity_tests import numpy_reference

    cfg, peft, weights, rounded, adapters = _setup(variant)
    models = _models(cfg, peft, weights, adapters)
    for layout, batch in parity_batches(cfg.vocab_size).items():
        assert layout in LAYOUTS
        valid = valid_positions(batch)
        ref = numpy_reference.logits(cfg, merge_adapters(cfg, peft, rounded, adapters), batch)
        base = numpy_reference.logits(cfg, rounded, batch)
        ulp = bf16_ulp(np.abs(ref[valid]).max())
        assert np.abs(ref - base)[valid].max() > 4 * ulp  # the adapters move the logits: the check can fail
        got = {name: be.logits(model, batch) for name, (be, model) in models.items()}
        targets = shift_labels(batch.labels)
        nll = {name: token_nll(x, targets) for name, x in got.items()}
        ref_nll = token_nll(ref, targets)
        logits = {"torch-jax": np.abs(got["torch"] - got["jax"])[valid].max(),
                  **{f"{n}-ref": np.abs(x - ref)[valid].max() for n, x in got.items()}}
        losses = {"torch-jax": np.abs(nll["torch"] - nll["jax"]).max(),
                  **{f"{n}-ref": np.abs(x - ref_nll).max() for n, x in nll.items()}}
        print(f"bf16 base {variant} {layout}: ulp {ulp:.2e}; logits {logits}; token losses {losses}")
        assert max(logits.values()) <= tol("bfloat16", "logits_ulps") * ulp, (layout, logits)
        assert max(losses.values()) <= tol("bfloat16", "token_loss_ulps") * ulp, (layout, losses)


@pytest.mark.parametrize("variant", VARIANTS)
def test_bf16_base_adapter_gradients(variant, exact_fp32):
    cfg, peft, weights, _, adapters = _setup(variant)
    batch = parity_batches(cfg.vocab_size)["padding_free"]
    grads = {name: be.loss_and_grads(model, batch)[1] for name, (be, model) in _models(cfg, peft, weights, adapters).items()}
    assert set(grads["torch"]) == set(grads["jax"]) == set(adapters)
    rel = {k: rel_norm(grads["jax"][k], grads["torch"][k]) for k in adapters}
    worst = max(rel, key=rel.get)
    print(f"bf16 base {variant}: worst adapter grad rel {rel[worst]:.2e} ({worst})")
    assert rel[worst] <= tol("bfloat16", "grad_rel"), worst
