"""Activation memory on the torch backend: checkpointing (recompute) and offloading (move to host).

Importing it (``import twinseq.torch_backend`` does) bounds CPU bfloat16's oneDNN kernel caches (below).

``apply_activation_checkpointing`` recomputes every decoder layer in backward; it is applied by
``parallel.parallelize``, in its stated place. The rest of this module is activation offloading:
saved activations go to pinned host memory in forward and come back in backward.

Built on ``torch.autograd.graph.saved_tensors_hooks``. Device-to-host copies run on a side
CUDA stream, so they overlap the next layers' compute; in backward the next few tensors are
prefetched the same way. What it fixes from the peers (ANCHORS failure 7):

- **Leaks (TRL #5700).** The stash is keyed by a small handle object that autograd holds in
  place of the tensor. When autograd frees a saved tensor (after its node's backward, or when
  a graph is dropped without backward) the handle dies and a ``weakref.finalize`` drops the
  host copy. Nothing outlives the graph; ``live_stashed`` is 0 after every step.
- **Non-contiguous tensors (TRL #5694).** A non-overlapping tensor (a transpose; a view with
  gaps of at most its own size, such as the row-padded attention bias that SDPA's memory-efficient
  kernel saves and whose aligned strides its backward requires) is copied into a host buffer with
  the same strides, and comes back with them; an expanded view keeps one copy along its
  stride-0 dimensions and is expanded again on return; any other overlapping or sparse view (a
  large step slice) is copied ``.contiguous()``, same shape and values.
- **In-place Liger cross-entropy.** Liger's kernel writes gradients into its input, which an
  offloaded copy would not see (and autograd's version check is bypassed by hooks). Given the
  model, only tensors saved inside the decoder (``model.model``: layers + final norm) are
  offloaded; the lm_head and loss run outside that region and keep their tensors on device.
  Code can also say ``with offloader.paused():``. An in-place change to an offloaded tensor
  raises at unpack, as autograd would.

On a CPU device there is nothing to offload to: it refuses, unless ``allow_cpu_for_testing``
(a plain host copy with the same bookkeeping, for tests).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import logging
import os
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from twinseq.common.errors import ConfigError
from twinseq.common.run.memory_plan import ONEDNN_CACHE_CAPACITY
from twinseq.torch_backend.blocked_attention import set_attention_block_size
from twinseq.torch_backend.unwrap import causal_lm_of

logger = logging.getLogger(__name__)

# CPU bfloat16 compute runs oneDNN kernels, and two caches keep one entry per distinct problem shape: oneDNN's
# primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep's (LRU_CACHE_CAPACITY), 1,024 entries each by default.
# With varlen attention every step brings new document lengths, so the heap grew without levelling off (small,
# staircase "+ bf16 state", 8 steps: 191 -> 404 MiB peak). Capped at 16 it levels off at step 5 (175 -> 228 MiB; both
# at 0/1: 197 MiB but twice the step time, every kernel rebuilt), at no measurable step-time cost (median 9.9 s
# against 11.4 s at the default, 2 loaded cores; fixed shapes, 27 kernels: 13 rebuilt a step, ~30 ms a step). Both
# variables are read when the first kernel is built, not at `import torch`, so setting them here, after torch is
# imported, works (measured), but not once bfloat16 compute ran. LRU_CACHE_CAPACITY=0 crashes torch 2.13
# (segfault), hence no zero. A user's own setting wins. memory_plan's cache row is the bound this cap implies.
for _var in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
    os.environ.setdefault(_var, str(ONEDNN_CACHE_CAPACITY))

INPLACE_LOSS_TYPES = ("liger",)


class _Handle:
    """What autograd stores instead of an offloaded tensor."""

    __slots__ = ("key", "__weakref__")

    def __init__(self, key: int) -> None:
        self.key = key


class _Kept:
    """A tensor left in place. Stored detached: a pack hook that returns an op's *output* itself
    makes a reference cycle (tensor -> grad_fn -> saved tensor) that keeps the whole graph alive;
    autograd re-attaches the grad_fn on unpack. The version makes in-place edits detectable."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t.detach(), t._version


@dataclass
class _Entry:
    host: torch.Tensor
    source: "weakref.ref[torch.Tensor]"
    version: int
    event: Optional[Any] = None  # D2H copy done (CUDA)
    device_copy: Optional[torch.Tensor] = None
    device_event: Optional[Any] = None  # H2D prefetch done (CUDA)
    expand_to: Optional[torch.Size] = None  # an expanded view: host holds one copy; expanded again on return


@dataclass
class OffloadStats:
    num_offloaded: int = 0
    bytes_offloaded: int = 0
    num_kept: int = 0
    shapes: set = field(default_factory=set)  # distinct shapes offloaded (bounded, for checks)


def _check_version(t: Optional[torch.Tensor], version: int) -> None:
    if t is not None and t._version != version:
        raise RuntimeError(
            "a tensor saved for backward was modified in place after it was saved under "
            "activation offloading (e.g. an in-place loss kernel such as Liger's); compute it "
            "under ActivationOffloader.paused() or outside the offloaded region."
        )


def _mirrorable(t: torch.Tensor) -> bool:
    """True iff a buffer with ``t``'s strides holds no element twice (no expand) and spans at most twice ``t``'s
    elements: a permuted contiguous layout (a transpose) or a view with small gaps (a row-padded slice)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    reach = 1  # elements spanned by the dimensions so far
    for stride, size in dims:
        if stride < reach:
            return False
        reach = stride * (size - 1) + reach
    return reach <= 2 * max(t.numel(), 1)


class ActivationOffloader:
    """Context manager that offloads saved activations. Usage (CUDA)::

        with ActivationOffloader(model):
            loss = compute_loss(model, batch)  # decoder activations move to pinned host memory
            loss.backward()                    # and come back, prefetched; the stash is then empty

    ``min_offload_bytes``: smaller tensors stay (copy overhead beats the saving).
    ``prefetch``: tensors brought back ahead of use in backward.
    """

    def __init__(
        self,
        model: Optional[torch.nn.Module] = None,
        *,
        device: Any = None,
        loss_type: str = "nll",
        min_offload_bytes: int = 1024,
        prefetch: int = 2,
        allow_cpu_for_testing: bool = False,
    ) -> None:
        if device is None:
            if model is None:
                raise ConfigError(
                    "ActivationOffloader got model=None and device=None; pass the model or an explicit device=."
                )
            device = next(model.parameters()).device
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.testing = self.device.type != "cuda"
        if self.testing and not allow_cpu_for_testing:
            raise ConfigError(
                f"activation offloading moves activations from a CUDA device to host memory; the "
                f"model is on {self.device.type!r}, where activations already live in host memory. "
                f"Drop activation_offloading (gradient_checkpointing saves memory on CPU)."
            )
        if loss_type in INPLACE_LOSS_TYPES and model is None:
            raise ConfigError(
                f"loss_type={loss_type!r} modifies its input in place, which breaks offloaded "
                f"tensors; pass the model so that only the decoder region is offloaded."
            )
        self.region = None if model is None else self._decoder_of(model)
        self.param_ptrs = set() if model is None else {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.min_offload_bytes, self.prefetch = min_offload_bytes, prefetch
        self.stats = OffloadStats()
        self._stash: dict[int, _Entry] = {}
        self._keys = itertools.count()
        self._depth_in_region = 0 if self.region is not None else 1
        self._paused = 0
        self._hooks_ctx = None
        self._region_handles: list = []
        self._callback_queued = False
        self._stream = None if self.testing else torch.cuda.Stream(device=self.device)

    @staticmethod
    def _decoder_of(model: torch.nn.Module) -> torch.nn.Module:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
        if decoder is None or decoder is model:
            raise ConfigError(
                f"cannot find the decoder of {type(model).__name__} (expected a .model submodule, as "
                f"every *ForCausalLM twinseq builds has); pass model=None to offload everything "
                f"(not with Liger)."
            )
        return decoder

    # ---- public state ----------------------------------------------------------------
    @property
    def live_stashed(self) -> int:
        """Tensors currently held in host memory by this offloader."""
        return len(self._stash)

    @contextlib.contextmanager
    def paused(self):
        """Inside, saved tensors stay where they are (e.g. around an in-place loss kernel)."""
        self._paused += 1
        try:
            yield self
        finally:
            self._paused -= 1

    # ---- context manager -------------------------------------------------------------
    def __enter__(self) -> "ActivationOffloader":
        assert self._hooks_ctx is None, "ActivationOffloader is not re-entrant"
        if self.region is not None:
            self._region_handles = [
                self.region.register_forward_pre_hook(lambda *_: self._enter_region()),
                self.region.register_forward_hook(lambda *_: self._leave_region(), always_call=True),
            ]
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks_ctx.__exit__(*exc)
        self._hooks_ctx = None
        for handle in self._region_handles:
            handle.remove()
        self._region_handles = []

    def _enter_region(self) -> None:
        self._depth_in_region += 1

    def _leave_region(self) -> None:
        self._depth_in_region -= 1

    # ---- hooks -----------------------------------------------------------------------
    def _should_offload(self, t: torch.Tensor) -> bool:
        if self._paused or self._depth_in_region <= 0:
            return False
        if isinstance(t, torch.nn.Parameter) or t.device != self.device or t.layout != torch.strided:
            return False
        if t.numel() * t.element_size() < self.min_offload_bytes:
            return False
        return t.untyped_storage().data_ptr() not in self.param_ptrs

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._should_offload(t):
            self.stats.num_kept += 1
            return _Kept(t)
        key = next(self._keys)
        self._stash[key] = self._to_host(t)
        handle = _Handle(key)
        weakref.finalize(handle, self._stash.pop, key, None)
        self.stats.num_offloaded += 1
        self.stats.bytes_offloaded += t.numel() * t.element_size()
        self.stats.shapes.add(tuple(t.shape))
        return handle

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Kept):
            _check_version(packed.tensor, packed.version)
            return packed.tensor
        entry = self._stash.get(packed.key)
        assert entry is not None, "offloaded tensor unpacked after its graph was freed"
        _check_version(entry.source(), entry.version)
        if self.testing:
            return entry.host if entry.expand_to is None else entry.host.expand(entry.expand_to)
        self._queue_end_of_backward()
        tensor = self._to_device(entry)
        self._prefetch_before(packed.key)
        return tensor if entry.expand_to is None else tensor.expand(entry.expand_to)

    # ---- copies ----------------------------------------------------------------------
    def _host_buffer(self, t: torch.Tensor) -> torch.Tensor:
        pin = not self.testing
        if t.is_contiguous():
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        if _mirrorable(t):  # the device copy is allocated with the host buffer's strides (_start_device_copy)
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=pin)
        # overlapping (expand) or sparse (a large step slice) views are not mirrored: same shape, contiguous
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)

    def _to_host(self, t: torch.Tensor) -> _Entry:
        source, expand_to = t, None
        if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
            # an expanded view (SDPA's attention bias over heads): keep one copy along each stride-0 dimension, so
            # the rest of its layout (padded rows) can be mirrored; it is expanded again when it comes back
            expand_to = t.shape
            t = t[tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for st, n in zip(t.stride(), t.shape))]
        host = self._host_buffer(t)
        entry = _Entry(host=host, source=weakref.ref(source), version=source._version, expand_to=expand_to)
        if self.testing:
            host.copy_(t)
            return entry
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            host.copy_(t, non_blocking=True)
            entry.event = torch.cuda.Event()
            entry.event.record(self._stream)
        # the allocator must not hand t's memory out again before the side-stream copy read it
        t.record_stream(self._stream)
        return entry

    def _start_device_copy(self, entry: _Entry) -> None:
        host = entry.host
        with torch.cuda.stream(self._stream):
            # allocated on the side stream, so no pending main-stream kernel can still own this memory
            device_copy = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=self.device)
            self._stream.wait_event(entry.event)
            device_copy.copy_(host, non_blocking=True)
            entry.device_event = torch.cuda.Event()
            entry.device_event.record(self._stream)
        entry.device_copy = device_copy

    def _to_device(self, entry: _Entry) -> torch.Tensor:
        if entry.device_copy is None:
            self._start_device_copy(entry)
        current = torch.cuda.current_stream(self.device)
        current.wait_event(entry.device_event)
        tensor, entry.device_copy = entry.device_copy, None
        # backward uses it on the main stream: its memory must outlive that use
        tensor.record_stream(current)
        return tensor

    def _prefetch_before(self, key: int) -> None:
        """Start bringing back the next tensors backward will need (saved just before ``key``)."""
        window = range(key - 1, max(key - 1 - 4 * self.prefetch, -1), -1)
        pending = [e for e in (self._stash.get(k) for k in window) if e is not None]
        for entry in pending[: self.prefetch]:
            if entry.device_copy is None:
                self._start_device_copy(entry)

    def _queue_end_of_backward(self) -> None:
        if self._callback_queued:
            return
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        except RuntimeError:  # unpacked outside a backward pass (e.g. grad_fn._saved_* access)
            pass

    def _end_of_backward(self) -> None:
        """Drop prefetched device copies that backward never used; wait for the side stream."""
        self._callback_queued = False
        for entry in list(self._stash.values()):
            entry.device_copy = None
        torch.cuda.current_stream(self.device).wait_stream(self._stream)


def offload_activations(
    model: Optional[torch.nn.Module] = None, *, loss_type: str = "nll", **kwargs: Any
) -> ActivationOffloader:
    """``ActivationOffloader(model, loss_type=loss_type, **kwargs)``: the trainer's entry point."""
    return ActivationOffloader(model, loss_type=loss_type, **kwargs)


def apply_activation_checkpointing(model: torch.nn.Module, policy: str = "full") -> None:
    """Recompute every decoder layer in backward (Hugging Face's per-layer checkpointing, non-reentrant).

    ``policy`` is the JAX backend's name of what is kept; torch keeps the layer inputs only
    (``"full"``), so other policies are refused rather than approximated.
    """
    if policy != "full":
        raise ConfigError(
            f"activation checkpointing policy={policy!r} is not available on the torch backend, "
            f"which recomputes whole layers ('full'); use policy='full'."
        )
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name is deprecated
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# --------------------------------------------------------------------------------------
# Tiled MLP: the decoder MLP over sequence chunks, recomputed chunk by chunk in backward
# --------------------------------------------------------------------------------------


class _TiledMLP(torch.autograd.Function):
    """``mlp(x)`` computed ``chunk_size`` tokens at a time; only ``x`` is saved, not the activations.

    Naive equivalent: ``mlp(x_NH)``. The ``[tokens, intermediate]`` gate/up activations of a
    SwiGLU/GeGLU MLP are 3-4x the hidden size per token; here one chunk's are alive at a time in
    forward (under ``no_grad``) and in backward (each chunk is re-run with grad and differentiated
    at once, its gradients added). ``params`` are the MLP's parameters, passed in so that autograd
    routes their gradients through this Function (frozen ones, e.g. under LoRA, get none).
    """

    @staticmethod
    def forward(ctx, x_NH: torch.Tensor, mlp_forward, chunk_size: int, *params: torch.Tensor) -> torch.Tensor:
        ctx.mlp_forward, ctx.chunk_size, ctx.num_params = mlp_forward, chunk_size, len(params)
        ctx.save_for_backward(x_NH, *params)
        with torch.no_grad():
            return torch.cat([mlp_forward(x_cH) for x_cH in x_NH.split(chunk_size)])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_NH: torch.Tensor):
        x_NH, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        wanted = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + i]]
        grad_x = torch.zeros_like(x_NH) if need_x else None
        grad_p: list = [None] * len(params)
        for start in range(0, x_NH.shape[0], ctx.chunk_size):
            x_cH = x_NH[start : start + ctx.chunk_size].detach().requires_grad_(need_x)
            with torch.enable_grad():
                y_cH = ctx.mlp_forward(x_cH)
                inputs = ([x_cH] if need_x else []) + [params[i] for i in wanted]
                grads = torch.autograd.grad(y_cH, inputs, grad_NH[start : start + ctx.chunk_size], allow_unused=True)
            if need_x:
                grad_x[start : start + ctx.chunk_size] = grads[0]
                grads = grads[1:]
            for i, g in zip(wanted, grads):
                if g is not None:
                    grad_p[i] = g if grad_p[i] is None else grad_p[i] + g
        return (grad_x, None, None, *grad_p)


def _tiled_mlp_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Instance ``forward`` of a tiled MLP: its class's own forward, over chunks of the flattened tokens."""
    chunk_size = mlp._twinseq_tiled_mlp_chunk_size
    mlp_forward = type(mlp).forward.__get__(mlp)
    x_NH = x.reshape(-1, x.shape[-1])
    if x_NH.shape[0] <= chunk_size:  # one tile: nothing to save, the plain MLP is the same computation
        return mlp_forward(x)
    params = [p for p in mlp.parameters()]
    out_NH = _TiledMLP.apply(x_NH, mlp_forward, chunk_size, *params)
    return out_NH.view(*x.shape[:-1], out_NH.shape[-1])


def decoder_mlps(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``.mlp`` of every decoder layer of an HF causal LM (all families twinseq builds name it so)."""
    layers = getattr(getattr(causal_lm_of(model), "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "mlp") for layer in layers):
        raise ConfigError(
            f"tiled_mlp=True: cannot find the decoder layers' .mlp modules of {type(model).__name__}; "
            f"set tiled_mlp=False for this model."
        )
    return [layer.mlp for layer in layers]


def apply_tiled_mlp(model: torch.nn.Module, chunk_size: int = 4096) -> None:
    """Run every decoder MLP over chunks of ``chunk_size`` tokens, recomputed in backward (``_TiledMLP``).

    Installed as an instance ``forward`` on each MLP module, so parameter names, checkpoints and
    FSDP units are unchanged; calling it again only updates the chunk size.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError(
            f"tiled_mlp_chunk_size={chunk_size!r} is not valid; pass a positive integer (tokens per MLP tile)."
        )
    for mlp in decoder_mlps(model):
        mlp._twinseq_tiled_mlp_chunk_size = chunk_size
        mlp.forward = types.MethodType(_tiled_mlp_forward, mlp)
    logger.info("tiled MLP: %d decoder MLPs run over chunks of %d tokens", len(decoder_mlps(model)), chunk_size)


def apply_long_context(model: torch.nn.Module, memory_cfg: Any) -> None:
    """The long-context knobs of ``MemoryConfig`` on a plain HF model: the blocked attention's block size
    (read by ``attention.forward_hidden`` and the ``allgather`` CP attention) and the tiled MLP."""
    set_attention_block_size(model, memory_cfg.attention_block_size)
    if memory_cfg.tiled_mlp:
        apply_tiled_mlp(model, memory_cfg.tiled_mlp_chunk_size)


# --------------------------------------------------------------------------------------
# Host memory: freed buffers back to the OS
# --------------------------------------------------------------------------------------


MMAP_THRESHOLD_BYTES = 128 * 1024
"""glibc's initial ``M_MMAP_THRESHOLD``: buffers from this size up are mapped on their own and unmapped on free."""
_PINNED: Optional[bool] = None


def return_large_frees_to_the_os(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold, so that every freed buffer of ``threshold`` bytes or more leaves the process.

    On CPU, bitsandbytes dequantises each NF4 layer to a float32 weight while the layer runs and frees it after.
    glibc raises its mmap threshold to the size of the largest mapped buffer freed so far (up to 32 MiB), so from
    the first freed weight on, the next ones are carved from the heap and stay resident after ``free``: the
    process then holds about as much as a float32 base, and QLoRA's saving shows in the step's peak only by
    allocator timing. Measured on an 8-layer, H=512 model (``tests/torch_backend/_peft_memory.py``): peak RSS
    LoRA 729-732 MiB vs QLoRA 653-678 MiB with the dynamic threshold, 671 vs 563-564 MiB with it pinned.
    Pinned before the model is built the whole run benefits; pinned after it, the steps' peak was still 668-699 MiB
    in the same measurement. It changes the whole process's allocator for good, so twinseq never calls it on its
    own: call it first thing in a QLoRA process on CPU (``tests/torch_backend/_peft_memory.py`` does, for both of
    the runs it compares). Returns whether it was set (glibc only); logs once either way.
    """
    global _PINNED
    if _PINNED is not None:
        return _PINNED
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        # the trim threshold too: glibc had raised it with the mmap threshold (to twice it), so the heap's free top
        # would not be given back either
        ok = bool(
            libc is not None
            and hasattr(libc, "mallopt")
            and libc.mallopt(M_MMAP_THRESHOLD, int(threshold))
            and libc.mallopt(M_TRIM_THRESHOLD, 2 * int(threshold))
        )
    except OSError:
        ok = False
    _PINNED = ok
    if ok:
        logger.info(
            "CPU: glibc mmap threshold pinned at %d KiB, so the float32 weights dequantised "
            "for each layer leave the process when freed",
            threshold // 1024,
        )
    else:
        logger.info("CPU: not glibc (no mallopt); freed dequantised weights may stay resident")
    return ok
