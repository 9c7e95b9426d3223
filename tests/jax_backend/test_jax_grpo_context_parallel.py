"""JAX GRPO under context parallelism: a completion micro-batch sharded over ``cp`` (zigzag order, targets shifted
before the reorder), the cp attention, the ``[N, C]`` token map pointing into the reordered layout.

Invariants (float32, matmuls at full precision):
- ``grpo_context_parallel.reordered_flat_NC`` points every completion token at its own target in the reordered
  layout; the token-order map read in the reordered layout points at other tokens (negative control);
- on 8 host devices (cp=8), the per-token log-probs of padded and padding-free micro-batches equal the
  single-device ones within 1e-5, and the token-order map gives log-probs far off (the comparison can fail);
- ``GRPOTrainer`` on the (data=1, cp=8) mesh trains like one device: the same completions and rewards per step, the
  loss and the KL within 1e-5 (absolute: a first iteration's loss is 0 up to rounding), the gradient norm within
  1e-5 relative and the first micro-batch's gradients within 1e-5 absolute (``test_ring_attention``'s ``TOL``), with
  a second iteration per generation (the sampling policy's log-probs sharded), the KL to the reference and the
  entropy bonus.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from twinseq.common.config import ModelConfig, TrainConfig  # noqa: E402
from twinseq.common.data.context_parallel import shard_sequence  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.common.objectives.grpo import collate_completions  # noqa: E402
from twinseq.common.objectives.nll import shift_labels  # noqa: E402
from twinseq.jax_backend import build_model  # noqa: E402
from twinseq.jax_backend import grpo as jgrpo  # noqa: E402
from twinseq.jax_backend import grpo_context_parallel as jcp  # noqa: E402

pytestmark = [pytest.mark.multi_device, pytest.mark.usefixtures("highest_precision")]

TOL = 1e-5
CP = 8


def _mesh():
    from twinseq.jax_backend.parallel import make_mesh

    if jax.device_count() < CP:
        pytest.skip(f"needs {CP} JAX devices (the root conftest sets XLA_FLAGS); found {jax.device_count()}")
    return make_mesh(data=1, cp=CP, devices=jax.devices()[:CP])


def _cb(padding_free: bool, vocab_size: int = 256):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, vocab_size, size=int(rng.integers(3, 12))).tolist() for _ in range(4)]
    completions = [rng.integers(3, vocab_size, size=int(rng.integers(2, 9))) for _ in range(4)]
    return collate_completions(
        prompts, completions, padding_free=padding_free, pad_token_id=0, num_columns=8, share_prefix=False
    )


@pytest.mark.parametrize("padding_free", [False, True])
def test_the_reordered_token_map_points_at_each_tokens_own_target(padding_free):
    from twinseq.common.data.batching import pad_batch

    cb = _cb(padding_free)
    batch = pad_batch(cb.batch, cb.batch.shape[0], 2 * CP)
    targets_BT = shift_labels(batch.labels)
    want_NC = np.zeros((cb.num_docs, cb.num_columns), np.int64)
    want_NC[cb.token_row_n, cb.token_col_n] = targets_BT[
        np.pad(cb.target_doc_ids, ((0, 0), (0, batch.shape[1] - cb.batch.shape[1])), constant_values=-1) >= 0
    ]
    reordered_T = shard_sequence(targets_BT, CP, axis=1).reshape(-1)
    flat_NC = jcp.reordered_flat_NC(cb, batch.shape, CP)
    valid = flat_NC >= 0
    assert valid.sum() == len(cb.token_row_n)
    np.testing.assert_array_equal(reordered_T[flat_NC[valid]], want_NC[valid])
    token_order = jcp.reordered_flat_NC(cb, batch.shape, 1)  # negative control: the map of the unreordered layout
    assert (reordered_T[token_order[valid]] != want_NC[valid]).sum() > valid.sum() // 2


@pytest.mark.parametrize("padding_free", [False, True])
def test_sharded_completion_logps_equal_one_devices(padding_free):
    from twinseq.jax_backend.model import split_trainable
    from twinseq.jax_backend.parallel import ring_attention_fn

    mesh = _mesh()
    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, init_weights(cfg, seed=0))
    cb = _cb(padding_free, cfg.vocab_size)
    want = jgrpo.compute_completion_logps(model, cb, temperature=0.9)
    graphdef, state, frozen = split_trainable(model)
    ci = jcp.CPCompletionInputs.of(cb, cfg.vocab_size, mesh, cb.batch.shape[0], 2 * CP)
    kw = dict(
        entropy_fn=jgrpo.chunked_entropy,
        attend=ring_attention_fn(mesh, "allgather"),
        loss_type="fused_linear",
        chunk_size=64,
        temperature=0.9,
        frozen=frozen,
    )
    got = np.asarray(jcp.cp_completion_logps_jit(graphdef, state, ci, **kw), np.float64)
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()
    bad_map = jax.numpy.asarray(jcp.reordered_flat_NC(cb, (ci.inputs[0].shape[0], ci.inputs[0].shape[1]), 1))
    bad = np.asarray(jcp.cp_completion_logps_jit(graphdef, state, jcp.CPCompletionInputs(ci.inputs, bad_map), **kw))
    assert np.abs(bad - want).max() > 100 * TOL


def _train(cfg: TrainConfig) -> tuple[list[dict], list]:
    """(per-step metrics, the first micro-batch's gradient leaves) of ``cfg.max_steps`` GRPO steps."""
    trainer, source, _, _ = jgrpo.build_grpo(cfg)
    first: list = []
    micro_step = trainer.micro_step

    def recording(mb):
        record, grads = micro_step(mb)
        if not first:
            first.extend(np.asarray(g, np.float64) for g in jax.tree.leaves(grads))
        return record, grads

    trainer.micro_step = recording
    keys = ("loss", "kl", "grad_norm", "reward", "completions/mean_length")
    return [
        {k: float(out[k]) for k in keys} for out in (trainer.step(source.next_step()) for _ in range(cfg.max_steps))
    ], first


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(), dict(padding_free=True, entropy_coef=0.05)], ids=["padded", "entropy"])
def test_grpo_trainer_on_the_cp_mesh_matches_one_device(overrides, tmp_path):
    _mesh()
    base = dict(
        task="grpo",
        backend="jax",
        model_config="tiny",
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_prompt_length=32,
        max_completion_length=8,
        num_iterations=2,
        grpo_beta=0.1,
        learning_rate=1e-3,
        max_grad_norm=None,
        seed=0,
        temperature=0.9,
        pad_to_multiple_of=2 * CP,
        share_prefix=False,
        output_dir=str(tmp_path),
        disable_tqdm=True,
        **overrides,
    )
    want, want_grads = _train(TrainConfig.from_flat(**base))
    got, got_grads = _train(TrainConfig.from_flat(**base, context_parallel_size=CP))
    assert max(abs(r["loss"]) for r in want) > 100 * TOL and want[-1]["kl"] > 100 * TOL
    for step, (g, w) in enumerate(zip(got, want), 1):
        for key in ("reward", "completions/mean_length"):  # the same completions were sampled
            assert g[key] == w[key], (step, key, g[key], w[key])
        for key in ("loss", "kl"):
            assert abs(g[key] - w[key]) <= TOL, (step, key, g[key], w[key])
        assert abs(g["grad_norm"] - w["grad_norm"]) <= TOL * w["grad_norm"], (step, g["grad_norm"], w["grad_norm"])
    assert len(got_grads) == len(want_grads)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(got_grads, want_grads))
    assert worst <= TOL, worst
