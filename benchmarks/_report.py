"""Where every benchmark result is written, with what it takes to reproduce it.

A result is ``<output_dir>/<what>_<hardware-slug>_<YYYY-MM-DD>.{json,md,png}``. Nothing in
the name is typed by hand: the slug comes from the detected hardware (``cpu-2core``,
``h100-80gb``) and the date from the UTC clock when the run started. The ``.json`` holds a
``"provenance"`` block (git commit and dirtiness, the command as run, versions, hardware,
dates, the arguments that differ from the script's defaults, load average) next to the
script's own figures; the ``.md`` opens with the same provenance as a table.

Usage from a benchmark script::

    def main(argv=None):
        run = start_run(parse_args, argv, __file__, device="cpu")   # parse, then take the provenance
        ...                                                          # measure with run.args
        run.write({"config": ..., "results": ...}, title="Packing benchmark", body=markdown_text,
                  plot=lambda png: draw(png))                        # write_result(...) underneath

Nothing here imports torch, jax or another framework: versions are read from the installed
packages' metadata (JAX fixes its device count at first import, and a benchmark may still
have to set ``XLA_FLAGS``), and CUDA is probed by torch in a short subprocess.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
RESULTS_DIR = HERE / "results"
MIB = 1 << 20

# Recorded for every result, installed or not, so that any two result files compare.
VERSION_PACKAGES = ("numpy", "pyarrow", "datasets", "torch", "jax", "jaxlib", "flax", "optax", "transformers",
                    "trl", "liger-kernel", "triton", "cut-cross-entropy")
# Environment variables that change what a benchmark measures; recorded when set.
ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "XLA_FLAGS", "JAX_PLATFORMS",
            "CUDA_VISIBLE_DEVICES", "MALLOC_MMAP_THRESHOLD_", "TWINSEQ_BACKEND", "TWINSEQ_CACHE",
            "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM", "TWINSEQ_TRITON_TILES",
            "TWINSEQ_COMMIT")
# Arguments that choose where results go, not what is measured.
OUTPUT_ARGS = frozenset({"output_dir", "no_write", "from_json"})
STEM_RE = re.compile(r"^(?P<what>[a-z0-9_]+?)_(?P<hardware>[a-z0-9.-]+)_(?P<date>\d{4}-\d{2}-\d{2})$")
NOT_INSTALLED = "not installed"

_CUDA_PROBE = r"""
import json, torch
out = {"cuda": torch.version.cuda}
if torch.cuda.is_available():
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    out["devices"] = [{"name": p.name, "memory_bytes": int(p.total_memory)} for p in props]
print(json.dumps(out))
"""


# --- provenance ----------------------------------------------------------------------------

def git_state(repo: Path = REPO_ROOT, results_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """``{"commit", "dirty", "changed_paths"}`` of the checkout holding ``repo``.

    ``changed_paths`` are ``git status --porcelain`` lines; the results folder is left out,
    since ``make bench`` writes there between one script and the next. Outside a git
    checkout: ``{"commit": None, "dirty": None, "error": ...}``.
    """
    try:
        commit = _git(repo, "rev-parse", "HEAD").strip()
        top = Path(_git(repo, "rev-parse", "--show-toplevel").strip())
        status = _git(repo, "status", "--porcelain", "--untracked-files=all").splitlines()
    except (OSError, subprocess.CalledProcessError) as err:
        commit, why = None, str(err).strip()
    else:
        why = f"its .git is at {commit}"
    # a copied tree (a GPU machine's) without .git, or whose .git is of another commit: the commit the copy was made
    # from, when the caller says it
    copied = os.environ.get("TWINSEQ_COMMIT")
    if commit is None or (copied and copied != commit):
        return {"commit": copied, "dirty": None, "changed_paths": [],
                "error": why + (" (a copied tree: the commit from TWINSEQ_COMMIT)" if copied else "")}
    skip = os.path.relpath(results_dir.resolve(), top.resolve()).replace(os.sep, "/") + "/"
    changed = [line for line in status if not line[3:].strip('"').startswith(skip)]
    return {"commit": commit, "dirty": bool(changed), "changed_paths": changed,
            "ignored_for_dirty": skip}


def _git(repo: Path, *argv: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *argv], capture_output=True, text=True, check=True,
                          timeout=30).stdout


def command_line(script: Optional[str] = None, argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """The command as run: ``sys.orig_argv`` (interpreter, its flags, script, arguments).

    A script's ``main(argv)`` called from other Python code passes ``script`` and ``argv``;
    the command is then the equivalent ``<interpreter> <script> <argv...>``.
    """
    if argv is None:
        run_argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
        how = "command line"
    else:
        script = os.path.relpath(script) if script else "<unknown script>"
        run_argv = [sys.executable, script, *argv]
        how = "main(argv) called from Python"
    return {"argv": run_argv, "command": shlex.join(run_argv), "executable": sys.executable,
            "cwd": os.getcwd(), "invoked_as": how}


def versions(packages: Sequence[str] = VERSION_PACKAGES) -> dict[str, str]:
    """Python and each package's installed version, or ``"not installed"``.

    >>> versions(["numpy", "no-such-package"])          # doctest: +SKIP
    {'python': '3.11.7', 'numpy': '2.4.6', 'no-such-package': 'not installed'}
    """
    found = {"python": platform.python_version()}
    for name in packages:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = NOT_INSTALLED
    return found


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def memory_total_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def usable_cores() -> int:
    """CPUs this process may run on (its affinity), which can be fewer than the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def gpu_info(timeout: float = 120.0) -> dict[str, Any] | str:
    """``"none"`` unless torch sees a CUDA GPU; then ``{"name", "count", "memory_bytes", "driver", "cuda"}``.

    torch is imported in a subprocess: importing it here would initialise CUDA and OpenMP in
    the measuring process.
    """
    try:
        importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none (torch not installed)"
    proc = subprocess.run([sys.executable, "-c", _CUDA_PROBE], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return f"unknown (the torch probe failed: {proc.stderr.strip().splitlines()[-1:]})"
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    devices = probe.get("devices") or []
    if not devices:
        return "none"
    return {"name": devices[0]["name"], "count": len(devices), "memory_bytes": devices[0]["memory_bytes"],
            "all_names": sorted({d["name"] for d in devices}), "driver": nvidia_driver_version(),
            "cuda": probe["cuda"]}


def nvidia_driver_version() -> str:
    if shutil.which("nvidia-smi"):
        proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.strip().splitlines()[0]
    try:  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  ..."
        text = Path("/proc/driver/nvidia/version").read_text()
        match = re.search(r"Kernel Module\s+(\S+)", text)
        if match:
            return match.group(1)
    except OSError:
        pass
    return "unknown"


def hardware() -> dict[str, Any]:
    """What the run had: CPU model, logical and usable cores, total memory, the GPU (or "none")."""
    return {"cpu_model": cpu_model(), "logical_cores": os.cpu_count(), "usable_cores": usable_cores(),
            "memory_total_bytes": memory_total_bytes(), "platform": platform.platform(), "gpu": gpu_info()}


def hardware_slug(hw: dict[str, Any], device: str = "cpu") -> str:
    """The file-name tag of ``hw`` for a run measured on ``device``.

    >>> hardware_slug({"usable_cores": 2}, "cpu")
    'cpu-2core'
    >>> hardware_slug({"gpu": {"name": "NVIDIA H100 80GB HBM3", "count": 1, "memory_bytes": 85e9}}, "cuda")
    'h100-80gb'
    >>> hardware_slug({"gpu": {"name": "NVIDIA H200", "count": 8, "memory_bytes": 143771 * 2**20}}, "cuda")
    'h200-140gb-x8'
    """
    if device == "cpu":
        return f"cpu-{hw['usable_cores']}core"
    gpu = hw.get("gpu")
    if not isinstance(gpu, dict):
        raise ValueError(f"device={device!r} but no GPU was detected (gpu: {gpu!r}); measure on 'cpu' or "
                         "run where torch sees a GPU.")
    words = [w for w in re.split(r"[\s_-]+", gpu["name"].lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    memory = next((w for w in words if re.fullmatch(r"\d+gb", w)), None)
    memory = memory or f"{round(gpu['memory_bytes'] / 2**30)}gb"
    slug = re.sub(r"[^a-z0-9.]", "", words[0] if words else "gpu") + f"-{memory}"
    return slug + (f"-x{gpu['count']}" if gpu["count"] > 1 else "")


def non_default_arguments(args: argparse.Namespace | dict, defaults: argparse.Namespace | dict) -> dict[str, Any]:
    """The parsed arguments that differ from the script's defaults, output location left out.

    Call it on the arguments as parsed, before the script fills in anything it derives.

    >>> non_default_arguments({"steps": 4, "seed": 0, "output_dir": "/tmp"}, {"steps": 20, "seed": 0})
    {'steps': 4}
    """
    values, default = (vars(a) if isinstance(a, argparse.Namespace) else a for a in (args, defaults))
    return {k: _plain(v) for k, v in values.items()
            if k not in OUTPUT_ARGS and k in default and _plain(v) != _plain(default[k])}


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def provenance(device: str = "cpu", *, changed_arguments: Optional[dict] = None, script: Optional[str] = None,
               argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Everything about this run but its figures; call it when the run starts.

    ``device`` is where the benchmark measures (``"cpu"`` or ``"cuda"``) and picks the
    hardware slug; ``changed_arguments`` is ``non_default_arguments(...)`` (empty: a full-size
    run); ``script``/``argv`` are for a ``main(argv)`` called from Python (``command_line``).
    """
    started = datetime.datetime.now(datetime.timezone.utc)
    hw = hardware()
    return {"started_utc": started.isoformat(timespec="seconds"), "date_utc": started.date().isoformat(),
            "git": git_state(), "command": command_line(script, argv), "versions": versions(),
            "hardware": hw, "device": device, "hardware_slug": hardware_slug(hw, device),
            "non_default_arguments": dict(changed_arguments or {}),
            "environment": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
            "load_average_1min": {"start": _load_average()}}


@dataclasses.dataclass
class Run:
    """One benchmark run: ``what`` it measures (the script's name), its parsed ``args`` (with
    ``add_output_args``' ``output_dir`` and ``no_write``) and its ``provenance``."""

    what: str
    args: argparse.Namespace
    provenance: dict[str, Any]

    def write(self, payload: dict[str, Any], *, title: str, body: str,
              plot: Optional[Callable[[Path], None]] = None) -> Path:
        """``write_result`` into ``args.output_dir`` (only printed with ``--no-write``)."""
        return write_result(self.what, self.provenance, payload, title=title, body=body,
                            output_dir=self.args.output_dir, plot=plot, dry_run=self.args.no_write)

    def arguments(self) -> dict[str, Any]:
        """The parsed arguments without the output location, for the payload."""
        return {k: _plain(v) for k, v in vars(self.args).items() if k not in OUTPUT_ARGS}


def start_run(parse: Callable[[Optional[Sequence[str]]], argparse.Namespace], argv: Optional[Sequence[str]],
              script: str, device: str | Callable[[argparse.Namespace], str] = "cpu") -> Run:
    """The ``Run`` of a script's ``main(argv)``, started: arguments parsed, provenance taken.

    ``parse(argv)`` parses; ``parse([])`` gives the defaults the arguments are compared with.
    ``device`` is ``"cpu"``, ``"cuda"`` or a function of the parsed arguments that returns one
    (it may fill in arguments it derives, e.g. ``_memory.resolve_device``). ``what`` is the
    script's file name without ``.py``.
    """
    args = parse(argv)
    changed = non_default_arguments(args, parse([]))
    where = device(args) if callable(device) else device
    return Run(Path(script).stem, args, provenance(where, changed_arguments=changed, script=script, argv=argv))


def _load_average() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def finish(prov: dict[str, Any]) -> dict[str, Any]:
    """Stamps the end of the run (once): ``finished_utc``, ``seconds``, the closing load average."""
    if "finished_utc" not in prov:
        end = datetime.datetime.now(datetime.timezone.utc)
        prov["finished_utc"] = end.isoformat(timespec="seconds")
        start = datetime.datetime.fromisoformat(prov["started_utc"])
        prov["seconds"] = round((end - start).total_seconds(), 1)
        prov["load_average_1min"]["end"] = _load_average()
    return prov


def result_stem(what: str, prov: dict[str, Any]) -> str:
    """``<what>_<hardware-slug>_<YYYY-MM-DD>``, e.g. ``packing_cpu-2core_2026-11-23``."""
    stem = f"{what}_{prov['hardware_slug']}_{prov['date_utc']}"
    assert STEM_RE.match(stem), f"result stem {stem!r} does not parse back"
    return stem


def parse_stem(stem: str) -> Optional[dict[str, str]]:
    """``"packing_cpu-2core_2026-11-21"`` -> ``{"what": "packing", "hardware": "cpu-2core", "date": ...}``."""
    match = STEM_RE.match(stem)
    return match.groupdict() if match else None


# --- writing -------------------------------------------------------------------------------

def provenance_markdown(prov: dict[str, Any]) -> str:
    """The provenance as a two-column markdown table (the head of every result ``.md``)."""
    git, cmd, hw, load = prov["git"], prov["command"], prov["hardware"], prov["load_average_1min"]
    if git["commit"] is None:
        commit = f"unknown ({git.get('error', 'not a git checkout')})"
    else:
        changed = git["changed_paths"]
        commit = f"`{git['commit']}`, " + (f"**dirty**: {len(changed)} changed path(s): "
                                           + ", ".join(f"`{c}`" for c in changed[:8])
                                           + (" ..." if len(changed) > 8 else "") if git["dirty"] else "clean")
    gpu = hw["gpu"]
    gpu_text = (f"{gpu['count']} x {gpu['name']} ({gpu['memory_bytes'] / 2**30:.1f} GiB), driver {gpu['driver']}, "
                f"CUDA {gpu['cuda']}" if isinstance(gpu, dict) else gpu)
    memory = hw["memory_total_bytes"]
    rows = [("commit", commit),
            ("command", f"`{cmd['command']}` (in `{cmd['cwd']}`, {cmd['invoked_as']})"),
            ("non-default arguments", ", ".join(f"`{k}={v}`" for k, v in prov["non_default_arguments"].items())
             or "none (the script's full-size defaults)"),
            ("run (UTC)", f"{prov['started_utc']} to {prov.get('finished_utc', '?')} ({prov.get('seconds', '?')} s)"),
            ("hardware", f"{hw['cpu_model']}; {hw['logical_cores']} logical cores, {hw['usable_cores']} usable; "
                         f"{'?' if memory is None else f'{memory / 2**30:.1f} GiB'} memory; GPU: {gpu_text}; "
                         f"{hw['platform']}"),
            ("measured on", f"{prov['device']} (file tag `{prov['hardware_slug']}`)"),
            ("versions", ", ".join(f"{k} {v}" for k, v in prov["versions"].items())),
            ("environment", ", ".join(f"`{k}={v}`" for k, v in prov["environment"].items()) or "none set"),
            ("load average (1 min)", f"{load['start']} at start, {load.get('end', '?')} at end")]
    return "\n".join(markdown_table(["provenance", ""], [[k, v.replace("|", "\\|")] for k, v in rows]))


def write_result(what: str, prov: dict[str, Any], payload: dict[str, Any], *, title: str, body: str,
                 output_dir: Path | str = RESULTS_DIR, plot: Optional[Callable[[Path], None]] = None,
                 dry_run: bool = False) -> Path:
    """Writes ``<output_dir>/<stem>.json`` (``{"what", "provenance", **payload}``) and ``<stem>.md``
    (title, provenance table, ``body``), then ``plot(<stem>.png)`` when given; prints the markdown.

    Returns the path without suffix. With ``dry_run`` it only prints.
    """
    assert not {"what", "provenance"} & set(payload), "payload keys 'what' and 'provenance' are reserved"
    finish(prov)
    stem = Path(output_dir) / result_stem(what, prov)
    text = (f"# {title} ({prov['hardware_slug']}, {prov['date_utc']})\n\n{provenance_markdown(prov)}\n\n"
            f"{body.strip()}\n")
    print(text, flush=True)
    if dry_run:
        return stem
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps({"what": what, "provenance": prov, **payload}, indent=2,
                                                    default=_plain) + "\n")
    stem.with_suffix(".md").write_text(text)
    written = ["json", "md"]
    if plot is not None:
        plot(stem.with_suffix(".png"))
        written.append("png")
    print(f"wrote {stem}.{{{','.join(written)}}}", flush=True)
    return stem


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """``--output-dir`` (aliases ``--out-dir``, ``--out``) and ``--no-write``, the same in every script."""
    parser.add_argument("--output-dir", "--out-dir", "--out", dest="output_dir", type=Path, default=RESULTS_DIR,
                        help="where the .json/.md/.png go (default: benchmarks/results)")
    parser.add_argument("--no-write", action="store_true", help="print only")


# --- markdown and figures shared by the scripts ----------------------------------------------

def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> list[str]:
    """Lines of a markdown table; ``align`` is one character per column, ``l`` or ``r`` (default ``l``)."""
    align = align or "l" * len(header)
    assert len(align) == len(header), (header, align)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def acceptance_line(checks: dict[str, bool]) -> str:
    """``"Acceptance: name: PASS, other: FAIL"``."""
    if not checks:
        return "Acceptance: nothing to check at these settings."
    return "Acceptance: " + ", ".join(f"{k}: {'PASS' if ok else 'FAIL'}" for k, ok in checks.items())


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (no display on the benchmark machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(ax, groups: Sequence[str], series: dict[str, Sequence[float]], *, title: Optional[str] = None,
                 ylabel: Optional[str] = None, labels: Optional[dict[str, Sequence[str]]] = None,
                 color: Any = None, legend: bool = True) -> None:
    """One bar per group and series, the series side by side; ``labels[name]`` writes text (a
    ratio, say) on top of that series' bars. With one series, ``color`` may list a colour per bar."""
    import numpy as np

    x = np.arange(len(groups))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=name, color=color)
        if labels and name in labels:
            ax.bar_label(bars, labels=list(labels[name]))
    ax.set_xticks(x, groups)
    if title:
        ax.set_title(title)
    if ylabel:
        ax.set_ylabel(ylabel)
    if legend and len(series) > 1:
        ax.legend(fontsize=8)


def memory_time_figure(path: Path, names: Sequence[str], rows: Sequence[dict], *, ratio_keys: tuple[str, str],
                       time_label: str, title: str, colors: Sequence[str], figsize=(10, 4)) -> None:
    """Two panels, one bar per row: ``peak_bytes`` (MiB) and ``median_seconds``, each bar labelled
    with the row's ratio to the baseline (``ratio_keys``: memory ratio, time ratio)."""
    fig, axes = pyplot().subplots(1, 2, figsize=figsize)
    panels = (("peak_bytes", MIB, ratio_keys[0], "peak memory above baseline (MiB)"),
              ("median_seconds", 1, ratio_keys[1], time_label))
    for ax, (key, scale, ratio, label) in zip(axes, panels):
        grouped_bars(ax, names, {key: [r[key] / scale for r in rows]}, ylabel=label, color=list(colors),
                     labels={key: [f"{r[ratio]:.2f}x" for r in rows]})
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title)
    save_figure(fig, path)


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
