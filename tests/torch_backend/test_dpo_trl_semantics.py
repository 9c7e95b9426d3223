"""Every DPO loss type against TRL 1.16's own code in this process (``_trl_dpo``: a real ``DPOTrainer``'s
``_compute_loss`` on per-token log-probs chosen here, with precomputed reference log-probs).

Invariants:
- for each of TRL's 15 loss types, and a weighted list of all of them, the numpy reference's loss, and torch's and
  JAX's loss and gradients w.r.t. the per-token policy log-probs, equal TRL's within 1e-6; the reward metrics too;
- the comparison sees a change: twinseq's loss of another type, or of the same type with another parameter
  (AOT's label smoothing, DiscoPOP's temperature), does not agree.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jnp = pytest.importorskip("jax.numpy")

from twinseq.common.objectives.dpo import (  # noqa: E402
    DPO_LOSS_TYPES,
    dpo_loss,
    reward_metrics,
    validate_dpo_config,
)
from twinseq.jax_backend import dpo as jdpo  # noqa: E402
from twinseq.torch_backend import dpo as tdpo  # noqa: E402

N, T = 4, 6
TOL = 1e-6
SMOOTHING = {"exo_pair": 1e-3, "robust": 0.1, "aot": 0.1, "aot_unpaired": 0.1}


@pytest.fixture(scope="module")
def trl_dpo():
    pytest.importorskip("trl")
    from tests.torch_backend import _trl_dpo

    return _trl_dpo


def _inputs(seed: int = 1234):
    """Per-token policy log-probs (masked positions hold values too: they must be ignored), masks with
    completions of different lengths, and reference sequence log-probs near the policy's (both signs)."""
    rng = np.random.default_rng(seed)
    c, r = -rng.uniform(0.05, 3, (N, T)), -rng.uniform(0.05, 3, (N, T))
    cm, rm = (rng.uniform(size=(N, T)) < 0.8).astype(np.int64), (rng.uniform(size=(N, T)) < 0.8).astype(np.int64)
    cm[:, 0] = rm[:, 0] = 1
    ref_c, ref_r = (c * cm).sum(1) + rng.normal(0, 1, N), (r * rm).sum(1) + rng.normal(0, 1, N)
    return c, r, cm, rm, ref_c, ref_r


def _config(loss_type):
    types = list(DPO_LOSS_TYPES) if loss_type == "all" else [loss_type]
    weights = np.linspace(1.0, 0.1, len(types)).tolist() if loss_type == "all" else None
    smoothing = max(SMOOTHING.get(t, 0.0) for t in types)
    return dict(loss_type=types, loss_weights=weights, beta=0.1, label_smoothing=smoothing, discopop_tau=0.05)


def _torch(c, r, cm, rm, ref_c, ref_r, kw):
    lc, lr = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (c, r))
    mc, mr = torch.tensor(cm, dtype=torch.float64), torch.tensor(rm, dtype=torch.float64)
    losses, _, _ = tdpo.dpo_losses((lc * mc).sum(1), (lr * mr).sum(1), torch.tensor(ref_c), torch.tensor(ref_r),
                                   validate_dpo_config(**kw), chosen_num_tokens=mc.sum(1),
                                   rejected_num_tokens=mr.sum(1))
    loss = losses.mean()
    gc, gr = torch.autograd.grad(loss, (lc, lr), allow_unused=True)
    zeros = torch.zeros(N, T, dtype=torch.float64)
    return float(loss), (zeros if gc is None else gc).numpy(), (zeros if gr is None else gr).numpy()


def _jax(c, r, cm, rm, ref_c, ref_r, kw):
    import jax

    config = validate_dpo_config(**kw)
    with jax.enable_x64(True):
        mc, mr = jnp.asarray(cm, jnp.float64), jnp.asarray(rm, jnp.float64)

        def f(lc, lr):
            losses, _, _ = jdpo.dpo_losses((lc * mc).sum(1), (lr * mr).sum(1), jnp.asarray(ref_c), jnp.asarray(ref_r),
                                           config, chosen_num_tokens=mc.sum(1), rejected_num_tokens=mr.sum(1))
            return losses.mean()

        loss, (gc, gr) = jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(c), jnp.asarray(r))
        return float(loss), np.asarray(gc, np.float64), np.asarray(gr, np.float64)


@pytest.mark.parametrize(
    "loss_type",
    # the fast tier keeps sigmoid and the weighted list of all 15 (every type in one loss); each alone: make test-all
    [t if t in ("sigmoid", "all") else pytest.param(t, marks=pytest.mark.slow) for t in [*DPO_LOSS_TYPES, "all"]],
)
def test_loss_gradients_and_metrics_equal_trls(trl_dpo, loss_type):
    c, r, cm, rm, ref_c, ref_r = _inputs()
    kw = _config(loss_type)
    want, want_gc, want_gr, want_metrics = trl_dpo.trl_dpo_loss_and_grads(c, r, cm, rm, ref_c, ref_r, **kw)
    pc, pr = (c * cm).sum(1), (r * rm).sum(1)
    out = dpo_loss(pc, pr, ref_c, ref_r, chosen_num_tokens=cm.sum(1), rejected_num_tokens=rm.sum(1), **kw)
    assert abs(out.loss - want) <= TOL, (out.loss, want)
    metrics = reward_metrics(out.chosen_rewards, out.rejected_rewards)
    for key, value in metrics.items():
        assert abs(value - want_metrics[key]) <= TOL, key
    for run in (_torch, _jax):
        loss, gc, gr = run(c, r, cm, rm, ref_c, ref_r, kw)
        assert abs(loss - want) <= TOL, (run.__name__, loss, want)
        np.testing.assert_allclose(gc, want_gc, rtol=0, atol=TOL, err_msg=run.__name__)
        np.testing.assert_allclose(gr, want_gr, rtol=0, atol=TOL, err_msg=run.__name__)


CHANGES = [
    ("aot", dict(label_smoothing=0.0)),
    ("aot", dict(loss_type=["sigmoid"])),  # unsorted: the margins pair by pair
    ("aot_unpaired", dict(loss_type=["aot"])),
    ("discopop", dict(discopop_tau=0.5)),
    ("sft", dict(loss_type=["sigmoid"])),
    ("sigmoid_norm", dict(loss_type=["sigmoid"])),  # without the length normalisation
]


@pytest.mark.parametrize("loss_type, change", CHANGES)
def test_the_comparison_sees_a_change(trl_dpo, loss_type, change):
    """Negative controls: TRL with ``loss_type``, twinseq with one thing changed, must not agree."""
    c, r, cm, rm, ref_c, ref_r = _inputs()
    kw = _config(loss_type)
    want, want_gc, _, _ = trl_dpo.trl_dpo_loss_and_grads(c, r, cm, rm, ref_c, ref_r, **kw)
    loss, gc, _ = _torch(c, r, cm, rm, ref_c, ref_r, {**kw, **change})
    assert abs(loss - want) > 1e-4 or np.abs(gc - want_gc).max() > 1e-4
