"""DPO on the torch backend: the loss of a preference micro-batch, its reference, and Liger's kernel.

A preference micro-batch (``common.data.preference_batching.PreferenceBatch``) holds 2N documents, chosen
then rejected, padded (one per row) or padding-free (all in one row). Their sequence log-probs
come from ``logprobs.sequence_logps`` with the token-loss kernel ``loss_type``; the loss family
is ``common.objectives.dpo.dpo_family`` (written once, evaluated here with torch ops; TRL 1.16 semantics).
A micro-batch's loss is ``Σ_n Σ_k w_k L_k[n] / examples_per_step`` so that accumulated
micro-batches give the full batch's mean over pairs. ``loss_type='liger'`` runs Liger's
``LigerFusedLinearDPOLoss`` (CUDA, padded, 'sigmoid', live reference).

Context parallelism (``cp_sequence_logps``). Every rank of a cp group holds ``T / cp`` tokens of each row of the
micro-batch (``preference_shard``: the zigzag shard of ``context_parallel.shard_for_rank``, the shifted targets and
their documents reordered alike), runs the policy (and the reference) through the cp attention, sums the target
log-probs of its shard per document, and all-reduces those [2N] sums over the cp group (``distributed.sum_over_ranks``,
whose backward is the identity). The DPO loss is then the same on every rank of the group, and each rank's
backward gives the gradient of its own share only, so FSDP2's sum over ranks is the exact gradient.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from twinseq.common.backend import Model
from twinseq.common.config import DEFAULT_CHUNK_SIZE
from twinseq.common.data.batching import pad_batch
from twinseq.common.data.context_parallel import pad_doc_ids, shard_doc_ids
from twinseq.common.data.preference_batching import PreferenceBatch
from twinseq.common.data.preference_steps import iter_preference_batches, with_ref_logps
from twinseq.common.errors import ConfigError, MissingDependencyError
from twinseq.common.models.init import parameter_shapes
from twinseq.common.objectives.dpo import ArrayOps, DPOLossConfig, check_liger_dpo_config, dpo_family
from twinseq.common.run.capabilities import GPU_EXTRA
from twinseq.torch_backend import context_parallel as cpmod
from twinseq.torch_backend.attention import forward_hidden, mask_layout
from twinseq.torch_backend.distributed import sum_over_ranks
from twinseq.torch_backend.logprobs import local_sequence_logps, sequence_logps, shard_target_rows
from twinseq.torch_backend.losses import final_logit_softcap
from twinseq.torch_backend.model import model_config_of
from twinseq.torch_backend.unwrap import adapter_grads, causal_lm_of, is_adapter_model, lm_head_weight

logger = logging.getLogger(__name__)

TORCH_OPS = ArrayOps(
    log_sigmoid=F.logsigmoid,
    exp=torch.exp,
    relu=torch.relu,
    zeros_like=torch.zeros_like,
    sort=lambda z: torch.sort(z, dim=0).values,
)


def dpo_losses(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    config: DPOLossConfig,
    *,
    chosen_num_tokens: Optional[torch.Tensor] = None,
    rejected_num_tokens: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair ``Σ_k w_k L_k`` [N], chosen rewards ``β c`` [N], rejected rewards ``β r`` [N]) in torch."""
    out = dpo_family(
        policy_chosen_logps - ref_chosen_logps,
        policy_rejected_logps - ref_rejected_logps,
        config,
        TORCH_OPS,
        chosen_num_tokens=chosen_num_tokens,
        rejected_num_tokens=rejected_num_tokens,
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
    )
    return out.losses, out.chosen_rewards, out.rejected_rewards


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
        raise ConfigError(
            "no reference log-probs: pass ref_chosen_logps/ref_rejected_logps (a reference model's "
            "sequence_logps) or precompute them into the rows (precompute_ref_log_probs=True)."
        )
    return tuple(torch.as_tensor(a, device=like.device).to(like.dtype).reshape(-1) for a in (ref_chosen, ref_rejected))


def dpo_from_logps(
    logps_D: torch.Tensor,
    pbatch: PreferenceBatch,
    config: DPOLossConfig,
    *,
    ref_chosen_logps=None,
    ref_rejected_logps=None,
    num_examples_in_step: Optional[int] = None,
) -> DPOOutput:
    """DPO loss from the policy's [2N] sequence log-probs; the reference ones come from the
    arguments, else from ``pbatch`` (precomputed columns)."""
    n = pbatch.num_examples
    chosen, rejected = logps_D[:n], logps_D[n:]
    ref_c, ref_r = _ref_tensors(pbatch, ref_chosen_logps, ref_rejected_logps, logps_D)
    counts = torch.as_tensor(pbatch.num_target_tokens, device=logps_D.device).to(logps_D.dtype)
    losses, rc, rr = dpo_losses(
        chosen, rejected, ref_c, ref_r, config, chosen_num_tokens=counts[:n], rejected_num_tokens=counts[n:]
    )
    denom = n if num_examples_in_step is None else int(num_examples_in_step)
    if denom < n:
        raise ConfigError(
            f"num_examples_in_step={denom} is smaller than this micro-batch's {n} pairs; pass the "
            f"count of pairs of the whole optimizer step."
        )
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
def reference_logps(
    ref_model: torch.nn.Module,
    pbatch: PreferenceBatch,
    *,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    attn_implementation: Optional[str] = None,
):
    """(chosen [N], rejected [N]) fp32 tensors of ``ref_model``, no graph (liger -> fused_linear)."""
    kernel = "fused_linear" if loss_type == "liger" else loss_type
    hidden_BTH = forward_hidden(ref_model, pbatch.batch, attn_implementation)
    logps_D = sequence_logps(
        hidden_BTH, lm_head_weight(ref_model), pbatch, kernel, chunk_size, logit_softcap=final_logit_softcap(ref_model)
    )
    return logps_D[: pbatch.num_examples], logps_D[pbatch.num_examples :]


def compute_sequence_logps(
    model: Model, pbatch: PreferenceBatch, *, loss_type: str = "fused_linear", chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[np.ndarray, np.ndarray]:
    """(chosen [N], rejected [N]) float64 numpy sequence log-probs of ``model``, no gradient."""
    chosen, rejected = reference_logps(model, pbatch, loss_type=loss_type, chunk_size=chunk_size)
    return chosen.double().cpu().numpy(), rejected.double().cpu().numpy()


def dpo_forward(
    model: torch.nn.Module,
    pbatch: PreferenceBatch,
    config: DPOLossConfig,
    *,
    ref_chosen_logps=None,
    ref_rejected_logps=None,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_examples_in_step: Optional[int] = None,
    attn_implementation: Optional[str] = None,
) -> DPOOutput:
    """Policy forward + DPO loss of one micro-batch (graph kept for ``.backward()``)."""
    hidden_BTH = forward_hidden(model, pbatch.batch, attn_implementation)
    logps_D = sequence_logps(
        hidden_BTH, lm_head_weight(model), pbatch, loss_type, chunk_size, logit_softcap=final_logit_softcap(model)
    )
    return dpo_from_logps(
        logps_D,
        pbatch,
        config,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
        num_examples_in_step=num_examples_in_step,
    )


def dpo_loss_and_grads(
    model: Model,
    pbatch: PreferenceBatch,
    config: DPOLossConfig,
    *,
    ref_chosen_logps: Any = None,
    ref_rejected_logps: Any = None,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_examples_in_step: Optional[int] = None,
) -> tuple[float, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(loss, float32 numpy gradient per HF name, per-pair float64 outputs) of one micro-batch.

    Of an adapter model (``add_adapters``) the gradients are the adapter tensors', by PEFT saved key. The per-pair
    dict holds ``losses``, ``chosen_logps``, ``rejected_logps``, ``chosen_rewards``,
    ``rejected_rewards``. ``.grad`` is cleared before and after.
    """
    model.zero_grad(set_to_none=True)
    out = dpo_forward(
        model,
        pbatch,
        config,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
        loss_type=loss_type,
        chunk_size=chunk_size,
        num_examples_in_step=num_examples_in_step,
    )
    out.loss.backward()
    if is_adapter_model(model):  # the adapter tensors only, by PEFT saved key
        grads = adapter_grads(model)
    else:
        params = dict(model.named_parameters())
        grads = {
            name: (
                np.zeros(tuple(params[name].shape), np.float32)
                if params[name].grad is None
                else params[name].grad.detach().float().cpu().numpy().copy()
            )
            for name in parameter_shapes(model_config_of(model))
        }
    model.zero_grad(set_to_none=True)
    per_pair = {
        k: getattr(out, k).detach().double().cpu().numpy()
        for k in ("losses", "chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards")
    }
    return float(out.loss.detach()), grads, per_pair


def precompute_ref_logps(ref_model: torch.nn.Module, rows: Any, cfg: Any, pad_token_id: int) -> Any:
    """``rows`` plus ``ref_chosen_logps`` / ``ref_rejected_logps`` columns, from one no-grad pass
    (``cfg`` a ``TrainConfig``: its batching and loss kernel)."""
    d, loss = cfg.data, cfg.loss
    chosen, rejected = [], []
    for _, pbatch in iter_preference_batches(
        rows,
        d.per_device_train_batch_size,
        padding_free=d.padding_free,
        pad_token_id=pad_token_id,
        pad_to_multiple_of=d.pad_to_multiple_of,
    ):
        c, r = reference_logps(
            ref_model,
            pbatch,
            loss_type=loss.loss_type,
            chunk_size=loss.loss_chunk_size,
            attn_implementation=cfg.model.attn_implementation,
        )
        chosen.append(c.double().cpu().numpy())
        rejected.append(r.double().cpu().numpy())
    return with_ref_logps(rows, np.concatenate(chosen), np.concatenate(rejected))


# --------------------------------------------------------------------------------------
# Context parallelism: a rank's shard of the micro-batch, its share of the sequence log-probs
# --------------------------------------------------------------------------------------


@dataclass
class CPPreferenceShard:
    """This rank's share of a preference micro-batch under context parallelism."""

    pbatch: PreferenceBatch  # the whole micro-batch: pairs, token counts, precomputed reference log-probs
    shard: cpmod.CPShard  # this rank's [B, T / cp] tokens, ids and shifted targets, zigzag order
    doc_BL: torch.Tensor  # long [B, T / cp]: the document of each target (-1: none), in the same order


def preference_shard(pbatch: PreferenceBatch, cp: int, cp_rank: int, device: Any = "cpu") -> CPPreferenceShard:
    """``cp_rank``'s shard of ``pbatch``, its rows first padded to a multiple of ``2 * cp`` tokens (padding holds no
    target). The targets are shifted before the zigzag reorder and ``target_doc_ids`` is in that shifted layout,
    so both are reordered alike (``common.data.context_parallel.shard_doc_ids``)."""
    rows = pbatch.batch.shape[0]
    batch = pad_batch(pbatch.batch, rows, 2 * cp)
    doc_BT = pad_doc_ids(pbatch.target_doc_ids, rows, 2 * cp)
    shard = cpmod.shard_for_rank(batch, cp, cp_rank, device)
    doc_BL = torch.as_tensor(np.ascontiguousarray(shard_doc_ids(doc_BT, cp, cp_rank)), dtype=torch.long, device=device)
    return CPPreferenceShard(pbatch, shard, doc_BL)


def cp_hidden(causal_lm: torch.nn.Module, shard: cpmod.CPShard, group: Any, strategy: str) -> torch.Tensor:
    """Final hidden states [B, T / cp, H] of this rank's tokens, the attention of every layer the cp strategy's
    (``parallel.use_cp_attention``), which sees the keys of the whole row."""
    ctx = cpmod.make_context(shard, group, strategy, mask_layout(causal_lm.config).sliding_window)
    out = causal_lm_of(causal_lm).model(
        input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False, **{cpmod.CP_KWARG: ctx}
    )
    return out.last_hidden_state


def cp_sequence_logps(
    causal_lm: torch.nn.Module,
    micro: CPPreferenceShard,
    group: Any,
    strategy: str,
    *,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """[2N] sequence log-probs of the whole micro-batch (chosen, then rejected), the same on every rank of
    ``group``: this rank's per-document sums, added over the cp ranks. Naive equivalent: ``sequence_logps`` of
    the unsharded batch. Backward gives this rank's share of the gradient (``distributed.sum_over_ranks``)."""
    kernel = "fused_linear" if loss_type == "liger" else loss_type
    hidden_BLH = cp_hidden(causal_lm, micro.shard, group, strategy)
    weight_VH = lm_head_weight(causal_lm)
    rows = shard_target_rows(micro.shard.targets, micro.doc_BL, micro.pbatch.num_docs, weight_VH.shape[0])
    local_D = local_sequence_logps(
        hidden_BLH, weight_VH, rows, kernel, chunk_size, logit_softcap=final_logit_softcap(causal_lm)
    )
    return sum_over_ranks(local_D, group)


# --------------------------------------------------------------------------------------
# Liger (CUDA)
# --------------------------------------------------------------------------------------


def check_liger_dpo(
    config: DPOLossConfig,
    *,
    padding_free: bool,
    device: Any,
    logit_softcap: Optional[float] = None,
    model_type: str = "",
) -> None:
    """Raise unless Liger's fused DPO loss can compute exactly what twinseq's would, here (a CUDA device: where a
    run uses Liger)."""
    _check_liger_dpo_exact(config, padding_free=padding_free, logit_softcap=logit_softcap, model_type=model_type)
    if torch.device(device).type != "cuda":
        raise ConfigError(
            "loss_type='liger' (or use_liger_kernel=True) needs a CUDA GPU with liger-kernel "
            f"(`{GPU_EXTRA}`); on CPU use --loss-type fused_linear, the same fused log-probs."
        )
    if importlib.util.find_spec("liger_kernel") is None:
        raise MissingDependencyError(
            f"loss_type='liger' needs the liger-kernel package; install the gpu extra "
            f"with `{GPU_EXTRA}`, or use --loss-type fused_linear."
        )


def _check_liger_dpo_exact(
    config: DPOLossConfig, *, padding_free: bool, logit_softcap: Optional[float], model_type: str
) -> None:
    """Liger's chunked preference losses compute ``log_softmax(hidden @ W.T)`` with no final logit soft-cap, so a
    model that caps its logits (Gemma 2) is refused rather than scored on other logits than its own forward
    produces."""
    check_liger_dpo_config(config.loss_type, padding_free=padding_free, precompute=False)
    if logit_softcap is not None:
        raise ConfigError(
            f"loss_type='liger' (or use_liger_kernel=True) for DPO: Liger's fused DPO loss has no final "
            f"logit soft-cap, and model_type {model_type!r} caps its logits (final_logit_softcapping="
            f"{logit_softcap}); use --loss-type fused_linear, the same fused log-probs with the cap."
        )


def liger_dpo_loss(
    hidden_BTH,
    weight_VH,
    ref_hidden_BTH,
    ref_weight_VH,
    pbatch: PreferenceBatch,
    config: DPOLossConfig,
    num_examples_in_step: int,
    *,
    logit_softcap: Optional[float] = None,
    model_type: str = "",
) -> torch.Tensor:
    """Liger's ``LigerFusedLinearDPOLoss`` on a padded batch, as a micro-batch of the step's mean (refused for
    a model with a final logit soft-cap, see ``check_liger_dpo``). Liger's chunked loss is plain torch and runs
    wherever torch does (``torch.compile`` on CUDA only; a run asks for CUDA, ``common.run.capabilities``)."""
    _check_liger_dpo_exact(
        config,
        padding_free=pbatch.batch.shape[0] != pbatch.num_docs,
        logit_softcap=logit_softcap,
        model_type=model_type,
    )
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss  # optional dependency

    params = inspect.signature(LigerFusedLinearDPOLoss.__init__).parameters
    kwargs = dict(
        ignore_index=-100,
        beta=config.beta,
        compute_nll_loss=False,
        use_ref_model=True,
        compiled=hidden_BTH.device.type == "cuda",
    )
    if "average_log_prob" not in params:
        raise ImportError(
            "this liger-kernel version averages DPO log-probs over tokens (no average_log_prob "
            f"option), while TRL and twinseq sum them; upgrade liger-kernel (`{GPU_EXTRA}`)."
        )
    kwargs["average_log_prob"] = False
    if "loss_type" in params:
        kwargs["loss_type"] = "sigmoid"
    labels_BT = torch.as_tensor(pbatch.batch.labels, dtype=torch.long, device=hidden_BTH.device)
    out = LigerFusedLinearDPOLoss(**kwargs)(
        weight_VH,
        hidden_BTH[:, :-1],
        labels_BT[:, 1:],
        bias=None,
        ref_input=ref_hidden_BTH[:, :-1],
        ref_weight=ref_weight_VH,
        ref_bias=None,
    )
    loss = out[0] if isinstance(out, tuple) else out
    # Liger divides by this micro-batch's pairs; the step's mean divides by all of them.
    return loss * (pbatch.num_examples / num_examples_in_step)


def liger_dpo_forward(
    model: torch.nn.Module,
    ref_model: torch.nn.Module,
    pbatch: PreferenceBatch,
    config: DPOLossConfig,
    num_examples_in_step: int,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    attn_implementation: Optional[str] = None,
) -> DPOOutput:
    """``dpo_forward`` with Liger's fused DPO loss (CUDA); the per-pair outputs for the metrics cost one
    no-grad ``fused_linear`` pass each, since Liger returns no log-probs."""
    cap = final_logit_softcap(model)
    w, ref_w = model.lm_head.weight, ref_model.lm_head.weight
    hidden_BTH = forward_hidden(model, pbatch.batch, attn_implementation)
    with torch.no_grad():
        ref_hidden_BTH = forward_hidden(ref_model, pbatch.batch, attn_implementation)
    loss = liger_dpo_loss(
        hidden_BTH,
        w,
        ref_hidden_BTH,
        ref_w,
        pbatch,
        config,
        num_examples_in_step,
        logit_softcap=cap,
        model_type=model.config.model_type,
    )
    with torch.no_grad():
        ref_D = sequence_logps(ref_hidden_BTH, ref_w, pbatch, "fused_linear", chunk_size, logit_softcap=cap)
        policy_D = sequence_logps(hidden_BTH.detach(), w, pbatch, "fused_linear", chunk_size, logit_softcap=cap)
        out = dpo_from_logps(
            policy_D,
            pbatch,
            config,
            ref_chosen_logps=ref_D[: pbatch.num_examples],
            ref_rejected_logps=ref_D[pbatch.num_examples :],
            num_examples_in_step=num_examples_in_step,
        )
    out.loss = loss
    return out
