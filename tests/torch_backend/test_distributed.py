"""FSDP2 and context parallelism (``twinseq.torch_backend.parallel``) on 2 gloo processes.

Invariants:
- FSDP2 over 2 ranks trains exactly like one process on the same step (same rows, same
  ``num_items_in_batch``): per-step loss and pre-clip gradient norm within 1e-5 relative over
  10 steps. The gradient norm catches a gradient averaged instead of summed over ranks, which
  Adam would hide in the loss (it is invariant to the gradient scale).
- FSDP2 + ``allgather`` CP (cp=2) on PACKED rows, whose documents cross the shard boundary,
  does the same; the data is checked to be sensitive to a document leak (ANCHORS failure 2).
- an epoch's short last step (9 rows at 4 per step: 1 row, so rank 1 gets a padding-only micro-batch) keeps
  the ranks in step and trains as one process does on the same rows;
- allgather CP attention and its gradients (through the reduce-scatter of K/V) equal dense
  document-masked attention of the whole row, on every rank.
- Bad configurations fail with an error that names the fix (single process, no spawn).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
import _dist_workers as W  # noqa: E402

from twinseq.common.data.batching import collate  # noqa: E402
from twinseq.common.config import TrainConfig  # noqa: E402
from twinseq.common.data.context_parallel import cp_permutation  # noqa: E402
from twinseq.torch_backend import context_parallel as cpmod  # noqa: E402
from twinseq.common.run.capabilities import Runtime, check_runtime  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.torch_backend.distributed import MeshConfig, check_launcher_env, wants_distributed  # noqa: E402

REL = 1e-5
CP = 2

FSDP_CFG = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1)
# the single process sees the same 4 rows per step as 2 ranks x 2 rows: as 2 micro-batches of 2
FSDP_REF_CFG = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2)
CP_PACKED_CFG = dict(packing=True, pad_to_multiple_of=2 * CP, context_parallel_size=CP,
                     per_device_train_batch_size=2, gradient_accumulation_steps=2)
CP_PADFREE_CFG = dict(packing=True, padding_free=True, pad_to_multiple_of=2 * CP, context_parallel_size=CP,
                      per_device_train_batch_size=3, gradient_accumulation_steps=1)
# LoRA (r=4 on every linear layer, plus two trainable token rows of the tied embedding) under FSDP2
LORA = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, trainable_token_indices=[3, 4],
            learning_rate=1e-2)
DIST_JOBS = {"fsdp": FSDP_CFG, "cp_packed": CP_PACKED_CFG, "cp_padding_free": CP_PADFREE_CFG,
             "fsdp_lora": {**FSDP_CFG, **LORA}}
EPOCH_DOCS = 9  # 3 steps per epoch (4, 4, 1 rows): 10 steps cross 3 epoch ends


# --------------------------------------------------------------------------------------
# Spawned: one 2-process job runs every distributed check (process start-up dominates)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="module")
def dist_results(dist_dir):
    jobs = [{"kind": "attention", "name": "attention"}]
    jobs += [{"kind": "train", "name": name, "data_seed": 0,
              "config": dataclasses.asdict(W.make_config(**overrides))} for name, overrides in DIST_JOBS.items()]
    jobs.append({"kind": "train", "name": "fsdp_epochs", "data_seed": 0, "num_docs": EPOCH_DOCS,
                 "config": dataclasses.asdict(W.make_config(**FSDP_CFG))})
    return W.launch({"jobs": jobs}, dist_dir, world_size=2)


def _assert_losses_match(dist_losses, ref_losses):
    got, want = np.asarray(dist_losses), np.asarray(ref_losses)
    assert got.shape == want.shape == (10,)
    rel = np.abs(got - want) / np.abs(want)
    assert rel.max() <= REL, f"max relative loss difference {rel.max():.2e}:\n{got}\n{want}"


def _assert_grads_match(dist_dir: Path, name: str, ref_cfg: dict):
    """First-step gradients per tensor: catches a gradient averaged instead of summed over ranks,
    which the loss alone would hide (Adam is invariant to the gradient scale). A tensor whose gradient is
    exactly zero (LoRA's lora_A at step 1, when lora_B = 0) must be exactly zero on both sides."""
    got = dict(np.load(dist_dir / f"grads_{name}.npz"))
    want = W.reference_grads(W.make_config(**ref_cfg), W.synthetic_rows(seed=0))
    assert sorted(got) == sorted(want)
    zero = [k for k in want if not np.any(want[k])]
    assert all(not np.any(got[k]) for k in zero) and len(zero) < len(want)
    rel = {k: float(np.linalg.norm(got[k] - want[k]) / np.linalg.norm(want[k])) for k in want if k not in zero}
    worst = max(rel, key=rel.get)
    assert rel[worst] <= REL, f"{worst}: relative gradient difference {rel[worst]:.2e}"


def _assert_ranks_agree(dist_results, name):
    assert dist_results[0][name] == dist_results[1][name], "ranks logged different reduced metrics"


pytestmark = [pytest.mark.distributed]


@pytest.mark.slow
def test_allgather_attention_and_grads_match_dense_on_every_rank(dist_results):
    for rank, result in enumerate(dist_results):
        errors = result["attention"]
        assert max(errors.values()) < 1e-12, f"rank {rank}: {errors}"  # float64 inputs


@pytest.mark.slow
def test_fsdp2_on_two_ranks_matches_single_process(dist_results, dist_dir):
    _assert_ranks_agree(dist_results, "fsdp")
    ref = W.reference_losses(W.make_config(**FSDP_REF_CFG), W.synthetic_rows(seed=0))
    _assert_losses_match(dist_results[0]["fsdp"], ref)
    assert ref[-1] < 0.95 * ref[0], "the data must be learnable, or a wrong update could go unnoticed"
    _assert_grads_match(dist_dir, "fsdp", FSDP_REF_CFG)


@pytest.mark.slow
def test_fsdp2_short_last_steps_of_epochs_match_single_process(dist_results):
    """Each epoch's last step has 1 row: rank 0 trains on it, rank 1 on a padding-only micro-batch (no document, no
    label), and the step equals the single process's step on that row."""
    _assert_ranks_agree(dist_results, "fsdp_epochs")
    ref = W.reference_losses(W.make_config(**FSDP_REF_CFG), W.synthetic_rows(num_docs=EPOCH_DOCS, seed=0))
    _assert_losses_match(dist_results[0]["fsdp_epochs"], ref)


@pytest.mark.slow
def test_fsdp2_lora_on_two_ranks_matches_single_process(dist_results, dist_dir):
    """LoRA + trainable tokens under FSDP2 (frozen base sharded with the adapters): the losses of 10 steps and
    the first step's adapter gradients equal the single-process trainer's (2 micro-batches of 2 rows)."""
    _assert_ranks_agree(dist_results, "fsdp_lora")
    ref = W.reference_losses(W.make_config(**{**FSDP_REF_CFG, **LORA}), W.synthetic_rows(seed=0))
    _assert_losses_match(dist_results[0]["fsdp_lora"], ref)
    # the adapters must learn, or a wrong update could go unnoticed: against the same run with learning rate 0
    # (random-init tiny barely moves under LoRA, so the control, not a fraction of the first loss, is the bar)
    frozen = W.reference_losses(W.make_config(**{**FSDP_REF_CFG, **LORA, "learning_rate": 0.0}),
                                W.synthetic_rows(seed=0))
    assert ref[0] == frozen[0] and all(r < f for r, f in zip(ref[1:], frozen[1:])), (ref, frozen)
    assert max(f - r for r, f in zip(ref, frozen)) > 0.05
    got = dict(np.load(dist_dir / "grads_fsdp_lora.npz"))
    assert got and all("lora_" in k or "trainable_tokens" in k for k in got)
    _assert_grads_match(dist_dir, "fsdp_lora", {**FSDP_REF_CFG, **LORA})


def _documents_crossing_shards(batches, cp: int) -> int:
    """Documents with tokens on more than one rank's shard, over all rows of ``batches``."""
    count = 0
    for batch in batches:
        owner_T = np.empty(batch.input_ids.shape[1], dtype=np.int64)
        owner_T[cp_permutation(batch.input_ids.shape[1], cp)] = np.repeat(np.arange(cp), batch.input_ids.shape[1] // cp)
        for seg_T in batch.segment_ids:
            for s in np.unique(seg_T[seg_T != 0]):
                count += len(np.unique(owner_T[seg_T == s])) > 1
    return count


def _leak_changes_the_loss(batch) -> float:
    """Relative change of ``batch``'s loss when documents are mixed (plain causal attention over the row)."""
    from twinseq.common.config import ModelConfig
    from twinseq.common.models.init import init_weights
    from twinseq.torch_backend.model import build_model, compute_loss

    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, init_weights(cfg, seed=0))
    mixed = dataclasses.replace(batch, segment_ids=(batch.segment_ids != 0).astype(np.int32),
                                position_ids=np.tile(np.arange(batch.input_ids.shape[1], dtype=np.int32),
                                                     (batch.input_ids.shape[0], 1)))
    with torch.no_grad():
        masked, leaky = float(compute_loss(model, batch)), float(compute_loss(model, mixed))
    return abs(leaky - masked) / masked


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cp_packed", "cp_padding_free"])
def test_fsdp2_allgather_cp_on_packed_rows_matches_single_process(dist_results, dist_dir, name):
    _assert_ranks_agree(dist_results, name)
    ref, steps = W.reference_losses(W.make_config(**DIST_JOBS[name]), W.synthetic_rows(seed=0), return_batches=True)
    batches = [b for step in steps for b in step]
    assert all(int(b.segment_ids.max()) > 1 for b in batches), "every row must pack several documents"
    assert _documents_crossing_shards(batches, CP) >= len(batches), "documents must cross the shard boundary"
    # at init the model attends almost uniformly, so a leak moves the loss least; still >10x the tolerance
    assert _leak_changes_the_loss(batches[0]) > 10 * REL, "a document leak must show in the loss"
    _assert_losses_match(dist_results[0][name], ref)
    _assert_grads_match(dist_dir, name, DIST_JOBS[name])


RING_CFG = dict(context_parallel_size=CP, context_parallel_strategy="ring", pad_to_multiple_of=2 * CP,
                per_device_train_batch_size=2, gradient_accumulation_steps=2)


@pytest.mark.gpu
@pytest.mark.slow
def test_fsdp2_ring_cp_on_two_gpus_matches_single_process(tmp_path):
    """torch's native ring attention (NCCL, head-tail balanced) on unpacked, right-padded rows."""
    if torch.cuda.device_count() < CP:
        pytest.skip(f"the ring needs {CP} CUDA GPUs (one rank each, NCCL); found {torch.cuda.device_count()}")
    job = {"kind": "train", "name": "ring", "data_seed": 0, "config": dataclasses.asdict(W.make_config(**RING_CFG))}
    results = W.launch({"jobs": [job]}, tmp_path, world_size=CP, cuda=True)
    _assert_ranks_agree(results, "ring")
    _assert_losses_match(results[0]["ring"], W.reference_losses(W.make_config(**RING_CFG), W.synthetic_rows(seed=0)))
    _assert_grads_match(tmp_path, "ring", RING_CFG)


# --------------------------------------------------------------------------------------
# Single process: sharding helpers, the attention math, and the refusals
# --------------------------------------------------------------------------------------


def test_torch_head_tail_order_is_the_common_zigzag_order():
    for T, cp in ((8, 2), (24, 2), (16, 4), (48, 3)):
        assert np.array_equal(cpmod.ring_load_balancer_indices(T, cp), cp_permutation(T, cp)), (T, cp)


def test_rank_shards_partition_the_targets_and_tokens():
    batch = W.packed_batch()
    shards = [cpmod.shard_for_rank(batch, CP, r) for r in range(CP)]
    assert sum(s.num_label_tokens for s in shards) == batch.num_label_tokens
    assert sum(s.num_tokens for s in shards) == batch.num_tokens
    targets = np.concatenate([s.targets.numpy() for s in shards], axis=1)
    from twinseq.common.objectives.nll import shift_labels

    assert np.array_equal(targets, shift_labels(batch.labels)[:, cp_permutation(batch.input_ids.shape[1], CP)])


@pytest.mark.parametrize("cp", [2, 4])
def test_allgather_attention_per_rank_equals_dense_attention(cp):
    """Each rank's queries against the gathered keys (simulated in one process) == dense attention."""
    import torch.nn.functional as F

    from twinseq.torch_backend.attention import document_mask

    batch = W.packed_batch(pad_to=2 * cp)
    B, T = batch.input_ids.shape
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, 8, generator=gen, dtype=torch.float64) for n in (4, 2, 2))
    seg, pos = (torch.as_tensor(x, dtype=torch.long) for x in (batch.segment_ids, batch.position_ids))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(seg, pos, torch.float64), enable_gqa=True)
    perm = torch.as_tensor(cp_permutation(T, cp))
    L = T // cp
    for rank in range(cp):
        mine = perm[rank * L:(rank + 1) * L]
        allowed = cpmod.cp_allowed_mask(seg[:, mine], pos[:, mine], seg[:, perm], pos[:, perm], rank * L)
        out = cpmod.local_document_attention(q[:, :, mine], k[:, :, perm], v[:, :, perm], allowed, None)
        real = (seg[:, mine] != 0)[:, None, :, None]
        assert float(((out - dense[:, :, mine]).abs() * real).max()) < 1e-12


def _cfg(**kw) -> TrainConfig:
    return TrainConfig.from_flat(**kw)


@pytest.mark.parametrize("kw, world, device, fragment", [
    (dict(context_parallel_size=4, pad_to_multiple_of=8), 2, "cpu", "larger than the 2 processes"),
    (dict(context_parallel_size=2, pad_to_multiple_of=4), 3, "cpu", "does not divide the 3 processes"),
    (dict(context_parallel_size=2, pad_to_multiple_of=6), 2, "cpu", "--pad-to-multiple-of 12"),
    (dict(context_parallel_size=2, pad_to_multiple_of=4, context_parallel_strategy="ring"), 2, "cpu",
     "needs CUDA SDPA"),
    (dict(context_parallel_size=2, pad_to_multiple_of=4, context_parallel_strategy="ring", packing=True), 2, "cuda",
     "cannot mask packed documents"),
    (dict(context_parallel_size=2, pad_to_multiple_of=4, context_parallel_strategy="ring", padding_free=True), 2,
     "cuda", "cannot mask packed documents"),
    (dict(context_parallel_size=2, pad_to_multiple_of=4, context_parallel_strategy="ring", padding_side="left"), 2,
     "cuda", "--padding-side right"),
])
def test_bad_parallel_configs_are_refused(kw, world, device, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        check_runtime(_cfg(**kw), Runtime("torch", device, world, accelerator=device == "cuda"))


def test_good_parallel_configs_give_the_mesh():
    check_runtime(_cfg(), Runtime("torch", "cpu", 2))
    check_runtime(_cfg(context_parallel_size=2), Runtime("torch", "cpu", 2))  # unset: rows padded to 2 * cp
    check_runtime(_cfg(context_parallel_size=2, pad_to_multiple_of=8, packing=True), Runtime("torch", "cpu", 4))
    mesh = MeshConfig(world_size=4, cp=2)
    assert (mesh.dp, mesh.cp, mesh.coords(1), mesh.coords(2)) == (2, 2, (0, 1), (1, 0))


@pytest.mark.parametrize("kw, fragment", [
    (dict(context_parallel_size=0), "context_parallel_size=0"),
    (dict(context_parallel_size=True), "context_parallel_size=True"),
    (dict(context_parallel_strategy="tree"), "context_parallel_strategy='tree'"),
])
def test_config_fields_are_validated(kw, fragment):
    with pytest.raises((ValueError, TypeError), match=fragment):
        TrainConfig.from_flat(**kw)


def test_sequence_not_divisible_names_the_padding_flag():
    batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 4, 3]}], padding_free=True)  # T = 7
    with pytest.raises(ValueError, match=r"--pad-to-multiple-of 4"):
        cpmod.shard_for_rank(batch, 2, 0)


def test_ring_refuses_packed_and_left_padded_batches():
    packed = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 4, 3, 2]}], padding_free=True)
    with pytest.raises(ValueError, match="packed/padding-free batch"):
        cpmod.check_ring_batch(packed)
    left = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}], padding_side="left")
    with pytest.raises(ValueError, match="right padding"):
        cpmod.check_ring_batch(left)
    cpmod.check_ring_batch(collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]))  # one document per row


def test_context_parallelism_in_one_process_is_refused_before_any_work():
    from twinseq.torch_backend.recipes import train

    cfg = _cfg(context_parallel_size=2, pad_to_multiple_of=4, dataset_name="/nonexistent.jsonl")
    with pytest.raises(ValueError, match="larger than the 1 processes"):
        train(cfg)


def test_distributed_dispatch_and_launcher_env():
    assert not wants_distributed(_cfg(), env={})
    assert wants_distributed(_cfg(), env={"WORLD_SIZE": "2"})
    assert wants_distributed(_cfg(fsdp=True), env={})
    cp2 = _cfg(context_parallel_size=2, pad_to_multiple_of=4)
    check_launcher_env(cp2, {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2"})
    with pytest.raises(ValueError, match="--context-parallel-size 2"):
        check_launcher_env(_cfg(), {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2"})
    with pytest.raises(ValueError, match="FSDP2 only"):
        check_launcher_env(_cfg(), {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"})
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        check_launcher_env(_cfg(), {"ACCELERATE_MIXED_PRECISION": "bf16"})


ACCELERATE_YAML = Path(__file__).resolve().parents[2] / "configs" / "accelerate" / "fsdp_context_parallel_2gpu.yaml"


def test_accelerate_yaml_is_parsed_by_accelerate_and_agrees_with_the_flags(monkeypatch):
    """accelerate's own launcher turns the YAML into the environment the trainer checks."""
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    args = launch_command_parser().parse_args(["--config_file", str(ACCELERATE_YAML), "-m", "twinseq.common.cli"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    assert (args.num_processes, env["FSDP_VERSION"], env["PARALLELISM_CONFIG_CP_SIZE"]) == (2, "2", "2")
    check_launcher_env(_cfg(context_parallel_size=2, pad_to_multiple_of=4, dtype="bfloat16"), env)
    with pytest.raises(ValueError, match="--context-parallel-size 2"):
        check_launcher_env(_cfg(dtype="bfloat16"), env)


@pytest.fixture(scope="module")
def sft_jsonl(tmp_path_factory) -> Path:
    import json

    from twinseq.common.data.corpus import load_embedded

    path = tmp_path_factory.mktemp("data") / "sft.jsonl"
    with path.open("w") as f:
        for row in load_embedded("embedded-sft").select(range(48)):
            f.write(json.dumps({"prompt": row["prompt"], "completion": row["completion"]}) + "\n")
    return path


@pytest.mark.slow
def test_twinseq_train_under_torchrun_with_fsdp2_and_cp(sft_jsonl, tmp_path):
    """The real CLI under ``torchrun --nproc-per-node 2``: FSDP2 + allgather CP on packed, padding-free rows.

    Rank 0 alone writes metrics.jsonl; the step-1 loss equals the single-process loss of the same
    batches (nothing has been trained yet); the saved final/ checkpoint loads and was trained.
    """
    import os
    import subprocess

    from twinseq.common.config import ModelConfig
    from twinseq.common.models.init import init_weights
    from twinseq.common.data.sft_steps import build_step_iterator
    from twinseq.common.run.report import REQUIRED_FIELDS, read_metrics
    from twinseq.torch_backend.checkpoint import load_pretrained
    from twinseq.torch_backend.model import build_model, export_weights
    from twinseq.torch_backend.parallel import parallelize
    from twinseq.torch_backend.trainer import SFTTrainer

    flags = dict(dataset_name=str(sft_jsonl), max_length=64, per_device_train_batch_size=2, packing=True,
                 padding_free=True, attn_implementation="varlen", context_parallel_size=CP,
                 pad_to_multiple_of=2 * CP, learning_rate=3e-3, max_steps=3, output_dir=str(tmp_path / "run"),
                 disable_tqdm=True, model_config="tiny")
    argv = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={CP}",
           "-m", "twinseq.common.cli", "train", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3] and all(k in r for r in records for k in REQUIRED_FIELDS)
    cfg = TrainConfig.from_flat(**flags).replace(context_parallel_size=1)
    iterator, _, _ = build_step_iterator(cfg)
    model_cfg = ModelConfig.preset("tiny")
    initial = init_weights(model_cfg, seed=cfg.seed)
    model = build_model(model_cfg, initial, attn_implementation="varlen")
    trainer = SFTTrainer(cfg, parallelize(model, None, cfg), torch.device("cpu"))
    loss = sum(trainer.micro_step(batch)["loss"] for batch in iterator.next_step())
    assert abs(records[0]["loss"] - loss) / loss <= REL
    trained = export_weights(load_pretrained(tmp_path / "run" / "final"))
    assert sorted(trained) == sorted(initial)
    assert max(float(np.abs(trained[k] - initial[k]).max()) for k in initial) > 1e-3


@pytest.mark.slow
def test_fsdp2_cp_resume_from_a_checkpoint_continues_the_uninterrupted_run(sft_jsonl, tmp_path):
    """FSDP2 + allgather CP on 2 gloo ranks, through the trainer and the runner: a run resumed (with
    ``--resume-from-checkpoint latest``) from its step-5 checkpoint, which is what a kill after that
    save leaves on disk, logs the same losses and ends with the same weights as the run that never
    stopped (the full state is gathered on rank 0 and every rank reloads it)."""
    import shutil

    from safetensors.numpy import load_file

    from twinseq.common.run.report import read_metrics

    flags = dict(dataset_name=str(sft_jsonl), max_length=64, per_device_train_batch_size=2, packing=True,
                 padding_free=True, attn_implementation="varlen", context_parallel_size=CP, pad_to_multiple_of=2 * CP,
                 learning_rate=3e-3, max_steps=8, save_steps=5, disable_tqdm=True, model_config="tiny")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"

    def run(out, **kw):
        job = {"kind": "run", "name": "run", "config": _cfg(**flags, output_dir=str(out), **kw).to_dict()}
        (tmp_path / out.name).mkdir(exist_ok=True)
        W.launch({"jobs": [job]}, tmp_path / out.name, world_size=CP)

    run(straight)
    assert sorted(p.name for p in straight.glob("checkpoint-*")) == ["checkpoint-5", "checkpoint-8"]
    shutil.copytree(straight / "checkpoint-5", resumed / "checkpoint-5")
    lines = (straight / "metrics.jsonl").read_text().splitlines()[:5]
    (resumed / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    run(resumed, resume_from_checkpoint="latest")
    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, 9))
    rel = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b))
    assert rel <= REL, f"resumed losses differ by {rel:.2e} relative"
    wa, wb = (load_file(str(d / "final" / "model.safetensors")) for d in (straight, resumed))
    assert sorted(wa) == sorted(wb)
    assert max(float(np.abs(wa[k] - wb[k]).max()) for k in wa) <= 1e-6
