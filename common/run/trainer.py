"""The trainer template: one optimizer step, the task dispatch, the run description and the adapter save, written
once for every backend and every training method.

``common.run.runner.run`` owns the loop around the steps; ``TrainerTemplate.step`` owns the step itself:

1. ``prepare`` the step's micro-batches (a task hook: GRPO generates here, FSDP2 shards here);
2. ``micro_step`` each one (loss and gradients) and ``accumulate`` its gradients (backend hooks);
3. the pre-clip gradient norm (``gradient_norm``: torch clips in the same pass, in float64);
4. the non-finite check over the micro-batches' losses and the norm, agreed over every rank
   (``any_rank``): the step stops the run, or with ``skip_nonfinite_steps`` is skipped and counted;
5. ``apply_update`` (AdamW and the schedule), ``discard_gradients``;
6. the step's metrics: the task's ``summarize`` plus ``lr``, ``grad_norm`` and ``num_skipped_steps``.

A backend writes the framework hooks once (``torch_backend.trainer.TorchTrainer``,
``jax_backend.trainer.JaxTrainer``; DeepSpeed ZeRO-3 is ``torch_backend.deepspeed.Zero3Hooks``, a
variant of the torch hooks). A task writes ``micro_step`` and ``summarize`` per backend, and its
rules and numpy loss reference here in ``common`` (docs/architecture.md, "Adding a training method").
This is Keras 3's split: a backend's trainer overrides a narrow, named hook set and inherits the rest.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from twinseq.common.config import TrainConfig
from twinseq.common.errors import ConfigError
from twinseq.common.models.hf_folder import resolve_model_source
from twinseq.common.models.peft import PeftConfig, save_adapters
from twinseq.common.objectives.reference import sync_due
from twinseq.common.run.callbacks import EarlyStoppingCallback
from twinseq.common.run.eval_set import build_evaluator
from twinseq.common.run.inputs import NO_INPUTS, RunInputs
from twinseq.common.run.runner import run
from twinseq.common.run.step_metrics import apply_or_skip, first_nonfinite
from twinseq.common.tasks import task_spec

logger = logging.getLogger(__name__)

ROUTER_PLOT_KEYS = ("aux_loss", "router_max_load")
"""Panels every task's ``metrics.png`` adds after its own where its steps carry them: a MoE model's SFT steps report
``router_max_load`` (``common.objectives.moe``) and, with ``output_router_logits``, the load-balancing ``aux_loss``;
a run whose steps lack them draws no panel for them."""


class TrainerTemplate:
    """``common.run.runner.StepTrainer``'s ``step``, once. Subclasses supply the hooks below; ``cfg`` is the run's
    ``TrainConfig``."""

    cfg: TrainConfig
    update_in_micro_steps: bool = False
    """True when the framework applies the update inside the micro-steps (DeepSpeed steps at the accumulation
    boundary): a non-finite step can then only stop the run, never be skipped."""

    @property
    def is_main(self) -> bool:
        """This process writes files and logs (rank 0; one process: always)."""
        return True

    # -- task hooks ----------------------------------------------------------------------

    def prepare(self, micro_batches: list[Any]) -> list[Any]:
        """The step's micro-batches as ``micro_step`` takes them."""
        return micro_batches

    def micro_step(self, micro: Any) -> Any:
        """Forward and backward of one micro-batch, its loss already its share of the step's; returns what
        ``accumulate`` takes (a record of its metrics, with the gradients where the framework returns them)."""
        raise NotImplementedError

    def micro_losses(self, records: list[Any]) -> list[float]:
        """Each micro-batch's loss, for the non-finite check."""
        return [float(r["loss"]) for r in records]

    def summarize(self, records: list[Any], micro_batches: list[Any]) -> dict[str, Any]:
        """The step's metrics (over every rank), with at least ``loss`` and ``num_tokens``."""
        raise NotImplementedError

    def eval_micro_step(self, micro: Any) -> dict[str, Any]:
        """Forward only, no gradient, the model in eval mode and back in train mode: one eval micro-batch's results
        (``common.run.evaluation``: SFT, its sums ``loss``, ``num_tokens``, ``num_correct_tokens``, ``entropy_sum``;
        DPO, its pairs' sequence log-probs under the policy and the live reference)."""
        raise NotImplementedError(f"{type(self).__name__} has no evaluation micro-step")

    # -- backend hooks -------------------------------------------------------------------

    def accumulate(self, out: Any) -> Any:
        """Add a micro-step's gradients to the step's, return its record (torch: ``.grad`` already holds them)."""
        return out

    def current_lr(self) -> float:
        """The learning rate this step's update uses."""
        raise NotImplementedError

    def gradient_norm(self) -> Optional[float]:
        """The pre-clip global norm of the step's gradients (clipping may happen here); None where the framework
        did not compute one (logged as NaN, not checked)."""
        raise NotImplementedError

    def apply_update(self, grad_norm: Optional[float]) -> Optional[float]:
        """Apply the optimizer update and advance the schedule; returns the norm to log."""
        raise NotImplementedError

    def discard_gradients(self) -> None:
        """Drop the step's gradients (after the update, or after a skipped step)."""

    def any_rank(self, flag: bool) -> bool:
        """``flag`` OR-ed over every rank (one process: ``flag``)."""
        return flag

    def reduce_sums(self, sums: dict[str, float]) -> dict[str, float]:
        """An evaluation's sums added up over every rank (one process: ``sums``)."""
        return sums

    def data_parallel(self) -> tuple[int, int]:
        """(ranks that split the data, this rank's index): how an eval set is divided (one process: ``(1, 0)``)."""
        return 1, 0

    def eval_generate(
        self, prompt_ids: list[list[int]], *, max_new_tokens: int, eos_token_id: Optional[int], pad_token_id: int
    ) -> Any:
        """[N, C] greedy completions of ``prompt_ids``, right-padded with ``pad_token_id`` after the first EOS (the
        model in eval mode; every rank calls it)."""
        raise NotImplementedError(f"{type(self).__name__} has no greedy generation for evaluation")

    def trained_model(self) -> Any:
        """The model being trained, as the backend holds it (what ``SFTTrainer(...).model`` returns)."""
        raise NotImplementedError

    def mix_reference(self, alpha: float) -> None:
        """``ref <- (1 - alpha) ref + alpha policy`` for every parameter of the live reference copy
        (``common.objectives.reference``; the config refuses ``sync_ref_model`` where there is none)."""
        raise NotImplementedError(f"{type(self).__name__} has no reference model to synchronise")

    def after_step(self, step: int) -> None:
        """Called by the runner after optimizer step ``step`` (1-based), before the callbacks and a checkpoint:
        synchronises the reference when ``sync_ref_model`` is due (TRL's ``SyncRefModelCallback.on_step_end``)."""
        if sync_due(self.cfg.reference, step):
            self.mix_reference(self.cfg.reference.ref_model_mixup_alpha)

    # -- the step ------------------------------------------------------------------------

    def step(self, micro_batches: list[Any]) -> dict[str, Any]:
        micro = self.prepare(micro_batches)
        lr = self.current_lr()  # before the micro-steps: DeepSpeed steps the schedule inside them
        records = [self.accumulate(self.micro_step(mb)) for mb in micro]
        grad_norm = self.gradient_norm()
        problem = first_nonfinite(self.micro_losses(records), grad_norm)
        if self.any_rank(problem is not None):  # every rank applies or skips the same step
            problem = problem or "a loss or gradient norm on another rank is not finite"
        skip = self.cfg.optim.skip_nonfinite_steps and not self.update_in_micro_steps
        apply = apply_or_skip(problem, skip=skip)
        if apply:
            grad_norm = self.apply_update(grad_norm)
        self.discard_gradients()
        return {
            **self.summarize(records, micro),
            "lr": float(lr),
            "grad_norm": float("nan") if grad_norm is None else float(grad_norm),
            "num_skipped_steps": int(not apply),
        }


# --------------------------------------------------------------------------------------
# What every backend's `train` shares
# --------------------------------------------------------------------------------------

Build = Callable[..., tuple[Any, Any, Any, list[str]]]
"""A task's builder, called as ``build(inputs=RunInputs)``."""


def train_task(
    cfg: TrainConfig, builders: Mapping[str, Build], *, desc: str, inputs: Optional[RunInputs] = None
) -> Path:
    """Build ``cfg.task``'s (trainer, step source, tokenizer, announce lines) with ``builders[cfg.task]`` and run
    it through ``common.run.runner.run``; returns the path of ``metrics.jsonl``. ``desc`` names the engine in the
    progress bar (``torch``, ``torch-fsdp2``, ``jax``, ...)."""
    if cfg.task not in builders:
        raise ConfigError(f"task={cfg.task!r} is not trained by this backend; choose one of {sorted(builders)}.")
    inputs = NO_INPUTS if inputs is None else inputs
    trainer, source, tokenizer, announce = builders[cfg.task](inputs=inputs)
    evaluator = build_evaluator(cfg, trainer, source, tokenizer, inputs)
    if evaluator is not None:
        announce = [*announce, evaluator.describe()]
    if inputs.on_built is not None:
        inputs.on_built(trainer=trainer, source=source, tokenizer=tokenizer, evaluator=evaluator)
    return run(
        cfg,
        trainer,
        source,
        tokenizer=tokenizer,
        desc=f"{cfg.task}[{desc}]",
        announce=announce,
        plot_keys=(*task_spec(cfg.task).plot_keys, *ROUTER_PLOT_KEYS),
        callbacks=[*inputs.callbacks, *early_stopping(cfg)],
        evaluator=evaluator,
    )


def early_stopping(cfg: TrainConfig) -> list[EarlyStoppingCallback]:
    """``[EarlyStoppingCallback]`` when ``early_stopping_patience`` is set (transformers' rule: stop after that many
    evaluations without an improvement of ``metric_for_best_model`` by more than ``early_stopping_threshold``)."""
    if cfg.early_stopping_patience is None:
        return []
    return [
        EarlyStoppingCallback(
            cfg.early_stopping_patience,
            cfg.early_stopping_threshold,
            metric_for_best_model=cfg.effective_metric_for_best_model,
            greater_is_better=cfg.effective_greater_is_better,
        )
    ]


def peft_summary(peft: PeftConfig, *, trainable: int, total: int, quantized: bool = False) -> str:
    """One line on the adapters: kind, rank, targets, and the trainable share of the parameters."""
    kind = (
        ("Q" if peft.load_in_4bit else "") + ("DoRA" if peft.use_dora else "LoRA") + (" rs" if peft.use_rslora else "")
    )
    tokens = f" + {len(peft.trainable_token_indices)} trainable tokens" if peft.trainable_token_indices else ""
    experts = f" + {','.join(peft.lora_target_parameters)}" if peft.lora_target_parameters else ""
    return (
        f"{kind} r={peft.lora_r} alpha={peft.lora_alpha} on {','.join(peft.lora_target_modules)}{experts}{tokens}"
        f"{' (NF4 base)' if quantized else ''}: {trainable:,} trainable of {total:,} params "
        f"({100 * trainable / max(total, 1):.2f}%)"
    )


def describe_run(
    cfg: TrainConfig,
    *,
    backend: str,
    model_type: str,
    params: str,
    where: str,
    details: Sequence[str] = (),
    world_size: int = 1,
) -> str:
    """The run's first announce line: backend, task, model, parameters, device, the memory switches and the
    effective batch."""
    d = cfg.data
    effective = d.per_device_train_batch_size * world_size * d.gradient_accumulation_steps
    switches = [
        *details,
        f"loss={cfg.loss.loss_type}",
        f"packing={d.packing}({d.packing_strategy})",
        f"padding_free={d.padding_free}",
        f"dtype={cfg.model.dtype}",
    ]
    return (
        f"twinseq {backend} {cfg.task}: {model_type} {cfg.model.model_config!r}, {params} on {where}, "
        f"{', '.join(switches)}; effective batch = {d.per_device_train_batch_size} per device x {world_size} "
        f"devices x {d.gradient_accumulation_steps} accumulation steps = {effective} "
        f"{'packed rows' if d.packing else 'examples'} per optimizer step"
    )


def save_adapter_folder(
    path: Path,
    cfg: TrainConfig,
    model_config: Any,
    peft_config: PeftConfig,
    adapters: Mapping[str, Any],
    write_base: Callable[[Path], object],
) -> None:
    """PEFT's folder (``adapter_config.json`` + ``adapter_model.safetensors``, which ``peft.PeftModel
    .from_pretrained`` loads). Its ``base_model_name_or_path`` is the model folder the run started from, or, for a
    preset (weights drawn by ``init_weights``), the base that ``write_base`` writes to ``path/base``."""
    source = resolve_model_source(cfg.model.model_config, cfg.model.init_weights)
    if source.weights_folder is not None:
        base = Path(source.weights_folder).resolve()
    else:
        base = (Path(path) / "base").resolve()
        write_base(base)
    save_adapters(path, model_config, peft_config, dict(adapters), base_model_name_or_path=str(base))


def reference_description(cfg: TrainConfig, *, precomputed: Optional[bool] = None) -> str:
    """What a DPO or GRPO run compares against: none, precomputed log-probs, the base with the adapters
    disabled (PEFT, as TRL), or a frozen copy of the initial policy."""
    if precomputed:
        return "precomputed"
    kl_beta = task_spec(cfg.task).kl_beta
    if kl_beta is not None and cfg.reference_kl_beta == 0:
        return f"none ({kl_beta.split('.')[-1]}=0)"
    return "the base (adapters disabled)" if cfg.peft.use_peft else "frozen copy"
