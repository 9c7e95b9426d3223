"""Per-token and per-document log-probs of the targets, from hidden states (DPO's, later GRPO's).

The sequence log-prob of document d is the sum, over the positions t whose target
``labels[t + 1]`` belongs to d (``target_doc_ids[t] == d``, see ``common.data.preference_batching``), of
``log softmax(hidden[t] @ W.T)[labels[t + 1]]``. How the per-token values are computed is the
token-loss kernel ``loss_type``, as for SFT:

- ``nll``: full logits ``[B*T, V]`` and ``log_softmax`` (the baseline; Hugging Face and TRL's
  unfused path);
- ``chunked_nll``: the target rows in chunks, each chunk's ``lm_head + log_softmax`` under
  ``torch.utils.checkpoint``;
- ``fused_linear``: ``FusedLinearTokenLogps``, a custom autograd Function that keeps only the
  per-token logsumexp between forward and backward and recomputes one chunk's logits at a
  time in backward: no ``[tokens, V]`` tensor ever, and one ``[V, H]`` gradient buffer;
- ``triton``: twinseq's Triton kernel (``triton_ce.linear_logps``), on CUDA; elsewhere ``fused_linear``,
  with a log line.

``logit_softcap`` (the model's final logit soft-cap, Gemma 2's ``final_logit_softcapping``)
replaces the float32 logits by ``c * tanh(logits / c)`` before the ``log_softmax`` on every path,
as transformers' forward does; the fused backward multiplies by its derivative ``1 - tanh^2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from twinseq.common.config import DEFAULT_CHUNK_SIZE
from twinseq.common.data.preference_batching import PreferenceBatch
from twinseq.common.errors import ConfigError, DataError
from twinseq.common.objectives.grpo import CompletionBatch
from twinseq.common.objectives.nll import shift_labels
from twinseq.torch_backend import triton_ce
from twinseq.torch_backend.losses import apply_logit_softcap, check_logit_softcap, softcap_with_derivative_

LOGPS_LOSS_TYPES = ("nll", "chunked_nll", "fused_linear", "triton")


def _acc(t: torch.Tensor) -> torch.Tensor:
    """fp32 for bf16/fp16/fp32, fp64 for fp64 (tests use it as a tighter reference)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


@dataclass
class TargetRows:
    """The scored positions of a ``PreferenceBatch``, flattened: index into [B*T], target, document."""

    idx_n: torch.Tensor  # long [n]: flattened positions t with a target
    targets_n: torch.Tensor  # long [n]: labels[t + 1]
    doc_n: torch.Tensor  # long [n]: document of that target (0..2N-1, chosen first)
    num_docs: int

    @classmethod
    def of(cls, pbatch: PreferenceBatch | CompletionBatch, vocab_size: int, device: Any) -> "TargetRows":
        doc_N = pbatch.target_doc_ids.reshape(-1)
        idx = np.flatnonzero(doc_N >= 0)
        targets = shift_labels(pbatch.batch.labels).reshape(-1)[idx]
        if targets.size and (targets.min() < 0 or targets.max() >= vocab_size):
            raise DataError(
                f"labels hold values in [{targets.min()}, {targets.max()}], outside the vocabulary "
                f"[0, {vocab_size}); fix the tokenisation or the model's vocab_size."
            )
        as_long = lambda a: torch.as_tensor(a, dtype=torch.long, device=device)  # noqa: E731
        return cls(as_long(idx), as_long(targets), as_long(doc_N[idx]), pbatch.num_docs)


def _picked_logps(logits_cV: torch.Tensor, targets_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target, logsumexp), as ``log_softmax``: ``(x_t - max) - log Σ exp(x - max)``.

    The operation order is torch's ``log_softmax`` (and the JAX backend's), so that every path
    rounds the same intermediates.
    """
    max_c = logits_cV.detach().amax(-1)
    log_sum_c = torch.log(torch.exp(logits_cV - max_c[:, None]).sum(-1))
    picked_c = logits_cV.gather(1, targets_c[:, None])[:, 0] - max_c
    return picked_c - log_sum_c, (log_sum_c + max_c).detach()


def _token_logps_full(hidden_NH, weight_VH, rows: TargetRows, logit_softcap=None) -> torch.Tensor:
    """Baseline: logits for every position ``[B*T, V]`` (padding and prompts included, as Hugging
    Face computes them), ``log_softmax``, then the target of each scored row."""
    logp_NV = F.log_softmax(apply_logit_softcap(_acc(F.linear(hidden_NH, weight_VH)), logit_softcap), dim=-1)
    # gather on all rows (target 0 where none), then pick the scored ones: one [N, V] buffer in backward
    targets_N = torch.zeros(hidden_NH.shape[0], dtype=torch.long, device=hidden_NH.device)
    targets_N[rows.idx_n] = rows.targets_n
    return logp_NV.gather(1, targets_N[:, None])[:, 0].index_select(0, rows.idx_n)


def _chunk_logps(hidden_cH, weight_VH, targets_c, logit_softcap=None):
    return _picked_logps(apply_logit_softcap(_acc(F.linear(hidden_cH, weight_VH)), logit_softcap), targets_c)[0]


def _token_logps_chunked(hidden_nH, weight_VH, targets_n, chunk_size: int, logit_softcap=None) -> torch.Tensor:
    """Checkpointed chunks: naive equivalent ``log_softmax(hidden_nH @ W.T)[arange(n), targets_n]``."""
    parts = [
        checkpoint(
            _chunk_logps,
            hidden_nH[s : s + chunk_size],
            weight_VH,
            targets_n[s : s + chunk_size],
            logit_softcap,
            use_reentrant=False,
        )
        for s in range(0, hidden_nH.shape[0], chunk_size)
    ]
    assert parts, "collate_preference guarantees at least one scored token per document"
    return torch.cat(parts)


class FusedLinearTokenLogps(torch.autograd.Function):
    """Per-token target log-probs from hidden states, chunk by chunk, logits never stored.

    Naive equivalent::

        logits = (hidden_nH @ weight_VH.T).float()
        logits = c * tanh(logits / c)                     # only with a logit_softcap c
        logp_n = log_softmax(logits, -1)[arange(n), targets_n]

    Forward keeps only the per-row logsumexp [n]. Backward gets ``g_n = dL/dlogp_n`` (one
    upstream gradient per token: DPO's is not a constant, unlike a token-mean loss, so the
    gradients cannot be formed in forward), recomputes each chunk's logits and forms
    ``dL/dlogits = g_n (onehot - softmax)`` in place; the weight gradient is accumulated
    in one fp32 ``[V, H]`` buffer. With a soft-cap, that gradient is multiplied by the cap's
    derivative ``1 - tanh^2`` (recomputed with the chunk's logits).
    """

    @staticmethod
    def forward(ctx, hidden_nH, weight_VH, targets_n, chunk_size: int, logit_softcap: Optional[float] = None):
        # Backward runs outside autocast, so the matmul dtype is fixed here and the operands saved in it.
        device_type = hidden_nH.device.type
        compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight_VH.dtype
        h_nH, w_VH = hidden_nH.to(compute), weight_VH.to(compute)
        n = h_nH.shape[0]
        acc_dtype = torch.promote_types(compute, torch.float32)
        logps_n = torch.empty(n, dtype=acc_dtype, device=h_nH.device)
        lse_n = torch.empty(n, dtype=acc_dtype, device=h_nH.device)
        with torch.autocast(device_type, enabled=False):
            for s in range(0, n, chunk_size):
                logits_cV = apply_logit_softcap(_acc(F.linear(h_nH[s : s + chunk_size], w_VH)), logit_softcap)
                logps_n[s : s + chunk_size], lse_n[s : s + chunk_size] = _picked_logps(
                    logits_cV, targets_n[s : s + chunk_size]
                )
                del logits_cV  # else the next chunk's logits are allocated while these are alive
        ctx.save_for_backward(h_nH, w_VH, targets_n, lse_n)
        ctx.chunk_size, ctx.dtypes, ctx.cap = chunk_size, (hidden_nH.dtype, weight_VH.dtype), logit_softcap
        return logps_n

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logps_n):
        hidden_nH, weight_VH, targets_n, lse_n = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty(hidden_nH.shape, dtype=ctx.dtypes[0], device=hidden_nH.device) if need_h else None
        grad_w = torch.zeros(weight_VH.shape, dtype=lse_n.dtype, device=weight_VH.device) if need_w else None
        cs = ctx.chunk_size
        for s in range(0, hidden_nH.shape[0], cs):
            h_cH, t_c, g_c = hidden_nH[s : s + cs], targets_n[s : s + cs], grad_logps_n[s : s + cs].to(lse_n.dtype)
            # dlogp/dlogits = onehot - softmax, scaled by the upstream gradient; in place on the chunk's logits
            logits_cV, dcap_cV = softcap_with_derivative_(_acc(F.linear(h_cH, weight_VH)), ctx.cap, True)
            g_cV = logits_cV.sub_(lse_n[s : s + cs, None]).exp_().mul_(-g_c[:, None])
            g_cV[torch.arange(len(t_c), device=t_c.device), t_c] += g_c
            if dcap_cV is not None:
                g_cV.mul_(dcap_cV)
            if grad_h is not None:
                grad_h[s : s + cs] = g_cV.to(weight_VH.dtype) @ weight_VH
            if grad_w is not None:
                grad_w.addmm_(g_cV.t(), h_cH.to(grad_w.dtype))
            del g_cV, dcap_cV
        return grad_h, None if grad_w is None else grad_w.to(ctx.dtypes[1]), None, None, None


def _entropy(logits_cV: torch.Tensor, lse_c: torch.Tensor) -> torch.Tensor:
    """[c] entropy ``lse - Σ p z`` of ``softmax(z)`` (the stable form of ``-Σ p log p``), with the chunk's logsumexp."""
    return lse_c - (torch.exp(logits_cV - lse_c[:, None]) * logits_cV).sum(-1)


class FusedLinearLogpsEntropy(torch.autograd.Function):
    """Per-token target log-probs and entropies from hidden states, both differentiable, chunk by chunk, logits
    never stored (what GRPO's entropy bonus needs; ``FusedLinearTokenLogps`` without the entropy).

    Naive equivalent::

        z = softcap((hidden_nH @ weight_VH.T).float())   # softcap: only with a logit_softcap c
        logp_n = log_softmax(z)[arange(n), targets_n]
        entropy_n = -(softmax(z) * log_softmax(z)).sum(-1)

    Forward keeps the logsumexp and the entropy per row [n]. Backward recomputes each chunk's logits and forms
    ``dL/dz = g_logp (onehot - p) - g_H p (log p + H)`` (``dH/dz_k = -p_k (log p_k + H)``), times the soft-cap's
    derivative, into one fp32 ``[V, H]`` weight-gradient buffer.
    """

    @staticmethod
    def forward(ctx, hidden_nH, weight_VH, targets_n, chunk_size: int, logit_softcap: Optional[float] = None):
        device_type = hidden_nH.device.type
        compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight_VH.dtype
        h_nH, w_VH = hidden_nH.to(compute), weight_VH.to(compute)
        n = h_nH.shape[0]
        acc_dtype = torch.promote_types(compute, torch.float32)
        logps_n, lse_n, ent_n = (torch.empty(n, dtype=acc_dtype, device=h_nH.device) for _ in range(3))
        with torch.autocast(device_type, enabled=False):
            for s in range(0, n, chunk_size):
                logits_cV = apply_logit_softcap(_acc(F.linear(h_nH[s : s + chunk_size], w_VH)), logit_softcap)
                logps_n[s : s + chunk_size], lse_n[s : s + chunk_size] = _picked_logps(
                    logits_cV, targets_n[s : s + chunk_size]
                )
                ent_n[s : s + chunk_size] = _entropy(logits_cV, lse_n[s : s + chunk_size])
                del logits_cV
        ctx.save_for_backward(h_nH, w_VH, targets_n, lse_n, ent_n)
        ctx.chunk_size, ctx.dtypes, ctx.cap = chunk_size, (hidden_nH.dtype, weight_VH.dtype), logit_softcap
        return logps_n, ent_n

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logps_n, grad_ent_n):
        hidden_nH, weight_VH, targets_n, lse_n, ent_n = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty(hidden_nH.shape, dtype=ctx.dtypes[0], device=hidden_nH.device) if need_h else None
        grad_w = torch.zeros(weight_VH.shape, dtype=lse_n.dtype, device=weight_VH.device) if need_w else None
        zeros = torch.zeros_like(lse_n)
        g_logp_n = zeros if grad_logps_n is None else grad_logps_n.to(lse_n.dtype)
        g_ent_n = zeros if grad_ent_n is None else grad_ent_n.to(lse_n.dtype)
        cs = ctx.chunk_size
        for s in range(0, hidden_nH.shape[0], cs):
            h_cH, t_c = hidden_nH[s : s + cs], targets_n[s : s + cs]
            g_c, ge_c, ent_c = g_logp_n[s : s + cs, None], g_ent_n[s : s + cs, None], ent_n[s : s + cs, None]
            logits_cV, dcap_cV = softcap_with_derivative_(_acc(F.linear(h_cH, weight_VH)), ctx.cap, True)
            logp_cV = logits_cV.sub_(lse_n[s : s + cs, None])
            p_cV = logp_cV.exp()
            # -p (g_logp + g_H (log p + H)), then + g_logp at the target: in place on the log-probs' buffer
            g_cV = logp_cV.add_(ent_c).mul_(ge_c).add_(g_c).mul_(p_cV).neg_()
            del p_cV
            g_cV[torch.arange(len(t_c), device=t_c.device), t_c] += g_c[:, 0]
            if dcap_cV is not None:
                g_cV.mul_(dcap_cV)
            if grad_h is not None:
                grad_h[s : s + cs] = g_cV.to(weight_VH.dtype) @ weight_VH
            if grad_w is not None:
                grad_w.addmm_(g_cV.t(), h_cH.to(grad_w.dtype))
            del g_cV, dcap_cV
        return grad_h, None if grad_w is None else grad_w.to(ctx.dtypes[1]), None, None, None


def _chunk_logps_entropy(hidden_cH, weight_VH, targets_c, logit_softcap=None):
    logits_cV = apply_logit_softcap(_acc(F.linear(hidden_cH, weight_VH)), logit_softcap)
    logp_cV = torch.log_softmax(logits_cV, -1)
    return _picked_logps(logits_cV, targets_c)[0], -(logp_cV.exp() * logp_cV).sum(-1)


def token_logps_entropy(
    hidden_BTH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    rows: TargetRows,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    logit_softcap: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([n] log-probs of the targets, [n] entropies of the predicted distributions) at ``rows.idx_n``, both with their
    gradient (``token_logps`` for the log-probs alone). ``nll``: full logits; ``chunked_nll``: checkpointed chunks
    of both; ``fused_linear`` and ``triton`` (whose kernel has no entropy gradient): ``FusedLinearLogpsEntropy``."""
    if loss_type not in LOGPS_LOSS_TYPES:
        raise ConfigError(f"loss_type={loss_type!r} has no log-prob kernel here; choose one of {LOGPS_LOSS_TYPES}.")
    check_logit_softcap(logit_softcap)
    hidden_nH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1]).index_select(0, rows.idx_n)
    if loss_type == "nll":
        logp_nV = F.log_softmax(apply_logit_softcap(_acc(F.linear(hidden_nH, lm_head_weight_VH)), logit_softcap), -1)
        return logp_nV.gather(1, rows.targets_n[:, None])[:, 0], -(logp_nV.exp() * logp_nV).sum(-1)
    if loss_type == "chunked_nll":
        parts = [
            checkpoint(
                _chunk_logps_entropy,
                hidden_nH[s : s + chunk_size],
                lm_head_weight_VH,
                rows.targets_n[s : s + chunk_size],
                logit_softcap,
                use_reentrant=False,
            )
            for s in range(0, hidden_nH.shape[0], chunk_size)
        ]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return FusedLinearLogpsEntropy.apply(hidden_nH, lm_head_weight_VH, rows.targets_n, chunk_size, logit_softcap)


def token_logps(
    hidden_BTH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    rows: TargetRows,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    logit_softcap: Optional[float] = None,
) -> torch.Tensor:
    """[n] log-probs of the targets at ``rows.idx_n`` (fp32; fp64 for fp64 inputs), from the logits soft-capped
    by ``logit_softcap`` when given (the model's ``final_logit_softcapping``)."""
    if loss_type not in LOGPS_LOSS_TYPES:
        raise ConfigError(
            f"loss_type={loss_type!r} has no log-prob kernel here; choose one of {LOGPS_LOSS_TYPES} "
            f"('liger' is the separate liger_dpo_loss path)."
        )
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ConfigError(f"chunk_size={chunk_size!r} is not valid; pass a positive integer (tokens per chunk).")
    check_logit_softcap(logit_softcap)
    hidden_NH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
    if loss_type == "nll":
        return _token_logps_full(hidden_NH, lm_head_weight_VH, rows, logit_softcap)
    hidden_nH = hidden_NH.index_select(0, rows.idx_n)
    if loss_type == "chunked_nll":
        return _token_logps_chunked(hidden_nH, lm_head_weight_VH, rows.targets_n, chunk_size, logit_softcap)
    if loss_type == "triton" and triton_ce.kernel_runs(hidden_nH):
        return triton_ce.linear_logps(hidden_nH, lm_head_weight_VH, rows.targets_n, logit_softcap=logit_softcap)[0]
    return FusedLinearTokenLogps.apply(hidden_nH, lm_head_weight_VH, rows.targets_n, chunk_size, logit_softcap)


def sequence_logps(
    hidden_BTH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    pbatch: PreferenceBatch,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    logit_softcap: Optional[float] = None,
) -> torch.Tensor:
    """[2N] sequence log-probs (chosen documents, then rejected) from the final hidden states.

    Naive equivalent (``common.data.preference_batching.sequence_logps_from_logits``)::

        logp_BT = log_softmax(softcap(hidden_BTH @ W.T))[b, t, labels[b, t + 1]]
        out[d] = Σ logp_BT[b, t] over (b, t) with target_doc_ids[b, t] == d

    ``logit_softcap``: the model's final logit soft-cap (``softcap`` above is the identity without one).
    """
    rows = TargetRows.of(pbatch, lm_head_weight_VH.shape[0], hidden_BTH.device)
    logps_n = token_logps(hidden_BTH, lm_head_weight_VH, rows, loss_type, chunk_size, logit_softcap=logit_softcap)
    return logps_n.new_zeros(rows.num_docs).index_add(0, rows.doc_n, logps_n)


def shard_target_rows(targets_BL: torch.Tensor, doc_BL: torch.Tensor, num_docs: int, vocab_size: int) -> TargetRows:
    """``TargetRows`` of one context-parallel shard: its already shifted ``targets`` and their documents
    (``common.data.context_parallel.shard_doc_ids``), both [B, T / cp] in the same zigzag order."""
    doc_N, targets_N = doc_BL.reshape(-1), targets_BL.reshape(-1)
    idx = torch.nonzero(doc_N >= 0).reshape(-1)
    targets = targets_N.index_select(0, idx)
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise DataError(
            f"labels hold values in [{int(targets.min())}, {int(targets.max())}], outside the vocabulary "
            f"[0, {vocab_size}); fix the tokenisation or the model's vocab_size."
        )
    return TargetRows(idx, targets, doc_N.index_select(0, idx), num_docs)


def local_sequence_logps(
    hidden_BLH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    rows: TargetRows,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    logit_softcap: Optional[float] = None,
) -> torch.Tensor:
    """[2N] per-document sums of the log-probs of the targets ``rows`` holds (a context-parallel shard's share of
    ``sequence_logps``: summed over the cp ranks, the shares give the sequence log-probs).

    A shard without any target still returns a result that depends on ``hidden_BLH`` (with a zero gradient), so
    its backward runs through the model as its peers' does (their collectives need this rank's part)."""
    if rows.idx_n.numel() == 0:
        zero = 0.0 * (hidden_BLH.sum() + lm_head_weight_VH.sum())
        return hidden_BLH.new_zeros(rows.num_docs, dtype=_acc(hidden_BLH).dtype) + zero
    logps_n = token_logps(hidden_BLH, lm_head_weight_VH, rows, loss_type, chunk_size, logit_softcap=logit_softcap)
    return logps_n.new_zeros(rows.num_docs).index_add(0, rows.doc_n, logps_n)
