"""Context-parallel attention under ``jax.shard_map``: a ring, and an all-gather of K/V.

The sequence axis of every input is sharded over one mesh axis (``cp`` by default); each
device owns ``T / cp`` queries and the keys/values of the same tokens. The row may be in any
token order (e.g. the load-balanced zigzag order of ``twinseq.common.data.context_parallel``):
the mask reads ``segment_ids`` and ``position_ids`` only, per DESIGN.md,

    query i may attend key j  iff  seg[i] == seg[j] != 0  and  pos[j] <= pos[i]
                                  (and pos[i] - pos[j] < sliding_window on a sliding-window layer),

so packed documents never mix, also when a document spans several shards. With shared prefixes
(``common.data.prefix_sharing``) a query also sees its parent segment: ``seg[j] == parent[i] != 0`` joins
``seg[i] == seg[j]``; ``parent`` is the queries' own and stays on their device (None: no parents, the
program without them). The window is a band
in positions, so every block reads it from the ids it already carries; a block pair entirely
outside the band is skipped like any fully masked pair. ``softcap`` (Gemma 2) caps the scaled
scores, ``c * tanh(s / c)``, before the mask; the backward multiplies by ``1 - (capped / c) ** 2``.
``sinks_N`` (gpt-oss's attention sinks, one learned logit per query head) joins every softmax denominator with
no value: the kernel runs without it and returns each row's log-sum-exp ``lse`` too, and the output is corrected
once, ``out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)``, by ordinary differentiable ops (so
the sink gets its gradient from autodiff, ``-p_sink * rowsum(dout * out)``, and ``lse``'s cotangent enters the
kernel's backward as ``ds = p * (dp - delta + dlse)``).

Naive equivalent (what both strategies must match, up to float32 rounding)::

    allowed = document_causal_mask(seg, pos, sliding_window)          # [B, 1, T, T]
    out = dot_product_attention(q, k, v, allowed, scale, softcap)     # twinseq.jax_backend.attention

Layout: ``[B, T, H, D]`` (sequence second, so the sharded axis is the same for q, k, v and
the [B, T] ids). Hugging Face's ``[B, H, T, D]`` is one transpose away; see
``twinseq.jax_backend.parallel.ring_attention_fn``. Grouped-query attention: ``q`` has
``N`` heads, ``k``/``v`` have ``K`` heads with ``N % K == 0``; query head ``n`` reads kv head
``n // (N // K)`` (HF ``repeat_kv`` order), without materialising the repeat.

Strategies:

- ``ring``: K/V and their segment/position ids travel around the ring with ``ppermute``;
  after ``cp`` steps every query has met every key. The forward accumulates an online
  softmax (running max and sum, float32) and saves only the output and its log-sum-exp.
  The backward (``custom_vjp``, FlashAttention-2 style) recomputes probabilities from that
  LSE, and sends K/V around the ring again together with their dK/dV accumulators, which
  arrive home after a last hop. Memory per device: O(T/cp) plus one score block.
- ``allgather``: ``all_gather`` K/V/ids over the axis, then the same blocked kernel for the
  local queries against all keys. Autodiff through ``all_gather`` gives the reduce-scatter of
  dK/dV. Simpler, fewer collectives, but O(T) K/V per device.

Skipping fully masked blocks: the local queries and each K/V shard are cut into blocks
(default: half a shard, i.e. one zigzag chunk, capped at 1024 tokens); a block pair whose mask
has no allowed pair is skipped with ``lax.cond`` on ``any(allowed)``. Under ``jit`` on CPU/GPU
a ``cond`` with a data-dependent predicate lowers to a real conditional, so a skipped block
costs only its mask test. (Under ``vmap`` a ``cond`` turns into a ``select`` that runs both branches, so do
not ``vmap`` over these functions: the batch is already a real dimension.)
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from twinseq.common.errors import ConfigError

STRATEGIES = ("ring", "allgather")
_F32 = jnp.float32


class _Cfg(NamedTuple):
    """Static settings of one call. ``axis_name=None`` means local attention (no ring)."""

    axis_name: Optional[str]
    num_shards: int
    scale: float
    block_q: int
    block_k: int
    sliding_window: Optional[int] = None
    softcap: Optional[float] = None


def _slice(x: jax.Array, start, size: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _update(x: jax.Array, block: jax.Array, start, axis: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, block.astype(x.dtype), start, axis=axis)


def _allowed(cfg: _Cfg, seg_q_BQ, pos_q_BQ, seg_k_BC, pos_k_BC, par_q_BQ=None) -> jax.Array:
    """bool [B, 1, 1, Q, C]: the mask rule (with the window band), broadcast over (kv head, group).
    ``par_q_BQ``: each query's parent segment (0: none), whose keys it also sees; None: no parents."""
    same = (seg_q_BQ[:, :, None] == seg_k_BC[:, None, :]) & (seg_q_BQ[:, :, None] != 0)
    if par_q_BQ is not None:
        same = same | ((par_q_BQ[:, :, None] == seg_k_BC[:, None, :]) & (seg_k_BC[:, None, :] != 0))
    allowed = same & (pos_k_BC[:, None, :] <= pos_q_BQ[:, :, None])
    if cfg.sliding_window is not None:
        allowed = allowed & (pos_q_BQ[:, :, None] - pos_k_BC[:, None, :] < cfg.sliding_window)
    return allowed[:, None, None]


def _scores(cfg: _Cfg, q_BKGQD, k_BKCD) -> jax.Array:
    """float32 scaled scores, soft-capped after the scaling when ``cfg.softcap`` is set (HF's order)."""
    s = jnp.einsum("bkgqd,bkcd->bkgqc", q_BKGQD, k_BKCD, preferred_element_type=_F32)
    s = s * jnp.asarray(cfg.scale, _F32)
    if cfg.softcap is not None:
        s = jnp.tanh(s / _F32(cfg.softcap)) * _F32(cfg.softcap)
    return s


def _block_pairs(cfg: _Cfg, len_q: int, len_k: int) -> tuple[int, int]:
    assert len_q % cfg.block_q == 0 and len_k % cfg.block_k == 0, (len_q, len_k, cfg)
    return len_q // cfg.block_q, len_k // cfg.block_k


def _fwd_shard(cfg: _Cfg, state, q, k, v, seg_q, pos_q, seg_k, pos_k, par_q=None):
    """Fold one K/V shard into the online-softmax state ``(o, m, l)`` of the local queries.

    q [B, K, G, Tq, D]; k, v [B, K, Tk, D]; o [B, K, G, Tq, D] f32; m, l [B, K, G, Tq] f32; par_q [B, Tq] or None.
    """
    bq, bk = cfg.block_q, cfg.block_k
    num_q, num_k = _block_pairs(cfg, q.shape[3], k.shape[2])

    def pair(i, state):
        qs, ks = (i // num_k) * bq, (i % num_k) * bk
        par_a = None if par_q is None else _slice(par_q, qs, bq, 1)
        allowed = _allowed(
            cfg,
            _slice(seg_q, qs, bq, 1),
            _slice(pos_q, qs, bq, 1),
            _slice(seg_k, ks, bk, 1),
            _slice(pos_k, ks, bk, 1),
            par_a,
        )

        def compute(state):
            o, m, l = state
            o_a, m_a, l_a = _slice(o, qs, bq, 3), _slice(m, qs, bq, 3), _slice(l, qs, bq, 3)
            s = _scores(cfg, _slice(q, qs, bq, 3), _slice(k, ks, bk, 2))
            s = jnp.where(allowed, s, -jnp.inf)
            m_new = jnp.maximum(m_a, s.max(axis=-1))
            # A row with no allowed key yet keeps m = -inf; shift by 0 there so exp gives 0, not NaN.
            m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m_a - m_safe)
            pv = jnp.einsum("bkgqc,bkcd->bkgqd", p, _slice(v, ks, bk, 2).astype(_F32))
            o_a = alpha[..., None] * o_a + pv
            l_a = alpha * l_a + p.sum(axis=-1)
            return _update(o, o_a, qs, 3), _update(m, m_new, qs, 3), _update(l, l_a, qs, 3)

        return jax.lax.cond(jnp.any(allowed), compute, lambda st: st, state)

    return jax.lax.fori_loop(0, num_q * num_k, pair, state)


def _bwd_shard(cfg: _Cfg, grads, q, k, v, dout, lse, delta, seg_q, pos_q, seg_k, pos_k, par_q=None):
    """Add one K/V shard's contribution to ``(dq, dk, dv)`` (float32, dk/dv of that shard).

    FlashAttention-2 backward: ``p = exp(s - lse)``, ``dv += p^T do``, ``dp = do v^T``,
    ``ds = p * (dp - delta)`` with ``delta = rowsum(do * out)``, ``dq += ds k``, ``dk += ds^T q``
    (``ds`` times ``1 - (s / c) ** 2`` first when the scores ``s`` are soft-capped at ``c``).
    """
    bq, bk = cfg.block_q, cfg.block_k
    num_q, num_k = _block_pairs(cfg, q.shape[3], k.shape[2])
    lse_safe = jnp.where(jnp.isneginf(lse), 0.0, lse)

    def pair(i, grads):
        qs, ks = (i // num_k) * bq, (i % num_k) * bk
        par_a = None if par_q is None else _slice(par_q, qs, bq, 1)
        allowed = _allowed(
            cfg,
            _slice(seg_q, qs, bq, 1),
            _slice(pos_q, qs, bq, 1),
            _slice(seg_k, ks, bk, 1),
            _slice(pos_k, ks, bk, 1),
            par_a,
        )

        def compute(grads):
            dq, dk, dv = grads
            q_a, k_b, v_b = _slice(q, qs, bq, 3), _slice(k, ks, bk, 2), _slice(v, ks, bk, 2)
            do_a = _slice(dout, qs, bq, 3).astype(_F32)
            s = _scores(cfg, q_a, k_b)
            p = jnp.where(allowed, jnp.exp(s - _slice(lse_safe, qs, bq, 3)[..., None]), 0.0)
            dv_b = jnp.einsum("bkgqc,bkgqd->bkcd", p, do_a)
            dp = jnp.einsum("bkgqd,bkcd->bkgqc", do_a, v_b.astype(_F32))
            ds = p * (dp - _slice(delta, qs, bq, 3)[..., None])
            if cfg.softcap is not None:
                ds = ds * (1.0 - jnp.square(s / _F32(cfg.softcap)))
            ds = ds * jnp.asarray(cfg.scale, _F32)
            dq_a = jnp.einsum("bkgqc,bkcd->bkgqd", ds, k_b.astype(_F32))
            dk_b = jnp.einsum("bkgqc,bkgqd->bkcd", ds, q_a.astype(_F32))
            return (
                _update(dq, _slice(dq, qs, bq, 3) + dq_a, qs, 3),
                _update(dk, _slice(dk, ks, bk, 2) + dk_b, ks, 2),
                _update(dv, _slice(dv, ks, bk, 2) + dv_b, ks, 2),
            )

        return jax.lax.cond(jnp.any(allowed), compute, lambda g: g, grads)

    return jax.lax.fori_loop(0, num_q * num_k, pair, grads)


def _rotate(cfg: _Cfg, tree):
    """Send every leaf to the next device of the ring (rank r -> r + 1)."""
    n = cfg.num_shards
    return jax.lax.ppermute(tree, cfg.axis_name, perm=[(i, (i + 1) % n) for i in range(n)])


def _forward(cfg: _Cfg, q, k, v, seg_q, pos_q, seg_k, pos_k, par_q):
    """-> out [B, K, G, Tq, D] (q.dtype), lse [B, K, G, Tq] f32 (-inf where no key is allowed).

    ``par_q`` (the local queries' parent segments, or None) stays home: the rule reads the keys' segment ids only.
    """
    m0 = jnp.full_like(q[..., 0], -jnp.inf, dtype=_F32)  # *_like keeps q's varying-axes type
    state = (jnp.zeros_like(q, dtype=_F32), m0, jnp.zeros_like(m0))

    def attend(state, kv):
        return _fwd_shard(cfg, state, q, kv[0], kv[1], seg_q, pos_q, kv[2], kv[3], par_q)

    def step(carry, _):
        state, kv = carry
        next_kv = _rotate(cfg, kv)  # independent of this step's compute, so the transfer can overlap it
        return (attend(state, kv), next_kv), None

    kv = (k, v, seg_k, pos_k)
    if cfg.num_shards > 1:
        (state, kv), _ = jax.lax.scan(step, (state, kv), None, length=cfg.num_shards - 1)
    state = attend(state, kv)
    o, m, l = state
    has_key = l > 0
    out = jnp.where(has_key[..., None], o / jnp.where(has_key, l, 1.0)[..., None], 0.0)
    lse = jnp.where(has_key, m + jnp.log(jnp.where(has_key, l, 1.0)), -jnp.inf)
    return out.astype(q.dtype), lse


def _backward(cfg: _Cfg, residuals, dout, dlse=None):
    """``dlse`` (float32 [B, K, G, Tq] or None): the cotangent of the log-sum-exp output (``_attention_core_lse``);
    ``d lse / d s_j = p_j``, so it joins ``dp`` in ``ds = p * (dp - delta)`` as ``delta - dlse``."""
    q, k, v, seg_q, pos_q, seg_k, pos_k, par_q, out, lse = residuals
    delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1)
    if dlse is not None:
        delta = delta - jnp.where(jnp.isneginf(lse), 0.0, dlse.astype(_F32))
    dq = jnp.zeros_like(q, dtype=_F32)
    kv = (k, v, seg_k, pos_k)
    dkv = (jnp.zeros_like(k, dtype=_F32), jnp.zeros_like(v, dtype=_F32))  # travel with the K/V they belong to

    def attend(dq, kv, dkv):
        dq, dk, dv = _bwd_shard(cfg, (dq, *dkv), q, kv[0], kv[1], dout, lse, delta, seg_q, pos_q, kv[2], kv[3], par_q)
        return dq, (dk, dv)

    def step(carry, _):
        dq, kv, dkv = carry
        next_kv = _rotate(cfg, kv)  # can overlap this step's compute; dK/dV must wait for it
        dq, dkv = attend(dq, kv, dkv)
        return (dq, next_kv, _rotate(cfg, dkv)), None

    if cfg.num_shards > 1:
        (dq, kv, dkv), _ = jax.lax.scan(step, (dq, kv, dkv), None, length=cfg.num_shards - 1)
    dq, (dk, dv) = attend(dq, kv, dkv)
    if cfg.num_shards > 1:
        dk, dv = _rotate(cfg, (dk, dv))  # the last hop brings each shard's dK/dV home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention_core(cfg: _Cfg, q, k, v, seg_q, pos_q, seg_k, pos_k, par_q):
    return _forward(cfg, q, k, v, seg_q, pos_q, seg_k, pos_k, par_q)[0]


def _core_fwd(cfg: _Cfg, q, k, v, seg_q, pos_q, seg_k, pos_k, par_q):
    out, lse = _forward(cfg, q, k, v, seg_q, pos_q, seg_k, pos_k, par_q)
    return out, (q, k, v, seg_q, pos_q, seg_k, pos_k, par_q, out, lse)


def _core_bwd(cfg: _Cfg, residuals, dout):
    dq, dk, dv = _backward(cfg, residuals, dout)
    return dq, dk, dv, None, None, None, None, None  # integer ids have no cotangent


_attention_core.defvjp(_core_fwd, _core_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention_core_lse(cfg: _Cfg, q, k, v, seg_q, pos_q, seg_k, pos_k, par_q):
    """``_attention_core`` that also returns the rows' log-sum-exp (float32 [B, K, G, Tq], -inf on rows with no
    allowed key), differentiable: what the attention sinks correct the output with (``_attend``)."""
    return _forward(cfg, q, k, v, seg_q, pos_q, seg_k, pos_k, par_q)


def _core_lse_fwd(cfg: _Cfg, q, k, v, seg_q, pos_q, seg_k, pos_k, par_q):
    out, lse = _forward(cfg, q, k, v, seg_q, pos_q, seg_k, pos_k, par_q)
    return (out, lse), (q, k, v, seg_q, pos_q, seg_k, pos_k, par_q, out, lse)


def _core_lse_bwd(cfg: _Cfg, residuals, cotangents):
    dout, dlse = cotangents
    dq, dk, dv = _backward(cfg, residuals, dout, dlse)
    return dq, dk, dv, None, None, None, None, None


_attention_core_lse.defvjp(_core_lse_fwd, _core_lse_bwd)


def _attend(cfg: _Cfg, q, k, v, seg_q, pos_q, seg_k, pos_k, par_q, sinks_N=None) -> jax.Array:
    """The kernel on internal-layout arrays (q [B, K, G, Tq, D]); with ``sinks_N`` (float [N = K * G], query head
    ``n = k * G + g``) the output is scaled by ``sigmoid(lse - sink)``: the share of the denominator that the keys
    hold once the sink joins it (0 on rows with no key, as without sinks). Without sinks: ``_attention_core``."""
    if sinks_N is None:
        return _attention_core(cfg, q, k, v, seg_q, pos_q, seg_k, pos_k, par_q)
    out, lse = _attention_core_lse(cfg, q, k, v, seg_q, pos_q, seg_k, pos_k, par_q)
    sink_1KG1 = jnp.asarray(sinks_N).astype(_F32).reshape(1, q.shape[1], q.shape[2], 1)
    no_key = jnp.isneginf(lse)  # lse - sink would be NaN for a sink of -inf; such rows are zeros anyway
    keys_share = jnp.where(no_key, 0.0, jax.nn.sigmoid(jnp.where(no_key, 0.0, lse) - sink_1KG1))
    return (out.astype(_F32) * keys_share[..., None]).astype(out.dtype)


def _check_sinks(sinks_N, num_heads: int) -> None:
    if sinks_N is not None and tuple(jnp.shape(sinks_N)) != (num_heads,):
        raise ConfigError(
            f"sinks_N has shape {tuple(jnp.shape(sinks_N))}; pass one attention-sink logit per query head, shape "
            f"({num_heads},) (the layer's self_attn.sinks), or None for attention without sinks."
        )


MAX_DEFAULT_BLOCK = 1024


def _default_block(length: int) -> int:
    """Half a shard (one zigzag chunk), or its largest divisor <= ``MAX_DEFAULT_BLOCK``.

    Half a shard lets the mask test skip the masked half of a zigzag shard pair; the cap bounds the
    [Q, C] score block (the dominant temp memory) at long T.
    """
    block = length // 2 if length % 2 == 0 and length >= 2 else length
    cap = min(block, MAX_DEFAULT_BLOCK)
    return next(b for b in range(cap, 0, -1) if block % b == 0)


def _check_shapes(q, k, v, seg, pos, par=None) -> None:
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ConfigError(
            f"q {q.shape}, k {k.shape}, v {v.shape} must be [B, T, H, D] with k.shape == v.shape; pass arrays "
            "in that layout."
        )
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ConfigError(
            f"q {q.shape} and k {k.shape} must share B, T and D (layout [B, T, H, D]); pass arrays in that layout."
        )
    if q.shape[2] % k.shape[2]:
        raise ConfigError(
            f"num_heads={q.shape[2]} must be a multiple of num_kv_heads={k.shape[2]} (GQA); pass k and v with a "
            f"divisor of {q.shape[2]} heads."
        )
    if seg.shape != q.shape[:2] or pos.shape != q.shape[:2]:
        raise ConfigError(
            f"segment_ids {seg.shape} and position_ids {pos.shape} must be [B, T] = {q.shape[:2]}; pass the "
            "arrays of the same batch."
        )
    if par is not None and par.shape != q.shape[:2]:
        raise ConfigError(
            f"parent_ids {par.shape} must be [B, T] = {q.shape[:2]} like segment_ids; pass the batch's parent_ids "
            "(or None: no shared prefixes)."
        )


def _to_internal(q_BTND, k_BTKD, v_BTKD):
    b, t, n, d = q_BTND.shape
    kv = k_BTKD.shape[2]
    q = q_BTND.reshape(b, t, kv, n // kv, d).transpose(0, 2, 3, 1, 4)
    return q, k_BTKD.transpose(0, 2, 1, 3), v_BTKD.transpose(0, 2, 1, 3)


def _from_internal(out_BKGTD) -> jax.Array:
    b, kv, g, t, d = out_BKGTD.shape
    return out_BKGTD.transpose(0, 3, 1, 2, 4).reshape(b, t, kv * g, d)


def _check_options(sliding_window, softcap) -> None:
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise ConfigError(
            f"sliding_window={sliding_window!r} is not valid; pass a positive integer (positions a query "
            f"attends to) or None for full attention."
        )
    if softcap is not None and not (
        isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap > 0
    ):
        raise ConfigError(
            f"softcap={softcap!r} is not valid; pass a positive number (the attention logit soft-cap) or None."
        )


def _cfg(axis_name, num_shards, q_BTND, k_len, scale, block_q, block_k, sliding_window=None, softcap=None) -> _Cfg:
    _check_options(sliding_window, softcap)
    len_q = q_BTND.shape[1]
    block_q = block_q or _default_block(len_q)
    block_k = block_k or _default_block(k_len)
    if len_q % block_q or k_len % block_k:
        raise ConfigError(
            f"block_q={block_q} must divide the local query length {len_q} and block_k={block_k} "
            f"the local key length {k_len}; pick divisors (default: half a shard)."
        )
    scale = q_BTND.shape[3] ** -0.5 if scale is None else float(scale)
    return _Cfg(
        axis_name,
        int(num_shards),
        scale,
        int(block_q),
        int(block_k),
        None if sliding_window is None else int(sliding_window),
        None if softcap is None else float(softcap),
    )


def blocked_attention(
    q_BTND,
    k_BTKD,
    v_BTKD,
    segment_ids_BT,
    position_ids_BT,
    *,
    scale: Optional[float] = None,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    parent_ids_BT=None,
    sinks_N=None,
) -> jax.Array:
    """Single-device memory-efficient attention (online softmax forward, FlashAttention-2 backward).

    Same inputs/outputs and mask as the module docstring; ``[B, T, N, D]`` out in q's dtype. Queries
    with no allowed key (padding) get zeros, like ``dot_product_attention``. ``parent_ids_BT``: each
    query's parent segment (shared prefixes, ``common.data.prefix_sharing``); None: none. ``sinks_N``: one
    attention-sink logit per query head (gpt-oss), None: none.
    """
    _check_shapes(q_BTND, k_BTKD, v_BTKD, segment_ids_BT, position_ids_BT, parent_ids_BT)
    _check_sinks(sinks_N, q_BTND.shape[2])
    cfg = _cfg(None, 1, q_BTND, k_BTKD.shape[1], scale, block_q, block_k, sliding_window, softcap)
    q, k, v = _to_internal(q_BTND, k_BTKD, v_BTKD)
    seg, pos = segment_ids_BT, position_ids_BT
    return _from_internal(_attend(cfg, q, k, v, seg, pos, seg, pos, parent_ids_BT, sinks_N))


def blocked_attention_heads_first(
    q_BNTD,
    k_BKTD,
    v_BKTD,
    segment_ids_BT,
    position_ids_BT,
    *,
    scale: float,
    block_size: int,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    parent_ids_BT=None,
    sinks_N=None,
) -> jax.Array:
    """``blocked_attention`` in the model's head-first layout: ``[B, N, T, D]`` in and out, ``T % block_size == 0``.

    The single-device attention of the model (``attention.blocked_document_attention`` pads T and calls
    this). Same kernel, mask and custom VJP as the ring: only ``O(T)`` residuals (q, k, v, out, log-sum-exp)
    are kept for the backward pass, which recomputes each ``[block, block]`` score tile. ``[B, N, T, D]``
    is ``[B, K, G, T, D]`` by a reshape (query head ``n = k * G + g``, HF's ``repeat_kv`` order), so no
    transpose is needed on the way in or out.
    """
    b, n, t, d = q_BNTD.shape
    kv = k_BKTD.shape[1]
    if n % kv:
        raise ConfigError(
            f"num_heads={n} must be a multiple of num_kv_heads={kv} (GQA); pass k and v with a divisor of {n} heads."
        )
    if t % block_size:
        raise ConfigError(f"block_size={block_size} must divide the sequence length {t}; pad T first.")
    _check_options(sliding_window, softcap)
    _check_sinks(sinks_N, n)
    cfg = _Cfg(
        None,
        1,
        float(scale),
        int(block_size),
        int(block_size),
        None if sliding_window is None else int(sliding_window),
        None if softcap is None else float(softcap),
    )
    q_BKGTD = q_BNTD.reshape(b, kv, n // kv, t, d)
    seg, pos = segment_ids_BT, position_ids_BT
    out_BKGTD = _attend(cfg, q_BKGTD, k_BKTD, v_BKTD, seg, pos, seg, pos, parent_ids_BT, sinks_N)
    return out_BKGTD.reshape(b, n, t, d)


def ring_attention_shard(
    q_BTND,
    k_BTKD,
    v_BTKD,
    segment_ids_BT,
    position_ids_BT,
    *,
    axis_name: str,
    scale: Optional[float] = None,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    parent_ids_BT=None,
    sinks_N=None,
) -> jax.Array:
    """Ring attention for the local shard; call inside ``shard_map`` over ``axis_name``.

    Every argument is this device's ``[B, T/cp, ...]`` shard; returns this device's output shard. The local
    queries' ``parent_ids_BT`` stay home: a parent's keys are found by the segment ids travelling with them.
    ``sinks_N`` (replicated, [N]) corrects the local queries' output once the ring is done.
    """
    _check_shapes(q_BTND, k_BTKD, v_BTKD, segment_ids_BT, position_ids_BT, parent_ids_BT)
    _check_sinks(sinks_N, q_BTND.shape[2])
    cfg = _cfg(
        axis_name,
        jax.lax.axis_size(axis_name),
        q_BTND,
        k_BTKD.shape[1],
        scale,
        block_q,
        block_k,
        sliding_window,
        softcap,
    )
    q, k, v = _to_internal(q_BTND, k_BTKD, v_BTKD)
    seg, pos = segment_ids_BT, position_ids_BT
    return _from_internal(_attend(cfg, q, k, v, seg, pos, seg, pos, parent_ids_BT, sinks_N))


def allgather_attention_shard(
    q_BTND,
    k_BTKD,
    v_BTKD,
    segment_ids_BT,
    position_ids_BT,
    *,
    axis_name: str,
    scale: Optional[float] = None,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    parent_ids_BT=None,
    sinks_N=None,
) -> jax.Array:
    """All-gather K/V (and their ids) over ``axis_name``, then blocked attention for the local queries.

    Call inside ``shard_map``. ``block_k`` defaults to half a shard, so block skipping sees the
    same chunks as the ring. ``sinks_N`` as ``ring_attention_shard``.
    """
    _check_shapes(q_BTND, k_BTKD, v_BTKD, segment_ids_BT, position_ids_BT, parent_ids_BT)
    _check_sinks(sinks_N, q_BTND.shape[2])
    block_k = block_k or _default_block(k_BTKD.shape[1])

    def gather(x):
        return jax.lax.all_gather(x, axis_name, axis=1, tiled=True)

    k_all, v_all, seg_all, pos_all = gather(k_BTKD), gather(v_BTKD), gather(segment_ids_BT), gather(position_ids_BT)
    cfg = _cfg(None, 1, q_BTND, k_all.shape[1], scale, block_q, block_k, sliding_window, softcap)
    q, k, v = _to_internal(q_BTND, k_all, v_all)
    seg, pos = segment_ids_BT, position_ids_BT
    return _from_internal(_attend(cfg, q, k, v, seg, pos, seg_all, pos_all, parent_ids_BT, sinks_N))


def _batch_spec(mesh: Mesh, axis_name: str, batch_axes) -> Union[None, str, tuple]:
    if batch_axes is None:
        batch_axes = tuple(a for a in mesh.axis_names if a != axis_name)
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    return batch_axes if batch_axes else None


def sharded_attention(
    q_BTND,
    k_BTKD,
    v_BTKD,
    segment_ids_BT,
    position_ids_BT,
    mesh: Mesh,
    *,
    strategy: str = "ring",
    axis_name: str = "cp",
    batch_axes: Union[None, str, Sequence[str]] = None,
    scale: Optional[float] = None,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    parent_ids_BT=None,
    sinks_N=None,
) -> jax.Array:
    """Context-parallel attention on global ``[B, T, ...]`` arrays: ``shard_map`` over ``mesh``.

    T is split over ``axis_name`` in the row's current order: pass rows already reordered with
    ``twinseq.common.data.context_parallel.shard_sequence`` for load balancing (the output comes back
    in that same order). B is split over ``batch_axes`` (default: every other mesh axis).
    ``sliding_window`` and ``softcap`` as the module docstring (None: full attention, no cap).
    ``parent_ids_BT`` ([B, T], sharded like ``segment_ids_BT``): each token's parent segment; None: none.
    ``sinks_N`` ([N], replicated on every device): the attention-sink logit of every query head; None: none.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy={strategy!r} is not valid; choose one of {STRATEGIES}.")
    if axis_name not in mesh.axis_names:
        raise ConfigError(f"axis_name={axis_name!r} is not a mesh axis; choose one of {mesh.axis_names}.")
    _check_shapes(q_BTND, k_BTKD, v_BTKD, segment_ids_BT, position_ids_BT, parent_ids_BT)
    _check_sinks(sinks_N, q_BTND.shape[2])
    cp = mesh.shape[axis_name]
    if q_BTND.shape[1] % cp:
        raise ConfigError(
            f"sequence length T={q_BTND.shape[1]} is not divisible by cp={cp}; pad with --pad-to-multiple-of {2 * cp}."
        )
    batch = _batch_spec(mesh, axis_name, batch_axes)
    num_replicas = int(np.prod([mesh.shape[a] for a in batch or ()]))
    if q_BTND.shape[0] % num_replicas:
        raise ConfigError(
            f"batch size B={q_BTND.shape[0]} is not divisible by the {num_replicas} devices of the "
            f"batch axes {batch}; use a multiple of {num_replicas} or pass batch_axes=()."
        )
    local = ring_attention_shard if strategy == "ring" else allgather_attention_shard
    _check_options(sliding_window, softcap)
    fn = functools.partial(
        local,
        axis_name=axis_name,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    x_spec, id_spec = P(batch, axis_name, None, None), P(batch, axis_name)
    args: tuple[Any, ...] = (q_BTND, k_BTKD, v_BTKD, segment_ids_BT, position_ids_BT)
    extras = {"parent_ids_BT": parent_ids_BT, "sinks_N": sinks_N}
    extras = {name: value for name, value in extras.items() if value is not None}
    args += tuple(extras.values())
    # parents are sharded like the ids; the sinks are replicated (every shard's queries have every head)
    in_specs = (x_spec,) * 3 + (id_spec,) * (2 + ("parent_ids_BT" in extras)) + (P(),) * ("sinks_N" in extras)
    return jax.shard_map(_with_extras(fn, tuple(extras)), mesh=mesh, in_specs=in_specs, out_specs=x_spec)(*args)


def _with_extras(local, names: tuple[str, ...]):
    """``local`` taking the optional keyword arrays ``names`` (``parent_ids_BT``, ``sinks_N``) as trailing positional
    arguments, in that order (``shard_map`` passes them so)."""
    if not names:
        return local

    def fn(*args):
        head, tail = args[: len(args) - len(names)], args[len(args) - len(names) :]
        return local(*head, **dict(zip(names, tail)))

    return fn
