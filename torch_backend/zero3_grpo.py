"""GRPO under DeepSpeed ZeRO-3 (``twinseq train --task grpo --deepspeed-zero-stage 3``): ``grpo.GRPOTrainer``
on every rank of a ``deepspeed.Zero3Engine``, and its builder (``recipes.train_zero3`` calls it)."""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from twinseq.common.config import TrainConfig
from twinseq.common.data.prepare import run_tokenizer
from twinseq.common.data.prompts import prepare_grpo_prompts, resolve_reward_funcs
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.grpo import reward_func_name
from twinseq.common.run.inputs import NO_INPUTS, RunInputs
from twinseq.common.run.rollout import generation_source, loss_description
from twinseq.common.run.schedule import with_resolved_max_steps
from twinseq.torch_backend.deepspeed import (
    Zero3Engine,
    Zero3Hooks,
    check_zero3_config,
    ensure_process_group,
    gathered_for_generation,
    refuse_built_model,
    require_deepspeed,
    zero3_engine_for,
)
from twinseq.torch_backend.distributed import main_process_first
from twinseq.torch_backend.grpo import GRPOTrainer


class Zero3GRPOTrainer(Zero3Hooks, GRPOTrainer):
    """``GRPOTrainer``'s micro-step and the common rollout on ``deepspeed.Zero3Hooks``: the parameters, gradients and
    AdamW state partitioned over the ranks.

    - Each rank takes its contiguous share of the step's prompts (``num_generations`` completions of a prompt
      stay on one rank, so its group is whole); rewards are gathered, so advantages (``scale_rewards='batch'``
      too) and the reward metrics are those of the whole step.
    - Generation: ``ds3_gather_for_generation=True`` gathers the full weights once per generation and lifts the
      engine's hooks (``deepspeed.gathered_for_generation``); ``False`` generates on the partitioned model, each
      layer gathered in its turn and every rank stepping in lock-step (HF ``synced_gpus``): no full copy, slower.
    - The loss is normalised by the step's counts over every rank, and the engine sums the gradients over
      ranks: the update equals one process's over the same completions.
    """

    def __init__(self, cfg: TrainConfig, engine: Zero3Engine, *, tokenizer: Any, reward_funcs: Sequence[Any]) -> None:
        self.cfg, self.engine, self.device, self.runtime = cfg, engine, engine.device, None
        self.module, self.causal_lm = engine.module, engine.causal_lm
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.init_rollout(cfg, tokenizer, reward_funcs, world=self.world)
        self.ref_model, self.vllm, self._vllm_sync_seconds = None, None, None
        self._sampling_logps, self._is_metrics = None, {}  # GRPOTrainer's vLLM correction state (no vLLM here)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self.rollout_state()}  # Zero3Hooks' state, and the entropy control's

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.load_rollout_state(state)

    def prepare(self, micro_batches: list[Any]) -> list[Any]:
        (entry,) = micro_batches
        share = len(entry["prompts"]) // self.world
        mine = entry["prompts"][self.rank * share : (self.rank + 1) * share]
        micro = super().prepare([{**entry, "prompts": mine}])
        self.check_micro_batches(micro)
        return micro

    def sample(self, prompt_ids: list[list[int]], **extra: Any) -> np.ndarray:
        gather = self.cfg.grpo.ds3_gather_for_generation
        context = (
            gathered_for_generation(self.causal_lm, getattr(self.engine.engine.optimizer, "parameter_offload", None))
            if gather
            else contextlib.nullcontext()
        )
        with context:
            return super().sample(prompt_ids, synced_gpus=not gather and self.world > 1)

    def _gather(self, value: Any) -> list[Any]:
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, value)
        return parts

    def gather_rewards(self, total: np.ndarray, per: np.ndarray) -> tuple[np.ndarray, np.ndarray, slice]:
        parts = self._gather((np.asarray(total), np.asarray(per)))
        start = sum(len(t) for t, _ in parts[: self.rank])
        return (
            np.concatenate([t for t, _ in parts]),
            np.concatenate([p for _, p in parts]),
            slice(start, start + len(total)),
        )

    def gather_rows(self, values: np.ndarray) -> np.ndarray:
        return np.concatenate([np.asarray(v) for v in self._gather(np.asarray(values))])

    def step_totals(self, num_sequences: int, num_tokens: int, num_micro_batches: int) -> tuple[int, int, int]:
        counts = torch.tensor([num_sequences, num_tokens, num_micro_batches], dtype=torch.int64, device=self.device)
        dist.all_reduce(counts)
        a, b, c = (int(x) for x in counts.tolist())
        return a, b, c

    def _forward(self, fn: Any) -> Any:
        return self.engine.engine(fn)  # losses.CausalLMLoss runs fn(causal_lm) inside the root forward

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def summarize(self, records: list[dict[str, float]], micro_batches: list[Any]) -> dict[str, Any]:
        keys = sorted({k for r in records for k in r if k.endswith("_sum")} | {"loss", "num_tokens", "num_loss_tokens"})
        sums = torch.tensor(
            [sum(r.get(k, 0.0) for r in records) for k in keys], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(sums)
        return super().summarize([dict(zip(keys, sums.tolist()))], micro_batches)


def build_grpo_zero3(cfg: TrainConfig, reward_funcs: Optional[Sequence[Any]] = None, inputs: RunInputs = NO_INPUTS):
    """(trainer, source, tokenizer, announce lines) of a GRPO run under ZeRO-3, on every rank of the launch
    (``recipes.train_zero3`` calls it with the process group up)."""
    check_zero3_config(cfg)
    refuse_built_model(inputs)
    require_deepspeed()
    ensure_process_group()
    g = cfg.grpo
    if g.use_vllm:
        raise ConfigError(
            "use_vllm=True does not combine with deepspeed_zero_stage=3 here: generation runs on the "
            "ZeRO-3 model (ds3_gather_for_generation); drop --use-vllm."
        )
    world = dist.get_world_size()
    if g.top_entropy_quantile < 1.0 and world > 1:
        raise ConfigError(
            f"top_entropy_quantile={g.top_entropy_quantile} takes its quantile over every rank's tokens in TRL, "
            f"which twinseq's ZeRO-3 GRPO (on {world} ranks) does not gather; set top_entropy_quantile=1.0, or run "
            f"it in one process."
        )
    with main_process_first():
        tokenizer = run_tokenizer(cfg, inputs.tokenizer)
        rows = prepare_grpo_prompts(cfg, tokenizer, inputs.train_dataset)
    funcs = resolve_reward_funcs(reward_funcs or inputs.reward_funcs or g.reward_funcs)
    source, per_rank = generation_source(cfg, rows, world)
    cfg = with_resolved_max_steps(cfg, source)  # max_steps=-1: num_train_epochs passes over the source
    engine = zero3_engine_for(cfg, tokenizer.vocab_size)  # its schedule reads the resolved max_steps
    trainer = Zero3GRPOTrainer(cfg, engine, tokenizer=tokenizer, reward_funcs=funcs)
    announce = [
        f"twinseq torch {cfg.task}: DeepSpeed ZeRO-3 over {world} rank(s) ({dist.get_backend()}), "
        f"{cfg.model.model_config!r}; generation "
        f"{'gathered once per generation' if g.ds3_gather_for_generation else 'on the partitioned model'} "
        f"(ds3_gather_for_generation={g.ds3_gather_for_generation})",
        f"{cfg.task}: {len(rows)} prompts, {source.prompts_per_step} prompts x {g.num_generations} generations = "
        f"{world * per_rank} completions per generation ({per_rank} per rank), {trainer.generation_parts} optimizer "
        f"step(s) each, max_completion_length="
        f"{trainer.max_completion_length}, {loss_description(cfg)}, num_iterations="
        f"{g.num_iterations}, rewards={[reward_func_name(f) for f in funcs]}",
    ]
    return trainer, source, tokenizer, announce
