"""Causal-LM losses for the JAX backend: the same semantics as ``twinseq.common.objectives.nll``.

- ``labels`` are unshifted; position t predicts ``labels[t + 1]`` (the shift happens here).
- The loss is ``sum of NLL over targets != -100 / num_items_in_batch``; when
  ``num_items_in_batch`` is 0 the loss is exactly 0 and every gradient is 0 (finite).
- Logits are computed in the model dtype and upcast to float32, as HF's ``ForCausalLMLoss``.
- ``logit_softcap`` (Gemma 2's ``final_logit_softcapping``): the float32 logits become
  ``c * tanh(logits / c)`` (HF's order: divide, tanh, multiply) before anything else sees them, in
  every loss type; the fused backward multiplies by the derivative ``1 - (capped / c) ** 2``.
  (HF caps in the model dtype, before its loss upcasts; in float32 the two are the same numbers.)

Three implementations of the same number, picked by ``loss_type``:

``nll``           full logits ``[N, V]`` (N = B * T), then cross-entropy.
``chunked_nll``   ``jax.lax.scan`` over chunks of ``chunk_size`` tokens, each chunk under
                  ``jax.checkpoint``: the backward pass recomputes one chunk's logits at a time.
``fused_linear``  a ``jax.custom_vjp``: the forward pass scans token chunks and keeps only the
                  per-token logsumexp; the backward pass scans *vocabulary* chunks, recomputes
                  ``logits[:, rows]``, forms ``softmax - onehot`` by hand and writes
                  ``dW[rows]`` in place (Cut Cross-Entropy's layout). Neither pass holds the
                  ``[N, V]`` logits, nor a second ``[V, H]`` buffer for the LM-head gradient,
                  which XLA materialises per chunk when a token-chunked backward accumulates it.

The naive equivalent of all three::

    logits = (hidden_BTH @ lm_head_VH.T).astype(float32)
    logits = c * tanh(logits / c)                             # only with logit_softcap=c
    targets = shift_labels(labels_BT)
    nll = logsumexp(logits, -1) - logits[..., targets]        # 0 where targets == -100
    loss = nll.sum() / max(num_items_in_batch, 1)
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from twinseq.common.config import DEFAULT_CHUNK_SIZE
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.nll import IGNORE_INDEX, check_num_items, check_targets
from twinseq.jax_backend.attention import soft_cap

LOSS_TYPES = ("nll", "chunked_nll", "fused_linear")


class Stats(NamedTuple):
    """Per-chunk sums for the logged metrics (no gradient flows through them)."""

    num_correct: jax.Array
    entropy_sum: jax.Array
    count: jax.Array

    @staticmethod
    def zeros() -> "Stats":
        return Stats(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))

    def __add__(self, other: "Stats") -> "Stats":  # type: ignore[override]
        return Stats(*(a + b for a, b in zip(self, other)))


def shift_labels(labels_BT: jax.Array) -> jax.Array:
    """``targets[:, t] = labels[:, t + 1]``; the last column is -100.

    >>> shift_labels(jnp.array([[-100, 6, 7, -100, 9]])).tolist()
    [[6, 7, -100, 9, -100]]
    """
    pad_B1 = jnp.full((labels_BT.shape[0], 1), IGNORE_INDEX, labels_BT.dtype)
    return jnp.concatenate([labels_BT[:, 1:], pad_B1], axis=1)


def logits_f32(hidden_NH: jax.Array, lm_head_VH: jax.Array, softcap: Optional[float] = None) -> jax.Array:
    """float32 ``hidden @ W.T`` (any leading shape), then ``softcap * tanh(logits / softcap)`` if set."""
    logits_NV = (hidden_NH @ lm_head_VH.T).astype(jnp.float32)
    return logits_NV if softcap is None else soft_cap(logits_NV, softcap)


def softcap_grad(dcapped_NV: jax.Array, capped_NV: jax.Array, softcap: Optional[float]) -> jax.Array:
    """The gradient w.r.t. the uncapped logits from the one w.r.t. the capped ones:
    ``d/dx [c tanh(x / c)] = 1 - tanh(x / c) ** 2 = 1 - (capped / c) ** 2``."""
    if softcap is None:
        return dcapped_NV
    return dcapped_NV * (1.0 - jnp.square(capped_NV / jnp.float32(softcap)))


def _nll_and_stats(logits_NV: jax.Array, targets_N: jax.Array) -> tuple[jax.Array, jax.Array, Stats]:
    """Per-token NLL (0 where ignored), per-token logsumexp, and the metric sums."""
    valid_N = targets_N != IGNORE_INDEX
    safe_N = jnp.where(valid_N, targets_N, 0)
    # torch's log_softmax order: (x - max) first, then log(sum(exp(x - max))); rounding then
    # matches torch's cross_entropy to the last bit far more often than lse - x_t does.
    max_N = jax.lax.stop_gradient(jnp.max(logits_NV, axis=-1))
    shifted_NV = logits_NV - max_N[:, None]
    log_sum_N = jnp.log(jnp.sum(jnp.exp(shifted_NV), axis=-1))
    picked_N = jnp.take_along_axis(shifted_NV, safe_N[:, None], axis=-1)[:, 0]
    nll_N = jnp.where(valid_N, log_sum_N - picked_N, 0.0)
    lse_N = log_sum_N + max_N
    return nll_N, lse_N, _stats(jax.lax.stop_gradient(logits_NV), jax.lax.stop_gradient(lse_N), safe_N, valid_N)


def _stats(logits_NV, lse_N, safe_N, valid_N) -> Stats:
    correct_N = (jnp.argmax(logits_NV, axis=-1) == safe_N) & valid_N
    # entropy = lse - sum(p * logits), the stable form of -sum(p log p)
    probs_NV = jnp.exp(logits_NV - lse_N[:, None])
    entropy_N = lse_N - jnp.sum(probs_NV * logits_NV, axis=-1)
    return Stats(correct_N.sum(dtype=jnp.int32), jnp.where(valid_N, entropy_N, 0.0).sum(), valid_N.sum(dtype=jnp.int32))


def token_nll(
    hidden_BTH: jax.Array, lm_head_VH: jax.Array, labels_BT: jax.Array, *, logit_softcap: Optional[float] = None
) -> jax.Array:
    """float32 [B, T]: the NLL of ``labels[:, t + 1]`` at position t; 0 where the target is -100."""
    b, t, h = hidden_BTH.shape
    nll_N, _, _ = _nll_and_stats(
        logits_f32(hidden_BTH.reshape(-1, h), lm_head_VH, logit_softcap), shift_labels(labels_BT).reshape(-1)
    )
    return nll_N.reshape(b, t)


def _full_sums(hidden_NH, lm_head_VH, targets_N, softcap: Optional[float]) -> tuple[jax.Array, Stats]:
    nll_N, _, stats = _nll_and_stats(logits_f32(hidden_NH, lm_head_VH, softcap), targets_N)
    return nll_N.sum(), stats


def to_token_chunks(hidden_NH, targets_N, chunk_size: int):
    """[N, H], [N] -> [C, S, H], [C, S] with S = chunk_size; the tail is padded with ignored tokens."""
    n, h = hidden_NH.shape
    num_chunks = -(-n // chunk_size)
    pad = num_chunks * chunk_size - n
    if pad:
        hidden_NH = jnp.concatenate([hidden_NH, jnp.zeros((pad, h), hidden_NH.dtype)])
        targets_N = jnp.concatenate([targets_N, jnp.full((pad,), IGNORE_INDEX, targets_N.dtype)])
    return hidden_NH.reshape(num_chunks, chunk_size, h), targets_N.reshape(num_chunks, chunk_size)


def _scan_token_chunks(hidden_NH, lm_head_VH, targets_N, chunk_size: int, softcap: Optional[float]):
    """Scan chunks of ``chunk_size`` tokens, each under ``jax.checkpoint``.

    Returns (NLL sum, metric sums, per-token logsumexp [N]); one chunk's logits at a time.
    """
    n = hidden_NH.shape[0]
    hidden_CSH, targets_CS = to_token_chunks(hidden_NH, targets_N, chunk_size)

    @jax.checkpoint
    def chunk_sums(h_SH, w_VH, t_S):
        nll_S, lse_S, stats = _nll_and_stats(logits_f32(h_SH, w_VH, softcap), t_S)
        return nll_S.sum(), stats, jax.lax.stop_gradient(lse_S)

    def step(carry, xs):
        total, stats = carry
        chunk_total, chunk_stats, lse_S = chunk_sums(xs[0], lm_head_VH, xs[1])
        return (total + chunk_total, stats + chunk_stats), lse_S

    init = (jnp.zeros((), jnp.float32), Stats.zeros())
    (total, stats), lse_CS = jax.lax.scan(step, init, (hidden_CSH, targets_CS))
    return total, stats, lse_CS.reshape(-1)[:n]


def _chunked_sums(
    hidden_NH, lm_head_VH, targets_N, chunk_size: int, softcap: Optional[float]
) -> tuple[jax.Array, Stats]:
    total, stats, _ = _scan_token_chunks(hidden_NH, lm_head_VH, targets_N, chunk_size, softcap)
    return total, stats


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused_sums(hidden_NH, lm_head_VH, targets_N, chunk_size: int, softcap: Optional[float]) -> tuple[jax.Array, Stats]:
    # Without differentiation the fused loss is exactly the chunked one.
    return _chunked_sums(hidden_NH, lm_head_VH, targets_N, chunk_size, softcap)


def _fused_fwd(hidden_NH, lm_head_VH, targets_N, chunk_size: int, softcap: Optional[float]):
    total, stats, lse_N = _scan_token_chunks(hidden_NH, lm_head_VH, targets_N, chunk_size, softcap)
    return (total, stats), (hidden_NH, lm_head_VH, targets_N, lse_N)


def _vocab_chunking(num_tokens: int, vocab_size: int, chunk_size: int) -> tuple[int, int]:
    """(number of vocabulary chunks, rows per chunk): as many chunks as token chunks, so that a
    [N, V / C] backward block is as big as a [chunk_size, V] forward block."""
    num_chunks = min(vocab_size, max(1, -(-num_tokens // chunk_size)))
    return num_chunks, -(-vocab_size // num_chunks)


def vocab_chunked_grads(
    hidden_NH, lm_head_VH, targets_N, lse_N, scale_N, chunk_size: int, softcap: Optional[float] = None
):
    """(dh [N, H], dW [V, H]) of ``Σ_n scale_n · nll_n``, scanning the vocabulary in chunks.

    Recomputes ``logits[:, chunk]`` (soft-capped with ``softcap``) from the saved logsumexp, forms
    ``(softmax - onehot) · scale`` by hand (times the cap's derivative ``1 - (capped / c) ** 2``),
    writes ``dW[chunk]`` in place and accumulates ``dh``. Nothing of size [N, V] or a
    second [V, H] ever exists (XLA would otherwise materialise each chunk's [V, H] dW before adding
    it). Naive equivalent: ``jax.vjp`` of ``(scale * nll(logits_f32(hidden, W, softcap))).sum()``.
    """
    (n, h), v = hidden_NH.shape, lm_head_VH.shape[0]
    num_chunks, rows = _vocab_chunking(n, v, chunk_size)

    def step(carry, c):
        dh_NH, dw_VH = carry
        nominal = c * rows
        start = jnp.minimum(nominal, v - rows)  # the last chunk overlaps the previous one
        w_RH = jax.lax.dynamic_slice_in_dim(lm_head_VH, start, rows, axis=0)
        cols_R = start + jnp.arange(rows)
        logits_NR = logits_f32(hidden_NH, w_RH, softcap)
        probs_NR = jnp.exp(logits_NR - lse_N[:, None])
        dlogits_NR = (probs_NR - (targets_N[:, None] == cols_R[None, :])) * scale_N[:, None]
        dlogits_NR = softcap_grad(dlogits_NR, logits_NR, softcap).astype(hidden_NH.dtype)
        dw_RH = (dlogits_NR.T @ hidden_NH).astype(dw_VH.dtype)
        dw_VH = jax.lax.dynamic_update_slice_in_dim(dw_VH, dw_RH, start, axis=0)
        fresh_NR = jnp.where((cols_R >= nominal)[None, :], dlogits_NR, 0)  # overlap: dh counts once
        return (dh_NH + (fresh_NR @ w_RH).astype(jnp.float32), dw_VH), None

    init = (jnp.zeros((n, h), jnp.float32), jnp.zeros(lm_head_VH.shape, lm_head_VH.dtype))
    (dh_NH, dw_VH), _ = jax.lax.scan(step, init, jnp.arange(num_chunks))
    return dh_NH.astype(hidden_NH.dtype), dw_VH


def _fused_bwd(chunk_size: int, softcap: Optional[float], residuals, cotangents):
    hidden_NH, lm_head_VH, targets_N, lse_N = residuals
    g = cotangents[0]  # the metrics carry no gradient
    scale_N = jnp.where(targets_N != IGNORE_INDEX, g, 0.0).astype(jnp.float32)
    dh_NH, dw_VH = vocab_chunked_grads(hidden_NH, lm_head_VH, targets_N, lse_N, scale_N, chunk_size, softcap)
    return dh_NH, dw_VH, None


_fused_sums.defvjp(_fused_fwd, _fused_bwd)


def check_softcap(logit_softcap: Optional[float]) -> Optional[float]:
    """``logit_softcap`` as a float (a static, hashable argument of the kernels), or ``ConfigError``."""
    if logit_softcap is None:
        return None
    if (
        isinstance(logit_softcap, bool)
        or not isinstance(logit_softcap, (int, float, np.floating, np.integer))
        or not logit_softcap > 0
    ):
        raise ConfigError(
            f"logit_softcap={logit_softcap!r} must be a positive number (the model's "
            f"final_logit_softcapping) or None for no cap: pass one of those."
        )
    return float(logit_softcap)


def check_labels(labels_BT, vocab_size: int, num_items_in_batch, *, targets_are_shifted: bool = False) -> int:
    """Host-side checks a traced loss cannot make; returns the micro-batch's valid target count.

    Raises ``ValueError`` for labels outside ``[0, vocab_size)`` (other than -100), or a
    ``num_items_in_batch`` that is negative, not an integer, or below this micro-batch's count.
    ``targets_are_shifted=True``: ``labels_BT`` are already the targets (see ``causal_lm_loss``).
    """
    targets = np.asarray(labels_BT) if targets_are_shifted else np.asarray(labels_BT)[:, 1:]
    num_valid = int(check_targets(targets, vocab_size).sum())
    check_num_items(num_items_in_batch, num_valid)
    return num_valid


def causal_lm_loss(
    hidden_BTH: jax.Array,
    lm_head_VH: jax.Array,
    labels_BT: jax.Array,
    num_items_in_batch,
    loss_type: str = "nll",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_metrics: bool = False,
    *,
    targets_are_shifted: bool = False,
    logit_softcap: Optional[float] = None,
):
    """Mean next-token NLL over the optimizer step: ``sum(nll) / max(num_items_in_batch, 1)``.

    ``hidden_BTH`` are the final-norm hidden states, ``lm_head_VH`` the LM head in HF layout
    ``[vocab, hidden]``, ``labels_BT`` unshifted (-100 = ignored). ``num_items_in_batch`` may be
    a traced scalar (no recompilation per value). With ``return_metrics`` also returns
    ``{"mean_token_accuracy", "entropy", "num_tokens", "num_correct_tokens", "entropy_sum"}`` over
    this micro-batch's valid targets, as ``twinseq.common.objectives.nll.metrics`` and the torch backend
    (the sums let a trainer aggregate a step exactly). Labels are not range-checked here (traced);
    ``check_labels`` does it on the host.

    ``targets_are_shifted=True``: ``labels_BT`` already holds the targets (``targets[t]`` is scored at position
    t), as the context-parallel batches of ``common.data.context_parallel.shard_batch`` do: their rows are
    reordered, so shifting them here would pair tokens with the wrong targets.

    ``logit_softcap``: the model's ``final_logit_softcapping`` (Gemma 2), applied to the float32 logits
    of every loss type; None (every other family) leaves them as they are.
    """
    if loss_type not in LOSS_TYPES:
        raise ConfigError(f"loss_type={loss_type!r} is not supported by the JAX backend; choose one of {LOSS_TYPES}.")
    if int(chunk_size) <= 0:
        raise ConfigError(f"chunk_size={chunk_size!r} is not valid; pass a positive integer (tokens per chunk).")
    softcap = check_softcap(logit_softcap)
    h = hidden_BTH.shape[-1]
    hidden_NH = hidden_BTH.reshape(-1, h)
    targets_N = (labels_BT if targets_are_shifted else shift_labels(labels_BT)).reshape(-1)
    if loss_type == "nll":
        total, stats = _full_sums(hidden_NH, lm_head_VH, targets_N, softcap)
    elif loss_type == "chunked_nll":
        total, stats = _chunked_sums(hidden_NH, lm_head_VH, targets_N, int(chunk_size), softcap)
    else:
        total, stats = _fused_sums(hidden_NH, lm_head_VH, targets_N, int(chunk_size), softcap)
    loss = total / jnp.maximum(jnp.asarray(num_items_in_batch, jnp.float32), 1.0)
    if not return_metrics:
        return loss
    denom = jnp.maximum(stats.count, 1).astype(jnp.float32)
    return loss, {
        "mean_token_accuracy": stats.num_correct / denom,
        "entropy": stats.entropy_sum / denom,
        "num_tokens": stats.count,
        "num_correct_tokens": stats.num_correct,
        "entropy_sum": stats.entropy_sum,
    }


def load_balancing_loss(
    router_logits: Sequence[jax.Array], num_experts: int, top_k: int, valid_N: jax.Array
) -> jax.Array:
    """float32 scalar: transformers' ``load_balancing_loss_func`` (Switch Transformer, eqs. 4-6) over the router
    logits ``[N, E]`` of every MoE layer, counting the tokens where ``valid_N`` (transformers' ``attention_mask``;
    twinseq passes ``segment_ids != 0``, so padding never counts):

        f_e = (top-k picks of expert e, over layers and valid tokens) / (layers * valid tokens)
        P_e = (softmax probability of e, summed the same way) / (layers * valid tokens)
        aux = num_experts * sum_e f_e * P_e

    The softmax runs in the logits' dtype, as transformers' (which does not upcast here).
    """
    mask_N = valid_N.astype(jnp.float32)
    tokens_E = jnp.zeros((num_experts,), jnp.float32)
    probs_E = jnp.zeros((num_experts,), jnp.float32)
    for logits_NE in router_logits:
        probs_NE = jax.nn.softmax(logits_NE, axis=-1)
        _, experts_NK = jax.lax.top_k(probs_NE, top_k)
        picks_NE = jnp.sum(jax.nn.one_hot(experts_NK, num_experts, dtype=jnp.float32), axis=1)
        tokens_E = tokens_E + jnp.sum(picks_NE * mask_N[:, None], axis=0)
        probs_E = probs_E + jnp.sum(probs_NE.astype(jnp.float32) * mask_N[:, None], axis=0)
    rows = jnp.sum(mask_N) * len(router_logits)
    return jnp.sum((tokens_E / rows) * (probs_E / rows)) * num_experts


def router_counts(router_logits: Sequence[jax.Array], top_k: int, valid_N: jax.Array) -> jax.Array:
    """int32 [L, E], no gradient: per MoE layer, the routing slots each expert got from the tokens where ``valid_N``
    (``segment_ids != 0``), from the router logits ``[N, E]`` of each layer. ``common.objectives.moe.router_counts``
    is the numpy reference: the top-k of the float32 logits, the model's selection (its softmax keeps their order).
    """
    mask_N = valid_N.astype(jnp.int32)
    rows = []
    for logits_NE in router_logits:
        _, experts_NK = jax.lax.top_k(jax.lax.stop_gradient(logits_NE).astype(jnp.float32), top_k)
        picks_NE = jnp.sum(jax.nn.one_hot(experts_NK, logits_NE.shape[-1], dtype=jnp.int32), axis=1)
        rows.append(jnp.sum(picks_NE * mask_N[:, None], axis=0))
    return jnp.stack(rows)
