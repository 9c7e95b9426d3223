"""The one step loop every trainer runs on, whatever the backend and the task.

A backend supplies a *step trainer* (``StepTrainer``: one optimizer step per call, its state as
numpy arrays and JSON values, a final export) and a *step source* (``StepSource``: the
micro-batches of each optimizer step, with a resumable position). ``run`` owns everything
around them, once: resume, step timing, logging every ``logging_steps`` steps, checkpoint
cadence and rotation, the final save and the end-of-run report. This is Keras 3's split,
where a backend's ``TorchTrainer`` overrides ``train_step`` and inherits ``fit``.

Under a multi-process launch every rank runs ``run``: ``step``, ``state_dict`` and
``save_final`` may be collectives; only the main rank writes files and logs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from twinseq.common.checkpoint import (load_training_checkpoint, resolve_resume, rotate_checkpoints,
                                       save_training_checkpoint)
from twinseq.common.config import TrainConfig
from twinseq.common.errors import CheckpointError

logger = logging.getLogger(__name__)


@runtime_checkable
class StepTrainer(Protocol):
    """What a backend implements per task (torch and jax, SFT and DPO, one process or many)."""

    is_main: bool
    """This process writes files and logs (rank 0)."""

    def step(self, micro_batches: list[Any]) -> dict[str, Any]:
        """One optimizer step; metrics with at least ``loss`` and ``num_tokens`` (over all ranks)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs, as nested dicts of numpy arrays and JSON values."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (on every rank)."""

    def save_final(self, path: Path) -> None:
        """Export the trained model to ``path`` (a Hugging Face folder)."""

    def peak_memory_bytes(self) -> int:
        """Peak device memory so far (max over ranks)."""


class StepSource(Protocol):
    """The data side: ``common.loader.StepIterator`` and its kin."""

    def next_step(self) -> list[Any]:
        """The micro-batches of the next optimizer step, for this rank."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def resume(cfg: TrainConfig, trainer: StepTrainer, source: StepSource) -> int:
    """Restore ``trainer`` and ``source`` from ``cfg.resume_from_checkpoint``; the last step done (0: fresh)."""
    path = resolve_resume(cfg.resume_from_checkpoint, cfg.output_dir)
    if path is None:
        return 0
    meta, state = load_training_checkpoint(path)
    step = int(meta["step"])
    if step > cfg.max_steps:
        raise CheckpointError(f"{path} is at step {step}, past max_steps={cfg.max_steps}; raise --max-steps to "
                              f"at least {step} to continue that run.")
    trainer.load_state_dict(state)
    source.load_state_dict(meta["data"])
    logger.info("resumed from %s at step %d", path, step)
    return step


def _merge_window(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One metrics line for the steps since the last one: counts add up, peaks take the max, the
    learning rate is the last one, the rest is averaged; tokens/s is total tokens over total time."""
    if len(records) == 1:
        return records[0]
    out: dict[str, Any] = {}
    for key in records[-1]:
        values = [r[key] for r in records if key in r]
        if key in ("step", "lr"):
            out[key] = values[-1]
        elif key.startswith("num_") or key.endswith("_sum"):
            out[key] = sum(values)
        elif key.startswith("peak_"):
            out[key] = max(values)
        else:
            out[key] = sum(values) / len(values)
    out["tokens_per_second"] = out["num_tokens"] / sum(r["step_seconds"] for r in records)
    out["logged_steps"] = len(records)
    return out


def _save(cfg: TrainConfig, trainer: StepTrainer, source: StepSource, step: int) -> None:
    state = trainer.state_dict()  # a collective under FSDP: every rank calls it
    if not trainer.is_main:
        return
    save_training_checkpoint(cfg.output_dir, step, state,
                             {"data": source.state_dict(), "config": cfg.to_dict()})
    rotate_checkpoints(cfg.output_dir, cfg.save_total_limit)


def run(cfg: TrainConfig, trainer: StepTrainer, source: StepSource, *, tokenizer: Any, desc: str,
        announce: Sequence[str] = (), plot_keys: Sequence[str] = ("loss", "tokens_per_second")) -> Path:
    """Train ``cfg.max_steps`` optimizer steps; returns the path of ``<output_dir>/metrics.jsonl``.

    ``announce`` lines are printed (main rank) before the first step; ``plot_keys`` are the panels
    of the end-of-run ``metrics.png``.
    """
    from twinseq.common.metrics import RunLogger, finish_run

    start = resume(cfg, trainer, source)
    log: Optional[RunLogger] = None
    if trainer.is_main:
        log = RunLogger(cfg.output_dir, cfg.max_steps, disable_tqdm=cfg.disable_tqdm, desc=desc, resume_step=start,
                        report_to=cfg.report_to)
        log.log_config(cfg)
        for line in announce:
            log.write(line)
    window: list[dict[str, Any]] = []
    for step in range(start + 1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        out = trainer.step(source.next_step())
        seconds = time.perf_counter() - t0
        window.append({"step": step, **out, "tokens_per_second": out["num_tokens"] / seconds,
                       "step_seconds": seconds, "peak_memory_bytes": trainer.peak_memory_bytes()})
        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
            if log is not None:
                log.log_step(_merge_window(window))
            window = []
        if cfg.save_steps and step % cfg.save_steps == 0 and step < cfg.max_steps:
            _save(cfg, trainer, source, step)
    if start < cfg.max_steps:
        _save(cfg, trainer, source, cfg.max_steps)
    final = Path(cfg.output_dir) / "final"
    trainer.save_final(final)
    metrics_path = Path(cfg.output_dir) / "metrics.jsonl"
    if log is not None:
        tokenizer.save_pretrained(final)
        log.close()
        finish_run(cfg.output_dir, keys=tuple(plot_keys))
    return metrics_path
