"""What each backend can run where: the one place that refuses an option this machine cannot honour.

``TrainConfig`` checks what is wrong on any machine; ``check_runtime`` checks what a backend
cannot do on the machine at hand (a CUDA kernel without CUDA, offloading without an accelerator,
context parallelism over more ranks than exist). Both backends call it once, before any data or
model is built, with the facts of their runtime, so the same bad input gets the same answer on
both. Nothing here imports a framework: the backend passes its device type and counts in.

>>> cfg = TrainConfig.from_flat(loss_type="liger")
>>> try:
...     check_runtime(cfg, Runtime(backend="jax", device_type="cpu"))
... except ConfigError as err:
...     print(str(err)[:58])
loss_type='liger' (or use_liger_kernel=True) is Liger's CU
"""

from __future__ import annotations

import importlib.util
import logging
import math
from dataclasses import dataclass

from twinseq.common.config import TrainConfig
from twinseq.common.errors import ConfigError, MissingDependencyError
from twinseq.common.models.configs import resolve_model_config
from twinseq.common.tasks import task_spec

logger = logging.getLogger(__name__)

GPU_EXTRA = "pip install -e '.[gpu]'"
_FLASH_MODULES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


@dataclass(frozen=True)
class Capabilities:
    """What a backend can run, as data: the checks below read these fields, never a backend's name."""

    name: str
    loss_kernels: frozenset[str]
    """``loss_type`` values it runs (``liger`` and ``triton`` are torch kernels)."""
    options: frozenset[str]
    """Framework-specific switches it honours: ``torch_compile``, ``fsdp``, ``deepspeed_zero_stage``,
    ``optimizer_in_backward``."""
    world_unit: str
    """What ``world_size`` counts: ``processes`` (one per rank) or ``visible devices`` (one process, a mesh)."""
    launch_hint: str
    """How a user gets ``{cp}`` of them."""
    multi_process: bool
    """A world of more than one means a multi-process launch (FSDP2 ranks)."""
    checks_attention_packages: bool
    """It imports the flash-attention packages (so their absence is refused here)."""
    own_masked_attention: bool
    """It runs its own document-masked attention for every ``attn_implementation`` (logged, not refused)."""
    ring_attention_rules: bool
    """Its ``ring`` context parallelism is torch's ring attention (CUDA SDPA, a causal mask only)."""
    context_parallel_strategies: frozenset[str]
    """``context_parallel_strategy`` values it runs (``ulysses`` is torch's)."""


BACKEND_CAPABILITIES = {
    "torch": Capabilities(
        "torch",
        frozenset({"nll", "chunked", "fused_linear", "liger", "triton"}),
        frozenset({"torch_compile", "fsdp", "deepspeed_zero_stage", "optimizer_in_backward"}),
        "processes",
        "launch {cp} or more processes (torchrun --nproc-per-node {cp})",
        multi_process=True,
        checks_attention_packages=True,
        own_masked_attention=False,
        ring_attention_rules=True,
        context_parallel_strategies=frozenset({"allgather", "ring", "ulysses"}),
    ),
    "jax": Capabilities(
        "jax",
        frozenset({"nll", "chunked", "fused_linear"}),
        frozenset(),
        "visible devices",
        "expose more devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={cp})",
        multi_process=False,
        checks_attention_packages=False,
        own_masked_attention=True,
        ring_attention_rules=False,
        context_parallel_strategies=frozenset({"allgather", "ring"}),
    ),
}
"""Each backend's capabilities, keyed by its ``--backend`` name."""


@dataclass(frozen=True)
class Runtime:
    """The facts a backend knows about where it runs."""

    backend: str  # "torch" or "jax"
    device_type: str  # "cpu", "cuda", "gpu", "tpu"
    world_size: int = 1  # torch: processes; jax: visible devices
    accelerator: bool = False  # device memory distinct from host memory (offloading has a meaning)

    @property
    def caps(self) -> Capabilities:
        return BACKEND_CAPABILITIES[self.backend]


def _has_package(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_runtime(cfg: TrainConfig, rt: Runtime) -> None:
    """Raise ``ConfigError`` (or ``MissingDependencyError``) for an option ``rt`` cannot honour."""
    _check_loss_kernel(cfg, rt)
    _check_memory(cfg, rt)
    _check_attention(cfg, rt)
    _check_parallel(cfg, rt)
    _check_optimizer_in_backward(cfg, rt)
    spec = task_spec(cfg.task)
    if spec.one_process:
        _check_one_process(cfg, rt)
    if spec.online and cfg.parallel.context_parallel_size > 1:
        (_check_torch_grpo_context_parallel if rt.backend == "torch" else _check_jax_grpo_context_parallel)(cfg, rt)


def _check_loss_kernel(cfg: TrainConfig, rt: Runtime) -> None:
    kernel = cfg.loss.loss_type
    if kernel == "triton" and kernel not in rt.caps.loss_kernels:
        raise ConfigError(
            f"loss_type='triton' is twinseq's Triton kernel for the torch backend; on the {rt.backend} "
            f"backend use --loss-type fused_linear (the same loss, never materialising the logits)."
        )
    if kernel != "liger":
        return
    if kernel not in rt.caps.loss_kernels or rt.device_type != "cuda":
        where = f"the {rt.backend} backend" if kernel not in rt.caps.loss_kernels else f"a {rt.device_type!r} device"
        raise ConfigError(
            f"loss_type='liger' (or use_liger_kernel=True) is Liger's CUDA kernel for the torch "
            f"backend, and this run is on {where}; use --loss-type fused_linear, which never "
            f"materialises the logits either."
        )
    if not _has_package("liger_kernel"):
        raise MissingDependencyError(
            f"loss_type='liger' needs the liger-kernel package; install the gpu extra "
            f"with `{GPU_EXTRA}`, or use --loss-type fused_linear."
        )


def _check_memory(cfg: TrainConfig, rt: Runtime) -> None:
    mem = cfg.memory
    if mem.activation_offloading and not rt.accelerator:
        raise ConfigError(
            "activation_offloading=True moves activations from accelerator to host memory and has no "
            "meaning on a CPU-only run; drop --activation-offloading or run on a GPU. "
            "--gradient-checkpointing saves activation memory on CPU."
        )
    if mem.torch_compile and "torch_compile" not in rt.caps.options:
        raise ConfigError(
            f"torch_compile=True is a torch option; the {rt.backend} backend compiles its own way "
            f"(jax.jit). Drop --torch-compile."
        )
    if mem.activation_offloading and rt.caps.multi_process and _distributed(cfg, rt):
        raise ConfigError(
            "activation_offloading=True is not supported with FSDP2/context parallelism yet; drop "
            "--activation-offloading or train in one process."
        )


def _check_attention(cfg: TrainConfig, rt: Runtime) -> None:
    """The same device rules on both backends; the JAX backend then runs its own masked attention."""
    attn = cfg.model.attn_implementation
    if attn in _FLASH_MODULES:
        what = "packed/padding-free batches" if cfg.data.packing or cfg.data.padding_free else "this run"
        if rt.device_type not in ("cuda", "gpu"):
            raise ConfigError(
                f"attn_implementation={attn!r} needs a CUDA device (got {rt.device_type!r}); refusing "
                f"{what} rather than attending across documents. Use attn_implementation='varlen' "
                f"(padding-free, document-masked) or 'sdpa'."
            )
        if rt.caps.checks_attention_packages and not _has_package(_FLASH_MODULES[attn]):
            raise ConfigError(
                f"attn_implementation={attn!r} needs the {_FLASH_MODULES[attn]!r} package, which is not "
                f"installed; refusing {what} rather than attending across documents. Install it with "
                f"`{GPU_EXTRA}` or use attn_implementation='varlen'."
            )
    if attn == "flex_attention" and rt.device_type == "cpu":
        raise ConfigError(
            "attn_implementation='flex_attention' cannot train on CPU: torch has no FlexAttention "
            "backward on CPU. Use 'varlen' or 'sdpa' on CPU, or flex_attention on CUDA."
        )
    if rt.caps.own_masked_attention and attn not in ("sdpa", "eager"):
        logger.info(
            "attn_implementation=%r: the %s backend runs its masked attention (segment ids, float32 "
            "softmax) for every setting",
            attn,
            rt.backend,
        )


def _distributed(cfg: TrainConfig, rt: Runtime) -> bool:
    return rt.world_size > 1 and rt.caps.multi_process or cfg.parallel.fsdp or cfg.parallel.context_parallel_size > 1


def _check_parallel(cfg: TrainConfig, rt: Runtime) -> None:
    par, data = cfg.parallel, cfg.data
    cp, units = par.context_parallel_size, rt.caps.world_unit
    if par.fsdp and "fsdp" not in rt.caps.options:
        raise ConfigError(
            f"fsdp=True is a torch option (FSDP2); the {rt.backend} backend shards over its device mesh. Drop --fsdp."
        )
    if par.deepspeed_zero_stage and "deepspeed_zero_stage" not in rt.caps.options:
        raise ConfigError(
            f"deepspeed_zero_stage={par.deepspeed_zero_stage} is a torch option (DeepSpeed); the "
            f"{rt.backend} backend shards over its device mesh. Drop --deepspeed-zero-stage."
        )
    if cp == 1:
        return
    _check_strategy(cfg, rt)
    if cp > rt.world_size:
        launch = rt.caps.launch_hint.format(cp=cp)
        raise ConfigError(
            f"context_parallel_size={cp} is larger than the {rt.world_size} {units}; {launch} or lower "
            f"--context-parallel-size."
        )
    if rt.world_size % cp:
        divisors = [d for d in range(1, rt.world_size + 1) if rt.world_size % d == 0]
        raise ConfigError(
            f"context_parallel_size={cp} does not divide the {rt.world_size} {units}: the mesh is "
            f"data x cp over all of them. Use context_parallel_size in {divisors}."
        )
    multiple = 2 * cp
    if data.pad_to_multiple_of is not None and data.pad_to_multiple_of % multiple:
        raise ConfigError(
            f"context_parallel_size={cp} splits every row into 2 * cp = {multiple} load-balanced "
            f"chunks, but pad_to_multiple_of={data.pad_to_multiple_of} is not a multiple of {multiple}; "
            f"use --pad-to-multiple-of {math.lcm(data.pad_to_multiple_of, multiple)}, or leave it unset."
        )
    if par.context_parallel_strategy == "ring" and rt.caps.ring_attention_rules:
        _check_torch_ring(cfg, rt)


def _check_strategy(cfg: TrainConfig, rt: Runtime) -> None:
    """What holds on any machine: the backend runs the strategy, and Ulysses can split the model's heads."""
    cp, strategy = cfg.parallel.context_parallel_size, cfg.parallel.context_parallel_strategy
    if strategy not in rt.caps.context_parallel_strategies:
        raise ConfigError(
            f"context_parallel_strategy={strategy!r} is not implemented by the {rt.backend} backend; use "
            f"--context-parallel-strategy in {sorted(rt.caps.context_parallel_strategies)}, or --backend torch."
        )
    if strategy != "ulysses":
        return
    check_ulysses_heads(resolve_model_config(cfg.model.model_config).num_attention_heads, cp)


def check_ulysses_heads(num_heads: int, cp: int) -> None:
    """``ConfigError`` unless the query heads split evenly over the ``cp`` ranks of a Ulysses all-to-all (checked
    here before any work, and by the torch attention on the model it runs)."""
    if num_heads % cp:
        sizes = [d for d in range(2, num_heads + 1) if num_heads % d == 0]
        raise ConfigError(
            f"context_parallel_strategy='ulysses' gives each of the context_parallel_size={cp} ranks "
            f"num_attention_heads / {cp} heads, but num_attention_heads={num_heads} is not a multiple of {cp}; "
            f"use --context-parallel-size in {sizes}, or --context-parallel-strategy allgather (any head count)."
        )


def _check_torch_ring(cfg: TrainConfig, rt: Runtime) -> None:
    if rt.device_type != "cuda":
        raise ConfigError(
            f"context_parallel_strategy='ring' uses torch's ring attention, which needs CUDA SDPA "
            f"(flash or efficient kernels); this run is on {rt.device_type!r}. Use "
            f"--context-parallel-strategy allgather, which runs on CPU/gloo too."
        )
    if cfg.data.packing or cfg.data.padding_free:
        raise ConfigError(
            f"context_parallel_strategy='ring' cannot mask packed documents (packing={cfg.data.packing}, "
            f"padding_free={cfg.data.padding_free}): torch's ring attention only knows a causal mask "
            f"and would attend across documents. Use --context-parallel-strategy allgather, or train "
            f"unpacked."
        )
    if cfg.data.padding_side != "right":
        raise ConfigError(
            "context_parallel_strategy='ring' needs --padding-side right (a causal mask lets real "
            "tokens see left padding); or use --context-parallel-strategy allgather."
        )


def _check_one_process(cfg: TrainConfig, rt: Runtime) -> None:
    """A ``TaskSpec.one_process`` task (DPO, KTO): no ``torch_compile``, no FSDP or multi-process launch (DPO's
    context parallelism excepted)."""
    if cfg.memory.torch_compile:
        raise ConfigError(f"torch_compile=True is not supported with task={cfg.task!r} yet; drop --torch-compile.")
    if cfg.task == "dpo" and cfg.parallel.context_parallel_size > 1:
        (_check_torch_dpo_context_parallel if rt.backend == "torch" else _check_jax_dpo_context_parallel)(cfg, rt)
        return
    if _distributed(cfg, rt):
        raise ConfigError(
            f"task={cfg.task!r} runs in one process on one device: FSDP, context parallelism and multi-process "
            f"launches are not implemented for {cfg.task.upper()}; drop --fsdp / --context-parallel-size and "
            f"launch with python."
        )


def _check_torch_dpo_context_parallel(cfg: TrainConfig, rt: Runtime) -> None:
    """DPO under context parallelism on torch: FSDP2 over exactly ``context_parallel_size`` ranks (no data
    parallelism), the ``allgather`` or ``ulysses`` strategy, a live reference (a frozen copy, or the adapters off);
    raises what it cannot run (``_check_parallel`` has already checked the world size and the padding)."""
    cp, par = cfg.parallel.context_parallel_size, cfg.parallel
    refusals = [
        (
            rt.world_size != cp,
            f"context_parallel_size={cp} with task='dpo' runs on exactly {cp} ranks (one cp group); this launch "
            f"has world_size={rt.world_size}, and DPO has no data parallelism yet. Launch {cp} processes "
            f"(torchrun --nproc-per-node {cp}).",
        ),
        (
            par.context_parallel_strategy == "ring",
            "context_parallel_strategy='ring' is not implemented for task='dpo' (torch's ring attention shards "
            "the batch itself, not the preference targets); use --context-parallel-strategy allgather or ulysses.",
        ),
        (
            cfg.loss.loss_type == "liger",
            "loss_type='liger' (or use_liger_kernel=True) for DPO scores whole rows, not a context-parallel "
            "shard; use --loss-type fused_linear with --context-parallel-size.",
        ),
        (
            cfg.dpo.precompute_ref_log_probs,
            "precompute_ref_log_probs=True is not implemented with context_parallel_size > 1 for task='dpo'; drop "
            "--precompute-ref-log-probs (the live reference runs through the same sharded forward).",
        ),
        (
            cfg.peft.load_in_4bit,
            "load_in_4bit=True (QLoRA) runs in one process: FSDP2 cannot shard bitsandbytes' packed NF4 weights; "
            "drop --load-in-4bit (LoRA shards) or drop --context-parallel-size.",
        ),
        (
            cfg.eval_strategy != "no",
            f"eval_strategy={cfg.eval_strategy!r} is not implemented with context_parallel_size > 1 for "
            f"task='dpo'; use --eval-strategy no, or evaluate the saved model in one process.",
        ),
        (
            cfg.optim.optimizer_in_backward,
            "optimizer_in_backward=True is not implemented with context_parallel_size > 1 for task='dpo'; drop "
            "--optimizer-in-backward.",
        ),
    ]
    for refused, message in refusals:
        if refused:
            raise ConfigError(message)


def _check_jax_dpo_context_parallel(cfg: TrainConfig, rt: Runtime) -> None:
    """DPO under context parallelism on jax: a (data=1, cp) mesh over every visible device (``jax_backend.dpo``);
    a data axis (cp below the device count) is not implemented for DPO (raises)."""
    cp = cfg.parallel.context_parallel_size
    if cp != rt.world_size:
        raise ConfigError(
            f"context_parallel_size={cp} with task={cfg.task!r} on {rt.world_size} {rt.caps.world_unit} would "
            f"leave a data-parallel axis of {rt.world_size // max(cp, 1)}, which is not implemented for DPO on "
            f"jax (its mesh is data=1 x cp); use --context-parallel-size {rt.world_size}, or expose {cp} devices "
            f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={cp})."
        )


def _check_torch_grpo_context_parallel(cfg: TrainConfig, rt: Runtime) -> None:
    """GRPO (and RLOO) under context parallelism on torch: FSDP2 over exactly ``context_parallel_size`` ranks (no
    data parallelism), the ``allgather`` or ``ulysses`` strategy, HF generation on every rank; raises what it cannot
    run (``_check_parallel`` has already checked the world size and the padding, ``_check_optimizer_in_backward``
    the per-parameter step)."""
    cp, par, task = cfg.parallel.context_parallel_size, cfg.parallel, cfg.task
    refusals = [
        (
            rt.world_size != cp,
            f"context_parallel_size={cp} with task={task!r} runs on exactly {cp} ranks (one cp group); this launch "
            f"has world_size={rt.world_size}, and {task.upper()} has no data parallelism yet. Launch {cp} processes "
            f"(torchrun --nproc-per-node {cp}).",
        ),
        (
            par.context_parallel_strategy == "ring",
            f"context_parallel_strategy='ring' is not implemented for task={task!r} (torch's ring attention shards "
            "the batch itself, not the completion targets); use --context-parallel-strategy allgather or ulysses.",
        ),
        (
            cfg.loss.loss_type == "liger",
            f"loss_type='liger' (or use_liger_kernel=True) for {task.upper()} scores whole rows, not a "
            "context-parallel shard; use --loss-type fused_linear with --context-parallel-size.",
        ),
        (
            cfg.grpo.use_vllm,
            f"use_vllm=True is not implemented with context_parallel_size > 1 for task={task!r} (the colocated "
            "engine holds the whole model on one rank); drop --use-vllm (every rank generates with HF generate).",
        ),
        (
            cfg.peft.load_in_4bit,
            "load_in_4bit=True (QLoRA) runs in one process: FSDP2 cannot shard bitsandbytes' packed NF4 weights; "
            "drop --load-in-4bit (LoRA shards) or drop --context-parallel-size.",
        ),
        (
            cfg.eval_strategy != "no",
            f"eval_strategy={cfg.eval_strategy!r} is not implemented with context_parallel_size > 1 for "
            f"task={task!r}; use --eval-strategy no, or evaluate the saved model in one process.",
        ),
        (
            cfg.memory.torch_compile,
            f"torch_compile=True is not implemented with context_parallel_size > 1 for task={task!r}; drop "
            "--torch-compile.",
        ),
    ]
    for refused, message in refusals:
        if refused:
            raise ConfigError(message)


def _check_jax_grpo_context_parallel(cfg: TrainConfig, rt: Runtime) -> None:
    """GRPO (and RLOO) under context parallelism on jax: a (data=1, cp) mesh over every visible device
    (``jax_backend.grpo``); a data axis (cp below the device count) is not implemented (raises)."""
    cp = cfg.parallel.context_parallel_size
    if cp != rt.world_size:
        raise ConfigError(
            f"context_parallel_size={cp} with task={cfg.task!r} on {rt.world_size} {rt.caps.world_unit} would "
            f"leave a data-parallel axis of {rt.world_size // max(cp, 1)}, which is not implemented for "
            f"{cfg.task.upper()} on jax (its mesh is data=1 x cp); use --context-parallel-size {rt.world_size}, or "
            f"expose {cp} devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={cp})."
        )


def _check_optimizer_in_backward(cfg: TrainConfig, rt: Runtime) -> None:
    """``optimizer_in_backward``: each parameter steps in its gradient's hook, so no step sees all the gradients."""
    opt, data = cfg.optim, cfg.data
    if not opt.optimizer_in_backward:
        return
    if "optimizer_in_backward" not in rt.caps.options:
        raise ConfigError(
            f"optimizer_in_backward=True is a torch option (a per-parameter step in each gradient's hook); the "
            f"{rt.backend} backend's step is one compiled program that updates its donated parameter and optimizer "
            f"buffers in place. Drop --optimizer-in-backward."
        )
    if data.gradient_accumulation_steps > 1:
        raise ConfigError(
            f"optimizer_in_backward=True steps each parameter when its gradient is produced, but "
            f"gradient_accumulation_steps={data.gradient_accumulation_steps} sums the gradients of several "
            f"backward passes first; use --gradient-accumulation-steps 1 (raise --per-device-train-batch-size "
            f"instead) or drop --optimizer-in-backward."
        )
    if opt.max_grad_norm is not None:
        raise ConfigError(
            f"optimizer_in_backward=True steps each parameter before the other gradients exist, so the global norm "
            f"that max_grad_norm={opt.max_grad_norm} clips to is not known in time; pass --max-grad-norm None "
            f"(the norm is still logged) or drop --optimizer-in-backward."
        )
    if opt.skip_nonfinite_steps:
        raise ConfigError(
            "optimizer_in_backward=True has updated the weights by the time a non-finite loss or norm is seen, so "
            "skip_nonfinite_steps=True cannot skip the step; drop --skip-nonfinite-steps (such a step stops the run) "
            "or drop --optimizer-in-backward."
        )
    if opt.optimizer == "adamw_bnb_8bit":
        raise ConfigError(
            "optimizer_in_backward=True steps one parameter at a time with twinseq's AdamW, and "
            "optimizer='adamw_bnb_8bit' is bitsandbytes' optimizer; use --optimizer adamw_bf16_8bit (the same "
            "8-bit moments, plain torch, bfloat16 weights) or drop --optimizer-in-backward."
        )
    if _distributed(cfg, rt) or cfg.parallel.deepspeed_zero_stage:
        raise ConfigError(
            "optimizer_in_backward=True runs in one process: FSDP2 reduces sharded gradients after backward and "
            "DeepSpeed steps its own partitions; drop --fsdp / --context-parallel-size / --deepspeed-zero-stage "
            "and launch with python, or drop --optimizer-in-backward."
        )
