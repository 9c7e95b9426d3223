"""The one step loop every trainer runs on, whatever the backend and the task.

A backend supplies a *step trainer* (``StepTrainer``: one optimizer step per call, its state as
numpy arrays and JSON values, a final export) and a *step source* (``StepSource``: the
micro-batches of each optimizer step, with a resumable position). ``run`` owns everything
around them, once: resume, step timing, logging every ``logging_steps`` steps, evaluation when
``eval_strategy`` says (``common.run.evaluation``, with the best model kept and restored), checkpoint
cadence and rotation, the final save and the end-of-run report. This is Keras 3's split,
where a backend's ``TorchTrainer`` overrides ``train_step`` and inherits ``fit``.

Under a multi-process launch every rank runs ``run``: ``step``, ``state_dict`` and
``save_final`` may be collectives; only the main rank writes files and logs.

What the runner guarantees a user who trains for hours:

- ``preflight`` refuses, before any data or model is built, what this machine cannot run, an
  output folder that cannot be written, and a model folder or checkpoint that cannot be read;
- a checkpoint is complete or absent (``common.run.checkpoint`` writes it atomically), and
  ``--resume-from-checkpoint latest`` takes the newest complete one;
- SIGTERM or Ctrl-C stops the run at the next step boundary with a checkpoint of that step
  (``TrainingInterrupted``), as preemptible clusters need; a second signal stops it at once;
- a NaN or Inf loss or gradient norm stops the run (``NonFiniteError``, naming the step and
  the micro-batch) before the update is applied, so the last checkpoint is the last good one;
  with ``skip_nonfinite_steps`` the step is skipped instead, counted and logged.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

from twinseq.common.config import MODEL_PRESETS, TrainConfig
from twinseq.common.errors import CheckpointError, ConfigError, NonFiniteError, TrainingInterrupted
from twinseq.common.models.hf_folder import resolve_model_source
from twinseq.common.run.callbacks import CallbackList, TrainerControl, TrainerState
from twinseq.common.run.capabilities import check_runtime
from twinseq.common.run.checkpoint import (
    PREFIX,
    checkpoint_dir,
    list_checkpoints,
    load_training_checkpoint,
    read_meta,
    resolve_resume,
    rotate_checkpoints,
    save_training_checkpoint,
)
from twinseq.common.run.evaluation import Evaluator, best_state, evaluate, restore_best, track_best
from twinseq.common.run.report import RunLogger, finish_run
from twinseq.common.run.schedule import describe_run_length, with_resolved_max_steps

logger = logging.getLogger(__name__)


@runtime_checkable
class StepTrainer(Protocol):
    """What a backend implements per task (torch and jax, SFT and DPO, one process or many)."""

    @property
    def is_main(self) -> bool:
        """This process writes files and logs (rank 0)."""

    def step(self, micro_batches: list[Any]) -> dict[str, Any]:
        """One optimizer step; metrics with at least ``loss`` and ``num_tokens`` (over all ranks)."""

    def after_step(self, step: int) -> None:
        """After optimizer step ``step`` (1-based): what follows an update (the reference's synchronisation)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs, as nested dicts of numpy arrays (or ``LazyArray``s, produced one at a time
        while the checkpoint is written) and JSON values. Under FSDP every rank returns the same tree of
        ``LazyArray``s; the main rank writes, the others take part in each tensor's gather."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (on every rank)."""

    def save_final(self, path: Path) -> None:
        """Export the trained model to ``path`` (a Hugging Face folder)."""

    def peak_memory_bytes(self) -> int:
        """Peak device memory so far (max over ranks)."""

    def any_rank(self, flag: bool) -> bool:
        """``flag`` OR-ed over every rank (the ranks must agree on when to stop)."""


class StepSource(Protocol):
    """The data side: ``common.data.sft_steps.StepIterator`` and its kin."""

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of one pass over the data: what ``num_train_epochs`` and the ``epoch`` metric count."""

    def next_step(self) -> list[Any]:
        """The micro-batches of the next optimizer step, for this rank."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# --------------------------------------------------------------------------------------
# Before any work
# --------------------------------------------------------------------------------------


def check_output_dir(path: str | os.PathLike) -> None:
    """Raise unless ``path`` is (or can become) a writable folder: checked before data and model are built."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"output_dir={str(path)!r} is a file, not a folder; pass a folder for the run (--output-dir runs/NAME)."
        )
    existing = path if path.is_dir() else next((p for p in path.parents if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"output_dir={str(path)!r} cannot be written ({str(existing)!r} is not a writable "
            f"folder); pass a folder you can write to (--output-dir)."
        )


def previous_run(path: str | os.PathLike) -> list[str]:
    """What of an earlier run ``path`` holds: ``metrics.jsonl``, ``checkpoint-N`` folders, ``final/`` (empty: none)."""
    path = Path(path)
    if not path.is_dir():
        return []
    found = ["metrics.jsonl"] if (path / "metrics.jsonl").is_file() else []
    found += [p.name for p in list_checkpoints(path)]
    return found + (["final/"] if (path / "final").is_dir() else [])


def check_previous_run(cfg: TrainConfig) -> None:
    """Refuse an ``output_dir`` that holds a run, unless this run overwrites it (``overwrite_output_dir``, HF's
    name) or continues it (``resume_from_checkpoint``): a second run into the same folder would otherwise
    truncate the first one's metrics and mix its checkpoints with the new ones."""
    found = previous_run(cfg.output_dir)
    if not found or cfg.resume_from_checkpoint is not None:
        return
    shown = found if len(found) <= 4 else [*found[:3], f"... ({len(found) - 3} more)"]
    if not cfg.overwrite_output_dir:
        raise ConfigError(
            f"output_dir={str(cfg.output_dir)!r} already holds a run ({', '.join(shown)}); pass "
            f"--overwrite-output-dir to train over it, or --resume-from-checkpoint latest to continue it "
            f"(or choose another --output-dir)."
        )
    logger.warning(
        "overwrite_output_dir: training over the run in %s (%s); metrics.jsonl and final/ are rewritten, older "
        "checkpoint folders stay until rotated",
        cfg.output_dir,
        ", ".join(shown),
    )


def _note_task_defaults(cfg: TrainConfig) -> None:
    """Log the learning rate a run took from its task (``DEFAULT_LEARNING_RATES``), with a hint when it trains a
    freshly initialised model, for which a pretrained checkpoint's rate barely moves the loss."""
    if "learning_rate" not in cfg.task_defaults():
        return
    fresh = cfg.model.model_config in MODEL_PRESETS or cfg.model.init_weights == "random"
    logger.info(
        "learning_rate=%g: the default of task=%r%s for a pretrained checkpoint (TRL's)%s",
        cfg.optim.learning_rate,
        cfg.task,
        " with use_peft" if cfg.peft.use_peft else "",
        "; this model starts from random weights, which want ~1e-3 (--learning-rate)" if fresh else "",
    )


def preflight(cfg: TrainConfig, runtime: Any) -> None:
    """Every check that needs no data and no model, in the order a user would fix them: what this
    machine can run (``common.run.capabilities``), the output folder (writable, and not holding another run
    unless ``overwrite_output_dir`` or a resume), the model folder, the checkpoint."""
    check_runtime(cfg, runtime)
    check_output_dir(cfg.output_dir)
    check_previous_run(cfg)
    _note_task_defaults(cfg)
    resolve_model_source(cfg.model.model_config, cfg.model.init_weights)
    if cfg.resume_from_checkpoint not in (None, "latest", "auto"):
        read_meta(cfg.resume_from_checkpoint)


# --------------------------------------------------------------------------------------
# Resume
# --------------------------------------------------------------------------------------

# Fields a resumed run must share with the run that wrote the checkpoint: the model, and what
# defines the data stream whose position the checkpoint holds.
RESUME_INVARIANTS = (
    "backend",
    "task",
    "model_config",
    "dataset_name",
    "dataset_split",
    "eval_fraction",  # the rows it holds out are not trained on
    "tokenizer_name_or_path",
    "max_length",
    "truncation_mode",
    "packing",
    "packing_strategy",
    "padding_free",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "seed",
)


def _check_compatible(cfg: TrainConfig, meta: dict[str, Any], path: Path) -> None:
    try:
        saved = TrainConfig.from_dict(meta["config"]).to_flat_dict()
    except (KeyError, ValueError, TypeError) as err:
        raise CheckpointError(
            f"{path}/trainer_state.json holds no readable run config ({err}); resume from a "
            f"checkpoint written by this twinseq."
        ) from None
    now = cfg.to_flat_dict()
    changed = [f"{k}: {saved[k]!r} -> {now[k]!r}" for k in RESUME_INVARIANTS if saved[k] != now[k]]
    if changed:
        raise CheckpointError(
            f"{path} was written by another run ({'; '.join(changed)}); resume with the same "
            f"settings, or start a fresh run in another --output-dir."
        )


def resume(cfg: TrainConfig, trainer: StepTrainer, source: StepSource) -> int:
    """Restore ``trainer`` and ``source`` from ``cfg.resume_from_checkpoint``; the last step done (0: fresh)."""
    path = resolve_resume(cfg.resume_from_checkpoint, cfg.output_dir)
    if path is None:
        return 0
    meta, state = load_training_checkpoint(path)
    _check_compatible(cfg, meta, path)
    step = int(meta["step"])
    if step > cfg.max_steps:
        raise CheckpointError(
            f"{path} is at step {step}, past max_steps={cfg.max_steps}; raise --max-steps to "
            f"at least {step} (or --num-train-epochs, with --max-steps -1) to continue that run."
        )
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
        if key in ("step", "lr", "epoch"):
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


class StopSignal:
    """SIGTERM/SIGINT handlers that ask the loop to stop at the next step boundary (main thread only).

    The first signal sets the request and restores the default handlers, so a second one stops the
    process at once (Ctrl-C twice).
    """

    SIGNALS = {signal.SIGTERM: 143, signal.SIGINT: 130}

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signum
        self._restore()
        logger.warning("received %s: stopping after the current step, with a checkpoint", signal.Signals(signum).name)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()


@dataclass
class RunHooks:
    """The callbacks of a run with the state and control they share (``common.run.callbacks``)."""

    cfg: TrainConfig
    callbacks: CallbackList
    state: TrainerState
    control: TrainerControl = field(default_factory=TrainerControl)
    evaluator: Optional[Evaluator] = None
    """The run's evaluation (``common.run.evaluation``), None without an eval set."""

    def call(self, hook: str, **kwargs: Any) -> None:
        if self.callbacks:
            self.callbacks.call(hook, self.cfg, self.state, self.control, **kwargs)


def _save(
    cfg: TrainConfig, trainer: StepTrainer, source: StepSource, step: int, hooks: Optional[RunHooks] = None
) -> None:
    state = trainer.state_dict()  # collectives under FSDP (each tensor's gather): every rank writes or takes part
    meta = {"data": source.state_dict(), "config": cfg.to_dict()}
    if hooks is not None and hooks.evaluator is not None:
        if hooks.state.best_global_step == step:  # HF's rule: the best model's checkpoint is the one written now
            hooks.state.best_model_checkpoint = str(checkpoint_dir(cfg.output_dir, step))
        meta["best"] = best_state(hooks.state)
    save_training_checkpoint(cfg.output_dir, step, state, meta, write=trainer.is_main)
    if trainer.is_main:
        best = hooks.state.best_model_checkpoint if hooks is not None and cfg.load_best_model_at_end else None
        _rotate(cfg, best)


def _rotate(cfg: TrainConfig, best: Optional[str]) -> None:
    """``rotate_checkpoints``, except that the best checkpoint (``load_best_model_at_end``) is never deleted: it
    counts as the newest, as HF's rotation does (with ``save_total_limit=1`` the newest is kept beside it)."""
    saved = list_checkpoints(cfg.output_dir)
    if best is None or cfg.save_total_limit is None or (saved and saved[-1].name == Path(best).name):
        rotate_checkpoints(cfg.output_dir, cfg.save_total_limit)
        return
    rotate_checkpoints(cfg.output_dir, None)  # leftovers of interrupted saves only
    others = [p for p in saved if p.name != Path(best).name]
    keep = max(cfg.save_total_limit - 1, 1)
    for path in others[:-keep]:
        assert path.name.startswith(PREFIX), path
        shutil.rmtree(path, ignore_errors=True)


def run(
    cfg: TrainConfig,
    trainer: StepTrainer,
    source: StepSource,
    *,
    tokenizer: Any,
    desc: str,
    announce: Sequence[str] = (),
    plot_keys: Sequence[str] = ("loss", "tokens_per_second"),
    callbacks: Sequence[Any] = (),
    evaluator: Optional[Evaluator] = None,
) -> Path:
    """Train ``cfg.max_steps`` optimizer steps (``max_steps=-1``: ``num_train_epochs`` passes over ``source``,
    ``common.run.schedule.resolve_max_steps``); returns the path of ``<output_dir>/metrics.jsonl``. Every metrics
    line carries ``epoch``, the passes over the data done (fractional: 1.5 is halfway through the second).

    ``announce`` lines are printed (main rank) before the first step; ``plot_keys`` are the panels
    of the end-of-run ``metrics.png``; ``callbacks`` (``common.run.callbacks``) are called at each step, log,
    save and evaluation, and may stop the run early (it then ends as at ``max_steps``: saves, final model).
    ``evaluator`` (``common.run.evaluation.build_evaluator``) evaluates when ``eval_strategy`` says (and before step 1
    with ``eval_on_start``); with ``load_best_model_at_end`` the final model is the best evaluation's.
    """
    announce = [*announce, describe_run_length(cfg, source.steps_per_epoch)]
    cfg = with_resolved_max_steps(cfg, source)  # max_steps=-1: the epochs decide, as in the builder's trainer
    start = resume(cfg, trainer, source)
    hooks = RunHooks(
        cfg,
        CallbackList(callbacks),
        TrainerState(start, cfg.max_steps, is_world_process_zero=trainer.is_main),
        evaluator=evaluator,
    )
    if start and evaluator is not None:  # keep comparing with the best evaluation of the resumed run
        resumed = resolve_resume(cfg.resume_from_checkpoint, cfg.output_dir)
        restore_best(hooks.state, read_meta(resumed).get("best") if resumed is not None else None)
    log: Optional[RunLogger] = None
    if trainer.is_main:
        log = RunLogger(
            cfg.output_dir,
            cfg.max_steps,
            disable_tqdm=cfg.disable_tqdm,
            desc=desc,
            resume_step=start,
            report_to=cfg.report_to,
        )
        log.log_config(cfg)
        for line in announce:
            log.write(line)
    final = Path(cfg.output_dir) / "final"
    try:
        with StopSignal() as stop:  # a signal during the last saves lets them finish
            hooks.call("on_train_begin")
            if evaluator is not None and cfg.eval_on_start:
                _evaluate(trainer, log, hooks, start)
                if cfg.load_best_model_at_end and start == 0:  # the starting weights may stay the best
                    _save(cfg, trainer, source, 0, hooks)
            skipped, last = _loop(cfg, trainer, source, log, start, stop, hooks)
            if start < last and cfg.save_final_checkpoint:
                _save(cfg, trainer, source, last, hooks)
                hooks.call("on_save", checkpoint=str(checkpoint_dir(cfg.output_dir, last)))
            if evaluator is not None and cfg.load_best_model_at_end:
                _load_best(trainer, log, hooks.state, last)
            trainer.save_final(final)
            hooks.call("on_train_end")
    finally:
        if log is not None:
            log.close()
    metrics_path = Path(cfg.output_dir) / "metrics.jsonl"
    if log is not None:
        tokenizer.save_pretrained(final)
        finish_run(cfg.output_dir, keys=tuple(plot_keys))
        if skipped:
            print(
                f"skipped {skipped} optimizer step(s) with a non-finite loss or gradient norm "
                f"(skip_nonfinite_steps=True); see num_skipped_steps in {metrics_path}"
            )
    return metrics_path


def _evaluate(trainer: StepTrainer, log: Any, hooks: RunHooks, step: int) -> None:
    """Evaluate after ``step`` (0: before the first): log the metrics as their own line, keep them in the log
    history, track the best, and call the callbacks' ``on_evaluate``."""
    assert hooks.evaluator is not None
    metrics = evaluate(trainer, hooks.evaluator, step=step)
    epoch = {} if hooks.state.epoch is None else {"epoch": hooks.state.epoch}
    record = {"step": step, **epoch, **metrics}
    if log is not None:
        log.log_eval(record)
    hooks.state.log_history.append(record)
    track_best(hooks.state, hooks.cfg, metrics, step)
    hooks.call("on_evaluate", metrics=metrics)


def _load_best(trainer: StepTrainer, log: Any, state: TrainerState, last: int) -> None:
    """``load_best_model_at_end``: the weights of the best evaluation's checkpoint (every rank loads them), unless
    the weights at hand, those of step ``last``, are the best."""
    if state.best_global_step is None or state.best_global_step == last:
        return
    if state.best_model_checkpoint is None or not Path(state.best_model_checkpoint).is_dir():
        logger.warning(
            "load_best_model_at_end: the best evaluation (step %s) has no checkpoint; the final model is step %d's",
            state.best_global_step,
            last,
        )
        return
    trainer.load_state_dict(load_training_checkpoint(state.best_model_checkpoint)[1])
    if log is not None:
        log.write(
            f"load_best_model_at_end: the final model is {Path(state.best_model_checkpoint).name} "
            f"(best {state.best_metric:.6g} at step {state.best_global_step})"
        )


def _loop(
    cfg: TrainConfig, trainer: StepTrainer, source: StepSource, log: Any, start: int, stop: StopSignal, hooks: RunHooks
) -> tuple[int, int]:
    """Steps ``start + 1 .. max_steps``: log, checkpoint, call the callbacks, and stop cleanly on a signal or when a
    callback asks; returns (the number of skipped steps, the last step run)."""
    window: list[dict[str, Any]] = []
    skipped = 0
    for step in range(start + 1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        try:
            out = trainer.step(source.next_step())
        except NonFiniteError as err:
            kept = [p.name for p in list_checkpoints(cfg.output_dir)]
            raise NonFiniteError(
                f"step {step}: {err}; the run stops here and the last checkpoint "
                f"({kept[-1] if kept else 'none yet'}) holds the last good state. Lower the learning "
                f"rate, check the data, or pass --skip-nonfinite-steps."
            ) from None
        seconds = time.perf_counter() - t0
        skipped += int(out.get("num_skipped_steps", 0))
        window.append(
            {
                "step": step,
                "epoch": step / source.steps_per_epoch,  # HF's fractional epoch: 1.5 = halfway through the second
                **out,
                "tokens_per_second": out["num_tokens"] / seconds,
                "step_seconds": seconds,
                "peak_memory_bytes": trainer.peak_memory_bytes(),
            }
        )
        trainer.after_step(step)
        hooks.state.global_step, hooks.state.epoch = step, step / source.steps_per_epoch
        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
            record = _merge_window(window)
            if log is not None:
                log.log_step(record)
            hooks.state.log_history.append(record)
            hooks.call("on_log", logs=record)
            window = []
        hooks.call("on_step_end")
        evaluated = hooks.evaluator is not None and hooks.evaluator.due(step, cfg.max_steps)
        if evaluated:
            _evaluate(trainer, log, hooks, step)
        stopping = trainer.any_rank(stop.received is not None)
        at_best = evaluated and cfg.load_best_model_at_end  # HF saves at every evaluation then
        if (cfg.save_steps and step % cfg.save_steps == 0 or stopping or at_best) and step < cfg.max_steps:
            _save(cfg, trainer, source, step, hooks)
            hooks.call("on_save", checkpoint=str(checkpoint_dir(cfg.output_dir, step)))
        if not stopping and step < cfg.max_steps and trainer.any_rank(hooks.control.should_training_stop):
            if log is not None and window:
                log.log_step(_merge_window(window))
            logger.info("a callback stopped the run after step %d of %d", step, cfg.max_steps)
            return skipped, step
        if stopping and step < cfg.max_steps:
            if log is not None and window:
                log.log_step(_merge_window(window))
            name = signal.Signals(stop.received).name if stop.received else "a signal on another rank"
            raise TrainingInterrupted(
                f"stopped by {name} after step {step} of {cfg.max_steps}: saved "
                f"checkpoint-{step} in {cfg.output_dir}; resume with --resume-from-checkpoint "
                f"latest",
                143 if stop.received is None else StopSignal.SIGNALS.get(stop.received, 143),  # type: ignore[call-overload]
            )
    return skipped, cfg.max_steps
