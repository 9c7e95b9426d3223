"""GRPO's entropy bonus (``entropy_coef``, adaptive control) and ``steps_per_generation`` against TRL 1.16's own
``_compute_loss`` in this process (``_trl_grpo``), in the numpy reference, torch and JAX, gradients included.

Invariants:
- the loss is the policy loss minus ``entropy_coef`` times each micro-batch's token-mean entropy over the tokens the
  policy loss keeps, divided for gradient accumulation only; loss, d/d log-probs and d/d entropies equal TRL's
  within 1e-6 for every loss type family and with the high-entropy mask;
- adaptive control (``use_adaptive_entropy``): no bonus on the first step; the coefficient moves by delta at each
  optimizer step from the step's entropy over its bonus tokens, within its bounds; each step's loss and the
  coefficient sequence equal TRL's;
- one generation feeding k optimizer steps (``steps_per_generation = k x gradient_accumulation_steps``): each step's
  loss is normalised as TRL's (dapo: the generation's tokens per step), equal to TRL's step by step;
- the fused log-prob + entropy kernel's gradients equal the naive full-logits ones (soft-capped too);
- each comparison fails when one side's option is removed (the negative controls).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from twinseq.common.objectives.grpo_loss import EntropyControl, LossSpec, StepShare, grpo_loss  # noqa: E402
from twinseq.jax_backend import grpo as jgrpo  # noqa: E402
from twinseq.torch_backend import grpo as tgrpo  # noqa: E402
from twinseq.torch_backend.logprobs import FusedLinearLogpsEntropy  # noqa: E402

N, C = 4, 5
TOL = 1e-6


@pytest.fixture(scope="module")
def trl_grpo():
    pytest.importorskip("trl")
    from tests.torch_backend import _trl_grpo

    return _trl_grpo


def _inputs(seed: int = 0, n: int = N):
    rng = np.random.default_rng(seed)
    logps = -rng.uniform(0.2, 3.0, (n, C))
    lengths = rng.integers(1, C + 1, n)
    mask = (np.arange(C)[None, :] < lengths[:, None]).astype(np.float64)
    old = logps + rng.normal(0, 0.3, (n, C))
    ref = logps + rng.normal(0, 0.8, (n, C))
    adv = rng.normal(0, 1, n)
    entropy = rng.uniform(0.05, 3.0, (n, C))
    return logps, old, ref, adv, mask, entropy


def _share(mask, grad_accum: int, k: int, loss_type: str, coef: float, parts: int = 1) -> StepShare:
    """The ``StepShare`` the rollout gives micro-batch ``k`` of a ``grad_accum``-micro-batch step (``parts`` steps
    per generation: dapo's normaliser is the generation's tokens per step)."""
    n = mask.shape[0] // (grad_accum * parts)
    return StepShare(n * grad_accum, float(mask.sum()) / parts, grad_accum, coef)


def _ours(backend, logps, old, ref, adv, mask, entropy, spec: LossSpec, share: StepShare):
    """(loss, d/d logps, d/d entropy) of one micro-batch on ``backend`` (numpy: loss only)."""
    if backend == "numpy":
        out = grpo_loss(logps, adv, mask, old_logps_NC=old, ref_logps_NC=ref, loss_type=spec.loss_type,
                        epsilon=spec.epsilon, epsilon_high=spec.epsilon_high, beta=spec.beta,
                        max_completion_length=spec.max_completion_length,
                        top_entropy_quantile=spec.top_entropy_quantile, entropy_NC=entropy,
                        num_sequences_in_step=share.num_sequences_in_step, num_tokens_in_step=share.num_tokens_in_step,
                        num_micro_batches=share.num_micro_batches, entropy_coef=share.entropy_coef)
        return out.loss, None, None
    if backend == "torch":
        lp = torch.tensor(logps, requires_grad=True)
        ent = torch.tensor(entropy, requires_grad=True)
        loss, _ = tgrpo.grpo_loss_torch(lp, torch.tensor(adv), torch.tensor(mask), spec, share,
                                        old_logps_NC=torch.tensor(old), ref_logps_NC=torch.tensor(ref), entropy_NC=ent)
        loss.backward()
        return float(loss), lp.grad.numpy(), np.zeros_like(entropy) if ent.grad is None else ent.grad.numpy()
    with jax.enable_x64(True):
        norms = jnp.asarray(list(share), jnp.float64)

        def f(x, e):
            return jgrpo.grpo_loss_jax(x, jnp.asarray(adv), jnp.asarray(mask), norms, spec,
                                       old_logps_NC=jnp.asarray(old), ref_logps_NC=jnp.asarray(ref), entropy_NC=e)[0]

        loss, (g, ge) = jax.value_and_grad(f, argnums=(0, 1))(jnp.asarray(logps), jnp.asarray(entropy))
        return float(loss), np.asarray(g), np.asarray(ge)


def _run_ours(backend, logps, old, ref, adv, mask, entropy, spec, grad_accum, coefs, parts: int = 1):
    """Each optimizer step's loss, and the accumulated gradients, over ``grad_accum x parts`` micro-batches
    (``coefs``: each step's applied coefficient)."""
    splits = grad_accum * parts
    micro = logps.shape[0] // splits
    losses, g, ge = [], np.zeros_like(logps), np.zeros_like(logps)
    for k in range(splits):
        rows = slice(k * micro, (k + 1) * micro)
        share = _share(mask, grad_accum, k, spec.loss_type, coefs[k // grad_accum], parts)
        loss, gk, gek = _ours(backend, logps[rows], old[rows], ref[rows], adv[rows], mask[rows], entropy[rows], spec,
                              share)
        if k % grad_accum == 0:
            losses.append(0.0)
        losses[-1] += loss
        if gk is not None:
            g[rows], ge[rows] = gk, gek
    return losses, g, ge


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize(
    "loss_type,grad_accum,quantile", [("dapo", 1, 1.0), ("grpo", 2, 1.0), ("bnpo", 2, 1.0), ("dapo", 2, 0.55)]
)
def test_entropy_bonus_equals_trls(trl_grpo, backend, loss_type, grad_accum, quantile):
    logps, old, ref, adv, mask, entropy = _inputs(seed=1)
    coef = 0.3
    spec = LossSpec(loss_type, 0.2, 0.28, 0.04, C, top_entropy_quantile=quantile, entropy_bonus=True)
    got = {}
    want_loss, want_grad, metrics = trl_grpo.trl_loss_and_grad(
        logps, old, ref, adv, mask, loss_type=loss_type, beta=0.04, epsilon_high=0.28, max_completion_length=C,
        grad_accum=grad_accum, entropies_NC=entropy, top_entropy_quantile=quantile, entropy_coef=coef, out=got,
    )
    losses, g, ge = _run_ours(backend, logps, old, ref, adv, mask, entropy, spec, grad_accum, [coef])
    assert abs(losses[0] - want_loss) <= TOL
    assert np.abs(got["entropy_grad"]).max() > 1e-3  # the bonus has a gradient through the entropies
    if backend != "numpy":
        np.testing.assert_allclose(g, want_grad, rtol=0, atol=TOL)
        np.testing.assert_allclose(ge, got["entropy_grad"], rtol=0, atol=TOL)
    if grad_accum == 1:  # TRL's policy_loss is a per-micro-batch value; with one micro-batch it is the step's
        assert abs(metrics["policy_loss"] - (want_loss + coef * (entropy * mask).sum() / mask.sum())) <= TOL
    # negative control: no bonus on our side
    plain = LossSpec(loss_type, 0.2, 0.28, 0.04, C, top_entropy_quantile=quantile)
    losses, *_ = _run_ours(backend, logps, old, ref, adv, mask, entropy, plain, grad_accum, [0.0])
    assert abs(losses[0] - want_loss) > 1e-3


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_adaptive_entropy_control_equals_trls(trl_grpo, backend, grad_accum):
    """Four optimizer steps of one generation (``steps_per_generation = 4 x grad_accum``), the entropies low on some
    steps and high on others: each step's loss (and so the applied coefficient) and the coefficient after it equal
    TRL's. The first step applies none; the target sits between the steps' entropies."""
    steps, target = 4, 0.9
    n = 2 * grad_accum * steps
    logps, old, ref, adv, mask, entropy = _inputs(seed=5, n=n)
    rows_per_step = n // steps
    for s, scale in enumerate([0.2, 0.25, 2.0, 0.3]):  # step means below, below, above, below the target
        entropy[s * rows_per_step : (s + 1) * rows_per_step] *= scale
    options = dict(use_adaptive_entropy=True, entropy_coef=0.1, entropy_coef_delta=0.05, entropy_target=target,
                   entropy_coef_max=0.18)
    got = {}
    trl_grpo.trl_loss_and_grad(
        logps, old, ref, adv, mask, loss_type="dapo", beta=0.04, epsilon_high=0.28, max_completion_length=C,
        grad_accum=grad_accum, entropies_NC=entropy, steps_per_generation=steps * grad_accum, out=got, **options,
    )
    control = EntropyControl(0.1, adaptive=True, low=0.0, high=0.18, delta=0.05, target=target)
    spec = LossSpec("dapo", 0.2, 0.28, 0.04, C, entropy_bonus=True)
    coefs, applied = [], []
    for s in range(steps):
        rows = slice(s * rows_per_step, (s + 1) * rows_per_step)
        applied.append(control.applied())
        control.update(float((entropy[rows] * mask[rows]).sum()), float(mask[rows].sum()))
        coefs.append(control.coef)
    assert applied[0] == 0.0 and len(set(applied)) > 2  # none first; then more than one coefficient
    np.testing.assert_allclose(coefs, got["entropy_coef"], rtol=0, atol=1e-12)
    losses, g, ge = _run_ours(backend, logps, old, ref, adv, mask, entropy, spec, grad_accum, applied, parts=steps)
    np.testing.assert_allclose(losses, got["step_losses"], rtol=0, atol=TOL)
    # negative control: a constant coefficient is not TRL's adaptive run
    losses, *_ = _run_ours(backend, logps, old, ref, adv, mask, entropy, spec, grad_accum, [0.1] * steps, parts=steps)
    assert np.abs(np.subtract(losses, got["step_losses"])).max() > 1e-3


@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo", "luspo"])
def test_steps_per_generation_normalises_each_step_as_trl(trl_grpo, backend, loss_type):
    """One generation of 8 completions, 2 micro-batches per step, 2 steps (``steps_per_generation=4``): each step's
    loss and the gradients equal TRL's. The negative control normalises dapo by each step's own tokens."""
    logps, old, ref, adv, mask, entropy = _inputs(seed=9, n=8)
    got = {}
    _, want_grad, _ = trl_grpo.trl_loss_and_grad(
        logps, old, ref, adv, mask, loss_type=loss_type, beta=0.04, epsilon_high=0.28, max_completion_length=C,
        grad_accum=2, steps_per_generation=4, out=got,
    )
    spec = LossSpec(loss_type, 0.2, 0.28, 0.04, C)
    losses, g, _ = _run_ours(backend, logps, old, ref, adv, mask, entropy, spec, 2, [0.0, 0.0], parts=2)
    np.testing.assert_allclose(losses, got["step_losses"], rtol=0, atol=TOL)
    if backend != "numpy":
        np.testing.assert_allclose(g, want_grad, rtol=0, atol=TOL)
    if loss_type == "dapo":
        own = [
            grpo_loss(logps[s], adv[s], mask[s], old_logps_NC=old[s], ref_logps_NC=ref[s], beta=0.04,
                      epsilon_high=0.28).loss
            for s in (slice(0, 4), slice(4, 8))
        ]
        assert np.abs(np.subtract(own, got["step_losses"])).max() > 1e-3


@pytest.mark.parametrize("cap", [None, 3.0])
def test_fused_logps_entropy_gradients_equal_the_full_logits(cap):
    torch.manual_seed(0)
    n, h_dim, vocab = 9, 6, 13
    h = torch.randn(n, h_dim, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, h_dim, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, vocab, (n,))
    g_lp, g_ent = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    lp, ent = FusedLinearLogpsEntropy.apply(h, w, t, 4, cap)
    (lp * g_lp + ent * g_ent).sum().backward()
    fused = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    z = h @ w.T
    z = z if cap is None else cap * torch.tanh(z / cap)
    logp = torch.log_softmax(z, -1)
    lp2, ent2 = logp[torch.arange(n), t], -(logp.exp() * logp).sum(-1)
    (lp2 * g_lp + ent2 * g_ent).sum().backward()
    assert torch.allclose(lp, lp2, atol=1e-12) and torch.allclose(ent, ent2, atol=1e-12)
    assert torch.allclose(fused[0], h.grad, atol=1e-12) and torch.allclose(fused[1], w.grad, atol=1e-12)
    # negative control: the entropy's gradient matters (dropping it changes the hidden-state gradient)
    h.grad = None
    lp3, _ = FusedLinearLogpsEntropy.apply(h, w, t, 4, cap)
    (lp3 * g_lp).sum().backward()
    assert (h.grad - fused[0]).abs().max() > 1e-3


@pytest.mark.parametrize("cap", [None, 3.0])
def test_jax_chunked_entropy_gradient_equals_the_full_logits(cap):
    rng = np.random.default_rng(0)
    h, w = rng.normal(size=(9, 6)), rng.normal(size=(13, 6))
    g_ent = rng.normal(size=9)
    with jax.enable_x64(True):

        def naive(h, w):
            z = h @ w.T
            z = z if cap is None else cap * jnp.tanh(z / cap)
            logp = jax.nn.log_softmax(z, -1)
            return (-(jnp.exp(logp) * logp).sum(-1) * g_ent).sum()

        def chunked(h, w, grad=True):
            return (jgrpo.chunked_entropy(h, w, 4, cap, grad=grad) * g_ent).sum()

        args = (jnp.asarray(h), jnp.asarray(w))
        want = jax.grad(naive, argnums=(0, 1))(*args)
        got = jax.grad(chunked, argnums=(0, 1))(*args)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5)
        assert np.abs(np.asarray(want[0])).max() > 1e-2
        # negative control: the metric's entropy (grad=False) is a constant
        assert np.abs(np.asarray(jax.grad(lambda h, w: chunked(h, w, grad=False))(*args))).max() == 0.0
