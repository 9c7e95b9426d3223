"""The rank side of ``test_ulysses.py``: Ulysses sequence parallelism on gloo ranks (``python _ulysses_workers.py
SPEC.json OUT_DIR`` with torchrun's environment, as ``_dist_workers.launch`` starts them).

Job kinds: ``attention`` (``ulysses_attention_forward`` and its gradients on this rank's shard against the dense
document-masked attention of the whole row, float64, for several head layouts, a sliding window and a soft-cap,
plus a leak control), and ``train`` (``_dist_workers``' trainer steps and first-step gradients on synthetic rows).
Each rank writes ``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import _dist_workers as W  # noqa: E402

# (num_heads, num_kv_heads): GQA split as it is on 2 ranks and repeated on 4, MHA, and one K/V head (MQA)
HEAD_LAYOUTS = ((4, 2), (4, 4), (4, 1), (8, 2))
# (sliding_window, softcap): plain, Mistral-like window, Gemma-2-like window and cap
MASK_VARIANTS = ((None, None), (5, None), (6, 2.0))


def _ulysses(batch, q, k, v, cp: int, rank: int, window: Optional[int], cap: Optional[float]):
    """This rank's Ulysses output [B, H, L, D] for q/k/v given in token order (its shard is sliced here)."""
    import torch
    import torch.distributed as dist

    from twinseq.common.data.context_parallel import cp_permutation
    from twinseq.torch_backend import context_parallel as cpmod

    mine = torch.as_tensor(cp_permutation(batch.input_ids.shape[1], cp)).reshape(cp, -1)[rank]
    q_loc, k_loc, v_loc = (x[:, :, mine].detach().clone().requires_grad_() for x in (q, k, v))
    ctx = cpmod.make_context(cpmod.shard_for_rank(batch, cp, rank), dist.group.WORLD, "ulysses", window)
    out, _ = cpmod.ulysses_attention_forward(torch.nn.Module(), q_loc, k_loc, v_loc, None, sliding_window=window,
                                             softcap=cap, **{cpmod.CP_KWARG: ctx})
    return out.transpose(1, 2), (q_loc, k_loc, v_loc), mine


def dense_attention(q, k, v, allowed_B1TT, cap: Optional[float]):
    """The naive reference in q's dtype throughout (HF's eager soft-cap path takes its softmax in float32)."""
    import torch

    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    return torch.softmax(s.masked_fill(~allowed_B1TT, float("-inf")), dim=-1) @ v


def attention_check(heads: tuple[int, int], window: Optional[int], cap: Optional[float], seed: int = 0) -> dict:
    """Max abs errors of the output and of dq, dk, dv on this rank's tokens against the dense attention (through
    the inverse all-to-all in backward), and ``leak``: the output's error when the row's documents are merged."""
    import torch
    import torch.distributed as dist

    from twinseq.torch_backend import context_parallel as cpmod

    cp, rank = dist.get_world_size(), dist.get_rank()
    batch = W.packed_batch(pad_to=2 * cp)
    (B, T), (H, KV), D = batch.input_ids.shape, heads, 8
    gen = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(B, n, T, D, generator=gen, dtype=torch.float64) for n in (H, KV, KV, H))
    real_BT = torch.as_tensor(batch.segment_ids != 0)
    w = w * real_BT[:, None, :, None]  # padding queries' outputs are don't-care (dense: own key; blocked: zero)
    seg, pos = (torch.as_tensor(x, dtype=torch.long) for x in (batch.segment_ids, batch.position_ids))
    refs = [x.clone().requires_grad_() for x in (q, k, v)]
    allowed = cpmod.cp_allowed_mask(seg, pos, seg, pos, 0, window)
    out_ref = dense_attention(*refs, allowed, cap)
    (out_ref * w).sum().backward()
    out, locs, mine = _ulysses(batch, q, k, v, cp, rank, window, cap)
    (out * w[:, :, mine]).sum().backward()
    real = real_BT[:, mine][:, None, :, None]
    errors = {"out": float(((out - out_ref[:, :, mine]).abs() * real).max())}
    errors.update({f"d{n}": float((x.grad - r.grad[:, :, mine]).abs().max()) for n, x, r in zip("qkv", locs, refs)})
    # the negative control: one document per row (segment 1, positions 0..T-1) must move the output
    merged = dataclasses.replace(batch, segment_ids=(batch.segment_ids != 0).astype(np.int32),
                                 position_ids=np.tile(np.arange(T, dtype=np.int32), (B, 1)))
    with torch.no_grad():
        leaky, _, _ = _ulysses(merged, q, k, v, cp, rank, window, cap)
    errors["leak"] = float(((leaky - out_ref[:, :, mine]).abs() * real).max())
    return errors


def attention_checks() -> dict[str, dict]:
    return {f"H{h}_KV{kv}_w{window}_cap{cap}": attention_check((h, kv), window, cap)
            for h, kv in HEAD_LAYOUTS for window, cap in MASK_VARIANTS}


def run_spec(spec: dict, out_dir: str) -> dict:
    import torch.distributed as dist

    from twinseq.common.config import TrainConfig

    out: dict[str, Any] = {}
    for job in spec["jobs"]:
        if job["kind"] == "attention":
            if not dist.is_initialized():
                dist.init_process_group("gloo")  # rank and world size from the environment, as torchrun sets them
            out[job["name"]] = attention_checks()
        else:
            cfg = TrainConfig.from_dict(job["config"])
            rows = W.synthetic_rows(seed=job["data_seed"])
            out[job["name"]] = W.distributed_losses(cfg, rows)
            grads = W.distributed_grads(cfg, rows)
            if dist.get_rank() == 0:
                np.savez(Path(out_dir, f"grads_{job['name']}.npz"), **grads)
    if dist.is_initialized():
        dist.barrier()  # every rank reaches teardown together (see _dist_workers.run_spec)
        dist.destroy_process_group()
    return out


def launch(spec: dict, tmp_path: Path, world_size: int) -> list[dict]:
    return W.launch_script(__file__, spec, tmp_path, world_size, timeout=400.0,
                           env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    result = run_spec(spec, argv[1])
    Path(argv[1], f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown, where gloo's static destructors can race (see _dist_workers.main)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
