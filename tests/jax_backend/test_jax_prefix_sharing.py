"""Prefix sharing on the JAX backend: every attention path honours ``parent_ids``.

Invariants (float32, matmuls at full precision), for GRPO groups of 3 and 4 completions of 2 prompts of different
lengths, collated with ``share_prefix=True`` (each prompt once, its completions children of it) and ``False``:
- per-token completion log-probs agree within 1e-6 and the GRPO loss gradients within 1e-5 relative, on the dense
  (``eager``) and blocked (``sdpa``, tiles smaller than the row) paths, padded and padding-free, and on a sliding-
  window family (Mistral, window 16 < the longest document);
- negative control: the shared batch with ``parent_ids`` zeroed (children blind to their prompt) gives log-probs
  far off, so the comparisons can fail;
- on 4 host devices, the ring (and all-gather) context-parallel forward of the shared batch equals the single-device
  shared forward and the unshared log-probs within 1e-6 (children's parents in earlier chunks);
- DPO: the sequence log-probs of ``collate_preference(rows, share_prefix=True)`` equal the unshared ones.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from twinseq.common.config import ModelConfig  # noqa: E402
from twinseq.common.data.context_parallel import shard_sequence, unshard_sequence  # noqa: E402
from twinseq.common.data.preference_batching import collate_preference  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.common.objectives.dpo import DPOLossConfig  # noqa: E402
from twinseq.common.objectives.grpo import collate_completions  # noqa: E402
from twinseq.common.objectives.grpo_loss import LossSpec  # noqa: E402
from twinseq.common.objectives.nll import shift_labels  # noqa: E402
from twinseq.jax_backend import dpo as jdpo  # noqa: E402
from twinseq.jax_backend import grpo as jgrpo  # noqa: E402
from twinseq.jax_backend.context_parallel import sharded_attention  # noqa: E402
from twinseq.jax_backend.model import CausalLM  # noqa: E402
from twinseq.jax_backend.parallel import make_mesh  # noqa: E402

pytestmark = pytest.mark.usefixtures("highest_precision")

LOGP_TOL = 1e-6
GRAD_RTOL = 1e-5
CP = 4


def _groups(vocab_size: int, group_sizes=(3, 4), prompt_lengths=(7, 13)):
    """(prompts, completions): prompt k repeated ``group_sizes[k]`` times, each with its own completion."""
    rng = np.random.default_rng(11)
    prompts, completions = [], []
    for g, p in zip(group_sizes, prompt_lengths):
        prompt = rng.integers(3, vocab_size, size=p).tolist()
        for _ in range(g):
            prompts.append(prompt)
            completions.append(rng.integers(3, vocab_size, size=int(rng.integers(2, 10))))
    return prompts, completions


def _pair(cfg: ModelConfig, padding_free: bool):
    """(shared, unshared) ``CompletionBatch`` of the same completions, the same ``[N, C]`` layout."""
    prompts, completions = _groups(cfg.vocab_size)
    shared, unshared = (
        collate_completions(prompts, completions, padding_free=padding_free, num_columns=10, share_prefix=s)
        for s in (True, False)
    )
    assert shared.batch.shares_prefix and unshared.batch.parent_ids is None
    assert (shared.batch.segment_ids != 0).sum() < (unshared.batch.segment_ids != 0).sum()
    return shared, unshared


def _orphaned(cb):
    """``cb`` with its children cut from their prompt: parent_ids all 0."""
    batch = dataclasses.replace(cb.batch, parent_ids=np.zeros_like(cb.batch.parent_ids))
    return dataclasses.replace(cb, batch=batch)


def _model(preset: str, attn_implementation: str) -> CausalLM:
    cfg = ModelConfig.preset(preset)
    return CausalLM(cfg, init_weights(cfg, seed=0), attn_implementation=attn_implementation, attention_block_size=8)


def _grpo_grads(model, cb):
    mask_NC = np.zeros((cb.num_docs, cb.num_columns), np.float32)
    mask_NC[cb.token_row_n, cb.token_col_n] = 1.0
    advantages_N = np.linspace(-1.0, 1.0, cb.num_docs, dtype=np.float32)
    spec = LossSpec("dapo", 0.2, 0.28, 0.0, cb.num_columns)
    return jgrpo.grpo_loss_and_grads(model, cb, mask_NC, advantages_N, spec, chunk_size=16)


def _assert_grads_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        err, scale = np.abs(got[name] - w).max(), np.abs(w).max()
        assert err <= GRAD_RTOL * scale, (name, err, scale)


@pytest.mark.parametrize(
    "preset, attn, padding_free",
    [
        ("tiny", "eager", False),
        ("tiny", "eager", True),
        ("tiny", "sdpa", False),
        ("tiny", "sdpa", True),
        ("tiny-mistral", "eager", False),
        ("tiny-mistral", "sdpa", True),
    ],
)
def test_shared_logps_and_grads_equal_unshared(preset, attn, padding_free):
    model = _model(preset, attn)
    shared, unshared = _pair(model.config, padding_free)
    assert shared.batch.shape[1] > 8  # the blocked path runs several tiles, not its one-tile dense shortcut
    want = jgrpo.compute_completion_logps(model, unshared)
    got = jgrpo.compute_completion_logps(model, shared)
    err = np.abs(got - want).max()
    print(f"{preset} {attn} padding_free={padding_free}: max |shared - unshared| log-prob {err:.2e}")
    assert err <= LOGP_TOL, err
    orphaned = jgrpo.compute_completion_logps(model, _orphaned(shared))
    assert np.abs(orphaned - want).max() > 1e3 * LOGP_TOL  # negative control: parents matter
    loss_s, grads_s, _ = _grpo_grads(model, shared)
    loss_u, grads_u, _ = _grpo_grads(model, unshared)
    assert abs(loss_s - loss_u) <= GRAD_RTOL * max(abs(loss_u), 1e-6), (loss_s, loss_u)
    _assert_grads_close(grads_s, grads_u)


def _mesh():
    if jax.device_count() < CP:
        pytest.skip(f"needs {CP} JAX devices (the root conftest sets XLA_FLAGS); found {jax.device_count()}")
    return make_mesh(data=1, cp=CP, devices=jax.devices()[:CP])


def _ring(mesh, strategy: str):
    """An ``AttendFn`` running ``sharded_attention`` over ``mesh``'s ``cp`` axis, the rows in their own order."""

    def attend(
        q_BNTD, k_BKTD, v_BKTD, seg_BT, pos_BT, scaling, *, sliding_window=None, softcap=None, parent_ids_BT=None
    ):
        out_BTND = sharded_attention(
            *(x.transpose(0, 2, 1, 3) for x in (q_BNTD, k_BKTD, v_BKTD)),
            seg_BT,
            pos_BT,
            mesh,
            strategy=strategy,
            batch_axes=(),
            scale=scaling,
            sliding_window=sliding_window,
            softcap=softcap,
            parent_ids_BT=parent_ids_BT,
        )
        return out_BTND.transpose(0, 2, 1, 3)

    return attend


def _logps_NC(model: CausalLM, ci: jgrpo.CompletionInputs, attend, zigzag: bool = False) -> np.ndarray:
    """float64 [N, C] completion log-probs from the full logits (``attend`` None: the model's own attention); with
    ``zigzag`` the model runs on the rows in the load-balanced cp order, and its log-probs are put back in order."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def token_logps(state, ids_BT, pos_BT, seg_BT, par_BT, targets_BT):
        logits_BTV = nnx.merge(graphdef, state).logits(ids_BT, pos_BT, seg_BT, attend, par_BT)
        logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
        return jnp.take_along_axis(logp_BTV, jnp.maximum(targets_BT, 0)[..., None], axis=-1)[..., 0]

    ids, pos, seg, labels = ci.inputs
    arrays = [np.asarray(a) for a in (ids, pos, seg, ci.parent_ids_BT, shift_labels(np.asarray(labels)))]
    if zigzag:
        arrays = [shard_sequence(a, CP, axis=1) for a in arrays]
    logp_BT = np.asarray(token_logps(state, *(jnp.asarray(a) for a in arrays)), np.float64)
    logp_n = (unshard_sequence(logp_BT, CP, axis=1) if zigzag else logp_BT).reshape(-1)
    flat_NC = np.asarray(ci.flat_NC)
    return np.where(flat_NC >= 0, logp_n[np.maximum(flat_NC, 0)], 0.0)


@pytest.mark.slow
@pytest.mark.multi_device
@pytest.mark.parametrize(
    "strategy, zigzag, padding_free", [("ring", False, False), ("ring", True, True), ("allgather", True, False)]
)
def test_ring_forward_of_a_shared_batch_equals_one_device(strategy, zigzag, padding_free):
    """Rows split over cp in their own order (a child's prompt in earlier chunks) or the zigzag order."""
    mesh = _mesh()
    model = _model("tiny", "sdpa")
    shared, unshared = _pair(model.config, padding_free)
    ci = jgrpo.CompletionInputs.of(shared, model.config.vocab_size, multiple=2 * CP)
    ring = _logps_NC(model, ci, _ring(mesh, strategy), zigzag)
    one_device = _logps_NC(model, ci, None)
    want = jgrpo.compute_completion_logps(model, unshared)
    errs = np.abs(ring - one_device).max(), np.abs(ring - want).max()
    print(f"{strategy} padding_free={padding_free}: |ring - one device| {errs[0]:.2e}, |ring - unshared| {errs[1]:.2e}")
    assert max(errs) <= LOGP_TOL, errs
    orphaned = jgrpo.CompletionInputs(ci.inputs, ci.flat_NC, jnp.zeros_like(ci.parent_ids_BT))
    assert np.abs(_logps_NC(model, orphaned, _ring(mesh, strategy), zigzag) - want).max() > 1e3 * LOGP_TOL


def _preference_rows(vocab_size: int):
    rng = np.random.default_rng(3)
    return [
        {
            "prompt_input_ids": rng.integers(3, vocab_size, size=p).tolist(),
            "chosen_input_ids": rng.integers(3, vocab_size, size=int(rng.integers(2, 9))).tolist(),
            "rejected_input_ids": rng.integers(3, vocab_size, size=int(rng.integers(2, 9))).tolist(),
        }
        for p in (6, 11)
    ]


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding_free"])
def test_dpo_sequence_logps_of_a_shared_batch_equal_unshared(padding_free):
    model = _model("tiny", "sdpa")
    rows = _preference_rows(model.config.vocab_size)
    shared, unshared = (collate_preference(rows, padding_free=padding_free, share_prefix=s) for s in (True, False))
    assert shared.batch.shares_prefix
    got, want = (np.concatenate(jdpo.compute_sequence_logps(model, pb)) for pb in (shared, unshared))
    err = np.abs(got - want).max()
    print(f"DPO padding_free={padding_free}: max |shared - unshared| sequence log-prob {err:.2e} of {want.tolist()}")
    assert err <= LOGP_TOL * np.abs(want).max(), (got, want)
    orphaned = dataclasses.replace(
        shared, batch=dataclasses.replace(shared.batch, parent_ids=np.zeros_like(shared.batch.parent_ids))
    )
    bad = np.concatenate(jdpo.compute_sequence_logps(model, orphaned))
    assert np.abs(bad - want).max() > 1e-2
    config = DPOLossConfig(("sigmoid",), (1.0,), beta=0.1, label_smoothing=0.0)
    ref = dict(ref_chosen_logps=want[:2] + 0.5, ref_rejected_logps=want[2:] - 0.5)
    loss_s, grads_s, _ = jdpo.dpo_loss_and_grads(model, shared, config, **ref)
    loss_u, grads_u, _ = jdpo.dpo_loss_and_grads(model, unshared, config, **ref)
    assert abs(loss_s - loss_u) <= GRAD_RTOL * abs(loss_u), (loss_s, loss_u)
    _assert_grads_close(grads_s, grads_u)


@pytest.mark.multi_device
def test_a_shared_preference_batch_under_context_parallelism_is_refused():
    model = _model("tiny", "sdpa")
    shared = collate_preference(_preference_rows(model.config.vocab_size), share_prefix=True)
    with pytest.raises(ConfigError, match="share_prefix=False"):
        jdpo.step_inputs(shared, model.config.vocab_size, _mesh())


def test_a_batch_without_parents_compiles_the_program_without_them():
    """All-zero parent_ids (nothing shared) become the static None: the unshared program, not a masked copy."""
    vocab_size = ModelConfig.preset("tiny").vocab_size
    cb = collate_completions(*_groups(vocab_size), share_prefix=True)
    assert jgrpo.CompletionInputs.of(cb, vocab_size).parent_ids_BT is not None
    assert jgrpo.CompletionInputs.of(_orphaned(cb), vocab_size).parent_ids_BT is None


@pytest.mark.multi_device
def test_parent_ids_of_the_wrong_shape_are_refused():
    q = jnp.zeros((1, 8, 2, 4))
    ids = jnp.ones((1, 8), jnp.int32)
    with pytest.raises(ConfigError, match=r"parent_ids \(1, 4\) must be \[B, T\] = \(1, 8\)"):
        sharded_attention(q, q, q, ids, ids, _mesh(), parent_ids_BT=jnp.ones((1, 4), jnp.int32))
