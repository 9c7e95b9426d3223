"""The front door: trainer classes in TRL's shape, on either backend.

::

    from datasets import Dataset
    from peft import LoraConfig
    from twinseq import SFTConfig, SFTTrainer

    train = Dataset.from_list([{"text": "..."}, ...])
    args = SFTConfig(output_dir="runs/sft", max_steps=50, max_length=256, eval_steps=10)
    trainer = SFTTrainer(model="path/to/model", args=args, train_dataset=train, eval_dataset=held_out,
                         peft_config=LoraConfig(r=16, lora_alpha=32), backend="jax")
    result = trainer.train()            # TrainOutput(global_step, training_loss, metrics)
    trainer.evaluate(); trainer.save_model("runs/sft/export"); trainer.model

A trainer class turns its arguments into one ``TrainConfig`` (the run's description: what the log, the checkpoints
and a resume check read) and one ``common.run.inputs.RunInputs`` (the objects a YAML file cannot hold), then calls
``backend.train(config, inputs)``: the run ``twinseq train`` makes from the same config, with the same pre-run
checks. ``twinseq train`` itself is a thin layer over these classes (``common.cli.train_main``).

Nothing here imports torch or jax: a ``peft.LoraConfig`` is read by its fields, a ``transformers`` model is handed
to the torch backend as it is.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

from twinseq.common.backend import load_backend
from twinseq.common.config import TrainConfig
from twinseq.common.errors import ConfigError, ConfigTypeError
from twinseq.common.models.hf_folder import has_weights
from twinseq.common.run import evaluation
from twinseq.common.run.inputs import RunInputs
from twinseq.common.tasks import TaskSpec, task_specs

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------
# Configs: TrainConfig with the task fixed, TRL's flat names
# --------------------------------------------------------------------------------------


class _TaskConfig(TrainConfig):
    """``TrainConfig`` whose ``task`` is the class's; it takes TRL's flat names (``max_length=512``)."""

    TASK: ClassVar[str] = "sft"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        task = kwargs.setdefault("task", self.TASK)
        if task != self.TASK:
            raise ConfigError(
                f"{type(self).__name__}(task={task!r}) is not valid: a {type(self).__name__} is for task="
                f"{self.TASK!r}; drop task=, or use the config class of that task."
            )
        super().__init__(*args, **kwargs)


class SFTConfig(_TaskConfig):
    """The arguments of ``SFTTrainer``: ``TrainConfig`` with ``task="sft"`` (TRL's ``SFTConfig`` names)."""

    TASK = "sft"


class DPOConfig(_TaskConfig):
    """The arguments of ``DPOTrainer``: ``TrainConfig`` with ``task="dpo"`` (TRL's ``DPOConfig`` names)."""

    TASK = "dpo"


class GRPOConfig(_TaskConfig):
    """The arguments of ``GRPOTrainer``: ``TrainConfig`` with ``task="grpo"`` (TRL's ``GRPOConfig`` names)."""

    TASK = "grpo"


class RLOOConfig(_TaskConfig):
    """The arguments of ``RLOOTrainer``: ``TrainConfig`` with ``task="rloo"`` (TRL's ``RLOOConfig`` names, but
    ``rloo_beta``; the rollout's knobs are GRPO's: ``num_generations``, ``epsilon``, ``reward_funcs``, ...)."""

    TASK = "rloo"


class KTOConfig(_TaskConfig):
    """The arguments of ``KTOTrainer``: ``TrainConfig`` with ``task="kto"`` (TRL's ``KTOConfig`` names: ``beta``,
    ``desirable_weight``, ``undesirable_weight``, ``precompute_ref_log_probs``; its ``loss_type`` is
    ``kto_loss_type``)."""

    TASK = "kto"


# --------------------------------------------------------------------------------------
# peft.LoraConfig -> twinseq's PEFT fields
# --------------------------------------------------------------------------------------

# LoraConfig field -> twinseq field, for the fields twinseq has
_LORA_FIELDS = {
    "r": "lora_r",
    "lora_alpha": "lora_alpha",
    "lora_dropout": "lora_dropout",
    "target_modules": "lora_target_modules",
    "target_parameters": "lora_target_parameters",
    "use_rslora": "use_rslora",
    "use_dora": "use_dora",
    "trainable_token_indices": "trainable_token_indices",
}
# fields that describe where the config came from, not what trains
_LORA_IGNORED = {
    "task_type",
    "peft_type",
    "auto_mapping",
    "peft_version",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "runtime_config",
    "megatron_core",
    "_custom_modules",
    "qalora_group_size",
}
PEFT_DEFAULT_TARGETS = ["q_proj", "v_proj"]
"""peft's own target modules for every family twinseq trains, when a ``LoraConfig`` names none."""


def peft_fields(peft_config: Any) -> dict[str, Any]:
    """A ``peft.LoraConfig`` as twinseq's flat PEFT fields (``use_peft=True``, ``lora_r``, ...).

    Read field by field against a default ``LoraConfig``: a field twinseq has is translated; a field set to a value
    twinseq has no equivalent for (``modules_to_save``, ``rank_pattern``, ``bias="all"``, ...) is refused, naming it.
    ``target_modules=None`` means peft's default for these families, ``["q_proj", "v_proj"]``.

    >>> class LoraConfig:  # peft's, as far as this reads it
    ...     def __init__(self, r=8, lora_alpha=8, lora_dropout=0.0, target_modules=None, bias="none", task_type=None):
    ...         self.r, self.lora_alpha, self.lora_dropout = r, lora_alpha, lora_dropout
    ...         self.target_modules, self.bias, self.task_type = target_modules, bias, task_type
    >>> fields = peft_fields(LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    >>> fields["lora_r"], fields["lora_alpha"], fields["lora_target_modules"], fields["lora_dropout"]
    (4, 16, ['all-linear'], 0.0)
    """
    name = type(peft_config).__name__
    if name != "LoraConfig" or not hasattr(peft_config, "r"):
        raise ConfigTypeError(
            f"peft_config={name} is not supported; pass a peft.LoraConfig (LoRA, DoRA with use_dora=True, rsLoRA "
            f"with use_rslora=True)."
        )
    values = dict(vars(peft_config))
    try:
        defaults = dict(vars(type(peft_config)()))
    except TypeError:  # a stand-in that needs arguments: every field is compared with nothing
        defaults = {}
    task_type = values.get("task_type")
    if task_type not in (None, "CAUSAL_LM") and str(task_type) not in ("TaskType.CAUSAL_LM", "CAUSAL_LM"):
        raise ConfigError(
            f"peft_config.task_type={task_type!r} is not valid for a causal LM trainer; pass task_type='CAUSAL_LM' "
            f"or leave it unset."
        )
    if values.get("bias", "none") != "none":
        raise ConfigError(
            f"peft_config.bias={values['bias']!r} is not supported (twinseq trains no bias with the adapters); pass "
            f"bias='none'."
        )
    unsupported = sorted(
        k
        for k, v in values.items()
        if k not in _LORA_FIELDS and k not in _LORA_IGNORED and k != "bias" and k in defaults and v != defaults[k]
    )
    if unsupported:
        shown = ", ".join(f"{k}={values[k]!r}" for k in unsupported)
        raise ConfigError(
            f"peft_config sets {shown}, which twinseq's LoRA has no equivalent for; drop "
            f"{'it' if len(unsupported) == 1 else 'them'} (twinseq reads r, lora_alpha, lora_dropout, target_modules, "
            f"target_parameters, use_rslora, use_dora, trainable_token_indices)."
        )
    out: dict[str, Any] = {"use_peft": True}
    for key, flat in _LORA_FIELDS.items():
        if key in values and not (key == "target_parameters" and not values[key]):  # peft's default is None
            out[flat] = values[key]
    targets = out.get("lora_target_modules")
    if targets is None:
        logger.info("peft_config.target_modules=None: peft's default for these families, %s", PEFT_DEFAULT_TARGETS)
        out["lora_target_modules"] = list(PEFT_DEFAULT_TARGETS)
    elif isinstance(targets, str):
        if targets != "all-linear":
            raise ConfigError(
                f"peft_config.target_modules={targets!r} (a regular expression) is not supported; pass a list of "
                f"module names (e.g. ['q_proj', 'v_proj']) or 'all-linear'."
            )
        out["lora_target_modules"] = [targets]
    else:
        out["lora_target_modules"] = sorted(targets)
    tokens = out.get("trainable_token_indices")
    if isinstance(tokens, dict):
        raise ConfigError(
            f"peft_config.trainable_token_indices={tokens!r} is a dict (per module); twinseq trains the rows of the "
            f"input embedding: pass a list of token ids."
        )
    if tokens is None:
        out.pop("trainable_token_indices", None)
    return out


# --------------------------------------------------------------------------------------
# The trainer classes
# --------------------------------------------------------------------------------------


@dataclass
class TrainOutput:
    """What ``train()`` returns, as transformers' ``TrainOutput``: the last optimizer step, the mean training loss
    over the logged steps, and the run's final metrics (``train_runtime``, the last step's logged values, ...)."""

    global_step: int
    training_loss: float
    metrics: dict[str, Any] = field(default_factory=dict)


ModelArg = Union[str, os.PathLike, Any, None]


class _Trainer:
    """The shared body of ``SFTTrainer``, ``DPOTrainer`` and ``GRPOTrainer`` (one class per task, as TRL)."""

    config_class: ClassVar[type[_TaskConfig]] = SFTConfig

    def __init__(
        self,
        model: ModelArg = None,
        args: Optional[TrainConfig] = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: Optional[Sequence[Any]] = None,
        backend: Optional[str] = None,
        *,
        reward_funcs: Optional[Sequence[Any]] = None,
    ) -> None:
        task = self.config_class.TASK
        if args is None:
            args = self.config_class()
        if not isinstance(args, TrainConfig):
            raise ConfigTypeError(
                f"args={type(args).__name__} is not valid; pass a {self.config_class.__name__}(...) (or a "
                f"TrainConfig with task={task!r})."
            )
        if args.task != task:
            raise ConfigError(
                f"args.task={args.task!r} does not fit {type(self).__name__}; pass a {self.config_class.__name__} "
                f"or a TrainConfig with task={task!r}."
            )
        changes: dict[str, Any] = {}
        if backend is not None:
            changes["backend"] = backend
        if peft_config is not None:
            changes.update(peft_fields(peft_config))
        model_object = None
        if model is not None and not isinstance(model, (str, os.PathLike)):
            model_object = model
            changes["model_config"] = self._folder_of(model, backend or args.backend, args.output_dir)
        elif model is not None:
            changes["model_config"] = os.fspath(model)
        if train_dataset is not None:
            changes["dataset_name"] = _describe_data(train_dataset, args.data.dataset_name)
        self.args: TrainConfig = args.replace(**changes) if changes else args
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class
        self.callbacks = list(callbacks or [])
        self._model_object = model_object
        self._reward_funcs = reward_funcs
        self._built: dict[str, Any] = {}
        self.metrics_path: Optional[Path] = None
        """``<output_dir>/metrics.jsonl`` of the last ``train()``."""

    @staticmethod
    def _folder_of(model: Any, backend: str, output_dir: str) -> str:
        """The folder that describes a built model in the run's config: its own (``name_or_path`` with weights), else
        the model written once (streamed) into ``<output_dir>/base_model`` so that the run, a resume and an adapter
        folder's ``base_model_name_or_path`` all point at real files."""
        if backend != "torch":
            raise ConfigError(
                f"model={type(model).__name__} (a built model object) is for backend='torch'; on backend={backend!r} "
                f"pass the model's folder, a Hub id in the local cache, or a preset name."
            )
        own = getattr(model, "name_or_path", "") or ""
        if own and Path(own).is_dir() and has_weights(own):
            return str(own)
        folder = Path(output_dir) / "base_model"
        logger.info("model: a %s built in memory; written once to %s to describe the run", type(model).__name__, folder)
        load_backend("torch").save_pretrained(model, folder)
        return str(folder)

    # -- running ---------------------------------------------------------------------------

    def _inputs(self) -> RunInputs:
        def keep(**built: Any) -> None:
            self._built.update(built)

        return RunInputs(
            train_dataset=self.train_dataset,
            eval_dataset=self.eval_dataset,
            tokenizer=self.processing_class,
            model=self._model_object,
            reward_funcs=self._reward_funcs,
            callbacks=self.callbacks,
            on_built=keep,
        )

    def add_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def train(self, resume_from_checkpoint: Union[bool, str, None] = None) -> TrainOutput:
        """Train ``args.max_steps`` steps (or ``num_train_epochs``); ``resume_from_checkpoint``: True (the newest
        checkpoint of ``output_dir``), a ``checkpoint-N`` folder, or None."""
        args = self.args
        if resume_from_checkpoint:
            value = "latest" if resume_from_checkpoint is True else os.fspath(resume_from_checkpoint)
            args = args.replace(resume_from_checkpoint=value)
        self.metrics_path = load_backend(args.backend).train(args, self._inputs())
        return train_output(self.metrics_path)

    @property
    def model(self) -> Any:
        """The trained model of the backend (torch: the ``transformers`` model, with its adapters under PEFT; jax:
        twinseq's ``CausalLM``); None before ``train()``."""
        trainer = self._built.get("trainer")
        return None if trainer is None else trainer.trained_model()

    def evaluate(self) -> dict[str, float]:
        """The evaluation metrics of the trained model on the eval set (``eval_dataset``, or the config's
        ``eval_dataset_name`` / ``eval_split`` / ``eval_fraction``)."""
        if "trainer" not in self._built:
            raise ConfigError(f"{type(self).__name__}.evaluate() needs a trained model; call train() first.")
        evaluator = self._built.get("evaluator")
        if evaluator is None:
            raise ConfigError(
                f"{type(self).__name__}.evaluate() has no eval set; pass eval_dataset= or set eval_dataset_name / "
                f"eval_split / eval_fraction in args."
            )
        return evaluation.evaluate(self._built["trainer"], evaluator)

    def save_model(self, output_dir: Optional[str] = None) -> Path:
        """Write the trained model as the run's ``final`` folder is written (an HF model folder, or PEFT's adapter
        folder), with its tokenizer; default ``<output_dir>/final``, which ``train()`` already wrote."""
        target = Path(output_dir) if output_dir is not None else Path(self.args.output_dir) / "final"
        if "trainer" not in self._built:
            raise ConfigError(f"{type(self).__name__}.save_model() needs a trained model; call train() first.")
        self._built["trainer"].save_final(target)
        if getattr(self._built["trainer"], "is_main", True):
            self._built["tokenizer"].save_pretrained(target)
        return target


class SFTTrainer(_Trainer):
    """Supervised fine-tuning, in TRL's shape: ``SFTTrainer(model, args, train_dataset, eval_dataset,
    processing_class, peft_config, callbacks, backend).train()``."""

    config_class = SFTConfig


class DPOTrainer(_Trainer):
    """Direct preference optimisation (rows with ``prompt``/``chosen``/``rejected``), in TRL's shape. The reference
    is the initial model (a frozen copy), or the base with the adapters disabled under PEFT, as TRL."""

    config_class = DPOConfig


class GRPOTrainer(_Trainer):
    """Group relative policy optimisation with ``reward_funcs``: callables with TRL's signature
    ``f(prompts, completions, **columns) -> list[float | None]``, or names of twinseq's built-in rewards."""

    config_class: ClassVar[type[_TaskConfig]] = GRPOConfig

    def __init__(
        self,
        model: ModelArg = None,
        reward_funcs: Union[Callable[..., Any], str, Sequence[Any], None] = None,
        args: Optional[TrainConfig] = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: Optional[Sequence[Any]] = None,
        backend: Optional[str] = None,
    ) -> None:
        funcs = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else reward_funcs
        super().__init__(
            model,
            args,
            train_dataset,
            eval_dataset,
            processing_class,
            peft_config,
            callbacks,
            backend,
            reward_funcs=None if funcs is None else list(funcs),
        )


class RLOOTrainer(GRPOTrainer):
    """REINFORCE leave-one-out with ``reward_funcs`` (as ``GRPOTrainer``): each completion's baseline is the mean
    reward of the other completions of its prompt, the KL to the reference a reward penalty (``rloo_beta``)."""

    config_class = RLOOConfig


class KTOTrainer(_Trainer):
    """Kahneman-Tversky optimisation from unpaired rows (``prompt``/``completion`` and a boolean ``label``; paired
    ``prompt``/``chosen``/``rejected`` rows are unpaired as TRL does). The reference is the initial model (a frozen
    copy), or the base with the adapters disabled under PEFT, as TRL."""

    config_class = KTOConfig


def _generated_trainer(spec: TaskSpec) -> type[_Trainer]:
    """The API of a task registered without classes of its own here: its ``<Name>Config`` and ``<Name>Trainer``
    (``TaskSpec.trainer``), an online task's on ``GRPOTrainer`` (``reward_funcs``)."""
    config = type(
        spec.config_name,
        (_TaskConfig,),
        {
            "TASK": spec.name,
            "__module__": __name__,
            "__doc__": f"The arguments of ``{spec.trainer}``: ``TrainConfig`` with ``task={spec.name!r}``.",
        },
    )
    base: type[_Trainer] = GRPOTrainer if spec.online else _Trainer
    doc = f"``twinseq train --task {spec.name}`` from Python, in TRL's shape."
    return type(spec.trainer, (base,), {"config_class": config, "__module__": __name__, "__doc__": doc})


_WRITTEN: dict[str, type[_Trainer]] = {
    cls.config_class.TASK: cls for cls in (SFTTrainer, DPOTrainer, GRPOTrainer, RLOOTrainer, KTOTrainer)
}
TRAINERS: dict[str, type[_Trainer]] = {
    spec.name: _WRITTEN.get(spec.name) or _generated_trainer(spec) for spec in task_specs()
}
"""The trainer class of each task (``twinseq train --task`` picks one)."""


def _describe_data(data: Any, default: str) -> str:
    """What ``dataset_name`` records for a dataset object: its path when it is one, else its kind and size."""
    if isinstance(data, (str, os.PathLike)):
        return os.fspath(data)
    size = len(data) if hasattr(data, "__len__") else "?"
    return f"<{type(data).__name__}: {size} rows>"


def train_output(metrics_path: Path) -> TrainOutput:
    """``TrainOutput`` from a run's ``metrics.jsonl``: the training lines (not evaluation ones)."""
    lines = [json.loads(x) for x in Path(metrics_path).read_text().splitlines() if x.strip()]
    steps = [r for r in lines if "loss" in r and not any(k.startswith("eval_") for k in r)]
    if not steps:
        return TrainOutput(0, float("nan"), {})
    last = steps[-1]
    metrics = {k: v for k, v in last.items() if isinstance(v, (int, float))}
    metrics["train_runtime"] = float(sum(r.get("step_seconds", 0.0) for r in steps))
    metrics["train_loss"] = float(sum(r["loss"] for r in steps) / len(steps))
    return TrainOutput(int(last["step"]), metrics["train_loss"], metrics)


def __getattr__(name: str) -> Any:
    """A generated trainer or config class of a registered task (``KTOTrainer``-like names of new methods)."""
    for cls in TRAINERS.values():
        if name == cls.__name__:
            return cls
        if name == cls.config_class.__name__:
            return cls.config_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
