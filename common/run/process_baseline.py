"""The process baseline: what a training process holds before it builds a model, so that ``twinseq memory``'s
grand total is the figure a user measures.

``plan_memory`` plans what one training step adds: parameters, gradients, optimizer state, activations. The
process that runs the step also holds the python interpreter with its backend imported: torch (or jax),
transformers, twinseq's trainer and, in a PEFT run, peft and bitsandbytes (about 0.5 GiB of RSS for torch on CPU,
as much as the whole plan of a small model). That is the *process baseline* (not the plan's ``runtime`` row, which
is what a torch step allocates besides the tensors the model names):

- on CPU it is **measured** once per machine: a fresh ``sys.executable -c`` imports what a training run of that
  backend imports before it builds its model (``RUNTIME_IMPORTS``, and ``PEFT_IMPORTS`` for a PEFT run), runs one
  small op (jax: its CPU client starts and compiles one function) and reports its resident memory
  (``/proc/self/status`` VmRSS, else ``getrusage``'s ``ru_maxrss``). The figure is **cached** in
  ``$TWINSEQ_CACHE/process_baseline/`` (default ``~/.cache/twinseq``), keyed by the backend, the imports, the
  versions of the packages in ``VERSIONED``, the python and the machine; a later ``twinseq memory`` reads it back.
  When the probe cannot run (the backend is not installed, it fails or times out) the baseline is **estimated**:
  ``ESTIMATED_BASELINE_BYTES`` (+ ``ESTIMATED_PEFT_BYTES``), measured that way on the 2-core CPU machine;
- on CUDA it is the **CUDA context**, ``CUDA_CONTEXT_BYTES``: an estimate, never measured here (no GPU was
  available when it was set). PyTorch enables CUDA's lazy module loading, with which a bare context holds
  ~274 MiB (287,047,680 bytes in pytorch/pytorch#86509; 636 MiB without lazy loading); a training step loads
  cuBLAS and the step's kernels into it on top. The host process's own RSS is not device memory, so it is not
  added.

The grand total, ``plan.total + baseline.bytes``, is comparable with ``COMPARABLE[(backend, device)]``: on CPU
the peak RSS of the whole ``twinseq train`` process (torch, ``tiny`` LoRA: 5-9 % under it,
``tests/test_memory_grand_total.py``); on CUDA ``torch.cuda.max_memory_allocated()`` plus the context. Not in it:
the data pipeline (the tokenised dataset in memory: ~60 MiB for the embedded 4,395 examples), the allocator's
caching, and for jax the XLA compiler's working memory and executable (~135 MiB for ``tiny``'s step on CPU), which
grow with the dataset and the graph, not with the machine.

>>> b = process_baseline("torch", device="cuda")
>>> b.source, b.bytes == CUDA_CONTEXT_BYTES
('estimated', True)
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

from twinseq.common.data.corpus import cache_root
from twinseq.common.errors import ConfigError
from twinseq.common.run.memory_plan import format_bytes

__all__ = [
    "ProcessBaseline",
    "process_baseline",
    "baseline_cache_path",
    "grand_total_lines",
    "RUNTIME_IMPORTS",
    "PEFT_IMPORTS",
    "VERSIONED",
    "ESTIMATED_BASELINE_BYTES",
    "ESTIMATED_PEFT_BYTES",
    "CUDA_CONTEXT_BYTES",
    "COMPARABLE",
]

logger = logging.getLogger(__name__)
MIB = 2**20
RUNTIME_IMPORTS = {
    "torch": ("twinseq.common.cli", "twinseq.torch_backend.trainer", "transformers.models.llama.modeling_llama"),
    "jax": ("twinseq.common.cli", "twinseq.jax_backend.trainer"),
}
"""What ``twinseq train`` of each backend has imported when it builds its model (the CLI, the backend's trainer
and the model code it builds from)."""
PEFT_IMPORTS = {"torch": ("peft", "bitsandbytes"), "jax": ("qwix",)}
"""What a PEFT run imports on top, where installed (peft imports bitsandbytes when it is there)."""
WARMUP = {
    "torch": "import torch\n(torch.ones(8, 8) @ torch.ones(8, 8)).sum().item()",
    "jax": "import jax, jax.numpy as jnp\njax.jit(lambda x: x + 1)(jnp.ones(8)).block_until_ready()",
}
"""One small op: the thread pools start (torch), the CPU client starts and compiles (jax), as in any run."""
VERSIONED = {
    "torch": ("torch", "transformers", "peft", "bitsandbytes", "numpy", "twinseq"),
    "jax": ("jax", "jaxlib", "flax", "optax", "qwix", "numpy", "twinseq"),
}
"""The packages whose versions key the cached measurement: a new version is measured again."""
ESTIMATED_BASELINE_BYTES = {"torch": 531 * MIB, "jax": 323 * MIB}
"""The baseline when it cannot be measured: the probe's figure on the 2-core CPU machine (python 3.11.7, torch
2.13.0+cpu, transformers 5.24.0; jax 0.10.2, flax 0.12.8)."""
ESTIMATED_PEFT_BYTES = {"torch": 56 * MIB, "jax": 1 * MIB}
"""What ``PEFT_IMPORTS`` added there (peft 0.21.2, bitsandbytes 0.50.2; qwix 0.1.8)."""
CUDA_CONTEXT_BYTES = 512 * MIB
"""The CUDA context of a training process: an estimate (the module docstring), not measured in this project."""
COMPARABLE = {
    ("torch", "cpu"): "the peak RSS of the whole `twinseq train` process (/usr/bin/time -v's \"Maximum resident "
    'set size", or getrusage(RUSAGE_CHILDREN).ru_maxrss of the process that ran it); not in the total: the data '
    "pipeline (the tokenised dataset, ~60 MiB for the embedded one) and the allocator's caching",
    ("jax", "cpu"): "the compiled step's memory_analysis() plus the baseline's RSS; the process's peak RSS is higher "
    "by XLA compiling the step (its working memory and executable, ~135 MiB for tiny) and the data pipeline, "
    "which are not planned",
    ("torch", "cuda"): "torch.cuda.max_memory_allocated() plus the CUDA context (what nvidia-smi shows for the "
    "process, less the caching allocator's unused reserve)",
    ("jax", "cuda"): "the compiled step's memory_analysis() plus the CUDA context, with "
    "XLA_PYTHON_CLIENT_PREALLOCATE=false (by default jax reserves 75% of the GPU at start)",
}
"""What the grand total (plan + process baseline) is comparable with, per (backend, device)."""
_MARKER = "__TWINSEQ_BASELINE__ "
_FORMAT = 1  # bump when the probe changes what it measures


@dataclass(frozen=True)
class ProcessBaseline:
    """The process baseline of one backend and device: ``bytes``, and how they were obtained."""

    bytes: int
    backend: str
    device: str
    source: str
    """``"measured now"``, ``"cached"`` or ``"estimated"``."""
    what: str
    """What the figure is."""
    detail: str
    """Where it is cached, or why it is an estimate."""

    @property
    def comparable(self) -> str:
        return COMPARABLE[(self.backend, self.device)]


def _imports(backend: str, peft: bool) -> tuple[str, ...]:
    return RUNTIME_IMPORTS[backend] + (PEFT_IMPORTS[backend] if peft else ())


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def _key(backend: str, peft: bool, python: str) -> dict[str, Any]:
    return {
        "format": _FORMAT,
        "backend": backend,
        "imports": list(_imports(backend, peft)),
        "warmup": WARMUP[backend],
        "versions": {d: _version(d) for d in VERSIONED[backend]},
        "python": python,
        "python_version": platform.python_version(),
        "machine": platform.machine(),
    }


def baseline_cache_path(backend: str, peft: bool = False, *, python: Optional[str] = None) -> Path:
    """Where the measured baseline of ``backend`` (with ``PEFT_IMPORTS`` when ``peft``) is cached."""
    key = _key(backend, peft, python or sys.executable)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "process_baseline" / f"{backend}{'-peft' if peft else ''}-{digest}.json"


def _probe_code(backend: str, peft: bool) -> str:
    required, optional = RUNTIME_IMPORTS[backend], PEFT_IMPORTS[backend] if peft else ()
    return (
        textwrap.dedent(f"""
        import gc, importlib, json, sys
        for name in {required!r}:
            importlib.import_module(name)
        for name in {optional!r}:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    """)
        + WARMUP[backend]
        + textwrap.dedent(f"""
        gc.collect()
        rss, how = None, None
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss, how = int(line.split()[1]) * 1024, "VmRSS"
        except OSError:
            pass
        if rss is None:
            import resource
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
            how = "ru_maxrss"
        print({_MARKER!r} + json.dumps({{"rss_bytes": rss, "how": how}}), flush=True)
    """)
    )


def _measure(backend: str, peft: bool, python: str, timeout: float) -> dict[str, Any]:
    """Run the probe in a fresh ``python``; raises ``RuntimeError`` saying why it gave no figure."""
    env = dict(os.environ)
    if backend == "jax":
        env["JAX_PLATFORMS"] = "cpu"  # the CPU plan's baseline: no GPU client, no preallocation
    try:
        proc = subprocess.run(
            [python, "-c", _probe_code(backend, peft)], capture_output=True, text=True, timeout=timeout, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise RuntimeError(f"the probe did not run ({type(err).__name__}: {err})") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARKER)]
    if proc.returncode != 0 or not lines:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the probe exited with {proc.returncode}: {last}")
    return json.loads(lines[-1][len(_MARKER) :])


def _read_cache(path: Path, key: dict[str, Any]) -> Optional[dict[str, Any]]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(record, dict) and record.get("key") == key and isinstance(record.get("rss_bytes"), int)
    return record if ok else None


def _write_cache(path: Path, record: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: two `twinseq memory` at once never read half a file
    except OSError as err:  # a read-only home: the figure is still this run's
        logger.warning("process baseline: could not cache it in %s (%s)", path, err)


def _describe(backend: str, peft: bool, versions: dict[str, str]) -> str:
    shown = ", ".join(f"{d} {v}" for d, v in versions.items() if v != "absent" and d != "twinseq")
    extra = f" + {'/'.join(PEFT_IMPORTS[backend])}" if peft else ""
    return f"python with twinseq's {backend} trainer{extra} imported (python {platform.python_version()}, {shown})"


def _estimate(backend: str, peft: bool, why: str) -> ProcessBaseline:
    n = ESTIMATED_BASELINE_BYTES[backend] + (ESTIMATED_PEFT_BYTES[backend] if peft else 0)
    extra = f" + {'/'.join(PEFT_IMPORTS[backend])}" if peft else ""
    what = f"python with twinseq's {backend} trainer{extra} imported"
    return ProcessBaseline(n, backend, "cpu", "estimated", what, f"{why}; the figure of the 2-core CPU machine")


def _cuda_context(backend: str) -> ProcessBaseline:
    return ProcessBaseline(
        CUDA_CONTEXT_BYTES,
        backend,
        "cuda",
        "estimated",
        "the CUDA context",
        "a constant: no GPU was available to measure it; lazy module loading starts it at ~274 MiB and the "
        "step's kernels load into it",
    )


def _measured(backend: str, peft: bool, python: str, timeout: float) -> ProcessBaseline:
    """Measure now and cache the figure; the estimate, saying why, when the probe gives none."""
    key = _key(backend, peft, python)
    path = baseline_cache_path(backend, peft, python=python)
    imports = ", ".join(_imports(backend, peft))
    logger.info("process baseline: measuring it once for %s (a fresh %s importing %s)", backend, python, imports)
    try:
        got = _measure(backend, peft, python, timeout)
    except RuntimeError as err:
        logger.warning("process baseline: not measured (%s); using the estimate", err)
        return _estimate(backend, peft, f"not measured: {err}")
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    _write_cache(path, {"key": key, "rss_bytes": int(got["rss_bytes"]), "how": got["how"], "measured_at": now})
    what = _describe(backend, peft, key["versions"])
    detail = f"{got['how']} of a fresh python; cached in {path}"
    return ProcessBaseline(int(got["rss_bytes"]), backend, "cpu", "measured now", what, detail)


def process_baseline(
    backend: str,
    *,
    device: str = "cpu",
    peft: bool = False,
    python: Optional[str] = None,
    timeout: float = 300.0,
) -> ProcessBaseline:
    """The process baseline of a ``backend`` training run on ``device`` (the module docstring): on CPU measured
    once by a fresh ``python`` (default ``sys.executable``), then cached; estimated when that cannot run. On
    ``cuda``, ``CUDA_CONTEXT_BYTES``."""
    if backend not in RUNTIME_IMPORTS:
        raise ConfigError(f"backend={backend!r} has no process baseline; use torch or jax.")
    if device == "cuda":
        return _cuda_context(backend)
    if device != "cpu":
        raise ConfigError(f"device={device!r} is not planned; use cpu or cuda.")
    python = python or sys.executable
    key = _key(backend, peft, python)
    path = baseline_cache_path(backend, peft, python=python)
    cached = _read_cache(path, key)
    if cached is None:
        return _measured(backend, peft, python, timeout)
    logger.debug("process baseline: cached %s (measured %s)", path, cached.get("measured_at", "?"))
    what = _describe(backend, peft, key["versions"])
    return ProcessBaseline(cached["rss_bytes"], backend, device, "cached", what, f"cached in {path}")


def grand_total_lines(plan_total: int, baseline: ProcessBaseline, width: int) -> list[str]:
    """The lines ``twinseq memory`` prints under the plan's table: the baseline, the grand total and what it is
    comparable with (``width``: the table's component column)."""
    grand = plan_total + baseline.bytes
    return [
        f"{'process baseline':<{width}}  {format_bytes(baseline.bytes):>10}  {baseline.source}: {baseline.what} "
        f"({baseline.detail})",
        f"{'grand total':<{width}}  {format_bytes(grand):>10}  plan total {format_bytes(plan_total)} + process "
        f"baseline {format_bytes(baseline.bytes)}",
        f"comparable with: {baseline.comparable}",
    ]
