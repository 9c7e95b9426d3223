"""GRPO under context parallelism on the torch backend: the per-token log-probs of a completion micro-batch from this
rank's shard of every row.

Every rank of a cp group holds ``T / cp`` tokens of each row of the micro-batch (``completion_shard``: the zigzag
shard of ``context_parallel.shard_for_rank``; the index of each scored completion token, in the shifted layout of
``CompletionBatch.target_doc_ids``, reordered alike by ``common.data.context_parallel.shard_doc_ids``). The policy
(the sampling policy, the reference) runs through the cp attention (``dpo.cp_hidden``); each rank scores the
completion tokens its shard predicts, puts them at their index of the micro-batch's ``n`` scored tokens (zeros
elsewhere) and sums that ``[n]`` vector over the cp group (``distributed.sum_over_ranks``, whose backward is the
identity). Every rank then holds all the per-token log-probs, computes the same GRPO loss, and its backward gives
the gradient of its own tokens only, so FSDP2's sum over the ranks is the single-process gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from twinseq.common.config import DEFAULT_CHUNK_SIZE
from twinseq.common.data.batching import pad_batch
from twinseq.common.data.context_parallel import pad_doc_ids, shard_doc_ids
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.grpo import CompletionBatch
from twinseq.torch_backend import context_parallel as cpmod
from twinseq.torch_backend.distributed import sum_over_ranks
from twinseq.torch_backend.dpo import cp_hidden
from twinseq.torch_backend.logprobs import (
    TargetRows,
    local_sequence_logps,
    shard_target_rows,
    token_logps_entropy,
)
from twinseq.torch_backend.losses import final_logit_softcap
from twinseq.torch_backend.unwrap import lm_head_weight


@dataclass
class CPCompletionShard:
    """This rank's share of a completion micro-batch under context parallelism."""

    cb: CompletionBatch  # the whole micro-batch: its [N, C] layout of the scored tokens
    shard: cpmod.CPShard  # this rank's [B, T / cp] tokens, ids and shifted targets, zigzag order
    token_BL: torch.Tensor  # long [B, T / cp]: the index (0..n-1) of the scored token predicted there (-1: none)


def token_index_BT(cb: CompletionBatch) -> np.ndarray:
    """int64 [B, T]: at each position t whose target ``labels[t + 1]`` is a scored completion token, that token's
    index in the order of ``TargetRows.of(cb)`` (``cb.token_row_n`` / ``token_col_n``); -1 elsewhere."""
    doc_T = cb.target_doc_ids.reshape(-1)
    out_T = np.full(doc_T.shape, -1, dtype=np.int64)
    idx = np.flatnonzero(doc_T >= 0)
    out_T[idx] = np.arange(idx.size)
    return out_T.reshape(cb.target_doc_ids.shape)


def completion_shard(cb: CompletionBatch, cp: int, cp_rank: int, device: Any = "cpu") -> CPCompletionShard:
    """``cp_rank``'s shard of ``cb``, its rows first padded to a multiple of ``2 * cp`` tokens (padding holds no
    scored token); the token indices are in the shifted layout, so they are reordered exactly as the targets."""
    rows = cb.batch.shape[0]
    shard = cpmod.shard_for_rank(pad_batch(cb.batch, rows, 2 * cp), cp, cp_rank, device)
    tok_BT = pad_doc_ids(token_index_BT(cb), rows, 2 * cp)
    token_BL = torch.as_tensor(np.ascontiguousarray(shard_doc_ids(tok_BT, cp, cp_rank)), dtype=torch.long)
    return CPCompletionShard(cb, shard, token_BL.to(device))


def scatter_NC(values_n: torch.Tensor, cb: CompletionBatch) -> torch.Tensor:
    """[N, C]: ``values_n`` at the (completion, column) of each scored token, 0 elsewhere."""
    out = values_n.new_zeros((cb.num_docs, cb.num_columns))
    rows = torch.as_tensor(cb.token_row_n, device=values_n.device)
    cols = torch.as_tensor(cb.token_col_n, device=values_n.device)
    return out.index_put((rows, cols), values_n)


def _local_logps_entropy(
    hidden_BLH: torch.Tensor, weight_VH: torch.Tensor, rows: TargetRows, loss_type: str, chunk_size: int, cap
) -> tuple[torch.Tensor, torch.Tensor]:
    """([n], [n]) log-probs and entropies of the tokens ``rows`` holds at their indices, 0 elsewhere; a shard with
    none still depends on ``hidden_BLH`` (zero gradient), so its backward runs the model's collectives too."""
    acc = torch.promote_types(hidden_BLH.dtype, torch.float32)
    if rows.idx_n.numel() == 0:
        zero = 0.0 * (hidden_BLH.sum() + weight_VH.sum())
        return hidden_BLH.new_zeros(rows.num_docs, dtype=acc) + zero, hidden_BLH.new_zeros(rows.num_docs, dtype=acc)
    logps_n, ent_n = token_logps_entropy(hidden_BLH, weight_VH, rows, loss_type, chunk_size, logit_softcap=cap)
    place = lambda v: v.new_zeros(rows.num_docs).index_add(0, rows.doc_n, v)  # noqa: E731
    return place(logps_n), place(ent_n)


def cp_completion_logps(
    causal_lm: torch.nn.Module,
    micro: CPCompletionShard,
    group: Any,
    strategy: str,
    *,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log-probs [N, C], entropy [N, C] or None) of each completion token of the whole micro-batch, the same on
    every rank of ``group``. Naive equivalent: ``grpo.completion_logps`` of the unsharded batch. ``entropy_grad``:
    the entropy keeps its gradient (the entropy bonus), else it is a constant. Backward gives this rank's share of
    the gradient (``distributed.sum_over_ranks``)."""
    cap = final_logit_softcap(causal_lm)
    if cap is not None and temperature != 1.0:
        raise ConfigError(
            f"temperature={temperature} with a model that soft-caps its logits (final_logit_softcapping={cap}): the "
            f"temperature would have to divide the capped logits, which the fused kernels do not do; use "
            f"--temperature 1.0 with this model."
        )
    hidden_BLH = cp_hidden(causal_lm, micro.shard, group, strategy)
    if temperature != 1.0:
        hidden_BLH = hidden_BLH / temperature  # (h / T) @ W.T = logits / T, the sampled distribution
    weight_VH = lm_head_weight(causal_lm)
    n = len(micro.cb.token_row_n)
    rows = shard_target_rows(micro.shard.targets, micro.token_BL, n, weight_VH.shape[0])
    if with_entropy and entropy_grad:
        logps_n, ent_n = _local_logps_entropy(hidden_BLH, weight_VH, rows, loss_type, chunk_size, cap)
        return scatter_NC(sum_over_ranks(logps_n, group), micro.cb), scatter_NC(sum_over_ranks(ent_n, group), micro.cb)
    logps_n = local_sequence_logps(hidden_BLH, weight_VH, rows, loss_type, chunk_size, logit_softcap=cap)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            _, ent_n = _local_logps_entropy(
                hidden_BLH.detach(), weight_VH.detach(), rows, "fused_linear", chunk_size, cap
            )
            entropy = scatter_NC(sum_over_ranks(ent_n, group), micro.cb)
    return scatter_NC(sum_over_ranks(logps_n, group), micro.cb), entropy
