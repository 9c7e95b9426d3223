"""KTO parity: torch vs jax vs the numpy reference, on the same weights and the same unpaired rows.

Inputs: the tiny preset from ``init_weights(seed=0)`` and four KTO rows (prompts of 3-8 tokens, completions of 2-9,
labels desirable, undesirable, undesirable, desirable) with TRL's mismatched completions (a rotation by one),
collated into one ``KTOBatch``: the four completions then the four mismatched pairs ('kto'; none for
'apo_zero_unpaired'), padded ([8, T], one document per row) and padding-free ([1, T]). The reference log-probs are
the float64 reference model's own shifted by fixed offsets of both signs, so every log-ratio is O(1) and non-zero,
and the mismatched pairs' mean log-ratio is 0.35: the KL estimate ``z`` is live (not clamped at 0).

Invariants (float32; the DPO rows of ``parity_tests/tolerances.py``, no new bound):

- one micro-batch end to end (forward, fused log-probs, loss), each backend: the loss and every row's loss within
  ``loss_rel`` of ``common.objectives.kto.kto_loss`` on the reference model's log-probs at TRL's ``beta = 0.1``.
  Error budget (as DPO's): a sequence log-prob carries ~2e-6 (up to ~1e-5 for a long padding-free sum); a row's
  loss moves by ``β σ(1 - σ) <= β/4`` times the error of ``r - z``, a relative ~1e-7 to 4e-7 of a loss near 0.5;
- torch vs jax: every row's loss and the loss within ``loss_rel``, every gradient within ``grad_rel`` per tensor,
  the completions' log-probs within ``grad_rel`` relative (DPO's rule), and the KL estimate within what those
  log-probs' bound allows for a mean of them (``grad_rel * max |logp|``);
- padding-free equals padded within ``grad_rel``, loss and gradients, in each backend.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

from parity_tests.inputs import rel_norm
from parity_tests.tolerances import TOLERANCES
from twinseq.common.data.preference_batching import sequence_logps_from_logits
from twinseq.common.data.unpaired import add_kl_completions, collate_unpaired
from twinseq.common.objectives.kto import KTO_LOSS_TYPES, kto_loss, validate_kto_config

TOL = TOLERANCES["float32"]
LAYOUTS = ("padded", "padding_free")
# each (loss type, layout) compiles the jax gradient once (~5 s on 2 CPU cores): 'apo_zero_unpaired' (the same
# documents less the mismatched pairs, and a loss whose arithmetic tests/jax_backend/test_jax_kto.py checks) is slow
LOSS_TYPES = [pytest.param(t, marks=pytest.mark.slow) if t == "apo_zero_unpaired" else t for t in KTO_LOSS_TYPES]
LENGTHS = ((5, 7), (3, 9), (8, 2), (4, 5))  # (prompt, completion) tokens per row
LABELS = np.array([True, False, False, True])
# reference = policy + these: log-ratios r = -offset of both signs; the mismatched pairs' mean log-ratio is 0.35
REF_OFFSETS = np.array([0.8, -0.6, 1.1, -0.4])
KL_OFFSETS = np.array([-0.9, 0.3, -0.6, -0.2])
BETA = 0.1
CHUNK_SIZE = 8


def kto_rows(vocab_size: int, seed: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    columns = {
        "prompt_input_ids": [rng.integers(3, vocab_size, p).tolist() for p, _ in LENGTHS],
        "completion_input_ids": [rng.integers(3, vocab_size, c).tolist() for _, c in LENGTHS],
        "label": LABELS.tolist(),
    }
    columns = add_kl_completions(columns, len(LENGTHS))
    return [{k: v[i] for k, v in columns.items()} for i in range(len(LENGTHS))]


class KTOHarness:
    """Memoised KTO outputs of torch, jax and the float64 numpy reference."""

    def __init__(self, harness) -> None:
        self.h = harness
        self.rows = kto_rows(harness.cfg.vocab_size)
        self.memo: dict[tuple, Any] = {}

    def memoised(self, *key: Any, compute: Callable[[], Any]) -> Any:
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def kbatch(self, loss_type: str, layout: str):
        free = layout == "padding_free"
        return self.memoised(
            "kbatch",
            loss_type,
            layout,
            compute=lambda: collate_unpaired(
                self.rows, with_kl=loss_type == "kto", padding_free=free, pad_to_multiple_of=8 if free else None
            ),
        )

    def policy_logps(self, loss_type: str) -> np.ndarray:
        """The float64 reference model's [N + M] sequence log-probs (padded layout)."""
        from parity_tests import numpy_reference

        kb = self.kbatch(loss_type, "padded")
        logits = lambda: numpy_reference.logits(self.h.cfg, self.h.weights, kb.batch)  # noqa: E731
        return self.memoised(
            "policy", loss_type, compute=lambda: np.concatenate(sequence_logps_from_logits(logits(), kb))
        )

    def ref_logps(self, loss_type: str) -> np.ndarray:
        offsets = np.concatenate([REF_OFFSETS, KL_OFFSETS]) if loss_type == "kto" else REF_OFFSETS
        return self.policy_logps(loss_type) + offsets

    def numpy_loss(self, loss_type: str):
        policy, ref, n = self.policy_logps(loss_type), self.ref_logps(loss_type), len(LENGTHS)
        return kto_loss(
            policy[:n],
            ref[:n],
            LABELS,
            policy_kl_logps=policy[n:],
            ref_kl_logps=ref[n:],
            loss_type=loss_type,
            beta=BETA,
        )

    def run(self, backend: str, loss_type: str, layout: str):
        """(loss, grads by HF name, per-row float64 outputs and ``kl``) of one backend."""
        return self.memoised("run", backend, loss_type, layout, compute=lambda: self._run(backend, loss_type, layout))

    def _run(self, backend: str, loss_type: str, layout: str):
        config = validate_kto_config(loss_type, BETA)
        kb, ref = self.kbatch(loss_type, layout), self.ref_logps(loss_type)
        if backend == "jax":
            from twinseq.jax_backend.kto import kto_loss_and_grads

            return kto_loss_and_grads(
                self.h.jax_model, kb, config, ref_logps_D=ref, loss_type="fused_linear", chunk_size=CHUNK_SIZE
            )
        return torch_kto_loss_and_grads(self.h.torch_model, kb, config, ref)


def torch_kto_loss_and_grads(model, kb, config, ref_logps_D: np.ndarray):
    """The torch mirror of ``jax_backend.kto.kto_loss_and_grads``: ``kto_forward``, backward, the gradients by HF
    name (as ``torch_backend.dpo.dpo_loss_and_grads``)."""
    import torch

    from twinseq.common.models.init import parameter_shapes
    from twinseq.torch_backend.kto import kto_forward
    from twinseq.torch_backend.model import model_config_of

    model.zero_grad(set_to_none=True)
    out = kto_forward(
        model, kb, config, ref_logps_D=torch.as_tensor(ref_logps_D), loss_type="fused_linear", chunk_size=CHUNK_SIZE
    )
    out.loss.backward()
    params = dict(model.named_parameters())
    grads = {
        name: params[name].grad.detach().float().cpu().numpy().copy()
        for name in parameter_shapes(model_config_of(model))
    }
    model.zero_grad(set_to_none=True)
    rows = {k: getattr(out, k).detach().double().cpu().numpy() for k in ("losses", "logps", "rewards")}
    return float(out.loss.detach()), grads, {**rows, "kl": out.kl}


@pytest.fixture(scope="module")
def kto(harness) -> KTOHarness:
    return KTOHarness(harness)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_the_batch_exercises_both_sides_and_a_live_kl_term(kto):
    padded, free = kto.kbatch("kto", "padded"), kto.kbatch("kto", "padding_free")
    assert padded.batch.shape[0] == 8 and free.batch.shape[0] == 1 and padded.num_kl == 4
    assert (padded.num_target_tokens == free.num_target_tokens).all()
    want = kto.numpy_loss("kto")
    assert want.kl == pytest.approx(0.35, abs=1e-12)
    assert LABELS.any() and (~LABELS).any() and np.abs(want.rewards).min() > BETA * 0.3


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_end_to_end_loss_matches_numpy_reference(kto, backend, loss_type, layout):
    loss, _, rows = kto.run(backend, loss_type, layout)
    want = kto.numpy_loss(loss_type)
    assert _rel(loss, want.loss) <= TOL["loss_rel"], (backend, loss_type, layout, loss, want.loss)
    np.testing.assert_allclose(rows["losses"], want.losses, rtol=TOL["loss_rel"], atol=0)
    # the rewards are β (logp - ref) of the returned log-probs, exact to one float32 spacing of the reference
    ref = kto.ref_logps(loss_type)[: len(LENGTHS)]
    atol = BETA * float(np.spacing(np.float32(np.abs(ref).max())))
    np.testing.assert_allclose(rows["rewards"], BETA * (rows["logps"] - ref), rtol=0, atol=atol)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_torch_and_jax_agree(kto, loss_type, layout):
    t_loss, t_grads, t_rows = kto.run("torch", loss_type, layout)
    j_loss, j_grads, j_rows = kto.run("jax", loss_type, layout)
    assert _rel(j_loss, t_loss) <= TOL["loss_rel"]
    np.testing.assert_allclose(j_rows["losses"], t_rows["losses"], rtol=TOL["loss_rel"], atol=0)
    np.testing.assert_allclose(j_rows["logps"], t_rows["logps"], rtol=TOL["grad_rel"], atol=0)
    # z is a mean of log-prob differences: it carries at most the log-probs' own bound
    assert abs(j_rows["kl"] - t_rows["kl"]) <= TOL["grad_rel"] * float(np.abs(kto.policy_logps(loss_type)).max())
    if loss_type == "kto":
        assert t_rows["kl"] > 0.3
    assert list(t_grads) == list(j_grads)
    worst = max((rel_norm(j_grads[k], t_grads[k]), k) for k in t_grads)
    assert worst[0] <= TOL["grad_rel"], worst
    assert all(np.linalg.norm(g) > 0 for g in t_grads.values())  # the KTO loss really moves every weight


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_padding_free_equals_padded(kto, backend, loss_type):
    p_loss, p_grads, p_rows = kto.run(backend, loss_type, "padded")
    f_loss, f_grads, f_rows = kto.run(backend, loss_type, "padding_free")
    assert _rel(f_loss, p_loss) <= TOL["grad_rel"]
    np.testing.assert_allclose(f_rows["logps"], p_rows["logps"], rtol=TOL["grad_rel"], atol=0)
    worst = max((rel_norm(f_grads[k], p_grads[k]), k) for k in p_grads)
    assert worst[0] <= TOL["grad_rel"], worst
