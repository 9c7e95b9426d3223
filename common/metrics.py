"""Run logging shared by both trainers: ``metrics.jsonl`` plus a tqdm progress bar.

Every run writes ``<output_dir>/metrics.jsonl``, one JSON object per optimizer step with at
least ``step``, ``loss``, ``num_tokens``, ``tokens_per_second`` and ``peak_memory_bytes``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

REQUIRED_FIELDS = ("step", "loss", "num_tokens", "tokens_per_second", "peak_memory_bytes")
logger = logging.getLogger(__name__)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux ru_maxrss is in KiB)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"


class RunLogger:
    """Append per-step metrics to ``metrics.jsonl`` and show them on a progress bar.

    ``resume_step`` keeps the lines of steps ``<= resume_step`` and drops later ones, so a
    resumed run continues the same file without duplicated steps.
    """

    def __init__(self, output_dir: str | os.PathLike, max_steps: int, *, disable_tqdm: bool = False,
                 desc: str = "train", resume_step: int = 0) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self._file = self.path.open("a")
        from tqdm.auto import tqdm

        self._bar = tqdm(total=max_steps, initial=resume_step, desc=desc, disable=disable_tqdm,
                         dynamic_ncols=True, file=sys.stderr)

    def _truncate_after(self, resume_step: int) -> None:
        if not self.path.exists():
            return
        if resume_step <= 0:
            self.path.unlink()
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= resume_step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def log_step(self, metrics: dict[str, Any]) -> None:
        missing = [k for k in REQUIRED_FIELDS if k not in metrics]
        assert not missing, f"metrics for step {metrics.get('step')} lack {missing}"
        loss = float(metrics["loss"])
        if not math.isfinite(loss):
            logger.warning("step %s: loss is %s", metrics["step"], loss)
        self._file.write(json.dumps(metrics, sort_keys=False) + "\n")
        self._file.flush()
        self._bar.update(1)
        self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{metrics['tokens_per_second']:.0f}",
                              peak=_human_bytes(metrics["peak_memory_bytes"]), refresh=False)

    def write(self, message: str) -> None:
        self._bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
        self._file.close()


def read_metrics(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_losses(records: list[dict[str, Any]], window: int = 5) -> Optional[str]:
    """One line: first and last (windowed mean) loss and their ratio."""
    if not records:
        return None
    losses = [r["loss"] for r in records]
    w = max(1, min(window, len(losses) // 2 or 1))
    first, last = sum(losses[:w]) / w, sum(losses[-w:]) / w
    return (f"loss: first step {losses[0]:.4f}, final step {losses[-1]:.4f} (final/first = "
            f"{losses[-1] / losses[0]:.3f}); mean of first/last {w} steps {first:.4f} -> {last:.4f} "
            f"(ratio {last / first:.3f}) over {len(losses)} steps")


def plot_metrics(output_dir: str | os.PathLike, *, keys: tuple[str, ...] = ("loss", "tokens_per_second")) -> Path:
    """Write ``<output_dir>/metrics.png``: one panel per key, against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(output_dir)
    keys = tuple(k for k in keys if records and k in records[0])
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.2), squeeze=False)
    steps = [r["step"] for r in records]
    for ax, key in zip(axes[0], keys):
        ax.plot(steps, [r[key] for r in records], marker=".", lw=1)
        ax.set_xlabel("optimizer step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(output_dir) / "metrics.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish_run(output_dir: str | os.PathLike,
               keys: tuple[str, ...] = ("loss", "tokens_per_second")) -> Optional[str]:
    """End-of-run report shared by every trainer: the loss summary line and ``metrics.png``."""
    records = read_metrics(output_dir)
    summary = summarize_losses(records)
    if summary:
        plot = plot_metrics(output_dir, keys=keys)
        print(f"{summary}\nplot: {plot}")
    return summary
