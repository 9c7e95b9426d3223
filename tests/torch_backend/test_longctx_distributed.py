"""``allgather`` CP with the blocked attention on 2 gloo ranks, with blocks much smaller than a shard.

Invariant: FSDP2 + allgather CP (cp=2) on packed rows of 64 tokens whose documents cross the shard
boundary, with ``attention_block_size=8`` (4 query blocks per rank against 8 gathered key blocks, fully
masked pairs skipped, full pairs unmasked) and the tiled MLP (tiles of 8 tokens), logs the losses of
the single process on the same rows within 1e-5 relative over 10 steps, and the first step's gradients
(reduce-scattered K/V gradients back to their owners, then FSDP2's reduce-scatter) match within 1e-5.
The single process runs the dense sdpa path (rows shorter than ``BLOCKED_MIN_SEQ_LEN``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
import _dist_workers as W  # noqa: E402

REL = 1e-5
CP = 2
BLOCKED_CP_CFG = dict(packing=True, pad_to_multiple_of=2 * CP, context_parallel_size=CP, per_device_train_batch_size=2,
                      gradient_accumulation_steps=2, attention_block_size=8, tiled_mlp=True, tiled_mlp_chunk_size=8)
REF_CFG = {k: v for k, v in BLOCKED_CP_CFG.items() if k != "context_parallel_size"}

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("longctx_dist")
    job = {"kind": "train", "name": "blocked_cp", "data_seed": 0,
           "config": dataclasses.asdict(W.make_config(**BLOCKED_CP_CFG))}
    return W.launch({"jobs": [job]}, out_dir, world_size=CP), out_dir


def test_blocked_allgather_cp_matches_single_process(results):
    ranks, out_dir = results
    assert ranks[0]["blocked_cp"] == ranks[1]["blocked_cp"], "ranks logged different reduced metrics"
    ref = W.reference_losses(W.make_config(**REF_CFG), W.synthetic_rows(seed=0))
    got, want = np.asarray(ranks[0]["blocked_cp"]), np.asarray(ref)
    rel = np.abs(got - want) / np.abs(want)
    print(f"blocked allgather CP vs 1 process: max relative loss difference {rel.max():.2e}")
    assert got.shape == (10,) and rel.max() <= REL, (got, want)
    assert want[-1] < 0.95 * want[0], "the data must be learnable, or a wrong update could go unnoticed"
    grads = dict(np.load(out_dir / "grads_blocked_cp.npz"))
    ref_grads = W.reference_grads(W.make_config(**REF_CFG), W.synthetic_rows(seed=0))
    assert sorted(grads) == sorted(ref_grads)
    worst = max(float(np.linalg.norm(grads[k] - ref_grads[k]) / np.linalg.norm(ref_grads[k])) for k in ref_grads)
    assert worst <= REL, worst
