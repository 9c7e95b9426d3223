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
are returned per repeat under ``"extra"``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

_MARKER = "__MEASURED__ "

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
