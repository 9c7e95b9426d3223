"""DeepSpeed ZeRO-3 for the torch backend: partitioned training and generation for online RL.

ZeRO-3 partitions every parameter, its gradient and its optimizer state over the ranks; a module's
parameters are all-gathered just before its forward (and backward) and released after. This module
wraps a plain twinseq model (``model.build_model`` / ``checkpoint.load_pretrained``, or the same
built here under ``deepspeed.zero.Init`` so no rank ever holds the full model) in a DeepSpeed engine
built from twinseq's own config, and steps it with twinseq's loss path.

What matches the plain torch trainer (``trainer.SFTTrainer``), and why:

- The loss. The engine runs ``losses.CausalLMLoss`` (body, lm_head and ``causal_lm_loss`` in one
  forward); each micro-batch loss is ``sum(NLL) / num_items_in_batch`` of the WHOLE step (every
  micro-batch, every rank), so the summed gradients equal one big batch's. DeepSpeed would divide
  twice more: by ``gradient_accumulation_steps`` in ``backward`` (we pass ``scale_wrt_gas=False``) and
  by the world size in its gradient reduce-scatter (we multiply the loss by the world size, exact
  for a power of two). The reduced gradient is then the plain SUM over ranks, as under FSDP2.
- The optimizer. A client ``torch.optim.AdamW`` (``foreach=False``, weight decay on matrices only) and
  the same ``LambdaLR`` schedule; DeepSpeed's FusedAdam/CPUAdam would compile C++ at run time.
- Clipping. DeepSpeed's ``gradient_clipping`` scales by ``max_norm / (norm + 1e-6)`` when above
  ``max_norm``, torch's rule; its norm is float32 (the plain trainer's is float64).
- Precision: float32 on CPU; ``dtype=bfloat16`` enables DeepSpeed's bf16 mode on CUDA only.

Generation (``generate``): ``gather_for_generation=True`` (TRL's ``ds3_gather_for_generation``)
gathers the full weights once per call and runs HF ``generate`` with the ZeRO-3 hooks lifted: fast,
but every rank holds a full copy for the call. ``False`` generates on the partitioned model: the
hooks gather layer by layer at every decoding step (slow, no full copy); ranks stay in lock-step
with ``synced_gpus`` because each forward is a collective.

>>> engine = build_zero3_engine(cfg, model_config=ModelConfig.preset("tiny"))   # doctest: +SKIP
>>> Zero3SFTTrainer(engine).step(iterator.next_step())["loss"]                    # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from typing import Any, Iterator, Mapping, Optional, Sequence, cast

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.initialization import no_init_weights

from twinseq.common.config import TrainConfig
from twinseq.common.data.sft_steps import build_step_iterator
from twinseq.common.errors import CheckpointError, ConfigError, MissingDependencyError
from twinseq.common.models.hf_folder import check_tokenizer_fits, resolve_model_source
from twinseq.common.models.init import check_weights, init_weights, parameter_shapes
from twinseq.common.models.safetensors_stream import LazyArray
from twinseq.common.run.inputs import NO_INPUTS, RunInputs
from twinseq.common.run.report import peak_rss_bytes
from twinseq.common.run.schedule import with_resolved_max_steps
from twinseq.common.run.trainer import TrainerTemplate
from twinseq.common.tasks import task_spec
from twinseq.torch_backend.checkpoint import (
    load_pretrained,
    rng_state,
    save_model_folder,
    set_rng_state,
    to_numpy_tree,
)
from twinseq.torch_backend.distributed import any_over_ranks, main_process_first, max_over_ranks
from twinseq.torch_backend.losses import CausalLMLoss
from twinseq.torch_backend.model import build_model, make_rope_stateless_, model_config_of, to_hf_model_config
from twinseq.torch_backend.trainer import autocast, build_optimizer, sft_summary
from twinseq.torch_backend.unwrap import lm_head_weight

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'twinseq[deepspeed]'"


# --------------------------------------------------------------------------------------
# Availability and the configurations it refuses
# --------------------------------------------------------------------------------------


def deepspeed_available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def require_deepspeed(what: str = "deepspeed_zero_stage=3") -> None:
    """Raise ``MissingDependencyError`` naming the extra when DeepSpeed is not installed."""
    if not deepspeed_available():
        raise MissingDependencyError(
            f"{what} needs DeepSpeed, which is not installed; {INSTALL_HINT} (pure Python "
            f"at install, CPU or CUDA), or set --deepspeed-zero-stage 0."
        )


def _import_deepspeed():
    """``import deepspeed`` on the accelerator this process has: DeepSpeed guesses CUDA unless told, and on a
    CPU-only machine its guess fails later, inside ``initialize``."""
    require_deepspeed()
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # optional dependency

    return deepspeed


def check_zero3_config(cfg: TrainConfig) -> None:
    """Refuse what ZeRO-3 here does not combine with, naming the flag to drop."""
    par = cfg.parallel
    if par.deepspeed_zero_stage != 3:
        raise ConfigError(
            f"deepspeed_zero_stage={par.deepspeed_zero_stage!r}: the DeepSpeed path runs ZeRO-3 "
            f"only; pass --deepspeed-zero-stage 3 (or 0 for the plain/FSDP2 trainer)."
        )
    if cfg.backend != "torch":
        raise ConfigError(
            "deepspeed_zero_stage=3 is a torch option; the jax backend shards over its device mesh. "
            "Drop --deepspeed-zero-stage or use --backend torch."
        )
    refusals = [
        (par.fsdp, "fsdp=True", "ZeRO-3 and FSDP2 both partition the parameters; pick one (drop --fsdp)"),
        (
            par.context_parallel_size > 1,
            f"context_parallel_size={par.context_parallel_size}",
            "context parallelism runs under FSDP2 only; use --context-parallel-size 1",
        ),
        (
            task_spec(cfg.task).one_process,
            f"task={cfg.task!r}",
            f"{cfg.task.upper()}'s frozen reference copy is not partitioned here; use --task sft",
        ),
        (
            cfg.task == "grpo" and cfg.grpo.grpo_beta > 0,
            f"grpo_beta={cfg.grpo.grpo_beta}",
            "the KL term's frozen reference copy is not partitioned here; use --grpo-beta 0 (TRL's default)",
        ),
        (
            cfg.task == "rloo" and cfg.rloo.rloo_beta > 0,
            f"rloo_beta={cfg.rloo.rloo_beta}",
            "the KL penalty's frozen reference copy is not partitioned here; use --rloo-beta 0",
        ),
        (
            cfg.task == "grpo" and cfg.loss.loss_type == "liger",
            "loss_type='liger' with task='grpo'",
            "Liger's fused GRPO loss reads the LM head outside the engine's forward; use --loss-type fused_linear",
        ),
        (cfg.peft.use_peft, "use_peft=True", "adapters are trained with FSDP2 or one process here; drop --use-peft"),
        (
            cfg.optim.optimizer != "adamw_torch",
            f"optimizer={cfg.optim.optimizer!r}",
            "ZeRO-3 partitions a client torch AdamW; use --optimizer adamw_torch",
        ),
        (
            cfg.memory.activation_offloading,
            "activation_offloading=True",
            "its saved-tensor hooks are not wired to ZeRO-3's parameter release; drop --activation-offloading",
        ),
        (cfg.memory.torch_compile, "torch_compile=True", "not wired with ZeRO-3's hooks; drop --torch-compile"),
        (
            cfg.model.dtype == "bfloat16" and not torch.cuda.is_available(),
            "dtype='bfloat16' on CPU",
            "DeepSpeed's bf16 mode needs CUDA; use --dtype float32 on CPU",
        ),
    ]
    for bad, what, fix in refusals:
        if bad:
            raise ConfigError(f"{what} does not combine with deepspeed_zero_stage=3: {fix}.")


# --------------------------------------------------------------------------------------
# The DeepSpeed config, from twinseq's
# --------------------------------------------------------------------------------------


def ds_config(cfg: TrainConfig, *, param_persistence_threshold: Optional[int] = None) -> dict:
    """DeepSpeed's config dict for ``cfg``: ZeRO stage 3, batch sizes, clipping, precision.

    ``param_persistence_threshold``: parameters of at most this many elements stay whole on every rank
    (DeepSpeed's ``stage3_param_persistence_threshold``; None keeps its default, 1e5). 0 partitions all.
    """
    # train_batch_size is left for DeepSpeed to derive (micro x accumulation x ranks): zero.Init reads this
    # config before DeepSpeed's own process group knows the world size, and would check it against 1
    d = cfg.data
    zero: dict[str, Any] = {"stage": 3}
    if param_persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = int(param_persistence_threshold)
    bf16 = cfg.model.dtype == "bfloat16" and torch.cuda.is_available()
    return {
        "train_micro_batch_size_per_gpu": d.per_device_train_batch_size,
        "gradient_accumulation_steps": d.gradient_accumulation_steps,
        "gradient_clipping": float(cfg.optim.max_grad_norm or 0.0),
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        # a client torch optimizer is what we want (DeepSpeed's own compile C++ at run time)
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _full_shape(param: torch.nn.Parameter) -> torch.Size:
    """The unpartitioned shape (a partitioned parameter's own ``.shape`` is an empty placeholder's)."""
    return getattr(param, "ds_shape", param.shape)


# --------------------------------------------------------------------------------------
# The model, partitioned from its construction on
# --------------------------------------------------------------------------------------


def ensure_process_group() -> None:
    """A process group for DeepSpeed: the launcher's (torchrun's environment), gloo on CPU, or a
    one-rank group when this is a plain single process (a world size of 1 is fine)."""
    for name, default in (("LOCAL_RANK", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        if name not in os.environ:  # DeepSpeed reads these itself (zero.Init: LOCAL_RANK), as torchrun sets them
            logger.info("%s is not set (no launcher): this process is rank 0 of 1", name)
            os.environ[name] = default
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)


def build_partitioned_model(
    model_cfg, weights: Mapping[str, np.ndarray], ds_cfg: dict, *, attn_implementation: str = "sdpa"
) -> torch.nn.Module:
    """The HF model of ``model_cfg`` built under ``deepspeed.zero.Init``: each parameter is partitioned as
    it is created, then ``weights`` (HF names, the same on every rank, e.g. ``init_weights(cfg, seed)``)
    are written one tensor at a time (gathered, written on rank 0, re-partitioned).

    The same model as ``model.build_model(model_cfg, weights)``, without a full copy per rank.
    """
    deepspeed = _import_deepspeed()
    ensure_process_group()
    check_weights(model_cfg, weights)
    config = to_hf_model_config(model_cfg, attn_implementation)
    # ``zero.Init`` replaces ``torch.Tensor.__new__`` while it is active. torch._dynamo, imported lazily the first
    # time something asks ``is_compiling()`` (transformers does, inside ``from_config``), registers a polyfill for
    # ``torch.Tensor.__new__`` at import and checks the signature of what it finds there: DeepSpeed's replacement
    # then fails that check ("Signature mismatch ... new_tensor ... tensor_pynew"), and the run dies. Import it
    # first, so the polyfill is registered against torch's own function; whether anything imported it earlier (a
    # test suite did, so its tests passed while a fresh `twinseq train` crashed) no longer matters.
    importlib.import_module("torch._dynamo")  # not `import torch._dynamo`: that would make `torch` a local name here

    # No ``dtype=`` here: DeepSpeed 0.19's ``zero.Init`` honours an explicit dtype only where the accelerator
    # reports float16 support, and otherwise builds bfloat16 partitions (an operator-precedence slip in
    # ``Init._set_dtype``); the CPU accelerator on a CPU without AVX512-FP16 (AMD Zen 4) then trained a
    # "float32" run in bfloat16. Left to the config, it takes bf16 / fp16 / float32 from ``ds_cfg`` as meant.
    with deepspeed.zero.Init(config_dict_or_path=ds_cfg), no_init_weights():
        model = AutoModelForCausalLM.from_config(config)
    expected = torch.bfloat16 if ds_cfg.get("bf16", {}).get("enabled") else torch.float32
    wrong = sorted({str(p.dtype) for p in model.parameters() if p.dtype != expected})
    if wrong:
        raise RuntimeError(
            f"deepspeed.zero.Init built parameters of dtype {', '.join(wrong)}, not {expected} as "
            f"the DeepSpeed config asks (bf16.enabled={bool(ds_cfg.get('bf16', {}).get('enabled'))}); "
            "this DeepSpeed version does not honour the config's precision: install the "
            "version pinned by twinseq's 'deepspeed' extra"
        )
    model.tie_weights()
    make_rope_stateless_(model)
    params = dict(model.named_parameters())
    for name in parameter_shapes(model_cfg):
        param = params[name]
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            if dist.get_rank() == 0:
                param.copy_(torch.as_tensor(np.asarray(weights[name]), dtype=param.dtype))
    return model.train()


# --------------------------------------------------------------------------------------
# The engine: one optimizer step, and generation
# --------------------------------------------------------------------------------------


class Zero3Engine:
    """A DeepSpeed ZeRO-3 engine around ``losses.CausalLMLoss(causal_lm)``: its micro-step (forward and the
    backward of a loss normalised by the whole step), generation, and the full weights. ``Zero3Hooks`` runs it
    through ``common.run.trainer.TrainerTemplate``'s step."""

    def __init__(self, engine: Any, scheduler: Any, cfg: TrainConfig) -> None:
        self.engine, self.scheduler, self.cfg = engine, scheduler, cfg
        self.world_size = dist.get_world_size()
        self.device = engine.device if isinstance(engine.device, torch.device) else torch.device(engine.device)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def causal_lm(self) -> torch.nn.Module:
        return self.engine.module.causal_lm

    @property
    def is_main(self) -> bool:
        return dist.get_rank() == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a loss already normalised by the whole step (any task's: SFT here, an RL loss
        elsewhere), so that the reduced gradient is the sum over ranks and micro-batches."""
        # undo DeepSpeed's mean over ranks (see the module docstring); not its mean over micro-batches either
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def micro_step(self, micro: Any) -> dict[str, float]:
        with autocast(self.cfg, self.device):
            loss, metrics = self.engine(micro)
        self.backward(loss)
        return {"loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}}

    def full_weights(self) -> dict[str, np.ndarray]:
        """Every parameter, unpartitioned, float32 numpy, HF names (a collective: every rank calls it)."""
        deepspeed = _import_deepspeed()
        named = list(self.causal_lm.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
            return {name: p.detach().float().cpu().numpy().copy() for name, p in named}

    def generate(
        self, prompts: Sequence[Sequence[int]], *, gather_for_generation: bool = True, **kwargs: Any
    ) -> list[list[int]]:
        """``generate(self.causal_lm, ...)`` on this engine (every rank calls it, each with its own prompts)."""
        offload = getattr(self.engine.optimizer, "parameter_offload", None)
        return generate(
            self.causal_lm, prompts, gather_for_generation=gather_for_generation, parameter_offload=offload, **kwargs
        )


def build_zero3_engine(
    cfg: TrainConfig,
    *,
    model_config=None,
    weights: Optional[Mapping[str, np.ndarray]] = None,
    model: Optional[torch.nn.Module] = None,
    zero_init: bool = True,
    param_persistence_threshold: Optional[int] = None,
) -> Zero3Engine:
    """A ``Zero3Engine`` for ``cfg`` (``deepspeed_zero_stage=3``), on every rank of the launch.

    The model is either ``model`` (a plain twinseq model, whole on each rank, partitioned by
    ``deepspeed.initialize``), or built here from ``model_config`` (a ``ModelConfig``) and ``weights``
    (default ``init_weights(model_config, seed=cfg.seed)``) under ``zero.Init`` (``zero_init=True``) or whole.
    """
    check_zero3_config(cfg)
    deepspeed = _import_deepspeed()
    ensure_process_group()
    conf = ds_config(cfg, param_persistence_threshold=param_persistence_threshold)
    if model is None:
        if model_config is None:
            raise ConfigError(
                "build_zero3_engine got model=None and model_config=None; pass model= (a built twinseq model) or "
                "model_config= (a ModelConfig to build under zero.Init)."
            )
        weights = init_weights(model_config, seed=cfg.seed) if weights is None else weights
        if zero_init:
            model = build_partitioned_model(
                model_config, weights, conf, attn_implementation=cfg.model.attn_implementation
            )
        else:
            model = build_model(model_config, dict(weights), attn_implementation=cfg.model.attn_implementation)
    module = CausalLMLoss(model, cfg)
    optimizer, scheduler = build_optimizer(module, cfg, ndim=lambda p: len(_full_shape(p)), allow_fused=False)
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=optimizer, lr_scheduler=scheduler, config=conf, dist_init_required=False
    )
    # The loss multiplies by the lm_head weight outside lm_head's own forward: DeepSpeed must gather it
    # around the whole root forward and backward (with tied embeddings it is the embedding's weight).
    deepspeed.zero.register_external_parameter(engine.module, lm_head_weight(model))
    return Zero3Engine(engine, scheduler, cfg)


# --------------------------------------------------------------------------------------
# Generation (online RL): left-padded prompts, HF generate, gathered or layer by layer
# --------------------------------------------------------------------------------------


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids_BT`` and ``attention_mask_BT`` with the padding on the left, so every prompt ends at
    column T-1 and the first new token of every row is written at column T.

    >>> ids, mask = left_pad([[5, 6, 7], [8]], pad_token_id=0)
    >>> ids.tolist(), mask.tolist()
    ([[5, 6, 7], [0, 0, 8]], [[1, 1, 1], [0, 0, 1]])
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError(
            f"prompts must be a non-empty list of non-empty token lists, got lengths {[len(p) for p in prompts][:8]}; "
            "drop empty prompts or prepend a BOS token."
        )
    T = max(len(p) for p in prompts)
    ids_BT = torch.full((len(prompts), T), pad_token_id, dtype=torch.long)
    mask_BT = torch.zeros((len(prompts), T), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids_BT[row, T - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask_BT[row, T - len(prompt) :] = 1
    return ids_BT, mask_BT


def _is_partitioned(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


@contextlib.contextmanager
def gathered_for_generation(model: torch.nn.Module, parameter_offload: Any = None) -> Iterator[torch.nn.Module]:
    """All of ``model``'s ZeRO-3 parameters gathered (read-only) for the block, and the engine's
    per-module hooks lifted, so no forward inside re-partitions them; both restored after."""
    deepspeed = _import_deepspeed()
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        if parameter_offload is not None:
            parameter_offload._remove_module_hooks()
        try:
            yield model
        finally:
            if parameter_offload is not None:
                parameter_offload.setup_zero_stage3_hooks()


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    gather_for_generation: bool = True,
    max_new_tokens: int = 16,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    pad_token_id: int = 0,
    eos_token_id: Optional[int] = None,
    seed: Optional[int] = None,
    parameter_offload: Any = None,
) -> list[list[int]]:
    """Completions (new token ids, up to ``max_new_tokens``, cut after ``eos_token_id``) of ``prompts``.

    HF ``generate`` on left-padded prompts, greedy (``do_sample=False``) or sampled (``temperature``,
    ``top_k``, ``top_p``; ``seed`` seeds torch's generator first). A ZeRO-3 model is run gathered
    (``gather_for_generation=True``: one all-gather per call, the engine's hooks lifted through
    ``parameter_offload``) or partitioned (False: layer by layer, every rank in lock-step through
    ``synced_gpus``, so every rank must call this). A plain model runs as it is.
    """
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 1; pass max_completion_length >= 1.")
    if do_sample and temperature <= 0:
        raise ConfigError(f"temperature={temperature} must be > 0 when sampling; use do_sample=False for greedy.")
    device = next(model.parameters()).device
    ids_BT, mask_BT = left_pad(prompts, pad_token_id)
    partitioned = _is_partitioned(model)
    if partitioned and gather_for_generation and parameter_offload is None:
        logger.warning(
            "gather_for_generation=True on a ZeRO-3 model without its engine's parameter_offload: "
            "the per-module hooks stay on (slower); pass Zero3Engine.generate instead"
        )
    gen_cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        use_cache=True,
        **({"temperature": temperature, "top_k": top_k, "top_p": top_p} if do_sample else {}),
    )
    synced = partitioned and not gather_for_generation and dist.is_initialized() and dist.get_world_size() > 1
    context = (
        gathered_for_generation(model, parameter_offload)
        if partitioned and gather_for_generation
        else contextlib.nullcontext(model)
    )
    was_training = model.training
    model.eval()
    try:
        if seed is not None:
            torch.manual_seed(seed)
        with context:
            out_BS = cast(Any, model).generate(
                input_ids=ids_BT.to(device),
                attention_mask=mask_BT.to(device),
                generation_config=gen_cfg,
                synced_gpus=synced,
            )
    finally:
        model.train(was_training)
    return [_cut(row[ids_BT.shape[1] :].tolist(), eos_token_id, pad_token_id) for row in out_BS.cpu()]


def _cut(tokens: list[int], eos_token_id: Optional[int], pad_token_id: int) -> list[int]:
    """The completion up to and including the first EOS (HF pads finished rows after it)."""
    if eos_token_id is not None and eos_token_id in tokens:
        return tokens[: tokens.index(eos_token_id) + 1]
    return tokens


# --------------------------------------------------------------------------------------
# `twinseq train --deepspeed-zero-stage 3` (under torchrun; one process works too)
# --------------------------------------------------------------------------------------


class Zero3Hooks(TrainerTemplate):
    """``common.run.trainer.TrainerTemplate``'s backend hooks over a ``Zero3Engine``: DeepSpeed steps the optimizer and
    the schedule at the accumulation boundary, inside the micro-steps (``update_in_micro_steps``: a non-finite
    step stops the run; ``train_zero3`` refuses ``skip_nonfinite_steps``); the gradient norm is DeepSpeed's.
    The state is the full (unpartitioned) state as numpy + JSON, read and written one parameter at a time with
    DeepSpeed's ``safe_get/set_full_*`` (collectives: every rank calls them); the export, a Hugging Face folder.
    A task adds ``micro_step`` and ``summarize`` (``Zero3SFTTrainer``, ``zero3_grpo.Zero3GRPOTrainer``)."""

    update_in_micro_steps = True
    engine: Zero3Engine

    @property
    def is_main(self) -> bool:
        return self.engine.is_main

    def check_micro_batches(self, micro_batches: Sequence[Any]) -> None:
        steps = self.engine.engine.gradient_accumulation_steps()
        if len(micro_batches) != steps:
            raise ConfigError(
                f"this rank's step has {len(micro_batches)} micro-batches, but DeepSpeed steps after "
                f"gradient_accumulation_steps={steps}; pass {steps} micro-batches per step."
            )

    # -- the step's backend hooks ----------------------------------------------------------

    def current_lr(self) -> float:
        return self.engine.scheduler.get_last_lr()[0]

    def accumulate(self, out: Any) -> Any:
        self.engine.engine.step()  # the optimizer (and the schedule) steps at the accumulation boundary
        return out

    def gradient_norm(self) -> Optional[float]:
        norm = self.engine.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def apply_update(self, grad_norm: Optional[float]) -> Optional[float]:
        return grad_norm  # applied by DeepSpeed at the accumulation boundary

    def discard_gradients(self) -> None:
        pass  # DeepSpeed zeroes its partitioned gradients after its step

    def any_rank(self, flag: bool) -> bool:
        return any_over_ranks(flag, self.engine.device)

    # -- state and export --------------------------------------------------------------------

    def trained_model(self) -> torch.nn.Module:
        """The ZeRO-3 partitioned ``transformers`` model (gather a parameter with ``deepspeed.zero.GatheredParameters``
        to read it)."""
        return self.engine.causal_lm

    def _named(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self.engine.causal_lm.named_parameters())  # a tied weight once, under its first name

    def _adam_step(self) -> float:
        inner = self.engine.engine.optimizer.optimizer  # the client AdamW over DeepSpeed's flat partitions
        steps = [float(s["step"]) for s in inner.state.values() if "step" in s]
        return steps[0] if steps else 0.0

    def _set_adam_step(self, step: float) -> None:
        """Write Adam's step count, creating its (zero) state where no step has run yet: torch's AdamW builds
        its state lazily at the first step, and DeepSpeed can only write moments into an existing state."""
        zero3 = self.engine.engine.optimizer
        for flat in zero3.fp32_partitioned_groups_flat:  # the tensors AdamW steps: one per partition sub-group
            state = zero3.optimizer.state[flat]
            state.setdefault("exp_avg", torch.zeros_like(flat))
            state.setdefault("exp_avg_sq", torch.zeros_like(flat))
            state["step"] = torch.tensor(step, dtype=torch.float32)

    def state_dict(self) -> dict[str, Any]:
        """The same tree on every rank, streamed: each ``LazyArray`` gathers one parameter's (or moment's) fp32
        partitions when the checkpoint writer reaches it (a collective), so a save holds one full tensor."""
        deepspeed = _import_deepspeed()

        def lazy(param: torch.nn.Parameter, moment: Optional[str] = None) -> LazyArray:
            def produce() -> np.ndarray:
                if moment is None:
                    return deepspeed.utils.safe_get_full_fp32_param(param).cpu().numpy()
                return deepspeed.utils.safe_get_full_optimizer_state(param, moment).cpu().numpy()

            return LazyArray(tuple(cast(Any, param).ds_shape), "float32", produce)

        named = self._named()
        return {
            "model": {name: lazy(param) for name, param in named},
            "optimizer": {
                "state": {name: {k: lazy(param, k) for k in ("exp_avg", "exp_avg_sq")} for name, param in named},
                "step": self._adam_step(),
            },
            "scheduler": to_numpy_tree(self.engine.scheduler.state_dict()),
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        deepspeed = _import_deepspeed()
        named = self._named()
        missing = sorted({n for n, _ in named} - set(state["model"]))
        if missing or "state" not in state["optimizer"]:
            raise CheckpointError(
                f"the checkpoint does not hold this model's full state (missing {missing[:2]}, or "
                f"an optimizer state of another trainer); resume a deepspeed_zero_stage=3 run from "
                f"its own checkpoint."
            )
        self._set_adam_step(float(state["optimizer"]["step"]))
        for name, param in named:
            value = torch.as_tensor(np.asarray(state["model"][name]))
            deepspeed.utils.safe_set_full_fp32_param(param, value)  # the optimizer's fp32 partition
            # ... and the parameter the forward reads (its own partition, refreshed only by an optimizer step)
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
                if dist.get_rank() == 0:
                    param.copy_(value.to(param.dtype))
            for key, value in state["optimizer"]["state"][name].items():
                deepspeed.utils.safe_set_full_optimizer_state(param, torch.as_tensor(np.asarray(value)), key)
        scheduler = self.engine.scheduler
        scheduler.load_state_dict(state["scheduler"])
        # LambdaLR's state holds the last rates, but the optimizer reads its groups' (torch's optimizer
        # load_state_dict restores those; the moments here are loaded one parameter at a time instead)
        for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
        set_rng_state(state["rng"])

    def save_final(self, path) -> None:
        """The HF model folder in float32, streamed: one parameter gathered at a time (every rank takes part)."""
        model_cfg = model_config_of(self.engine.causal_lm)
        lazy = self.state_dict()["model"]
        weights = {k: lazy[k] for k in parameter_shapes(model_cfg)}
        if self.is_main:
            save_model_folder(self.engine.causal_lm, path, weights)
        else:
            for tensor in weights.values():  # this rank's part of each gather
                tensor.produce()
        dist.barrier()

    def peak_memory_bytes(self) -> int:
        device = self.engine.device
        peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else peak_rss_bytes()
        return max_over_ranks(peak, device)


class Zero3SFTTrainer(Zero3Hooks):
    """SFT under ZeRO-3: this rank's micro-batches (``common.data.sft_steps.StepIterator(..., world_size, rank)``),
    losses normalised by the step's label count; the step's metrics summed over ranks (the step's mean token loss)."""

    def __init__(self, engine: Zero3Engine) -> None:
        self.engine, self.cfg, self.device = engine, engine.cfg, engine.device

    def prepare(self, micro_batches: list[Any]) -> list[Any]:
        self.check_micro_batches(micro_batches)
        return micro_batches

    def micro_step(self, micro: Any) -> dict[str, float]:
        return self.engine.micro_step(micro)

    def summarize(self, records: list[dict[str, float]], micro_batches: list[Any]) -> dict[str, Any]:
        return sft_summary(records, micro_batches, self.device, distributed=True)


def zero3_engine_for(cfg: TrainConfig, vocab_size: int) -> Zero3Engine:
    """The engine of ``cfg.model``: a model folder loaded whole on each rank and partitioned by
    ``deepspeed.initialize``, or a preset built under ``zero.Init``."""
    spec = resolve_model_source(cfg.model.model_config, cfg.model.init_weights)
    check_tokenizer_fits(spec.config, vocab_size, cfg.model.model_config)
    model = None
    if spec.weights_folder is not None:
        model = load_pretrained(spec.weights_folder, dtype="float32", attn_implementation=cfg.model.attn_implementation)
    return build_zero3_engine(cfg, model_config=spec.config, model=model)


def refuse_built_model(inputs: RunInputs) -> None:
    """ZeRO-3 builds the model partitioned (``zero.Init``); a model a Python caller built is whole already."""
    if inputs.model is not None:
        raise ConfigError(
            f"model={type(inputs.model).__name__} (a built model) cannot train under deepspeed_zero_stage=3, which "
            f'builds the model partitioned across ranks; pass the model\'s folder (model="path/to/model") instead.'
        )


def build_zero3_sft(cfg: TrainConfig, inputs: RunInputs = NO_INPUTS):
    """(trainer, step source, tokenizer, announce lines) of SFT under ZeRO-3, on every rank of the launch (the
    process group is up: ``recipes.train_zero3``)."""
    refuse_built_model(inputs)
    world, rank = dist.get_world_size(), dist.get_rank()
    with main_process_first():
        source, tokenizer, stats = build_step_iterator(
            cfg, world_size=world, rank=rank, dataset=inputs.train_dataset, tokenizer=inputs.tokenizer
        )
    cfg = with_resolved_max_steps(cfg, source)  # max_steps=-1: num_train_epochs passes over the source
    engine = zero3_engine_for(cfg, tokenizer.vocab_size)
    d = cfg.data
    announce = [
        f"twinseq torch sft: DeepSpeed ZeRO-3 over {world} rank(s) ({dist.get_backend()}), "
        f"{cfg.model.model_config!r}; effective batch = {d.per_device_train_batch_size} per device x "
        f"{world} x {d.gradient_accumulation_steps} accumulation steps",
        f"data: {stats}",
    ]
    return Zero3SFTTrainer(engine), source, tokenizer, announce
