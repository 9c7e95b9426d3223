"""JAX DPO under context parallelism: a preference micro-batch sharded over ``cp`` (zigzag order), ring attention,
per-document log-prob sums reduced over the shards.

Invariants (float32, matmuls at full precision):
- ``parallel.shard_preference_batch`` keeps every shifted target with its document: unsharded, the targets are
  ``shift_labels(labels)`` and the document ids ``target_doc_ids``; each shard's partial per-document sums add up
  to the whole batch's (the numpy reference);
- on 8 host devices, DPO with cp=2 and cp=8 (and cp=4 x data=2 for padded rows), padded and padding-free, with
  documents crossing cp shard boundaries, gives the single-device loss within 1e-5 relative, its sequence
  log-probs within 1e-5 and every gradient within 1e-5 absolute (``test_ring_attention``'s ``TOL``);
- the comparison can fail: targets shifted a second time, or document ids left in token order, move the
  log-probs by far more than the bounds;
- the reference passes (live and precomputed) give the single-device log-probs; ``DPOTrainer`` on the mesh
  steps and evaluates as on one device;
- ``twinseq train --task dpo --backend jax --context-parallel-size N`` in a fresh process follows the
  single-device run's loss and gradient-norm trajectory within 1e-5 relative; a cp that leaves a data axis is
  refused before any work, naming the field, the value and the fix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from twinseq.common.config import ModelConfig, TrainConfig  # noqa: E402
from twinseq.common.data.context_parallel import cp_permutation, unshard_sequence  # noqa: E402
from twinseq.common.data.preference_batching import (  # noqa: E402
    collate_preference,
    sequence_logps_from_logits,
    sequence_logps_from_tokens,
    token_logps_from_logits,
)
from twinseq.common.data.preference_steps import preference_columns  # noqa: E402
from twinseq.common.models.init import init_weights  # noqa: E402
from twinseq.common.objectives.dpo import validate_dpo_config  # noqa: E402
from twinseq.common.objectives.nll import shift_labels  # noqa: E402
from twinseq.jax_backend import build_model, logits  # noqa: E402
from twinseq.jax_backend import dpo as jdpo  # noqa: E402

pytestmark = [pytest.mark.multi_device, pytest.mark.usefixtures("highest_precision")]

LOSS_REL = 1e-5  # the acceptance bound of the JAX CP tests (test_sharded_training.CP_LOSS_REL)
TOL = 1e-5  # test_ring_attention.TOL: max abs difference of outputs and gradients
LENGTHS = ((5, 7, 4), (3, 9, 6), (8, 2, 5), (4, 5, 10))  # (prompt, chosen, rejected) tokens per pair
CONFIG = validate_dpo_config(["sigmoid", "ipo"], [1.0, 0.5], beta=0.5)


def _needs_eight_devices():
    if jax.device_count() < 8:
        pytest.skip(f"needs 8 JAX devices (the root conftest sets XLA_FLAGS); found {jax.device_count()}")


def _mesh(data: int, cp: int):
    from twinseq.jax_backend.parallel import make_mesh

    _needs_eight_devices()
    return make_mesh(data=data, cp=cp, devices=jax.devices()[: data * cp])


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.preset("tiny")
    return cfg, build_model(cfg, init_weights(cfg, seed=0))


def _examples(vocab_size: int) -> list[dict]:
    rng = np.random.default_rng(3)
    return [{"prompt_input_ids": rng.integers(3, vocab_size, p).tolist(),
             "chosen_input_ids": rng.integers(3, vocab_size, c).tolist(),
             "rejected_input_ids": rng.integers(3, vocab_size, r).tolist()} for p, c, r in LENGTHS]


def _pbatch(vocab_size: int, padding_free: bool):
    return collate_preference(_examples(vocab_size), padding_free=padding_free, pad_to_multiple_of=16)


def _documents_cross_shards(pbatch, cp: int) -> bool:
    """Some scored document has targets on two cp shards (the case a per-shard sum without a reduction breaks)."""
    t = pbatch.target_doc_ids.shape[1]
    owner_T = np.argsort(cp_permutation(t, cp)) // (t // cp)
    return any(len(set(owner_T[doc_T == d])) > 1 for doc_T in pbatch.target_doc_ids for d in set(doc_T) - {-1})


@pytest.fixture(scope="module")
def single_device(tiny):
    """Per layout: (batch, reference log-probs, (loss, grads, per-pair)) on one device."""
    cfg, model = tiny
    out = {}
    for padding_free in (False, True):
        pb = _pbatch(cfg.vocab_size, padding_free)
        c, r = sequence_logps_from_logits(logits(model, pb.batch), pb)
        refs = dict(ref_chosen_logps=c + 0.7, ref_rejected_logps=r - 0.4)
        out[padding_free] = pb, refs, jdpo.dpo_loss_and_grads(model, pb, CONFIG, **refs)
    return out


# --------------------------------------------------------------------------------------
# The sharded batch
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding_free", [False, True])
def test_sharded_preference_batch_keeps_targets_with_their_documents(tiny, padding_free):
    from twinseq.jax_backend.parallel import shard_preference_batch

    cfg, model = tiny
    cp = 2
    pb = _pbatch(cfg.vocab_size, padding_free)
    assert _documents_cross_shards(pb, cp)
    input_ids, _, _, targets, doc_ids, counts = shard_preference_batch(pb, _mesh(1, cp))
    assert doc_ids.sharding.spec == targets.sharding.spec and doc_ids.sharding.spec[1] == "cp"
    np.testing.assert_array_equal(unshard_sequence(np.asarray(targets), cp, axis=1), shift_labels(pb.batch.labels))
    np.testing.assert_array_equal(unshard_sequence(np.asarray(doc_ids), cp, axis=1), pb.target_doc_ids)
    np.testing.assert_array_equal(unshard_sequence(np.asarray(input_ids), cp, axis=1), pb.batch.input_ids)
    np.testing.assert_array_equal(np.asarray(counts), pb.num_target_tokens)
    # each rank's partial sums (its shard of the reordered token log-probs) add up to the whole batch's
    token_BT = token_logps_from_logits(logits(model, pb.batch), pb)
    reordered_BT, docs_BT = (np.take(x, cp_permutation(x.shape[1], cp), axis=1) for x in (token_BT, pb.target_doc_ids))
    partial = [np.bincount(d[d >= 0], weights=x[d >= 0], minlength=pb.num_docs)
               for x, d in zip(np.split(reordered_BT, cp, axis=1), np.split(docs_BT, cp, axis=1))]
    assert sum(bool(p.any()) for p in partial) == cp  # every rank holds scored targets
    np.testing.assert_allclose(np.sum(partial, axis=0), np.concatenate(sequence_logps_from_tokens(token_BT, pb)),
                               rtol=0, atol=1e-9)


# --------------------------------------------------------------------------------------
# Loss and gradients on the mesh vs one device
# --------------------------------------------------------------------------------------


def _assert_matches(got, want, label):
    loss, grads, pairs = got
    want_loss, want_grads, want_pairs = want
    loss_rel = abs(loss - want_loss) / abs(want_loss)
    grad_abs = max(float(np.abs(grads[k] - want_grads[k]).max()) for k in want_grads)
    logp_abs = max(float(np.abs(pairs[k] - want_pairs[k]).max()) for k in ("chosen_logps", "rejected_logps"))
    print(f"{label}: loss rel {loss_rel:.2e}, max grad abs {grad_abs:.2e}, max logp abs {logp_abs:.2e}")
    assert set(grads) == set(want_grads)
    assert loss_rel <= LOSS_REL, (label, loss, want_loss)
    assert logp_abs <= TOL, label
    assert grad_abs <= TOL, label
    assert max(float(np.abs(g).max()) for g in want_grads.values()) > 100 * TOL  # the gradients are not ~0


@pytest.mark.parametrize("data,cp,padding_free", [
    (1, 2, False),
    (1, 2, True),
    pytest.param(1, 8, False, marks=pytest.mark.slow),
    pytest.param(1, 8, True, marks=pytest.mark.slow),
    pytest.param(2, 4, False, marks=pytest.mark.slow),  # padded rows split over data too
])
def test_dpo_on_the_mesh_equals_one_device(tiny, single_device, data, cp, padding_free):
    cfg, model = tiny
    pb, refs, want = single_device[padding_free]
    assert _documents_cross_shards(pb, cp)
    strategy = "allgather" if padding_free else "ring"
    got = jdpo.context_parallel_dpo_loss_and_grads(model, pb, CONFIG, _mesh(data, cp), strategy=strategy, **refs)
    _assert_matches(got, want, f"data={data} x cp={cp}, padding_free={padding_free}, {strategy}")


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["nll", "chunked_nll"])
def test_every_log_prob_kernel_reduces_over_the_shards(tiny, single_device, loss_type):
    cfg, model = tiny
    pb, refs, _ = single_device[True]
    want = jdpo.dpo_loss_and_grads(model, pb, CONFIG, loss_type=loss_type, chunk_size=8, **refs)
    got = jdpo.context_parallel_dpo_loss_and_grads(model, pb, CONFIG, _mesh(1, 2), loss_type=loss_type, chunk_size=8,
                                                   **refs)
    _assert_matches(got, want, f"cp=2, {loss_type}")


@pytest.mark.parametrize("fault", ["targets shifted twice", "document ids in token order"])
def test_the_comparison_sees_a_misaligned_shard(tiny, single_device, fault):
    """Negative controls: the bugs a CP log-prob path invites move the log-probs far beyond ``TOL``."""
    from flax import nnx

    from twinseq.jax_backend.parallel import batch_sharding

    cfg, model = tiny
    pb, _, (_, _, want_pairs) = single_device[True]
    mesh = _mesh(1, 2)
    inputs, keywords = jdpo.step_inputs(jdpo.pad_for_mesh(pb, mesh), cfg.vocab_size, mesh)
    if fault == "targets shifted twice":
        keywords["targets_are_shifted"] = False
    else:
        inputs = (*inputs[:4], jax.device_put(np.asarray(pb.target_doc_ids, np.int32), batch_sharding(mesh)), inputs[5])
    graphdef, state = nnx.split(model)
    logps_D = np.asarray(jdpo.sequence_logps_jit(graphdef, jdpo._state_on(mesh, state)[0], inputs,
                                                 loss_type="fused_linear", chunk_size=1024, **keywords))
    want_D = np.concatenate([want_pairs["chosen_logps"], want_pairs["rejected_logps"]])
    print(f"negative control, {fault}: max logp abs {np.abs(logps_D - want_D).max():.2e}")
    assert np.abs(logps_D - want_D).max() > 1000 * TOL, fault


# --------------------------------------------------------------------------------------
# The reference passes
# --------------------------------------------------------------------------------------


def test_reference_log_probs_on_the_mesh(tiny, single_device):
    cfg, model = tiny
    pb, _, (_, _, pairs) = single_device[False]
    mesh = _mesh(1, 2)
    c, r = jdpo.context_parallel_sequence_logps(model, pb, mesh)
    np.testing.assert_allclose(c, pairs["chosen_logps"], rtol=0, atol=TOL)
    np.testing.assert_allclose(r, pairs["rejected_logps"], rtol=0, atol=TOL)
    rows = {k: [ex[k] for ex in _examples(cfg.vocab_size)] for k in _examples(cfg.vocab_size)[0]}
    train_cfg = TrainConfig.from_flat(task="dpo", backend="jax", per_device_train_batch_size=2, padding_free=True,
                                      context_parallel_size=2, context_parallel_strategy="ring")
    sharded = preference_columns(jdpo.precompute_ref_logps(model, rows, train_cfg, 0, bucket=16, mesh=mesh))
    single = preference_columns(jdpo.precompute_ref_logps(model, rows, train_cfg, 0, bucket=16))
    for key in ("ref_chosen_logps", "ref_rejected_logps"):
        np.testing.assert_allclose(sharded[key], single[key], rtol=0, atol=TOL)


# --------------------------------------------------------------------------------------
# The trainer and the CLI
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_step_and_evaluation_on_the_mesh_equal_one_device(tiny):
    """``DPOTrainer`` with a (data=1, cp=2) mesh: one optimizer step (live reference) and an evaluation pass give
    the one-device trainer's loss, gradient norm and log-probs."""
    from twinseq.jax_backend.parallel import parallelize
    from twinseq.jax_backend.trainer import DPOTrainer

    cfg, _ = tiny
    pb = _pbatch(cfg.vocab_size, padding_free=True)
    results = []
    for mesh in (None, _mesh(1, 2)):
        train_cfg = TrainConfig.from_flat(task="dpo", backend="jax", pad_to_multiple_of=16, max_steps=2,
                                          padding_free=True, context_parallel_size=1 if mesh is None else 2,
                                          context_parallel_strategy="ring")
        model = parallelize(build_model(cfg, init_weights(cfg, seed=0)), mesh, train_cfg)
        trainer = DPOTrainer(model, train_cfg, config=CONFIG, examples_per_step=pb.num_examples, live_reference=True,
                             mesh=mesh)
        results.append((trainer.step([pb]), trainer.eval_micro_step(pb)))
    (want, want_eval), (got, got_eval) = results
    assert abs(got["loss"] - want["loss"]) <= LOSS_REL * abs(want["loss"])
    assert abs(got["grad_norm"] - want["grad_norm"]) <= LOSS_REL * want["grad_norm"]
    assert set(got_eval) == set(want_eval) == {"chosen_logps", "rejected_logps", "ref_chosen_logps",
                                               "ref_rejected_logps"}
    for key in want_eval:
        np.testing.assert_allclose(got_eval[key], want_eval[key], rtol=0, atol=TOL)
    assert np.abs(want_eval["chosen_logps"] - want_eval["ref_chosen_logps"]).max() > 100 * TOL  # the step moved it


def test_a_data_axis_is_refused_with_the_fix():
    from twinseq.common.run.capabilities import Runtime, check_runtime

    def check(cp: int, devices: int):
        check_runtime(TrainConfig.from_flat(backend="jax", task="dpo", context_parallel_size=cp),
                      Runtime("jax", "cpu", devices))

    check(8, 8)
    check(2, 2)
    with pytest.raises(ValueError, match=r"context_parallel_size=2 with task='dpo' on 8 visible devices .* "
                                         r"data-parallel axis of 4.*--context-parallel-size 8.*device_count=2"):
        check(2, 8)


def _train(tmp_path, name: str, devices: int, *flags: str) -> list[dict]:
    """``twinseq train --task dpo --backend jax`` in a fresh process on ``devices`` host devices."""
    out = tmp_path / name
    argv = ["train", "--task", "dpo", "--backend", "jax", "--model-config", "tiny", "--max-length", "64",
            "--per-device-train-batch-size", "2", "--pad-to-multiple-of", "16", "--max-steps", "3",
            "--learning-rate", "1e-3", "--output-dir", str(out), "--disable-tqdm",
            "--no-share-prefix",  # context parallelism does not share prompts: the one-device run lays rows alike
            *flags]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    proc = subprocess.run([sys.executable, "-m", "twinseq.common.cli", *argv], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"'cp': {devices}" in proc.stdout + proc.stderr or devices == 1
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single_device_cli(tmp_path_factory):
    """The single-device run of a set of flags, run once per module."""
    runs: dict[tuple, list[dict]] = {}

    def run(flags: tuple) -> list[dict]:
        if flags not in runs:
            runs[flags] = _train(tmp_path_factory.mktemp("single"), "out", 1, *flags)
        return runs[flags]

    return run


PEFT_FLAGS = ["--use-peft", "--lora-dropout", "0", "--precompute-ref-log-probs"]


@pytest.mark.slow
@pytest.mark.parametrize("cp,flags", [
    (2, ["--context-parallel-strategy", "ring"]),
    (8, ["--padding-free", "--context-parallel-strategy", "allgather"]),
    (2, PEFT_FLAGS),  # adapters, their base as the precomputed reference (no LoRA dropout: see docs/long-context.md)
], ids=["cp2-padded-ring", "cp8-padding-free-allgather", "cp2-peft-precomputed"])
def test_cli_dpo_with_context_parallelism_follows_one_device(tmp_path, single_device_cli, cp, flags):
    got = _train(tmp_path, f"cp{cp}", cp, "--context-parallel-size", str(cp), *flags)
    want = single_device_cli(tuple(f for f in flags if "strateg" not in f and f not in ("ring", "allgather")))
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    worst = 0.0
    for a, b in zip(got, want):
        assert np.isfinite(a["loss"]) and (a["num_tokens"], a["num_label_tokens"]) == (b["num_tokens"],
                                                                                   b["num_label_tokens"])
        rel = abs(a["loss"] - b["loss"]) / abs(b["loss"])
        worst = max(worst, rel, abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"])
        assert rel <= LOSS_REL, (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= LOSS_REL * b["grad_norm"], a["step"]
    assert got[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # the reference starts as the policy
    assert got[1]["loss"] != got[0]["loss"]  # the first step moved the policy: later steps are not the trivial log 2
    print(f"cli cp={cp} {flags}: worst loss / grad-norm rel {worst:.2e} over 3 steps")
