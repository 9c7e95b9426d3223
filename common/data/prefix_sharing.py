"""Prefix sharing: several completions of one prompt in one row, the prompt written once.

GRPO samples G completions per prompt, and DPO scores a chosen and a rejected completion of
one prompt. Collated one document per completion, the prompt is computed G (or 2) times. A
shared row writes it once::

    [ prompt[:-1] | prompt[-1] completion_1 | prompt[-1] completion_2 | ... ]
      segment s     segment s+1               segment s+2
      parent 0      parent s                  parent s

The batch contract's ``parent_ids`` (int32 [B, T], 0 = none) holds, for each token, the
segment whose tokens it may attend to besides its own. The rule (``Batch.attention_allowed``)
is: token i attends to token j iff ``position_ids[j] <= position_ids[i]`` and
``segment_ids[j] != 0`` and ``segment_ids[j]`` is ``segment_ids[i]`` or ``parent_ids[i]``.

A child segment starts with a copy of the prompt's last token, at position P - 1. Its hidden
state is the one the unshared document has there (it sees the same P tokens), and it predicts
the completion's first token inside its own segment, so the label shift of the contract
(``labels[t + 1]`` from position t, never across a segment) is unchanged. Each completion
costs one extra token; a group costs ``P - 1 + G * (C + 1)`` tokens instead of ``G * (P + C)``.

Every log-prob is the unshared one: each completion token sees the same keys at the same
positions. Gradients flow into the shared prompt from every completion.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from twinseq.common.data.batching import IGNORE_INDEX, Batch, _round_up
from twinseq.common.errors import DataError
from twinseq.common.tasks import task_spec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedGroup:
    """One prompt and the completions that share it; ``doc_ids[k]`` is the document index of completion k."""

    prompt: np.ndarray  # int64 [P], P >= 1
    completions: tuple[np.ndarray, ...]  # int64 [C_k], C_k >= 1
    doc_ids: tuple[int, ...]


def group_consecutive(prompts: Sequence[Sequence[int] | np.ndarray]) -> list[list[int]]:
    """Indices of runs of equal consecutive prompts (GRPO's groups: a prompt repeated G times).

    >>> group_consecutive([[1, 2], [1, 2], [3], [1, 2]])
    [[0, 1], [2], [3]]
    """
    runs: list[list[int]] = []
    previous: Optional[np.ndarray] = None
    for i, p in enumerate(prompts):
        p = np.asarray(p)
        if previous is not None and p.shape == previous.shape and (p == previous).all():
            runs[-1].append(i)
        else:
            runs.append([i])
        previous = p
    return runs


def _group_tokens(group: SharedGroup, first_segment: int):
    """(ids, labels, positions, segments, parents, target docs) of one group's tokens; the prefix
    segment only when the prompt has more than one token and more than one completion shares it."""
    p = np.asarray(group.prompt, np.int64)
    shared = p.size > 1 and len(group.completions) > 1
    ids, lab, pos, seg, par, doc = [], [], [], [], [], []
    s = first_segment
    if shared:
        n = p.size - 1
        ids.append(p[:-1])
        lab.append(np.full(n, IGNORE_INDEX))
        pos.append(np.arange(n))
        seg.append(np.full(n, s))
        par.append(np.zeros(n, np.int64))
        doc.append(np.full(n, -1))
        parent, head, s = s, p[-1:], s + 1
    else:
        parent, head = 0, p
    for c, d in zip(group.completions, group.doc_ids):
        c = np.asarray(c, np.int64)
        n = head.size + c.size
        ids.append(np.concatenate([head, c]))
        lab.append(np.concatenate([np.full(head.size, IGNORE_INDEX), c]))
        pos.append(np.arange(p.size - head.size, p.size + c.size))
        seg.append(np.full(n, s))
        par.append(np.full(n, parent))
        doc.append(np.full(n, d))
        s += 1
    return [np.concatenate(a) for a in (ids, lab, pos, seg, par, doc)], s


def collate_shared(
    groups: Sequence[SharedGroup],
    *,
    padding_free: bool = False,
    pad_token_id: int = 0,
    pad_to_multiple_of: Optional[int] = None,
) -> tuple[Batch, np.ndarray]:
    """``(batch, target_doc_ids)``: each group's prompt once, then its completions, each completion its own
    segment whose parent is the prompt's (module docstring). Padded: one row per group; padding-free: one row.

    ``target_doc_ids`` (int32 [B, T]) is the document of the target ``labels[t + 1]`` predicted at t, -1 where
    there is none, as ``collate_completions`` and ``collate_preference`` define it.

    >>> g = SharedGroup(np.array([1, 5, 6]), (np.array([7, 2]), np.array([8])), (0, 1))
    >>> b, t = collate_shared([g])
    >>> b.input_ids.tolist(), b.labels.tolist()
    ([[1, 5, 6, 7, 2, 6, 8]], [[-100, -100, -100, 7, 2, -100, 8]])
    >>> b.position_ids.tolist(), b.segment_ids.tolist(), b.parent_ids.tolist()
    ([[0, 1, 2, 3, 4, 2, 3]], [[1, 1, 2, 2, 2, 3, 3]], [[0, 0, 1, 1, 1, 1, 1]])
    >>> t.tolist()
    [[-1, -1, 0, 0, -1, 1, -1]]
    """
    if not len(groups):
        raise DataError(
            f"groups={groups!r}: collate_shared() needs at least one group; pass a non-empty list of SharedGroup."
        )
    rows: list[list[np.ndarray]] = []
    s = 1
    for i, g in enumerate(groups):
        if np.asarray(g.prompt).size == 0 or any(np.asarray(c).size == 0 for c in g.completions):
            raise DataError(
                f"group {i}: an empty prompt or completion (prompt {np.asarray(g.prompt).tolist()}); a prompt needs at "
                f"least one token (a BOS) and a completion at least one token to score: prepend a BOS token, drop "
                f"empty completions."
            )
        tokens, s = _group_tokens(g, 1 if not padding_free else s)
        if padding_free and rows:
            rows[0] = [np.concatenate([a, b]) for a, b in zip(rows[0], tokens)]
        else:
            rows.append(tokens)
    width = _round_up(max(r[0].size for r in rows), pad_to_multiple_of)
    fills = (pad_token_id, IGNORE_INDEX, 0, 0, 0, -1)
    out = [np.full((len(rows), width), f, np.int32) for f in fills]
    for r, tokens in enumerate(rows):
        for a, t in zip(out, tokens):
            a[r, : t.size] = t
    input_ids, labels, position_ids, segment_ids, parent_ids, doc_BT = out
    lengths = [np.bincount(row[row > 0])[1:] for row in segment_ids]
    cu_seqlens = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int32)
    batch = Batch(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        segment_ids=segment_ids,
        cu_seqlens=cu_seqlens,
        num_items_in_batch=int((labels != IGNORE_INDEX).sum()),
        parent_ids=parent_ids,
    )
    target_BT = np.full_like(doc_BT, -1)
    has_target = np.zeros_like(labels, dtype=bool)
    has_target[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    target_BT[:, :-1] = np.where(has_target[:, :-1], doc_BT[:, 1:], -1)
    return batch, target_BT


def unshared_documents(batch: Batch) -> list[dict[str, np.ndarray]]:
    """The documents a shared batch stands for, each ``parent tokens + own tokens`` (``split_documents``'s form),
    in order; parents alone (segments with children) are not documents."""
    docs = []
    par = batch.parent_ids if batch.parent_ids is not None else np.zeros_like(batch.segment_ids)
    for r in range(batch.input_ids.shape[0]):
        seg = batch.segment_ids[r]
        parents = set(np.unique(par[r][par[r] != 0]).tolist())
        for s in np.unique(seg[seg != 0]):
            if int(s) in parents:
                continue
            idx = np.nonzero(seg == s)[0]
            p = int(par[r, idx[0]])
            if p:
                idx = np.concatenate([np.nonzero(seg == p)[0], idx])
            docs.append({"input_ids": batch.input_ids[r, idx], "labels": batch.labels[r, idx]})
    return docs


def prefix_sharing_off_reason(cfg: Any) -> Optional[str]:
    """Why a run of ``cfg`` (a ``TrainConfig``) does not share prompts, or None when it does (``memory.share_prefix``
    on, a task that scores several completions of one prompt, and a path that carries ``parent_ids``)."""
    if not task_spec(cfg.task).shares_prefix:
        return f"task={cfg.task!r} scores one completion per prompt"
    if not cfg.memory.share_prefix:
        return "share_prefix=False"
    if cfg.parallel.context_parallel_size > 1:
        return (
            f"context_parallel_size={cfg.parallel.context_parallel_size} shards each row over ranks, which the "
            f"shared layout does not split yet"
        )
    if cfg.task == "dpo" and cfg.loss.loss_type == "liger":
        return "Liger's fused DPO loss scores chosen and rejected rows of their own"
    return None


def shares_prefix(cfg: Any) -> bool:
    """True when the run of ``cfg`` collates prefix-shared batches; when ``share_prefix`` is on but the run cannot
    share, the reason is logged once."""
    reason = prefix_sharing_off_reason(cfg)
    if reason is not None and cfg.memory.share_prefix and task_spec(cfg.task).shares_prefix:
        _log_off(reason)
    return reason is None


@functools.lru_cache(maxsize=None)
def _log_off(reason: str) -> None:
    logger.info("prefix sharing is off: %s; every completion repeats its prompt", reason)
