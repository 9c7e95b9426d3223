"""GRPO under DeepSpeed ZeRO-3 (``twinseq train --task grpo --deepspeed-zero-stage 3``): ``grpo.GRPOTrainer``
on every rank of a ``deepspeed.Zero3Engine``, and its builder (``deepspeed.train_zero3`` calls it)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from twinseq.common.config import TrainConfig
from twinseq.common.errors import ConfigError
from twinseq.common.grpo import reward_func_name
from twinseq.torch_backend.grpo import GRPOTrainer


class Zero3GRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` on every rank of a ``deepspeed.Zero3Engine``: the parameters, gradients and AdamW state
    partitioned over the ranks.

    - Each rank takes its contiguous share of the step's prompts (``num_generations`` completions of a prompt
      stay on one rank, so its group is whole); rewards are gathered, so advantages (``scale_rewards='batch'``
      too) and the reward metrics are those of the whole step.
    - Generation: ``ds3_gather_for_generation=True`` gathers the full weights once per generation and lifts the
      engine's hooks (``deepspeed.gathered_for_generation``); ``False`` generates on the partitioned model, each
      layer gathered in its turn and every rank stepping in lock-step (HF ``synced_gpus``): no full copy, slower.
    - The loss is normalised by the step's counts over every rank, and the engine sums the gradients over
      ranks: the update equals one process's over the same completions.
    """

    def __init__(self, cfg: TrainConfig, engine: Any, *, tokenizer: Any, reward_funcs: Sequence[Any]) -> None:
        import torch.distributed as dist

        from twinseq.torch_backend.deepspeed import Zero3Trainer

        self.cfg, self.engine, self.device, self.runtime = cfg, engine, engine.device, None
        self.module, self.causal_lm = engine.module, engine.causal_lm
        self._zero3 = Zero3Trainer(engine)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self._init_grpo(cfg, tokenizer, reward_funcs, None)

    @property
    def is_main(self) -> bool:
        return self.engine.is_main

    def prepare(self, micro_batches: list[Any]) -> list[Any]:
        (entry,) = micro_batches
        share = len(entry["prompts"]) // self.world
        mine = entry["prompts"][self.rank * share:(self.rank + 1) * share]
        return super().prepare([{**entry, "prompts": mine}])

    def _generate_ids(self, generate: Any, prompt_ids: list[list[int]]) -> Any:
        import contextlib

        from twinseq.torch_backend.deepspeed import gathered_for_generation

        gather = self.cfg.grpo.ds3_gather_for_generation
        context = gathered_for_generation(self.causal_lm, getattr(self.engine.engine.optimizer,
                                                                  "parameter_offload", None)) \
            if gather else contextlib.nullcontext()
        with context:
            return super()._generate_ids(generate, prompt_ids, synced_gpus=not gather and self.world > 1)

    def _gather(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, value)
        return parts

    def _all_rewards(self, total: np.ndarray, per: np.ndarray) -> tuple[np.ndarray, np.ndarray, slice]:
        parts = self._gather((np.asarray(total), np.asarray(per)))
        start = sum(len(t) for t, _ in parts[:self.rank])
        return (np.concatenate([t for t, _ in parts]), np.concatenate([p for _, p in parts]),
                slice(start, start + len(total)))

    def _all_rows(self, values: np.ndarray) -> np.ndarray:
        return np.concatenate([np.asarray(v) for v in self._gather(np.asarray(values))])

    def _step_counts(self, num_sequences: int, num_tokens: int, num_micro_batches: int) -> tuple[int, int, int]:
        import torch.distributed as dist

        counts = torch.tensor([num_sequences, num_tokens, num_micro_batches], dtype=torch.int64,
                              device=self.device)
        dist.all_reduce(counts)
        return tuple(int(c) for c in counts.tolist())

    def _forward(self, fn: Any) -> Any:
        return self.engine.engine(fn)  # parallel.CausalLMLoss runs fn(causal_lm) inside the root forward

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def summarize(self, records: list[dict[str, float]], micro_batches: list[Any]) -> dict[str, Any]:
        import torch.distributed as dist

        keys = sorted({k for r in records for k in r if k.endswith("_sum")} | {"loss", "num_tokens",
                                                                                 "num_loss_tokens"})
        sums = torch.tensor([sum(r.get(k, 0.0) for r in records) for k in keys], dtype=torch.float64,
                            device=self.device)
        dist.all_reduce(sums)
        return super().summarize([dict(zip(keys, sums.tolist()))], micro_batches)

    def step(self, micro_batches: list[Any]) -> dict[str, Any]:
        from twinseq.common.step_metrics import apply_or_skip, first_nonfinite

        micro = self.prepare(micro_batches)
        engine = self.engine.engine
        if len(micro) != engine.gradient_accumulation_steps():
            raise ConfigError(f"this rank's completions split into {len(micro)} micro-batches, but DeepSpeed steps "
                              f"after gradient_accumulation_steps={engine.gradient_accumulation_steps()}")
        lr = self.engine.scheduler.get_last_lr()[0]
        records = []
        for mb in micro:
            records.append(self.micro_step(mb))
            engine.step()  # the optimizer (and the schedule) steps at the accumulation boundary
        norm = engine.get_global_grad_norm()
        out = self.summarize(records, micro)
        problem = first_nonfinite([out["loss"]], float(norm) if norm is not None else 0.0)
        if self.any_rank(problem is not None):  # DeepSpeed has applied the update: the run stops
            apply_or_skip(problem or "a loss or gradient norm on another rank is not finite", skip=False)
        return {**out, "lr": lr, "grad_norm": float(norm) if norm is not None else float("nan"),
                "num_skipped_steps": 0}

    def any_rank(self, flag: bool) -> bool:
        return self._zero3.any_rank(flag)

    def state_dict(self) -> dict[str, Any]:
        return self._zero3.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._zero3.load_state_dict(state)

    def save_final(self, path: Any) -> None:
        self._zero3.save_final(path)

    def peak_memory_bytes(self) -> int:
        return self._zero3.peak_memory_bytes()


def build_grpo_zero3(cfg: TrainConfig, reward_funcs: Optional[Sequence[Any]] = None):
    """(trainer, source, tokenizer, announce lines) of a GRPO run under ZeRO-3, on every rank of the launch
    (``deepspeed.train_zero3`` calls it with the process group up)."""
    import torch.distributed as dist

    from twinseq.common.data import run_tokenizer
    from twinseq.common.grpo_data import PromptSource, prepare_grpo_prompts, resolve_reward_funcs
    from twinseq.common.hf_checkpoint import check_tokenizer_fits, resolve_model_source
    from twinseq.torch_backend.checkpoint import load_pretrained
    from twinseq.torch_backend.deepspeed import (build_zero3_engine, check_zero3_config, ensure_process_group,
                                                 require_deepspeed)

    check_zero3_config(cfg)
    require_deepspeed()
    ensure_process_group()
    g = cfg.grpo
    if g.use_vllm:
        raise ConfigError("use_vllm=True does not combine with deepspeed_zero_stage=3 here: generation runs on the "
                          "ZeRO-3 model (ds3_gather_for_generation); drop --use-vllm.")
    world, rank = dist.get_world_size(), dist.get_rank()
    if rank != 0:
        dist.barrier()  # rank 0 builds the caches (corpus, tokenizer) first
    tokenizer = run_tokenizer(cfg)
    rows = prepare_grpo_prompts(cfg, tokenizer)
    if rank == 0:
        dist.barrier()
    funcs = resolve_reward_funcs(g.reward_funcs if reward_funcs is None else reward_funcs)
    spec = resolve_model_source(cfg.model.model_config, cfg.model.init_weights)
    check_tokenizer_fits(spec.config, tokenizer.vocab_size, cfg.model.model_config)
    model = None
    if spec.weights_folder is not None:  # whole on each rank, partitioned by deepspeed.initialize
        model = load_pretrained(spec.weights_folder, dtype="float32", attn_implementation=cfg.model.attn_implementation)
    engine = build_zero3_engine(cfg, model_config=spec.config, model=model)
    per_rank = cfg.data.per_device_train_batch_size * cfg.data.gradient_accumulation_steps
    prompts_per_step = world * per_rank // g.num_generations
    source = PromptSource(rows, prompts_per_step, num_iterations=g.num_iterations, seed=cfg.seed)
    trainer = Zero3GRPOTrainer(cfg, engine, tokenizer=tokenizer, reward_funcs=funcs)
    announce = [f"twinseq torch grpo: DeepSpeed ZeRO-3 over {world} rank(s) ({dist.get_backend()}), "
                f"{cfg.model.model_config!r}; generation "
                f"{'gathered once per generation' if g.ds3_gather_for_generation else 'on the partitioned model'} "
                f"(ds3_gather_for_generation={g.ds3_gather_for_generation})",
                f"grpo: {len(rows)} prompts, {prompts_per_step} prompts x {g.num_generations} generations = "
                f"{world * per_rank} completions per step ({per_rank} per rank), max_completion_length="
                f"{trainer.max_completion_length}, loss={g.grpo_loss_type}, beta={g.grpo_beta}, num_iterations="
                f"{g.num_iterations}, rewards={[reward_func_name(f) for f in funcs]}"]
    return trainer, source, tokenizer, announce

