"""GRPO parity: one GRPO loss and gradient, torch vs jax vs the numpy reference, from identical weights and
identical completions.

Inputs: the tiny preset from ``init_weights(seed=0)``, four prompts of 2-7 tokens with completions of 1-5
tokens (``max_completion_length`` 5), collated padded (one document per row) and padding-free (one row), and
fixed advantages of both signs. The sampling policy's log-probs are the float64 reference model's own, shifted
by fixed offsets of both signs (``OLD_OFFSETS``, so both clips fire on some tokens and the ratio is away from 1),
the reference model's by ``REF_OFFSETS`` (so the KL term is non-zero); sampling temperature 0.7.

Invariants (float32; bounds from ``parity_tests/tolerances.py``):

- loss arithmetic: each backend's loss family, given the reference's token log-probs rounded to float32,
  equals ``common.objectives.grpo_loss.grpo_loss`` within ``loss_rel`` (1e-6), for every ``grpo_loss_type``;
- end to end (forward, chunked completion log-probs, loss): torch and jax within ``loss_rel`` of each other,
  padded and padding-free, for every loss type, relative to the size of the loss's terms (``_loss_scale``: the
  loss with ``|A|``). Error budget: each token log-prob carries ~1 ulp at ~9 (``token_loss_abs``); the loss is a
  weighted mean of per-token terms ``-ρ A`` with ``|A| ~ 1`` and ``ρ = exp(logp - old)``, so a per-token error
  ``δ`` moves the loss by at most ``max |δ| · mean ρ |A|``, and in practice (errors of both signs) ~1e-7 of
  ``mean ρ |A|``. Relative to the loss itself the same error is 10x larger, because the advantages' signs
  cancel the terms down to a loss of 0.08;
- gradients: torch vs jax within ``grad_rel`` (1e-5) per tensor.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from parity_tests.tolerances import TOLERANCES
from twinseq.common.objectives.grpo import collate_completions
from twinseq.common.objectives.grpo_loss import LOSS_FAMILY, grpo_loss

TOL = TOLERANCES["float32"]
LAYOUTS = ("padded", "padding_free")
PROMPTS = (4, 2, 7, 3)
COMPLETIONS = (3, 5, 1, 4)
C = 5
TEMPERATURE = 0.7
ADVANTAGES = np.array([1.2, -0.8, 0.5, -0.9], np.float32)
OLD_OFFSETS = np.array([0.3, -0.25, 0.05, -0.4, 0.2], np.float32)   # per column: ratio exp(-offset)
REF_OFFSETS = np.array([-0.5, 0.4, 0.3, -0.2, 0.6], np.float32)
SPEC = dict(epsilon=0.2, epsilon_high=0.28, beta=0.04, max_completion_length=C)


def _spec(loss_type: str) -> dict:
    """``SPEC`` for ``loss_type``: RLOO's loss has no KL term (its KL is a reward penalty), so beta 0."""
    return {**SPEC, "beta": 0.0} if loss_type == "rloo" else SPEC


def _documents(vocab_size: int):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, vocab_size, n).tolist() for n in PROMPTS]
    completions = [rng.integers(3, vocab_size, n).tolist() for n in COMPLETIONS]
    return prompts, completions


class GRPOHarness:
    """Memoised GRPO outputs of torch, jax and the float64 numpy reference."""

    def __init__(self, harness) -> None:
        self.h = harness
        prompts, completions = _documents(harness.cfg.vocab_size)
        self.cbs = {"padded": collate_completions(prompts, completions, num_columns=C),
                    "padding_free": collate_completions(prompts, completions, padding_free=True, num_columns=C,
                                                        pad_to_multiple_of=8)}
        self.mask = (np.arange(C)[None, :] < np.array(COMPLETIONS)[:, None]).astype(np.float32)
        policy = self.reference_logps()
        self.old = ((policy + OLD_OFFSETS[None, :]) * self.mask).astype(np.float32)
        self.ref = ((policy + REF_OFFSETS[None, :]) * self.mask).astype(np.float32)

    @functools.lru_cache(maxsize=None)
    def reference_logps(self) -> np.ndarray:
        """float64 [N, C]: log_softmax(logits / T) of the float64 numpy model at each completion token."""
        from parity_tests import numpy_reference

        cb = self.cbs["padded"]
        logits_BTV = numpy_reference.logits(self.h.cfg, self.h.weights, cb.batch) / TEMPERATURE
        top = logits_BTV.max(-1, keepdims=True)
        logp_BTV = logits_BTV - top - np.log(np.exp(logits_BTV - top).sum(-1, keepdims=True))
        flat = np.flatnonzero(cb.target_doc_ids.reshape(-1) >= 0)
        b_idx, t_idx = np.unravel_index(flat, cb.target_doc_ids.shape)
        out = np.zeros((cb.num_docs, C))
        out[cb.token_row_n, cb.token_col_n] = logp_BTV[b_idx, t_idx, cb.batch.input_ids[b_idx, t_idx + 1]]
        return out

    @functools.lru_cache(maxsize=None)
    def run(self, backend: str, layout: str, loss_type: str, kernel: str = "fused_linear", entropy_coef: float = 0.0):
        """(loss, grads by HF name) of one GRPO micro-batch (the whole step); ``entropy_coef``: with the entropy
        bonus (its gradient through the entropy)."""
        cb = self.cbs[layout]
        if backend == "jax":
            from twinseq.jax_backend import grpo as jgrpo

            spec = jgrpo.LossSpec(loss_type=loss_type, entropy_bonus=entropy_coef != 0, **_spec(loss_type))
            loss, grads, _ = jgrpo.grpo_loss_and_grads(self.h.jax_model, cb, self.mask, ADVANTAGES, spec,
                                                       old_logps_NC=self.old, ref_logps_NC=self.ref,
                                                       loss_type=kernel, chunk_size=8, temperature=TEMPERATURE,
                                                       entropy_coef=entropy_coef)
            return loss, grads
        return self._torch(cb, loss_type, kernel, entropy_coef)

    def _torch(self, cb, loss_type: str, kernel: str, entropy_coef: float = 0.0):
        import torch

        from twinseq.common.models.init import parameter_shapes
        from twinseq.torch_backend import grpo as tgrpo

        model = self.h.torch_model
        spec = tgrpo.LossSpec(loss_type=loss_type, entropy_bonus=entropy_coef != 0, **_spec(loss_type))
        model.zero_grad(set_to_none=True)
        logps, entropy = tgrpo.completion_logps(model, cb, loss_type=kernel, chunk_size=8, temperature=TEMPERATURE,
                                                with_entropy=True, entropy_grad=spec.entropy_bonus)
        loss, _ = tgrpo.grpo_loss_torch(logps.float(), torch.from_numpy(ADVANTAGES), torch.from_numpy(self.mask),
                                        spec, tgrpo.StepShare(entropy_coef=entropy_coef),
                                        old_logps_NC=torch.from_numpy(self.old),
                                        ref_logps_NC=torch.from_numpy(self.ref), entropy_NC=entropy)
        loss.backward()
        params = dict(model.named_parameters())
        grads = {name: params[name].grad.detach().float().numpy().copy() for name in parameter_shapes(self.h.cfg)}
        model.zero_grad(set_to_none=True)
        return float(loss.detach()), grads


@pytest.fixture(scope="module")
def grpo(harness) -> GRPOHarness:
    pytest.importorskip("twinseq.torch_backend.grpo", reason="the torch GRPO trainer (branch grpo) is not merged")
    return GRPOHarness(harness)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@functools.lru_cache(maxsize=None)
def _loss_scale(grpo: GRPOHarness, loss_type: str) -> float:
    """The size of the loss's terms: the float64 reference loss with ``|A|`` for ``A``.

    The GRPO loss is a weighted mean of ``-ρ A`` terms with advantages of both signs, which cancel (the
    loss is 0.08 where the terms are ~1). A per-token log-prob error ``δ`` moves it by at most
    ``max |δ| · mean ρ |A|``, so its float32 error is relative to this, not to the cancelled sum: the forward
    error of a sum is bounded relative to the sum of its terms' magnitudes.
    """
    if loss_type == "rloo":
        # one term per completion, rho_i |A_i| with rho_i the exp of a sum over its n_i tokens: a per-token error
        # delta moves it by rho_i |A_i| (delta_1 + ... + delta_n), so its size is rho_i |A_i| n_i
        n = grpo.mask.sum(-1)
        rho = np.exp(((grpo.reference_logps() - grpo.old) * grpo.mask).sum(-1))
        return float(np.mean(rho * np.abs(ADVANTAGES) * n))
    out = grpo_loss(grpo.reference_logps(), np.abs(ADVANTAGES), grpo.mask, old_logps_NC=grpo.old,
                    ref_logps_NC=grpo.ref, loss_type=loss_type, **_spec(loss_type))
    return abs(float(out.loss))


def test_inputs_exercise_both_clips_and_the_kl(grpo):
    out = grpo_loss(grpo.reference_logps(), ADVANTAGES, grpo.mask, old_logps_NC=grpo.old, ref_logps_NC=grpo.ref,
                    loss_type="dapo", **SPEC)
    assert out.metrics["clip_ratio/low_mean"] > 0 and out.metrics["clip_ratio/high_mean"] > 0
    assert out.metrics["kl"] > 1e-3 and abs(out.loss) > 1e-2


@pytest.mark.parametrize("loss_type", LOSS_FAMILY)
def test_loss_arithmetic_matches_numpy_reference(grpo, loss_type):
    """Both backends' loss family on the reference's float32-rounded log-probs, vs float64 numpy."""
    import jax.numpy as jnp
    import torch

    from twinseq.jax_backend import grpo as jgrpo
    from twinseq.torch_backend import grpo as tgrpo

    logps32 = grpo.reference_logps().astype(np.float32)
    expected = grpo_loss(logps32.astype(np.float64), ADVANTAGES, grpo.mask, old_logps_NC=grpo.old,
                         ref_logps_NC=grpo.ref, loss_type=loss_type, **_spec(loss_type))
    t_spec = tgrpo.LossSpec(loss_type=loss_type, **_spec(loss_type))
    t_loss, t_metrics = tgrpo.grpo_loss_torch(torch.from_numpy(logps32), torch.from_numpy(ADVANTAGES),
                                              torch.from_numpy(grpo.mask), t_spec,
                                              old_logps_NC=torch.from_numpy(grpo.old),
                                              ref_logps_NC=torch.from_numpy(grpo.ref))
    j_spec = jgrpo.LossSpec(loss_type=loss_type, **_spec(loss_type))
    j_loss, j_metrics = jgrpo.grpo_loss_jax(jnp.asarray(logps32), jnp.asarray(ADVANTAGES), jnp.asarray(grpo.mask),
                                            jgrpo.loss_norms(grpo.mask), j_spec, old_logps_NC=jnp.asarray(grpo.old),
                                            ref_logps_NC=jnp.asarray(grpo.ref))
    for loss in (float(t_loss), float(j_loss)):
        # relative to the loss's terms, as the end-to-end test (see _loss_scale): sapo's terms are ~2|A| where the
        # loss is 0.034, so float32 rounding of order 1e-7 of the terms is 2e-6 of the cancelled sum
        assert abs(loss - expected.loss) / _loss_scale(grpo, loss_type) <= TOL["loss_rel"], (loss_type, loss)
    for k, v in expected.metrics.items():
        assert abs(float(t_metrics[k]) - v) <= 1e-6 and abs(float(j_metrics[k]) - v) <= 1e-6, k


ONE_STEP_CASES = [(t, layout) if (t, layout) == ("dapo", "padded") else
                  pytest.param(t, layout, marks=pytest.mark.slow) for t in LOSS_FAMILY for layout in LAYOUTS]


@pytest.mark.parametrize("loss_type, layout", ONE_STEP_CASES)
def test_one_step_loss_and_gradients_match(grpo, loss_type, layout):
    t_loss, t_grads = grpo.run("torch", layout, loss_type)
    j_loss, j_grads = grpo.run("jax", layout, loss_type)
    scale = _loss_scale(grpo, loss_type)
    print(f"{loss_type} {layout}: loss {t_loss:.6f}, |torch - jax| = {abs(j_loss - t_loss):.1e} = "
          f"{abs(j_loss - t_loss) / scale:.1e} of the terms' size {scale:.3f}")
    assert abs(j_loss - t_loss) / scale <= TOL["loss_rel"], (loss_type, layout, j_loss, t_loss, scale)
    assert set(j_grads) == set(t_grads)
    for name, g in t_grads.items():
        rel = np.linalg.norm(j_grads[name] - g) / np.linalg.norm(g)
        assert rel <= TOL["grad_rel"], (loss_type, layout, name, rel)


@pytest.mark.slow
def test_padding_free_equals_padded_in_each_backend(grpo):
    for backend in ("torch", "jax"):
        (p_loss, p_grads), (f_loss, f_grads) = (grpo.run(backend, layout, "dapo") for layout in LAYOUTS)
        assert abs(f_loss - p_loss) / _loss_scale(grpo, "dapo") <= TOL["loss_rel"], backend
        for name, g in p_grads.items():
            assert np.linalg.norm(f_grads[name] - g) / np.linalg.norm(g) <= TOL["grad_rel"], (backend, name)


@pytest.mark.parametrize("kernel", ["fused_linear", "chunked_nll", "nll"])
def test_entropy_bonus_loss_and_gradients_match(grpo, kernel):
    """The entropy bonus's gradient reaches the weights through each torch kernel as through JAX's; without the
    bonus's entropy gradient (torch's metric entropy, a constant) the gradients differ (the negative control)."""
    coef = 0.5
    t_loss, t_grads = grpo.run("torch", "padding_free", "dapo", kernel, entropy_coef=coef)
    j_loss, j_grads = grpo.run("jax", "padding_free", "dapo", "fused_linear", entropy_coef=coef)
    p_loss, p_grads = grpo.run("torch", "padding_free", "dapo", kernel)
    scale = _loss_scale(grpo, "dapo") + coef * 10.0  # the bonus's term: coef x a mean entropy of a few nats
    assert abs(j_loss - t_loss) / scale <= TOL["loss_rel"], (kernel, j_loss, t_loss)
    for name, g in t_grads.items():
        assert np.linalg.norm(j_grads[name] - g) / np.linalg.norm(g) <= TOL["grad_rel"], (kernel, name)
    moved = max(np.linalg.norm(p_grads[n] - g) / np.linalg.norm(g) for n, g in t_grads.items())
    assert moved > 100 * TOL["grad_rel"], moved
