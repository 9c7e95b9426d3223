"""Document-causal attention for the JAX backend, driven by segment and position ids.

The mask rule is the one of DESIGN.md ("The data contract"): query i may attend to key j
iff ``segment_ids[i] == segment_ids[j] != 0`` and ``position_ids[j] <= position_ids[i]``.
On a sliding-window layer (Mistral, Gemma 2's local layers, Qwen2's optional ones) also
``position_ids[i] - position_ids[j] < sliding_window``: transformers' rule ``q_idx - kv_idx <
window`` with positions counted within the document, so a window never reaches into another
document nor depends on where the document sits in a packed row.
Shared prefixes (``twinseq.common.data.prefix_sharing``): with ``parent_ids`` a query also attends to the
keys of its parent segment (``segment_ids[j] == parent_ids[i] != 0``), positions and windows as above;
``parent_ids=None`` (no parents) builds exactly the program without them.
Attention sinks (gpt-oss, ``sinks_N``: one learned logit per query head) join every query's softmax
denominator with no value, ``softmax([scores, sink])[:-1] @ V``, on every path: the dense one appends the
sink as a last score column (HF eager's order), the blocked kernel corrects its output with the row's
log-sum-exp (``context_parallel``). ``sinks_N=None`` builds exactly the program without them.
Padded batches (one document per row, segment 0 on padding) and padding-free batches
(many documents in one row) go through the same code; only B, T and the ids differ.

Every shape depends on (B, T) alone, so a jitted step compiles once per (B, T) bucket.

Two implementations of the same rule, picked by ``attn_implementation`` (``attention_for``):

``eager``   the dense reference: a ``[B, 1, T, T]`` mask and ``[B, N, T, T]`` scores, HF's eager
            operation order (scores in the input dtype). Memory O(T^2); parity tests and small T.
``sdpa``    (the default, and every other name) ``blocked_document_attention``: online softmax over
            ``[block, block]`` tiles with a custom VJP that recomputes the tiles in backward
            (FlashAttention-2), the kernel of the ring (``context_parallel``). Memory O(T * block);
            tiles with no allowed pair are skipped, so packed documents also save compute.

No fused kernel is used: ``jax.nn.dot_product_attention`` (jax 0.10, cuDNN included) takes a dense
mask or bias, ``is_causal``, one length per row and a left window, but no segment ids, so it cannot
mask several documents in a row without the O(T^2) mask this module exists to avoid.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

from twinseq.common.config import DEFAULT_ATTENTION_BLOCK_SIZE, JAX_DENSE_ATTN_IMPLEMENTATIONS
from twinseq.common.errors import ConfigError
from twinseq.jax_backend.context_parallel import blocked_attention_heads_first

logger = logging.getLogger(__name__)

DENSE_IMPLEMENTATIONS = JAX_DENSE_ATTN_IMPLEMENTATIONS
"""``attn_implementation`` values that run the dense reference; every other value runs the blocked kernel."""


def document_causal_mask(
    segment_ids_BT: jax.Array,
    position_ids_BT: jax.Array,
    sliding_window: Optional[int] = None,
    parent_ids_BT: Optional[jax.Array] = None,
) -> jax.Array:
    """bool [B, 1, T, T]: ``allowed[b, 0, i, j]`` per the mask rule (head axis broadcast), with the keys of
    each query's parent segment when ``parent_ids_BT`` is given.

    >>> seg = jnp.array([[1, 1, 2, 2, 0]]); pos = jnp.array([[0, 1, 0, 1, 0]])
    >>> document_causal_mask(seg, pos)[0, 0].astype(int).tolist()
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]]
    >>> one_doc = jnp.array([[1, 1, 1]]), jnp.array([[0, 1, 2]])
    >>> document_causal_mask(*one_doc, sliding_window=2)[0, 0].astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    >>> shared = jnp.array([[1, 1, 2, 2, 3]]), jnp.array([[0, 1, 2, 3, 2]]), jnp.array([[0, 0, 1, 1, 1]])
    >>> document_causal_mask(*shared[:2], parent_ids_BT=shared[2])[0, 0, 4].astype(int).tolist()
    [1, 1, 0, 0, 1]
    """
    seg_q, seg_k = segment_ids_BT[:, :, None], segment_ids_BT[:, None, :]
    pos_q, pos_k = position_ids_BT[:, :, None], position_ids_BT[:, None, :]
    same_BTT = (seg_q == seg_k) & (seg_q != 0)
    if parent_ids_BT is not None:
        same_BTT = same_BTT | ((parent_ids_BT[:, :, None] == seg_k) & (seg_k != 0))
    allowed_BTT = same_BTT & (pos_k <= pos_q)
    if sliding_window is not None:
        allowed_BTT = allowed_BTT & (pos_q - pos_k < sliding_window)
    return allowed_BTT[:, None, :, :]


def repeat_kv(x_BKTD: jax.Array, num_groups: int) -> jax.Array:
    """[B, K, T, D] -> [B, K * num_groups, T, D], each kv head repeated in place (HF ``repeat_kv``)."""
    if num_groups == 1:
        return x_BKTD
    return jnp.repeat(x_BKTD, num_groups, axis=1)


def soft_cap(x: jax.Array, cap: float) -> jax.Array:
    """``cap * tanh(x / cap)`` in HF's operation order (divide, tanh, multiply), in ``x``'s dtype."""
    return jnp.tanh(x / jnp.asarray(cap, x.dtype)) * jnp.asarray(cap, x.dtype)


def dot_product_attention(
    q_BNTD: jax.Array,
    k_BKTD: jax.Array,
    v_BKTD: jax.Array,
    allowed_B1TT: jax.Array,
    scaling: float,
    softcap: Optional[float] = None,
    sinks_N: Optional[jax.Array] = None,
) -> jax.Array:
    """Masked softmax attention, as HF's eager path: [B, N, T, D] out.

    Scores are computed in the input dtype (and soft-capped there, after the scaling and before the mask,
    when ``softcap`` is set: Gemma 2), and the softmax in float32, then cast back, like
    ``eager_attention_forward`` of transformers. Masked scores take the dtype's lowest finite
    value (HF's additive mask value), so allowed entries are bit-identical to HF.

    A query with no allowed key (a padding token) gets an all-zero output instead of a
    uniform average over garbage: no NaN, and nothing from padding can leak anywhere.

    ``sinks_N`` (gpt-oss): head ``n``'s sink logit is appended as a last column of its scores (after the mask,
    in the scores' dtype, as ``GptOssAttention``'s eager path), the softmax taken over both, the sink's column
    dropped: the keys' probabilities then sum to less than 1.
    """
    num_groups = q_BNTD.shape[1] // k_BKTD.shape[1]
    k_BNTD = repeat_kv(k_BKTD, num_groups)
    v_BNTD = repeat_kv(v_BKTD, num_groups)
    scores_BNTT = jnp.einsum("bnqd,bnkd->bnqk", q_BNTD, k_BNTD) * jnp.asarray(scaling, q_BNTD.dtype)
    if softcap is not None:
        scores_BNTT = soft_cap(scores_BNTT, softcap)
    scores_BNTT = jnp.where(allowed_B1TT, scores_BNTT, jnp.finfo(scores_BNTT.dtype).min)
    if sinks_N is None:
        probs_BNTT = jax.nn.softmax(scores_BNTT.astype(jnp.float32), axis=-1)
    else:
        b, n, t, _ = scores_BNTT.shape
        sink_BNT1 = jnp.broadcast_to(sinks_N.astype(scores_BNTT.dtype).reshape(1, n, 1, 1), (b, n, t, 1))
        combined_BNTK = jnp.concatenate([scores_BNTT, sink_BNT1], axis=-1).astype(jnp.float32)
        probs_BNTT = jax.nn.softmax(combined_BNTK, axis=-1)[..., :-1]
    # Fully-masked rows would be uniform over masked keys; zero them (padding queries only).
    probs_BNTT = jnp.where(allowed_B1TT, probs_BNTT, 0.0).astype(q_BNTD.dtype)
    return jnp.einsum("bnqk,bnkd->bnqd", probs_BNTT, v_BNTD)


def document_attention(
    q_BNTD: jax.Array,
    k_BKTD: jax.Array,
    v_BKTD: jax.Array,
    segment_ids_BT: jax.Array,
    position_ids_BT: jax.Array,
    scaling: float,
    *,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    parent_ids_BT: Optional[jax.Array] = None,
    sinks: Optional[jax.Array] = None,
) -> jax.Array:
    """The model's default attention in the pluggable signature, ``[B, N, T, D]`` out.

    ``attend(q_BNTD, k_BKTD, v_BKTD, segment_ids_BT, position_ids_BT, scaling, **options) -> out_BNTD`` is
    what ``CausalLM(..., attend=...)`` accepts (``options``: ``sliding_window``, ``softcap`` on the layers
    that have them); ``parallel.ring_attention_fn(mesh)`` returns a context-parallel one. This is the dense
    reference they must match:
    ``dot_product_attention(q, k, v, document_causal_mask(seg, pos, sliding_window, par), scaling, softcap)``.
    A shared batch passes ``parent_ids_BT=`` (``AttendFn``'s optional keyword; absent without shared prefixes);
    a layer with attention sinks passes ``sinks=`` (its ``[N]`` sink logits; absent on layers without).
    """
    allowed_B1TT = document_causal_mask(segment_ids_BT, position_ids_BT, sliding_window, parent_ids_BT)
    return dot_product_attention(q_BNTD, k_BKTD, v_BKTD, allowed_B1TT, scaling, softcap, sinks_N=sinks)


def blocked_document_attention(
    q_BNTD: jax.Array,
    k_BKTD: jax.Array,
    v_BKTD: jax.Array,
    segment_ids_BT: jax.Array,
    position_ids_BT: jax.Array,
    scaling: float,
    *,
    block_size: int = DEFAULT_ATTENTION_BLOCK_SIZE,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    parent_ids_BT: Optional[jax.Array] = None,
    sinks: Optional[jax.Array] = None,
) -> jax.Array:
    """``document_attention`` without the T x T mask or scores: ``[B, N, T, D]`` out, in q's dtype.

    Naive equivalent (equal up to float32 rounding; the blocked kernel accumulates in float32 where
    the dense path rounds bfloat16 scores and probabilities to the input dtype)::

        document_attention(q, k, v, seg, pos, scaling, sliding_window=w, softcap=c, parent_ids_BT=par, sinks=s)

    T is padded up to a multiple of the block (``min(block_size, T)``) with segment 0 (parent 0), which no
    query attends to and whose queries get zeros; the padding is sliced off again. A tile pair is skipped
    only when no query of it may see any key of it, parents included.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(
            f"attention_block_size={block_size!r} is not valid; pass a positive integer (tokens per query/key "
            f"tile of the blocked attention), e.g. 512."
        )
    t = q_BNTD.shape[2]
    block = min(block_size, t)
    pad = -t % block
    if pad:

        def pad_t(x, axis):
            return jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)])

        q_BNTD, k_BKTD, v_BKTD = pad_t(q_BNTD, 2), pad_t(k_BKTD, 2), pad_t(v_BKTD, 2)
        segment_ids_BT, position_ids_BT = pad_t(segment_ids_BT, 1), pad_t(position_ids_BT, 1)
        parent_ids_BT = None if parent_ids_BT is None else pad_t(parent_ids_BT, 1)
    out_BNTD = blocked_attention_heads_first(
        q_BNTD,
        k_BKTD,
        v_BKTD,
        segment_ids_BT,
        position_ids_BT,
        scale=scaling,
        block_size=block,
        sliding_window=sliding_window,
        softcap=softcap,
        parent_ids_BT=parent_ids_BT,
        sinks_N=sinks,
    )
    return out_BNTD[:, :, :t] if pad else out_BNTD


@dataclass(frozen=True)
class BlockedAttention:
    """An ``AttendFn`` (see ``model.AttendFn``) running ``blocked_document_attention`` with ``block_size``.

    A frozen dataclass, so it is hashable by value: a static argument of ``jit``/``checkpoint`` that
    does not retrace when rebuilt with the same block size.
    """

    block_size: int = DEFAULT_ATTENTION_BLOCK_SIZE

    def __call__(
        self,
        q_BNTD,
        k_BKTD,
        v_BKTD,
        segment_ids_BT,
        position_ids_BT,
        scaling,
        *,
        sliding_window: Optional[int] = None,
        softcap: Optional[float] = None,
        parent_ids_BT: Optional[jax.Array] = None,
        sinks: Optional[jax.Array] = None,
    ) -> jax.Array:
        if q_BNTD.shape[2] <= self.block_size:
            # One block: the blocked kernel would hold the same T x T tile the dense path does, only with
            # the online-softmax rescaling's extra rounding. Rows that fit one block take the dense path,
            # which is HF eager's operation order (as torch keeps sdpa for short rows).
            return document_attention(
                q_BNTD,
                k_BKTD,
                v_BKTD,
                segment_ids_BT,
                position_ids_BT,
                scaling,
                sliding_window=sliding_window,
                softcap=softcap,
                parent_ids_BT=parent_ids_BT,
                sinks=sinks,
            )
        return blocked_document_attention(
            q_BNTD,
            k_BKTD,
            v_BKTD,
            segment_ids_BT,
            position_ids_BT,
            scaling,
            block_size=self.block_size,
            sliding_window=sliding_window,
            softcap=softcap,
            parent_ids_BT=parent_ids_BT,
            sinks=sinks,
        )


def attention_for(
    attn_implementation: str, block_size: int = DEFAULT_ATTENTION_BLOCK_SIZE
) -> Optional[BlockedAttention]:
    """The model's single-device attention for ``attn_implementation``: None (the dense ``eager``
    reference) or a ``BlockedAttention``. The torch names of memory-efficient kernels (``sdpa``,
    ``varlen``, ``flex_attention``, ``flash_attention_*``) all map to the blocked kernel here."""
    if attn_implementation in DENSE_IMPLEMENTATIONS:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(
            f"attention_block_size={block_size!r} is not valid; pass a positive integer (tokens per query/key "
            f"tile of the blocked attention), e.g. 512."
        )
    if attn_implementation != "sdpa":
        logger.info(
            "attn_implementation=%r on the jax backend: blocked online-softmax attention (block %d), "
            "document-masked by segment ids",
            attn_implementation,
            block_size,
        )
    return BlockedAttention(int(block_size))
