"""Evaluation during training, once for every backend and every task: the eval set, the cadence, the metrics and
the best model.

``common.run.eval_set.build_evaluator(cfg, trainer, source, tokenizer, inputs)`` turns the run's eval set (a Python
``eval_dataset``, the rows ``eval_fraction`` holds out of the training data, or ``eval_dataset_name`` at
``eval_split``) into this rank's eval micro-batches with ``common.data``'s own preparation (the training data's
tokenising, truncation, packing and padding-free rules, so an eval loss is measured as the training loss is) and
one of the evaluators here. ``evaluate(trainer,
evaluator)`` runs them through the trainer's forward-only hooks and returns the metrics with Hugging Face's
``eval_`` prefix; ``common.run.runner`` calls it every ``eval_steps`` (``Evaluator.due``), logs the metrics, tracks
the best one (``track_best``) and with ``load_best_model_at_end`` ends on the best checkpoint.

The hooks a backend writes (``common.run.trainer.TrainerTemplate``), forward only, the model in eval mode:

- ``eval_micro_step(micro)``: SFT, the sums of one eval micro-batch (``loss`` as its share of the eval set's
  label count, like a training micro-batch's of its step, ``num_tokens``, ``num_correct_tokens``,
  ``entropy_sum``); DPO, the per-pair sequence log-probs of the policy and of its live reference;
- ``eval_generate(prompt_ids, ...)``: greedy completions (GRPO's eval reward, SFT's samples);
- ``reduce_sums(sums)``: the sums over every rank (FSDP2: all-reduced like a step's metrics);
- ``data_parallel()``: (ranks that split the data, this rank's index).

Metrics (TRL's names, with ``eval_``):

- SFT: ``eval_loss`` = Σ NLL / label tokens over the whole eval set (the training loss's normalisation, one
  "step" holding every eval row), ``eval_mean_token_accuracy``, ``eval_entropy``;
- DPO: ``eval_loss`` (mean over pairs), ``eval_rewards/chosen``, ``eval_rewards/rejected``,
  ``eval_rewards/accuracies``, ``eval_rewards/margins``, ``eval_logps/chosen``, ``eval_logps/rejected``;
- GRPO: ``eval_reward`` (mean reward of one greedy completion per held-out prompt), ``eval_rewards/<func>/mean``,
  ``eval_completions/mean_length``, ``eval_completions/clipped_ratio``;
- all: ``eval_runtime`` (seconds) and ``eval_samples_per_second``.

>>> Evaluator._due_in_steps(10, every=5), Evaluator._due_in_steps(7, every=5), Evaluator._due_in_steps(0, every=5)
(True, False, False)
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Optional, Sequence

import numpy as np

from twinseq.common.config import TrainConfig
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.dpo import NUMPY_OPS, dpo_family, validate_dpo_config
from twinseq.common.objectives.grpo import completion_mask, compute_rewards, reward_func_name
from twinseq.common.objectives.kto import kl_estimate, kto_family, validate_kto_config
from twinseq.common.run.callbacks import TrainerState
from twinseq.common.run.report import write_samples

logger = logging.getLogger(__name__)

ADDITIVE_SFT = ("loss", "num_label_tokens", "num_correct_tokens", "entropy_sum")
"""The sums of an SFT evaluation (keys of ``common.run.step_metrics.ADDITIVE``: a backend reduces them over ranks as
it reduces a step's)."""


class Evaluator:
    """This rank's eval micro-batches and what turns their hook results into metrics (``build_evaluator`` makes
    one per task: ``SFTEvaluator``, ``DPOEvaluator``, ``KTOEvaluator``, ``GRPOEvaluator``)."""

    task, unit = "", "examples"

    def __init__(
        self,
        cfg: TrainConfig,
        micro_batches: list[Any],
        *,
        num_examples: int,
        tokenizer: Any,
        steps_per_epoch: Optional[int],
    ) -> None:
        self.cfg, self.micro_batches, self.num_examples = cfg, micro_batches, num_examples
        self.tokenizer, self.steps_per_epoch = tokenizer, steps_per_epoch

    # -- the cadence -------------------------------------------------------------------------

    @staticmethod
    def _due_in_steps(step: int, every: int) -> bool:
        return step > 0 and step % every == 0

    def due(self, step: int, max_steps: int) -> bool:
        """Whether the run evaluates after optimizer step ``step`` of ``max_steps``: every ``eval_steps`` steps
        (``eval_strategy='steps'``), or at the end of every epoch and at the last step (``'epoch'``, as HF's epoch
        loop ends there too)."""
        strategy = self.cfg.eval_strategy
        if strategy == "steps":
            return self._due_in_steps(step, self.cfg.effective_eval_steps)
        if strategy == "epoch":
            assert self.steps_per_epoch, "build_evaluator refuses eval_strategy='epoch' without epochs"
            return self._due_in_steps(step, self.steps_per_epoch) or step == max_steps
        return False

    def describe(self) -> str:
        """The announce line of the eval set and the cadence."""
        c = self.cfg
        when = {
            "no": "on request (eval_strategy='no')",
            "steps": f"every {c.effective_eval_steps} steps",
            "epoch": f"every epoch ({self.steps_per_epoch} steps)",
        }[c.eval_strategy]
        start = " and before the first step" if c.eval_on_start else ""
        best = f"; best model by {c.effective_metric_for_best_model} kept" if c.load_best_model_at_end else ""
        return f"eval: {self.num_examples} {self.unit} {when}{start}{best}"

    # -- per task ------------------------------------------------------------------------------

    def collect(self, trainer: Any, step: Optional[int]) -> dict[str, float]:
        """The eval set's sums over every rank (``step``: where samples are written; None: none)."""
        raise NotImplementedError

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        """Sums -> metrics, without the ``eval_`` prefix."""
        raise NotImplementedError


def _add(total: dict[str, float], part: dict[str, Any]) -> None:
    for key, value in part.items():
        total[key] = total.get(key, 0.0) + float(value)


def eval_hook(trainer: Any, name: str) -> Any:
    """``trainer``'s evaluation hook ``name``, or a ``ConfigError`` saying that this engine has none."""
    method = getattr(trainer, name, None)
    if method is None:
        raise ConfigError(
            f"{type(trainer).__name__} has no evaluation hook {name!r}; evaluation is not wired for this engine: "
            f"drop --eval-strategy / the eval set, or train with another engine."
        )
    return method


# --------------------------------------------------------------------------------------
# SFT
# --------------------------------------------------------------------------------------


class SFTEvaluator(Evaluator):
    task, unit = "sft", "rows"

    def __init__(self, *args: Any, samples: Sequence[tuple[list[int], list[int]]] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.samples = list(samples)

    def collect(self, trainer: Any, step: Optional[int]) -> dict[str, float]:
        sums = dict.fromkeys(ADDITIVE_SFT, 0.0)
        for micro in self.micro_batches:
            out = eval_hook(trainer, "eval_micro_step")(micro)
            _add(
                sums,
                {
                    "loss": out["loss"],
                    "num_label_tokens": out["num_tokens"],
                    "num_correct_tokens": out["num_correct_tokens"],
                    "entropy_sum": out["entropy_sum"],
                },
            )
        sums = trainer.reduce_sums(sums)
        if self.samples and step is not None:
            self._write_samples(trainer, step)
        return sums

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        labels = sums["num_label_tokens"]
        return {
            "loss": float(sums["loss"]),
            "mean_token_accuracy": sums["num_correct_tokens"] / labels if labels else 0.0,
            "entropy": sums["entropy_sum"] / labels if labels else 0.0,
            "num_label_tokens": int(labels),
        }

    def _write_samples(self, trainer: Any, step: int) -> None:
        """Greedy completions of the first ``eval_generate_samples`` eval rows' prompts beside their references
        (every rank generates: a sharded model's forward is a collective; the main rank writes)."""
        tok, limit = self.tokenizer, self.cfg.data.max_completion_length or 256
        prompts = [p for p, _ in self.samples]
        budget = max(1, min(limit, max(len(r) for _, r in self.samples)))
        texts = generate_texts(trainer, tok, prompts, budget)
        if trainer.is_main:
            rows = [
                {"step": step, "prompt": tok.decode(p), "reference": tok.decode(r, skip_special_tokens=True), **t}
                for (p, r), t in zip(self.samples, texts)
            ]
            write_samples(self.cfg.output_dir, step, rows)


def generate_texts(trainer: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    """``{"completion": text, "completion_length": n, "truncated": bool}`` per prompt: the trainer's greedy
    completion, cut at its first EOS."""
    ids = np.asarray(
        eval_hook(trainer, "eval_generate")(
            prompts,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    mask, truncated = completion_mask(ids, tokenizer.eos_token_id, tokenizer.pad_token_id)
    lengths = np.maximum(mask.sum(axis=1), 1)
    return [
        {
            "completion": tokenizer.decode(row[:n].tolist(), skip_special_tokens=True),
            "completion_length": int(n),
            "truncated": bool(cut),
        }
        for row, n, cut in zip(ids, lengths, truncated)
    ]


# --------------------------------------------------------------------------------------
# DPO
# --------------------------------------------------------------------------------------

DPO_SUMS = ("loss", "chosen_rewards", "rejected_rewards", "accuracies", "margins", "chosen_logps", "rejected_logps")


class DPOEvaluator(Evaluator):
    task, unit = "dpo", "pairs"

    def collect(self, trainer: Any, step: Optional[int]) -> dict[str, float]:
        c = self.cfg.dpo
        config = validate_dpo_config(c.dpo_loss_type, c.loss_weights, c.beta, c.label_smoothing, c.discopop_tau)
        sums = dict.fromkeys((*DPO_SUMS, "num_pairs"), 0.0)
        for pbatch in self.micro_batches:
            if pbatch.num_examples:
                _add(sums, dpo_pair_sums(pbatch, eval_hook(trainer, "eval_micro_step")(pbatch), config))
        return trainer.reduce_sums(sums)

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["num_pairs"], 1.0)
        names = {"loss": "loss", "chosen_logps": "logps/chosen", "rejected_logps": "logps/rejected"}
        return {names.get(k, f"rewards/{k.removesuffix('_rewards')}"): sums[k] / n for k in DPO_SUMS}


def dpo_pair_sums(pbatch: Any, logps: dict[str, Any], config: Any) -> dict[str, float]:
    """The sums of one eval micro-batch from its pairs' sequence log-probs (the hook's ``chosen_logps``,
    ``rejected_logps`` and, for a live reference, ``ref_chosen_logps`` / ``ref_rejected_logps``; else the batch's
    precomputed ones), through the DPO loss family in numpy (``common.objectives.dpo``)."""
    ref_c = logps.get("ref_chosen_logps", pbatch.ref_chosen_logps)
    ref_r = logps.get("ref_rejected_logps", pbatch.ref_rejected_logps)
    assert ref_c is not None and ref_r is not None, "a DPO eval batch needs a live or precomputed reference"
    as64 = lambda a: np.asarray(a, np.float64).reshape(-1)  # noqa: E731
    pc, pr = as64(logps["chosen_logps"]), as64(logps["rejected_logps"])
    out = dpo_family(
        pc - as64(ref_c),
        pr - as64(ref_r),
        config,
        NUMPY_OPS,
        chosen_num_tokens=pbatch.chosen_num_tokens.astype(np.float64),
        rejected_num_tokens=pbatch.rejected_num_tokens.astype(np.float64),
        policy_chosen_logps=pc,
        policy_rejected_logps=pr,
    )
    chosen, rejected = np.asarray(out.chosen_rewards), np.asarray(out.rejected_rewards)
    return {
        "loss": float(np.sum(out.losses)),
        "chosen_rewards": float(chosen.sum()),
        "rejected_rewards": float(rejected.sum()),
        "accuracies": float((chosen > rejected).sum()),  # strict, as TRL
        "margins": float((chosen - rejected).sum()),
        "chosen_logps": float(pc.sum()),
        "rejected_logps": float(pr.sum()),
        "num_pairs": float(pbatch.num_examples),
    }


# --------------------------------------------------------------------------------------
# KTO
# --------------------------------------------------------------------------------------

KTO_SUMS = ("loss", "kl", "num_batches", "num_rows", "num_chosen", "num_rejected")
KTO_SIDE_SUMS = ("chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps")


class KTOEvaluator(Evaluator):
    """KTO's eval metrics: the loss (summed over the eval rows, over their count), the mean KL estimate of the eval
    micro-batches, and per side the mean reward and sequence log-prob, with ``rewards/margins`` (TRL's names)."""

    task, unit = "kto", "rows"

    def collect(self, trainer: Any, step: Optional[int]) -> dict[str, float]:
        c = self.cfg
        config = validate_kto_config(c.kto.kto_loss_type, c.dpo.beta, c.kto.desirable_weight, c.kto.undesirable_weight)
        sums = dict.fromkeys((*KTO_SUMS, *KTO_SIDE_SUMS), 0.0)
        for kbatch in self.micro_batches:
            if kbatch.num_examples:
                _add(sums, kto_row_sums(kbatch, eval_hook(trainer, "eval_micro_step")(kbatch), config))
        return trainer.reduce_sums(sums)

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        out = {"loss": sums["loss"] / max(sums["num_rows"], 1.0), "kl": sums["kl"] / max(sums["num_batches"], 1.0)}
        for side in ("chosen", "rejected"):
            if sums[f"num_{side}"]:
                out[f"rewards/{side}"] = sums[f"{side}_rewards"] / sums[f"num_{side}"]
                out[f"logps/{side}"] = sums[f"{side}_logps"] / sums[f"num_{side}"]
        if sums["num_chosen"] and sums["num_rejected"]:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


def kto_row_sums(kbatch: Any, logps: dict[str, Any], config: Any) -> dict[str, float]:
    """The sums of one eval micro-batch from the hook's sequence log-probs (``chosen_logps``: the completions,
    ``rejected_logps``: the mismatched pairs, and the live reference's ``ref_*``; else the batch's precomputed
    ones), through the KTO loss family in numpy (``common.objectives.kto``)."""
    as64 = lambda a: np.asarray(a, np.float64).reshape(-1)  # noqa: E731
    ref = as64(logps.get("ref_chosen_logps", kbatch.ref_chosen_logps))
    ref_kl = logps.get("ref_rejected_logps", kbatch.ref_rejected_logps)
    policy, policy_kl = as64(logps["chosen_logps"]), as64(logps["rejected_logps"])
    kl = kl_estimate(policy_kl, as64(ref_kl)) if config.uses_kl and kbatch.num_kl else 0.0
    labels = np.asarray(kbatch.labels, bool)
    out = kto_family(policy - ref, labels.astype(np.float64), kl, config, NUMPY_OPS)
    rewards = np.asarray(out.rewards)
    return {
        "loss": float(np.sum(out.losses)),
        "kl": kl,
        "num_batches": 1.0,
        "num_rows": float(labels.size),
        "num_chosen": float(labels.sum()),
        "num_rejected": float((~labels).sum()),
        "chosen_rewards": float(rewards[labels].sum()),
        "rejected_rewards": float(rewards[~labels].sum()),
        "chosen_logps": float(policy[labels].sum()),
        "rejected_logps": float(policy[~labels].sum()),
    }


# --------------------------------------------------------------------------------------
# GRPO
# --------------------------------------------------------------------------------------


class GRPOEvaluator(Evaluator):
    task, unit = "grpo", "prompts"

    def collect(self, trainer: Any, step: Optional[int]) -> dict[str, float]:
        funcs = list(trainer.reward_funcs)
        names = [reward_func_name(f) for f in funcs]
        sums: dict[str, float] = {
            "reward": 0.0,
            "num_scored": 0.0,
            "num_completions": 0.0,
            "completion_length": 0.0,
            "clipped": 0.0,
        }
        table: list[dict[str, Any]] = []
        for rows in self.micro_batches:
            texts = generate_texts(
                trainer, self.tokenizer, [list(r["prompt_input_ids"]) for r in rows], trainer.max_completion_length
            )
            total, per = self._rewards(funcs, rows, [t["completion"] for t in texts])
            _add(
                sums,
                {
                    "reward": np.nansum(total),  # NaN: unscorable (every reward function abstained), left out
                    "num_scored": int((~np.isnan(total)).sum()),
                    "num_completions": len(rows),
                    "completion_length": sum(t["completion_length"] for t in texts),
                    "clipped": sum(t["truncated"] for t in texts),
                },
            )
            for j, name in enumerate(names):
                scored = per[:, j][~np.isnan(per[:, j])]
                _add(sums, {f"rewards/{name}/sum": scored.sum(), f"rewards/{name}/count": scored.size})
            if self.cfg.grpo.log_completions:
                table += [
                    {"step": step, "prompt": r["prompt_text"], "completion": t["completion"], "reward": float(tot)}
                    | {name: float(v) for name, v in zip(names, p)}
                    for r, t, tot, p in zip(rows, texts, total, per)
                ]
        if table and step is not None and trainer.is_main:
            write_samples(self.cfg.output_dir, step, table)
        return trainer.reduce_sums(sums)

    def _rewards(self, funcs: list, rows: list[dict], texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        prompts = [r["prompt"] for r in rows]
        completions: list[Any] = texts
        if prompts and not isinstance(prompts[0], str):  # conversational: TRL passes messages back
            completions = [[{"role": "assistant", "content": t}] for t in texts]
        skip = {"prompt", "prompt_text", "prompt_input_ids"}
        columns = {k: [r.get(k) for r in rows] for k in rows[0] if k not in skip}
        return compute_rewards(funcs, prompts, completions, weights=self.cfg.grpo.reward_weights, columns=columns)

    def finish(self, sums: dict[str, float]) -> dict[str, float]:
        n = max(sums["num_completions"], 1.0)
        out = {
            "reward": sums["reward"] / sums["num_scored"] if sums.get("num_scored") else float("nan"),
            "completions/mean_length": sums["completion_length"] / n,
            "completions/clipped_ratio": sums["clipped"] / n,
        }
        for key in sorted(k for k in sums if k.startswith("rewards/") and k.endswith("/sum")):
            count = sums[key.removesuffix("/sum") + "/count"]
            out[key.removesuffix("/sum") + "/mean"] = sums[key] / count if count else float("nan")
        return out


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


def evaluate(trainer: Any, evaluator: Evaluator, *, step: Optional[int] = None) -> dict[str, float]:
    """The eval metrics of ``trainer``'s model now (every rank calls it: a sharded forward is a collective), with
    HF's ``eval_`` prefix, ``eval_runtime`` and ``eval_samples_per_second``; ``step``: where SFT samples and GRPO's
    logged completions are written (None, as for ``twinseq.SFTTrainer.evaluate()``: not written).

    What a Python trainer class's ``evaluate()`` calls, after training or between runs."""
    t0 = time.perf_counter()
    metrics = evaluator.finish(evaluator.collect(trainer, step))
    seconds = time.perf_counter() - t0
    out = {f"eval_{k}": v for k, v in metrics.items()}
    out["eval_runtime"] = seconds
    out["eval_samples_per_second"] = evaluator.num_examples / seconds if seconds > 0 else float("inf")
    return out


def track_best(state: TrainerState, cfg: TrainConfig, metrics: dict[str, float], step: int) -> bool:
    """Update ``state.best_metric`` / ``best_global_step`` with this evaluation (HF's ``_determine_best_metric``: a
    strict improvement of ``metric_for_best_model`` in the direction of ``greater_is_better``); True when it is a new
    best. ``best_model_checkpoint`` is set by the runner when the step's checkpoint is written."""
    name = cfg.effective_metric_for_best_model
    if name not in metrics:
        raise ConfigError(
            f"metric_for_best_model={cfg.metric_for_best_model!r} ({name}) is not among this evaluation's metrics "
            f"{sorted(metrics)}; pass one of those."
        )
    value, best = float(metrics[name]), state.best_metric
    better = best is None or (value > best if cfg.effective_greater_is_better else value < best)
    if better and math.isfinite(value):
        state.best_metric, state.best_global_step = value, step
        state.best_model_checkpoint = None
        return True
    return False


def best_state(state: TrainerState) -> dict[str, Any]:
    """What a checkpoint keeps of the best evaluation, so that a resumed run keeps comparing with it."""
    return {
        "best_metric": state.best_metric,
        "best_global_step": state.best_global_step,
        "best_model_checkpoint": state.best_model_checkpoint,
    }


def restore_best(state: TrainerState, saved: Optional[dict[str, Any]]) -> None:
    """The inverse of ``best_state`` (a checkpoint without one leaves ``state`` as it is)."""
    for key, value in (saved or {}).items():
        setattr(state, key, value)
