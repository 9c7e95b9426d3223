"""Sequence sharding for context parallelism (CP), shared by both backends (numpy only).

With CP over ``cp`` ranks, every rank holds ``T / cp`` tokens of each row and attention
rides a ring (or an all-gather) to see the keys of the other ranks.

Load balancing ("zigzag" or "head-tail"). Under a causal mask a contiguous split gives the
last rank ``cp`` times the work of the first, because late queries see every earlier key.
Instead ``T`` is cut into ``2 * cp`` chunks and rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r``: one early and one late chunk, so every rank does the same work.

    T = 8, cp = 2, chunks of 2:   tokens 0 1 | 2 3 | 4 5 | 6 7
    rank 0 holds chunks 0 and 3:  0 1 6 7
    rank 1 holds chunks 1 and 2:  2 3 4 5
    reordered row (ranks in order): [0 1 6 7 2 3 4 5]

The attention mask is driven by ``segment_ids`` and ``position_ids`` (DESIGN.md: i attends j
iff ``seg[i] == seg[j] != 0`` and ``pos[j] <= pos[i]``), never by the index in the row, so a
reordered row still has the right mask once those ids are reordered with it.

The label shift must happen BEFORE the reorder. The loss predicts ``labels[t + 1]`` from
position ``t``; after a reorder, ``t + 1`` of the reordered row is a different token (and
at a shard edge it lives on another rank), so shifting afterwards would drop or scramble
targets. ``shard_batch`` therefore ships ``targets = shift_labels(labels)`` already
shifted, and the loss on a CP batch must not shift again.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Union

import numpy as np

from twinseq.common.data.batching import Batch
from twinseq.common.errors import ConfigError
from twinseq.common.objectives.nll import shift_labels


def required_multiple(cp: int, load_balance: bool = True) -> int:
    """The multiple ``T`` must be padded to: ``2 * cp`` with load balancing, else ``cp``."""
    if not isinstance(cp, (int, np.integer)) or isinstance(cp, bool) or cp < 1:
        raise ConfigError(
            f"cp={cp!r} must be a positive integer (the size of the context-parallel mesh axis): pass e.g. cp=2."
        )
    return 2 * int(cp) if load_balance else int(cp)


def check_seq_len(seq_len: int, cp: int, load_balance: bool = True) -> None:
    """Raise ``ValueError`` unless ``seq_len`` splits evenly into the CP chunks."""
    multiple = required_multiple(cp, load_balance)
    if seq_len % multiple:
        what = f"2 * cp = {multiple} load-balanced chunks" if load_balance else f"cp = {multiple} shards"
        raise ConfigError(
            f"sequence length T={seq_len} is not divisible by {what} (cp={cp}); pad the batch with "
            f"--pad-to-multiple-of {multiple} (TrainConfig.pad_to_multiple_of={multiple})."
        )


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (out of ``2 * cp``) held by ``rank``: ``(rank, 2 * cp - 1 - rank)``.

    >>> [zigzag_chunks(4, r) for r in range(4)]
    [(0, 7), (1, 6), (2, 5), (3, 4)]
    """
    if not 0 <= rank < cp:
        raise ConfigError(f"rank={rank} is outside [0, cp={cp}); pass a rank from 0 to {cp - 1}.")
    return rank, 2 * cp - 1 - rank


def cp_permutation(seq_len: int, cp: int, load_balance: bool = True) -> np.ndarray:
    """int64 [T]: ``reordered = x[..., perm]``; rank ``r`` owns ``reordered[r * T/cp:(r + 1) * T/cp]``.

    Without load balancing this is the identity (contiguous shards).

    >>> cp_permutation(8, 2).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    check_seq_len(seq_len, cp, load_balance)
    if not load_balance:
        return np.arange(seq_len, dtype=np.int64)
    chunks = np.arange(seq_len, dtype=np.int64).reshape(2 * cp, -1)
    order = [c for r in range(cp) for c in zigzag_chunks(cp, r)]
    return chunks[order].reshape(-1)


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    """``inv`` with ``x[..., perm][..., inv] == x``."""
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm), dtype=perm.dtype)
    return inv


def shard_sequence(x: np.ndarray, cp: int, load_balance: bool = True, axis: int = -1) -> np.ndarray:
    """Reorder ``x`` along ``axis`` (the sequence) so that rank shards are contiguous, in rank order.

    The result, split into ``cp`` equal parts along ``axis``, gives rank 0, 1, ... shards: exactly
    what a sequence-sharded device array (``PartitionSpec(..., 'cp')``) holds.

    >>> shard_sequence(np.arange(8)[None], cp=2).tolist()
    [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    x = np.asarray(x)
    return np.take(x, cp_permutation(x.shape[axis], cp, load_balance), axis=axis)


def split_shards(x_reordered: np.ndarray, cp: int, axis: int = -1) -> list[np.ndarray]:
    """The ``cp`` per-rank shards of a reordered array (``shard_sequence`` output)."""
    x_reordered = np.asarray(x_reordered)
    if x_reordered.shape[axis] % cp:
        raise ConfigError(
            f"axis {axis} has length {x_reordered.shape[axis]}, not divisible by cp={cp}; pad that axis to a "
            f"multiple of {cp} (shard_sequence's output is)."
        )
    return np.split(x_reordered, cp, axis=axis)


def unshard_sequence(
    shards: Union[np.ndarray, Sequence[np.ndarray]], cp: int, load_balance: bool = True, axis: int = -1
) -> np.ndarray:
    """Inverse of ``shard_sequence``: a reordered array, or the list of rank shards, back to token order.

    >>> unshard_sequence([np.array([0, 1, 6, 7]), np.array([2, 3, 4, 5])], cp=2).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    if isinstance(shards, (list, tuple)):
        if len(shards) != cp:
            raise ConfigError(f"got {len(shards)} shards for cp={cp}; pass one shard per rank, in rank order.")
        x_reordered = np.concatenate([np.asarray(s) for s in shards], axis=axis)
    else:
        x_reordered = np.asarray(shards)
    inv = inverse_permutation(cp_permutation(x_reordered.shape[axis], cp, load_balance))
    return np.take(x_reordered, inv, axis=axis)


@dataclasses.dataclass
class CPBatch:
    """A ``Batch`` reordered for CP: every array is [B, T] with rank shards contiguous along T.

    ``targets`` are the labels *already shifted* (``targets[t] = labels[t + 1]`` in token order,
    then reordered); a loss on a CP batch must use them as they are and not shift again.
    """

    input_ids: np.ndarray  # int32 [B, T], reordered
    targets: np.ndarray  # int32 [B, T], shifted then reordered; -100 = no loss
    position_ids: np.ndarray  # int32 [B, T], reordered (the attention mask reads these)
    segment_ids: np.ndarray  # int32 [B, T], reordered
    num_items_in_batch: int
    cp: int
    load_balance: bool

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            "input_ids": self.input_ids,
            "targets": self.targets,
            "position_ids": self.position_ids,
            "segment_ids": self.segment_ids,
        }

    def rank(self, rank: int) -> dict[str, np.ndarray]:
        """The [B, T / cp] shard of every array held by ``rank``."""
        if not 0 <= rank < self.cp:
            raise ConfigError(f"rank={rank} is outside [0, cp={self.cp}); pass a rank from 0 to {self.cp - 1}.")
        return {k: split_shards(v, self.cp)[rank] for k, v in self.arrays().items()}

    def unshard(self, x_reordered: np.ndarray, axis: int = 1) -> np.ndarray:
        """Put a per-token result computed on this batch (e.g. logits [B, T, V]) back in token order."""
        return unshard_sequence(x_reordered, self.cp, self.load_balance, axis=axis)


def shard_batch(batch: Batch, cp: int, load_balance: bool = True) -> CPBatch:
    """Shift the labels, then reorder ``input_ids``, targets, ``position_ids`` and ``segment_ids``.

    >>> from twinseq.common.data.batching import collate
    >>> b = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9, 4, 3, 2]}], padding_free=True)
    >>> s = shard_batch(b, cp=2)
    >>> s.input_ids.tolist(), s.targets.tolist()
    ([[5, 6, 3, 2, 7, 8, 9, 4]], [[6, 7, 2, -100, -100, 9, 4, 3]])
    >>> s.rank(1)["position_ids"].tolist()
    [[2, 0, 1, 2]]
    """
    check_seq_len(batch.input_ids.shape[1], cp, load_balance)
    targets = shift_labels(batch.labels).astype(np.int32)

    def reorder(x: np.ndarray) -> np.ndarray:
        return shard_sequence(x, cp, load_balance, axis=1)

    return CPBatch(
        input_ids=reorder(batch.input_ids),
        targets=reorder(targets),
        position_ids=reorder(batch.position_ids),
        segment_ids=reorder(batch.segment_ids),
        num_items_in_batch=int(batch.num_items_in_batch),
        cp=int(cp),
        load_balance=bool(load_balance),
    )


def pad_doc_ids(doc_ids_BT: np.ndarray, rows: int, multiple: int) -> np.ndarray:
    """``doc_ids_BT`` padded with -1 (no document, no target) to ``rows`` rows and a multiple of ``multiple``
    columns, as ``batching.pad_batch`` pads a ``Batch`` (to the right and below).

    >>> pad_doc_ids(np.array([[0, 0, -1]]), rows=1, multiple=4).tolist()
    [[0, 0, -1, -1]]
    """
    b, t = doc_ids_BT.shape
    width = -(-t // multiple) * multiple
    return np.pad(doc_ids_BT, ((0, rows - b), (0, width - t)), constant_values=-1)


def shard_doc_ids(target_doc_ids_BT: np.ndarray, cp: int, rank: int, load_balance: bool = True) -> np.ndarray:
    """``rank``'s [B, T / cp] shard of a preference batch's ``target_doc_ids`` (the document of the target
    ``labels[t + 1]`` predicted at t, -1 for none; ``common.data.preference_batching``).

    ``target_doc_ids`` is already in the shifted layout (its position t is the position of
    ``targets[t] = labels[t + 1]``), so it is reordered exactly as ``CPBatch.targets`` is and never shifted again:
    a rank's targets and their documents stay aligned, also where a document crosses the shard boundary.

    >>> shard_doc_ids(np.array([[-1, 0, 0, -1, -1, 1, 1, -1]]), cp=2, rank=0).tolist()
    [[-1, 0, 1, -1]]
    """
    return split_shards(shard_sequence(np.asarray(target_doc_ids_BT), cp, load_balance, axis=1), cp, axis=1)[rank]


def _block_extremes(seg_NS: np.ndarray, pos_NS: np.ndarray, segments: np.ndarray):
    """Per block and segment: the max position (as a query) and the min position (as a key).

    Absent segments get max -1 and min +big, so they never make a block pair non-empty.
    """
    num_blocks = seg_NS.shape[0]
    big = np.iinfo(np.int64).max
    max_pos = np.full((num_blocks, len(segments)), -1, dtype=np.int64)
    min_pos = np.full((num_blocks, len(segments)), big, dtype=np.int64)
    block_idx = np.broadcast_to(np.arange(num_blocks)[:, None], seg_NS.shape)
    real = seg_NS != 0
    seg_idx = np.searchsorted(segments, seg_NS[real])
    np.maximum.at(max_pos, (block_idx[real], seg_idx), pos_NS[real])
    np.minimum.at(min_pos, (block_idx[real], seg_idx), pos_NS[real])
    return max_pos, min_pos


def _nonempty_block_pairs(seg_T: np.ndarray, pos_T: np.ndarray, block_size: int) -> np.ndarray:
    """bool [nb, nb]: query block a and key block b share an allowed pair (mask rule of DESIGN.md).

    Exact: some segment s is in both and min key position <= max query position within s.
    """
    segments = np.unique(seg_T[seg_T != 0])
    num_blocks = len(seg_T) // block_size
    if not len(segments):
        return np.zeros((num_blocks, num_blocks), dtype=bool)
    max_q, min_k = _block_extremes(
        seg_T.reshape(num_blocks, block_size), pos_T.astype(np.int64).reshape(num_blocks, block_size), segments
    )
    out = np.zeros((num_blocks, num_blocks), dtype=bool)
    for a in range(num_blocks):
        out[a] = (min_k <= max_q[a][None, :]).any(axis=1)
    return out


def count_attention_blocks(
    segment_ids: np.ndarray, position_ids: np.ndarray, cp: int, block_size: int, load_balance: bool = True
) -> np.ndarray:
    """int64 [cp]: attention blocks each rank computes, fully masked blocks skipped.

    Rank r's queries (its ``T / cp`` shard, cut into blocks of ``block_size``) meet every key
    block of every shard over the ring. A (query block, key block) pair is computed iff it holds
    at least one allowed pair, for any row of the batch (one predicate per block pair, as the
    kernel's ``lax.cond``). ``segment_ids`` and ``position_ids`` are [T] or [B, T] in token order.

    >>> seg = np.ones(16, np.int32); pos = np.arange(16)
    >>> count_attention_blocks(seg, pos, cp=2, block_size=4, load_balance=False).tolist()
    [3, 7]
    >>> count_attention_blocks(seg, pos, cp=2, block_size=4, load_balance=True).tolist()
    [5, 5]
    """
    seg_BT = np.atleast_2d(np.asarray(segment_ids))
    pos_BT = np.atleast_2d(np.asarray(position_ids))
    if seg_BT.shape != pos_BT.shape or seg_BT.ndim != 2:
        raise ConfigError(
            f"segment_ids {seg_BT.shape} and position_ids {pos_BT.shape} must both be [T] or [B, T]; "
            "pass arrays of the same shape."
        )
    local_len = seg_BT.shape[1] // required_multiple(cp, False)
    check_seq_len(seg_BT.shape[1], cp, load_balance)
    if block_size < 1 or local_len % block_size:
        raise ConfigError(
            f"block_size={block_size} must divide the per-rank length T/cp={local_len}; pick a divisor of {local_len}."
        )
    perm = cp_permutation(seg_BT.shape[1], cp, load_balance)
    pairs = np.zeros((seg_BT.shape[1] // block_size,) * 2, dtype=bool)
    for seg_T, pos_T in zip(seg_BT, pos_BT):
        pairs |= _nonempty_block_pairs(seg_T[perm], pos_T[perm], block_size)
    per_query_block = pairs.sum(axis=1)
    return per_query_block.reshape(cp, -1).sum(axis=1).astype(np.int64)


def imbalance(counts: np.ndarray) -> float:
    """``max / mean`` of per-rank work: 1.0 is perfect balance."""
    counts = np.asarray(counts, dtype=np.float64)
    return float(counts.max() / counts.mean()) if counts.mean() > 0 else 1.0
