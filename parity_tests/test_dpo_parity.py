"""DPO parity: torch vs jax vs the numpy reference, on the same weights and the same pairs.

Inputs: the tiny preset from ``init_weights(seed=0)`` and four preference pairs (prompts of
3-8 tokens, completions of 2-10), collated padded ([8, T], one document per row) and
padding-free ([1, T], eight documents). The reference log-probs are the float64 reference
model's own sequence log-probs shifted by fixed offsets of both signs (``REF_OFFSETS``), so every log-ratio is
non-zero and every loss type is away from its symmetric point (at ``ref == policy`` the
sigmoid loss is exactly log 2 in every implementation, a test that cannot fail).

Invariants (float32; bounds from ``parity_tests/tolerances.py``):

- loss arithmetic: each backend's loss family, given the reference's sequence log-probs
  (rounded to float32), equals ``common.objectives.dpo.dpo_loss`` within ``loss_rel`` (1e-6), for every
  loss type at two betas and for weighted combinations;
- end to end (forward, chunked log-probs, loss): within ``loss_rel`` of the float64 reference
  at TRL's default ``beta = 0.1``. Error budget: a sequence log-prob of k tokens (|logp| up to
  ~90 here) carries k per-token errors of <= 1 ulp at ~9 (``token_loss_abs``) plus the float32
  rounding of partial sums (ulp 7.6e-6 above 64): ~5e-6 typical. The loss moves by
  ``Σ_d |∂L/∂logp_d| δ_d``, which at beta = 0.1 is a relative 1e-7 to 1e-6 (largest for
  'sppo_hard', whose loss grows with ``1/(2β)``). The margin is thin by construction; at
  larger beta (or longer completions) float32 itself cannot resolve the log-probs to 1e-6 of
  the loss, and only the arithmetic test above applies;
- gradients: torch vs jax within ``grad_rel`` (1e-5) per tensor, padded and padding-free;
- padding-free equals padded within ``grad_rel``, loss and gradients, in each backend.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from parity_tests.inputs import rel_norm
from parity_tests.tolerances import TOLERANCES
from twinseq.common.objectives.dpo import DPO_LOSS_TYPES, dpo_loss, validate_dpo_config
from twinseq.common.data.preference_batching import collate_preference, sequence_logps_from_logits

TOL = TOLERANCES["float32"]
LAYOUTS = ("padded", "padding_free")
LENGTHS = ((5, 7, 4), (3, 9, 6), (8, 2, 5), (4, 5, 10))   # (prompt, chosen, rejected) tokens per pair
# reference = policy + these: log-ratios c = -offset of both signs, so chosen wins some pairs and loses others
REF_OFFSETS = np.array([[0.8, -0.6, 1.1, -0.4], [-0.7, 0.9, -1.2, 0.5]])
SMOOTHED = ("robust", "exo_pair")  # need 0 < label_smoothing < 0.5

CONFIGS = {
    "trl_default": dict(loss_type=["sigmoid"], beta=0.1),
    "all_types": dict(loss_type=list(DPO_LOSS_TYPES), loss_weights=np.linspace(1.0, 0.1, len(DPO_LOSS_TYPES)).tolist(),
                    beta=0.1, label_smoothing=0.1),
}


def preference_examples(vocab_size: int, seed: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_input_ids": rng.integers(3, vocab_size, p).tolist(),
             "chosen_input_ids": rng.integers(3, vocab_size, c).tolist(),
             "rejected_input_ids": rng.integers(3, vocab_size, r).tolist()} for p, c, r in LENGTHS]


class DPOHarness:
    """Memoised DPO outputs of torch, jax and the float64 numpy reference."""

    def __init__(self, harness) -> None:
        self.h = harness
        examples = preference_examples(harness.cfg.vocab_size)
        self.pbatches = {"padded": collate_preference(examples),
                         "padding_free": collate_preference(examples, padding_free=True, pad_to_multiple_of=8)}
        self.policy_c, self.policy_r = self.reference_logps("padded")
        self.ref_c, self.ref_r = self.policy_c + REF_OFFSETS[0], self.policy_r + REF_OFFSETS[1]

    @functools.lru_cache(maxsize=None)
    def reference_logps(self, layout: str) -> tuple[np.ndarray, np.ndarray]:
        from parity_tests import numpy_reference

        pb = self.pbatches[layout]
        return sequence_logps_from_logits(numpy_reference.logits(self.h.cfg, self.h.weights, pb.batch), pb)

    def numpy_loss(self, name: str, chosen=None, rejected=None) -> float:
        pb = self.pbatches["padded"]
        return dpo_loss(self.policy_c if chosen is None else chosen, self.policy_r if rejected is None else rejected,
                        self.ref_c, self.ref_r, chosen_num_tokens=pb.chosen_num_tokens,
                        rejected_num_tokens=pb.rejected_num_tokens, **CONFIGS[name]).loss

    @functools.lru_cache(maxsize=None)
    def run(self, backend: str, layout: str, name: str, kernel: str = "fused_linear"):
        """(loss, grads, per-pair outputs) of one backend."""
        if backend == "torch":
            from twinseq.torch_backend.dpo import dpo_loss_and_grads
            model = self.h.torch_model
        else:
            from twinseq.jax_backend.dpo import dpo_loss_and_grads
            model = self.h.jax_model
        config = validate_dpo_config(**CONFIGS[name])
        return dpo_loss_and_grads(model, self.pbatches[layout], config, ref_chosen_logps=self.ref_c,
                                  ref_rejected_logps=self.ref_r, loss_type=kernel, chunk_size=8)


@pytest.fixture(scope="module")
def dpo(harness) -> DPOHarness:
    return DPOHarness(harness)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_layouts_hold_the_same_documents(dpo):
    padded, free = dpo.pbatches["padded"], dpo.pbatches["padding_free"]
    assert padded.batch.shape[0] == 8 and free.batch.shape[0] == 1
    assert (padded.num_target_tokens == free.num_target_tokens).all()
    np.testing.assert_allclose(dpo.reference_logps("padding_free"), dpo.reference_logps("padded"), rtol=0, atol=1e-9)
    # every log-ratio is O(1), and chosen beats rejected in some pairs only
    margins = (dpo.policy_c - dpo.ref_c) - (dpo.policy_r - dpo.ref_r)
    assert (margins > 0).any() and (margins < 0).any() and np.abs(margins).min() > 0.5


@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES + ("combined",))
def test_loss_arithmetic_matches_numpy_reference(dpo, loss_type, beta):
    """Both backends' loss family on the reference's float32-rounded log-probs, vs float64 numpy."""
    import jax.numpy as jnp
    import torch

    from twinseq.jax_backend.dpo import dpo_losses as jax_losses
    from twinseq.torch_backend.dpo import dpo_losses as torch_losses

    types = list(DPO_LOSS_TYPES) if loss_type == "combined" else [loss_type]
    kwargs = dict(loss_type=types, beta=beta, label_smoothing=0.1 if set(types) & set(SMOOTHED) else 0.0,
                  loss_weights=np.linspace(1.0, 0.1, len(types)).tolist())
    config = validate_dpo_config(**kwargs)
    pb = dpo.pbatches["padded"]
    f32 = [np.asarray(a, np.float32) for a in (dpo.policy_c, dpo.policy_r, dpo.ref_c, dpo.ref_r)]
    counts = [np.asarray(pb.chosen_num_tokens, np.float32), np.asarray(pb.rejected_num_tokens, np.float32)]
    expected = dpo_loss(*[a.astype(np.float64) for a in f32], chosen_num_tokens=pb.chosen_num_tokens,
                        rejected_num_tokens=pb.rejected_num_tokens, **kwargs)
    t_losses, t_cr, t_rr = torch_losses(*map(torch.from_numpy, f32), config, chosen_num_tokens=torch.from_numpy(
        counts[0]), rejected_num_tokens=torch.from_numpy(counts[1]))
    j_losses, j_cr, j_rr = jax_losses(*map(jnp.asarray, f32), config, chosen_num_tokens=jnp.asarray(counts[0]),
                                      rejected_num_tokens=jnp.asarray(counts[1]))
    for losses, cr, rr in ((t_losses.numpy(), t_cr.numpy(), t_rr.numpy()), tuple(map(np.asarray,
                                                                                    (j_losses, j_cr, j_rr)))):
        assert _rel(float(np.mean(losses, dtype=np.float64)), expected.loss) <= TOL["loss_rel"]
        np.testing.assert_allclose(losses, expected.losses, rtol=TOL["loss_rel"], atol=0)
        np.testing.assert_allclose(cr, expected.chosen_rewards, rtol=TOL["loss_rel"], atol=1e-7)
        np.testing.assert_allclose(rr, expected.rejected_rewards, rtol=TOL["loss_rel"], atol=1e-7)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_end_to_end_loss_matches_numpy_reference(dpo, backend, name, layout):
    loss, _, per_pair = dpo.run(backend, layout, name)
    expected = dpo.numpy_loss(name)
    assert _rel(loss, expected) <= TOL["loss_rel"], (backend, name, layout, loss, expected)
    # the per-pair rewards are TRL's β c and β r of the same log-probs; c is a difference of two
    # float32 numbers of magnitude |ref|, so it is exact to one spacing there (ref rounded, then c rounded)
    beta = CONFIGS[name]["beta"]
    for side, ref in (("chosen", dpo.ref_c), ("rejected", dpo.ref_r)):
        atol = beta * float(np.spacing(np.float32(np.abs(ref).max())))
        np.testing.assert_allclose(per_pair[f"{side}_rewards"], beta * (per_pair[f"{side}_logps"] - ref), rtol=0,
                                   atol=atol)


# The full-logits kernel on one configuration: the loss math does not depend on the kernel.
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name,kernel", [("trl_default", "fused_linear"), ("all_types", "fused_linear"),
                                         ("trl_default", "nll")])
def test_torch_and_jax_gradients_agree(dpo, name, kernel, layout):
    t_loss, t_grads, t_pairs = dpo.run("torch", layout, name, kernel)
    j_loss, j_grads, j_pairs = dpo.run("jax", layout, name, kernel)
    assert _rel(j_loss, t_loss) <= TOL["loss_rel"]
    assert list(t_grads) == list(j_grads)
    worst = max((rel_norm(j_grads[k], t_grads[k]), k) for k in t_grads)
    assert worst[0] <= TOL["grad_rel"], worst
    # the gradient is not trivially zero: the DPO loss really moves the weights
    assert all(np.linalg.norm(g) > 0 for g in t_grads.values())


@pytest.mark.parametrize("backend", ["torch", "jax"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_padding_free_equals_padded(dpo, backend, name):
    p_loss, p_grads, p_pairs = dpo.run(backend, "padded", name)
    f_loss, f_grads, f_pairs = dpo.run(backend, "padding_free", name)
    assert _rel(f_loss, p_loss) <= TOL["grad_rel"]
    for key in ("chosen_logps", "rejected_logps"):
        np.testing.assert_allclose(f_pairs[key], p_pairs[key], rtol=TOL["grad_rel"], atol=0)
    worst = max((rel_norm(f_grads[k], p_grads[k]), k) for k in p_grads)
    assert worst[0] <= TOL["grad_rel"], worst
