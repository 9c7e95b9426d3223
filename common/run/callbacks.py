"""Callbacks in the shape of transformers' ``TrainerCallback``: hooks the runner calls at fixed points of a run.

A callback implements any of ``on_train_begin``, ``on_step_end``, ``on_log``, ``on_evaluate``, ``on_save`` and
``on_train_end``, each called as ``hook(args, state, control, **kwargs)`` with the run's ``TrainConfig``, the
``TrainerState`` (global step, epoch, the log history, the best metric so far) and the ``TrainerControl`` a
callback sets to ask for something (``should_training_stop``). Methods a callback lacks are skipped, so a plain
object with one method is a callback. ``EarlyStoppingCallback`` stops a run whose evaluation metric has not
improved for ``early_stopping_patience`` evaluations, as transformers' does (it keeps its own best value; the
runner's ``state.best_metric`` is the one ``load_best_model_at_end`` reads).

>>> state, control = TrainerState(), TrainerControl()
>>> stop = EarlyStoppingCallback(early_stopping_patience=2)
>>> for loss in (3.0, 2.5, 2.6, 2.55):
...     state.global_step += 1
...     stop.on_evaluate(None, state, control, metrics={"eval_loss": loss})
>>> control.should_training_stop, stop.best, stop.best_step
(True, 2.5, 2)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from twinseq.common.errors import ConfigError

logger = logging.getLogger(__name__)

HOOKS = ("on_train_begin", "on_step_end", "on_log", "on_evaluate", "on_save", "on_train_end")


@dataclass
class TrainerState:
    """Where a run is: the fields of transformers' ``TrainerState`` that a callback reads."""

    global_step: int = 0
    max_steps: int = 0
    epoch: Optional[float] = None
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: Optional[float] = None
    best_global_step: Optional[int] = None
    best_model_checkpoint: Optional[str] = None
    is_world_process_zero: bool = True


@dataclass
class TrainerControl:
    """What the callbacks ask of the runner; read after every hook."""

    should_training_stop: bool = False
    should_evaluate: bool = False
    should_save: bool = False


class TrainerCallback:
    """A base to subclass, as transformers' ``TrainerCallback``: every hook does nothing until overridden."""

    def on_train_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Before the first step (after a resume has restored the state)."""

    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """After each optimizer step (``state.global_step`` is that step)."""

    def on_log(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """After a metrics line is written (``logs=``: the line)."""

    def on_evaluate(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """After an evaluation (``metrics=``: the ``eval_*`` values)."""

    def on_save(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """After a checkpoint is written (``checkpoint=``: its folder)."""

    def on_train_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """After the final model is saved."""


class CallbackList:
    """The callbacks of a run, called in order; a hook a callback does not define is skipped."""

    def __init__(self, callbacks: Sequence[Any] = ()) -> None:
        for cb in callbacks:
            if not any(callable(getattr(cb, hook, None)) for hook in HOOKS):
                raise ConfigError(
                    f"callbacks: {cb!r} has none of the hooks {', '.join(HOOKS)}; pass an object with at least one "
                    f"of them (a transformers TrainerCallback works)."
                )
        self.callbacks = list(callbacks)

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def call(self, hook: str, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if callable(method):
                method(args, state, control, **kwargs)


class EarlyStoppingCallback(TrainerCallback):
    """Stop when ``metric_for_best_model`` (``eval_loss`` unless the config names another) has not improved by
    more than ``early_stopping_threshold`` for ``early_stopping_patience`` evaluations in a row."""

    def __init__(
        self,
        early_stopping_patience: int = 1,
        early_stopping_threshold: float = 0.0,
        metric_for_best_model: Optional[str] = None,
        greater_is_better: Optional[bool] = None,
    ) -> None:
        if not isinstance(early_stopping_patience, int) or early_stopping_patience < 1:
            raise ConfigError(
                f"early_stopping_patience={early_stopping_patience!r} is not valid; pass a whole number of "
                f"evaluations >= 1."
            )
        if not early_stopping_threshold >= 0:
            raise ConfigError(
                f"early_stopping_threshold={early_stopping_threshold!r} is not valid; pass a number >= 0 (the "
                f"smallest change that counts as an improvement)."
            )
        self.patience, self.threshold = early_stopping_patience, float(early_stopping_threshold)
        self.metric, self.greater_is_better = metric_for_best_model, greater_is_better
        self.bad_evaluations = 0
        self.best: Optional[float] = None
        self.best_step: Optional[int] = None

    def _metric_name(self, args: Any) -> str:
        name = self.metric or getattr(args, "metric_for_best_model", None) or "eval_loss"
        return name if name.startswith("eval_") else f"eval_{name}"

    def _greater(self, args: Any, name: str) -> bool:
        if self.greater_is_better is not None:
            return self.greater_is_better
        configured = getattr(args, "greater_is_better", None)
        return bool(configured) if configured is not None else not name.endswith("loss")

    def on_evaluate(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        metrics = kwargs["metrics"]
        name = self._metric_name(args)
        if name not in metrics:
            raise ConfigError(
                f"EarlyStoppingCallback watches {name!r}, which this evaluation did not report (it reported "
                f"{sorted(metrics)}); pass metric_for_best_model= one of those."
            )
        value, best = float(metrics[name]), self.best
        greater = self._greater(args, name)
        improved = best is None or (value - best > self.threshold if greater else best - value > self.threshold)
        if improved:
            self.bad_evaluations = 0
            self.best, self.best_step = value, state.global_step
        else:
            self.bad_evaluations += 1
            if self.bad_evaluations >= self.patience:
                logger.info(
                    "early stopping at step %d: %s=%.6g has not improved on %.6g (step %s) for %d evaluation(s)",
                    state.global_step,
                    name,
                    value,
                    best,
                    self.best_step,
                    self.bad_evaluations,
                )
                control.should_training_stop = True
