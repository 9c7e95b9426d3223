"""Packing plans: which tokens of which example go into which packed row.

A plan is computed from example lengths alone (numpy, no data), so it is cheap to
build, easy to test, and lets a collator gather rows lazily instead of rewriting the
dataset. ``twinseq.common.data.packing.pack_dataset`` materialises a plan into a dataset.

A plan is a list of *fragments* in row-major order. Fragment ``f`` is the token range
``[source_offsets[f], source_offsets[f] + fragment_lengths[f])`` of example
``source_indices[f]``, and row ``r`` holds fragments ``row_offsets[r]:row_offsets[r+1]``.
Every fragment is its own document in the packed row (``seq_lengths``), so positions
restart at each fragment.

Strategies (ANCHORS item 5: both overflow semantics exist, with distinct names):

- ``"bfd"``: best-fit-decreasing over whole examples; an example longer than
  ``seq_length`` is **truncated** to its first ``seq_length`` tokens and the rest is
  dropped (counted in ``PackingStats.num_tokens_dropped``).
- ``"bfd_split"``: every example is **split** into fragments of ``seq_length`` tokens
  (the last one shorter) and all fragments are binned by best-fit-decreasing. No token
  is lost, but one target per cut is (see below).
- ``"wrapped"``: all examples are concatenated in order and cut into rows of
  ``seq_length`` tokens; documents are cut at row borders. No token is lost or repeated,
  but one target per cut is.

Keeping every token is not keeping every target. A continuation fragment is a new
document in its row, and the collator gives a document's first token the label -100
(``twinseq.common.data.batching``), so the prediction across the cut (last token of piece k
-> first token of piece k+1) is gone: each cut loses the target at the cut's first token,
if that token was a target (a cut inside a masked prompt loses nothing).
``PackingStats.num_cuts`` and ``num_targets_lost`` count this.

Length-0 examples produce no fragment but are counted in ``PackingStats``.
"""

from __future__ import annotations

import bisect
import numbers
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from twinseq.common.errors import DataError, DataTypeError

STRATEGIES = ("bfd", "bfd_split", "wrapped")
_INT32_MAX = 2**31 - 1  # seq_lengths and list offsets are int32, as in TRL


# --------------------------------------------------------------------------- validation


def check_seq_length(seq_length) -> int:
    """Return ``seq_length`` as an int, or raise naming the value and the fix."""
    if isinstance(seq_length, (bool, np.bool_)) or not isinstance(seq_length, numbers.Integral):
        raise DataTypeError(
            f"seq_length={seq_length!r} ({type(seq_length).__name__}) must be a positive int; "
            f"pass an integer such as seq_length=2048."
        )
    if not 0 < int(seq_length) <= _INT32_MAX:
        raise DataError(
            f"seq_length={seq_length!r} must be a positive int no larger than {_INT32_MAX}; "
            f"pass the packed row length, e.g. seq_length=2048."
        )
    return int(seq_length)


def check_strategy(strategy) -> str:
    if strategy not in STRATEGIES:
        raise DataError(
            f"strategy={strategy!r} is not a packing strategy; choose one of {STRATEGIES} "
            f"('bfd' truncates overflow, 'bfd_split' splits it, 'wrapped' cuts documents)."
        )
    return strategy


def check_window(window) -> Optional[int]:
    if window is None:
        return None
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, numbers.Integral):
        raise DataTypeError(
            f"window={window!r} ({type(window).__name__}) must be a positive int (examples per "
            f"packing window) or None for one global window; pass one of those."
        )
    if int(window) <= 0:
        raise DataError(
            f"window={window!r} must be a positive number of examples per packing window: pass one, "
            f"or None to pack the whole dataset at once."
        )
    return int(window)


def check_lengths(lengths) -> np.ndarray:
    """Return ``lengths`` as an int64 vector of non-negative example lengths."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1:
        raise DataError(
            f"lengths must be a 1-D sequence of example lengths, got shape {lengths.shape}; "
            f"pass one length per example."
        )
    if lengths.size == 0:
        raise DataError(
            f"lengths is empty (shape {lengths.shape}): there are no examples to pack; check the dataset is not empty."
        )
    if lengths.dtype == np.bool_ or not np.issubdtype(lengths.dtype, np.integer):
        raise DataTypeError(
            f"lengths must hold integers, got dtype {lengths.dtype} (first value {lengths[0]!r}); "
            f"pass token counts, e.g. [len(ids) for ids in dataset['input_ids']]."
        )
    if lengths.min() < 0:
        i = int(np.argmin(lengths))
        raise DataError(f"lengths[{i}]={int(lengths[i])} is negative; pass token counts >= 0.")
    return lengths.astype(np.int64, copy=False)


# --------------------------------------------------------------------------- stats


@dataclass(frozen=True)
class PackingStats:
    """What a packing plan kept, dropped and how full its rows are.

    ``num_tokens_dropped`` is non-zero only for ``"bfd"`` (truncated overflow).
    ``lower_bound_rows`` is ``ceil(num_tokens_kept / seq_length)``: no packing of the
    kept tokens can use fewer rows.

    ``num_cuts`` is the number of places where an example was cut into two fragments
    (``num_fragments`` minus the non-empty examples); always 0 for ``"bfd"``.
    ``num_targets_lost`` is the number of loss targets (labels != -100 after
    ``collate``, the count the loss divides by) that the examples had before packing and
    the packed rows no longer have:

    - ``"bfd_split"``, ``"wrapped"``: one per cut whose first token was a target. Each
      continuation fragment starts a document, whose first label is -100.
    - ``"bfd"``: the targets among the dropped tokens.

    ``plan_packing`` sees lengths only, so it counts every token but an example's first
    as a target: exact for rows without ``labels`` or loss masks, an upper bound
    otherwise. ``pack_dataset`` recounts from the ``labels`` and mask columns.

    >>> stats = plan_packing([9, 3], seq_length=4, strategy="bfd_split").stats
    >>> stats.num_fragments, stats.num_cuts, stats.num_targets_lost
    (4, 2, 2)
    """

    strategy: str
    seq_length: int
    num_examples: int
    num_empty_examples: int
    num_tokens: int
    num_tokens_kept: int
    num_truncated_examples: int
    num_split_examples: int
    num_fragments: int
    num_rows: int
    num_targets_lost: int

    @property
    def num_tokens_dropped(self) -> int:
        return self.num_tokens - self.num_tokens_kept

    @property
    def num_cuts(self) -> int:
        # Each non-empty example has exactly one fragment at offset 0; every other one follows a cut.
        return self.num_fragments - (self.num_examples - self.num_empty_examples)

    @property
    def lower_bound_rows(self) -> int:
        return -(-self.num_tokens_kept // self.seq_length)

    @property
    def rows_over_lower_bound(self) -> float:
        """Fraction of rows above the lower bound (0.0001 means +0.01 %)."""
        return self.num_rows / self.lower_bound_rows - 1.0 if self.lower_bound_rows else 0.0

    @property
    def tokens_kept_fraction(self) -> float:
        return self.num_tokens_kept / self.num_tokens if self.num_tokens else 1.0

    @property
    def fill_fraction(self) -> float:
        """Kept tokens over row capacity ``num_rows * seq_length``."""
        return self.num_tokens_kept / (self.num_rows * self.seq_length) if self.num_rows else 1.0

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in (
            "num_tokens_dropped",
            "num_cuts",
            "lower_bound_rows",
            "rows_over_lower_bound",
            "tokens_kept_fraction",
            "fill_fraction",
        ):
            d[name] = getattr(self, name)
        return d

    def summary(self) -> str:
        return (
            f"{self.strategy}: {self.num_examples} examples ({self.num_empty_examples} empty) -> "
            f"{self.num_rows} rows of {self.seq_length} (lower bound {self.lower_bound_rows}, "
            f"+{100 * self.rows_over_lower_bound:.4f} %), kept {self.num_tokens_kept}/{self.num_tokens} tokens "
            f"({100 * self.tokens_kept_fraction:.2f} %), {self.num_truncated_examples} truncated, "
            f"{self.num_split_examples} split at {self.num_cuts} cuts, lost {self.num_targets_lost} loss "
            f"targets {'in the dropped tokens' if self.strategy == 'bfd' else 'at the cuts'}"
        )


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, eq=False)
class PackingPlan:
    """Fragments in row-major order; see the module docstring for the layout.

    >>> plan = plan_packing([5, 2, 3, 1], seq_length=4, strategy="bfd_split")
    >>> plan.seq_lengths()
    [[4], [3, 1], [2, 1]]
    >>> plan.source_indices.tolist(), plan.source_offsets.tolist()
    ([0, 2, 0, 1, 3], [0, 0, 4, 0, 0])
    >>> values, token_offsets = plan.materialize(np.arange(1, 12), np.array([0, 5, 7, 10, 11]))
    >>> np.split(values, token_offsets[1:-1])
    [array([1, 2, 3, 4]), array([ 8,  9, 10,  5]), array([ 6,  7, 11])]
    """

    seq_length: int
    strategy: str
    source_indices: np.ndarray  # int64 [F]: example each fragment comes from
    source_offsets: np.ndarray  # int64 [F]: first token of the fragment within its example
    fragment_lengths: np.ndarray  # int64 [F]: tokens in the fragment (>= 1)
    row_offsets: np.ndarray  # int64 [R + 1]: row r holds fragments row_offsets[r]:row_offsets[r+1]
    stats: PackingStats

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    @property
    def num_fragments(self) -> int:
        return len(self.fragment_lengths)

    def row_lengths(self) -> np.ndarray:
        """int64 [R]: tokens per packed row."""
        csum = np.concatenate([[0], np.cumsum(self.fragment_lengths)])
        return np.diff(csum[self.row_offsets])

    def token_offsets(self) -> np.ndarray:
        """int64 [R + 1]: row r is tokens ``token_offsets[r]:token_offsets[r+1]`` of the packed values."""
        return np.concatenate([[0], np.cumsum(self.fragment_lengths)])[self.row_offsets]

    def seq_lengths(self) -> list[list[int]]:
        """Fragment lengths per row, as in the ``seq_lengths`` column (Python lists; small plans)."""
        return [self.fragment_lengths[a:b].tolist() for a, b in zip(self.row_offsets[:-1], self.row_offsets[1:])]

    def select(self, rows: Sequence[int]) -> "PackingPlan":
        """The plan of ``rows`` only (in the given order); sources keep their indices."""
        row_ids = np.asarray(rows, dtype=np.int64).reshape(-1)
        if row_ids.size and (row_ids.min() < -self.num_rows or row_ids.max() >= self.num_rows):
            raise DataError(
                f"rows {row_ids.tolist()[:8]} out of range for a plan of {self.num_rows} rows; select rows in "
                f"[0, {self.num_rows})."
            )
        row_ids = row_ids % max(self.num_rows, 1)
        starts, ends = self.row_offsets[row_ids], self.row_offsets[row_ids + 1]
        counts = ends - starts
        frag = _ranges(starts, counts)
        return PackingPlan(
            self.seq_length,
            self.strategy,
            self.source_indices[frag],
            self.source_offsets[frag],
            self.fragment_lengths[frag],
            np.concatenate([[0], np.cumsum(counts)]),
            self.stats,
        )

    def fragment_starts(self, example_offsets: np.ndarray) -> np.ndarray:
        """int64 [F]: absolute start of each fragment in values laid out by ``example_offsets`` [N+1]."""
        example_offsets = np.asarray(example_offsets, dtype=np.int64)
        if example_offsets.ndim != 1 or len(example_offsets) < 2:
            raise DataError(
                f"example_offsets must be a 1-D [num_examples + 1] offsets array, got shape {example_offsets.shape}; "
                "pass np.concatenate([[0], np.cumsum(lengths)])."
            )
        num_examples = len(example_offsets) - 1
        if self.num_fragments and int(self.source_indices.max()) >= num_examples:
            raise DataError(
                f"the plan reads example {int(self.source_indices.max())} but the arrays hold "
                f"{num_examples} examples; materialise the plan with the arrays it was planned for."
            )
        example_len = np.diff(example_offsets)[self.source_indices]
        bad = np.flatnonzero(self.source_offsets + self.fragment_lengths > example_len)
        if bad.size:
            f = int(bad[0])
            raise DataError(
                f"fragment {f} needs tokens {int(self.source_offsets[f])}.."
                f"{int(self.source_offsets[f] + self.fragment_lengths[f])} of example "
                f"{int(self.source_indices[f])}, which has {int(example_len[f])}; the arrays do not "
                f"match the lengths this plan was made from: pass those arrays."
            )
        return example_offsets[self.source_indices] + self.source_offsets

    def materialize(self, values: np.ndarray, example_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Gather packed rows from flat numpy ``values`` laid out by ``example_offsets``.

        Returns ``(packed_values, token_offsets)``: row r is
        ``packed_values[token_offsets[r]:token_offsets[r+1]]``. Uses a per-token index;
        ``materialize_arrow`` is the fast path for large data.
        """
        starts = self.fragment_starts(example_offsets)
        values = np.asarray(values)
        index = _ranges(starts, self.fragment_lengths)
        return values[index], self.token_offsets()

    def materialize_arrow(self, column, list_type: Optional[pa.DataType] = None) -> pa.Array:
        """Pack a list column (``pa.ListArray``/``LargeListArray``, or chunked) into one list per row.

        Copies each fragment with one memcpy-like step (Arrow list views), no per-token
        index. The result has ``list_type`` (default: the column's own list type).
        """
        values, example_offsets = flat_list_values(column)
        starts = self.fragment_starts(example_offsets)
        view = pa.LargeListViewArray.from_arrays(
            pa.array(starts, pa.int64()), pa.array(self.fragment_lengths, pa.int64()), values
        )
        flat = pc.list_flatten(view)
        list_type = list_type or column.type
        offsets = self.token_offsets()
        if pa.types.is_list(list_type):
            if offsets[-1] > _INT32_MAX:
                raise DataError(
                    f"{int(offsets[-1])} packed values do not fit the int32 offsets of {list_type}; "
                    f"cast the column to a large_list first."
                )
            return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), flat, type=list_type)
        return pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), flat, type=list_type)


def flat_list_values(column) -> tuple[pa.Array, np.ndarray]:
    """``(values, example_offsets)`` of a list column; zero-copy for a single chunk."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    if not chunks:
        return pa.array([], column.type.value_type), np.zeros(1, dtype=np.int64)
    if len(chunks) == 1:
        return chunks[0].values, chunks[0].offsets.to_numpy().astype(np.int64, copy=False)
    # Several chunks have several value buffers; one copy gives list views a single buffer.
    flats = [c.flatten() for c in chunks]
    lengths = np.concatenate([pc.list_value_length(c).fill_null(0).to_numpy(zero_copy_only=False) for c in chunks])
    return pa.concat_arrays(flats), np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + c)`` for each pair, without a Python loop."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    out_starts = np.cumsum(counts) - counts
    return np.repeat(np.asarray(starts, dtype=np.int64) - out_starts, counts) + np.arange(total, dtype=np.int64)


# --------------------------------------------------------------------------- planning


def plan_packing(lengths, seq_length: int, strategy: str = "bfd", *, window: Optional[int] = None) -> PackingPlan:
    """Plan the packing of examples with the given token ``lengths`` into rows of ``seq_length``.

    ``lengths``: one non-negative int per example. ``window``: pack each run of
    ``window`` consecutive examples on its own (for streams); ``None`` packs globally.
    Best-fit-decreasing is exact (see ``_BestFitDecreasing``), and with a window it
    matches TRL's ``pack_dataset`` with ``map_kwargs={"batch_size": window}``.

    >>> plan = plan_packing([5, 2, 3, 1, 0], seq_length=4, strategy="bfd")
    >>> plan.seq_lengths(), plan.source_indices.tolist()
    ([[4], [3, 1], [2]], [0, 2, 3, 1])
    >>> plan.stats.num_tokens_dropped, plan.stats.num_empty_examples
    (1, 1)
    >>> plan_packing([5, 2, 3, 1], seq_length=4, strategy="wrapped").seq_lengths()
    [[4], [1, 2, 1], [2, 1]]
    """
    lengths = check_lengths(lengths)
    seq_length = check_seq_length(seq_length)
    check_strategy(strategy)
    window = check_window(window)
    bounds = np.arange(0, len(lengths), window or len(lengths)).tolist() + [len(lengths)]
    pieces = [_plan_window(lengths[a:b], seq_length, strategy) for a, b in zip(bounds[:-1], bounds[1:])]
    if len(pieces) == 1:
        src, off, frag_len, row_offsets = pieces[0]
    else:
        src = np.concatenate([p[0] + a for p, a in zip(pieces, bounds)])
        off, frag_len = (np.concatenate([p[i] for p in pieces]) for i in (1, 2))
        row_counts = np.concatenate([np.diff(p[3]) for p in pieces])
        row_offsets = np.concatenate([[0], np.cumsum(row_counts)]).astype(np.int64)
    stats = _stats(lengths, seq_length, strategy, src, frag_len, len(row_offsets) - 1)
    return PackingPlan(seq_length, strategy, src, off, frag_len, row_offsets, stats)


def _plan_window(lengths: np.ndarray, seq_length: int, strategy: str):
    """(source_indices, source_offsets, fragment_lengths, row_offsets) for one window."""
    if strategy == "wrapped":
        return _wrapped(lengths, seq_length)
    src, off, frag_len = _bfd_fragments(lengths, seq_length, split=strategy == "bfd_split")
    order, row_offsets = _BestFitDecreasing(frag_len, seq_length).run()
    if strategy == "bfd":
        # Offsets are all 0, and with no empty example source i is fragment i.
        src = order if len(src) == len(lengths) else src[order]
        return src, np.zeros(len(order), dtype=np.int64), frag_len[order], row_offsets
    return src[order], off[order], frag_len[order], row_offsets


def _bfd_fragments(lengths: np.ndarray, seq_length: int, split: bool):
    """Fragments in source order: one truncated fragment per example, or ceil(len/S) pieces."""
    if not split:
        src = np.flatnonzero(lengths)
        return src, np.zeros(len(src), dtype=np.int64), np.minimum(lengths[src], seq_length)
    num_pieces = -(-lengths // seq_length)
    src = np.repeat(np.arange(len(lengths), dtype=np.int64), num_pieces)
    piece = np.arange(len(src), dtype=np.int64) - np.repeat(np.cumsum(num_pieces) - num_pieces, num_pieces)
    off = piece * seq_length
    return src, off, np.minimum(lengths[src] - off, seq_length)


def _wrapped(lengths: np.ndarray, seq_length: int):
    """Concatenate, cut every ``seq_length`` tokens; a fragment is a document's part in one row."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    nonempty = lengths > 0
    first_row = starts // seq_length
    last_row = np.where(nonempty, (ends - 1) // seq_length, first_row - 1)
    num_pieces = last_row - first_row + 1
    src = np.repeat(np.arange(len(lengths), dtype=np.int64), num_pieces)
    piece = np.arange(len(src), dtype=np.int64) - np.repeat(np.cumsum(num_pieces) - num_pieces, num_pieces)
    row = first_row[src] + piece
    begin = np.maximum(starts[src], row * seq_length)
    end = np.minimum(ends[src], (row + 1) * seq_length)
    num_rows = -(-int(ends[-1]) // seq_length)
    row_offsets = np.searchsorted(row, np.arange(num_rows + 1), side="left").astype(np.int64)
    return src, begin - starts[src], end - begin, row_offsets


def _stats(lengths, seq_length, strategy, src, frag_len, num_rows) -> PackingStats:
    if strategy == "wrapped":
        # Wrapped fragments are in source order: a cut example is a run of equal sources.
        same = src[1:] == src[:-1]
        num_split = int((same & ~np.concatenate([[False], same[:-1]])).sum())
    else:
        num_split = int((lengths > seq_length).sum()) if strategy == "bfd_split" else 0
    return PackingStats(
        strategy=strategy,
        seq_length=seq_length,
        num_examples=len(lengths),
        num_empty_examples=int((lengths == 0).sum()),
        num_tokens=int(lengths.sum()),
        num_tokens_kept=int(frag_len.sum()),
        num_truncated_examples=int((lengths > seq_length).sum()) if strategy == "bfd" else 0,
        num_split_examples=num_split,
        num_fragments=len(frag_len),
        num_rows=int(num_rows),
        num_targets_lost=_targets_lost_by_lengths(lengths, seq_length, strategy, len(frag_len)),
    )


def _targets_lost_by_lengths(lengths, seq_length, strategy, num_fragments) -> int:
    """``num_targets_lost`` when every token but an example's first is a target (no labels known)."""
    if strategy == "bfd":
        # Dropped tokens sit at positions >= seq_length >= 1, never an example's first.
        return int(np.maximum(lengths - seq_length, 0).sum())
    return num_fragments - int((lengths > 0).sum())


class _BestFitDecreasing:
    """Exact best-fit-decreasing, one item length at a time instead of one item at a time.

    The sequential algorithm (TRL's, and the textbook one): sort items by length,
    longest first, ties by index; put each item in the open bin with the smallest
    remaining capacity that fits it, ties to the bin that reached that capacity first;
    open a new bin if none fits.

    Why whole lengths can be placed at once: let ``c`` be the smallest capacity >= L.
    After taking an item of length L the bin has ``c - L < c`` and no capacity lies in
    ``[L, c)``, so if ``c - L >= L`` the same bin is again the best fit. A bin at
    capacity ``c`` therefore takes ``c // L`` items in a row (or what is left) and ends
    at ``c % L``; bins are visited by increasing capacity, first-come first-served within
    one capacity (a FIFO queue of bin ids per capacity), then new bins take
    ``seq_length // L`` each. Items longer than ``seq_length / 2`` never share a bin with
    each other, so they each open one. The tests check the result is identical to a
    plain-Python BFD and to TRL's ``_pack_bfd``.

    ``run()`` returns ``(order, row_offsets)``: item indices bin by bin (bins in opening
    order, items in placement order) and the CSR offsets of the bins.
    """

    def __init__(self, lengths: np.ndarray, seq_length: int):
        assert lengths.size == 0 or (lengths.min() >= 1 and lengths.max() <= seq_length)
        self.lengths, self.seq_length = lengths, seq_length
        self.queues: dict[int, list[np.ndarray]] = {}  # capacity -> FIFO of arrays of bin ids
        self.queue_size: dict[int, int] = {}
        self.capacities: list[int] = []  # sorted capacities with a non-empty queue
        self.bin_of_sorted = np.empty(len(lengths), dtype=np.int64)
        self.num_placed = 0
        self.num_bins = 0

    def run(self) -> tuple[np.ndarray, np.ndarray]:
        S = self.seq_length
        # Decreasing length, ties by index: a stable sort of S - length (radix sort for uint16).
        key = (S - self.lengths).astype(np.uint16 if S < 2**16 else np.uint32)
        sorted_items = np.argsort(key, kind="stable")
        counts = np.bincount(self.lengths, minlength=S + 1)
        num_long = int(counts[S // 2 + 1 :].sum())
        self._open_singletons(S - self.lengths[sorted_items[:num_long]])
        for length in (np.flatnonzero(counts[1 : S // 2 + 1])[::-1] + 1).tolist():
            left = self._fill_open_bins(length, int(counts[length]))
            if left:
                self._open_bins(length, left)
        assert self.num_placed == len(self.lengths)
        bin_order = np.argsort(self.bin_of_sorted, kind="stable")
        sizes = np.bincount(self.bin_of_sorted, minlength=self.num_bins)
        return sorted_items[bin_order], np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def _push(self, capacity: int, bins: np.ndarray) -> None:
        if capacity == 0 or not len(bins):
            return  # a full bin takes nothing more
        if capacity not in self.queues:
            self.queues[capacity], self.queue_size[capacity] = [], 0
            bisect.insort(self.capacities, capacity)
        self.queues[capacity].append(bins)
        self.queue_size[capacity] += len(bins)

    def _pop(self, capacity: int, count: int) -> np.ndarray:
        """The first ``count`` bins of the queue; an emptied queue stays in ``capacities``."""
        queue = self.queues[capacity]
        bins = queue[0] if len(queue) == 1 else np.concatenate(queue)
        if count == len(bins):
            del self.queues[capacity], self.queue_size[capacity]
        else:
            self.queues[capacity], self.queue_size[capacity] = [bins[count:]], len(bins) - count
        return bins[:count]

    def _place(self, bins: np.ndarray, per_bin: int) -> None:
        """The next ``len(bins) * per_bin`` sorted items go ``per_bin`` to each bin, in order."""
        n = len(bins) * per_bin
        self.bin_of_sorted[self.num_placed : self.num_placed + n] = bins if per_bin == 1 else np.repeat(bins, per_bin)
        self.num_placed += n

    def _open_singletons(self, capacities: np.ndarray) -> None:
        """One new bin per long item; ``capacities`` is non-decreasing (items sorted by length)."""
        bins = np.arange(len(capacities), dtype=np.int64) + self.num_bins
        self._place(bins, 1)
        self.num_bins += len(bins)
        firsts = np.flatnonzero(np.diff(capacities, prepend=-1))
        ends = firsts[1:].tolist() + [len(bins)]
        for cap, a, b in zip(capacities[firsts].tolist(), firsts.tolist(), ends):
            self._push(cap, bins[a:b])

    def _fill_open_bins(self, length: int, count: int) -> int:
        """Place up to ``count`` items of ``length`` in open bins; return how many are left."""
        first = bisect.bisect_left(self.capacities, length)
        moves = []  # (new capacity, bins); applied after the scan so the scan sees no new queue
        j, left = first, count
        while left and j < len(self.capacities):
            cap = self.capacities[j]
            per_bin, num_bins = cap // length, self.queue_size[cap]
            if num_bins * per_bin <= left:
                bins = self._pop(cap, num_bins)
                self._place(bins, per_bin)
                moves.append((cap % length, bins))
                left -= num_bins * per_bin
                j += 1
                continue
            num_whole, rest = divmod(left, per_bin)
            bins = self._pop(cap, num_whole + (rest > 0))
            self._place(bins[:num_whole], per_bin)
            moves.append((cap % length, bins[:num_whole]))
            if rest:
                # Its new capacity is in [length, cap): every queue there was just emptied.
                assert cap - rest * length not in self.queues
                self._place(bins[num_whole:], rest)
                moves.append((cap - rest * length, bins[num_whole:]))
            j += cap not in self.queues
            left = 0
        del self.capacities[first:j]
        for cap, bins in moves:
            self._push(cap, bins)
        return left

    def _open_bins(self, length: int, count: int) -> None:
        per_bin = self.seq_length // length
        num_whole, rest = divmod(count, per_bin)
        bins = np.arange(num_whole + (rest > 0), dtype=np.int64) + self.num_bins
        self.num_bins += len(bins)
        self._place(bins[:num_whole], per_bin)
        self._push(self.seq_length - per_bin * length, bins[:num_whole])
        if rest:
            self._place(bins[num_whole:], rest)
            self._push(self.seq_length - rest * length, bins[num_whole:])
