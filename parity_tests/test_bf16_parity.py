"""bfloat16 parity: torch and jax models in bfloat16 (parameters and compute, as HF ``dtype``).

Bounds come from the bfloat16 table of ``tolerances.py`` (see TOLERANCES.md): logits and
per-token losses in bfloat16 ulps at the largest reference logit, gradients in unit
roundoffs. The reference is the float64 numpy model on the same bfloat16-rounded weights.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.inputs import LAYOUTS, rel_norm, valid_positions
from parity_tests.tolerances import bf16_ulp, tol
from twinseq.common.objectives.nll import shift_labels, token_nll

pytest.importorskip("torch")
pytest.importorskip("jax")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bf16_logits_and_token_losses(harness_bf16, layout):
    h = harness_bf16
    batch = h.batches[layout]
    valid = valid_positions(batch)
    ref_BTV = h.reference_logits(layout, weights_dtype="bfloat16")
    ulp = bf16_ulp(np.abs(ref_BTV[valid]).max())
    (jax_BTV, jax_BT), (torch_BTV, torch_BT) = h.jax_forward(layout), h.torch_forward(layout)
    ref_BT = token_nll(ref_BTV, shift_labels(batch.labels))
    logits = {"torch-jax": np.abs(torch_BTV - jax_BTV)[valid].max(), "jax-ref": np.abs(jax_BTV - ref_BTV)[valid].max(),
              "torch-ref": np.abs(torch_BTV - ref_BTV)[valid].max()}
    losses = {"torch-jax": np.abs(torch_BT - jax_BT).max(), "jax-ref": np.abs(jax_BT - ref_BT).max(),
              "torch-ref": np.abs(torch_BT - ref_BT).max()}
    print(f"bf16 {layout}: ulp {ulp:.2e}; logits {logits}; token losses {losses}")
    assert np.isfinite(jax_BTV).all()
    assert max(logits.values()) <= tol("bfloat16", "logits_ulps") * ulp, logits
    assert max(losses.values()) <= tol("bfloat16", "token_loss_ulps") * ulp, losses


def test_bf16_gradients(harness_bf16):
    h = harness_bf16
    _, jax_grads, _ = h.jax_grads("padding_free", "nll")
    _, torch_grads, _ = h.torch_grads("padding_free", "nll")
    rel = {k: rel_norm(jax_grads[k], torch_grads[k]) for k in torch_grads}
    worst = max(rel, key=rel.get)
    print(f"bf16 worst grad rel {rel[worst]:.2e} ({worst})")
    assert rel[worst] <= tol("bfloat16", "grad_rel"), worst
