"""Per-token and per-document log-probs of the targets, from hidden states (DPO's, later GRPO's).

The sequence log-prob of document d is ``Σ log softmax(hidden[t] @ W.T)[labels[t + 1]]`` over
the positions t with ``target_doc_ids[t] == d`` (``common.data.preference_batching``), chosen documents
first. ``loss_type`` picks the per-token kernel, as for SFT:

``nll``           full logits ``[B*T, V]`` (the baseline);
``chunked_nll``   ``jax.lax.scan`` over token chunks, each under ``jax.checkpoint``;
``fused_linear``  a ``jax.custom_vjp``: forward scans token chunks and keeps only the
                  per-token logsumexp; backward scans *vocabulary* chunks, recomputes
                  ``logits[:, rows]`` and forms ``g_t (onehot - softmax)`` by hand, writing
                  ``dW[rows]`` in place. Nothing of size ``[tokens, V]`` and no second ``[V, H]``.

``logit_softcap`` (Gemma 2's ``final_logit_softcapping``) caps the float32 logits of every kernel, as
in ``losses``; the fused backward multiplies by the cap's derivative.

Every shape depends on (B, T, N) only, so a jitted step compiles once per bucket.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

from twinseq.common.config import DEFAULT_CHUNK_SIZE
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.nll import IGNORE_INDEX
from twinseq.jax_backend.losses import check_softcap, logits_f32, shift_labels, to_token_chunks, vocab_chunked_grads

LOGPS_LOSS_TYPES = ("nll", "chunked_nll", "fused_linear")


def _picked_logps(logits_NV: jax.Array, targets_N: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(target log-prob, logsumexp) in torch's ``log_softmax`` order ``(x_t - max) - log Σ exp(x - max)``;
    0 where the target is -100."""
    valid_N = targets_N != IGNORE_INDEX
    safe_N = jnp.where(valid_N, targets_N, 0)
    max_N = jax.lax.stop_gradient(jnp.max(logits_NV, axis=-1))
    log_sum_N = jnp.log(jnp.sum(jnp.exp(logits_NV - max_N[:, None]), axis=-1))
    picked_N = jnp.take_along_axis(logits_NV, safe_N[:, None], axis=-1)[:, 0] - max_N
    return jnp.where(valid_N, picked_N - log_sum_N, 0.0), jax.lax.stop_gradient(log_sum_N + max_N)


def _scan_logps(hidden_NH, lm_head_VH, targets_N, chunk_size: int, remat: bool, softcap: Optional[float]):
    """(logp [N], lse [N]) over token chunks; one chunk's logits at a time."""
    n = hidden_NH.shape[0]
    hidden_CSH, targets_CS = to_token_chunks(hidden_NH, targets_N, chunk_size)

    def chunk(h_SH, w_VH, t_S):
        return _picked_logps(logits_f32(h_SH, w_VH, softcap), t_S)

    chunk_fn = jax.checkpoint(chunk) if remat else chunk
    _, (logp_CS, lse_CS) = jax.lax.scan(
        lambda carry, xs: (carry, chunk_fn(xs[0], lm_head_VH, xs[1])), None, (hidden_CSH, targets_CS)
    )
    return logp_CS.reshape(-1)[:n], lse_CS.reshape(-1)[:n]


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused_logps(hidden_NH, lm_head_VH, targets_N, chunk_size: int, softcap: Optional[float]) -> jax.Array:
    return _scan_logps(hidden_NH, lm_head_VH, targets_N, chunk_size, False, softcap)[0]


def _fused_fwd(hidden_NH, lm_head_VH, targets_N, chunk_size: int, softcap: Optional[float]):
    logp_N, lse_N = _scan_logps(hidden_NH, lm_head_VH, targets_N, chunk_size, False, softcap)
    return logp_N, (hidden_NH, lm_head_VH, targets_N, lse_N)


def _fused_bwd(chunk_size: int, softcap: Optional[float], residuals, g_N):
    """``d logp_t / d logits = onehot - softmax``: the NLL's vocabulary-chunked backward with the
    upstream gradient negated (bit for bit the same numbers)."""
    hidden_NH, lm_head_VH, targets_N, lse_N = residuals
    scale_N = jnp.where(targets_N != IGNORE_INDEX, -g_N, 0.0).astype(jnp.float32)
    dh_NH, dw_VH = vocab_chunked_grads(hidden_NH, lm_head_VH, targets_N, lse_N, scale_N, chunk_size, softcap)
    return dh_NH, dw_VH, None


_fused_logps.defvjp(_fused_fwd, _fused_bwd)


def token_logps(
    hidden_BTH: jax.Array,
    lm_head_VH: jax.Array,
    labels_BT: jax.Array,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    logit_softcap: Optional[float] = None,
    targets_are_shifted: bool = False,
) -> jax.Array:
    """float32 [B*T]: log-prob of ``labels[t + 1]`` at t (flattened), 0 where the target is -100.

    Naive equivalent: ``log_softmax(logits_f32(hidden, W, logit_softcap))[..., shift_labels(labels)]``.
    ``targets_are_shifted``: ``labels_BT`` are already the targets (a context-parallel batch, whose targets were
    shifted before the zigzag reorder, ``parallel.shard_preference_batch``): they are not shifted again.
    """
    if loss_type not in LOGPS_LOSS_TYPES:
        raise ConfigError(
            f"loss_type={loss_type!r} is not supported by the JAX DPO log-probs; choose one of {LOGPS_LOSS_TYPES}."
        )
    if int(chunk_size) <= 0:
        raise ConfigError(f"chunk_size={chunk_size!r} is not valid; pass a positive integer (tokens per chunk).")
    softcap = check_softcap(logit_softcap)
    hidden_NH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
    targets_N = (labels_BT if targets_are_shifted else shift_labels(labels_BT)).reshape(-1)
    if loss_type == "nll":
        return _picked_logps(logits_f32(hidden_NH, lm_head_VH, softcap), targets_N)[0]
    if loss_type == "chunked_nll":
        return _scan_logps(hidden_NH, lm_head_VH, targets_N, int(chunk_size), True, softcap)[0]
    return _fused_logps(hidden_NH, lm_head_VH, targets_N, int(chunk_size), softcap)


def sequence_logps(
    hidden_BTH,
    lm_head_VH,
    labels_BT,
    target_doc_ids_BT,
    num_docs: int,
    loss_type: str = "fused_linear",
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    *,
    logit_softcap: Optional[float] = None,
    targets_are_shifted: bool = False,
) -> jax.Array:
    """float32 [2N]: per-document sums of the target log-probs (``common.data.preference_batching``'s rule);
    ``logit_softcap`` and ``targets_are_shifted`` as ``token_logps``.

    On a context-parallel batch every [B, T] input is sharded over ``cp`` on T (in the zigzag order, the targets
    and ``target_doc_ids_BT`` reordered with the tokens); the ``segment_sum`` then reduces over a sharded axis and
    GSPMD adds the shards' partial sums (an all-reduce over ``cp``), whose transpose hands every shard the
    gradient of its own tokens: the same sums and gradients as on one device.
    """
    logp_N = token_logps(
        hidden_BTH,
        lm_head_VH,
        labels_BT,
        loss_type,
        chunk_size,
        logit_softcap=logit_softcap,
        targets_are_shifted=targets_are_shifted,
    )
    doc_N = target_doc_ids_BT.reshape(-1)
    # -1 (no target) goes to an extra segment that is dropped
    seg_N = jnp.where(doc_N >= 0, doc_N, num_docs)
    return jax.ops.segment_sum(jnp.where(doc_N >= 0, logp_N, 0.0), seg_N, num_segments=num_docs + 1)[:num_docs]
