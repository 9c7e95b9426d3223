"""The torch trainers: the torch hooks of ``common.run.trainer.TrainerTemplate`` (``TorchTrainer``), and SFT's and DPO's
micro-steps on them, in one process or under FSDP2 + context parallelism.

``recipes.train(cfg)`` calls ``build_sft``/``build_dpo`` (data, the plain model, ``parallel.parallelize``) and
hands the trainer to ``common.run.runner.run``, which owns the loop (timing, logging, checkpoints, resume, the final
save). ``TrainerTemplate.step`` owns the step: ``gradient_accumulation_steps`` micro-batches, each loss already
normalised by the label count (SFT) or pair count (DPO) of the whole step, so the summed gradients equal one big
batch's; clipping (norm in float64), AdamW, the schedule. ``TorchTrainer`` adds the state (weights, optimizer,
scheduler and RNG as numpy + JSON; the full, unsharded state, gathered on rank 0 under FSDP2) and the export.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from twinseq.common.config import TrainConfig
from twinseq.common.data.preference_steps import build_preference_iterator
from twinseq.common.data.prepare import prepare_dpo_dataset
from twinseq.common.data.sft_steps import build_step_iterator
from twinseq.common.errors import CheckpointError, ConfigError
from twinseq.common.models.hf_folder import check_tokenizer_fits, resolve_model_source
from twinseq.common.models.init import check_weights, init_weights, parameter_shapes
from twinseq.common.models.peft import base_dtype
from twinseq.common.objectives.dpo import validate_dpo_config
from twinseq.common.objectives.moe import COUNTS_KEY, moe_layers
from twinseq.common.run.inputs import NO_INPUTS, RunInputs
from twinseq.common.run.report import peak_rss_bytes
from twinseq.common.run.schedule import lr_multiplier, with_resolved_max_steps
from twinseq.common.run.step_metrics import ADDITIVE, dpo_step_metrics, sft_step_sums, with_means
from twinseq.common.run.trainer import (
    TrainerTemplate,
    describe_run,
    peft_summary,
    reference_description,
    save_adapter_folder,
)
from twinseq.torch_backend.attention import twinseq_attn_name
from twinseq.torch_backend.bf16_adamw import AdamWBF16
from twinseq.torch_backend.checkpoint import (
    adopt_model,
    from_numpy_tree,
    load_pretrained,
    rng_state,
    save_model_folder,
    save_pretrained,
    set_rng_state,
    to_numpy_tree,
)
from twinseq.torch_backend.distributed import (
    Runtime,
    any_over_ranks,
    lazy_model_state,
    lazy_optimizer_state,
    load_full_model_state,
    load_full_optimizer_state,
    main_process_first,
    max_over_ranks,
    micro_batch_context,
    prepare_micro_batches,
    reduce_step_metrics,
)
from twinseq.torch_backend.dpo import (
    CPPreferenceShard,
    cp_sequence_logps,
    dpo_forward,
    dpo_from_logps,
    frozen_reference,
    liger_dpo_forward,
    precompute_ref_logps,
    preference_shard,
    reference_logps,
)
from twinseq.torch_backend.generation import eval_mode, generate
from twinseq.torch_backend.in_backward import StepInBackward
from twinseq.torch_backend.memory import apply_long_context, offload_activations
from twinseq.torch_backend.model import build_model, cast_parameters_, model_config_of
from twinseq.torch_backend.parallel import parallelize, use_cp_attention
from twinseq.torch_backend.peft import (
    add_adapters_seeded,
    is_quantized,
    peft_config_of,
    reference_mode,
    require_bitsandbytes,
)
from twinseq.torch_backend.unwrap import is_adapter_model, saved_key

logger = logging.getLogger(__name__)

_PREFIX = "causal_lm."  # the plain model's parameter names inside parallelize's CausalLMLoss


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def build_causal_lm(
    cfg: TrainConfig, vocab_size: int, device: torch.device, model: Optional[torch.nn.Module] = None
) -> torch.nn.Module:
    """The plain HF model of ``cfg.model.model_config`` (a local folder, or a preset with ``common``'s
    initial weights), or the built ``model`` a Python caller passed (``checkpoint.adopt_model``), on ``device``,
    in train mode."""
    spec, attn = cfg.model.model_config, cfg.model.attn_implementation
    if model is not None:
        model = adopt_model(model, attn_implementation=attn)
        check_tokenizer_fits(model_config_of(model), vocab_size, "model")
    else:
        source = resolve_model_source(spec, cfg.model.init_weights)
        check_tokenizer_fits(source.config, vocab_size, spec)
        if source.weights_folder is not None:
            model = load_pretrained(source.weights_folder, dtype="float32", attn_implementation=attn)
        else:
            model = build_model(source.config, init_weights(source.config, seed=cfg.seed), attn_implementation=attn)
    if cfg.optim.optimizer in BF16_STATE:
        check_bf16_state(cfg)
        cast_parameters_(model, "bfloat16")  # the weights the run trains are bfloat16 (AdamWBF16)
    return model.to(device).train()


BF16_STATE = ("adamw_bf16", "adamw_bf16_8bit")
"""The optimizers that train bfloat16 weights (``AdamWBF16``)."""


def check_bf16_state(cfg: TrainConfig) -> None:
    """``optimizer='adamw_bf16'``/``'adamw_bf16_8bit'`` train every weight in bfloat16, in one process: refused with
    adapters (their state is small; the base is already bfloat16 under ``--dtype bfloat16``) and under a launch
    (FSDP2 keeps float32 shards)."""
    name = cfg.optim.optimizer
    if cfg.peft.use_peft:
        raise ConfigError(
            f"optimizer={name!r} trains full bfloat16 weights, but use_peft=True trains float32 adapters over a "
            f"frozen base; drop --use-peft (full fine-tune) or use --optimizer adamw_torch with adapters."
        )
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigError(
            f"optimizer={name!r} runs in one process today; this launch has {dist.get_world_size()} ranks: "
            f"run one process, or use --optimizer adamw_torch under FSDP2."
        )


def add_peft(cfg: TrainConfig, causal_lm: torch.nn.Module) -> torch.nn.Module:
    """The plain model with ``cfg.peft``'s adapters (``peft.add_adapters``, drawn with ``cfg.seed``), its frozen base
    first cast to ``common.models.peft.base_dtype`` (bfloat16 under ``--dtype bfloat16``; the adapters float32)."""
    dtype = base_dtype(cfg.peft, cfg.model.dtype)
    if dtype != "float32":
        cast_parameters_(causal_lm, dtype)
    return add_adapters_seeded(causal_lm, model_config_of(causal_lm), cfg.peft, seed=cfg.seed)


def build_optimizer(
    model: torch.nn.Module,
    cfg: TrainConfig,
    ndim: Callable[[torch.nn.Parameter], int] = lambda p: p.ndim,
    allow_fused: bool = True,
):
    """AdamW over the parameters that train (all, or the adapters only); weight decay on matrices only (norm
    scales are not decayed), as HF Trainer does. ``optimizer='adamw_bnb_8bit'``: bitsandbytes' ``AdamW8bit``;
    ``'adamw_bf16'``: ``AdamWBF16`` (bfloat16 weights and moments, stochastic rounding); ``'adamw_bf16_8bit'``: the
    same with 8-bit moments; ``optimizer_in_backward``: ``AdamWBF16``, stepped per parameter. torch's AdamW runs its
    fused CUDA kernel on a GPU (one launch per group chunk) and the per-parameter loop elsewhere (foreach would hold
    a second copy of every gradient).
    ``ndim``: a parameter's rank (ZeRO-3 reads it from the full shape: its own is a placeholder's); ``allow_fused``:
    False keeps the per-parameter loop on a GPU too (DeepSpeed steps its own partitions)."""
    opt = cfg.optim
    decay = [p for p in model.parameters() if p.requires_grad and ndim(p) >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and ndim(p) < 2]
    groups = [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if opt.optimizer == "adamw_bnb_8bit":
        require_bitsandbytes("optimizer='adamw_bnb_8bit'")
        import bitsandbytes as bnb  # optional dependency

        optimizer = bnb.optim.AdamW8bit(
            groups, lr=cfg.effective_learning_rate, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_epsilon
        )
    elif opt.optimizer in BF16_STATE or opt.optimizer_in_backward:
        # optimizer_in_backward steps one parameter at a time: AdamWBF16 (on float32 weights torch's AdamW exactly)
        optimizer = AdamWBF16(
            groups,
            lr=cfg.effective_learning_rate,
            betas=(opt.adam_beta1, opt.adam_beta2),
            eps=opt.adam_epsilon,
            eight_bit=opt.optimizer == "adamw_bf16_8bit",
        )
    else:
        on_cuda = allow_fused and all(p.is_cuda and not isinstance(p, DTensor) for p in decay + no_decay)
        optimizer = torch.optim.AdamW(
            groups,
            lr=cfg.effective_learning_rate,
            betas=(opt.adam_beta1, opt.adam_beta2),
            eps=opt.adam_epsilon,
            foreach=False,
            fused=on_cuda or None,
        )
    warmup, total, kind = cfg.effective_warmup_steps, cfg.max_steps, opt.lr_scheduler_type
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: lr_multiplier(k, warmup_steps=warmup, max_steps=total, scheduler=kind)
    )
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
    return offload_activations(model, loss_type=cfg.loss.loss_type)


class TorchTrainer(TrainerTemplate):
    """The torch hooks of ``common.run.trainer.TrainerTemplate``: gradients accumulate in ``.grad``, the norm is
    clipped in float64 (``clip_grad_norm_fp64_``), AdamW and the schedule step; plus the state (the full,
    unsharded state, gathered on rank 0 under FSDP2) and the export. A task adds ``micro_step`` and
    ``summarize``."""

    def __init__(
        self, cfg: TrainConfig, module: torch.nn.Module, device: torch.device, runtime: Optional[Runtime] = None
    ) -> None:
        self.cfg, self.module, self.device, self.runtime = cfg, module, device, runtime
        self.causal_lm: torch.nn.Module = cast(torch.nn.Module, module.causal_lm)
        self.optimizer, self.scheduler = build_optimizer(module, cfg)
        self.in_backward = (
            StepInBackward(module, cast(AdamWBF16, self.optimizer)) if cfg.optim.optimizer_in_backward else None
        )
        self.update_in_micro_steps = self.in_backward is not None
        self.ref_model: Optional[torch.nn.Module] = None  # DPO, KTO, GRPO: the live reference copy, if any

    @property
    def is_main(self) -> bool:
        return self.runtime is None or self.runtime.is_main

    # -- the step's backend hooks ----------------------------------------------------------

    def current_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def gradient_norm(self) -> Optional[float]:
        if self.in_backward is not None:
            return self.in_backward.take_norm()  # the parameters stepped in backward (no clipping: checked)
        max_norm = self.cfg.optim.max_grad_norm
        if max_norm is not None:
            return float(clip_grad_norm_fp64_(self.module.parameters(), max_norm))
        return float(grad_norm_fp64([p for p in self.module.parameters() if p.grad is not None]))

    def apply_update(self, grad_norm: Optional[float]) -> Optional[float]:
        if self.in_backward is None:
            self.optimizer.step()
            self.scheduler.step()
            return grad_norm
        with warnings.catch_warnings():  # the parameters stepped in backward: torch's "step before optimizer.step()"
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
            self.scheduler.step()
        return grad_norm

    @torch.no_grad()
    def mix_reference(self, alpha: float) -> None:
        if self.ref_model is None:
            return super().mix_reference(alpha)
        policy = dict(self.causal_lm.named_parameters())
        for name, ref in self.ref_model.named_parameters():
            p = policy[name]
            full = p.full_tensor() if isinstance(p, DTensor) else p  # FSDP2: every rank gathers, in the same order
            ref.mul_(1.0 - alpha).add_(full.detach().to(ref.dtype), alpha=alpha)

    def _synced_reference(self) -> Optional[torch.nn.Module]:
        """The reference copy when it moves (``sync_ref_model``): then a checkpoint holds it."""
        return self.ref_model if self.cfg.reference.sync_ref_model else None

    def discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def any_rank(self, flag: bool) -> bool:
        return flag if self.runtime is None else any_over_ranks(flag, self.device)

    # -- evaluation's backend hooks ------------------------------------------------------------

    def reduce_sums(self, sums: dict[str, float]) -> dict[str, float]:
        if self.runtime is None:
            return sums
        assert set(sums) <= set(ADDITIVE), f"reduce_step_metrics sums {ADDITIVE} only, got {sorted(sums)}"
        return reduce_step_metrics(sums, self.device)

    def data_parallel(self) -> tuple[int, int]:
        return (1, 0) if self.runtime is None else (self.runtime.mesh_cfg.dp, self.runtime.dp_rank)

    def eval_generate(
        self, prompt_ids: list[list[int]], *, max_new_tokens: int, eos_token_id: Optional[int], pad_token_id: int
    ) -> Any:
        """HF ``generate`` (greedy, KV cache) run inside the root module's forward, so that FSDP2 gathers the root
        parameters around it; every rank steps until all are done (``synced_gpus``)."""

        def greedy(causal_lm: torch.nn.Module) -> Any:
            with autocast(self.cfg, self.device):
                return generate(
                    causal_lm,
                    prompt_ids,
                    max_completion_length=max_new_tokens,
                    eos_token_id=eos_token_id,
                    pad_token_id=pad_token_id,
                    greedy=True,
                    synced_gpus=self.runtime is not None,
                ).completion_ids

        try:
            return self.module(greedy)
        finally:
            self.reshard()

    def reshard(self) -> None:
        """Free FSDP2's gathered root parameters after a forward without backward (an evaluation): the root keeps
        them gathered for the backward that would follow, and the optimizer and the state hold the shards."""
        if isinstance(self.module, FSDPModule):
            self.module.reshard()

    # -- state and export --------------------------------------------------------------------

    def trained_model(self) -> torch.nn.Module:
        """The ``transformers`` model (a ``PeftModel`` under PEFT; FSDP2's sharded module under a launch)."""
        return self.causal_lm

    @property
    def is_peft(self) -> bool:
        return is_adapter_model(self.causal_lm)

    def _weight_names(self) -> list[str]:
        """The parameters a checkpoint holds: every weight (HF names), or the adapters only (PeftModel names)."""
        if self.is_peft:
            return [name for name, p in self.causal_lm.named_parameters() if p.requires_grad]
        return list(parameter_shapes(model_config_of(self.causal_lm)))

    def state_dict(self) -> dict[str, Any]:
        """Streamed (``LazyArray`` leaves, each gathered under FSDP2 when the checkpoint writer reaches it), the
        same tree on every rank; the weights and optimizer state in float32, as a resume loads them."""
        state = {
            "model": lazy_model_state(self.module, self._weight_names(), _PREFIX, float32=True),
            "optimizer": lazy_optimizer_state(self.module, self.optimizer),
            "scheduler": to_numpy_tree(self.scheduler.state_dict()),
            "rng": rng_state(),
        }
        ref = self._synced_reference()
        if ref is not None:
            state["reference"] = lazy_model_state(ref, [n for n, _ in ref.named_parameters()], float32=True)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.is_peft or any("lora_" in k or "trainable_tokens" in k for k in state["model"]):
            expected, got = set(self._weight_names()), set(state["model"])
            if expected != got:
                raise CheckpointError(
                    f"the checkpoint holds {'adapter' if any('lora_' in k for k in got) else 'full-model'} weights "
                    f"that do not fit this {'PEFT' if self.is_peft else 'full fine-tuning'} run (missing "
                    f"{sorted(expected - got)[:2]}, unexpected {sorted(got - expected)[:2]}); resume with the "
                    f"peft settings (use_peft, lora_r, lora_target_modules, ...) the checkpoint was written with."
                )
        else:
            try:
                check_weights(model_config_of(self.causal_lm), state["model"])
            except ValueError as err:
                raise CheckpointError(f"the checkpoint's weights do not fit this model: {err}") from None
        load_full_model_state(self.module, state["model"], _PREFIX)
        ref = self._synced_reference()
        if ref is not None and "reference" in state:  # none: written before the first synchronisation
            load_full_model_state(ref, state["reference"])
        load_full_optimizer_state(self.module, self.optimizer, from_numpy_tree(state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])

    def save_final(self, path: Path) -> None:
        """An HF model folder, or with PEFT the adapter folder (``common.run.trainer.save_adapter_folder``), streamed:
        one tensor in memory at a time (under FSDP2 each is gathered in turn, so every rank takes part)."""
        if self.is_peft:
            lazy = lazy_model_state(self.module, self._weight_names(), _PREFIX, float32=True)
            adapters = {saved_key(k): v.produce() for k, v in lazy.items()}  # small: the adapters only
            if self.is_main:
                model_cfg = model_config_of(self.causal_lm)
                save_adapter_folder(
                    path,
                    self.cfg,
                    model_cfg,
                    peft_config_of(self.causal_lm),
                    adapters,
                    lambda base: save_pretrained(
                        build_model(model_cfg, init_weights(model_cfg, seed=self.cfg.seed)), base
                    ),
                )
        else:
            weights = lazy_model_state(self.module, self._weight_names(), _PREFIX)
            if self.is_main:
                save_model_folder(self.causal_lm, path, weights)
            else:
                for tensor in weights.values():  # this rank's part of each gather
                    tensor.produce()
        if self.runtime is not None:
            dist.barrier()

    def peak_memory_bytes(self) -> int:
        peak = int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda" else peak_rss_bytes()
        return peak if self.runtime is None else max_over_ranks(peak, self.device)


def sft_summary(
    records: list[dict[str, Any]],
    micro_batches: list[Any],
    device: torch.device,
    distributed: bool,
    layers: Optional[list[int]] = None,
) -> dict[str, Any]:
    """An SFT step's metrics from its micro-batches' sums, all-reduced over the ranks when ``distributed`` (a MoE
    model's ``router_counts`` too: every rank routes its own tokens; ``layers`` name their rows, ``moe_layers``)."""
    sums = sft_step_sums(records, num_tokens=sum(mb.num_tokens for mb in micro_batches))
    if distributed:
        sums = reduce_step_metrics(sums, device)
        if COUNTS_KEY in sums:
            counts = torch.as_tensor(sums[COUNTS_KEY], dtype=torch.int64, device=device)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            sums[COUNTS_KEY] = counts.cpu().numpy()
    return with_means(sums, layers)


def _host_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """A micro-step's metric tensors on the host: scalars as floats, a MoE model's ``router_counts`` as int64
    numpy [L, E]."""
    return {k: v.cpu().numpy() if k == COUNTS_KEY else float(v) for k, v in metrics.items()}


class SFTTrainer(TorchTrainer):
    """Next-token loss of ``parallelize``'s ``CausalLMLoss``: on this rank's ``Batch``, ``CPShard`` or ring batch."""

    def prepare(self, micro_batches: list[Any]) -> list[Any]:
        return micro_batches if self.runtime is None else prepare_micro_batches(micro_batches, self.cfg, self.runtime)

    def micro_step(self, micro: Any) -> dict[str, float]:
        with micro_batch_context(micro, self.runtime) as inputs:
            with offload_context(self.cfg, self.causal_lm):
                with autocast(self.cfg, self.device):
                    loss, metrics = self.module(inputs, router_stats=True)
                loss.backward()
        return {"loss": float(loss.detach()), **_host_metrics(metrics)}

    def summarize(self, records: list[dict[str, Any]], micro_batches: list[Any]) -> dict[str, Any]:
        layers = moe_layers(model_config_of(self.causal_lm)) if any(COUNTS_KEY in r for r in records) else None
        return sft_summary(records, micro_batches, self.device, self.runtime is not None, layers)

    @torch.no_grad()
    def eval_micro_step(self, micro: Any) -> dict[str, float]:
        (prepared,) = self.prepare([micro])
        with eval_mode(self.causal_lm), micro_batch_context(prepared, self.runtime) as inputs:
            with autocast(self.cfg, self.device):
                loss, metrics = self.module(inputs)
        self.reshard()
        return {"loss": float(loss), **{k: float(v) for k, v in metrics.items()}}


class DPOTrainer(TorchTrainer):
    """DPO of the policy (``module.causal_lm``) against a frozen reference copy, or precomputed log-probs; in one
    process, or under FSDP2 + context parallelism (``runtime`` with ``cp > 1``: ``cp_micro_step``)."""

    def __init__(
        self,
        cfg: TrainConfig,
        module: torch.nn.Module,
        device: torch.device,
        *,
        ref_model,
        config,
        examples_per_step: int,
        runtime: Optional[Runtime] = None,
    ) -> None:
        super().__init__(cfg, module, device, runtime)
        self.ref_model, self.config, self.examples_per_step = ref_model, config, examples_per_step
        # PEFT: the reference is the policy with its adapters disabled (TRL's way), unless precomputed
        self.adapter_reference = self.is_peft and ref_model is None and not cfg.dpo.precompute_ref_log_probs

    def micro_losses(self, records: list[Any]) -> list[float]:
        return [float(o.loss.detach()) for o in records]

    @property
    def cp(self) -> int:
        return 1 if self.runtime is None else self.runtime.mesh_cfg.cp

    def _cp_logps(self, causal_lm: torch.nn.Module, micro: CPPreferenceShard) -> torch.Tensor:
        assert self.runtime is not None
        return cp_sequence_logps(
            causal_lm,
            micro,
            self.runtime.cp_group,
            self.cfg.parallel.context_parallel_strategy,
            loss_type=self.cfg.loss.loss_type,
            chunk_size=self.cfg.loss.loss_chunk_size,
        )

    def cp_micro_step(self, pbatch: Any):
        """``micro_step`` under context parallelism: this rank's shard of ``pbatch`` through the policy (inside the
        FSDP2 root's forward, which gathers the embeddings and the lm_head) and the live reference, the [2N]
        sequence log-probs summed over the cp ranks, then the DPO loss of the whole micro-batch (the same on every
        cp rank; its backward gives this rank's share of the gradient, ``dpo.cp_sequence_logps``)."""
        assert self.runtime is not None
        c = self.cfg
        micro = preference_shard(pbatch, self.cp, self.runtime.cp_rank, self.device)
        ref_c = ref_r = None
        if self.ref_model is not None or self.adapter_reference:
            with torch.no_grad(), autocast(c, self.device):
                if self.ref_model is not None:
                    ref_D = self._cp_logps(self.ref_model, micro)
                else:
                    with reference_mode(self.causal_lm):
                        ref_D = self.module(lambda lm: self._cp_logps(lm, micro))
            ref_c, ref_r = ref_D[: pbatch.num_examples], ref_D[pbatch.num_examples :]
        with offload_context(c, self.causal_lm):
            with autocast(c, self.device):
                logps_D = self.module(lambda lm: self._cp_logps(lm, micro))
                out = dpo_from_logps(
                    logps_D,
                    pbatch,
                    self.config,
                    ref_chosen_logps=ref_c,
                    ref_rejected_logps=ref_r,
                    num_examples_in_step=pbatch.num_examples_in_step or self.examples_per_step,
                )
            out.loss.backward()
        return out

    def micro_step(self, pbatch: Any):
        if self.cp > 1:
            return self.cp_micro_step(pbatch)
        c, loss = self.cfg, self.cfg.loss
        pairs_in_step = pbatch.num_examples_in_step or self.examples_per_step  # an epoch's last step may be short
        # the live reference: a frozen copy (Liger's kernel runs it itself), or the policy with its adapters off
        ref_c = ref_r = None
        reference: Optional[torch.nn.Module] = None
        context: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self.ref_model is not None and loss.loss_type != "liger":
            reference = self.ref_model
        elif self.adapter_reference:
            reference, context = self.causal_lm, reference_mode(self.causal_lm)
        if reference is not None:
            with autocast(c, self.device), context:
                ref_c, ref_r = reference_logps(
                    reference,
                    pbatch,
                    loss_type=loss.loss_type,
                    chunk_size=loss.loss_chunk_size,
                    attn_implementation=c.model.attn_implementation,
                )
        with offload_context(c, self.causal_lm):
            with autocast(c, self.device):
                if loss.loss_type == "liger":
                    assert self.ref_model is not None, "build_dpo refuses liger without a reference copy"
                    out = liger_dpo_forward(
                        self.causal_lm,
                        self.ref_model,
                        pbatch,
                        self.config,
                        pairs_in_step,
                        chunk_size=loss.loss_chunk_size,
                        attn_implementation=c.model.attn_implementation,
                    )
                else:
                    out = dpo_forward(
                        self.causal_lm,
                        pbatch,
                        self.config,
                        ref_chosen_logps=ref_c,
                        ref_rejected_logps=ref_r,
                        loss_type=loss.loss_type,
                        chunk_size=loss.loss_chunk_size,
                        num_examples_in_step=pairs_in_step,
                        attn_implementation=c.model.attn_implementation,
                    )
            out.loss.backward()
        return out

    @torch.no_grad()
    def eval_micro_step(self, pbatch: Any) -> dict[str, Any]:
        c = self.cfg
        kw: dict[str, Any] = dict(
            loss_type=c.loss.loss_type,
            chunk_size=c.loss.loss_chunk_size,
            attn_implementation=c.model.attn_implementation,
        )
        out: dict[str, Any] = {}
        with eval_mode(self.causal_lm), autocast(c, self.device):
            out["chosen_logps"], out["rejected_logps"] = reference_logps(self.causal_lm, pbatch, **kw)
            if self.ref_model is not None:
                out["ref_chosen_logps"], out["ref_rejected_logps"] = reference_logps(self.ref_model, pbatch, **kw)
            elif self.adapter_reference:
                with reference_mode(self.causal_lm):
                    out["ref_chosen_logps"], out["ref_rejected_logps"] = reference_logps(self.causal_lm, pbatch, **kw)
        return {k: v.double().cpu().numpy() for k, v in out.items()}

    def summarize(self, records: list[Any], micro_batches: list[Any]) -> dict[str, Any]:
        per_pair = {
            k: [getattr(o, k).detach().double().cpu().numpy() for o in records]
            for k in ("chosen_rewards", "rejected_rewards", "chosen_logps", "rejected_logps")
        }
        return dpo_step_metrics(
            [float(o.loss.detach()) for o in records],
            per_pair,
            num_tokens=sum(pb.batch.num_tokens for pb in micro_batches),
            num_label_tokens=sum(pb.batch.num_label_tokens for pb in micro_batches),
        )


# --------------------------------------------------------------------------------------
# `twinseq train --backend torch`
# --------------------------------------------------------------------------------------


def describe(cfg: TrainConfig, model: torch.nn.Module, device: Any, world_size: int = 1) -> str:
    """``common.run.trainer.describe_run`` of a torch model: its parameters (or adapters), the attention that runs."""
    num_params = sum(p.numel() for p in model.parameters())
    params = f"{num_params / 1e6:.2f}M params"
    if is_adapter_model(model):
        params = peft_summary(
            cfg.peft,
            trainable=sum(t.numel() for t in model.parameters() if t.requires_grad),
            total=num_params,
            quantized=is_quantized(model),
        )
    hf_config: Any = model.config
    attn = twinseq_attn_name(hf_config._attn_implementation)  # what runs (sdpa may have fallen back)
    return describe_run(
        cfg,
        backend="torch",
        model_type=hf_config.model_type,
        params=params,
        where=str(device),
        details=[f"attn={attn}"],
        world_size=world_size,
    )


def build_sft(cfg: TrainConfig, device: torch.device, runtime: Optional[Runtime], inputs: RunInputs = NO_INPUTS):
    """(trainer, step source, tokenizer, announce lines) of an SFT run, one process or FSDP2 (+ CP)."""
    dp, dp_rank = (1, 0) if runtime is None else (runtime.mesh_cfg.dp, runtime.dp_rank)
    with main_process_first():
        source, tokenizer, stats = build_step_iterator(
            cfg, world_size=dp, rank=dp_rank, dataset=inputs.train_dataset, tokenizer=inputs.tokenizer
        )
    cfg = with_resolved_max_steps(cfg, source)  # max_steps=-1: num_train_epochs passes over the source
    causal_lm = build_causal_lm(cfg, tokenizer.vocab_size, device, inputs.model)
    if cfg.peft.use_peft:
        if runtime is not None and cfg.peft.load_in_4bit:
            raise ConfigError(
                "load_in_4bit=True (QLoRA) runs in one process here: FSDP2 cannot shard "
                "bitsandbytes' packed NF4 weights; drop --load-in-4bit (LoRA shards) or run one process."
            )
        causal_lm = add_peft(cfg, causal_lm)
    module = parallelize(causal_lm, runtime, cfg)
    announce = [describe(cfg, module.causal_lm, device, dp), f"data: {stats}"]
    if runtime is not None:
        m = runtime.mesh_cfg
        announce.append(
            f"mesh: dp={m.dp} x cp={m.cp} on {m.world_size} ranks ({dist.get_backend()}), FSDP2 over "
            f"dp x cp, cp strategy={cfg.parallel.context_parallel_strategy if m.cp > 1 else 'none'}"
        )
    return SFTTrainer(cfg, module, device, runtime), source, tokenizer, announce


def cp_reference(ref_model: torch.nn.Module, cfg: TrainConfig, runtime: Runtime) -> torch.nn.Module:
    """The frozen reference copy under context parallelism: the same cp attention and block size as the policy
    (``parallel.parallelize`` steps 1 and 2), unsharded on every rank (it holds no gradient nor optimizer state)."""
    use_cp_attention(ref_model, cfg.parallel.context_parallel_strategy)
    apply_long_context(ref_model, cfg.memory)
    return ref_model.to(runtime.device)


def build_dpo(cfg: TrainConfig, device: torch.device, runtime: Optional[Runtime], inputs: RunInputs = NO_INPUTS):
    """(trainer, step source, tokenizer, announce lines) of a DPO run: one process, or FSDP2 + context parallelism
    over exactly ``cp`` ranks (``common.run.capabilities`` refuses the rest)."""
    assert runtime is None or runtime.mesh_cfg.dp == 1, "check_runtime refuses data-parallel DPO"
    config = validate_dpo_config(
        cfg.dpo.dpo_loss_type, cfg.dpo.loss_weights, cfg.dpo.beta, cfg.dpo.label_smoothing, cfg.dpo.discopop_tau
    )
    with main_process_first():
        rows, tokenizer, stats = prepare_dpo_dataset(cfg, inputs.train_dataset, inputs.tokenizer)
    causal_lm = build_causal_lm(cfg, tokenizer.vocab_size, device, inputs.model)
    if cfg.peft.use_peft:
        if cfg.loss.loss_type == "liger":
            raise ConfigError(
                "loss_type='liger' (or use_liger_kernel=True) for DPO needs a separate reference "
                "model, and with use_peft=True the reference is the policy with its adapters "
                "disabled; use --loss-type fused_linear with --use-peft."
            )
        causal_lm = add_peft(cfg, causal_lm)
        # The reference is the base: the policy with its adapters disabled, no second copy (as TRL does).
        ref_model = None
    else:
        # The reference is the *initial* policy, copied before any checkpoint is loaded.
        ref_model = frozen_reference(causal_lm)
        if runtime is not None:
            ref_model = cp_reference(ref_model, cfg, runtime)
    if cfg.dpo.precompute_ref_log_probs:
        t0 = time.perf_counter()
        with autocast(cfg, device), reference_mode(causal_lm) if ref_model is None else contextlib.nullcontext():
            rows = precompute_ref_logps(
                causal_lm if ref_model is None else ref_model, rows, cfg, tokenizer.pad_token_id
            )
        logger.info(
            "precomputed reference log-probs of %d pairs in %.1fs; the reference model is freed",
            len(rows),
            time.perf_counter() - t0,
        )
        ref_model = None
    source = build_preference_iterator(cfg, rows, tokenizer.pad_token_id)
    cfg = with_resolved_max_steps(cfg, source)  # max_steps=-1: num_train_epochs passes over the source
    module = parallelize(causal_lm, runtime, cfg)
    announce = [
        describe(cfg, module.causal_lm, device),
        f"dpo_loss_type={list(config.loss_type)}, beta={config.beta}, reference="
        f"{reference_description(cfg, precomputed=cfg.dpo.precompute_ref_log_probs)}, "
        f"{source.examples_per_step} pairs per step; data: {stats}",
    ]
    if runtime is not None:
        m = runtime.mesh_cfg
        announce.append(
            f"mesh: dp={m.dp} x cp={m.cp} on {m.world_size} ranks ({dist.get_backend()}), FSDP2 over dp x cp, "
            f"cp strategy={cfg.parallel.context_parallel_strategy if m.cp > 1 else 'none'}; every cp rank scores "
            f"T/cp tokens of each pair, the sequence log-probs summed over the cp group"
        )
    trainer = DPOTrainer(
        cfg,
        module,
        device,
        ref_model=ref_model,
        config=config,
        examples_per_step=source.examples_per_step,
        runtime=runtime,
    )
    return trainer, source, tokenizer, announce
