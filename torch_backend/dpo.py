"""DPO for the torch backend: sequence log-probs from hidden states, the loss family, the trainer.

A preference micro-batch (``common.dpo_batching.PreferenceBatch``) holds 2N documents, chosen
then rejected, padded (one per row) or padding-free (all in one row). The policy's sequence
log-prob of document d is the sum, over the positions t whose target ``labels[t + 1]`` belongs
to d (``target_doc_ids[t] == d``), of ``log softmax(hidden[t] @ W.T)[labels[t + 1]]``.

How the per-token log-probs are computed is ``loss_type`` (the token-loss kernel of
``TrainConfig``), as for SFT:

- ``nll``: full logits ``[B*T, V]`` and ``log_softmax`` (the baseline; Hugging Face and TRL's
  unfused path);
- ``chunked_nll``: the target rows in chunks, each chunk's ``lm_head + log_softmax`` under
  ``torch.utils.checkpoint``;
- ``fused_linear``: ``FusedLinearTokenLogps``, a custom autograd Function that keeps only the
  per-token logsumexp between forward and backward and recomputes one chunk's logits at a
  time in backward: no ``[tokens, V]`` tensor ever, and one ``[V, H]`` gradient buffer;
- ``liger``: Liger's ``LigerFusedLinearDPOLoss`` (CUDA, padded, 'sigmoid', live reference).

The loss family mirrors ``common.dpo`` (the float64 numpy reference, TRL 1.16 semantics); a
micro-batch's loss is ``Σ_n Σ_k w_k L_k[n] / examples_per_step`` so that accumulated
micro-batches give the full batch's mean over pairs.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from twinseq.common.config import TrainConfig
from twinseq.common.dpo import DPOLossConfig, reward_metrics, validate_dpo_config
from twinseq.common.dpo_batching import PreferenceBatch
from twinseq.common.loss import shift_labels

logger = logging.getLogger(__name__)

LOGPS_LOSS_TYPES = ("nll", "chunked_nll", "fused_linear")
DEFAULT_CHUNK_SIZE = 256
_GPU_EXTRA = "pip install -e '.[gpu]'"


def _acc(t: torch.Tensor) -> torch.Tensor:
    """fp32 for bf16/fp16/fp32, fp64 for fp64 (tests use it as a tighter reference)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


# --------------------------------------------------------------------------------------
# Per-token log-probs of the targets
# --------------------------------------------------------------------------------------


@dataclass
class TargetRows:
    """The scored positions of a ``PreferenceBatch``, flattened: index into [B*T], target, document."""

    idx_n: torch.Tensor       # long [n]: flattened positions t with a target
    targets_n: torch.Tensor   # long [n]: labels[t + 1]
    doc_n: torch.Tensor       # long [n]: document of that target (0..2N-1, chosen first)
    num_docs: int

    @classmethod
    def of(cls, pbatch: PreferenceBatch, vocab_size: int, device: Any) -> "TargetRows":
        doc_N = pbatch.target_doc_ids.reshape(-1)
        idx = np.flatnonzero(doc_N >= 0)
        targets = shift_labels(pbatch.batch.labels).reshape(-1)[idx]
        if targets.size and (targets.min() < 0 or targets.max() >= vocab_size):
            raise ValueError(f"labels hold values in [{targets.min()}, {targets.max()}], outside the vocabulary "
                             f"[0, {vocab_size}); fix the tokenisation or the model's vocab_size.")
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


def _token_logps_full(hidden_NH, weight_VH, rows: TargetRows) -> torch.Tensor:
    """Baseline: logits for every position ``[B*T, V]`` (padding and prompts included, as Hugging
    Face computes them), ``log_softmax``, then the target of each scored row."""
    logp_NV = F.log_softmax(_acc(F.linear(hidden_NH, weight_VH)), dim=-1)
    # gather on all rows (target 0 where none), then pick the scored ones: one [N, V] buffer in backward
    targets_N = torch.zeros(hidden_NH.shape[0], dtype=torch.long, device=hidden_NH.device)
    targets_N[rows.idx_n] = rows.targets_n
    return logp_NV.gather(1, targets_N[:, None])[:, 0].index_select(0, rows.idx_n)


def _chunk_logps(hidden_cH, weight_VH, targets_c):
    return _picked_logps(_acc(F.linear(hidden_cH, weight_VH)), targets_c)[0]


def _token_logps_chunked(hidden_nH, weight_VH, targets_n, chunk_size: int) -> torch.Tensor:
    """Checkpointed chunks: naive equivalent ``log_softmax(hidden_nH @ W.T)[arange(n), targets_n]``."""
    parts = [checkpoint(_chunk_logps, hidden_nH[s:s + chunk_size], weight_VH, targets_n[s:s + chunk_size],
                        use_reentrant=False) for s in range(0, hidden_nH.shape[0], chunk_size)]
    assert parts, "collate_preference guarantees at least one scored token per document"
    return torch.cat(parts)


class FusedLinearTokenLogps(torch.autograd.Function):
    """Per-token target log-probs from hidden states, chunk by chunk, logits never stored.

    Naive equivalent::

        logp_n = log_softmax((hidden_nH @ weight_VH.T).float(), -1)[arange(n), targets_n]

    Forward keeps only the per-row logsumexp [n]. Backward gets ``g_n = dL/dlogp_n`` (one
    upstream gradient per token: DPO's is not a constant, unlike a token-mean loss, so the
    gradients cannot be formed in forward), recomputes each chunk's logits and forms
    ``dL/dlogits = g_n (onehot - softmax)`` in place; the weight gradient is accumulated
    in one fp32 ``[V, H]`` buffer.
    """

    @staticmethod
    def forward(ctx, hidden_nH, weight_VH, targets_n, chunk_size: int):
        # Backward runs outside autocast, so the matmul dtype is fixed here and the operands saved in it.
        device_type = hidden_nH.device.type
        compute = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                   else weight_VH.dtype)
        h_nH, w_VH = hidden_nH.to(compute), weight_VH.to(compute)
        n = h_nH.shape[0]
        acc_dtype = torch.promote_types(compute, torch.float32)
        logps_n = torch.empty(n, dtype=acc_dtype, device=h_nH.device)
        lse_n = torch.empty(n, dtype=acc_dtype, device=h_nH.device)
        with torch.autocast(device_type, enabled=False):
            for s in range(0, n, chunk_size):
                logits_cV = _acc(F.linear(h_nH[s:s + chunk_size], w_VH))
                logps_n[s:s + chunk_size], lse_n[s:s + chunk_size] = _picked_logps(logits_cV,
                                                                                  targets_n[s:s + chunk_size])
                del logits_cV  # else the next chunk's logits are allocated while these are alive
        ctx.save_for_backward(h_nH, w_VH, targets_n, lse_n)
        ctx.chunk_size, ctx.dtypes = chunk_size, (hidden_nH.dtype, weight_VH.dtype)
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
            h_cH, t_c, g_c = hidden_nH[s:s + cs], targets_n[s:s + cs], grad_logps_n[s:s + cs].to(lse_n.dtype)
            # dlogp/dlogits = onehot - softmax, scaled by the upstream gradient; in place on the chunk's logits
            g_cV = _acc(F.linear(h_cH, weight_VH)).sub_(lse_n[s:s + cs, None]).exp_().mul_(-g_c[:, None])
            g_cV[torch.arange(len(t_c), device=t_c.device), t_c] += g_c
            if grad_h is not None:
                grad_h[s:s + cs] = g_cV.to(weight_VH.dtype) @ weight_VH
            if grad_w is not None:
                grad_w.addmm_(g_cV.t(), h_cH.to(grad_w.dtype))
            del g_cV
        return grad_h, None if grad_w is None else grad_w.to(ctx.dtypes[1]), None, None


def token_logps(hidden_BTH: torch.Tensor, lm_head_weight_VH: torch.Tensor, rows: TargetRows,
                loss_type: str = "fused_linear", chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """[n] log-probs of the targets at ``rows.idx_n`` (fp32; fp64 for fp64 inputs)."""
    if loss_type not in LOGPS_LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} has no log-prob kernel here; choose one of {LOGPS_LOSS_TYPES} "
                         f"('liger' is the separate liger_dpo_loss path).")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive integer (tokens per chunk).")
    hidden_NH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
    if loss_type == "nll":
        return _token_logps_full(hidden_NH, lm_head_weight_VH, rows)
    hidden_nH = hidden_NH.index_select(0, rows.idx_n)
    if loss_type == "chunked_nll":
        return _token_logps_chunked(hidden_nH, lm_head_weight_VH, rows.targets_n, chunk_size)
    return FusedLinearTokenLogps.apply(hidden_nH, lm_head_weight_VH, rows.targets_n, chunk_size)


def sequence_logps(hidden_BTH: torch.Tensor, lm_head_weight_VH: torch.Tensor, pbatch: PreferenceBatch,
                   loss_type: str = "fused_linear", chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """[2N] sequence log-probs (chosen documents, then rejected) from the final hidden states.

    Naive equivalent (``common.dpo_batching.sequence_logps_from_logits``)::

        logp_BT = log_softmax(hidden_BTH @ W.T)[b, t, labels[b, t + 1]]
        out[d] = Σ logp_BT[b, t] over (b, t) with target_doc_ids[b, t] == d
    """
    rows = TargetRows.of(pbatch, lm_head_weight_VH.shape[0], hidden_BTH.device)
    logps_n = token_logps(hidden_BTH, lm_head_weight_VH, rows, loss_type, chunk_size)
    return logps_n.new_zeros(rows.num_docs).index_add(0, rows.doc_n, logps_n)


# --------------------------------------------------------------------------------------
# The DPO loss family (common.dpo in torch)
# --------------------------------------------------------------------------------------


def _sigmoid(z):
    return torch.exp(F.logsigmoid(z))


def _family(c, r, beta: float, eps: float, n_c, n_r) -> dict[str, Any]:
    """Lazily evaluated per-type losses; formulas and names of ``common.dpo``."""
    x = beta * (c - r)
    half = 0.5 / beta

    def exo():
        log_qw, log_ql = F.logsigmoid(x), F.logsigmoid(-x)
        return torch.exp(log_qw) * (log_qw - math.log1p(-eps)) + torch.exp(log_ql) * (log_ql - math.log(eps))

    return {
        "sigmoid": lambda: -F.logsigmoid(x),
        "hinge": lambda: torch.relu(1.0 - x),
        "ipo": lambda: (c / n_c - r / n_r - half) ** 2,
        "exo_pair": exo,
        "nca_pair": lambda: (-F.logsigmoid(beta * c) - 0.5 * F.logsigmoid(-beta * c)
                             - 0.5 * F.logsigmoid(-beta * r)),
        "robust": lambda: (-(1.0 - eps) * F.logsigmoid(x) + eps * F.logsigmoid(-x)) / (1.0 - 2.0 * eps),
        "bco_pair": lambda: -F.logsigmoid(beta * c) - F.logsigmoid(-beta * r),
        "sppo_hard": lambda: (c - half) ** 2 + (r + half) ** 2,
        "apo_zero": lambda: _sigmoid(-beta * c) + _sigmoid(beta * r),
        "apo_down": lambda: _sigmoid(beta * c) + _sigmoid(-x),
    }


def dpo_losses(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
               ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, config: DPOLossConfig, *,
               chosen_num_tokens: Optional[torch.Tensor] = None, rejected_num_tokens: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair ``Σ_k w_k L_k`` [N], chosen rewards ``β c`` [N], rejected rewards ``β r`` [N]).

    The torch mirror of ``common.dpo.dpo_loss`` (validate ``config`` with
    ``validate_dpo_config``); 'ipo' needs the completion token counts.
    """
    c, r = policy_chosen_logps - ref_chosen_logps, policy_rejected_logps - ref_rejected_logps
    if "ipo" in config.loss_type and (chosen_num_tokens is None or rejected_num_tokens is None):
        raise ValueError("loss_type 'ipo' normalises by completion length and needs chosen_num_tokens and "
                         "rejected_num_tokens (PreferenceBatch.chosen_num_tokens / rejected_num_tokens).")
    family = _family(c, r, config.beta, config.label_smoothing, chosen_num_tokens, rejected_num_tokens)
    by_type = {t: family[t]() for t in dict.fromkeys(config.loss_type)}
    losses = torch.zeros_like(c)
    for t, w in zip(config.loss_type, config.loss_weights):
        losses = losses + w * by_type[t]
    return losses, config.beta * c, config.beta * r


@dataclass
class DPOOutput:
    """One micro-batch: the scalar loss (normalised by the step's pairs) and per-pair tensors [N]."""

    loss: torch.Tensor
    losses: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def _ref_tensors(pbatch: PreferenceBatch, ref_chosen, ref_rejected, like: torch.Tensor):
    ref_chosen = pbatch.ref_chosen_logps if ref_chosen is None else ref_chosen
    ref_rejected = pbatch.ref_rejected_logps if ref_rejected is None else ref_rejected
    if ref_chosen is None or ref_rejected is None:
        raise ValueError("no reference log-probs: pass ref_chosen_logps/ref_rejected_logps (a reference model's "
                         "sequence_logps) or precompute them into the rows (precompute_ref_log_probs=True).")
    return tuple(torch.as_tensor(a, device=like.device).to(like.dtype).reshape(-1)
                 for a in (ref_chosen, ref_rejected))


def dpo_from_logps(logps_D: torch.Tensor, pbatch: PreferenceBatch, config: DPOLossConfig, *,
                   ref_chosen_logps=None, ref_rejected_logps=None,
                   num_examples_in_step: Optional[int] = None) -> DPOOutput:
    """DPO loss from the policy's [2N] sequence log-probs; the reference ones come from the
    arguments, else from ``pbatch`` (precomputed columns)."""
    n = pbatch.num_examples
    chosen, rejected = logps_D[:n], logps_D[n:]
    ref_c, ref_r = _ref_tensors(pbatch, ref_chosen_logps, ref_rejected_logps, logps_D)
    counts = torch.as_tensor(pbatch.num_target_tokens, device=logps_D.device).to(logps_D.dtype)
    losses, rc, rr = dpo_losses(chosen, rejected, ref_c, ref_r, config, chosen_num_tokens=counts[:n],
                                rejected_num_tokens=counts[n:])
    denom = n if num_examples_in_step is None else int(num_examples_in_step)
    if denom < n:
        raise ValueError(f"num_examples_in_step={denom} is smaller than this micro-batch's {n} pairs; it must "
                         f"count the pairs of the whole optimizer step.")
    return DPOOutput(losses.sum() / denom, losses, chosen, rejected, rc, rr)


# --------------------------------------------------------------------------------------
# Model-level API (parity tests, notebooks, the trainer)
# --------------------------------------------------------------------------------------


def frozen_reference(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` in eval mode with no gradients: the live reference model."""
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()


@torch.no_grad()
def reference_logps(ref_model: torch.nn.Module, pbatch: PreferenceBatch, *, loss_type: str = "fused_linear",
                    chunk_size: int = DEFAULT_CHUNK_SIZE, attn_implementation: Optional[str] = None):
    """(chosen [N], rejected [N]) fp32 tensors of ``ref_model``, no graph (liger -> fused_linear)."""
    from twinseq.torch_backend.attention import forward_hidden

    kernel = "fused_linear" if loss_type == "liger" else loss_type
    hidden_BTH = forward_hidden(ref_model, pbatch.batch, attn_implementation)
    logps_D = sequence_logps(hidden_BTH, ref_model.lm_head.weight, pbatch, kernel, chunk_size)
    return logps_D[:pbatch.num_examples], logps_D[pbatch.num_examples:]


def compute_sequence_logps(model: torch.nn.Module, pbatch: PreferenceBatch, *, loss_type: str = "fused_linear",
                           chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """(chosen [N], rejected [N]) float64 numpy sequence log-probs of ``model``, no gradient."""
    chosen, rejected = reference_logps(model, pbatch, loss_type=loss_type, chunk_size=chunk_size)
    return chosen.double().cpu().numpy(), rejected.double().cpu().numpy()


def dpo_forward(model: torch.nn.Module, pbatch: PreferenceBatch, config: DPOLossConfig, *,
                ref_chosen_logps=None, ref_rejected_logps=None, loss_type: str = "fused_linear",
                chunk_size: int = DEFAULT_CHUNK_SIZE, num_examples_in_step: Optional[int] = None,
                attn_implementation: Optional[str] = None) -> DPOOutput:
    """Policy forward + DPO loss of one micro-batch (graph kept for ``.backward()``)."""
    from twinseq.torch_backend.attention import forward_hidden

    hidden_BTH = forward_hidden(model, pbatch.batch, attn_implementation)
    logps_D = sequence_logps(hidden_BTH, model.lm_head.weight, pbatch, loss_type, chunk_size)
    return dpo_from_logps(logps_D, pbatch, config, ref_chosen_logps=ref_chosen_logps,
                          ref_rejected_logps=ref_rejected_logps, num_examples_in_step=num_examples_in_step)


def dpo_loss_and_grads(model: torch.nn.Module, pbatch: PreferenceBatch, config: DPOLossConfig, *,
                       ref_chosen_logps=None, ref_rejected_logps=None, loss_type: str = "fused_linear",
                       chunk_size: int = DEFAULT_CHUNK_SIZE, num_examples_in_step: Optional[int] = None
                       ) -> tuple[float, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(loss, float32 numpy gradient per HF name, per-pair float64 outputs) of one micro-batch.

    The per-pair dict holds ``losses``, ``chosen_logps``, ``rejected_logps``, ``chosen_rewards``,
    ``rejected_rewards``. ``.grad`` is cleared before and after.
    """
    from twinseq.common.init import parameter_shapes
    from twinseq.torch_backend.model import model_config_of

    model.zero_grad(set_to_none=True)
    out = dpo_forward(model, pbatch, config, ref_chosen_logps=ref_chosen_logps,
                      ref_rejected_logps=ref_rejected_logps, loss_type=loss_type, chunk_size=chunk_size,
                      num_examples_in_step=num_examples_in_step)
    out.loss.backward()
    params = dict(model.named_parameters())
    grads = {name: (np.zeros(tuple(params[name].shape), np.float32) if params[name].grad is None
                    else params[name].grad.detach().float().cpu().numpy().copy())
             for name in parameter_shapes(model_config_of(model))}
    model.zero_grad(set_to_none=True)
    per_pair = {k: getattr(out, k).detach().double().cpu().numpy()
                for k in ("losses", "chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards")}
    return float(out.loss.detach()), grads, per_pair


def precompute_ref_logps(ref_model: torch.nn.Module, rows: Any, cfg: TrainConfig, pad_token_id: int) -> Any:
    """``rows`` plus ``ref_chosen_logps`` / ``ref_rejected_logps`` columns, from one no-grad pass."""
    from twinseq.common.dpo_loader import iter_preference_batches, with_ref_logps

    chosen, rejected = [], []
    for _, pbatch in iter_preference_batches(rows, cfg.per_device_train_batch_size, padding_free=cfg.padding_free,
                                             pad_token_id=pad_token_id, pad_to_multiple_of=cfg.pad_to_multiple_of):
        c, r = reference_logps(ref_model, pbatch, loss_type=cfg.loss_type, chunk_size=cfg.loss_chunk_size,
                               attn_implementation=cfg.attn_implementation)
        chosen.append(c.double().cpu().numpy())
        rejected.append(r.double().cpu().numpy())
    return with_ref_logps(rows, np.concatenate(chosen), np.concatenate(rejected))


# --------------------------------------------------------------------------------------
# Liger (CUDA)
# --------------------------------------------------------------------------------------


def check_liger_dpo(config: DPOLossConfig, *, padding_free: bool, precompute: bool, device: Any) -> None:
    """Raise unless Liger's fused DPO loss can compute exactly what twinseq's would (configuration
    conflicts first, so they show on any machine; then CUDA, then the package)."""
    if tuple(config.loss_type) != ("sigmoid",):
        raise ValueError(f"loss_type='liger' computes the 'sigmoid' DPO loss only; dpo_loss_type="
                         f"{list(config.loss_type)} needs --loss-type fused_linear.")
    if padding_free:
        raise ValueError("loss_type='liger' needs padded batches (chosen and rejected stacked as rows); drop "
                         "--padding-free or use --loss-type fused_linear.")
    if precompute:
        raise ValueError("precompute_ref_log_probs=True is not supported with loss_type='liger': twinseq's Liger "
                         "path feeds the reference hidden states to the kernel. Drop --precompute-ref-log-probs "
                         "or use --loss-type fused_linear.")
    if torch.device(device).type != "cuda":
        raise ValueError("loss_type='liger' (or use_liger_kernel=True) needs a CUDA GPU with liger-kernel "
                         f"(`{_GPU_EXTRA}`); on CPU use --loss-type fused_linear, the same fused log-probs.")
    if importlib.util.find_spec("liger_kernel") is None:
        raise ImportError(f"loss_type='liger' needs the liger-kernel package; install the gpu extra with "
                          f"`{_GPU_EXTRA}`, or use --loss-type fused_linear.")


def liger_dpo_loss(hidden_BTH, weight_VH, ref_hidden_BTH, ref_weight_VH, pbatch: PreferenceBatch,
                   config: DPOLossConfig, num_examples_in_step: int) -> torch.Tensor:
    """Liger's ``LigerFusedLinearDPOLoss`` on a padded batch, as a micro-batch of the step's mean."""
    check_liger_dpo(config, padding_free=pbatch.batch.shape[0] != pbatch.num_docs, precompute=False,
                    device=hidden_BTH.device)
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

    params = inspect.signature(LigerFusedLinearDPOLoss.__init__).parameters
    kwargs = dict(ignore_index=-100, beta=config.beta, compute_nll_loss=False, use_ref_model=True)
    if "average_log_prob" not in params:
        raise ImportError("this liger-kernel version averages DPO log-probs over tokens (no average_log_prob "
                          f"option), while TRL and twinseq sum them; upgrade liger-kernel (`{_GPU_EXTRA}`).")
    kwargs["average_log_prob"] = False
    if "loss_type" in params:
        kwargs["loss_type"] = "sigmoid"
    labels_BT = torch.as_tensor(pbatch.batch.labels, dtype=torch.long, device=hidden_BTH.device)
    out = LigerFusedLinearDPOLoss(**kwargs)(weight_VH, hidden_BTH[:, :-1], labels_BT[:, 1:], bias=None,
                                            ref_input=ref_hidden_BTH[:, :-1], ref_weight=ref_weight_VH,
                                            ref_bias=None)
    loss = out[0] if isinstance(out, tuple) else out
    # Liger divides by this micro-batch's pairs; the step's mean divides by all of them.
    return loss * (pbatch.num_examples / num_examples_in_step)


# --------------------------------------------------------------------------------------
# Trainer: `twinseq train --task dpo --backend torch`
# --------------------------------------------------------------------------------------


def validate_dpo_runtime(cfg: TrainConfig, device: torch.device) -> DPOLossConfig:
    """Refuse what the torch DPO trainer cannot run correctly, before any work; returns the loss config."""
    from twinseq.torch_backend.parallel import wants_distributed
    from twinseq.torch_backend.train import validate_runtime

    config = validate_dpo_config(list(cfg.dpo_loss_type), cfg.loss_weights, cfg.beta, cfg.label_smoothing)
    if cfg.loss_type == "liger":
        check_liger_dpo(config, padding_free=cfg.padding_free, precompute=cfg.precompute_ref_log_probs,
                        device=device)
    validate_runtime(cfg, device)  # attention path, offloading without CUDA
    if wants_distributed(cfg):
        raise ValueError("task='dpo' runs in one process: FSDP, context parallelism and multi-process launches are "
                         "not implemented for DPO; drop --fsdp / --context-parallel-size and launch with python.")
    if cfg.packing:
        raise ValueError("packing=True does not apply to DPO (it would cut pairs apart); use --padding-free.")
    if cfg.torch_compile:
        raise ValueError("torch_compile=True is not supported with task='dpo' yet; drop --torch-compile.")
    return config


class DPOMicroStep:
    """Reference log-probs + policy forward + DPO loss + backward of one micro-batch."""

    def __init__(self, model, ref_model, cfg: TrainConfig, device: torch.device, config: DPOLossConfig,
                 examples_per_step: int) -> None:
        self.model, self.ref_model, self.cfg, self.device = model, ref_model, cfg, device
        self.config, self.examples_per_step = config, examples_per_step

    def _liger(self, pbatch: PreferenceBatch) -> DPOOutput:
        from twinseq.torch_backend.attention import forward_hidden

        attn, w, ref_w = self.cfg.attn_implementation, self.model.lm_head.weight, self.ref_model.lm_head.weight
        hidden_BTH = forward_hidden(self.model, pbatch.batch, attn)
        with torch.no_grad():
            ref_hidden_BTH = forward_hidden(self.ref_model, pbatch.batch, attn)
        loss = liger_dpo_loss(hidden_BTH, w, ref_hidden_BTH, ref_w, pbatch, self.config, self.examples_per_step)
        with torch.no_grad():  # Liger returns no per-pair log-probs; the metrics cost one lm_head pass each
            ref_D = sequence_logps(ref_hidden_BTH, ref_w, pbatch, "fused_linear", self.cfg.loss_chunk_size)
            out = dpo_from_logps(sequence_logps(hidden_BTH.detach(), w, pbatch, "fused_linear",
                                                self.cfg.loss_chunk_size), pbatch, self.config,
                                 ref_chosen_logps=ref_D[:pbatch.num_examples],
                                 ref_rejected_logps=ref_D[pbatch.num_examples:],
                                 num_examples_in_step=self.examples_per_step)
        out.loss = loss
        return out

    def __call__(self, pbatch: PreferenceBatch) -> DPOOutput:
        from twinseq.torch_backend.train import _autocast, _offload_context

        c = self.cfg
        with _autocast(c, self.device):
            ref_c = ref_r = None
            if self.ref_model is not None and c.loss_type != "liger":
                ref_c, ref_r = reference_logps(self.ref_model, pbatch, loss_type=c.loss_type,
                                               chunk_size=c.loss_chunk_size, attn_implementation=c.attn_implementation)
        with _offload_context(c, self.model):
            with _autocast(c, self.device):
                if c.loss_type == "liger":
                    out = self._liger(pbatch)
                else:
                    out = dpo_forward(self.model, pbatch, self.config, ref_chosen_logps=ref_c,
                                      ref_rejected_logps=ref_r, loss_type=c.loss_type, chunk_size=c.loss_chunk_size,
                                      num_examples_in_step=self.examples_per_step,
                                      attn_implementation=c.attn_implementation)
            out.loss.backward()
        return out


def dpo_train_step(model, optimizer, scheduler, micro_step: DPOMicroStep, pbatches: list[PreferenceBatch],
                   cfg: TrainConfig) -> dict[str, Any]:
    """One optimizer step over the micro-batches; the metrics of every pair of the step (this rank)."""
    from twinseq.torch_backend.train import clip_grad_norm_fp64_

    outs = [micro_step(pb) for pb in pbatches]
    grad_norm = (clip_grad_norm_fp64_(model.parameters(), cfg.max_grad_norm)
                 if cfg.max_grad_norm is not None else None)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    cat = lambda name: torch.cat([getattr(o, name).detach() for o in outs]).double().cpu().numpy()  # noqa: E731
    result = {"loss": float(sum(float(o.loss.detach()) for o in outs)), "lr": lr,
              "num_tokens": sum(pb.batch.num_tokens for pb in pbatches),
              "num_label_tokens": sum(pb.batch.num_label_tokens for pb in pbatches),
              "num_pairs": sum(pb.num_examples for pb in pbatches),
              **reward_metrics(cat("chosen_rewards"), cat("rejected_rewards")),
              "logps/chosen": float(cat("chosen_logps").mean()), "logps/rejected": float(cat("rejected_logps").mean())}
    if grad_norm is not None:
        result["grad_norm"] = float(grad_norm)
    return result


def _reference_for(cfg: TrainConfig, model, rows, pad_token_id: int, device: torch.device, log):
    """(rows, live reference model or None). The reference is the *initial* policy: this runs before a
    checkpoint is loaded, so a resumed run keeps the same reference."""
    from twinseq.torch_backend.train import _autocast

    ref_model = frozen_reference(model)
    if not cfg.precompute_ref_log_probs:
        return rows, ref_model
    t0 = time.perf_counter()
    with _autocast(cfg, device):
        rows = precompute_ref_logps(ref_model, rows, cfg, pad_token_id)
    log(f"precomputed reference log-probs of {len(rows)} pairs in {time.perf_counter() - t0:.1f}s; "
        f"the reference model is freed")
    return rows, None


def train_dpo(cfg: TrainConfig) -> Path:
    """Run ``cfg.max_steps`` DPO optimizer steps; returns the path of ``metrics.jsonl``."""
    from twinseq.common.data import prepare_dpo_dataset
    from twinseq.common.dpo_loader import build_preference_iterator
    from twinseq.common.metrics import RunLogger
    from twinseq.torch_backend.train import (build_optimizer, build_training_model, pick_device, resume_if_asked,
                                             run_steps)

    device = pick_device()
    config = validate_dpo_runtime(cfg, device)
    torch.manual_seed(cfg.seed)
    rows, tokenizer, stats = prepare_dpo_dataset(cfg)
    model = build_training_model(cfg, tokenizer.vocab_size, device)
    rows, ref_model = _reference_for(cfg, model, rows, tokenizer.pad_token_id, device, logger.info)
    iterator = build_preference_iterator(cfg, rows, tokenizer.pad_token_id)
    optimizer, scheduler = build_optimizer(model, cfg)
    start = resume_if_asked(cfg, model, optimizer, scheduler, iterator)
    log = RunLogger(cfg.output_dir, cfg.max_steps, disable_tqdm=cfg.disable_tqdm, desc="dpo[torch]",
                    resume_step=start)
    log.write(f"twinseq torch dpo: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params on {device}, "
              f"dpo_loss_type={list(config.loss_type)}, beta={config.beta}, logps kernel={cfg.loss_type}, "
              f"padding_free={cfg.padding_free}, reference={'precomputed' if ref_model is None else 'live copy'}, "
              f"{iterator.examples_per_step} pairs per step; data: {stats}")
    micro_step = DPOMicroStep(model, ref_model, cfg, device, config, iterator.examples_per_step)
    return run_steps(cfg, lambda pbatches: dpo_train_step(model, optimizer, scheduler, micro_step, pbatches, cfg),
                     model=model, optimizer=optimizer, scheduler=scheduler, iterator=iterator, tokenizer=tokenizer,
                     log=log, start=start, device=device,
                     plot_keys=("loss", "rewards/accuracies", "tokens_per_second"))
