"""All torch parallelism: the named ("dp", "cp") mesh, FSDP2, and the multi-process trainer.

Mesh. ``world_size = dp * cp`` ranks on a ``DeviceMesh`` named ``("dp", "cp")``, cp innermost
(the ranks of a cp group are neighbours, so on one node they share the fastest links). Ranks
of one cp group read the same rows and each keeps ``T / cp`` tokens of them
(``twinseq.torch_backend.context_parallel``); dp groups read different rows.

FSDP2. Parameters, gradients and optimizer state are sharded with ``fully_shard`` over the
flattened ``dp x cp`` mesh (as torchtitan's ``dp_shard_cp``): cp ranks hold different tokens
of the same rows, so their gradients are partial sums exactly like dp ranks', and one
reduce-scatter over all ranks adds both. Each decoder layer is its own FSDP unit; the root is
``CausalLMLoss`` (model body + lm_head + loss in one forward, so the tied embedding is
gathered once and its gradient reduced once). Mixed precision (bf16 params, fp32 reduce) is
used on CUDA with ``dtype=bfloat16`` only.

Loss normalisation (ANCHORS failure 8). Every micro-batch loss is ``sum of its NLL /
num_items_in_batch``, where ``num_items_in_batch`` counts the labels of the whole optimizer
step over every micro-batch and every rank (``StepIterator`` computes it locally). Gradients
are therefore SUMMED over ranks (FSDP's divide factor is set to 1), never averaged, and the
logged loss is the all-reduced sum.

Process group: gloo on CPU, NCCL on CUDA; rank and world size come from the environment that
``torchrun`` / ``accelerate launch`` set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_*``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist

from twinseq.common.batching import Batch
from twinseq.common.config import TrainConfig
from twinseq.torch_backend import context_parallel as cpmod
from twinseq.torch_backend.train import MicroStep

logger = logging.getLogger(__name__)

MESH_DIMS = ("dp", "cp")
FSDP_DIM = "dp_cp"


# --------------------------------------------------------------------------------------
# The named mesh and its rules
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeshConfig:
    """``world_size`` ranks as ``dp x cp``; rank ``r`` sits at ``(r // cp, r % cp)``.

    >>> m = MeshConfig(world_size=4, cp=2)
    >>> m.dp, m.coords(3)
    (2, (1, 1))
    """

    world_size: int
    cp: int = 1

    @property
    def dp(self) -> int:
        return self.world_size // self.cp

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, cp_rank) of a global rank."""
        return rank // self.cp, rank % self.cp


def check_parallel_config(cfg: TrainConfig, world_size: int, device_type: str) -> MeshConfig:
    """The ``MeshConfig`` of ``cfg`` on ``world_size`` ranks, or a ``ValueError`` that names the fix."""
    cp, strategy = cfg.context_parallel_size, cfg.context_parallel_strategy
    if cp > world_size:
        raise ValueError(f"context_parallel_size={cp} is larger than the world size {world_size}; launch "
                         f"{cp} or more processes (torchrun --nproc-per-node {cp}) or lower --context-parallel-size.")
    if world_size % cp:
        raise ValueError(f"world size {world_size} is not divisible by context_parallel_size={cp}; the mesh is "
                         f"dp x cp, so use a cp that divides {world_size} or launch a multiple of {cp} processes.")
    if cp > 1:
        _check_cp_config(cfg, cp, strategy, device_type)
    return MeshConfig(world_size=world_size, cp=cp)


def _check_cp_config(cfg: TrainConfig, cp: int, strategy: str, device_type: str) -> None:
    multiple = 2 * cp
    if cfg.pad_to_multiple_of is None or cfg.pad_to_multiple_of % multiple:
        raise ValueError(f"context_parallel_size={cp} splits every row into 2 * cp = {multiple} load-balanced "
                         f"chunks, but pad_to_multiple_of={cfg.pad_to_multiple_of!r} does not guarantee it; pad "
                         f"the batches with --pad-to-multiple-of {multiple} (or a multiple of it).")
    if strategy != "ring":
        return
    if device_type != "cuda":
        raise ValueError(f"context_parallel_strategy='ring' uses torch's ring attention, which needs CUDA SDPA "
                         f"(flash or efficient kernels); this run is on {device_type!r}. Use "
                         f"--context-parallel-strategy allgather, which runs on CPU/gloo too.")
    if cfg.packing or cfg.padding_free:
        raise ValueError(f"context_parallel_strategy='ring' cannot mask packed documents (packing={cfg.packing}, "
                         f"padding_free={cfg.padding_free}): torch's ring attention only knows a causal mask and "
                         f"would attend across documents (TRL #6843). Use --context-parallel-strategy allgather, "
                         f"or train unpacked.")
    if cfg.padding_side != "right":
        raise ValueError("context_parallel_strategy='ring' needs --padding-side right (a causal mask lets real "
                         "tokens see left padding); or use --context-parallel-strategy allgather.")


def check_launcher_env(cfg: TrainConfig, env: Optional[Mapping[str, str]] = None) -> None:
    """Refuse a launcher config (``accelerate launch --config_file``) that disagrees with ``cfg``.

    accelerate exports its YAML as environment variables; twinseq does its own FSDP2 and CP, so
    a YAML asking for something else must not be silently ignored.
    """
    env = os.environ if env is None else env
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and env.get("FSDP_VERSION", "2") != "2":
        raise ValueError(f"the accelerate config asks for fsdp_version={env['FSDP_VERSION']}; twinseq shards with "
                         f"FSDP2 only. Set fsdp_version: 2 in the accelerate YAML.")
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        cp_env = int(env.get("PARALLELISM_CONFIG_CP_SIZE", "1"))
        if cp_env != cfg.context_parallel_size:
            raise ValueError(f"the accelerate config sets parallelism_config_cp_size={cp_env} but "
                             f"context_parallel_size={cfg.context_parallel_size}; pass --context-parallel-size "
                             f"{cp_env} (or change the YAML) so both agree.")
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision == "bf16" and cfg.dtype != "bfloat16":
        raise ValueError(f"the accelerate config sets mixed_precision=bf16 but dtype={cfg.dtype!r}; pass "
                         f"--dtype bfloat16 (or set mixed_precision: 'no').")


def wants_distributed(cfg: TrainConfig, env: Optional[Mapping[str, str]] = None) -> bool:
    """True when the run must go through ``train_distributed`` (FSDP2 and/or CP)."""
    env = os.environ if env is None else env
    return int(env.get("WORLD_SIZE", "1")) > 1 or cfg.fsdp or cfg.context_parallel_size > 1


# --------------------------------------------------------------------------------------
# Process group and mesh
# --------------------------------------------------------------------------------------


@dataclass
class Runtime:
    """Where this process stands: device, global rank, mesh and its coordinates."""

    device: torch.device
    rank: int
    mesh_cfg: MeshConfig
    mesh: Any                 # DeviceMesh ("dp", "cp")
    fsdp_mesh: Any            # the flattened dp x cp mesh FSDP shards over
    owns_group: bool          # this module initialised the process group (and destroys it)

    @property
    def dp_rank(self) -> int:
        return self.mesh_cfg.coords(self.rank)[0]

    @property
    def cp_rank(self) -> int:
        return self.mesh_cfg.coords(self.rank)[1]

    @property
    def cp_group(self):
        return self.mesh.get_group("cp") if self.mesh_cfg.cp > 1 else None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} must be an integer (set by torchrun).") from None


def init_runtime(cfg: TrainConfig, env: Optional[Mapping[str, str]] = None) -> Runtime:
    """Init the process group from the environment (or reuse one), check ``cfg``, build the mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    env = os.environ if env is None else env
    world_size, rank = _env_int(env, "WORLD_SIZE", 1), _env_int(env, "RANK", 0)
    local_rank = _env_int(env, "LOCAL_RANK", 0)
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    mesh_cfg = check_parallel_config(cfg, world_size, device.type)
    check_launcher_env(cfg, env)
    owns_group = not dist.is_initialized()
    if owns_group:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if world_size == 1 and "MASTER_ADDR" not in env:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
    if dist.get_world_size() != world_size:
        raise ValueError(f"WORLD_SIZE={world_size} but the process group has {dist.get_world_size()} ranks.")
    mesh = init_device_mesh(device.type, (mesh_cfg.dp, mesh_cfg.cp), mesh_dim_names=MESH_DIMS)
    # DeviceMesh has no public flatten yet; torchtitan uses the same private call.
    fsdp_mesh = mesh[MESH_DIMS]._flatten(FSDP_DIM)
    return Runtime(device, dist.get_rank(), mesh_cfg, mesh, fsdp_mesh, owns_group)


# --------------------------------------------------------------------------------------
# The model: body + loss in one FSDP root, and the sharding
# --------------------------------------------------------------------------------------


class CausalLMLoss(torch.nn.Module):
    """``forward(micro) -> (loss, metrics)`` for a ``Batch`` (no CP) or a ``CPShard``.

    Running the body, the lm_head and the loss inside one module forward lets FSDP2's hooks
    gather the root parameters (embeddings, final norm, lm_head) around all of their uses.
    """

    def __init__(self, causal_lm: torch.nn.Module, cfg: TrainConfig, cp_group=None) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.cfg, self.cp_group = cfg, cp_group

    def _hidden(self, micro) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(hidden_BTH, labels or targets, whether they are already shifted)."""
        from twinseq.torch_backend.attention import forward_hidden

        if isinstance(micro, Batch):
            hidden = forward_hidden(self.causal_lm, micro, self.cfg.attn_implementation)
            return hidden, torch.as_tensor(micro.labels, dtype=torch.long, device=hidden.device), False
        ctx = cpmod.make_context(micro, self.cp_group, self.cfg.context_parallel_strategy)
        out = self.causal_lm.model(input_ids=micro.input_ids, position_ids=micro.position_ids, use_cache=False,
                                   **{cpmod.CP_KWARG: ctx})
        return out.last_hidden_state, micro.targets, True

    def forward(self, micro):
        from twinseq.torch_backend.losses import causal_lm_loss

        hidden_BTH, labels_BT, shifted = self._hidden(micro)
        return causal_lm_loss(hidden_BTH, self.causal_lm.lm_head.weight, labels_BT, micro.num_items_in_batch,
                              self.cfg.loss_type, chunk_size=self.cfg.loss_chunk_size, return_metrics=True,
                              targets_are_shifted=shifted)


def use_cp_attention(model: torch.nn.Module, strategy: str) -> None:
    """Switch an HF model's attention to the registered CP function of ``strategy`` (logged)."""
    cpmod.register_cp_attention()
    name = cpmod.HF_NAMES[strategy]
    logger.info("context parallelism: attention runs %r (replaces %r)", name, model.config._attn_implementation)
    model.set_attn_implementation(name)


def apply_fsdp(module: CausalLMLoss, runtime: Runtime, cfg: TrainConfig) -> CausalLMLoss:
    """``fully_shard`` every decoder layer, then the root; gradients summed over ranks (factor 1)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": runtime.fsdp_mesh}
    if runtime.device.type == "cuda" and cfg.dtype == "bfloat16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in module.causal_lm.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            # a plain SUM: the losses are already normalised by the whole step (gloo has no PREMUL_SUM)
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)
    return module


def build_parallel_model(cfg: TrainConfig, runtime: Runtime, causal_lm: torch.nn.Module) -> CausalLMLoss:
    """Wrap ``causal_lm`` (full weights on every rank) with the CP attention and FSDP2."""
    if runtime.mesh_cfg.cp > 1:
        use_cp_attention(causal_lm, cfg.context_parallel_strategy)
    return apply_fsdp(CausalLMLoss(causal_lm.to(runtime.device), cfg, runtime.cp_group), runtime, cfg)


# --------------------------------------------------------------------------------------
# One optimizer step
# --------------------------------------------------------------------------------------


class ParallelMicroStep(MicroStep):
    """``MicroStep`` whose forward is the FSDP root ``CausalLMLoss``; with ``ring`` the forward and
    backward run inside torch's ``context_parallel`` block."""

    def __init__(self, module: CausalLMLoss, cfg: TrainConfig, runtime: Runtime) -> None:
        super().__init__(module, cfg, runtime.device)
        self.runtime = runtime

    def _forward_loss(self, micro):
        return self.model(micro)

    def __call__(self, micro) -> tuple[float, dict[str, float]]:
        if isinstance(micro, cpmod.RingMicroBatch):  # torch shards the batch itself, inside the block
            with cpmod.ring_context(self.runtime.mesh["cp"], micro.batch, self.runtime.device) as shard:
                return super().__call__(shard)
        return super().__call__(micro)


def prepare_micro_batches(batches: list[Batch], cfg: TrainConfig, runtime: Runtime) -> list[Any]:
    """This rank's view of a step: the batches as they are (no CP), their ``CPShard`` (allgather),
    or ``RingMicroBatch`` (ring: the checked full batch, which ``ring_context`` shards)."""
    cp = runtime.mesh_cfg.cp
    if cp == 1:
        return batches
    if cfg.context_parallel_strategy == "ring":
        return [cpmod.ring_micro_batch(b, cp, runtime.cp_rank) for b in batches]
    return [cpmod.shard_for_rank(b, cp, runtime.cp_rank, runtime.device) for b in batches]


_SUMMED = ("loss", "num_tokens", "num_label_tokens", "num_correct_tokens", "entropy_sum")


def reduce_step_metrics(out: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Sum the additive metrics over all ranks and recompute the means from the sums."""
    keys = [k for k in _SUMMED if k in out]
    values = torch.tensor([float(out[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    out = {**out, **dict(zip(keys, values.tolist()))}
    for k in ("num_tokens", "num_label_tokens", "num_correct_tokens"):
        if k in out:
            out[k] = int(round(out[k]))
    labels = out.get("num_label_tokens", 0)
    if "num_correct_tokens" in out:
        out["mean_token_accuracy"] = out["num_correct_tokens"] / labels if labels else 0.0
    if "entropy_sum" in out:
        out["entropy"] = out["entropy_sum"] / labels if labels else 0.0
    return out


def parallel_train_step(module, optimizer, scheduler, micro_step: ParallelMicroStep, batches: list[Batch],
                        cfg: TrainConfig, runtime: Runtime) -> dict[str, Any]:
    """One optimizer step on this rank's micro-batches; metrics reduced over all ranks."""
    from twinseq.torch_backend.train import train_step

    micro = prepare_micro_batches(batches, cfg, runtime)
    return reduce_step_metrics(train_step(module, optimizer, scheduler, micro_step, micro, cfg), runtime.device)


# --------------------------------------------------------------------------------------
# The multi-process trainer (``twinseq train`` under torchrun / accelerate launch)
# --------------------------------------------------------------------------------------


def _refuse_unsupported(cfg: TrainConfig) -> None:
    """Options the single-process trainer has but the FSDP2 path does not (yet): refused, not ignored."""
    unsupported = {"save_steps": cfg.save_steps > 0, "resume_from_checkpoint": cfg.resume_from_checkpoint is not None,
                   "torch_compile": cfg.torch_compile, "activation_offloading": cfg.activation_offloading}
    bad = [name for name, on in unsupported.items() if on]
    if bad:
        raise ValueError(f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not supported with FSDP2/context "
                         f"parallelism yet (the run writes only final/); drop "
                         f"{' '.join('--' + b.replace('_', '-') for b in bad)} or train in one process.")


def main_process_first(runtime: Runtime):
    """Rank 0 runs the block first (it may build caches: corpus, tokenizer), the others after it."""
    import contextlib

    @contextlib.contextmanager
    def ordered():
        if not runtime.is_main:
            dist.barrier()
        yield
        if runtime.is_main:
            dist.barrier()

    return ordered()


def save_full_model(module: CausalLMLoss, runtime: Runtime, path: Union[str, Path]) -> Optional[Path]:
    """Gather the full weights (collective) and write an HF checkpoint from rank 0; returns the path there."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from twinseq.common.init import parameter_shapes
    from twinseq.torch_backend.model import build_model, model_config_of, save_pretrained

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = None
    if runtime.is_main:
        model_cfg = model_config_of(module.causal_lm)
        weights = {k.removeprefix("causal_lm."): v.float().numpy() for k, v in state.items()}
        plain = build_model(model_cfg, {k: weights[k] for k in parameter_shapes(model_cfg)})
        out = save_pretrained(plain, path)
    dist.barrier()
    return out


def _max_over_ranks(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def train_distributed(cfg: TrainConfig) -> Path:
    """``cfg.max_steps`` optimizer steps with FSDP2 (+ CP); rank 0 writes ``metrics.jsonl`` and ``final/``.

    Returns the path of ``metrics.jsonl`` (on every rank).
    """
    from twinseq.torch_backend.train import validate_runtime

    _refuse_unsupported(cfg)
    runtime = init_runtime(cfg)
    try:
        validate_runtime(cfg, runtime.device)
        return _train_loop(cfg, runtime)
    finally:
        if runtime.owns_group:
            dist.destroy_process_group()


def _train_loop(cfg: TrainConfig, runtime: Runtime) -> Path:
    from twinseq.common.loader import build_step_iterator
    from twinseq.common.metrics import RunLogger, read_metrics, summarize_losses
    from twinseq.torch_backend.train import _announce, _peak_memory, build_optimizer, build_training_model

    torch.manual_seed(cfg.seed)
    with main_process_first(runtime):
        iterator, tokenizer, stats = build_step_iterator(cfg, world_size=runtime.mesh_cfg.dp, rank=runtime.dp_rank)
    module = build_parallel_model(cfg, runtime, build_training_model(cfg, tokenizer.vocab_size, runtime.device))
    optimizer, scheduler = build_optimizer(module, cfg)
    micro_step = ParallelMicroStep(module, cfg, runtime)
    log = None
    if runtime.is_main:
        log = RunLogger(cfg.output_dir, cfg.max_steps, disable_tqdm=cfg.disable_tqdm, desc="train[torch-fsdp2]")
        _announce(cfg, module.causal_lm, runtime.device, stats, log, world_size=runtime.mesh_cfg.dp)
        log.write(f"mesh: dp={runtime.mesh_cfg.dp} x cp={runtime.mesh_cfg.cp} on {runtime.mesh_cfg.world_size} "
                  f"ranks ({dist.get_backend()}), FSDP2 over dp x cp, cp strategy="
                  f"{cfg.context_parallel_strategy if runtime.mesh_cfg.cp > 1 else 'none'}")
    for step in range(1, cfg.max_steps + 1):
        t0 = time.perf_counter()
        out = parallel_train_step(module, optimizer, scheduler, micro_step, iterator.next_step(), cfg, runtime)
        seconds = time.perf_counter() - t0
        peak = _max_over_ranks(_peak_memory(runtime.device), runtime.device)
        if log is not None:
            log.log_step({"step": step, **out, "tokens_per_second": out["num_tokens"] / seconds,
                          "step_seconds": seconds, "peak_memory_bytes": peak})
    final = Path(cfg.output_dir) / "final"
    save_full_model(module, runtime, final)
    if log is not None:
        tokenizer.save_pretrained(final)
        log.close()
        summary = summarize_losses(read_metrics(cfg.output_dir))
        if summary:
            print(summary)
    return Path(cfg.output_dir) / "metrics.jsonl"
