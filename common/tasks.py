"""The training methods, as data: one ``TaskSpec`` per task, declared by the method's own objectives module.

Everything that used to be a per-task list is read from here: the ``task`` choices and their default learning
rates, the config sections a task reads (setting one on another task is refused), the tasks with a reference
model, the online (generating) tasks, the panels of ``metrics.png``, the embedded dataset, the one-process rule,
the task's own config checks, its evaluator, the Python API's trainer class, and each backend's builder. A new
method declares one spec beside its loss (``common/objectives/<method>.py``) and writes
``torch_backend/<method>.py`` and ``jax_backend/<method>.py``; nothing else lists it (docs/architecture.md,
"Adding a training method").

Backend code and data code are named by string (``"kto:build_kto"``, ``"twinseq.common.data.unpaired:..."``) and
imported when a run needs them: ``common`` never imports a backend, and the objectives modules, which declare the
specs, stay below the data and run modules that implement the evaluators.

>>> task_spec("kto").sections
('dpo', 'kto')
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

from twinseq.common.errors import ConfigError

EmbeddedData = Literal["sft", "preference", "prompts"]


@dataclass(frozen=True)
class TaskSpec:
    """One training method."""

    name: str
    """``--task`` value."""
    trainer: str
    """The Python API's class name (``twinseq.KTOTrainer``); its argument class is the same name with ``Config``
    for ``Trainer`` (``KTOConfig``)."""
    builder: str
    """``"<module>:<function>"`` in each backend package: ``torch_backend.<module>.<function>(cfg, device, runtime,
    inputs=...)`` and ``jax_backend.<module>.<function>(cfg, inputs=...)`` return (trainer, step source, tokenizer,
    announce lines)."""
    order: int = 100
    """Where the task sits in ``--task``'s choices (built-in methods 0-4)."""
    sections: tuple[str, ...] = ()
    """The task-specific config sections it reads (``TrainConfig`` fields); with ``reference`` the ``reference``
    section is added. A section is refused on every task that does not list it."""
    reference: bool = False
    """The task compares against a reference model (``reference`` section, TR-DPO's synchronisation)."""
    online: bool = False
    """The task generates its batches (``common.run.rollout``; the ``grpo`` section's rollout knobs)."""
    one_process: bool = False
    """FSDP, context parallelism and multi-process launches are not implemented for it (refused by the capability
    check), and neither is ``torch_compile``."""
    data: EmbeddedData = "sft"
    """Which embedded dataset ``dataset_name='embedded'`` means for it."""
    learning_rate: float = 2e-5
    """The default ``learning_rate`` for a full fine-tune (TRL's default of the method)."""
    peft_learning_rate: float = 1e-4
    """The default with LoRA (about ten times the full fine-tune's, as TRL's PEFT guides)."""
    kl_beta: Optional[str] = None
    """``"<section>.<field>"`` of the KL coefficient of an online task (``grpo.grpo_beta``): at 0 no reference
    model is loaded (None: the task's reference, if any, is always used)."""
    shares_prefix: bool = False
    """The task scores several completions of one prompt, so its batches can write the prompt once
    (``memory.share_prefix``, ``common.data.prefix_sharing``)."""
    plot_keys: tuple[str, ...] = ("loss", "tokens_per_second")
    """The panels of the end-of-run ``metrics.png``."""
    check: Optional[Callable[[Any], None]] = None
    """The task's own rules over a validated ``TrainConfig`` (called by ``TrainConfig._check_combinations``)."""
    evaluator: Optional[str] = None
    """``"<module path>:<function>"`` building the run's evaluator, called as ``f(cfg, trainer, dataset,
    tokenizer, world_size=, rank=, shared=)`` (None: the task has no held-out evaluation)."""

    @property
    def config_name(self) -> str:
        """The Python API's argument class (``KTOConfig``)."""
        return self.trainer.removesuffix("Trainer") + "Config"


_SPECS: dict[str, TaskSpec] = {}


def register_task(spec: TaskSpec) -> TaskSpec:
    """Add ``spec`` to the registry (once per name); returns it."""
    known = _SPECS.get(spec.name)
    if known is not None and known != spec:
        raise ConfigError(
            f"task {spec.name!r} is declared twice ({known.builder} and {spec.builder}); give the new method "
            f"another name."
        )
    _SPECS[spec.name] = spec
    return spec


def task_specs() -> tuple[TaskSpec, ...]:
    """Every registered task, in ``order``."""
    return tuple(sorted(_SPECS.values(), key=lambda s: (s.order, s.name)))


def task_names() -> tuple[str, ...]:
    return tuple(s.name for s in task_specs())


def task_spec(name: str) -> TaskSpec:
    """The spec of ``name``; an unknown task is refused with the known ones."""
    try:
        return _SPECS[name]
    except KeyError:
        raise ConfigError(f"task={name!r} is not a twinseq task; choose one of {list(task_names())}.") from None


def resolve(path: str, package: Optional[str] = None) -> Any:
    """The object ``"<module>:<attribute>"`` names (``package``: the package a relative module sits in)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(f"{package}.{module}" if package else module), attribute)


__all__ = ["TaskSpec", "register_task", "resolve", "task_names", "task_spec", "task_specs"]
