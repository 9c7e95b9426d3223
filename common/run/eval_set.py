"""The eval set of a run, from the config and a Python caller's objects to this rank's eval micro-batches and the
run's ``common.run.evaluation.Evaluator``: ``build_evaluator``.

The eval set is a Python ``eval_dataset``, the rows ``eval_fraction`` holds out of the training data (drawn from the
seed; the run does not train on them), or ``eval_dataset_name`` (None: ``dataset_name``) at ``eval_split``. It is
prepared by ``common.data`` as the training data is (tokenising, truncation, packing, padding-free batching) and
collated as ONE step spanning the whole set (``eval_step_batches``), so that the micro-batches' loss shares add up to
the eval set's token-normalised loss. Kept apart from ``common.run.evaluation`` (the metrics, the cadence, the best
model), which ``import twinseq`` loads: this module needs the data pipeline and its heavy libraries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import numpy as np

from twinseq.common.config import TrainConfig
from twinseq.common.data.packing import pack_dataset
from twinseq.common.data.preference_steps import PreferenceStepIterator, iter_preference_batches, with_ref_logps
from twinseq.common.data.prepare import eval_dataset, prepare_dpo_dataset, prepare_sft_dataset
from twinseq.common.data.prompts import prepare_grpo_eval_prompts
from twinseq.common.data.sft_steps import StepIterator
from twinseq.common.data.unpaired import KTOStepIterator, iter_unpaired_batches, prepare_kto_dataset, with_kto_ref_logps
from twinseq.common.errors import ConfigError
from twinseq.common.run.evaluation import DPOEvaluator, Evaluator, GRPOEvaluator, KTOEvaluator, SFTEvaluator, eval_hook
from twinseq.common.tasks import resolve, task_spec


def build_evaluator(cfg: TrainConfig, trainer: Any, source: Any, tokenizer: Any, inputs: Any) -> Optional[Evaluator]:
    """The evaluator of a run, or None when it has no eval set (``eval_strategy``, ``eval_on_start`` and
    ``load_best_model_at_end`` then refuse to run). Called once the builder returned, before any step. The task's
    ``TaskSpec.evaluator`` builds it (``sft_evaluator``, ``dpo_evaluator``, ``kto_evaluator``, ``grpo_evaluator``
    here for the built-in methods)."""
    world_size, rank = trainer.data_parallel()
    steps_per_epoch = getattr(source, "steps_per_epoch", None)
    spec = task_spec(cfg.task)
    evaluator: Optional[Evaluator] = None
    if spec.evaluator is not None:
        evaluator = resolve(spec.evaluator)(
            EvalContext(
                cfg,
                trainer,
                tokenizer,
                inputs,
                world_size,
                rank,
                dict(tokenizer=tokenizer, steps_per_epoch=steps_per_epoch),
            )
        )
    _check_evaluator(cfg, evaluator, steps_per_epoch)
    return evaluator


@dataclass
class EvalContext:
    """What a task's evaluator builder gets: the run's config, trainer (its ``eval_micro_step`` hook), tokenizer
    and Python inputs, this rank's place in data parallelism, and the keyword arguments every ``Evaluator`` takes
    (``shared``)."""

    cfg: TrainConfig
    trainer: Any
    tokenizer: Any
    inputs: Any
    world_size: int
    rank: int
    shared: dict

    def eval_rows(self) -> Any:
        """The untokenised eval set (None: the run has none)."""
        given, train = getattr(self.inputs, "eval_dataset", None), getattr(self.inputs, "train_dataset", None)
        return eval_dataset(self.cfg, self.cfg.task, given, train)

    def one_step(self, rows: Any, iterator: Any = None) -> list[Any]:
        """This rank's micro-batches of every eval row as one step (``eval_step_batches``)."""
        pad = self.tokenizer.pad_token_id
        return eval_step_batches(rows, self.cfg, pad, world_size=self.world_size, rank=self.rank, iterator=iterator)


def grpo_evaluator(ctx: EvalContext) -> Optional[Evaluator]:
    """The online tasks': the reward of greedy completions of the held-out prompts."""
    given, train = getattr(ctx.inputs, "eval_dataset", None), getattr(ctx.inputs, "train_dataset", None)
    prompts = prepare_grpo_eval_prompts(ctx.cfg, ctx.tokenizer, given, train)
    if prompts is None:
        return None
    size = ctx.cfg.data.per_device_eval_batch_size
    chunks = [prompts[s : s + size] for s in range(0, len(prompts), size)]
    return GRPOEvaluator(ctx.cfg, chunks, num_examples=len(prompts), **ctx.shared)


def sft_evaluator(ctx: EvalContext) -> Optional[Evaluator]:
    """SFT's: the token-normalised loss of the eval rows (and ``eval_generate_samples`` completions)."""
    ds = ctx.eval_rows()
    if ds is None:
        return None
    rows = prepare_sft_dataset(ctx.cfg, ds, ctx.tokenizer, held_out=True)[0]
    samples = sample_prompts(rows, ctx.cfg.eval_generate_samples)
    return SFTEvaluator(ctx.cfg, ctx.one_step(rows), num_examples=len(rows), samples=samples, **ctx.shared)


def dpo_evaluator(ctx: EvalContext) -> Optional[Evaluator]:
    """DPO's: the loss, rewards and accuracies of the eval pairs."""
    ds, cfg = ctx.eval_rows(), ctx.cfg
    if ds is None:
        return None
    rows = prepare_dpo_dataset(cfg, ds, ctx.tokenizer, held_out=True)[0]
    if cfg.dpo.precompute_ref_log_probs:
        rows = with_eval_reference(ctx.trainer, rows, cfg, ctx.tokenizer.pad_token_id)
    return DPOEvaluator(cfg, ctx.one_step(rows, PreferenceStepIterator), num_examples=len(rows), **ctx.shared)


def kto_evaluator(ctx: EvalContext) -> Optional[Evaluator]:
    """KTO's: the loss, the KL estimate and the rewards of the eval rows."""
    ds, cfg = ctx.eval_rows(), ctx.cfg
    if ds is None:
        return None
    rows = prepare_kto_dataset(cfg, ds, ctx.tokenizer, held_out=True)[0]
    if cfg.dpo.precompute_ref_log_probs:
        rows = with_eval_kto_reference(ctx.trainer, rows, cfg, ctx.tokenizer.pad_token_id)
    iterator = partial(KTOStepIterator, with_kl=cfg.kto.kto_loss_type == "kto")
    return KTOEvaluator(cfg, ctx.one_step(rows, iterator), num_examples=len(rows), **ctx.shared)


def _check_evaluator(cfg: TrainConfig, evaluator: Optional[Evaluator], steps_per_epoch: Optional[int]) -> None:
    wants = [
        name
        for name, on in (
            (f"eval_strategy={cfg.eval_strategy!r}", cfg.eval_strategy != "no"),
            ("eval_on_start=True", cfg.eval_on_start),
            ("load_best_model_at_end=True", cfg.load_best_model_at_end),
        )
        if on
    ]
    if evaluator is None and wants:
        raise ConfigError(
            f"{', '.join(wants)} needs an eval set, and this run has none: pass --eval-fraction 0.1 (held out of the "
            f"training rows), --eval-dataset-name / --eval-split, or eval_dataset= from Python."
        )
    if evaluator is not None and cfg.eval_strategy == "epoch" and not steps_per_epoch:
        raise ConfigError(
            "eval_strategy='epoch' needs the training data's epochs, and this step source has none; use "
            "--eval-strategy steps --eval-steps N."
        )


def eval_step_batches(
    rows: Any, cfg: TrainConfig, pad_token_id: int, *, world_size: int, rank: int, iterator: Any = None
) -> list[Any]:
    """This rank's micro-batches of every eval row, collated as training collates them (``StepIterator``: packing,
    padding-free, ``pad_to_multiple_of``; ``iterator``: the task's step source, DPO's ``PreferenceStepIterator``),
    as ONE step spanning the eval set:
    ``per_device_eval_batch_size`` examples per micro-batch at most, the same number of micro-batches on every rank
    (a rank short of rows gets padding-only ones), and ``num_items_in_batch`` (DPO: ``num_examples_in_step``) the
    whole eval set's count, so the micro-batches' loss shares add up to the eval set's loss."""
    d = cfg.data
    if cfg.task == "sft" and d.packing:
        assert d.max_length is not None  # TrainConfig refuses packing without max_length
        rows = pack_dataset(
            rows,
            d.max_length,
            strategy=d.packing_strategy,
            completion_only_loss=d.completion_only_loss,
            assistant_only_loss=d.assistant_only_loss,
        )
    num_rows = rows.num_rows if hasattr(rows, "num_rows") else len(next(iter(rows.values())))
    slots = max(1, math.ceil(num_rows / (d.per_device_eval_batch_size * world_size)))
    one_step = cfg.replace(
        packing=False, per_device_train_batch_size=d.per_device_eval_batch_size, gradient_accumulation_steps=slots
    )
    kind = StepIterator if iterator is None else iterator
    return kind(rows, one_step, pad_token_id, world_size=world_size, rank=rank).next_step()


def sample_prompts(rows: Any, num: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, reference ids) of the first ``num`` tokenised SFT rows: the prompt is what precedes the first
    target of the completion or assistant mask, else the first half of the row.

    >>> sample_prompts({"input_ids": [[1, 5, 6, 7]], "completion_mask": [[0, 0, 1, 1]]}, 1)
    [([1, 5], [6, 7])]
    """
    head = rows[:num] if hasattr(rows, "column_names") else {k: list(v)[:num] for k, v in rows.items()}
    masks = next((head[k] for k in ("completion_mask", "assistant_masks") if k in head), None)
    out = []
    for i, ids in enumerate(head["input_ids"]):
        ids, mask = list(ids), None if masks is None else list(masks[i])
        cut = mask.index(1) if mask is not None and 1 in mask else len(ids) // 2
        cut = min(max(cut, 1), max(len(ids) - 1, 1))
        out.append((ids[:cut], ids[cut:]))
    return out


def with_eval_reference(trainer: Any, rows: Any, cfg: TrainConfig, pad_token_id: int) -> Any:
    """``precompute_ref_log_probs``: the eval pairs with ``ref_chosen_logps`` / ``ref_rejected_logps`` columns, the
    policy's own sequence log-probs before its first update, which is the reference the training pairs' were
    precomputed from (the evaluator is built before any step and before a resume is loaded)."""
    d, chosen, rejected = cfg.data, [], []
    for _, pbatch in iter_preference_batches(
        rows,
        d.per_device_eval_batch_size,
        padding_free=d.padding_free,
        pad_token_id=pad_token_id,
        pad_to_multiple_of=d.pad_to_multiple_of,
    ):
        out = eval_hook(trainer, "eval_micro_step")(pbatch)
        chosen.append(np.asarray(out["chosen_logps"], np.float64).reshape(-1))
        rejected.append(np.asarray(out["rejected_logps"], np.float64).reshape(-1))
    return with_ref_logps(rows, np.concatenate(chosen), np.concatenate(rejected))


def with_eval_kto_reference(trainer: Any, rows: Any, cfg: TrainConfig, pad_token_id: int) -> Any:
    """KTO's ``with_eval_reference``: the eval rows with ``ref_logps`` (and ``ref_KL_logps``) columns, the policy's
    own sequence log-probs before its first update."""
    with_kl = cfg.kto.kto_loss_type == "kto"
    main, mismatched = [], []
    for _, kbatch in iter_unpaired_batches(
        rows, cfg.data.per_device_eval_batch_size, with_kl=with_kl, cfg=cfg, pad_token_id=pad_token_id
    ):
        out = eval_hook(trainer, "eval_micro_step")(kbatch)
        main.append(np.asarray(out["chosen_logps"], np.float64).reshape(-1))
        mismatched.append(np.asarray(out["rejected_logps"], np.float64).reshape(-1))
    return with_kto_ref_logps(rows, np.concatenate(main), np.concatenate(mismatched) if with_kl else None)
