"""Torch and JAX agree on every model family, from the same checkpoint saved by transformers.

For each case of ``parity_tests.families`` (Llama 3.x and the other RoPE types, Llama with
biases, Qwen2 with and without sliding layers, Qwen3, Qwen3-MoE, Mistral, Mixtral, Gemma 2, Gemma 3), on a padded and a
packed batch of the same documents (one longer than the sliding window):

- logits agree within ``logits_abs``; per-token NLL within ``token_loss_abs`` once the part of the NLL
  difference that the logits difference explains is removed (``nll_change_from_logits``); the step loss within
  ``loss_rel`` and every gradient tensor within ``grad_rel`` (the float32 table of TOLERANCES.md,
  the same bounds as the Llama preset: no family gets a looser one);
- a checkpoint goes torch -> jax -> torch bit for bit;
- Qwen3-MoE and Mixtral with ``output_router_logits``: the loss with the load-balancing term and its gradients agree.

Each backend is also compared with transformers' own forward (tests/torch_backend/test_families.py,
parity_tests/test_jax_families_vs_hf.py); this file closes the triangle.
"""

from __future__ import annotations

import numpy as np
import pytest

from parity_tests.families import FAMILIES, FAMILY_CASES, family_batches, hf_random_checkpoint
from parity_tests.inputs import rel_norm
from parity_tests.tolerances import nll_change_from_logits, tol
from twinseq.common.objectives.nll import shift_labels

torch = pytest.importorskip("torch")
pytest.importorskip("jax")

LAYOUTS = ("padded", "packed")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: hf_random_checkpoint(name, tmp_path_factory.mktemp(name), seed=7) for name in FAMILIES}


def _token_nll(logits_BTV: np.ndarray, labels_BT: np.ndarray) -> np.ndarray:
    import torch.nn.functional as F

    targets_BT = torch.from_numpy(shift_labels(labels_BT)).long()
    return F.cross_entropy(torch.from_numpy(logits_BTV).flatten(0, 1), targets_BT.flatten(), ignore_index=-100,
                           reduction="none").reshape(targets_BT.shape).numpy()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", FAMILIES)
def test_torch_and_jax_agree(name, layout, checkpoints, exact_fp32):
    import twinseq.jax_backend as jb
    import twinseq.torch_backend as tb

    tmodel, jmodel = tb.load_pretrained(checkpoints[name]), jb.load_pretrained(checkpoints[name])
    batch = family_batches()[layout]
    valid = batch.segment_ids != 0
    t_logits, j_logits = tb.logits(tmodel, batch), jb.logits(jmodel, batch)
    logits_diff = float(np.abs(t_logits - j_logits)[valid].max())
    t_nll, j_nll = _token_nll(t_logits, batch.labels), np.asarray(jb.token_losses(jmodel, batch))
    raw_token_diff = float(np.abs(j_nll - t_nll).max())
    # the loss arithmetic's own difference: the NLL difference less what the logits difference explains
    explained = nll_change_from_logits(j_logits, t_logits, shift_labels(batch.labels))
    token_diff = float(np.abs(j_nll.astype(np.float64) - t_nll - explained).max())
    t_loss, t_grads = tb.loss_and_grads(tmodel, batch)
    j_loss, j_grads = jb.loss_and_grads(jmodel, batch)
    assert set(t_grads) == set(j_grads)
    grad_rel = {k: rel_norm(j_grads[k], t_grads[k]) for k in t_grads}
    worst = max(grad_rel, key=grad_rel.get)
    loss_rel = abs(j_loss - t_loss) / abs(t_loss)
    print(f"{name} {layout}: logits {logits_diff:.1e}, token nll {raw_token_diff:.1e} ({token_diff:.1e} less the "
          f"logits' part), loss rel {loss_rel:.1e}, "
          f"grad rel {grad_rel[worst]:.1e} ({worst})")
    assert logits_diff <= tol("float32", "logits_abs")
    assert token_diff <= tol("float32", "token_loss_abs")
    assert loss_rel <= tol("float32", "loss_rel")
    assert grad_rel[worst] <= tol("float32", "grad_rel"), worst


@pytest.mark.parametrize("name", FAMILIES)
def test_checkpoint_round_trip_torch_jax_torch_is_bitwise(name, checkpoints, tmp_path):
    import twinseq.jax_backend as jb
    import twinseq.torch_backend as tb
    from twinseq.common.models.hf_folder import read_hf_checkpoint

    cfg, original = read_hf_checkpoint(checkpoints[name])
    assert cfg == FAMILY_CASES[name]
    tb.save_pretrained(tb.load_pretrained(checkpoints[name]), tmp_path / "torch")
    jb.save_pretrained(jb.load_pretrained(tmp_path / "torch"), tmp_path / "jax")
    back = tb.export_weights(tb.load_pretrained(tmp_path / "jax"))
    assert read_hf_checkpoint(tmp_path / "jax")[0] == cfg
    assert set(back) == set(original)
    for key, value in original.items():
        assert back[key].tobytes() == value.tobytes(), key


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_loss_with_router_aux_loss_agrees(name, layout, checkpoints):
    """Qwen3-MoE, Mixtral and gpt-oss with ``output_router_logits``: both backends add ``router_aux_loss_coef * aux_loss``
    (over the real tokens) to the NLL, and the loss and every gradient (the router's included, which the aux loss
    moves) agree within ``loss_rel`` / ``grad_rel``; the control: the aux loss moves the router's gradient."""
    import dataclasses

    import twinseq.jax_backend as jb
    import twinseq.torch_backend as tb
    from twinseq.common.models.hf_folder import read_hf_checkpoint

    cfg, weights = read_hf_checkpoint(checkpoints[name])
    batch = family_batches()[layout]
    aux = dataclasses.replace(cfg, output_router_logits=True)
    t_loss, t_grads = tb.loss_and_grads(tb.build_model(aux, weights), batch)
    j_loss, j_grads = jb.loss_and_grads(jb.build_model(aux, weights), batch)
    grad_rel = {k: rel_norm(j_grads[k], t_grads[k]) for k in t_grads}
    worst = max(grad_rel, key=grad_rel.get)
    print(f"{name} {layout} with aux: loss {t_loss:.7f} / {j_loss:.7f}, grad rel {grad_rel[worst]:.1e} ({worst})")
    assert abs(j_loss - t_loss) <= tol("float32", "loss_rel") * abs(t_loss)
    assert grad_rel[worst] <= tol("float32", "grad_rel"), worst
    _, plain = jb.loss_and_grads(jb.build_model(cfg, weights), batch)
    router = "model.layers.1.mlp.router.weight" if name == "gpt_oss" else "model.layers.1.mlp.gate.weight"
    assert rel_norm(plain[router], j_grads[router]) > 1e-3
