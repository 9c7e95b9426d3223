"""Ulysses sequence parallelism (``context_parallel_strategy='ulysses'``, ``twinseq_cp_ulysses``).

Invariants:
- FSDP2 + Ulysses on 2 and on 4 gloo ranks, on packed and on padding-free rows whose documents cross the
  shard boundaries, logs the single process's losses within 1e-5 relative over 10 steps, and its first-step
  gradients match within 1e-5 relative (the tolerance of the other CP tests). The data is checked to cross
  shards and to be sensitive to a document leak.
- On every rank, the attention output and dq, dk, dv (back through the inverse all-to-all) equal the dense
  document-masked attention of the whole row (float64, 1e-12), for GQA split (KV % cp == 0), GQA repeated
  (KV % cp != 0), MHA and a single K/V head, with and without a sliding window and a soft-cap; merging the
  row's documents moves the output by far more (the negative control).
- The whole model through ``twinseq_cp_ulysses`` on one rank gives the plain model's logits; a context built for
  another strategy is refused.
- ``twinseq train --context-parallel-size 2 --context-parallel-strategy ulysses`` under torchrun trains, runs the
  all-to-all attention (logged) and its first loss is the single process's.
- Refusals: heads that do not split over the ranks (named field, value and fix), ulysses on the jax backend.
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
import _ulysses_workers as U  # noqa: E402

from twinseq.common.config import TrainConfig  # noqa: E402
from twinseq.common.data.context_parallel import cp_permutation  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.common.run.capabilities import Runtime, check_runtime  # noqa: E402
from twinseq.torch_backend import context_parallel as cpmod  # noqa: E402

REL = 1e-5  # as tests/torch_backend/test_distributed.py


def _jobs(cp: int) -> dict[str, dict]:
    ulysses = dict(context_parallel_size=cp, context_parallel_strategy="ulysses", pad_to_multiple_of=2 * cp)
    return {"packed": dict(packing=True, per_device_train_batch_size=2, gradient_accumulation_steps=2, **ulysses),
            "padding_free": dict(packing=True, padding_free=True, per_device_train_batch_size=3,
                                 gradient_accumulation_steps=1, **ulysses)}


# --------------------------------------------------------------------------------------
# Spawned: one job per world size runs the attention checks and both trainings
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def ranks(request, tmp_path_factory):
    cp = request.param
    out_dir = tmp_path_factory.mktemp(f"ulysses_cp{cp}")
    jobs = [{"kind": "attention", "name": "attention"}]
    jobs += [{"kind": "train", "name": name, "data_seed": 0, "config": dataclasses.asdict(W.make_config(**kw))}
             for name, kw in _jobs(cp).items()]
    return cp, U.launch({"jobs": jobs}, out_dir, world_size=cp), out_dir


def _documents_crossing_shards(batches, cp: int) -> int:
    count = 0
    for batch in batches:
        T = batch.input_ids.shape[1]
        owner_T = np.empty(T, dtype=np.int64)
        owner_T[cp_permutation(T, cp)] = np.repeat(np.arange(cp), T // cp)
        for seg_T in batch.segment_ids:
            count += sum(len(np.unique(owner_T[seg_T == s])) > 1 for s in np.unique(seg_T[seg_T != 0]))
    return count


def _leak_changes_the_loss(batch) -> float:
    """Relative change of ``batch``'s loss when its documents are merged (plain causal attention over the row)."""
    from twinseq.common.config import ModelConfig
    from twinseq.common.models.init import init_weights
    from twinseq.torch_backend.model import build_model, compute_loss

    cfg = ModelConfig.preset("tiny")
    model = build_model(cfg, init_weights(cfg, seed=0))
    B, T = batch.input_ids.shape
    merged = dataclasses.replace(batch, segment_ids=(batch.segment_ids != 0).astype(np.int32),
                                 position_ids=np.tile(np.arange(T, dtype=np.int32), (B, 1)))
    with torch.no_grad():
        masked, leaky = float(compute_loss(model, batch)), float(compute_loss(model, merged))
    return abs(leaky - masked) / masked


@pytest.mark.distributed
@pytest.mark.slow
def test_ulysses_attention_and_grads_match_dense_on_every_rank(ranks):
    cp, results, _ = ranks
    for rank, result in enumerate(results):
        assert len(result["attention"]) == len(U.HEAD_LAYOUTS) * len(U.MASK_VARIANTS)
        for case, errors in result["attention"].items():
            worst = max(errors[k] for k in ("out", "dq", "dk", "dv"))
            assert worst < 1e-12, f"cp={cp} rank {rank} {case}: {errors}"  # float64 inputs
            assert errors["leak"] > 1e-3, f"cp={cp} rank {rank} {case}: merging documents must show ({errors})"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", ["packed", "padding_free"])
def test_fsdp2_ulysses_on_packed_rows_matches_single_process(ranks, name):
    cp, results, out_dir = ranks
    assert all(r[name] == results[0][name] for r in results), "ranks logged different reduced metrics"
    cfg = W.make_config(**_jobs(cp)[name])
    ref, steps = W.reference_losses(cfg, W.synthetic_rows(seed=0), return_batches=True)
    batches = [b for step in steps for b in step]
    assert all(int(b.segment_ids.max()) > 1 for b in batches), "every row must pack several documents"
    assert _documents_crossing_shards(batches, cp) >= len(batches), "documents must cross the shard boundary"
    assert _leak_changes_the_loss(batches[0]) > 10 * REL, "a document leak must show in the loss"
    assert ref[-1] < 0.95 * ref[0], "the data must be learnable, or a wrong update could go unnoticed"
    got, want = np.asarray(results[0][name]), np.asarray(ref)
    rel = np.abs(got - want) / np.abs(want)
    print(f"ulysses cp={cp} {name}: max loss difference {np.abs(got - want).max():.2e} abs, {rel.max():.2e} rel")
    assert got.shape == (10,) and rel.max() <= REL, (got, want)
    grads = dict(np.load(out_dir / f"grads_{name}.npz"))
    ref_grads = W.reference_grads(cfg, W.synthetic_rows(seed=0))
    assert sorted(grads) == sorted(ref_grads)
    rel_g = {k: float(np.linalg.norm(grads[k] - ref_grads[k]) / np.linalg.norm(ref_grads[k])) for k in ref_grads}
    abs_g = max(float(np.abs(grads[k] - ref_grads[k]).max()) for k in ref_grads)
    worst = max(rel_g, key=rel_g.get)
    print(f"ulysses cp={cp} {name}: max gradient difference {abs_g:.2e} abs, {rel_g[worst]:.2e} rel ({worst})")
    assert rel_g[worst] <= REL, f"{worst}: relative gradient difference {rel_g[worst]:.2e}"


@pytest.mark.distributed
@pytest.mark.slow
def test_twinseq_train_under_torchrun_with_ulysses(tmp_path):
    """The real CLI in a fresh ``torchrun --nproc-per-node 2``: FSDP2 + Ulysses on packed, padding-free rows; rank
    0 logs that the all-to-all attention runs, and the step-1 loss equals the single process's on the same batches."""
    import json
    import os
    import subprocess

    from twinseq.common.data.corpus import load_embedded
    from twinseq.common.data.sft_steps import build_step_iterator
    from twinseq.common.run.report import read_metrics

    data = tmp_path / "sft.jsonl"
    with data.open("w") as f:
        for row in load_embedded("embedded-sft").select(range(48)):
            f.write(json.dumps({"prompt": row["prompt"], "completion": row["completion"]}) + "\n")
    flags = dict(dataset_name=str(data), max_length=64, per_device_train_batch_size=2, packing=True,
                 padding_free=True, attn_implementation="varlen", context_parallel_size=2, context_parallel_strategy="ulysses",
                 pad_to_multiple_of=4, learning_rate=3e-3, max_steps=2, output_dir=str(tmp_path / "run"),
                 disable_tqdm=True, model_config="tiny")
    argv = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "twinseq.common.cli", "train", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "attention runs 'twinseq_cp_ulysses'" in proc.stderr, proc.stderr[-3000:]
    assert "all_to_all_single over 2 ranks (gloo)" in proc.stderr, proc.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    cfg = TrainConfig.from_flat(**flags).replace(context_parallel_size=1)
    iterator, _, _ = build_step_iterator(cfg)
    trainer = W._trainer(cfg)  # the same tiny preset and seed, one process
    loss = sum(trainer.micro_step(batch)["loss"] for batch in iterator.next_step())
    assert abs(records[0]["loss"] - loss) / loss <= REL, (records[0]["loss"], loss)


# --------------------------------------------------------------------------------------
# Single process: the head split, the whole model on one rank, the refusals
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (8, 2), (8, 8)])
def test_head_slices_of_the_whole_row_assemble_dense_attention(cp, heads):
    """What each rank computes after the all-to-all, simulated: query heads r*H/cp.. and their K/V heads (repeated
    by ``kv_repeats`` where KV % cp != 0) over the whole zigzag-ordered row, through the blocked attention with the
    gathered ids; assembled, they equal dense attention. Slicing the unrepeated K/V heads instead is wrong."""
    from twinseq.torch_backend.attention import document_mask
    from twinseq.torch_backend.blocked_attention import BlockedPlan, blocked_attention

    batch = W.packed_batch(pad_to=2 * cp)
    (B, T), (H, KV) = batch.input_ids.shape, heads
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, T, 8, generator=gen, dtype=torch.float64) for n in (H, KV, KV))
    seg, pos = (torch.as_tensor(x, dtype=torch.long) for x in (batch.segment_ids, batch.position_ids))
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(seg, pos, q.dtype),
                                                             enable_gqa=True)
    perm = torch.as_tensor(cp_permutation(T, cp))
    plan = BlockedPlan(seg[:, perm], pos[:, perm], seg[:, perm], pos[:, perm], 8)
    repeats = cpmod.kv_repeats(H, KV, cp)
    assert (repeats == 1) == (KV % cp == 0)
    k_rep, v_rep = (x.repeat_interleave(repeats, dim=1)[:, :, perm] for x in (k, v))
    h, kv = H // cp, KV * repeats // cp
    out = torch.cat([blocked_attention(q[:, r * h:(r + 1) * h, perm], k_rep[:, r * kv:(r + 1) * kv],
                                       v_rep[:, r * kv:(r + 1) * kv], plan) for r in range(cp)], dim=1)
    real = (seg[:, perm] != 0)[:, None, :, None]
    assert float(((out - dense[:, :, perm]).abs() * real).max()) < 1e-12
    if KV % cp == 0 or KV == 1:
        return  # the negative control needs K/V heads to slice wrongly
    kv_naive = max(KV // cp, 1)
    wrong = torch.cat([blocked_attention(q[:, r * h:(r + 1) * h, perm], k[:, r % KV:r % KV + kv_naive][:, :, perm],
                                         v[:, r % KV:r % KV + kv_naive][:, :, perm], plan) for r in range(cp)], dim=1)
    assert float(((wrong - dense[:, :, perm]).abs() * real).max()) > 1e-3


@pytest.mark.parametrize("preset", ["tiny", "tiny-mistral", "tiny-gemma2"])
def test_whole_model_through_ulysses_on_one_rank_gives_the_eager_logits(preset):
    """One rank (no group): ``twinseq_cp_ulysses`` is the blocked document attention of the whole row, with each
    layer's sliding window (16 tokens, a 30-token document) and soft-cap as HF passes them; packed documents stay
    apart. A context built for allgather, or for another window, is refused by the ulysses attention."""
    from twinseq.common.config import ModelConfig
    from twinseq.common.data.batching import collate
    from twinseq.common.models.init import init_weights
    from twinseq.torch_backend.attention import mask_layout
    from twinseq.torch_backend.model import apply_logit_softcap, build_model, final_logit_softcap, logits
    from twinseq.torch_backend.parallel import use_cp_attention

    cfg = ModelConfig.preset(preset)
    rng = np.random.default_rng(0)
    batch = collate([{"input_ids": rng.integers(3, 200, size=n).tolist(), "seq_lengths": lengths}
                     for n, lengths in ((48, [30, 10, 8]), (40, [12, 28]))], pad_to_multiple_of=8)
    want = logits(build_model(cfg, init_weights(cfg, seed=0), attn_implementation="eager"), batch)
    model = build_model(cfg, init_weights(cfg, seed=0))
    use_cp_attention(model, "ulysses")
    assert model.config._attn_implementation == cpmod.ULYSSES_HF_NAME
    shard = cpmod.shard_for_rank(batch, cp=1, cp_rank=0)
    window = mask_layout(model.config).sliding_window

    def run(ctx):
        hidden = model.model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False,
                             **{cpmod.CP_KWARG: ctx}).last_hidden_state
        return apply_logit_softcap(model.lm_head(hidden).float(), final_logit_softcap(model)).numpy()

    with torch.no_grad():
        got = run(cpmod.make_context(shard, None, "ulysses", window))
    real = batch.segment_ids != 0
    assert float(np.abs(got - want)[real].max()) < 1e-4
    with pytest.raises(ConfigError, match=re.escape("strategy='allgather'")):
        run(cpmod.make_context(shard, None, "allgather", window))
    if window is not None:
        with pytest.raises(ConfigError, match="sliding_window=None"):
            run(cpmod.make_context(shard, None, "ulysses", None))


def _cfg(**kw) -> TrainConfig:
    return TrainConfig.from_flat(context_parallel_strategy="ulysses", **kw)


def test_ulysses_configs_are_accepted_or_refused_with_the_fix():
    check_runtime(_cfg(context_parallel_size=2), Runtime("torch", "cpu", 2))  # tiny: 4 heads, 2 K/V heads
    check_runtime(_cfg(context_parallel_size=4), Runtime("torch", "cpu", 4))  # K/V heads repeated, not refused
    check_runtime(_cfg(context_parallel_size=2, model_config="small"), Runtime("torch", "cpu", 2))  # 6 heads
    with pytest.raises(ConfigError, match=r"num_attention_heads=6 is not a multiple of 4.*--context-parallel-size in "
                                          r"\[2, 3, 6\]"):
        check_runtime(_cfg(context_parallel_size=4, model_config="small"), Runtime("torch", "cpu", 4))
    with pytest.raises(ConfigError, match=r"context_parallel_strategy='ulysses' is not implemented by the jax"):
        check_runtime(_cfg(context_parallel_size=2), Runtime("jax", "cpu", 2))
    check_runtime(_cfg(context_parallel_size=2, model_config="small", backend="jax").replace(
        context_parallel_strategy="allgather"), Runtime("jax", "cpu", 2))
    check_runtime(_cfg(model_config="small", backend="jax"), Runtime("jax", "cpu", 1))  # cp=1: no strategy runs
    with pytest.raises(ConfigError, match=r"num_attention_heads=6"):
        cpmod.kv_repeats(6, 2, 4)
