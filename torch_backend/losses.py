"""Causal-LM losses from the last hidden state: full, chunked, fused, Liger and Triton.

All five compute the same number (``twinseq.common.objectives.nll.nll_loss`` is the reference):

    targets = labels shifted left by one (last position -100)
    logits = hidden @ W.T + b, in float32; with ``logit_softcap`` c: c * tanh(logits / c)
    loss = sum over targets != -100 of CE(logits, target) / num_items_in_batch

``logit_softcap`` is the model's final logit soft-cap (Gemma 2's ``final_logit_softcapping``),
applied to the float32 logits in transformers' operation order; every path caps the same
values, and the fused path differentiates through it (``d capped / d logits = 1 - (capped / c)^2``).

They differ only in what they keep in memory:

- ``nll``: the full [N, V] logits (and their gradient), as Hugging Face does.
- ``chunked_nll``: chunks of ``chunk_size`` tokens, each (lm_head + CE) checkpointed, so only
  one chunk's logits live at a time, in forward and in backward (TRL's approach). The lm_head
  matmul runs twice, and autograd sums one [V, H] weight gradient per chunk, so its peak
  holds two or three [V, H] buffers: it only wins when N x V is much larger than V x H.
- ``fused_linear``: the gradients w.r.t. hidden and the lm_head are computed chunk by chunk in
  the forward pass (Liger's approach); only ``grad_hidden`` [N, H] and ``grad_weight`` [V, H]
  are kept. No [N, V] tensor is ever materialised.
- ``liger``: Liger's Triton kernel (CUDA only, ``pip install -e '.[gpu]'``).
- ``triton``: twinseq's own Triton kernel (``triton_ce``): no [N, V] tensor in forward or backward, and
  no chunk of it either; tiles of logits live in registers. Without CUDA it runs ``fused_linear`` and logs so.

Chunked and fused paths first gather the rows whose target is valid, so ignored tokens
(prompt, padding, document starts) cost nothing.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import numbers
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from twinseq.common.config import DEFAULT_CHUNK_SIZE, LOSS_TYPES, TrainConfig
from twinseq.common.data.batching import Batch
from twinseq.common.errors import ConfigError, ConfigTypeError, DataError
from twinseq.common.objectives.moe import COUNTS_KEY
from twinseq.common.objectives.nll import IGNORE_INDEX, check_num_items
from twinseq.common.run.capabilities import GPU_EXTRA as _GPU_EXTRA
from twinseq.torch_backend import context_parallel as cpmod
from twinseq.torch_backend import triton_ce
from twinseq.torch_backend.attention import forward_hidden, forward_outputs, mask_layout
from twinseq.torch_backend.unwrap import causal_lm_of, lm_head_weight

logger = logging.getLogger(__name__)


def shift_labels(labels_BT: torch.Tensor) -> torch.Tensor:
    """``targets[:, t] = labels[:, t + 1]``, the last position -100 (see common/objectives/nll.py)."""
    return F.pad(labels_BT[:, 1:], (0, 1), value=IGNORE_INDEX)


def _check_inputs(hidden_BTH, weight_VH, labels_BT, bias_V) -> None:
    if hidden_BTH.dim() != 3 or labels_BT.shape != hidden_BTH.shape[:2]:
        raise ConfigError(
            f"hidden must be [B, T, H] and labels [B, T]; got hidden {tuple(hidden_BTH.shape)} "
            f"and labels {tuple(labels_BT.shape)}; pass the final hidden states and the labels of one batch."
        )
    if weight_VH.dim() != 2 or weight_VH.shape[1] != hidden_BTH.shape[2]:
        raise ConfigError(
            f"lm_head_weight must be [V, H] with H={hidden_BTH.shape[2]}; got "
            f"{tuple(weight_VH.shape)} (pass lm_head.weight, not its transpose)."
        )
    if bias_V is not None and bias_V.shape != weight_VH.shape[:1]:
        raise ConfigError(
            f"lm_head_bias must be [V]={weight_VH.shape[0]}, got {tuple(bias_V.shape)}; pass lm_head.bias or None."
        )
    if labels_BT.dtype.is_floating_point:
        raise ConfigTypeError(f"labels must be an integer tensor, got {labels_BT.dtype}; pass token ids (torch.long).")


def _num_valid_checked(targets_N: torch.Tensor, vocab_size: int, num_items_in_batch) -> tuple[int, int]:
    """(valid target count, denominator), after checking labels and ``num_items_in_batch``.

    One host sync for the three statistics.
    """
    valid_N = targets_N != IGNORE_INDEX
    num_valid, lowest, highest = 0, 0, 0
    if targets_N.numel():
        # ignored targets count as 0, which is in range, so min/max see only the valid ones
        in_vocab_N = torch.where(valid_N, targets_N, 0)
        num_valid, lowest, highest = torch.stack([valid_N.sum(), in_vocab_N.amin(), in_vocab_N.amax()]).tolist()
    if num_valid and (lowest < 0 or highest >= vocab_size):
        raise DataError(
            f"labels hold values outside the vocabulary [0, {vocab_size}) that are not the ignore "
            f"index {IGNORE_INDEX} (min {lowest}, max {highest}); fix the tokenisation or vocab_size."
        )
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.item()
    check_num_items(num_items_in_batch, num_valid)
    return num_valid, max(int(num_items_in_batch), 1)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 (tests use it as a tighter reference)."""
    return torch.promote_types(dtype, torch.float32)


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(_acc_dtype(logits.dtype))


def apply_logit_softcap(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` in the operation order of transformers (``/``, ``tanh``, ``*``), so that
    float32 results are bitwise those of HF's ``Gemma2ForCausalLM``; ``logits`` unchanged when ``cap`` is None.

    >>> apply_logit_softcap(torch.tensor([0.0, 100.0]), 2.0).tolist()
    [0.0, 2.0]
    """
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def _capped_logits(hidden_NH, weight_VH, bias_V, logit_softcap):
    """float32 (fp64 for fp64) logits of the lm_head, soft-capped after the upcast when ``logit_softcap`` is set."""
    return apply_logit_softcap(_upcast(F.linear(hidden_NH, weight_VH, bias_V)), logit_softcap)


@torch.no_grad()
def _metric_sums(logits_NV: torch.Tensor, targets_N: torch.Tensor, row_chunk: int = 1024) -> torch.Tensor:
    """[2], accumulation dtype: (valid targets that are the argmax, sum of entropies over valid targets).

    Rows are processed ``row_chunk`` at a time so that the softmax temporary stays small.
    """
    sums = torch.zeros(2, dtype=_acc_dtype(logits_NV.dtype), device=logits_NV.device)
    for start in range(0, logits_NV.shape[0], row_chunk):
        logits = _upcast(logits_NV[start : start + row_chunk])
        targets = targets_N[start : start + row_chunk]
        valid = targets != IGNORE_INDEX
        lse = torch.logsumexp(logits, -1)
        probs = torch.exp(logits - lse[:, None])
        # entropy = lse - sum_v p_v * logit_v; the batched dot avoids a second [rows, V] temporary
        ent = lse - torch.bmm(probs[:, None, :], logits[:, :, None])[:, 0, 0]
        sums[0] += ((logits.argmax(-1) == targets) & valid).sum()
        sums[1] += torch.where(valid, ent, 0.0).sum()
        del logits, probs  # free before the next slice's temporaries
    return sums


def _metrics_dict(sums: torch.Tensor, num_valid: int) -> dict:
    num_correct, entropy_sum = sums.tolist()
    return {
        "mean_token_accuracy": num_correct / num_valid if num_valid else 0.0,
        "entropy": entropy_sum / num_valid if num_valid else 0.0,
        "num_tokens": num_valid,
        "num_correct_tokens": int(round(num_correct)),
        "entropy_sum": entropy_sum,
    }


def _nll(hidden_NH, weight_VH, bias_V, targets_N, want_metrics, logit_softcap=None):
    logits_NV = _capped_logits(hidden_NH, weight_VH, bias_V, logit_softcap)
    loss_sum = F.cross_entropy(logits_NV, targets_N, ignore_index=IGNORE_INDEX, reduction="sum")
    sums = _metric_sums(logits_NV.detach(), targets_N) if want_metrics else None
    return loss_sum, sums


def _chunk_ce(hidden_cH, weight_VH, bias_V, targets_c, want_metrics, logit_softcap=None):
    logits_cV = _capped_logits(hidden_cH, weight_VH, bias_V, logit_softcap)
    loss_sum = F.cross_entropy(logits_cV, targets_c, ignore_index=IGNORE_INDEX, reduction="sum")
    sums = _metric_sums(logits_cV.detach(), targets_c) if want_metrics else None
    return loss_sum, sums


def _chunked_nll(hidden_nH, weight_VH, bias_V, targets_n, chunk_size, want_metrics, logit_softcap=None):
    """Checkpointed chunks over the valid rows. Naive equivalent: ``_nll`` on the same rows."""
    loss_sum, sums = 0.0, torch.zeros(2, dtype=_acc_dtype(hidden_nH.dtype), device=hidden_nH.device)
    # max(n, 1): an empty input still runs one (empty) chunk so the weight gets a zero gradient
    for start in range(0, max(hidden_nH.shape[0], 1), chunk_size):
        end = start + chunk_size
        part, part_sums = checkpoint(
            _chunk_ce,
            hidden_nH[start:end],
            weight_VH,
            bias_V,
            targets_n[start:end],
            want_metrics,
            logit_softcap,
            use_reentrant=False,
        )
        loss_sum = loss_sum + part
        if want_metrics:
            sums += part_sums
    return loss_sum, (sums if want_metrics else None)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Loss and lm_head/hidden gradients, chunk by chunk, in one forward pass.

    ``valid_idx_n`` lists the rows of ``hidden_NH`` whose target is not -100; only those rows
    are computed. Naive equivalent::

        logits = (hidden_NH @ weight_VH.T + bias_V).float()
        logits = c * tanh(logits / c)                     # only with a logit_softcap c
        loss = F.cross_entropy(logits, targets_N, ignore_index=-100, reduction="sum") / denom

    Forward keeps ``grad_hidden`` [N, H] (input dtype) and ``grad_weight`` [V, H] (fp32
    accumulator), never a [n, V] tensor: each chunk's fp32 logits are turned in place into
    ``(softmax - onehot) / denom`` and multiplied out at once. Backward only rescales them by
    ``grad_output``. A gradient is computed only for inputs that need it (a frozen lm_head, as
    with LoRA, skips the [V, H] buffer and a third of the FLOPs). Backward runs once.

    With a soft-cap, the logit gradient is that of the capped logits times ``1 - tanh^2``, the
    derivative of ``c * tanh(x / c)``; it costs one more [c, V] buffer per chunk.
    """

    @staticmethod
    def forward(
        ctx,
        hidden_NH,
        weight_VH,
        bias_V,
        targets_N,
        valid_idx_n,
        denom: int,
        chunk_size: int,
        want_metrics: bool,
        logit_softcap: Optional[float] = None,
    ):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        targets_n = targets_N.index_select(0, valid_idx_n)
        n, V = targets_n.shape[0], weight_VH.shape[0]
        acc = dict(device=hidden_NH.device, dtype=_acc_dtype(weight_VH.dtype))
        loss_sum, sums = torch.zeros((), **acc), torch.zeros(2, **acc)
        grad_h = torch.zeros_like(hidden_NH) if need_h else None  # ignored rows keep an exact zero
        grad_w = torch.zeros(weight_VH.shape, **acc) if need_w else None
        grad_b = torch.zeros(V, **acc) if need_b and bias_V is not None else None
        for start in range(0, n, chunk_size):
            rows_c, t_c = valid_idx_n[start : start + chunk_size], targets_n[start : start + chunk_size]
            h_cH = hidden_NH.index_select(0, rows_c)  # per chunk: no [n, H] copy of the valid rows
            need_grad = need_h or need_w or need_b
            logits_cV, dcap_cV = softcap_with_derivative_(
                _upcast(F.linear(h_cH, weight_VH, bias_V)), logit_softcap, need_grad
            )
            if want_metrics:
                sums += _metric_sums(logits_cV, t_c)
            chunk_loss, g_cV = _ce_and_logit_grad_(logits_cV, t_c, denom, need_grad)
            if g_cV is not None and dcap_cV is not None:
                g_cV.mul_(dcap_cV)
            loss_sum += chunk_loss
            if g_cV is not None:
                _accumulate_chunk_grads(g_cV, h_cH, weight_VH, grad_h, grad_w, grad_b, rows_c)
            del logits_cV, g_cV, dcap_cV  # else the next chunk's logits are allocated while these are alive
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden_NH.dtype, weight_VH.dtype, None if bias_V is None else bias_V.dtype)
        ctx.mark_non_differentiable(sums)
        return loss_sum / denom, sums

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_sums):
        if ctx.grads is None:
            raise RuntimeError(
                "the fused_linear loss frees its stored gradients in backward, so it can be "
                "backpropagated once only; recompute the loss instead of retain_graph=True."
            )
        grads, ctx.grads = ctx.grads, None  # drop our reference so autograd can take the buffers without a copy
        if not bool(grad_loss == 1.0):
            for g in grads:
                if g is not None:
                    g.mul_(grad_loss.to(g.dtype))
        grad_h, grad_w, grad_b = (None if g is None else g.to(dt) for g, dt in zip(grads, ctx.dtypes))
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def softcap_with_derivative_(logits_cV, cap: Optional[float], need_grad: bool):
    """(``cap * tanh(logits / cap)``, its derivative ``1 - tanh^2`` or None), reusing ``logits_cV``'s buffer.

    The capped values are bitwise ``apply_logit_softcap``'s (same operations, same order).
    """
    if cap is None:
        return logits_cV, None
    tanh_cV = logits_cV.div_(cap).tanh_()
    dcap_cV = tanh_cV.square().neg_().add_(1.0) if need_grad else None
    return tanh_cV.mul_(cap), dcap_cV


def _ce_and_logit_grad_(logits_cV, targets_c, denom: int, need_grad: bool):
    """(sum of CE over the chunk, ``(softmax - onehot) / denom`` or None), overwriting ``logits_cV``.

    The softmax is taken in place so that a chunk never needs a second [c, V] buffer.
    """
    target_logit_c = logits_cV.gather(1, targets_c[:, None])[:, 0]
    max_c1 = logits_cV.amax(-1, keepdim=True)
    probs_cV = logits_cV.sub_(max_c1).exp_()
    sumexp_c1 = probs_cV.sum(-1, keepdim=True)
    loss_sum = (max_c1 + sumexp_c1.log())[:, 0].sub(target_logit_c).sum()
    if not need_grad:
        return loss_sum, None
    g_cV = probs_cV.div_(sumexp_c1 * denom)
    g_cV[torch.arange(len(targets_c), device=targets_c.device), targets_c] -= 1.0 / denom
    return loss_sum, g_cV


def _accumulate_chunk_grads(g_cV, h_cH, weight_VH, grad_h, grad_w, grad_b, rows_c):
    """Add one chunk's logit gradient ``g_cV`` (fp32) into the weight/bias gradients and write
    its hidden gradient to the rows ``rows_c`` of ``grad_h``."""
    g_low = g_cV.to(weight_VH.dtype)
    if grad_h is not None:
        # under autocast the matmul comes out in the autocast dtype (bf16), not the hidden states'
        grad_h.index_copy_(0, rows_c, (g_low @ weight_VH).to(grad_h.dtype))
    if grad_w is not None:
        if h_cH.dtype == grad_w.dtype:
            grad_w.addmm_(g_cV.t(), h_cH)
        else:  # low-precision matmul, fp32 accumulation across chunks
            grad_w += (g_low.t() @ h_cH).float()
    if grad_b is not None:
        grad_b += g_cV.sum(0)


def _liger(hidden_nH, weight_VH, bias_V, targets_n, logit_softcap=None):
    if not hidden_nH.is_cuda:
        raise ConfigError(
            f"loss_type='liger' needs CUDA (Liger's kernels are Triton); the hidden states are on "
            f"{hidden_nH.device}. Use loss_type='fused_linear', the CPU implementation of the same "
            f"fused loss, or run on a GPU with `{_GPU_EXTRA}`."
        )
    if importlib.util.find_spec("liger_kernel") is None:
        raise ImportError(
            f"loss_type='liger' needs the liger-kernel package; install the gpu extra with "
            f"`{_GPU_EXTRA}`, or use loss_type='fused_linear'."
        )
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # optional dependency

    kwargs = dict(ignore_index=IGNORE_INDEX, reduction="sum")
    if logit_softcap is not None:
        if "softcap" not in inspect.signature(LigerFusedLinearCrossEntropyLoss.__init__).parameters:
            raise ConfigError(
                f"loss_type='liger': this liger-kernel version has no softcap option, and the model "
                f"soft-caps its logits (final_logit_softcapping={logit_softcap}); upgrade liger-kernel "
                f"(`{_GPU_EXTRA}`) or use loss_type='fused_linear'."
            )
        kwargs["softcap"] = logit_softcap
    out = LigerFusedLinearCrossEntropyLoss(**kwargs)(weight_VH, hidden_nH, targets_n, bias_V)
    # newer liger versions may return (loss, z_loss, ...) or an output object
    out = getattr(out, "loss", out)
    return out[0] if isinstance(out, tuple) else out


def liger_chunked_loss(name: str) -> Any:
    """Liger's chunked preference/RL loss class ``name`` (``LigerFusedLinearDPOLoss``, ``...KTOLoss``,
    ``...GRPOLoss``): plain torch modules, so they run wherever torch does; a run asks for CUDA before it builds
    (``common.run.capabilities``)."""
    if importlib.util.find_spec("liger_kernel") is None:
        raise ImportError(
            f"{name} is liger-kernel's; install it (the dev and gpu extras: `{_GPU_EXTRA}`), or use "
            f"loss_type='fused_linear'."
        )
    from liger_kernel import chunked_loss  # optional dependency

    return getattr(chunked_loss, name)


def check_logit_softcap(logit_softcap) -> None:
    """``ConfigError`` unless ``logit_softcap`` is None or a positive number (a cap of 0 would divide by 0)."""
    if logit_softcap is None:
        return
    if isinstance(logit_softcap, bool) or not isinstance(logit_softcap, numbers.Real) or not logit_softcap > 0:
        raise ConfigError(
            f"logit_softcap={logit_softcap!r} must be a positive number (the model's "
            f"final_logit_softcapping) or None for no cap: pass one of those."
        )


def _valid_rows(targets_N):
    """Indices of the rows with a valid target (the shift leaves at least one ignored per row)."""
    return torch.nonzero(targets_N != IGNORE_INDEX).squeeze(1)


def causal_lm_loss(
    hidden_BTH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_BT: torch.Tensor,
    num_items_in_batch: Union[int, torch.Tensor],
    loss_type: str = "nll",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_metrics: bool = False,
    lm_head_bias: Optional[torch.Tensor] = None,
    targets_are_shifted: bool = False,
    logit_softcap: Optional[float] = None,
    triton_gradients: str = "exact",
):
    """Next-token cross-entropy from the last hidden state, normalised by the whole step.

    In: ``hidden_BTH`` (final-norm output), ``lm_head_weight_VH`` (``lm_head.weight``),
    ``labels_BT`` unshifted with -100 = ignore, ``num_items_in_batch`` = labels != -100 over
    the whole optimizer step. Out: a 0-dim loss (fp32; fp64 for fp64 inputs),
    ``sum(CE) / num_items_in_batch`` (0 when nothing is valid), and with ``return_metrics`` also a dict
    ``{"mean_token_accuracy", "entropy", "num_tokens", "num_correct_tokens", "entropy_sum"}``
    over this micro-batch's valid targets (the sums let a trainer aggregate a step exactly).

    ``loss_type`` is one of ``common.config.LOSS_TYPES``; ``chunk_size`` is the tokens per
    chunk of ``chunked_nll`` and ``fused_linear``. ``targets_are_shifted=True`` means
    ``labels_BT`` already holds the targets (``labels[t + 1]`` at t), as a context-parallel
    shard does (``common.data.context_parallel.shard_batch``): they are used as they are.
    ``logit_softcap`` is the model's final logit soft-cap ``c`` (``final_logit_softcapping``; None:
    none): every loss type computes the cross-entropy of ``c * tanh(logits / c)``.
    """
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"loss_type={loss_type!r} is not valid; choose one of {LOSS_TYPES}.")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ConfigError(f"chunk_size={chunk_size!r} is not valid; pass a positive integer (tokens per chunk).")
    check_logit_softcap(logit_softcap)
    _check_inputs(hidden_BTH, lm_head_weight_VH, labels_BT, lm_head_bias)
    hidden_NH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
    targets_N = (labels_BT if targets_are_shifted else shift_labels(labels_BT)).reshape(-1).long()
    num_valid, denom = _num_valid_checked(targets_N, lm_head_weight_VH.shape[0], num_items_in_batch)
    args = (lm_head_weight_VH, lm_head_bias)
    if loss_type == "nll":
        loss_sum, sums = _nll(hidden_NH, *args, targets_N, return_metrics, logit_softcap)
        loss = loss_sum / denom
    elif loss_type == "triton" and triton_ce.kernel_runs(hidden_NH, lm_head_bias):
        loss, sums = _triton_loss(
            hidden_NH, lm_head_weight_VH, targets_N, denom, return_metrics, logit_softcap, triton_gradients
        )
    elif loss_type in ("fused_linear", "triton"):
        loss, sums = FusedLinearCrossEntropy.apply(
            hidden_NH, *args, targets_N, _valid_rows(targets_N), denom, chunk_size, return_metrics, logit_softcap
        )
    else:
        idx = _valid_rows(targets_N)
        hidden_nH, targets_n = hidden_NH.index_select(0, idx), targets_N.index_select(0, idx)
        if loss_type == "chunked_nll":
            loss_sum, sums = _chunked_nll(hidden_nH, *args, targets_n, chunk_size, return_metrics, logit_softcap)
            loss = loss_sum / denom
        else:
            loss = _liger(hidden_nH, *args, targets_n, logit_softcap) / denom
            # Liger returns no logits, so metrics cost one extra no-grad lm_head pass, chunked
            sums = (
                _metric_sums_chunked(hidden_nH, *args, targets_n, chunk_size, logit_softcap) if return_metrics else None
            )
    if not return_metrics:
        return loss
    return loss, _metrics_dict(sums, num_valid)


def _triton_loss(hidden_NH, weight_VH, targets_N, denom, want_metrics, logit_softcap, gradients="exact"):
    # every row goes in: the kernel visits only those with a target (no gathered copy of the hidden states), and
    # an ignored row's log-prob, entropy and hit are 0
    cce = gradients == "cce"  # cut cross-entropy's numerics: its gradient filter, input-dtype accumulation
    logp_n, ent_n, hit_n = triton_ce.linear_logps(
        hidden_NH,
        weight_VH,
        targets_N,
        logit_softcap=logit_softcap,
        with_entropy=want_metrics,
        filter_eps="auto" if cce else None,
        accumulate="input" if cce else "float32",
    )
    loss = -logp_n.sum() / denom
    sums = torch.stack([hit_n.sum(), ent_n.detach().sum()]) if want_metrics else None
    return loss, sums


@torch.no_grad()
def _metric_sums_chunked(hidden_nH, weight_VH, bias_V, targets_n, chunk_size, logit_softcap=None):
    sums = torch.zeros(2, dtype=_acc_dtype(hidden_nH.dtype), device=hidden_nH.device)
    for start in range(0, hidden_nH.shape[0], chunk_size):
        logits_cV = _capped_logits(hidden_nH[start : start + chunk_size], weight_VH, bias_V, logit_softcap)
        sums += _metric_sums(logits_cV, targets_n[start : start + chunk_size])
        del logits_cV
    return sums


def final_logit_softcap(model: torch.nn.Module) -> Optional[float]:
    """The model's final logit soft-cap ``c`` (logits become ``c * tanh(logits / c)``), or None.

    Gemma 2 has one (``final_logit_softcapping``); the other families have none. Every loss and
    log-prob path takes it as ``logit_softcap``.
    """
    return getattr(model.config, "final_logit_softcapping", None)


# --------------------------------------------------------------------------------------
# The Mixture-of-Experts load-balancing loss
# --------------------------------------------------------------------------------------


def router_aux_loss_weight(causal_lm: torch.nn.Module) -> Optional[float]:
    """``router_aux_loss_coef`` of a MoE model whose config sets ``output_router_logits`` (transformers' switch for
    adding the aux loss to the training loss); None for any other model."""
    config = causal_lm_of(causal_lm).config
    if not getattr(config, "output_router_logits", False) or not getattr(config, "num_experts", 0):
        return None
    return float(config.router_aux_loss_coef)


def router_aux_loss(causal_lm: torch.nn.Module, router_logits, segment_ids_BT) -> torch.Tensor:
    """transformers' own ``load_balancing_loss_func`` of the router logits (one ``[B * T, E]`` per MoE layer) over
    the real tokens of the batch (``segment_ids != 0`` as its ``attention_mask``: padding never counts). Qwen3-MoE's
    copy of the function serves Mixtral too: transformers' two copies are the same code, and Mixtral's config answers
    ``num_experts`` for its ``num_local_experts``."""
    config = causal_lm_of(causal_lm).config
    mask_BT = torch.as_tensor(segment_ids_BT != 0, device=router_logits[0].device)
    return load_balancing_loss_func(tuple(router_logits), config.num_experts, config.num_experts_per_tok, mask_BT)


def is_moe(causal_lm: torch.nn.Module) -> bool:
    """Whether the model routes tokens to experts (qwen3_moe, mixtral, gpt_oss: its config has ``num_experts``)."""
    return bool(getattr(causal_lm_of(causal_lm).config, "num_experts", 0))


@torch.no_grad()
def router_counts(router_logits, segment_ids_BT, top_k: int) -> torch.Tensor:
    """int64 [L, E]: per MoE layer, the routing slots each expert got from the real tokens (``segment_ids != 0``),
    from the router logits (one ``[B * T, E]`` per MoE layer); ``common.objectives.moe.router_counts`` is the numpy
    reference (the top-k of the float32 logits: the model's selection, whose softmax keeps their order)."""
    mask_N = torch.as_tensor(segment_ids_BT != 0, device=router_logits[0].device).reshape(-1)
    rows = []
    for logits_NE in router_logits:
        experts_NK = torch.topk(logits_NE.float(), top_k, dim=-1).indices
        picks_NE = torch.zeros_like(logits_NE, dtype=torch.int64).scatter_(1, experts_NK, 1)
        rows.append((picks_NE * mask_N[:, None]).sum(dim=0))
    return torch.stack(rows)


def _data_ranks() -> int:
    """The ranks whose gradients are summed (1 in one process; context parallelism is refused with the aux loss)."""
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def sft_loss_with_aux(
    causal_lm,
    batch: Batch,
    attn_implementation,
    num_micro_batches: int = 1,
    router_stats: bool = False,
    **loss_kwargs,
):
    """``causal_lm_loss`` of ``batch`` (``loss_kwargs`` passed on), plus, for a MoE model with
    ``output_router_logits``, ``router_aux_loss_coef * aux_loss / num_micro_batches``.

    The NLL is normalised by the whole step's ``num_items_in_batch``, so a step's micro-batch losses add up to the
    step's loss; the aux loss is a mean over one micro-batch's tokens, so it is divided by the step's micro-batch
    count: the step then adds the coefficient times the mean of its micro-batches' aux losses (TRL's rule), and one
    micro-batch gives transformers' ``loss + coef * aux_loss``. Returns what ``causal_lm_loss`` returns; with
    metrics, they gain ``aux_loss`` (this micro-batch's, unweighted), and with ``router_stats`` (a MoE model) the
    micro-batch's ``router_counts`` [L, E] (``router_counts``; the trainer's step adds them up).
    """
    weight = router_aux_loss_weight(causal_lm)
    stats = router_stats and is_moe(causal_lm)
    out = forward_outputs(causal_lm, batch, attn_implementation, output_router_logits=weight is not None or stats)
    labels_BT = torch.as_tensor(batch.labels, dtype=torch.long, device=out.last_hidden_state.device)
    result = causal_lm_loss(
        out.last_hidden_state, lm_head_weight(causal_lm), labels_BT, batch.num_items_in_batch, **loss_kwargs
    )
    if stats and isinstance(result, tuple):
        top_k = causal_lm_of(causal_lm).config.num_experts_per_tok
        result = result[0], {**result[1], COUNTS_KEY: router_counts(out.router_logits, batch.segment_ids, top_k)}
    if weight is None:
        return result
    aux = router_aux_loss(causal_lm, out.router_logits, batch.segment_ids)
    extra = (weight / num_micro_batches) * aux.to(out.last_hidden_state.device)
    if isinstance(result, tuple):
        loss, metrics = result
        return loss + extra, {**metrics, "aux_loss": aux.detach()}
    return result + extra


# --------------------------------------------------------------------------------------
# The model's body and its loss in one module (one FSDP root)
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
        if isinstance(micro, Batch):
            hidden = forward_hidden(self.causal_lm, micro, self.cfg.model.attn_implementation)
            return hidden, torch.as_tensor(micro.labels, dtype=torch.long, device=hidden.device), False
        ctx = cpmod.make_context(
            micro,
            self.cp_group,
            self.cfg.parallel.context_parallel_strategy,
            mask_layout(self.causal_lm.config).sliding_window,
        )
        out = causal_lm_of(self.causal_lm).model(
            input_ids=micro.input_ids, position_ids=micro.position_ids, use_cache=False, **{cpmod.CP_KWARG: ctx}
        )
        return out.last_hidden_state, micro.targets, True

    def forward(self, micro, router_stats: bool = False):
        """``micro``: a ``Batch`` or ``CPShard`` (the SFT loss), or a function of the causal LM (online RL's policy
        forward), run here so that an engine wrapping this module gathers the root parameters around it.

        ``router_stats``: a MoE model's ``Batch`` adds its ``router_counts`` to the metrics (the SFT trainer's
        micro-steps ask; a context-parallel shard has none: its router logits cover part of each sequence)."""
        if callable(micro):
            return micro(self.causal_lm)
        stats = router_stats and is_moe(self.causal_lm)
        if isinstance(micro, Batch) and (router_aux_loss_weight(self.causal_lm) is not None or stats):
            return sft_loss_with_aux(
                self.causal_lm,
                micro,
                self.cfg.model.attn_implementation,
                # a per-micro-batch mean: divided by the step's micro-batches over every rank (gradients are summed
                # over ranks), so the step adds the coefficient times their mean, as TRL (its ranks average)
                self.cfg.data.gradient_accumulation_steps * _data_ranks(),
                router_stats=stats,
                loss_type=self.cfg.loss.loss_type,
                chunk_size=self.cfg.loss.loss_chunk_size,
                return_metrics=True,
                logit_softcap=final_logit_softcap(self.causal_lm),
                triton_gradients=self.cfg.loss.triton_gradients,
            )
        if router_aux_loss_weight(self.causal_lm) is not None:
            raise ConfigError(
                "output_router_logits=True (the MoE load-balancing loss) is not built for context-parallel shards "
                "(the router logits of a shard cover part of each sequence); set output_router_logits to false in "
                "the model's config.json, or drop context parallelism."
            )
        hidden_BTH, labels_BT, shifted = self._hidden(micro)
        return causal_lm_loss(
            hidden_BTH,
            lm_head_weight(self.causal_lm),
            labels_BT,
            micro.num_items_in_batch,
            self.cfg.loss.loss_type,
            chunk_size=self.cfg.loss.loss_chunk_size,
            return_metrics=True,
            targets_are_shifted=shifted,
            logit_softcap=final_logit_softcap(self.causal_lm),
            triton_gradients=self.cfg.loss.triton_gradients,
        )
