"""The torch trainers: one optimizer step of SFT or DPO, in one process or under FSDP2 + context parallelism.

``train(cfg)`` builds the data, the plain model, ``parallel.parallelize``s it, and hands a
trainer to ``common.runner.run``, which owns the loop (timing, logging, checkpoints, resume,
the final save). A trainer implements ``common.runner.StepTrainer``:

- ``step(micro_batches)``: ``gradient_accumulation_steps`` micro-batches, each loss already
  normalised by the label count (SFT) or pair count (DPO) of the whole step, so the summed
  gradients equal one big batch's; clipping (norm in float64), AdamW, the schedule;
- ``state_dict``/``load_state_dict``: weights, optimizer, scheduler and RNG as numpy + JSON
  (the full, unsharded state, gathered on rank 0 under FSDP2);
- ``save_final``: a Hugging Face folder.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from twinseq.common.capabilities import Runtime as CapabilityRuntime
from twinseq.common.config import TrainConfig
from twinseq.common.errors import CheckpointError, ConfigError
from twinseq.common.hf_checkpoint import check_tokenizer_fits, resolve_model_source
from twinseq.common.init import check_weights, init_weights, parameter_shapes
from twinseq.common.metrics import peak_rss_bytes
from twinseq.common.runner import preflight, run
from twinseq.common.schedule import lr_multiplier
from twinseq.common.step_metrics import apply_or_skip, dpo_step_metrics, first_nonfinite, sft_step_sums, with_means
from twinseq.torch_backend.checkpoint import (from_numpy_tree, load_pretrained, rng_state, save_pretrained,
                                              set_rng_state, to_numpy_tree)
from twinseq.torch_backend.parallel import (Runtime, any_over_ranks, full_model_state, full_optimizer_state, init_runtime,
                                            load_full_model_state, load_full_optimizer_state, main_process_first,
                                            max_over_ranks, micro_batch_context, parallelize, prepare_micro_batches,
                                            reduce_step_metrics, wants_distributed)

logger = logging.getLogger(__name__)

_PREFIX = "causal_lm."  # the plain model's parameter names inside parallelize's CausalLMLoss


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def build_causal_lm(cfg: TrainConfig, vocab_size: int, device: torch.device) -> torch.nn.Module:
    """The plain HF model of ``cfg.model.model_config`` (a local folder, or a preset with ``common``'s
    initial weights), on ``device``, in train mode."""
    from twinseq.torch_backend.model import build_model

    spec, attn = cfg.model.model_config, cfg.model.attn_implementation
    source = resolve_model_source(spec, cfg.model.init_weights)
    check_tokenizer_fits(source.config, vocab_size, spec)
    if source.weights_folder is not None:
        model = load_pretrained(source.weights_folder, dtype="float32", attn_implementation=attn)
    else:
        model = build_model(source.config, init_weights(source.config, seed=cfg.seed), attn_implementation=attn)
    return model.to(device).train()


def add_peft(cfg: TrainConfig, causal_lm: torch.nn.Module) -> torch.nn.Module:
    """The plain model with ``cfg.peft``'s adapters (``peft.add_adapters``, drawn with ``cfg.seed``)."""
    from twinseq.torch_backend.model import model_config_of
    from twinseq.torch_backend.peft import add_adapters_seeded

    return add_adapters_seeded(causal_lm, model_config_of(causal_lm), cfg.peft, seed=cfg.seed)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """AdamW over the parameters that train (all, or the adapters only); weight decay on matrices only (norm
    scales are not decayed), as HF Trainer does. ``optimizer='adamw_bnb_8bit'``: bitsandbytes' ``AdamW8bit``."""
    opt = cfg.optim
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if opt.optimizer == "adamw_bnb_8bit":
        from twinseq.torch_backend.peft import require_bitsandbytes

        require_bitsandbytes("optimizer='adamw_bnb_8bit'")
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(groups, lr=opt.learning_rate, betas=(opt.adam_beta1, opt.adam_beta2),
                                        eps=opt.adam_epsilon)
    else:
        optimizer = torch.optim.AdamW(groups, lr=opt.learning_rate, betas=(opt.adam_beta1, opt.adam_beta2),
                                      eps=opt.adam_epsilon, foreach=False)
    warmup, total, kind = cfg.effective_warmup_steps, cfg.max_steps, opt.lr_scheduler_type
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: lr_multiplier(k, warmup_steps=warmup, max_steps=total, scheduler=kind))
    return optimizer, scheduler


def grad_norm_fp64(params: list) -> torch.Tensor:
    """The total 2-norm of the gradients of ``params`` (float64; DTensor gradients give the global norm)."""
    if not params:
        return torch.tensor(0.0, dtype=torch.float64)
    device = params[0].grad.device
    norms = [torch.linalg.vector_norm(p.grad, 2.0, dtype=torch.float64).to(device) for p in params]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_grad_norm_fp64_(parameters, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (``grads *= min(1, max_norm / (norm + 1e-6))``, returns the
    pre-clip total norm), with the norm accumulated in float64.

    torch's float32 norm on CPU is off by ~1e-4 relative on the embedding gradient (2.84467 vs
    2.84508), which moved every clipped step off the JAX trainer's trajectory (parity_tests/
    TOLERANCES.md). The same two steps as torch's own ``get_total_norm`` + ``clip_grads_with_norm_``,
    so DTensor (FSDP2) gradients work as before.
    """
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm_fp64(params)
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def autocast(cfg: TrainConfig, device: torch.device):
    if cfg.model.dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def offload_context(cfg: TrainConfig, model: torch.nn.Module):
    if not cfg.memory.activation_offloading:
        return contextlib.nullcontext()
    from twinseq.torch_backend.memory import offload_activations

    return offload_activations(model, loss_type=cfg.loss.loss_type)


class Trainer:
    """What SFT and DPO share: the optimizer step, the state, the export. A task implements
    ``micro_step`` (forward + backward of one micro-batch) and ``summarize`` (the step's metrics)."""

    def __init__(self, cfg: TrainConfig, module: torch.nn.Module, device: torch.device,
                 runtime: Optional[Runtime] = None) -> None:
        self.cfg, self.module, self.device, self.runtime = cfg, module, device, runtime
        self.causal_lm = module.causal_lm
        self.optimizer, self.scheduler = build_optimizer(module, cfg)

    @property
    def is_main(self) -> bool:
        return self.runtime is None or self.runtime.is_main

    def prepare(self, micro_batches: list[Any]) -> list[Any]:
        return micro_batches

    def micro_step(self, micro: Any) -> Any:
        raise NotImplementedError

    def summarize(self, records: list[Any], micro_batches: list[Any]) -> dict[str, Any]:
        raise NotImplementedError

    def micro_losses(self, records: list[Any]) -> list[float]:
        raise NotImplementedError

    def step(self, micro_batches: list[Any]) -> dict[str, Any]:
        micro_batches = self.prepare(micro_batches)
        records = [self.micro_step(mb) for mb in micro_batches]
        max_norm = self.cfg.optim.max_grad_norm
        if max_norm is not None:
            grad_norm = clip_grad_norm_fp64_(self.module.parameters(), max_norm)
        else:
            grad_norm = grad_norm_fp64([p for p in self.module.parameters() if p.grad is not None])
        problem = first_nonfinite(self.micro_losses(records), float(grad_norm))
        if self.any_rank(problem is not None):  # every rank applies or skips the same step
            problem = problem or "a loss or gradient norm on another rank is not finite"
        apply = apply_or_skip(problem, skip=self.cfg.optim.skip_nonfinite_steps)
        lr = self.optimizer.param_groups[0]["lr"]
        if apply:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {**self.summarize(records, micro_batches), "lr": lr, "grad_norm": float(grad_norm),
                "num_skipped_steps": int(not apply)}

    def any_rank(self, flag: bool) -> bool:
        return flag if self.runtime is None else any_over_ranks(flag, self.device)

    @property
    def is_peft(self) -> bool:
        from twinseq.torch_backend.peft import is_adapter_model

        return is_adapter_model(self.causal_lm)

    def _weight_names(self) -> list[str]:
        """The parameters a checkpoint holds: every weight (HF names), or the adapters only (PeftModel names)."""
        from twinseq.torch_backend.model import model_config_of

        if self.is_peft:
            return [name for name, p in self.causal_lm.named_parameters() if p.requires_grad]
        return list(parameter_shapes(model_config_of(self.causal_lm)))

    def state_dict(self) -> dict[str, Any]:
        weights = full_model_state(self.module, _PREFIX)  # collectives under FSDP2: every rank calls them
        optimizer = full_optimizer_state(self.module, self.optimizer)
        if not self.is_main:
            return {}
        return {"model": {k: to_numpy_tree(weights[k]) for k in self._weight_names()},
                "optimizer": to_numpy_tree(optimizer), "scheduler": to_numpy_tree(self.scheduler.state_dict()),
                "rng": rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from twinseq.torch_backend.model import model_config_of

        if self.is_peft or any("lora_" in k or "trainable_tokens" in k for k in state["model"]):
            expected, got = set(self._weight_names()), set(state["model"])
            if expected != got:
                raise CheckpointError(
                    f"the checkpoint holds {'adapter' if any('lora_' in k for k in got) else 'full-model'} weights "
                    f"that do not fit this {'PEFT' if self.is_peft else 'full fine-tuning'} run (missing "
                    f"{sorted(expected - got)[:2]}, unexpected {sorted(got - expected)[:2]}); resume with the "
                    f"peft settings (use_peft, lora_r, lora_target_modules, ...) the checkpoint was written with.")
        else:
            try:
                check_weights(model_config_of(self.causal_lm), state["model"])
            except ValueError as err:
                raise CheckpointError(f"the checkpoint's weights do not fit this model: {err}") from None
        load_full_model_state(self.module, state["model"], _PREFIX)
        load_full_optimizer_state(self.module, self.optimizer, from_numpy_tree(state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])

    def save_final(self, path: Path) -> None:
        if self.is_peft:
            self._save_final_adapters(path)
            return
        if self.runtime is None:
            save_pretrained(self.causal_lm, path)
            return
        from twinseq.torch_backend.model import build_model, model_config_of

        weights = full_model_state(self.module, _PREFIX)
        if self.is_main:
            model_cfg = model_config_of(self.causal_lm)
            save_pretrained(build_model(model_cfg, {k: weights[k].float().numpy() for k in self._weight_names()}),
                            path)
        dist.barrier()

    def _save_final_adapters(self, path: Path) -> None:
        """PEFT's folder (``adapter_config.json`` + ``adapter_model.safetensors``, which
        ``peft.PeftModel.from_pretrained`` loads); its ``base_model_name_or_path`` is the model folder the run
        started from, or, for a preset (weights drawn by ``init_weights``), the base written to ``path/base``."""
        from twinseq.common.peft import save_adapters
        from twinseq.torch_backend.model import build_model, model_config_of
        from twinseq.torch_backend.peft import peft_config_of, saved_key

        weights = full_model_state(self.module, _PREFIX)  # a collective under FSDP2
        if self.is_main:
            model_cfg = model_config_of(self.causal_lm)
            adapters = {saved_key(k): weights[k].float().numpy() for k in self._weight_names()}
            source = resolve_model_source(self.cfg.model.model_config, self.cfg.model.init_weights)
            if source.weights_folder is not None:
                base = Path(source.weights_folder).resolve()
            else:
                base = (Path(path) / "base").resolve()
                save_pretrained(build_model(model_cfg, init_weights(model_cfg, seed=self.cfg.seed)), base)
            save_adapters(path, model_cfg, peft_config_of(self.causal_lm), adapters, base_model_name_or_path=str(base))
        if self.runtime is not None:
            dist.barrier()

    def peak_memory_bytes(self) -> int:
        peak = int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else peak_rss_bytes()
        return peak if self.runtime is None else max_over_ranks(peak, self.device)


class SFTTrainer(Trainer):
    """Next-token loss of ``parallelize``'s ``CausalLMLoss``: on this rank's ``Batch``, ``CPShard`` or ring batch."""

    def prepare(self, micro_batches: list[Any]) -> list[Any]:
        return micro_batches if self.runtime is None else prepare_micro_batches(micro_batches, self.cfg, self.runtime)

    def micro_losses(self, records: list[dict[str, float]]) -> list[float]:
        return [r["loss"] for r in records]

    def micro_step(self, micro: Any) -> dict[str, float]:
        with micro_batch_context(micro, self.runtime) as inputs:
            with offload_context(self.cfg, self.causal_lm):
                with autocast(self.cfg, self.device):
                    loss, metrics = self.module(inputs)
                loss.backward()
        return {"loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}}

    def summarize(self, records: list[dict[str, float]], micro_batches: list[Any]) -> dict[str, Any]:
        sums = sft_step_sums(records, num_tokens=sum(mb.num_tokens for mb in micro_batches))
        return with_means(sums if self.runtime is None else reduce_step_metrics(sums, self.device))


class DPOTrainer(Trainer):
    """DPO of the policy (``module.causal_lm``) against a frozen reference copy, or precomputed log-probs."""

    def __init__(self, cfg: TrainConfig, module: torch.nn.Module, device: torch.device, *, ref_model, config,
                 examples_per_step: int) -> None:
        super().__init__(cfg, module, device)
        self.ref_model, self.config, self.examples_per_step = ref_model, config, examples_per_step
        # PEFT: the reference is the policy with its adapters disabled (TRL's way), unless precomputed
        self.adapter_reference = self.is_peft and ref_model is None and not cfg.dpo.precompute_ref_log_probs

    def micro_losses(self, records: list[Any]) -> list[float]:
        return [float(o.loss.detach()) for o in records]

    def micro_step(self, pbatch: Any):
        from twinseq.torch_backend.dpo import dpo_forward, liger_dpo_forward, reference_logps

        c, loss = self.cfg, self.cfg.loss
        with autocast(c, self.device):
            ref_c = ref_r = None
            if self.ref_model is not None and loss.loss_type != "liger":
                ref_c, ref_r = reference_logps(self.ref_model, pbatch, loss_type=loss.loss_type,
                                               chunk_size=loss.loss_chunk_size,
                                               attn_implementation=c.model.attn_implementation)
            elif self.adapter_reference:
                from twinseq.torch_backend.peft import reference_mode

                with reference_mode(self.causal_lm):
                    ref_c, ref_r = reference_logps(self.causal_lm, pbatch, loss_type=loss.loss_type,
                                                   chunk_size=loss.loss_chunk_size,
                                                   attn_implementation=c.model.attn_implementation)
        with offload_context(c, self.causal_lm):
            with autocast(c, self.device):
                if loss.loss_type == "liger":
                    out = liger_dpo_forward(self.causal_lm, self.ref_model, pbatch, self.config,
                                            self.examples_per_step, chunk_size=loss.loss_chunk_size,
                                            attn_implementation=c.model.attn_implementation)
                else:
                    out = dpo_forward(self.causal_lm, pbatch, self.config, ref_chosen_logps=ref_c,
                                      ref_rejected_logps=ref_r, loss_type=loss.loss_type,
                                      chunk_size=loss.loss_chunk_size, num_examples_in_step=self.examples_per_step,
                                      attn_implementation=c.model.attn_implementation)
            out.loss.backward()
        return out

    def summarize(self, records: list[Any], micro_batches: list[Any]) -> dict[str, Any]:
        per_pair = {k: [getattr(o, k).detach().double().cpu().numpy() for o in records]
                    for k in ("chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps")}
        return dpo_step_metrics([float(o.loss.detach()) for o in records], per_pair,
                                num_tokens=sum(pb.batch.num_tokens for pb in micro_batches),
                                num_label_tokens=sum(pb.batch.num_label_tokens for pb in micro_batches))


# --------------------------------------------------------------------------------------
# `twinseq train --backend torch`
# --------------------------------------------------------------------------------------


def _describe(cfg: TrainConfig, model: torch.nn.Module, device: torch.device, world_size: int = 1) -> str:
    d = cfg.data
    num_params = sum(p.numel() for p in model.parameters())
    params = f"{num_params / 1e6:.2f}M params"
    from twinseq.torch_backend.peft import is_adapter_model, is_quantized

    if is_adapter_model(model):
        p = cfg.peft
        trainable = sum(t.numel() for t in model.parameters() if t.requires_grad)
        kind = ("Q" if p.load_in_4bit else "") + ("DoRA" if p.use_dora else "LoRA") + (" rs" if p.use_rslora else "")
        params = (f"{kind} r={p.lora_r} alpha={p.lora_alpha} on {','.join(p.lora_target_modules)}"
                  f"{' + trainable tokens' if p.trainable_token_indices else ''}"
                  f"{' (NF4 base)' if is_quantized(model) else ''}: {trainable:,} trainable of {num_params:,} "
                  f"params ({100 * trainable / num_params:.2f}%)")
    effective = d.per_device_train_batch_size * world_size * d.gradient_accumulation_steps
    from twinseq.torch_backend.attention import twinseq_attn_name

    attn = twinseq_attn_name(model.config._attn_implementation)  # what runs (sdpa may have fallen back)
    return (f"twinseq torch {cfg.task}: {model.config.model_type} {cfg.model.model_config!r}, "
            f"{params} on {device}, attn={attn}, loss={cfg.loss.loss_type}, packing={d.packing}"
            f"({d.packing_strategy}), padding_free={d.padding_free}; effective batch = "
            f"{d.per_device_train_batch_size} per device x {world_size} devices x {d.gradient_accumulation_steps} "
            f"accumulation steps = {effective} {'packed rows' if d.packing else 'examples'} per optimizer step")


def _build_sft(cfg: TrainConfig, device: torch.device, runtime: Optional[Runtime]):
    from twinseq.common.loader import build_step_iterator

    dp, dp_rank = (1, 0) if runtime is None else (runtime.mesh_cfg.dp, runtime.dp_rank)
    with main_process_first(runtime):
        source, tokenizer, stats = build_step_iterator(cfg, world_size=dp, rank=dp_rank)
    causal_lm = build_causal_lm(cfg, tokenizer.vocab_size, device)
    if cfg.peft.use_peft:
        if runtime is not None and cfg.peft.load_in_4bit:
            raise ConfigError("load_in_4bit=True (QLoRA) runs in one process here: FSDP2 cannot shard "
                              "bitsandbytes' packed NF4 weights; drop --load-in-4bit (LoRA shards) or run one process.")
        causal_lm = add_peft(cfg, causal_lm)
    module = parallelize(causal_lm, runtime, cfg)
    announce = [_describe(cfg, module.causal_lm, device, dp), f"data: {stats}"]
    if runtime is not None:
        m = runtime.mesh_cfg
        announce.append(f"mesh: dp={m.dp} x cp={m.cp} on {m.world_size} ranks ({dist.get_backend()}), FSDP2 over "
                        f"dp x cp, cp strategy={cfg.parallel.context_parallel_strategy if m.cp > 1 else 'none'}")
    return SFTTrainer(cfg, module, device, runtime), source, tokenizer, announce


def _build_dpo(cfg: TrainConfig, device: torch.device, runtime: Optional[Runtime]):
    from twinseq.common.data import prepare_dpo_dataset
    from twinseq.common.dpo import validate_dpo_config
    from twinseq.common.dpo_loader import build_preference_iterator
    from twinseq.torch_backend.dpo import frozen_reference, precompute_ref_logps

    assert runtime is None, "check_runtime refuses a distributed DPO run"
    config = validate_dpo_config(cfg.dpo.dpo_loss_type, cfg.dpo.loss_weights, cfg.dpo.beta, cfg.dpo.label_smoothing)
    rows, tokenizer, stats = prepare_dpo_dataset(cfg)
    causal_lm = build_causal_lm(cfg, tokenizer.vocab_size, device)
    if cfg.peft.use_peft:
        if cfg.loss.loss_type == "liger":
            raise ConfigError("loss_type='liger' (or use_liger_kernel=True) for DPO needs a separate reference "
                              "model, and with use_peft=True the reference is the policy with its adapters "
                              "disabled; use --loss-type fused_linear with --use-peft.")
        causal_lm = add_peft(cfg, causal_lm)
        # The reference is the base: the policy with its adapters disabled, no second copy (as TRL does).
        ref_model = None
    else:
        # The reference is the *initial* policy, copied before any checkpoint is loaded.
        ref_model = frozen_reference(causal_lm)
    if cfg.dpo.precompute_ref_log_probs:
        from twinseq.torch_backend.peft import reference_mode

        t0 = time.perf_counter()
        with autocast(cfg, device), (reference_mode(causal_lm) if ref_model is None else contextlib.nullcontext()):
            rows = precompute_ref_logps(causal_lm if ref_model is None else ref_model, rows, cfg,
                                        tokenizer.pad_token_id)
        logger.info("precomputed reference log-probs of %d pairs in %.1fs; the reference model is freed", len(rows),
                    time.perf_counter() - t0)
        ref_model = None
    source = build_preference_iterator(cfg, rows, tokenizer.pad_token_id)
    module = parallelize(causal_lm, None, cfg)
    announce = [_describe(cfg, causal_lm, device),
                f"dpo_loss_type={list(config.loss_type)}, beta={config.beta}, reference="
                f"{'precomputed' if cfg.dpo.precompute_ref_log_probs else 'the base (adapters disabled)' if cfg.peft.use_peft else 'live copy'}, {source.examples_per_step} pairs per step; "
                f"data: {stats}"]
    trainer = DPOTrainer(cfg, module, device, ref_model=ref_model, config=config,
                         examples_per_step=source.examples_per_step)
    return trainer, source, tokenizer, announce


def train(config: TrainConfig) -> Path:
    """Run ``config.max_steps`` optimizer steps of ``config.task``; returns the path of ``metrics.jsonl``.

    One process, or every rank of a ``torchrun``/``accelerate launch`` (FSDP2, context parallelism).
    """
    cfg = config
    if cfg.parallel.deepspeed_zero_stage:  # DeepSpeed owns the process group, the model and the optimizer
        from twinseq.torch_backend.deepspeed import train_zero3

        return train_zero3(cfg)
    runtime = init_runtime(cfg) if wants_distributed(cfg) else None
    try:
        device = pick_device() if runtime is None else runtime.device
        if runtime is None:
            preflight(cfg, CapabilityRuntime("torch", device.type, 1, accelerator=device.type == "cuda"))
        torch.manual_seed(cfg.seed)
        build = _build_dpo if cfg.task == "dpo" else _build_sft
        if cfg.task == "grpo":
            from twinseq.torch_backend.grpo import build_grpo as build
        trainer, source, tokenizer, announce = build(cfg, device, runtime)
        plot_keys = ("loss", "rewards/accuracies", "tokens_per_second") if cfg.task == "dpo" else \
            ("loss", "tokens_per_second")
        if cfg.task == "grpo":
            plot_keys = ("loss", "reward", "completions/mean_length", "tokens_per_second")
        desc = f"{cfg.task}[torch{'' if runtime is None else '-fsdp2'}]"
        return run(cfg, trainer, source, tokenizer=tokenizer, desc=desc, announce=announce, plot_keys=plot_keys)
    finally:
        if runtime is not None and runtime.owns_group:
            dist.destroy_process_group()
