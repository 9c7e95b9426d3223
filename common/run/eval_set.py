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
from typing import Any, Optional

import numpy as np

from twinseq.common.config import ONLINE_TASKS, TrainConfig
from twinseq.common.data.packing import pack_dataset
from twinseq.common.data.preference_steps import PreferenceStepIterator, iter_preference_batches, with_ref_logps
from twinseq.common.data.prepare import eval_dataset, prepare_dpo_dataset, prepare_sft_dataset
from twinseq.common.data.prompts import prepare_grpo_eval_prompts
from twinseq.common.data.sft_steps import StepIterator
from twinseq.common.data.unpaired import KTOStepIterator, iter_unpaired_batches, prepare_kto_dataset, with_kto_ref_logps
from twinseq.common.errors import ConfigError
from twinseq.common.run.evaluation import DPOEvaluator, Evaluator, GRPOEvaluator, KTOEvaluator, SFTEvaluator, eval_hook


def build_evaluator(cfg: TrainConfig, trainer: Any, source: Any, tokenizer: Any, inputs: Any) -> Optional[Evaluator]:
    """The evaluator of a run, or None when it has no eval set (``eval_strategy``, ``eval_on_start`` and
    ``load_best_model_at_end`` then refuse to run). Called once the builder returned, before any step."""
    given, train = getattr(inputs, "eval_dataset", None), getattr(inputs, "train_dataset", None)
    world_size, rank = trainer.data_parallel()
    steps_per_epoch = getattr(source, "steps_per_epoch", None)
    shared = dict(tokenizer=tokenizer, steps_per_epoch=steps_per_epoch)
    evaluator: Optional[Evaluator] = None
    if cfg.task in ONLINE_TASKS:
        prompts = prepare_grpo_eval_prompts(cfg, tokenizer, given, train)
        if prompts is not None:
            size = cfg.data.per_device_eval_batch_size
            chunks = [prompts[s : s + size] for s in range(0, len(prompts), size)]
            evaluator = GRPOEvaluator(cfg, chunks, num_examples=len(prompts), **shared)
    else:
        ds = eval_dataset(cfg, cfg.task, given, train)
        if ds is not None:
            evaluator = _build_offline(cfg, trainer, ds, tokenizer, world_size, rank, shared)
    _check_evaluator(cfg, evaluator, steps_per_epoch)
    return evaluator


def _build_offline(
    cfg: TrainConfig, trainer: Any, ds: Any, tokenizer: Any, world_size: int, rank: int, shared: dict
) -> Evaluator:
    """SFT's or DPO's evaluator over the untokenised eval set ``ds``."""
    pad = tokenizer.pad_token_id
    if cfg.task == "dpo":
        rows = prepare_dpo_dataset(cfg, ds, tokenizer, held_out=True)[0]
        if cfg.dpo.precompute_ref_log_probs:
            rows = with_eval_reference(trainer, rows, cfg, pad)
        micro = eval_step_batches(rows, cfg, pad, world_size=world_size, rank=rank)
        return DPOEvaluator(cfg, micro, num_examples=len(rows), **shared)
    if cfg.task == "kto":
        rows = prepare_kto_dataset(cfg, ds, tokenizer, held_out=True)[0]
        if cfg.dpo.precompute_ref_log_probs:
            rows = with_eval_kto_reference(trainer, rows, cfg, pad)
        micro = eval_step_batches(rows, cfg, pad, world_size=world_size, rank=rank)
        return KTOEvaluator(cfg, micro, num_examples=len(rows), **shared)
    rows = prepare_sft_dataset(cfg, ds, tokenizer, held_out=True)[0]
    micro = eval_step_batches(rows, cfg, pad, world_size=world_size, rank=rank)
    samples = sample_prompts(rows, cfg.eval_generate_samples)
    return SFTEvaluator(cfg, micro, num_examples=len(rows), samples=samples, **shared)


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


def eval_step_batches(rows: Any, cfg: TrainConfig, pad_token_id: int, *, world_size: int, rank: int) -> list[Any]:
    """This rank's micro-batches of every eval row, collated as training collates them (``StepIterator``: packing,
    padding-free, ``pad_to_multiple_of``; DPO: ``PreferenceStepIterator``), as ONE step spanning the eval set:
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
    if cfg.task == "kto":
        with_kl = cfg.kto.kto_loss_type == "kto"
        return KTOStepIterator(
            rows, one_step, pad_token_id, with_kl=with_kl, world_size=world_size, rank=rank
        ).next_step()
    kind = PreferenceStepIterator if cfg.task == "dpo" else StepIterator
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
