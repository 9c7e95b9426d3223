"""Peak memory of one torch training step at a given row length T, in fresh subprocesses (CPU: peak RSS).

``train_step_peak(seq_len)`` runs ``twinseq train`` for ``max_steps`` steps on the embedded data packed into
rows of exactly ``seq_len`` tokens (one row per step, ``pad_to_multiple_of`` keeps T fixed) and returns
``_train_peak.measure``'s record: ``peak_bytes`` is the largest RSS high-water mark over the steps minus
the RSS before the model was built. On CPU, rows of ``blocked_attention.BLOCKED_MIN_SEQ_LEN`` tokens or more take the
blocked attention (no [T, T] mask), so with ``gradient_checkpointing`` the peak is linear in T.

``cp > 1`` launches ``cp`` ranks on gloo (the environment ``torchrun`` would set), each measured by the same
child as the single process, with ``context_parallel_size=cp`` (``allgather``: blocked attention of the
local queries against the gathered keys); the record is rank 0's, plus ``per_rank_peak_bytes``.

    from _long_context import train_step_peak
    rec = train_step_peak(8192)                      # small preset, fp32, checkpointing, fused_linear
    rec["peak_bytes"], rec["seconds_per_step"]
    rec2 = train_step_peak(16384, cp=2)              # per-rank peaks in rec2["per_rank_peak_bytes"]
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _train_peak import _MARKER, flags_of, measure  # noqa: E402

# The setting of the long-context figures: what the task's memory claims are stated for.
LONG_CONTEXT_DEFAULTS = dict(backend="torch", model_config="small", dtype="float32", gradient_checkpointing=True,
                             loss_type="fused_linear", packing=True, per_device_train_batch_size=1,
                             gradient_accumulation_steps=1, attn_implementation="sdpa", learning_rate=1e-4)


def long_context_values(seq_len: int, cp: int = 1, **overrides: Any) -> dict[str, Any]:
    """The flat config of one measured run: rows of exactly ``seq_len`` tokens."""
    values = dict(LONG_CONTEXT_DEFAULTS, max_length=seq_len, pad_to_multiple_of=seq_len)
    if cp > 1:
        values["context_parallel_size"] = cp
    values.update(overrides)
    return values


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _measure_ranks(values: dict[str, Any], cp: int, max_steps: int, timeout: float, threads: int) -> dict:
    """``cp`` ranks of ``twinseq train``, each in ``_train_peak``'s measuring child; rank 0's record."""
    with tempfile.TemporaryDirectory(prefix="twinseq-cp-peak-") as tmp:
        values = dict(values, output_dir=str(Path(tmp) / "run"), max_steps=max_steps, disable_tqdm=True)
        port = _free_port()
        procs = []
        for rank in range(cp):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cp),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TWINSEQ_MEASURE_THREADS=str(threads),
                       OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
            env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
            cmd = [sys.executable, str(HERE / "_train_peak.py"), "--child", "torch", json.dumps(flags_of(values))]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        outs = [p.communicate(timeout=timeout) for p in procs]
    recs = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        lines = [ln for ln in out.splitlines() if ln.startswith(_MARKER)]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"rank {rank} of the measured CP run failed (exit {p.returncode}):\n{err[-3000:]}")
        recs.append(json.loads(lines[-1][len(_MARKER):]))
    rec = dict(recs[0])
    rec["per_rank_peak_bytes"] = [r["peak_bytes"] for r in recs]
    steps = rec["step_seconds"][1:] or rec["step_seconds"]
    rec["seconds_per_step"] = sorted(steps)[len(steps) // 2]
    rec["command"] = f"torchrun --nproc-per-node {cp} -m twinseq.common.cli train " + " ".join(flags_of(values))
    return rec


def train_step_peak(seq_len: int, *, cp: int = 1, max_steps: int = 1, timeout: float = 1800.0,
                    threads: Optional[int] = None, **overrides: Any) -> dict[str, Any]:
    """Measured peak memory (bytes, ``peak_bytes``) of a torch training step on rows of ``seq_len`` tokens.

    ``overrides`` are flat config fields on top of ``LONG_CONTEXT_DEFAULTS`` (e.g. ``model_config="tiny"``,
    ``tiled_mlp=True``, ``attention_block_size=256``). ``threads`` defaults to 2 for one process, 1 per rank.
    """
    values = long_context_values(seq_len, cp, **overrides)
    if cp == 1:
        return measure(values, max_steps=max_steps, timeout=timeout, threads=threads or 2)
    return _measure_ranks(values, cp, max_steps, timeout, threads or 1)
