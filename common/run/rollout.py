"""The rollout of an online method, once for every backend: from a step's prompts to its scored, grouped
completions, split into micro-batches, and the step's metrics.

``GroupRollout`` is a mixin beside a backend's trainer (``common.run.trainer.TrainerTemplate``'s hooks). It owns:

- group expansion (``num_generations`` completions per prompt) and the completion-length rule
  (``grpo.completion_budget``: ``max_completion_length``, or TRL 1.16's 512 when unset, on both backends);
- the completion mask (to the first EOS; ``mask_truncated_completions``), the reward calls with the dataset's
  extra columns (conversational prompts get their completions back as messages, as TRL passes them),
  the group advantages and TRL's reward and completion metrics;
- regeneration every ``num_iterations`` steps (``PromptSource`` marks the steps that generate); with
  ``steps_per_generation`` k times ``gradient_accumulation_steps``, one generation feeds k optimizer steps, each
  its next slice of the micro-batches (TRL's order, bar its shuffle: slices stay in generation order);
- the step's loss normalisers over every rank (``StepShare``), and the entropy bonus's coefficient
  (``EntropyControl``: constant, or adaptive, updated from each step's entropy over every rank);
- the step's metrics (``summarize``): token means of the micro-batches' sums, the generation's metrics,
  and the time spent generating and training;
- with ``log_completions`` (TRL's name), each generation's prompts, completions, rewards and advantages,
  appended to ``<output_dir>/completions.jsonl``.

The advantage is the task's: GRPO's group-normalised one (``common.objectives.grpo.score_advantages``), or RLOO's
leave-one-out one (``common.objectives.rloo.rloo_advantages``), whose KL penalty reads the sampling policy's and
the reference's log-probs, so RLOO's micro-batches are built first and given their advantages after.

A backend supplies ``sample`` (generate completions of these prompt ids) and ``build_micro_batches``
(collate them, with the per-token log-probs of the sampling policy and the reference where the loss needs
them), and for RLOO ``kl_sums`` and ``set_advantages``. A multi-rank engine (ZeRO-3) overrides
``gather_rewards``, ``gather_rows`` and ``step_totals``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from twinseq.common.config import TrainConfig
from twinseq.common.data.prompts import PromptSource
from twinseq.common.objectives.grpo import (
    completion_budget,
    completion_mask,
    compute_rewards,
    generation_steps,
    reward_func_name,
    reward_metrics,
    score_advantages,
)
from twinseq.common.objectives.grpo_loss import EntropyControl, LossSpec, StepShare
from twinseq.common.objectives.rloo import RLOOConfig, rloo_advantages, rloo_loss_spec
from twinseq.common.run.report import append_jsonl, cut_jsonl


@dataclass
class Rollout:
    """What one generation produced: the micro-batches, and the metrics of the completions."""

    micro_batches: list[Any]
    metrics: dict[str, float]
    num_loss_tokens: int
    num_sequences: int
    completions: list[dict[str, Any]] = field(default_factory=list)
    """With ``log_completions``: this rank's prompts, completions, rewards and advantages (TRL's table)."""


def generation_source(cfg: TrainConfig, rows: Sequence[Any], world: int = 1) -> tuple[PromptSource, int]:
    """(the run's ``PromptSource``, completions per generation on each rank): a generation is
    ``per_device_train_batch_size x steps_per_generation`` completions per rank (``generation_steps``), so
    ``world`` times that over ``num_generations`` prompts."""
    d, g = cfg.data, cfg.grpo
    steps = generation_steps(g, d.per_device_train_batch_size, d.gradient_accumulation_steps, world)
    per_rank = d.per_device_train_batch_size * steps
    source = PromptSource(
        rows,
        world * per_rank // g.num_generations,
        num_iterations=g.num_iterations,
        seed=cfg.seed,
        steps_per_generation=steps // d.gradient_accumulation_steps,
    )
    return source, per_rank


def trim_completions(completion_ids_NC: np.ndarray, length_mask_NC: np.ndarray) -> list[np.ndarray]:
    """Each completion up to and including its first EOS (at least one token: a completion is never empty)."""
    lengths = np.maximum(np.asarray(length_mask_NC).sum(axis=1), 1)
    return [row[:n] for row, n in zip(completion_ids_NC, lengths)]


class GroupRollout:
    """GRPO's rollout and step bookkeeping (see the module docstring); ``init_rollout`` sets it up."""

    cfg: TrainConfig

    def init_rollout(self, cfg: TrainConfig, tokenizer: Any, reward_funcs: Sequence[Any], world: int = 1) -> None:
        self.tokenizer, self.reward_funcs = tokenizer, list(reward_funcs)
        d = cfg.data
        self.generation_parts = (
            generation_steps(cfg.grpo, d.per_device_train_batch_size, d.gradient_accumulation_steps, world)
            // d.gradient_accumulation_steps
        )
        """Optimizer steps one generation feeds per iteration: steps_per_generation / gradient_accumulation_steps."""
        self.entropy_control = EntropyControl.of(cfg.grpo)
        self.num_generations = cfg.grpo.num_generations
        self.max_completion_length = completion_budget(cfg.data.max_completion_length)
        self.rloo: Optional[RLOOConfig] = cfg.rloo if cfg.task == "rloo" else None
        self.loss_spec = (
            rloo_loss_spec(cfg.grpo) if self.rloo is not None else LossSpec.of(cfg.grpo, self.max_completion_length)
        )
        self.kl_beta = cfg.reference_kl_beta
        """Above 0 the reference's log-probs are kept: GRPO's KL term, RLOO's KL penalty."""
        g = cfg.grpo
        self.vllm_is = cfg.task == "grpo" and g.use_vllm and g.vllm_importance_sampling_correction
        """vLLM's importance-sampling correction is on (GRPO only, as TRL: its RLOO has none)."""
        self.keeps_old_logps = (
            g.num_iterations > 1
            or self.generation_parts > 1
            or (self.rloo is not None and self.kl_beta > 0)
            or self.vllm_is
        )
        """The sampling policy's log-probs are kept: the ratio's denominator (a generation that feeds more than one
        optimizer step), RLOO's KL penalty, and the numerator of vLLM's importance ratio."""
        self.share = StepShare()
        self.num_generations_done = 0
        self._rollout: Optional[Rollout] = None
        self._generated_now = False
        self._completions_logged = False
        self._step_started = 0.0

    # -- backend hooks -------------------------------------------------------------------

    def sample(self, prompt_ids: list[list[int]]) -> np.ndarray:
        """[N, C] completion ids of ``prompt_ids`` (one completion per entry), right-padded with ``pad_token_id``."""
        raise NotImplementedError

    def build_micro_batches(
        self,
        prompt_ids: list[list[int]],
        completions: list[np.ndarray],
        loss_mask_NC: np.ndarray,
        advantages_N: np.ndarray,
        num_columns: int,
    ) -> list[Any]:
        """Consecutive slices of ``per_device_train_batch_size`` completions, collated for the backend, with the
        sampling policy's (``keeps_old_logps``) and the reference's (``kl_beta > 0``) log-probs."""
        raise NotImplementedError

    def kl_sums(self, micro_batches: list[Any]) -> np.ndarray:
        """RLOO: float64 [N] of this rank's completions, in order: ``Σ_t m (log π_old - log π_ref)`` from the kept
        log-probs."""
        raise NotImplementedError

    def set_advantages(self, micro_batches: list[Any], advantages_N: np.ndarray) -> None:
        """RLOO: give the built micro-batches their advantages (this rank's completions, in order)."""
        raise NotImplementedError

    def generation_metrics(self) -> dict[str, float]:
        """Backend extras of the last generation (vLLM's weight-sync time)."""
        return {}

    # -- multi-rank hooks (one process: the identity) ---------------------------------------

    def gather_rewards(self, total: np.ndarray, per: np.ndarray) -> tuple[np.ndarray, np.ndarray, slice]:
        """(every rank's total rewards, per-function rewards, the slice of them that are this rank's)."""
        return total, per, slice(0, len(total))

    def gather_rows(self, values: np.ndarray) -> np.ndarray:
        """A per-completion array of every rank, in rank order."""
        return values

    def step_totals(self, num_sequences: int, num_tokens: int, num_micro_batches: int) -> tuple[int, int, int]:
        """The step's completions, loss tokens and micro-batches, over every rank."""
        return num_sequences, num_tokens, num_micro_batches

    # -- the rollout ---------------------------------------------------------------------

    def rollout(self, prompts: Sequence[dict]) -> Rollout:
        """Sample ``num_generations`` completions of each prompt, score them, and split them into micro-batches."""
        g, tok = self.cfg.grpo, self.tokenizer
        expanded = [row for row in prompts for _ in range(self.num_generations)]
        prompt_ids = [list(r["prompt_input_ids"]) for r in expanded]
        t0 = time.perf_counter()
        completion_ids = self.sample(prompt_ids)
        gen_seconds = time.perf_counter() - t0
        self.num_generations_done += 1
        length_mask, truncated = completion_mask(completion_ids, tok.eos_token_id, tok.pad_token_id)
        loss_mask = length_mask * (~truncated[:, None] if g.mask_truncated_completions else 1)
        completions = trim_completions(completion_ids, length_mask)
        texts = [tok.decode(ids.tolist(), skip_special_tokens=True) for ids in completions]
        prompt_values = [r["prompt"] for r in expanded]
        if prompt_values and not isinstance(prompt_values[0], str):  # conversational: TRL passes messages back
            texts_for_rewards: list[Any] = [[{"role": "assistant", "content": t}] for t in texts]
        else:
            texts_for_rewards = texts
        skip = {"prompt", "prompt_text", "prompt_input_ids"}
        columns = {k: [r.get(k) for r in expanded] for k in expanded[0] if k not in skip}
        t1 = time.perf_counter()
        total, per = compute_rewards(
            self.reward_funcs, prompt_values, texts_for_rewards, weights=g.reward_weights, columns=columns
        )
        reward_seconds = time.perf_counter() - t1
        # every rank's rewards (one process: its own), in rank order; advantages over them all, then ours
        total, per, ours = self.gather_rewards(total, per)
        extra: dict[str, float] = {}
        if self.rloo is None:
            all_advantages, scale_std = score_advantages(
                total,
                per,
                self.num_generations,
                weights=g.reward_weights,
                scale_rewards=g.scale_rewards,
                aggregation=g.multi_objective_aggregation,
            )
            advantages = all_advantages[ours]
            micro = self.build_micro_batches(prompt_ids, completions, loss_mask, advantages, completion_ids.shape[1])
        else:  # the KL penalty reads the kept log-probs: build first, then the advantages
            zeros = np.zeros(len(completions))
            micro = self.build_micro_batches(prompt_ids, completions, loss_mask, zeros, completion_ids.shape[1])
            kl = None
            if self.kl_beta > 0:
                kl = self.gather_rows(self.kl_sums(micro))
                extra["kl"] = float(kl.sum() / max(float(self.gather_rows(loss_mask.sum(axis=1)).sum()), 1.0))
            all_advantages, scale_std = rloo_advantages(
                total,
                self.num_generations,
                kl_N=kl,
                beta=self.kl_beta,
                normalize=self.rloo.normalize_advantages,
                reward_clip_range=self.rloo.reward_clip_range,
            )
            advantages = all_advantages[ours]
            self.set_advantages(micro, advantages)
        lengths = self.gather_rows(length_mask.sum(axis=1))
        truncated = self.gather_rows(truncated)
        metrics = {
            **reward_metrics(
                total,
                per,
                [reward_func_name(f) for f in self.reward_funcs],
                self.num_generations,
                g.scale_rewards,
                scale_std,
            ),
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(truncated.mean()),
            "generation_seconds": gen_seconds,
            "reward_seconds": reward_seconds,
            **extra,
            **self.generation_metrics(),
        }
        table = []
        if g.log_completions:
            names = [reward_func_name(f) for f in self.reward_funcs]
            table = [
                {"prompt": r["prompt_text"], "completion": text, "reward": float(tot), "advantage": float(adv)}
                | {name: float(v) for name, v in zip(names, p)}
                for r, text, tot, p, adv in zip(expanded, texts, total[ours], per[ours], advantages)
            ]
        return Rollout(micro, metrics, int(loss_mask.sum()), len(completions), table)

    # -- what a checkpoint adds ------------------------------------------------------------

    def rollout_state(self) -> dict[str, Any]:
        """The adaptive entropy coefficient and the last step's entropy (none without adaptive control), for the
        backend's ``state_dict``."""
        if not self.entropy_control.adaptive:
            return {}
        return {"entropy_control": {k: np.asarray(v, np.float64) for k, v in self.entropy_control.state_dict().items()}}

    def load_rollout_state(self, state: dict[str, Any]) -> None:
        if self.entropy_control.adaptive and "entropy_control" in state:
            self.entropy_control.load_state_dict({k: float(v) for k, v in state["entropy_control"].items()})

    # -- TrainerTemplate's task hooks ------------------------------------------------------

    def prepare(self, micro_batches: list[Any]) -> list[Any]:
        """The step's one entry (``PromptSource``: its prompts, and whether it generates) -> the rollout's
        micro-batches; ``share`` holds the step's normalisers."""
        (entry,) = micro_batches
        self._generated_now = bool(entry["new_generation"] or self._rollout is None)
        if self._generated_now:
            self._rollout = self.rollout(entry["prompts"])
            if self._rollout.completions and getattr(self, "is_main", True):
                self._log_completions(entry.get("step", self.num_generations_done), self._rollout.completions)
        rec = self._rollout
        assert rec is not None
        micro, sequences = rec.micro_batches, rec.num_sequences
        if self.generation_parts > 1:  # this step's slice of the generation
            ga, size = self.cfg.data.gradient_accumulation_steps, self.cfg.data.per_device_train_batch_size
            part = int(entry.get("part", 0))
            micro = rec.micro_batches[part * ga : (part + 1) * ga]
            sequences = min(ga * size, rec.num_sequences - part * ga * size)
        num_sequences, num_tokens, num_micro = self.step_totals(sequences, rec.num_loss_tokens, len(micro))
        # dapo's normaliser: the generation's tokens per optimizer step (TRL's num_items_in_batch x GA / S)
        self.share = StepShare(
            num_sequences, num_tokens / self.generation_parts, num_micro, self.entropy_control.applied()
        )
        self._step_started = time.perf_counter()
        return micro

    def _log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """``log_completions``: a generation's table, appended to ``<output_dir>/completions.jsonl`` (the run's first
        generation first drops the lines a previous or resumed run wrote from this step on)."""
        path = Path(self.cfg.output_dir) / "completions.jsonl"
        if not self._completions_logged:
            cut_jsonl(path, step)
            self._completions_logged = True
        append_jsonl(path, [{"step": step, **row} for row in rows])

    def summarize(self, records: list[dict[str, float]], micro_batches: list[Any]) -> dict[str, Any]:
        """The loss, token counts, token means of the ``*_sum`` metrics, and the generation's metrics."""
        tokens = max(sum(r["num_loss_tokens"] for r in records), 1.0)
        out: dict[str, Any] = {
            "loss": sum(r["loss"] for r in records),
            "num_tokens": int(sum(r["num_tokens"] for r in records)),
            "num_completion_tokens": int(sum(r["num_loss_tokens"] for r in records)),
        }
        step_sums = {k: sum(r.get(k + "_sum", 0.0) for r in records) for k in STEP_SUMS}
        for key in sorted({k for r in records for k in r if k.endswith("_sum")} - {k + "_sum" for k in STEP_SUMS}):
            out[key[:-4]] = sum(r.get(key, 0.0) for r in records) / tokens
        if self.loss_spec.entropy_bonus:  # TRL logs both only with the bonus on
            out["policy_loss"] = step_sums["policy_loss"]
            self.entropy_control.update(step_sums["bonus_entropy"], step_sums["bonus_tokens"])
            out["entropy_coef"] = self.entropy_control.coef
        assert self._rollout is not None
        out.update(self._rollout.metrics)
        out["generation_seconds"] = self._rollout.metrics["generation_seconds"] if self._generated_now else 0.0
        out["training_seconds"] = time.perf_counter() - self._step_started
        return out


STEP_SUMS = ("policy_loss", "bonus_entropy", "bonus_tokens")
"""Micro-step metrics that add up over a step as they are (not token means): the policy loss's share without the
entropy bonus, and the bonus tokens' entropy sum and count (what adaptive entropy control reads)."""


def bonus_sums(policy_loss: float, entropy_total: float, tokens: float) -> dict[str, float]:
    """A micro-batch's ``STEP_SUMS`` with an entropy bonus (see ``common.objectives.grpo_loss.entropy_bonus_np``)."""
    return dict(zip(STEP_SUMS, (float(policy_loss), float(entropy_total), float(tokens))))


def token_record(
    loss: float, num_loss_tokens: float, num_tokens: int, token_means: dict[str, float]
) -> dict[str, float]:
    """A micro-step's record: its loss and counts, and its token means as token sums (``*_sum``), so that the
    step's means weigh the micro-batches by their tokens (``STEP_SUMS`` as they are)."""
    record = {"loss": float(loss), "num_loss_tokens": float(num_loss_tokens), "num_tokens": num_tokens}
    for k, v in token_means.items():
        record[k + "_sum"] = float(v) * (1.0 if k in STEP_SUMS else float(num_loss_tokens))
    return record


def loss_description(cfg: TrainConfig) -> str:
    """The announce line's account of an online run's loss."""
    if cfg.task == "rloo":
        r = cfg.rloo
        return f"loss=rloo (leave-one-out), rloo_beta={r.rloo_beta}, normalize_advantages={r.normalize_advantages}"
    return f"loss={cfg.grpo.grpo_loss_type}, beta={cfg.grpo.grpo_beta}"
