"""JAX KTO (``jax_backend.kto``): the loss against the float64 numpy reference, the KL estimate held constant, the
trainer's step and its refusals.

Invariants (float32, x64 off; bounds from ``parity_tests/tolerances.py``, the DPO rows):
- loss arithmetic: ``kto_from_logps`` on float32 log-probs equals ``common.objectives.kto.kto_loss`` (float64) on
  the same values within ``loss_rel`` per row and for the loss, for both loss types, mixed labels, desirable rows
  only, undesirable rows only, and a KL estimate clamped at 0; the same comparison with the sign of ``z`` flipped
  fails by orders of magnitude (the negative control);
- end to end on the tiny model (forward, fused log-probs, loss), padded and padding-free: within ``loss_rel`` of
  ``kto_loss`` on the float64 reference model's log-probs at TRL's ``beta = 0.1`` (the DPO parity error budget:
  a ~5e-6 log-prob error moves a row's loss by ``β/4`` of it);
- the KL estimate gets no gradient: the loss's gradient w.r.t. the mismatched documents' log-probs is exactly 0
  while ``z > 0`` (their finite difference is not), and on the model, replacing the mismatched completions (the
  reference moved so that ``z`` keeps its value) leaves the parameter gradient within ``grad_rel``; without the
  ``stop_gradient`` it moves by far more (the negative control);
- the trainer's step logs ``kto_step_metrics``' keys (the torch trainer's), and a precomputed reference gives the
  live reference's step.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from parity_tests.inputs import rel_norm  # noqa: E402
from parity_tests.tolerances import tol  # noqa: E402
from twinseq.common.config import ModelConfig, TrainConfig  # noqa: E402
from twinseq.common.data.preference_batching import sequence_logps_from_logits  # noqa: E402
from twinseq.common.data.unpaired import add_kl_completions, collate_unpaired  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.common.objectives.kto import KTO_LOSS_TYPES, kto_family, kto_loss, validate_kto_config  # noqa: E402
from twinseq.jax_backend import build_model  # noqa: E402
from twinseq.jax_backend import kto as jkto  # noqa: E402
from twinseq.jax_backend.dpo import JAX_OPS, preference_inputs  # noqa: E402
from twinseq.jax_backend.model import merge_state, split_trainable  # noqa: E402

pytestmark = pytest.mark.usefixtures("highest_precision")

LOSS_REL, GRAD_REL = tol("float32", "loss_rel"), tol("float32", "grad_rel")
LENGTHS = ((5, 7), (3, 9), (8, 2), (4, 5))  # (prompt, completion) tokens per row
# reference = policy + these: log-ratios r = -offset of both signs; the KL pairs' mean log-ratio is 0.35 (z > 0)
REF_OFFSETS = np.array([0.8, -0.6, 1.1, -0.4])
KL_OFFSETS = np.array([-0.9, 0.3, -0.6, -0.2])
LABELS = {"mixed": np.array([True, False, False, True]), "desirable_only": np.ones(4, bool)}
BETA = 0.1  # TRL's default: the end-to-end bound is derived at it (module docstring)
KW = dict(loss_type="fused_linear", chunk_size=4)


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.preset("tiny")
    weights = init_weights(cfg, seed=0)
    return cfg, weights, build_model(cfg, weights)


def unpaired_rows(vocab_size: int, labels=LABELS["mixed"], seed: int = 3) -> list[dict]:
    """Tokenised KTO rows (``LENGTHS``) with TRL's mismatched completions (a rotation by one)."""
    rng = np.random.default_rng(seed)
    columns = {
        "prompt_input_ids": [rng.integers(3, vocab_size, p).tolist() for p, _ in LENGTHS],
        "completion_input_ids": [rng.integers(3, vocab_size, c).tolist() for _, c in LENGTHS],
        "label": [bool(v) for v in labels],
    }
    columns = add_kl_completions(columns, len(LENGTHS))
    return [{k: v[i] for k, v in columns.items()} for i in range(len(LENGTHS))]


def kbatch_of(rows: list[dict], loss_type: str, layout: str):
    return collate_unpaired(
        rows,
        with_kl=loss_type == "kto",
        padding_free=layout == "padding_free",
        pad_to_multiple_of=8 if layout == "padding_free" else None,
    )


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _mismatch(got_losses, got_loss, want) -> float:
    """The largest relative error of the per-row losses and the loss (``kto_loss`` output ``want``)."""
    per_row = np.max(np.abs(np.asarray(got_losses, np.float64) - want.losses) / np.abs(want.losses))
    return max(float(per_row), _rel(float(got_loss), want.loss))


# --------------------------------------------------------------------------------------
# The loss arithmetic, on float32 log-probs
# --------------------------------------------------------------------------------------

ARITHMETIC_CASES = {
    "mixed": (np.array([True, False, True, False, False, True]), 0.0),
    "desirable_only": (np.ones(6, bool), 0.0),
    "undesirable_only": (np.zeros(6, bool), 0.0),
    "kl_clamped": (np.array([True, False, True, False, False, True]), -3.0),  # mean KL log-ratio < 0: z = 0
}


def _arithmetic_inputs(case: str):
    """float32 policy/reference log-probs of 6 rows and 6 mismatched pairs (|logp| ~ 20), and the labels."""
    labels, kl_shift = ARITHMETIC_CASES[case]
    rng = np.random.default_rng(7)
    pol, ref = rng.normal(-20, 3, 6), rng.normal(-20, 3, 6)
    pkl = rng.normal(-20, 3, 6)
    rkl = pkl - rng.normal(0.5, 0.3, 6) - kl_shift  # pkl - rkl: mean ~0.5 (z > 0), or ~-2.5 (clamped)
    return [np.asarray(a, np.float32) for a in (pol, ref, pkl, rkl)], labels


def _jax_arithmetic(pol, ref, pkl, rkl, labels, config, *, flip_z: bool = False):
    """(per-row losses, loss, rewards, kl) of ``kto_from_logps``; ``flip_z``: the deliberately wrong loss with
    ``-z`` (the negative control)."""
    logps_D, ref_D = jnp.concatenate([pol, pkl]), jnp.concatenate([ref, rkl])
    if config.loss_type == "apo_zero_unpaired":  # no mismatched pairs
        logps_D, ref_D = jnp.asarray(pol), jnp.asarray(ref)
    loss, rows = jkto.kto_from_logps(logps_D, ref_D, jnp.asarray(labels), len(labels), config=config)
    if flip_z:
        losses, _ = kto_family(logps_D[:6] - ref_D[:6], jnp.asarray(labels, jnp.float32), -rows["kl"], config, JAX_OPS)
        return losses, losses.sum() / 6, rows["rewards"], -rows["kl"]
    return rows["losses"], loss, rows["rewards"], rows["kl"]


@pytest.mark.parametrize("case", sorted(ARITHMETIC_CASES))
@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
def test_loss_arithmetic_matches_numpy_reference(loss_type, case):
    (pol, ref, pkl, rkl), labels = _arithmetic_inputs(case)
    config = validate_kto_config(loss_type, 0.5, desirable_weight=1.3, undesirable_weight=0.7)
    want = kto_loss(
        *(a.astype(np.float64) for a in (pol, ref)),
        labels,
        policy_kl_logps=pkl.astype(np.float64),
        ref_kl_logps=rkl.astype(np.float64),
        loss_type=loss_type,
        beta=0.5,
        desirable_weight=1.3,
        undesirable_weight=0.7,
    )
    if loss_type == "kto":
        assert (want.kl == 0.0) == (case == "kl_clamped")  # the KL term is live in every other case
    losses, loss, rewards, kl = _jax_arithmetic(pol, ref, pkl, rkl, labels, config)
    assert _mismatch(losses, loss, want) <= LOSS_REL
    np.testing.assert_allclose(rewards, want.rewards, rtol=LOSS_REL, atol=1e-7)
    assert abs(float(kl) - want.kl) <= LOSS_REL * max(want.kl, 1.0)


def test_the_comparison_fails_on_a_loss_with_z_of_the_wrong_sign():
    """Negative control: the arithmetic check above, on a loss whose KL estimate enters with the wrong sign."""
    (pol, ref, pkl, rkl), labels = _arithmetic_inputs("mixed")
    config = validate_kto_config("kto", 0.5)
    want = kto_loss(
        *(a.astype(np.float64) for a in (pol, ref)),
        labels,
        policy_kl_logps=pkl.astype(np.float64),
        ref_kl_logps=rkl.astype(np.float64),
        beta=0.5,
    )
    assert want.kl > 0.1
    right = _jax_arithmetic(pol, ref, pkl, rkl, labels, config)
    wrong = _jax_arithmetic(pol, ref, pkl, rkl, labels, config, flip_z=True)
    assert _mismatch(right[0], right[1], want) <= LOSS_REL
    assert _mismatch(wrong[0], wrong[1], want) > 1e3 * LOSS_REL


# --------------------------------------------------------------------------------------
# End to end on the tiny model
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def numpy_logps(tiny):
    """(loss type, layout) -> the float64 reference model's [N + M] sequence log-probs of the test batch (the
    labels do not change them)."""
    from parity_tests import numpy_reference

    cfg, weights, _ = tiny

    @functools.lru_cache(maxsize=None)
    def logps(loss_type: str, layout: str) -> np.ndarray:
        kb = kbatch_of(unpaired_rows(cfg.vocab_size), loss_type, layout)
        return np.concatenate(sequence_logps_from_logits(numpy_reference.logits(cfg, weights, kb.batch), kb))

    return logps


def reference_of(policy: np.ndarray, loss_type: str) -> np.ndarray:
    """The reference's [N + M] log-probs: the policy's shifted by ``REF_OFFSETS`` (and ``KL_OFFSETS``)."""
    return policy + (np.concatenate([REF_OFFSETS, KL_OFFSETS]) if loss_type == "kto" else REF_OFFSETS)


# each (loss type, layout) compiles the gradient once: the full tier (the fast one is at its 10-minute budget and
# keeps the loss arithmetic against the numpy reference)
@pytest.mark.slow
@pytest.mark.parametrize("labels", sorted(LABELS))
@pytest.mark.parametrize("layout", ["padded", "padding_free"])
@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
def test_end_to_end_loss_matches_numpy_reference(tiny, numpy_logps, loss_type, layout, labels):
    cfg, _, model = tiny
    policy, n = numpy_logps(loss_type, layout), len(LENGTHS)
    ref = reference_of(policy, loss_type)
    config = validate_kto_config(loss_type, BETA)
    kb = kbatch_of(unpaired_rows(cfg.vocab_size, LABELS[labels]), loss_type, layout)
    loss, grads, rows = jkto.kto_loss_and_grads(model, kb, config, ref_logps_D=ref, **KW)
    want = kto_loss(
        policy[:n],
        ref[:n],
        LABELS[labels],
        policy_kl_logps=policy[n:],
        ref_kl_logps=ref[n:],
        loss_type=loss_type,
        beta=BETA,
    )
    assert want.kl == pytest.approx(0.35 if loss_type == "kto" else 0.0, abs=1e-9)
    assert _mismatch(rows["losses"], loss, want) <= LOSS_REL, (rows["losses"], want.losses)
    # rewards are β (logp - ref) of the returned log-probs: exact to one float32 spacing of the reference
    atol = BETA * float(np.spacing(np.float32(np.abs(ref).max())))
    np.testing.assert_allclose(rows["rewards"], BETA * (rows["logps"] - ref[:n]), rtol=0, atol=atol)
    assert all(np.linalg.norm(g) > 0 for g in grads.values())


# --------------------------------------------------------------------------------------
# The KL estimate is held constant
# --------------------------------------------------------------------------------------


def _kl_without_stop_gradient(policy_kl_logps, ref_kl_logps):
    """The deliberately wrong estimate: gradient flows through ``z``."""
    return jnp.maximum(0.0, jnp.mean(policy_kl_logps - ref_kl_logps))


def test_the_kl_estimate_gets_no_gradient_from_the_log_probs():
    (pol, ref, pkl, rkl), labels = _arithmetic_inputs("mixed")
    config = validate_kto_config("kto", 0.5)
    logps_D, ref_D = jnp.concatenate([pol, pkl]), jnp.concatenate([ref, rkl])

    def loss(lp):
        return jkto.kto_from_logps(lp, ref_D, jnp.asarray(labels), 6, config=config)[0]

    grad = np.asarray(jax.grad(loss)(logps_D))
    assert (grad[6:] == 0).all() and (grad[:6] != 0).all()
    # the loss does depend on the mismatched log-probs (through the value of z > 0): only the gradient is stopped
    step = np.zeros(12, np.float32)
    step[6:] = 0.25
    assert abs(float(loss(logps_D + step)) - float(loss(logps_D - step))) > 1e-3


def _no_stop_grads(model, kb, ref_D, config):
    """The parameter gradient of the KTO loss with the wrong (differentiated) KL estimate: the negative control."""
    graphdef, state, _ = split_trainable(model)
    n = kb.num_examples

    @jax.jit
    def grads(s, inputs, ref, labels):
        def scalar(st):
            logps = jkto.policy_logps(merge_state(graphdef, st), inputs, **KW)
            kl = _kl_without_stop_gradient(logps[n:], ref[n:])
            losses, _ = kto_family(logps[:n] - ref[:n], labels.astype(jnp.float32), kl, config, JAX_OPS)
            return losses.sum() / n

        return jax.grad(scalar)(s)

    g = grads(
        state, preference_inputs(kb, model.config.vocab_size), jnp.asarray(ref_D, jnp.float32), jnp.asarray(kb.labels)
    )
    return {"/".join(map(str, path)): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(g)}


@pytest.mark.slow  # two compilations of the tiny model (the product's gradient is the end-to-end test's)
def test_replacing_the_mismatched_completions_leaves_the_gradient_unchanged(tiny):
    """Two batches with the same completions and different mismatched completions (of the same lengths), the
    reference's KL log-probs moved so that ``z`` keeps its value: the parameter gradient is the same, as only the
    completions carry one. Without ``stop_gradient`` the mismatched documents add their own term and the check fails
    (negative control). Desirable rows only, so that the rows' ``∂L/∂z`` add up instead of cancelling."""
    from twinseq.jax_backend.dpo import compute_sequence_logps

    cfg, _, model = tiny
    config = validate_kto_config("kto", BETA)
    rows = unpaired_rows(cfg.vocab_size, LABELS["desirable_only"])
    rng = np.random.default_rng(11)
    other = [
        dict(r, kl_completion_input_ids=rng.integers(3, cfg.vocab_size, len(r["kl_completion_input_ids"])))
        for r in rows
    ]
    batches = [kbatch_of(r, "kto", "padded") for r in (rows, other)]
    assert batches[0].batch.shape == batches[1].batch.shape
    refs = [reference_of(np.concatenate(compute_sequence_logps(model, kb, **KW)), "kto") for kb in batches]
    outs = [jkto.kto_loss_and_grads(model, kb, config, ref_logps_D=ref, **KW) for kb, ref in zip(batches, refs)]
    assert outs[0][2]["kl"] == pytest.approx(0.35, abs=1e-5) and outs[1][2]["kl"] == pytest.approx(0.35, abs=1e-5)
    np.testing.assert_allclose(outs[1][2]["losses"], outs[0][2]["losses"], rtol=LOSS_REL, atol=0)
    assert max(rel_norm(outs[1][1][k], outs[0][1][k]) for k in outs[0][1]) <= GRAD_REL
    wrong = [_no_stop_grads(model, kb, ref, config) for kb, ref in zip(batches, refs)]
    assert max(rel_norm(wrong[1][k], wrong[0][k]) for k in wrong[0]) > 100 * GRAD_REL


# --------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------


@pytest.mark.slow  # the trainer's step compiles the reference pass, the gradients and the update
def test_trainer_step_logs_the_torch_keys_and_a_precomputed_reference_gives_the_same_step(tiny):
    import datasets

    from twinseq.common.objectives.kto import kto_step_metrics

    mcfg, _, model = tiny
    rows = unpaired_rows(mcfg.vocab_size)
    cfg = TrainConfig.from_flat(
        task="kto",
        backend="jax",
        per_device_train_batch_size=4,
        padding_free=True,
        max_steps=2,
        learning_rate=1e-3,
        pad_to_multiple_of=16,
    )
    config = validate_kto_config("kto", cfg.dpo.beta)
    kb = collate_unpaired(rows, with_kl=True, padding_free=True)
    live = jkto.KTOTrainer(model, cfg, config=config, examples_per_step=4, live_reference=True)
    live_metrics = live.step([kb])
    precomputed_rows = jkto.precompute_kto_ref_logps(model, datasets.Dataset.from_list(rows), cfg, 0, bucket=16)
    assert set(precomputed_rows.column_names) >= {"ref_logps", "ref_KL_logps"}
    kb_pre = collate_unpaired(list(precomputed_rows), with_kl=True, padding_free=True)
    pre = jkto.KTOTrainer(model, cfg, config=config, examples_per_step=4, live_reference=False)
    pre_metrics = pre.step([kb_pre])
    torch_keys = set(
        kto_step_metrics(
            [0.0],
            {"labels": [kb.labels], "rewards": [np.zeros(4)], "logps": [np.zeros(4)]},
            [0.0],
            num_tokens=1,
            num_label_tokens=1,
        )
    )
    assert set(live_metrics) == torch_keys | {"lr", "grad_norm", "num_skipped_steps"}
    assert live_metrics["loss"] == pytest.approx(0.5, abs=1e-6)  # policy == reference at the first step: σ(0)
    for key in ("loss", "kl", "rewards/margins", "grad_norm"):
        assert pre_metrics[key] == pytest.approx(live_metrics[key], rel=GRAD_REL, abs=1e-6), key
    assert live.step([kb])["rewards/margins"] > 0  # the first update already separates the two sides


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"context_parallel_size": 2}, "not implemented for KTO"),
    ],
)
def test_builder_refuses_distributed_runs(overrides, match):
    cfg = TrainConfig.from_flat(task="kto", backend="jax", **overrides)
    with pytest.raises(ConfigError, match=match):
        jkto.build_kto(cfg)
