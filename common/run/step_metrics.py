"""One optimizer step's metrics, assembled from its micro-batches the same way on every backend.

A micro-batch reports sums (``loss`` already normalised by the whole step's label count, and the
target count, correct-argmax count and entropy sum of its own targets); a step adds them up, a
multi-process step adds them over ranks (``ADDITIVE``), and only then are the means formed, so
no mean is ever averaged.

>>> micro = [{"loss": 1.0, "num_tokens": 3, "num_correct_tokens": 1, "entropy_sum": 6.0},
...          {"loss": 0.5, "num_tokens": 1, "num_correct_tokens": 1, "entropy_sum": 2.0}]
>>> out = with_means(sft_step_sums(micro, num_tokens=10))
>>> out["loss"], out["num_label_tokens"], out["mean_token_accuracy"], out["entropy"]
(1.5, 4, 0.5, 2.0)
"""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from twinseq.common.errors import NonFiniteError
from twinseq.common.objectives.dpo import reward_metrics
from twinseq.common.objectives.moe import COUNTS_KEY, router_load_metrics

logger = logging.getLogger(__name__)

ADDITIVE = (
    "loss",
    "num_tokens",
    "num_label_tokens",
    "num_correct_tokens",
    "entropy_sum",
    "aux_loss_sum",
    "aux_loss_micro_batches",
)
"""Keys that add up over micro-batches and ranks (a distributed trainer all-reduces exactly these)."""
INTEGER = ("num_tokens", "num_label_tokens", "num_correct_tokens", "aux_loss_micro_batches")


def sft_step_sums(micro: Sequence[Mapping[str, Any]], *, num_tokens: int) -> dict[str, Any]:
    """The additive metrics of one step from its micro-batches' loss and metric sums.

    ``micro[i]`` holds ``loss`` and the loss kernels' ``num_tokens`` (valid targets),
    ``num_correct_tokens`` and ``entropy_sum``; ``num_tokens`` is the step's non-padding tokens.
    A MoE model's micro-batches also hold ``router_counts`` [L, E] (``common.objectives.moe``): the step's are their
    sum, int64 (a multi-process trainer adds them over ranks too); with ``output_router_logits`` each holds its
    unweighted ``aux_loss``, summed with the count of micro-batches so that ``with_means`` gives the mean over every
    micro-batch of every rank (the figure TRL logs as ``aux_loss``).
    """
    sums = {
        "loss": sum(float(m["loss"]) for m in micro),
        "num_tokens": int(num_tokens),
        "num_label_tokens": sum(int(m["num_tokens"]) for m in micro),
        "num_correct_tokens": sum(int(round(float(m["num_correct_tokens"]))) for m in micro),
        "entropy_sum": sum(float(m["entropy_sum"]) for m in micro),
    }
    aux = [float(m["aux_loss"]) for m in micro if "aux_loss" in m]
    if aux:
        assert len(aux) == len(micro), "every micro-batch of a MoE step with output_router_logits has its aux_loss"
        sums["aux_loss_sum"], sums["aux_loss_micro_batches"] = sum(aux), len(aux)
    counts = [np.asarray(m[COUNTS_KEY], np.int64) for m in micro if COUNTS_KEY in m]
    if counts:
        assert len(counts) == len(micro), "every micro-batch of a MoE step reports its router counts"
        sums[COUNTS_KEY] = np.sum(counts, axis=0)
    return sums


def with_means(sums: dict[str, Any], moe_layers: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """``sums`` plus ``mean_token_accuracy`` and ``entropy`` over the step's targets (0 without any). Summed
    ``router_counts`` become the router metrics (``common.objectives.moe.router_load_metrics``; ``moe_layers``: the
    decoder-layer index of each of their rows, None: 0..L-1) and leave the step's metrics, as the aux loss's sum and
    count leave for their mean, ``aux_loss``."""
    labels = sums["num_label_tokens"]
    counts = sums.get(COUNTS_KEY)
    aux = {"aux_loss": sums["aux_loss_sum"] / sums["aux_loss_micro_batches"]} if "aux_loss_sum" in sums else {}
    dropped = (COUNTS_KEY, "aux_loss_sum", "aux_loss_micro_batches")
    return {
        **{k: v for k, v in sums.items() if k not in dropped},
        **aux,
        "mean_token_accuracy": sums["num_correct_tokens"] / labels if labels else 0.0,
        "entropy": sums["entropy_sum"] / labels if labels else 0.0,
        **({} if counts is None else router_load_metrics(counts, moe_layers)),
    }


def dpo_step_metrics(
    losses: Sequence[float], per_pair: Mapping[str, Sequence[np.ndarray]], *, num_tokens: int, num_label_tokens: int
) -> dict[str, Any]:
    """TRL's DPO metrics of one step: the loss (sum of the micro-batch losses, each already divided
    by the step's pairs), reward means and the policy's mean sequence log-probs over every pair.

    ``per_pair`` holds, per micro-batch, ``chosen_rewards``, ``rejected_rewards``, ``chosen_logps``
    and ``rejected_logps`` arrays [N].
    """
    cat = {k: np.concatenate([np.asarray(a, np.float64) for a in v]) for k, v in per_pair.items()}
    return {
        "loss": float(sum(losses)),
        "num_tokens": int(num_tokens),
        "num_label_tokens": int(num_label_tokens),
        "num_pairs": int(cat["chosen_rewards"].size),
        **reward_metrics(cat["chosen_rewards"], cat["rejected_rewards"]),
        "logps/chosen": float(cat["chosen_logps"].mean()),
        "logps/rejected": float(cat["rejected_logps"].mean()),
    }


def first_nonfinite(losses: Sequence[float], grad_norm: Optional[float]) -> Optional[str]:
    """What is not finite in a step, before its update is applied, or None when all is finite.

    >>> first_nonfinite([0.5, float("nan")], 1.0), first_nonfinite([0.5], float("inf")), first_nonfinite([0.5], 2.0)
    ('the loss of micro-batch 1 is nan', 'the gradient norm is inf', None)
    """
    for i, loss in enumerate(losses):
        if not math.isfinite(loss):
            return f"the loss of micro-batch {i} is {loss}"
    if grad_norm is not None and not math.isfinite(grad_norm):
        return f"the gradient norm is {grad_norm}"
    return None


def apply_or_skip(problem: Optional[str], *, skip: bool) -> bool:
    """True: apply the update. False: skip it (``skip_nonfinite_steps``, logged). Raises ``NonFiniteError``
    otherwise (the runner adds the step number)."""
    if problem is None:
        return True
    if skip:
        logger.warning("skipping the optimizer step: %s (skip_nonfinite_steps=True)", problem)
        return False
    raise NonFiniteError(problem)
