"""``loss_type="triton"``: twinseq's own Triton kernel for the fused linear cross-entropy.

Naive equivalent (per valid row ``i`` of ``hidden_nH``)::

    z = (hidden_nH @ weight_VH.T).float()
    z = c * tanh(z / c)                                   # only with a logit_softcap c
    logp[i] = log_softmax(z, -1)[i, targets_n[i]]          # 0 where targets_n[i] == -100
    ent[i] = -(softmax(z) * log_softmax(z)).sum(-1)[i]
    hit[i] = z[i].argmax() == targets_n[i]                 # ties count as a hit

No ``[n, V]`` tensor exists in forward or backward (the ``cut cross-entropy`` design): forward
streams the vocabulary through an online logsumexp and keeps only ``lse`` [n] (and the entropy);
backward recomputes one [BLOCK_N, BLOCK_V] tile of logits at a time in registers, forms
``dL/dz = g_logp (onehot - p) - g_ent p (z - E[z])`` (times the cap's ``1 - (z/c)^2``) and adds
its products with ``W`` and ``h`` into fp32 gradient buffers with atomics. The lm_head gradient
is accumulated in fp32 a vocabulary slice at a time (``TRITON_DW_SLICE_BYTES``), each slice cast to the
weight's dtype when done, so a bf16 model holds one bf16 ``[V, H]`` gradient plus one fp32 slice.

Both outputs are differentiable, so SFT (``-sum(logp) / denom``), DPO's sequence log-probs and
GRPO's per-token log-probs with an entropy term all run on the same kernel.

Where it runs:

- CUDA tensors and Triton installed: the compiled kernels.
- CPU tensors with ``TRITON_INTERPRET=1`` (set before triton is imported): the same kernel sources
  under Triton's interpreter (numpy), which is how CI tests them; fp32 and fp16 (the interpreter
  mishandles bf16).
- Otherwise: the torch implementation of the same math (``losses.FusedLinearCrossEntropy`` and
  ``logprobs.FusedLinearTokenLogps``), with a log line that says so.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import math
import os
import sys
from typing import Any, Optional, Sequence

import torch

from twinseq.common.config import TRITON_DW_SLICE_BYTES
from twinseq.common.errors import ConfigError

logger = logging.getLogger(__name__)

# Tiles of the compiled kernels: the fastest of benchmarks/gpu/_tune_triton_ce.py's shortlist on an H100 (16,384 x
# 2,048 x {128,256, 248,320}, bf16; benchmarks/results/tune_triton_ce_h100-80gb_2026-11-25.json).
# Forward: BLOCK_N rows x BLOCK_V columns, D read BLOCK_D at a time; the vocabulary is cut into splits so that
# about ``programs_per_sm`` programs per multiprocessor run. Backward: the same tile, then its two gradient matmuls
# BLOCK_D2 columns of D at a time; GROUP_N row blocks are ordered together so that their rows stay in L2.
GPU_FWD = dict(BLOCK_N=128, BLOCK_V=256, BLOCK_D=64, num_warps=8, num_stages=3, programs_per_sm=2)
GPU_BWD = dict(BLOCK_N=128, BLOCK_V=128, BLOCK_D=64, BLOCK_D2=64, num_warps=8, num_stages=3, GROUP_N=8)
# The interpreter wants small tiles (tl.dot needs >= 16); its "multiprocessors" make a few splits, as a GPU does.
INTERPRETER_FWD = dict(BLOCK_N=16, BLOCK_V=32, BLOCK_D=16, programs_per_sm=2)
INTERPRETER_BWD = dict(BLOCK_N=16, BLOCK_V=32, BLOCK_D=16, BLOCK_D2=16, GROUP_N=8)
INTERPRETER_SMS = 2
# Gradient accumulators (``linear_logps(accumulate=...)``): "float32" (the default: a float32 hidden-state gradient
# and float32 lm_head-gradient slices, exact to float32 summation order) or "input" (both added straight into
# tensors of the inputs' dtype, as cut cross-entropy accumulates: no float32 buffer, a rounding at every tile added).
ACCUMULATE = ("float32", "input")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def interpreter_ready() -> bool:
    """True unless triton was imported before ``TRITON_INTERPRET=1`` was set: its standard library (``tl.max``,
    ``tl.sum``) is then compiled-only, and the interpreter cannot call it."""
    if "triton.language" not in sys.modules:
        return True  # it will be imported now, with the variable set
    try:
        from triton.runtime.interpreter import InterpretedFunction  # optional dependency

        return isinstance(sys.modules["triton.language"].max, InterpretedFunction)
    except (ImportError, AttributeError):
        return False


def kernel_mode(device: torch.device) -> Optional[str]:
    """``"cuda"``, ``"interpret"`` or None (no Triton path for this device: use the torch fallback)."""
    if not triton_available():
        return None
    if device.type == "cuda":
        return "cuda"
    if device.type == "cpu" and interpreter_requested() and interpreter_ready():
        return "interpret"
    return None


def fallback_reason(hidden: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why the kernel cannot run on these inputs (the caller then runs its torch path), or None."""
    if bias is not None:
        return "the lm_head has a bias, which the kernel does not add"
    if hidden.dtype == torch.float64:
        return "the kernel computes in float32 or lower and the inputs are float64"
    if kernel_mode(hidden.device) is not None:
        return None
    if not triton_available():
        return "the triton package is not installed"
    if hidden.device.type == "cpu" and interpreter_requested():
        return "TRITON_INTERPRET=1 was set after triton was imported; set it before Python starts"
    return (
        f"the tensors are on {hidden.device.type}, and Triton compiles for CUDA (set TRITON_INTERPRET=1 to run "
        f"the kernel under Triton's CPU interpreter, slowly)"
    )


@functools.lru_cache(maxsize=None)
def log_fallback_once(reason: str, fallback: str) -> None:
    logger.warning("loss_type='triton': %s; using %s, the torch implementation of the same loss.", reason, fallback)


def kernel_runs(hidden: torch.Tensor, bias: Optional[torch.Tensor] = None) -> bool:
    """True when the kernel can run on these inputs; otherwise logs once why the caller's ``fused_linear`` runs."""
    reason = fallback_reason(hidden, bias)
    if reason:
        log_fallback_once(reason, "fused_linear")
    return reason is None


def wrap_kernels(mode: str, *sources: Any, do_not_specialize: Sequence[str] = ()) -> tuple:
    """Triton kernel sources (undecorated functions) as launchable kernels: ``triton.jit`` for ``"cuda"``, Triton's
    interpreter (numpy, CPU tensors) for ``"interpret"``; ``do_not_specialize`` names integer arguments that change
    from call to call (one compiled variant serves them all)."""
    import triton  # optional dependency

    if mode == "interpret":
        from triton.runtime.interpreter import InterpretedFunction  # optional dependency

        return tuple(InterpretedFunction(source) for source in sources)
    return tuple(triton.jit(source, do_not_specialize=list(do_not_specialize)) for source in sources)


@functools.lru_cache(maxsize=2)
def _kernels(mode: str):
    from twinseq.torch_backend import triton_ce_kernels as k  # optional dependency: imports triton.language

    # ``n`` (rows with a target) changes every step: unspecialised, one compiled variant serves them all (Triton
    # would compile one for n % 16 == 0 and one for the rest, 0.7 s each, the second one steps into a run)
    return wrap_kernels(mode, k.fwd_kernel, k.bwd_kernel, do_not_specialize=["n"])


TILES_ENV = "TWINSEQ_TRITON_TILES"


@functools.lru_cache(maxsize=4)
def _tile_override(path: str) -> dict:
    """``{"fwd": {...}, "bwd": {...}}`` from the JSON file ``$TWINSEQ_TRITON_TILES`` names (tiles tuned for another
    GPU, as ``benchmarks/gpu/_tune_triton_ce.py`` writes them), each key one of GPU_FWD's / GPU_BWD's."""
    try:
        got = json.loads(open(path).read())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{TILES_ENV}={path!r} cannot be read as JSON ({err}); point it to a file like "
            f'{{"fwd": {GPU_FWD}, "bwd": {GPU_BWD}}}, or unset it.'
        ) from err
    for which, known in (("fwd", GPU_FWD), ("bwd", GPU_BWD)):
        unknown = sorted(set(got.get(which, {})) - set(known))
        if unknown:
            raise ConfigError(f"{TILES_ENV}={path!r}: {which} has unknown keys {unknown}; choose from {sorted(known)}.")
    logger.info("loss_type='triton': tiles from %s=%s: %s", TILES_ENV, path, got)
    return got


def _tiles(mode: str, which: str) -> dict:
    if mode == "interpret":
        return INTERPRETER_FWD if which == "fwd" else INTERPRETER_BWD
    base = GPU_FWD if which == "fwd" else GPU_BWD
    path = os.environ.get(TILES_ENV)
    return {**base, **_tile_override(path).get(which, {})} if path else base


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight.dtype


def _launch_kwargs(mode: str, tiles: dict) -> dict:
    if mode == "interpret":
        return {}
    return {"num_warps": tiles["num_warps"], "num_stages": tiles["num_stages"]}


def _multiprocessors(mode: str, device: torch.device) -> int:
    if mode == "interpret":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def vocab_splits(n: int, V: int, tiles: dict, sms: int) -> tuple[int, int]:
    """(splits, columns per split) of the forward: enough splits for ``programs_per_sm`` programs per
    multiprocessor over ``cdiv(n, BLOCK_N)`` row blocks, each split a whole number of BLOCK_V tiles, none empty."""
    bn, bv = tiles["BLOCK_N"], tiles["BLOCK_V"]
    tiles_v = -(-V // bv)
    want = -(-tiles["programs_per_sm"] * sms // max(1, -(-n // bn)))
    splits = max(1, min(tiles_v, want))
    per_split = -(-tiles_v // splits) * bv
    return -(-V // per_split), per_split


def _combine(pm, ps, pt, pz, targets_n, with_entropy):
    """Merge the forward's per-split partials ([splits, n] each) into lse, logp, entropy, hit ([n] each)."""
    m = pm.max(0).values
    scale = torch.exp(pm - m)
    s = (ps * scale).sum(0)
    lse = m + torch.log(s)
    zt = pz.sum(0)
    valid = targets_n >= 0
    logp = torch.where(valid, zt - lse, 0.0)
    hit = (valid & (zt >= m)).float()
    ent = lse - (pt * scale).sum(0) / s if with_entropy else None
    return lse, logp, ent, hit


def _forward(mode, h_NH, w_VH, targets_n, idx_n, cap, with_entropy):
    n, D = targets_n.shape[0], h_NH.shape[1]
    V = w_VH.shape[0]
    tiles = _tiles(mode, "fwd")
    splits, per_split = vocab_splits(n, V, tiles, _multiprocessors(mode, h_NH.device))
    f32 = dict(dtype=torch.float32, device=h_NH.device)
    pm, ps, pz = (torch.empty((splits, n), **f32) for _ in range(3))
    pt = torch.empty((splits, n), **f32) if with_entropy else pm  # a placeholder pointer when unused
    fwd, _ = _kernels(mode)
    if n:
        bn = tiles["BLOCK_N"]
        fwd[(math.ceil(n / bn), splits)](
            h_NH,
            w_VH,
            targets_n,
            idx_n if idx_n is not None else targets_n,
            pm,
            ps,
            pt,
            pz,
            n,
            V,
            D,
            h_NH.stride(0),
            w_VH.stride(0),
            float(cap or 1.0),
            HAS_IDX=idx_n is not None,
            HAS_CAP=cap is not None,
            WITH_ENT=with_entropy,
            IEEE=h_NH.dtype == torch.float32,
            V_SPLIT=per_split,
            BLOCK_N=bn,
            BLOCK_V=tiles["BLOCK_V"],
            BLOCK_D=tiles["BLOCK_D"],
            **_launch_kwargs(mode, tiles),
        )
    return _combine(pm, ps, pt, pz, targets_n, with_entropy)


def _dw_chunk_rows(V: int, D: int, block_v: int) -> int:
    rows = max(TRITON_DW_SLICE_BYTES // (4 * max(D, 1)), block_v)
    return min(V, (rows // block_v) * block_v)


def _backward(
    mode, h_NH, w_VH, targets_n, idx_n, lse, ent, g_logp, g_ent, cap, need_h, need_w, filter_eps, accumulate="float32"
):
    n, D = targets_n.shape[0], h_NH.shape[1]
    V = w_VH.shape[0]
    tiles = _tiles(mode, "bwd")
    bn, bv = tiles["BLOCK_N"], tiles["BLOCK_V"]
    _, bwd = _kernels(mode)
    dh = None
    if need_h:
        dh_dtype = torch.float32 if accumulate == "float32" else h_NH.dtype
        dh = torch.zeros(h_NH.shape, dtype=dh_dtype, device=h_NH.device)
    dw_out = None
    direct = w_VH.dtype == torch.float32 or accumulate == "input"  # atomics straight into dw_out
    if need_w:
        dw_out = torch.zeros_like(w_VH) if direct else torch.empty_like(w_VH)
    with_ent = g_ent is not None
    sliced = dw_out is not None and not direct  # fp32 slices, cast into dw_out when done
    chunk = _dw_chunk_rows(V, D, bv) if sliced else V
    for v0 in range(0, V, max(chunk, 1)):
        v1 = min(V, v0 + chunk)
        if dw_out is None:
            dw = h_NH  # placeholder pointer, never written (NEED_DW=False)
        elif sliced:
            dw = torch.zeros((v1 - v0, D), dtype=torch.float32, device=w_VH.device)
        else:
            dw = dw_out[v0:v1]
        if n:
            grid = (math.ceil(n / bn) * math.ceil((v1 - v0) / bv),)
            bwd[grid](
                h_NH,
                w_VH,
                targets_n,
                idx_n if idx_n is not None else targets_n,
                lse,
                ent if with_ent else lse,
                g_logp,
                g_ent if with_ent else g_logp,
                dh if dh is not None else lse,
                dw,
                n,
                V,
                D,
                v0,
                v1,
                h_NH.stride(0),
                w_VH.stride(0),
                D,
                D,
                float(cap or 1.0),
                float(filter_eps or 0.0),
                HAS_IDX=idx_n is not None,
                HAS_CAP=cap is not None,
                WITH_ENT=with_ent,
                NEED_DH=need_h,
                NEED_DW=need_w,
                FILTER=filter_eps is not None,
                IEEE=h_NH.dtype == torch.float32,
                BLOCK_N=bn,
                BLOCK_V=bv,
                BLOCK_D=tiles["BLOCK_D"],
                BLOCK_D2=tiles["BLOCK_D2"],
                GROUP_N=tiles["GROUP_N"],
                **_launch_kwargs(mode, tiles),
            )
        if sliced:
            dw_out[v0:v1] = dw
            del dw
    return dh, dw_out


def _scatter(x_n: Optional[torch.Tensor], idx_n: Optional[torch.Tensor], N: int) -> Optional[torch.Tensor]:
    if x_n is None or idx_n is None:
        return x_n
    return x_n.new_zeros(N).index_copy_(0, idx_n, x_n)


def _gather(x_N: torch.Tensor, idx_n: Optional[torch.Tensor]) -> torch.Tensor:
    return x_N if idx_n is None else x_N.index_select(0, idx_n)


class TritonLinearLogps(torch.autograd.Function):
    """(logp [n], entropy [n] or None, hit [n]) of ``targets_n`` under ``softcap(hidden_nH @ weight_VH.T)``.

    See the module docstring for the naive equivalent. ``hit`` is not differentiable.
    """

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, targets_N, logit_softcap, with_entropy, filter_eps, mode, accumulate):
        compute = _compute_dtype(hidden_NH, weight_VH)
        h_NH, w_VH = hidden_NH.to(compute).contiguous(), weight_VH.to(compute).contiguous()
        targets_N = targets_N.to(torch.int64).contiguous()
        # the kernels visit only the rows with a target: ignored rows are neither computed nor copied
        idx_n = (targets_N >= 0).nonzero().squeeze(1)  # one host sync
        if idx_n.numel() == targets_N.shape[0]:
            idx_n = None  # every row has a target: no index
        targets_n = targets_N if idx_n is None else targets_N.index_select(0, idx_n)
        lse, logp_n, ent_n, hit_n = _forward(mode, h_NH, w_VH, targets_n, idx_n, logit_softcap, with_entropy)
        logp, ent, hit = (_scatter(x, idx_n, targets_N.shape[0]) for x in (logp_n, ent_n, hit_n))
        ctx.save_for_backward(
            h_NH, w_VH, targets_n, idx_n if idx_n is not None else targets_n, lse, ent_n if ent_n is not None else lse
        )
        ctx.cfg = (
            logit_softcap,
            with_entropy,
            filter_eps,
            mode,
            hidden_NH.dtype,
            weight_VH.dtype,
            idx_n is not None,
            accumulate,
        )
        ctx.mark_non_differentiable(hit)
        ctx.set_materialize_grads(False)  # an unused entropy output gets None, and backward skips its term
        return logp, ent, hit

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent, _g_hit):
        h_NH, w_VH, targets_n, idx_n, lse, ent = ctx.saved_tensors
        cap, with_entropy, filter_eps, mode, h_dtype, w_dtype, has_idx, accumulate = ctx.cfg
        idx_n = idx_n if has_idx else None
        need_h, need_w = ctx.needs_input_grad[:2]
        if g_logp is None:  # only the entropy was used
            g_logp = torch.zeros_like(lse)
        else:
            g_logp = _gather(g_logp, idx_n)
        g_ent = _gather(g_ent, idx_n).float().contiguous() if (with_entropy and g_ent is not None) else None
        dh, dw = _backward(
            mode,
            h_NH,
            w_VH,
            targets_n,
            idx_n,
            lse,
            ent,
            g_logp.float().contiguous(),
            g_ent,
            cap,
            need_h,
            need_w,
            filter_eps,
            accumulate,
        )
        return (
            None if dh is None else dh.to(h_dtype),
            None if dw is None else dw.to(w_dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def resolve_filter_eps(filter_eps, dtype: torch.dtype) -> Optional[float]:
    """None (exact), a float in (0, 1), or ``"auto"``: the compute dtype's machine epsilon / 32 (2^-12 for bf16,
    the threshold cut cross-entropy filters at by default)."""
    if filter_eps == "auto":
        return torch.finfo(dtype).eps / 32
    if filter_eps is not None and not (isinstance(filter_eps, float) and 0.0 < filter_eps < 1.0):
        raise ConfigError(
            f"filter_eps={filter_eps!r} must be None (exact gradients), 'auto' (the dtype's eps / 32) "
            f"or a float in (0, 1): the softmax probability below which a target-free tile of logit "
            f"gradients is skipped; pass one of those."
        )
    return filter_eps


def linear_logps(
    hidden_nH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_n: torch.Tensor,
    *,
    logit_softcap: Optional[float] = None,
    with_entropy: bool = False,
    filter_eps: Optional[float] = None,
    accumulate: str = "float32",
    mode: Optional[str] = None,
):
    """(logp [n] fp32, entropy [n] fp32 or None, hit [n] fp32) on the Triton kernel.

    Rows whose target is -100 are skipped: their log-prob, entropy and hit are 0 and they get no gradient.

    ``filter_eps``: None computes exact gradients (the default, and what ``loss_type='triton'`` uses); ``"auto"`` or a
    float skips, in backward, every tile of logits that holds no target and whose softmax probabilities are all
    below it (cut cross-entropy's gradient filter). Each skipped entry is then below ``filter_eps`` times its
    row's upstream gradient; their sum is not bounded by that, which is why it is opt-in.

    ``accumulate``: ``"float32"`` (the default) adds the gradients' tiles into float32 buffers (the whole hidden
    gradient, lm_head-gradient slices of ``TRITON_DW_SLICE_BYTES``); ``"input"`` adds them straight into gradients of
    the inputs' dtype, as cut cross-entropy does: no float32 buffer at all, one rounding to that dtype per tile added.

    ``mode``: ``"cuda"``, ``"interpret"``, or None to pick from the device (``kernel_mode``); the
    caller handles the None case (no Triton path) with its torch fallback.
    """
    reason = fallback_reason(hidden_nH) if mode is None else None
    if reason or torch.float64 in (hidden_nH.dtype, weight_VH.dtype):
        raise ConfigError(
            f"loss_type='triton' cannot run here: {reason or 'float64 inputs'}; use loss_type='fused_linear'."
        )
    mode = mode or kernel_mode(hidden_nH.device)
    filter_eps = resolve_filter_eps(filter_eps, _compute_dtype(hidden_nH, weight_VH))
    if accumulate not in ACCUMULATE:
        raise ConfigError(
            f"accumulate={accumulate!r} is not valid; choose 'float32' (float32 gradient buffers, the "
            f"default) or 'input' (gradients accumulated in the inputs' dtype, no float32 buffer)."
        )
    return TritonLinearLogps.apply(
        hidden_nH, weight_VH, targets_n, logit_softcap, with_entropy, filter_eps, mode, accumulate
    )
