"""DPO under context parallelism (``dpo.cp_sequence_logps``, ``DPOTrainer.cp_micro_step``) on 2 gloo processes.

Invariants:
- DPO with ``context_parallel_size=2`` (FSDP2, cp=2) trains exactly like one process on the same rows: per step the
  loss, the pre-clip gradient norm and the policy's mean sequence log-probs within 1e-5 relative (the rewards within
  1e-5 absolute: a difference of two log-probs of ~100), the first step's gradients per tensor and the final
  weights within 1e-5 relative, for padded and padding-free micro-batches, with the ``allgather`` and ``ulysses``
  strategies, and with LoRA (the reference: the adapters off). Documents cross the shard boundary in every
  micro-batch (checked), and a document leak would show in the log-probs (checked).
- negative control: torch's differentiable all-reduce in place of ``sum_over_ranks`` counts every gradient cp
  times, and the comparison sees it.
- a rank's shifted targets and their documents are sharded alike (one process, numpy + torch); sharding the
  unshifted document ids instead misassigns targets at document edges.
- the CLI under ``torchrun --nproc-per-node 2`` trains ``--task dpo --context-parallel-size 2`` on the embedded
  preference data, its first step equal to one process's.
- what DPO under CP cannot run is refused before any work, naming the field, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
import _dist_workers as W  # noqa: E402
import _dpo_cp_workers as D  # noqa: E402

from twinseq.common.config import TrainConfig  # noqa: E402
from twinseq.common.data.context_parallel import cp_permutation, shard_doc_ids  # noqa: E402
from twinseq.common.data.preference_batching import collate_preference  # noqa: E402
from twinseq.common.data.preference_steps import PreferenceStepIterator  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.common.run.capabilities import Runtime, check_runtime  # noqa: E402
from twinseq.torch_backend.dpo import preference_shard  # noqa: E402

REL = 1e-5  # as tests/torch_backend/test_distributed.py
CP = 2
CP_FLAGS = dict(context_parallel_size=CP, pad_to_multiple_of=2 * CP)
LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, learning_rate=1e-2)
JOBS = {
    "padded": {},
    "padding_free": dict(padding_free=True),
    "ulysses": dict(padding_free=True, context_parallel_strategy="ulysses"),
    "lora": dict(padding_free=True, **LORA),
    # short pairs padded to 16 tokens: rank 1 holds no target of any micro-batch
    "empty_shard": dict(pad_to_multiple_of=16, per_device_train_batch_size=1),
}
ROWS = {"empty_shard": "short"}


def _rows(name: str) -> dict:
    return D.job_rows({"rows": ROWS.get(name), "data_seed": 0})


def _single_process(name: str, overrides: dict):
    """The single-process run of the same rows: the CP flags minus the cp size (the same padding)."""
    overrides = {k: v for k, v in overrides.items() if k != "context_parallel_strategy"}
    return D.train(D.make_config(**{"pad_to_multiple_of": 2 * CP, **overrides}), _rows(name))


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dpo_cp")


@pytest.fixture(scope="module")
def dist_results(dist_dir):
    jobs = [{"name": name, "data_seed": 0, "rows": ROWS.get(name),
             "config": D.make_config(**{**CP_FLAGS, **kw}).to_dict()} for name, kw in JOBS.items()]
    jobs.append({"name": "control", "data_seed": 0, "control": "autograd_all_reduce",
                 "config": D.make_config(**CP_FLAGS, max_steps=1).to_dict()})  # last: it patches the reduction
    return W.launch_script(D.__file__, {"jobs": jobs}, dist_dir, CP,
                           env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})


def _relative(got: dict, want: dict) -> dict[str, float]:
    """Per tensor ``||got - want|| / ||want||``; a tensor exactly zero in ``want`` must be exactly zero in ``got``."""
    assert sorted(got) == sorted(want)
    zero = [k for k in want if not np.any(want[k])]
    assert all(not np.any(got[k]) for k in zero) and len(zero) < len(want)
    return {k: float(np.linalg.norm(got[k] - want[k]) / np.linalg.norm(want[k])) for k in want if k not in zero}


def _assert_matches(records: list[dict], ref: list[dict]) -> None:
    assert len(records) == len(ref) == 4
    for step, (got, want) in enumerate(zip(records, ref), 1):
        for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
            rel = abs(got[key] - want[key]) / abs(want[key])
            assert rel <= REL, f"step {step} {key}: {got[key]} vs {want[key]} ({rel:.2e} relative)"
        for key in ("rewards/chosen", "rewards/rejected"):
            assert abs(got[key] - want[key]) <= REL, f"step {step} {key}: {got[key]} vs {want[key]}"


def _documents_crossing_shards(pbatch) -> int:
    """Documents whose targets lie on more than one rank's shard."""
    owners: dict[int, set] = {}
    for rank in range(CP):
        doc = preference_shard(pbatch, CP, rank).doc_BL.numpy()
        for d in np.unique(doc[doc >= 0]):
            owners.setdefault(int(d), set()).add(rank)
    return sum(len(r) > 1 for r in owners.values())


def _leak_changes_the_logps(pbatch) -> float:
    """Relative change of the policy's sequence log-probs when the documents of a padding-free row attend to each
    other (plain causal attention over the row)."""
    from twinseq.torch_backend.dpo import reference_logps

    model = W._model(D.make_config())
    batch = pbatch.batch
    mixed = dataclasses.replace(batch, segment_ids=(batch.segment_ids != 0).astype(np.int32),
                                position_ids=np.tile(np.arange(batch.input_ids.shape[1], dtype=np.int32),
                                                     (batch.input_ids.shape[0], 1)))
    good = torch.cat(reference_logps(model, pbatch))
    leaky = torch.cat(reference_logps(model, dataclasses.replace(pbatch, batch=mixed)))
    return float(((leaky - good).abs() / good.abs()).max())


pytestmark = [pytest.mark.distributed]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(JOBS))
def test_dpo_with_context_parallelism_on_two_ranks_matches_single_process(dist_results, dist_dir, name):
    assert dist_results[0][name] == dist_results[1][name], "the cp ranks logged different metrics"
    overrides = JOBS[name]
    cfg = D.make_config(**{"pad_to_multiple_of": 2 * CP, **overrides})
    step = PreferenceStepIterator(_rows(name), cfg, pad_token_id=0).next_step()
    if name == "empty_shard":
        assert all((preference_shard(pb, CP, 1).doc_BL < 0).all() for pb in step), "rank 1 must hold no target"
    else:
        assert all(_documents_crossing_shards(pb) >= 1 for pb in step), "documents must cross the shard boundary"
    if cfg.data.padding_free:
        assert _leak_changes_the_logps(step[0]) > 10 * REL, "a document leak must show in the log-probs"
    ref_records, ref_grads, ref_weights = _single_process(name, overrides)
    assert ref_records[-1]["loss"] < 0.95 * ref_records[0]["loss"], "the policy must learn, or an update could hide"
    _assert_matches(dist_results[0][name], ref_records)
    grads = _relative(dict(np.load(dist_dir / f"{name}_grads.npz")), ref_grads)
    worst = max(grads, key=grads.get)
    assert grads[worst] <= REL, f"{worst}: relative gradient difference {grads[worst]:.2e}"
    weights = {k: float(np.linalg.norm(v - ref_weights[k]) / np.linalg.norm(ref_weights[k]))
               for k, v in np.load(dist_dir / f"{name}_weights.npz").items()}
    assert sorted(weights) == sorted(ref_weights)
    worst = max(weights, key=weights.get)
    assert weights[worst] <= REL, f"{worst}: relative weight difference {weights[worst]:.2e}"
    if overrides.get("use_peft"):
        assert all("lora_" in k for k in ref_grads), "under LoRA only the adapters train"


@pytest.mark.slow
def test_a_gradient_summed_in_the_all_reduce_backward_is_caught(dist_results, dist_dir):
    """Negative control: the all-reduce whose backward sums over the cp ranks doubles every gradient (cp = 2)."""
    _, ref_grads, _ = _single_process("padded", {})
    got = dict(np.load(dist_dir / "control_grads.npz"))
    ratio = {k: float(np.linalg.norm(got[k]) / np.linalg.norm(ref_grads[k])) for k in ref_grads
             if np.any(ref_grads[k])}
    assert all(abs(r - CP) < 1e-3 for r in ratio.values()), ratio
    assert max(_relative(got, ref_grads).values()) > 0.5 > 100 * REL


# --------------------------------------------------------------------------------------
# One process: the shard's targets and documents
# --------------------------------------------------------------------------------------


def _pbatch(padding_free: bool):
    rows = D.preference_rows(num_pairs=3, seed=1)
    examples = [{k: rows[k][i] for k in rows} for i in range(3)]
    return collate_preference(examples, padding_free=padding_free, pad_to_multiple_of=2 * CP)


@pytest.mark.parametrize("padding_free", [False, True])
def test_shard_targets_and_their_documents_partition_the_batch(padding_free):
    """Every (target, document) pair of the batch is on exactly one rank, and per-document sums of any per-target
    value add up over the ranks to the unsharded ones; the unshifted document ids, sharded the same way, do not."""
    from twinseq.common.data.context_parallel import shard_sequence, split_shards
    from twinseq.common.data.preference_batching import _global_doc_ids
    from twinseq.common.objectives.nll import shift_labels

    pb = _pbatch(padding_free)
    targets, docs = shift_labels(pb.batch.labels), pb.target_doc_ids
    value = np.random.default_rng(0).standard_normal(docs.shape)  # a per-position "log-prob"
    want = np.bincount(docs[docs >= 0], weights=value[docs >= 0], minlength=pb.num_docs)
    got = np.zeros(pb.num_docs)
    pairs = []
    for rank in range(CP):
        shard = preference_shard(pb, CP, rank)
        t, d = shard.shard.targets.numpy(), shard.doc_BL.numpy()
        v = split_shards(shard_sequence(value, CP, axis=1), CP, axis=1)[rank]
        got += np.bincount(d[d >= 0], weights=v[d >= 0], minlength=pb.num_docs)
        pairs += list(zip(t[d >= 0].tolist(), d[d >= 0].tolist()))
        assert ((t != -100) == (d >= 0)).all(), "a target without a document, or a document without a target"
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert sorted(pairs) == sorted(zip(targets[docs >= 0].tolist(), docs[docs >= 0].tolist()))
    # negative control: shifting AFTER the zigzag reorder (the labels and documents of the reordered row) scores the
    # wrong tokens at every chunk edge
    labels_r = shard_sequence(pb.batch.labels, CP, axis=1)
    docs_r = shard_sequence(_global_doc_ids(pb.batch.segment_ids), CP, axis=1)
    targets_w = shift_labels(labels_r)
    docs_w = np.where(targets_w != -100, np.pad(docs_r[:, 1:], ((0, 0), (0, 1)), constant_values=-1), -1)
    value_r = shard_sequence(value, CP, axis=1)
    wrong = np.bincount(docs_w[docs_w >= 0], weights=value_r[docs_w >= 0], minlength=pb.num_docs)
    assert not np.allclose(wrong, want)


def test_shard_doc_ids_follow_the_zigzag_permutation():
    T = 16
    doc = np.arange(T)[None]
    shards = [shard_doc_ids(doc, CP, r) for r in range(CP)]
    np.testing.assert_array_equal(np.concatenate(shards, axis=1)[0], cp_permutation(T, CP))


# --------------------------------------------------------------------------------------
# Refusals (one process, before any work)
# --------------------------------------------------------------------------------------


def _check(world_size: int = CP, device: str = "cpu", **kw):
    cfg = TrainConfig.from_flat(task="dpo", context_parallel_size=CP, **kw)
    check_runtime(cfg, Runtime("torch", device, world_size, accelerator=device == "cuda"))


def test_dpo_context_parallel_configs_that_run_pass_the_check():
    _check()
    _check(padding_free=True, context_parallel_strategy="ulysses")
    _check(use_peft=True)
    _check(pad_to_multiple_of=8, loss_type="chunked_nll")


@pytest.mark.parametrize("kw, fragments", [
    (dict(world_size=4), ["world_size=4", "--nproc-per-node 2"]),
    (dict(context_parallel_strategy="ring", device="cuda"), ["context_parallel_strategy='ring'", "allgather"]),
    (dict(loss_type="liger", device="cuda"), ["loss_type='liger'", "--loss-type fused_linear"]),
    (dict(precompute_ref_log_probs=True), ["precompute_ref_log_probs=True", "drop --precompute-ref-log-probs"]),
    (dict(use_peft=True, load_in_4bit=True, device="cuda"), ["load_in_4bit=True", "drop --load-in-4bit"]),
    (dict(eval_strategy="steps", eval_fraction=0.1), ["eval_strategy='steps'", "--eval-strategy no"]),
    (dict(optimizer_in_backward=True), ["optimizer_in_backward=True", "drop --optimizer-in-backward"]),
])
def test_what_dpo_under_context_parallelism_cannot_run_is_refused(kw, fragments):
    with pytest.raises(ConfigError) as err:
        _check(**kw)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


# --------------------------------------------------------------------------------------
# The CLI under torchrun
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_twinseq_train_dpo_under_torchrun_with_context_parallelism(tmp_path):
    """``twinseq train --task dpo --context-parallel-size 2`` under ``torchrun --nproc-per-node 2`` on the embedded
    preference data: rank 0 writes 3 steps of metrics, the first equal to the single-process step on the same
    batches (the loss is log 2 at the start, so the log-probs and the gradient norm carry the check), and the saved
    final/ model was trained."""
    from twinseq.common.config import ModelConfig
    from twinseq.common.models.init import init_weights
    from twinseq.common.run.report import REQUIRED_FIELDS, read_metrics
    from twinseq.torch_backend.checkpoint import load_pretrained
    from twinseq.torch_backend.model import export_weights
    from twinseq.torch_backend.trainer import build_dpo

    flags = dict(task="dpo", max_length=64, per_device_train_batch_size=2, padding_free=True,
                 context_parallel_size=CP, pad_to_multiple_of=2 * CP, learning_rate=1e-3, max_steps=3,
                 output_dir=str(tmp_path / "run"), disable_tqdm=True, model_config="tiny")
    argv = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={CP}",
           "-m", "twinseq.common.cli", "train", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "cp strategy=allgather" in proc.stdout + proc.stderr

    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3] and all(k in r for r in records for k in REQUIRED_FIELDS)
    cfg = TrainConfig.from_flat(**flags).replace(context_parallel_size=1, output_dir=str(tmp_path / "one"))
    trainer, source, _, _ = build_dpo(cfg, torch.device("cpu"), None)
    want = trainer.step(source.next_step())
    for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
        assert abs(records[0][key] - want[key]) / abs(want[key]) <= REL, (key, records[0][key], want[key])
    initial = init_weights(ModelConfig.preset("tiny"), seed=cfg.seed)
    trained = export_weights(load_pretrained(tmp_path / "run" / "final"))
    assert sorted(trained) == sorted(initial)
    assert max(float(np.abs(trained[k] - initial[k]).max()) for k in initial) > 1e-4
