"""Peak memory of a function in a fresh subprocess, above that subprocess's baseline.

DESIGN.md ("Benchmarks"): on CPU, memory is the peak RSS of a fresh subprocess minus its
baseline. The baseline is taken after ``setup`` has allocated the inputs and weights and
before ``run`` starts, so the figure is what ``run`` itself needs (activations, logits,
gradients), whatever the size of the inputs.

Usage from a benchmark script ``bench.py`` that defines ``setup(**kwargs) -> state`` and
``run(state) -> dict | None``::

    from _memory import measure_in_subprocess
    res = measure_in_subprocess("bench.py", "setup", "run", {"n": 4096}, repeats=3)
    res["peak_above_baseline_bytes"], res["seconds"]

``run`` may return a dict of extra figures (e.g. ``torch.cuda.max_memory_allocated``); they
are returned per repeat under ``"extra"``. On CUDA, ``run`` wraps its work in
``cuda_peak_above_baseline(extra)`` and the driver reads the figure of either device with
``peak_bytes(res)``; ``add_measure_args`` and ``resolve_device`` give the scripts one set of
flags and one rule for the device, dtype, repeats and warmup.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

_MARKER = "__MEASURED__ "
CUDA_PEAK = "cuda_peak_above_baseline_bytes"

# The child resets the kernel's RSS high-water mark (VmHWM) before each repeat by writing 5
# to /proc/self/clear_refs (Linux >= 4.0), so each repeat's peak is its own.
_CHILD = r"""
import gc, importlib.util, json, sys, time
path, setup_name, run_name, kwargs, repeats, warmup = json.loads(sys.argv[1])

def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")

spec = importlib.util.spec_from_file_location("_measured_module", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
state = getattr(mod, setup_name)(**kwargs)
records = []
for i in range(warmup + repeats):
    gc.collect()
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    extra = getattr(mod, run_name)(state) or {}
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    if i >= warmup:
        records.append({"baseline_rss_bytes": baseline, "peak_rss_bytes": peak, "seconds": seconds,
                        "extra": extra})
print(__MARKER__ + json.dumps(records), flush=True)
""".replace("__MARKER__", repr(_MARKER))


def child_env(num_threads: Optional[int] = None, extra: Optional[dict] = None) -> dict:
    """Environment of the measured subprocess.

    ``MALLOC_MMAP_THRESHOLD_`` fixes glibc's mmap threshold at 1 MiB: blocks above it are
    mmapped and go back to the OS when freed, so RSS follows live memory. Without it glibc
    raises the threshold dynamically and a freed block can stay resident, hiding the next
    allocation from the peak.
    """
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    if num_threads is not None:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[var] = str(num_threads)
    env.update(extra or {})
    return env


def measure_in_subprocess(script: str | os.PathLike, setup: str, run: str, kwargs: dict[str, Any], *,
                          repeats: int = 1, warmup: int = 0, num_threads: Optional[int] = None,
                          timeout: Optional[float] = None, env: Optional[dict] = None) -> dict[str, Any]:
    """Run ``setup(**kwargs)`` then ``run(state)`` ``warmup + repeats`` times in a fresh Python.

    Returns ``{"peak_above_baseline_bytes"`` (max over the measured repeats),
    ``"first_peak_above_baseline_bytes"``, ``"seconds"`` (list), ``"median_seconds"``,
    ``"baseline_rss_bytes"``, ``"records"`` (per repeat, with ``"extra"``)}.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0.")
    script = str(Path(script).resolve())
    payload = json.dumps([script, setup, run, kwargs, repeats, warmup])
    proc = subprocess.run([sys.executable, "-c", _CHILD, payload], capture_output=True, text=True,
                          timeout=timeout, env=child_env(num_threads, env))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"measured subprocess failed (exit {proc.returncode}) for {script}:{run} "
                           f"{kwargs}:\n{proc.stderr[-3000:]}")
    records = json.loads(lines[-1][len(_MARKER):])
    above = [max(r["peak_rss_bytes"] - r["baseline_rss_bytes"], 0) for r in records]
    seconds = [r["seconds"] for r in records]
    return {"peak_above_baseline_bytes": max(above), "first_peak_above_baseline_bytes": above[0],
            "seconds": seconds, "median_seconds": statistics.median(seconds),
            "baseline_rss_bytes": records[0]["baseline_rss_bytes"], "records": records}


def peak_bytes(res: dict[str, Any], cuda_key: str = CUDA_PEAK) -> int:
    """The peak of a ``measure_in_subprocess`` result: the largest ``extra[cuda_key]`` over the
    repeats when ``run`` reported one (CUDA), else the peak RSS above the baseline (CPU)."""
    extras = [r["extra"] for r in res["records"]]
    if extras and all(cuda_key in e for e in extras):
        return int(max(e[cuda_key] for e in extras))
    return int(res["peak_above_baseline_bytes"])


@contextlib.contextmanager
def cuda_peak_above_baseline(extra: dict, enabled: bool = True):
    """Inside ``run``: sets ``extra[CUDA_PEAK]`` to ``torch.cuda.max_memory_allocated`` over the
    block minus the bytes allocated when it starts. Does nothing when ``enabled`` is False (CPU)."""
    if not enabled:
        yield
        return
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    yield
    torch.cuda.synchronize()
    extra[CUDA_PEAK] = int(torch.cuda.max_memory_allocated() - before)


def memory_method(device: str) -> str:
    """How ``peak_bytes`` measured on ``device``, in words for the result files."""
    if device == "cuda":
        return "torch.cuda.max_memory_allocated minus the bytes allocated before the measured call"
    return "peak RSS of a fresh subprocess minus its RSS after setup (inputs and weights allocated)"


def add_measure_args(parser: argparse.ArgumentParser, timeout: float = 3600.0) -> None:
    """``--repeats``, ``--warmup``, ``--threads``, ``--device``, ``--timeout`` (see ``resolve_device``)."""
    parser.add_argument("--repeats", type=int, default=None, help="default: 1 on CPU, 5 on CUDA")
    parser.add_argument("--warmup", type=int, default=None, help="default: 0 on CPU, 1 on CUDA")
    parser.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 16))
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds per measured subprocess")


def resolve_device(args: argparse.Namespace) -> str:
    """Settles ``args.device`` (``auto``: ``cuda`` when torch sees a GPU) and returns it; sets
    ``args.dtype`` (bfloat16 on CUDA, float32 on CPU) and fills ``args.repeats``/``args.warmup``
    when unset: one cold repeat on CPU (minutes each at full size), five after one warmup on CUDA."""
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.repeats = args.repeats or (5 if args.device == "cuda" else 1)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.device == "cuda" else 0)
    return args.device


def measured_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What ``add_measure_args``/``resolve_device`` settled, for the result files."""
    return {"device": args.device, "dtype": args.dtype, "repeats": args.repeats, "warmup": args.warmup,
            "threads": args.threads, "memory_method": memory_method(args.device)}


def with_baseline(names: str, baseline: str = "nll") -> list[str]:
    """A comma-separated choice with the baseline measured first, once.

    >>> with_baseline("fused_linear,nll,chunked_nll")
    ['nll', 'fused_linear', 'chunked_nll']
    """
    return [baseline] + [n for n in names.split(",") if n and n != baseline]


def print_measured(label: str, row: dict[str, Any]) -> None:
    """One progress line: peak (MiB), median seconds and loss of a measured row."""
    print(f"{label:>26}: peak {row['peak_bytes'] / (1 << 20):10,.0f} MiB  time {row['median_seconds']:8.2f} s  "
          f"loss {row['loss']:.6f}", flush=True)
