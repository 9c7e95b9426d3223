"""Router statistics of a mixture-of-experts model: the numpy reference of how each MoE layer spreads the real
tokens over its experts.

Each MoE layer sends every token to the ``top_k`` experts with the largest router logits. qwen3_moe and mixtral take
the top-k of the softmax of the logits, gpt_oss the softmax of the top-k logits: the softmax keeps the order, so the
selection, and every count here, is the same. Both backends count in-graph, without a gradient, what
``router_counts`` counts:

- a micro-batch reports ``router_counts`` [L, E]: per MoE layer, the routing slots (k per token) each expert got from
  the micro-batch's real tokens (``segment_ids != 0``; padding never counts);
- a step adds its micro-batches' counts (and, on several ranks, every rank's), so gradient accumulation and data
  parallelism give the step's exact figure, never a mean of means;
- ``router_load_metrics`` turns the step's counts into its metrics: per layer the load of each expert (its share of
  the layer's slots, summing to 1), the busiest expert's load, and ``router_max_load``, their mean over the layers.

A perfectly balanced layer gives every expert a load of ``1 / E``; a collapsed router gives one expert ``1 / k`` (it
holds one of each token's k slots) and ``router_max_load`` tends there.

>>> logits_LNE = np.array([[[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 0.0, 9.0]]])  # 1 layer, 3 tokens, 3 experts
>>> counts = router_counts(logits_LNE, segment_ids=np.array([[1, 1, 0]]), top_k=1)  # the third token is padding
>>> counts.tolist()
[[1, 1, 0]]
>>> metrics = router_load_metrics(counts, layers=[5])
>>> metrics["router_max_load"], metrics["router_load_max/L5"], metrics["router_load/L5"].tolist()
(0.5, 0.5, [0.5, 0.5, 0.0])
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from twinseq.common.errors import DataError
from twinseq.common.models.configs import ModelConfig

COUNTS_KEY = "router_counts"
"""The key of a micro-batch's (and a step's sums') routing-slot counts [L, E]."""


def moe_layers(cfg: ModelConfig) -> list[int]:
    """The decoder-layer indices of the MoE layers, in order: what ``L{i}`` of the metric names counts (a qwen3_moe
    model with ``mlp_only_layers`` or ``decoder_sparse_step`` > 1 skips its dense layers)."""
    return [i for i in range(cfg.num_hidden_layers) if cfg.layer_is_moe(i)]


def router_counts(router_logits: Sequence[np.ndarray], segment_ids: np.ndarray, top_k: int) -> np.ndarray:
    """int64 [L, E]: per MoE layer, how many of the real tokens' routing slots each expert got.

    ``router_logits``: one [N, E] array per MoE layer (or one [L, N, E] array), the tokens in row-major order of
    ``segment_ids`` [B, T] (N = B * T); a token counts where its segment id is not 0. Each token gives its ``top_k``
    largest logits one slot each (ties: the lower expert index, as ``jax.lax.top_k``), so every row of the result
    sums to ``top_k`` times the number of real tokens. Naive equivalent::

        for l, n: if segment_ids.flat[n]: for e in argsort(-logits[l][n])[:top_k]: counts[l, e] += 1
    """
    valid_N = np.asarray(segment_ids).reshape(-1) != 0
    layers = [np.asarray(x, np.float64) for x in router_logits]
    rows = []
    for i, logits_NE in enumerate(layers):
        if logits_NE.ndim != 2 or logits_NE.shape[0] != valid_N.size or not 1 <= top_k <= logits_NE.shape[1]:
            raise DataError(
                f"router_logits[{i}] has shape {logits_NE.shape}; expected [N={valid_N.size}, E] with "
                f"E >= top_k={top_k}; pass one [B * T, E] array per MoE layer for segment_ids of shape "
                f"{np.shape(segment_ids)}."
            )
        experts_NK = np.argsort(-logits_NE[valid_N], axis=-1, kind="stable")[:, :top_k]
        rows.append(np.bincount(experts_NK.reshape(-1), minlength=logits_NE.shape[1]))
    return np.stack(rows).astype(np.int64) if rows else np.zeros((0, 0), np.int64)


def router_load_metrics(counts_LE: np.ndarray, layers: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """A step's router metrics from its summed ``router_counts`` [L, E].

    - ``router_max_load``: the mean over the MoE layers of the busiest expert's load (the mean, not the max, so that
      one unbalanced layer moves it by 1/L: the per-layer values say which one);
    - ``router_load_max/L{i}``: the busiest expert's load in layer ``i``;
    - ``router_load/L{i}``: float64 [E], each expert's share of layer ``i``'s routing slots (sums to 1; all 0 for a
      step without a real token). An array, so that a window of logged steps averages it; ``metrics.jsonl`` writes
      it as a list, and the terminal line and the scalar sinks leave it out.

    ``layers``: the decoder-layer index of each row (``moe_layers``); None: 0..L-1.
    """
    counts_LE = np.asarray(counts_LE, np.float64)
    layers = list(range(counts_LE.shape[0])) if layers is None else list(layers)
    assert len(layers) == counts_LE.shape[0], (layers, counts_LE.shape)
    if not layers:
        return {}
    slots_L1 = counts_LE.sum(axis=-1, keepdims=True)
    loads_LE = np.divide(counts_LE, slots_L1, out=np.zeros_like(counts_LE), where=slots_L1 > 0)
    out: dict[str, Any] = {"router_max_load": float(loads_LE.max(axis=-1).mean())}
    for i, loads_E in zip(layers, loads_LE):
        out[f"router_load_max/L{i}"] = float(loads_E.max())
    for i, loads_E in zip(layers, loads_LE):
        out[f"router_load/L{i}"] = loads_E
    return out
