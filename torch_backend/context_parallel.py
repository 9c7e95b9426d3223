"""Context parallelism (CP) for the torch backend: every rank of a ``cp`` group holds ``T / cp``
tokens of each row, in the load-balanced zigzag order of ``twinseq.common.data.context_parallel``.

Three strategies, each run as an HF attention function registered in ``transformers.AttentionInterface``
(so RoPE uses the shard's own ``position_ids`` and the rest of the Llama is untouched):

- ``allgather`` (``twinseq_cp_allgather``): each rank keeps its queries, all-gathers K/V
  (autograd-aware: the backward reduce-scatters dK/dV to their owners) and the segment and
  position ids (once per forward), then attends with the DESIGN.md rule

      query i may attend key j  iff  seg[i] == seg[j] != 0  and  pos[j] <= pos[i]

  so packed and padding-free rows never mix documents, also when a document crosses a shard
  boundary (the failure of TRL #6843, where accelerate's CP hook drops the mask). It runs on
  gloo (CPU) and NCCL. Memory: the gathered K/V [B, KV, T, D] and no mask (a sliding window
  is one more condition on the
  gathered positions, ``pos[i] - pos[j] < sliding_window``), soft-capped scores (Gemma 2)
  included, all computed by ``blocked_attention.blocked_attention``: the local queries against
  the gathered keys block by block (online softmax, each block pair's mask built from the
  ids), so the attention temporaries are O(T/cp x block), never the [T/cp, T] mask or scores.
  Padding queries get a zero output. Attention sinks (gpt-oss's ``s_aux``, a logit per query head with no
  value) enter the blocked attention's online softmax as its first column.
- ``ring`` (``twinseq_cp_ring``): torch's native ``context_parallel`` (CUDA SDPA flash or
  efficient kernels, head-tail load balancing, K/V rotated around the ring). It knows only
  ``is_causal``, so it is correct for UNPACKED, right-padded rows only; packed or
  padding-free data is refused with a ``ValueError`` (``check_ring_batch``), never mixed. For
  the same reason it cannot slide a window, soft-cap scores or add attention sinks: such models are refused
  (``check_ring_model``).
- ``ulysses`` (``twinseq_cp_ulysses``): DeepSpeed-Ulysses sequence parallelism (ALST). The rank keeps
  its zigzag shard for everything but attention; in each attention layer one all-to-all turns the
  sequence-sharded q/k/v [B, H, T/cp, D] into head-sharded [B, H/cp, T, D] (the whole row, a slice of
  the heads), the blocked document attention runs on the whole row with the gathered segment and
  position ids (the rule above; sliding window, soft-cap and sinks as ``allgather``, each rank its heads' sinks),
  and the inverse
  all-to-all returns [B, H, T/cp, D]. The exchange is autograd-aware: the backward of each all-to-all
  is the other one. It is ``torch.distributed.all_to_all_single``, which NCCL and gloo (CPU tensors)
  both implement. GQA: the K/V heads are split the same way when ``num_key_value_heads % cp == 0``;
  otherwise each K/V head is repeated ``lcm(KV, cp) / KV`` times first (logged), the fewest copies
  that split evenly. ``num_attention_heads % cp != 0`` is refused (``check_ulysses_heads``).
  Traffic per layer: q, k, v and the output once each, (cp - 1)/cp of them leaving the rank, against
  allgather's whole-row K/V; memory: attention temporaries O(T x block) per rank for H/cp heads.

Naive equivalent of every strategy (what the tests check): the dense document-masked attention
of ``twinseq.torch_backend.attention.document_mask`` on the unsharded row, then the rank's slice.

The labels are shifted BEFORE the zigzag reorder (``common.data.context_parallel.shard_batch``), so
a shard carries ``targets`` and the loss must not shift again (``targets_are_shifted=True``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface

from twinseq.common.config import DEFAULT_ATTENTION_BLOCK_SIZE
from twinseq.common.data.batching import Batch
from twinseq.common.data.context_parallel import check_seq_len, cp_permutation, shard_batch
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.nll import shift_labels
from twinseq.common.run.capabilities import check_ulysses_heads
from twinseq.torch_backend.attention import mask_layout, softcapped_attention
from twinseq.torch_backend.blocked_attention import BlockedPlan, attention_block_size, blocked_attention

logger = logging.getLogger(__name__)

ALLGATHER_HF_NAME = "twinseq_cp_allgather"
RING_HF_NAME = "twinseq_cp_ring"
ULYSSES_HF_NAME = "twinseq_cp_ulysses"
HF_NAMES = {"allgather": ALLGATHER_HF_NAME, "ring": RING_HF_NAME, "ulysses": ULYSSES_HF_NAME}
CP_KWARG = "twinseq_cp"  # the keyword that carries a ``CPAttentionContext`` down to every attention layer


# --------------------------------------------------------------------------------------
# A rank's shard of a batch
# --------------------------------------------------------------------------------------


@dataclass
class CPShard:
    """This rank's ``[B, T / cp]`` slice of a batch as long tensors, in zigzag order.

    ``targets`` are already shifted (``labels[t + 1]`` in token order, then reordered);
    ``num_items_in_batch`` stays the label count of the whole optimizer step.
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    segment_ids: torch.Tensor
    num_items_in_batch: int
    cp: int
    cp_rank: int

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens of this shard."""
        return int((self.segment_ids != 0).sum())

    @property
    def num_label_tokens(self) -> int:
        """Targets of this shard (the shards of a batch add up to ``Batch.num_label_tokens``)."""
        return int((self.targets != -100).sum())

    @property
    def is_packed(self) -> bool:
        return int(self.segment_ids.max()) > 1 if self.segment_ids.numel() else False


def check_cp_seq_len(seq_len: int, cp: int) -> None:
    """``ValueError`` naming ``--pad-to-multiple-of 2*cp`` unless ``seq_len`` splits into 2*cp chunks."""
    check_seq_len(seq_len, cp, load_balance=True)


def shard_for_rank(batch: Batch, cp: int, cp_rank: int, device: Any = "cpu") -> CPShard:
    """Shift the labels, reorder the row (zigzag) and keep ``cp_rank``'s contiguous slice.

    >>> from twinseq.common.data.batching import collate
    >>> b = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 4, 3, 2]}], padding_free=True)
    >>> s = shard_for_rank(b, cp=2, cp_rank=0)
    >>> s.input_ids.tolist(), s.targets.tolist(), s.position_ids.tolist()
    ([[5, 6, 3, 2]], [[6, 7, 2, -100]], [[0, 1, 3, 4]])
    """
    check_cp_seq_len(batch.input_ids.shape[1], cp)
    if batch.shares_prefix:
        raise ConfigError(
            f"context_parallel_size={cp} got a prefix-shared batch (parent_ids set); torch's context-parallel "
            f"attention does not carry parent segments yet; pass share_prefix=False when collating (--no-share-prefix)."
        )
    arrays = shard_batch(batch, cp, load_balance=True).rank(cp_rank)

    def tensor(name: str) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(arrays[name]), dtype=torch.long, device=device)

    return CPShard(
        tensor("input_ids"),
        tensor("targets"),
        tensor("position_ids"),
        tensor("segment_ids"),
        int(batch.num_items_in_batch),
        int(cp),
        int(cp_rank),
    )


# --------------------------------------------------------------------------------------
# allgather: autograd-aware gather of the sequence dimension
# --------------------------------------------------------------------------------------


def _gather_chunks(x: torch.Tensor, group) -> list[torch.Tensor]:
    chunks = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(chunks, x, group=group)
    return chunks


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather ``x`` along ``dim`` (rank order). Backward: reduce-scatter (sum) the
    gradient, so each rank gets the sum over ranks of the gradient of its own chunk.

    NCCL has ``reduce_scatter``; gloo has not, so there the full gradient is all-reduced and the
    rank's chunk kept (same sum, more traffic).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.size = group, dim, x.shape[dim]
        return torch.cat(_gather_chunks(x.contiguous(), group), dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, dim = ctx.group, ctx.dim
        rank = dist.get_rank(group)
        grad = grad.contiguous()
        if dist.get_backend(group) == dist.Backend.NCCL:
            chunks = [c.contiguous() for c in grad.split(ctx.size, dim=dim)]
            out = torch.empty_like(chunks[rank])
            dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=group)
        else:
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
            out = grad.narrow(dim, rank * ctx.size, ctx.size).contiguous()
        return out, None, None


def gather_sequence(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """``cat([x of rank 0, x of rank 1, ...], dim)`` with the reduce-scatter backward."""
    return _GatherSequence.apply(x, group, dim)


def cp_allowed_mask(
    seg_q_BL: torch.Tensor,
    pos_q_BL: torch.Tensor,
    seg_k_BT: torch.Tensor,
    pos_k_BT: torch.Tensor,
    q_offset: int,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """bool [B, 1, L, T]: the mask rule for L local queries against all T keys (zigzag order), within
    ``sliding_window`` positions when given.

    A padding query (segment 0) gets its own key (global index ``q_offset + i``) as its only
    key, as ``attention.allowed_mask`` does: no empty softmax row, hence no NaN.
    """
    same_doc = (seg_q_BL[:, :, None] == seg_k_BT[:, None, :]) & (seg_q_BL[:, :, None] != 0)
    distance = pos_q_BL[:, :, None] - pos_k_BT[:, None, :]
    causal = distance >= 0
    if sliding_window is not None:
        causal = causal & (distance < sliding_window)
    L, T = seg_q_BL.shape[1], seg_k_BT.shape[1]
    q_idx = torch.arange(q_offset, q_offset + L, device=seg_q_BL.device)
    self_key = q_idx[:, None] == torch.arange(T, device=seg_q_BL.device)[None, :]
    return ((same_doc & causal) | (self_key & (seg_q_BL[:, :, None] == 0)))[:, None]


@dataclass
class CPAttentionContext:
    """What every attention layer of one forward needs; built once per forward by ``make_context``."""

    group: Any  # the cp ProcessGroup (None: one rank, nothing to gather)
    plan: Optional[BlockedPlan]  # queries' and keys' ids: local x gathered (allgather), gathered x gathered
    # (ulysses); None for ring
    sliding_window: Optional[int] = None  # the window of the model's sliding layers, if any
    strategy: str = "allgather"

    def plan_for(self, block_size: int) -> BlockedPlan:
        """``plan`` with blocks of ``block_size`` tokens (the layer's ``attention_block_size``), rebuilt once if
        it was made with another size; its block-pair lists are then shared by every layer."""
        assert self.plan is not None, "plan_for is the allgather and ulysses strategies'; a ring context has no plan"
        if self.plan.block_size != block_size:
            p = self.plan
            self.plan = BlockedPlan(p.seg_q, p.pos_q, p.seg_k, p.pos_k, block_size)
        return self.plan


def make_context(
    shard: CPShard,
    group,
    strategy: str,
    sliding_window: Optional[int] = None,
    block_size: int = DEFAULT_ATTENTION_BLOCK_SIZE,
) -> CPAttentionContext:
    """Gather the segment and position ids of the whole row once (no gradient), for the blocked attention of
    the local queries (allgather) or of the whole row (ulysses) against the gathered keys (``sliding_window``:
    the window of the model's sliding layers, ``attention.mask_layout``). No mask is built: each block pair's
    comes from these ids."""
    if strategy == "ring":
        return CPAttentionContext(group, None, strategy="ring")
    seg_k, pos_k = shard.segment_ids, shard.position_ids
    if group is not None and shard.cp > 1:
        ids = torch.stack([shard.segment_ids, shard.position_ids])
        gathered = torch.cat(_gather_chunks(ids.contiguous(), group), dim=2)
        seg_k, pos_k = gathered[0], gathered[1]
    if strategy == "ulysses":
        return CPAttentionContext(group, BlockedPlan(seg_k, pos_k, seg_k, pos_k, block_size), sliding_window, strategy)
    plan = BlockedPlan(shard.segment_ids, shard.position_ids, seg_k, pos_k, block_size)
    return CPAttentionContext(group, plan, sliding_window)


def local_document_attention(
    q_BHLD: torch.Tensor,
    k_BKTD: torch.Tensor,
    v_BKTD: torch.Tensor,
    allowed_B1LT: torch.Tensor,
    scaling: Optional[float],
    dropout: float = 0.0,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """[B, H, L, D]: local queries against every key, masked by ``allowed_B1LT`` (GQA-aware).

    Naive equivalent: ``softmax(softcap(q k^T * scaling) + where(allowed, 0, -inf)) v``, where
    ``softcap(s) = softcap * tanh(s / softcap)`` only when ``softcap`` is given (Gemma 2).
    """
    if softcap is not None:
        return softcapped_attention(q_BHLD, k_BKTD, v_BKTD, allowed_B1LT, scaling, softcap, dropout)
    return F.scaled_dot_product_attention(
        q_BHLD,
        k_BKTD,
        v_BKTD,
        attn_mask=allowed_B1LT,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=k_BKTD.shape[1] != q_BHLD.shape[1],
    )


def _context(kwargs: dict, name: str) -> CPAttentionContext:
    ctx = kwargs.get(CP_KWARG)
    if ctx is None:
        raise ConfigError(
            f"attention {name!r} needs a CPAttentionContext in the {CP_KWARG!r} keyword; run the "
            f"model through twinseq.torch_backend.parallel (CausalLMLoss), not model(input_ids)."
        )
    return ctx


def _check_layer(
    module: torch.nn.Module, ctx: CPAttentionContext, strategy: str, dropout: float, sliding_window: Optional[int]
) -> None:
    """``ConfigError`` for a layer the context cannot serve: another strategy's context, another window, dropout."""
    if ctx.strategy != strategy:
        raise ConfigError(
            f"attention {HF_NAMES[strategy]!r} got a CPAttentionContext built for strategy={ctx.strategy!r}; "
            f"build it with make_context(..., strategy={strategy!r})."
        )
    if sliding_window is not None and sliding_window != ctx.sliding_window:
        raise ConfigError(
            f"a layer of {type(module).__name__} slides within {sliding_window} positions but the "
            f"CPAttentionContext was built for sliding_window={ctx.sliding_window}; build it with "
            f"make_context(..., sliding_window=mask_layout(model.config).sliding_window)."
        )
    if dropout > 0 and module.training:
        raise ConfigError(
            f"context_parallel_strategy={strategy!r} has no attention dropout (got {dropout} from "
            f"{type(module).__name__}); set attention_dropout=0."
        )


def allgather_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention ``twinseq_cp_allgather``: q [B, H, L, D], k/v [B, KV, L, D] (local) -> [B, L, H, D].

    ``sliding_window``, ``softcap`` and the attention sinks ``s_aux`` [H] are the layer's, as HF's attention modules
    pass them.
    """
    ctx = _context(kwargs, ALLGATHER_HF_NAME)
    _check_layer(module, ctx, "allgather", dropout, sliding_window)
    if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
        key, value = gather_sequence(key, ctx.group, 2), gather_sequence(value, ctx.group, 2)
    out_BHLD = blocked_attention(
        query,
        key,
        value,
        ctx.plan_for(attention_block_size(module)),
        scaling,
        sliding_window,
        softcap,
        kwargs.get("s_aux"),
    )
    return out_BHLD.transpose(1, 2).contiguous(), None


# --------------------------------------------------------------------------------------
# ulysses: all-to-all from sequence shards to head shards and back
# --------------------------------------------------------------------------------------


def _all_to_all(x_PX: torch.Tensor, group) -> torch.Tensor:
    """Chunk ``p`` of dim 0 goes to rank ``p``; chunk ``p`` of the result came from rank ``p`` (NCCL and gloo)."""
    out = torch.empty_like(x_PX)
    dist.all_to_all_single(out, x_PX, group=group)
    return out


def seq_to_head(x_BNLD: torch.Tensor, group) -> torch.Tensor:
    """[B, N, L, D] (this rank's L tokens, all N heads) -> [B, N/P, P*L, D]: on rank r, heads ``r*N/P`` to
    ``(r+1)*N/P - 1`` of the whole row, the ranks' shards in rank order (the gathered order of ``make_context``).
    No autograd (``SeqToHead`` is the autograd-aware one)."""
    P = dist.get_world_size(group)
    B, N, L, D = x_BNLD.shape
    x_PBnLD = x_BNLD.reshape(B, P, N // P, L, D).transpose(0, 1).contiguous()
    y_PBnLD = _all_to_all(x_PBnLD, group)  # chunk p: rank p's tokens
    return y_PBnLD.permute(1, 2, 0, 3, 4).reshape(B, N // P, P * L, D)


def head_to_seq(y_BnTD: torch.Tensor, group) -> torch.Tensor:
    """The inverse of ``seq_to_head``: [B, N/P, T, D] -> [B, N, T/P, D]."""
    P = dist.get_world_size(group)
    B, n, T, D = y_BnTD.shape
    y_PBnLD = y_BnTD.reshape(B, n, P, T // P, D).permute(2, 0, 1, 3, 4).contiguous()
    x_PBnLD = _all_to_all(y_PBnLD, group)  # chunk p: rank p's heads
    return x_PBnLD.transpose(0, 1).reshape(B, P * n, T // P, D)


class SeqToHead(torch.autograd.Function):
    """``seq_to_head`` with its adjoint, ``head_to_seq``, as the backward (a permutation's transpose is its
    inverse)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return seq_to_head(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return head_to_seq(grad.contiguous(), ctx.group), None


class HeadToSeq(torch.autograd.Function):
    """``head_to_seq`` with ``seq_to_head`` as the backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return head_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return seq_to_head(grad.contiguous(), ctx.group), None


def kv_repeats(num_heads: int, num_kv_heads: int, cp: int) -> int:
    """How many copies of each K/V head let ``cp`` ranks split them: 1 when ``num_kv_heads % cp == 0``, else
    ``lcm(num_kv_heads, cp) / num_kv_heads`` (at most ``num_heads / num_kv_heads``: then every query head has its
    own copy). Repeating with ``repeat_interleave`` keeps query head h on K/V head ``h // (H / KV)``.

    >>> kv_repeats(8, 4, 2), kv_repeats(8, 2, 4), kv_repeats(12, 2, 4), kv_repeats(4, 1, 4)
    (1, 2, 2, 4)
    """
    check_ulysses_heads(num_heads, cp)
    repeats = math.lcm(num_kv_heads, cp) // num_kv_heads
    assert num_heads % (num_kv_heads * repeats) == 0, (num_heads, num_kv_heads, cp)
    return repeats


@functools.lru_cache(maxsize=None)
def _log_exchange(cp: int, backend: str, num_kv_heads: int, repeats: int) -> None:
    logger.info(
        "ulysses: q/k/v and the output move by torch.distributed.all_to_all_single over %d ranks (%s); "
        "num_key_value_heads=%d, each K/V head sent %d time(s)%s",
        cp,
        backend,
        num_kv_heads,
        repeats,
        "" if repeats == 1 else " (repeated: the K/V heads do not split over the ranks; the fewest copies that do)",
    )


def ulysses_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention ``twinseq_cp_ulysses``: q [B, H, L, D], k/v [B, KV, L, D] (local) -> [B, L, H, D].

    Naive equivalent: gather q, k, v of the whole row, run the document-masked attention, keep this rank's L
    tokens; here each rank computes H/cp heads of the whole row instead of all heads of its tokens.
    """
    ctx = _context(kwargs, ULYSSES_HF_NAME)
    _check_layer(module, ctx, "ulysses", dropout, sliding_window)
    cp = dist.get_world_size(ctx.group) if ctx.group is not None else 1
    sinks: Optional[torch.Tensor] = kwargs.get("s_aux")
    if cp > 1:
        if sinks is not None:  # this rank holds query heads [r * H / cp, (r + 1) * H / cp) of the whole row
            sinks = sinks.view(cp, -1)[dist.get_rank(ctx.group)]
        repeats = kv_repeats(query.shape[1], key.shape[1], cp)
        _log_exchange(cp, str(dist.get_backend(ctx.group)), key.shape[1], repeats)
        if repeats > 1:
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        query, key, value = (SeqToHead.apply(x, ctx.group) for x in (query, key, value))
    plan = ctx.plan_for(attention_block_size(module))
    out_BhTD = blocked_attention(query, key, value, plan, scaling, sliding_window, softcap, sinks)
    out_BHLD = HeadToSeq.apply(out_BhTD, ctx.group) if cp > 1 else out_BhTD
    return out_BHLD.transpose(1, 2).contiguous(), None


# --------------------------------------------------------------------------------------
# ring: torch's native context_parallel (CUDA), unpacked rows only
# --------------------------------------------------------------------------------------


def ring_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention ``twinseq_cp_ring``: causal SDPA, which ``torch...context_parallel`` turns into a ring.

    Only ``is_causal`` reaches the kernel: the rows must hold one document each, right-padded
    (``check_ring_batch``). K/V heads are repeated here because the ring kernels take no GQA flag.
    """
    _context(kwargs, RING_HF_NAME)
    if any(kwargs.get(name) is not None for name in ("sliding_window", "softcap", "s_aux")):
        raise ConfigError(
            f"context_parallel_strategy='ring' cannot slide a window, soft-cap scores or add attention sinks (layer "
            f"of {type(module).__name__}); use --context-parallel-strategy allgather."
        )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    # torch's ring exists for these two kernels only; the math fallback would raise inside CP
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out_BHLD = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout if module.training else 0.0, is_causal=True, scale=scaling
        )
    return out_BHLD.transpose(1, 2).contiguous(), None


def check_ring_model(config: Any) -> None:
    """``ConfigError`` for a model whose attention the ring cannot compute: it knows ``is_causal`` only, so
    neither a sliding window (Mistral, Qwen2/3 with ``use_sliding_window``, Gemma 2) nor soft-capped
    scores (Gemma 2) nor attention sinks (gpt-oss)."""
    layout = mask_layout(config)
    features = [
        f"sliding_window={layout.sliding_window}" if layout.sliding_window is not None else "",
        f"attn_logit_softcapping={layout.softcap}" if layout.softcap is not None else "",
        "attention sinks (a learned logit per head in every softmax)" if layout.sinks else "",
    ]
    features = [f for f in features if f]
    if features:
        raise ConfigError(
            f"context_parallel_strategy='ring' cannot compute the attention of model_type "
            f"{config.model_type!r} ({', '.join(features)}): torch's ring attention applies a plain "
            f"causal mask only. Use --context-parallel-strategy allgather, which masks windows, "
            f"soft-caps scores and adds attention sinks."
        )


def check_ring_batch(batch: Batch) -> None:
    """``ValueError`` unless every row holds one document, right-padded (what ``is_causal`` can mask)."""
    seg_BT = np.asarray(batch.segment_ids)
    if int(seg_BT.max(initial=0)) > 1:
        raise ConfigError(
            "context_parallel_strategy='ring' got a packed/padding-free batch (several documents per "
            "row); torch's ring attention only applies a causal mask and would attend across "
            "documents (TRL #6843). Use --context-parallel-strategy allgather, which masks documents."
        )
    real_BT = seg_BT != 0
    if (real_BT[:, 1:] & ~real_BT[:, :-1]).any():
        raise ConfigError(
            "context_parallel_strategy='ring' needs right padding (a causal mask lets real tokens "
            "see left padding); set --padding-side right or use --context-parallel-strategy allgather."
        )


@dataclass
class RingMicroBatch:
    """A full ``Batch`` for ``ring_context`` plus the token counts of this rank's shard (for metrics)."""

    batch: Batch
    num_tokens: int
    num_label_tokens: int


def ring_micro_batch(batch: Batch, cp: int, cp_rank: int) -> RingMicroBatch:
    """Check ``batch`` for the ring and count the tokens ``cp_rank`` will hold."""
    check_ring_batch(batch)
    shard = shard_for_rank(batch, cp, cp_rank)
    return RingMicroBatch(batch, shard.num_tokens, shard.num_label_tokens)


def ring_load_balancer_indices(seq_len: int, cp: int) -> np.ndarray:
    """int64 [T]: torch's head-tail load-balancer order (rank shards contiguous), for comparison with
    ``common.data.context_parallel.cp_permutation`` (they must agree: the loss counts targets by it)."""
    return _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices().reshape(-1).numpy()


@contextlib.contextmanager
def ring_context(cp_mesh, batch: Batch, device: Any):
    """Enter torch's ``context_parallel`` over ``cp_mesh`` and yield this rank's ``CPShard``.

    torch shards ``input_ids``, the pre-shifted targets and ``position_ids`` itself (head-tail
    order, equal to ``cp_permutation``) and patches SDPA into ring attention for the forward and
    backward run inside the ``with`` block.
    """
    check_ring_batch(batch)
    cp = cp_mesh.size()
    check_cp_seq_len(batch.input_ids.shape[1], cp)
    assert np.array_equal(
        ring_load_balancer_indices(batch.input_ids.shape[1], cp), cp_permutation(batch.input_ids.shape[1], cp)
    ), "torch's head-tail order changed"
    buffers = [
        torch.as_tensor(np.asarray(x), dtype=torch.long, device=device)
        for x in (batch.input_ids, shift_labels(batch.labels), batch.position_ids, batch.segment_ids)
    ]
    with context_parallel(
        cp_mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers=set(buffers)
    ):
        input_ids, targets, position_ids, segment_ids = buffers
        yield CPShard(
            input_ids, targets, position_ids, segment_ids, int(batch.num_items_in_batch), cp, cp_mesh.get_local_rank()
        )


def register_cp_attention() -> None:
    """Register the CP attention functions with transformers (idempotent; never at import)."""
    functions = (
        (ALLGATHER_HF_NAME, allgather_attention_forward),
        (RING_HF_NAME, ring_attention_forward),
        (ULYSSES_HF_NAME, ulysses_attention_forward),
    )
    for name, fn in functions:
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, fn)
