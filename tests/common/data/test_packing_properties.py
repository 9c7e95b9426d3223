"""Property tests of packing: no token lost or repeated, rows within bounds, exact BFD.

Token values are unique running ids, so every packed token can be traced to exactly one
position of one source example.
"""

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from twinseq.common.data.batching import collate
from twinseq.common.data.packing import pack_dataset, plan_packing

SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def instances(draw, max_seq_length=16, max_examples=40):
    """(seq_length, lengths) with lengths 0, 1, seq_length, seq_length + 1 and far beyond."""
    seq_length = draw(st.integers(1, max_seq_length))
    special = st.sampled_from([0, 1, seq_length, seq_length + 1, 2 * seq_length])
    length = st.one_of(special, st.integers(0, 3 * seq_length))
    lengths = draw(st.lists(length, min_size=1, max_size=max_examples))
    return seq_length, lengths


def make_examples(lengths):
    """input_ids are unique running ids; attention_mask/labels are derived, to check alignment."""
    ends = np.cumsum(lengths)
    ids = [list(range(int(e - n), int(e))) for n, e in zip(lengths, ends)]
    return {"input_ids": ids, "labels": [[-t for t in row] for row in ids],
            "attention_mask": [[t % 2 for t in row] for row in ids]}


def reference_bfd(lengths, seq_length):
    """Plain best-fit-decreasing: longest first (ties by index); the open bin with the least
    room that fits, ties to the bin that reached that room first; else a new bin."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins, room, since = [], [], []
    for tick, i in enumerate(order):
        fits = [b for b in range(len(bins)) if room[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (room[b], since[b]))
        else:
            bins.append([]), room.append(seq_length), since.append(tick)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= lengths[i]
        since[b] = tick
    return bins


def check_common(packed, examples, seq_length):
    """Invariants of every strategy; returns the fragments as (source, offset, tokens)."""
    fragments = []
    for r, row in enumerate(packed["input_ids"]):
        seq_lengths = packed["seq_lengths"][r]
        assert 0 < len(row) <= seq_length
        assert sum(seq_lengths) == len(row) and min(seq_lengths) >= 1
        assert len(seq_lengths) == len(packed["source_indices"][r]) == len(packed["source_offsets"][r])
        for name in ("labels", "attention_mask"):
            assert len(packed[name][r]) == len(row)
        start = 0
        for n, src, off in zip(seq_lengths, packed["source_indices"][r], packed["source_offsets"][r]):
            for name in ("input_ids", "labels", "attention_mask"):
                assert packed[name][r][start:start + n] == examples[name][src][off:off + n]
            fragments.append((src, off, n))
            start += n
    return fragments


def assert_tiles_every_example(fragments, lengths):
    """Fragments of each example cover [0, len) exactly once: no token lost or repeated."""
    by_source = {}
    for src, off, n in fragments:
        by_source.setdefault(src, []).append((off, n))
    assert set(by_source) == {i for i, n in enumerate(lengths) if n > 0}
    for src, pieces in by_source.items():
        pos = 0
        for off, n in sorted(pieces):
            assert off == pos
            pos += n
        assert pos == lengths[src]


@SETTINGS
@given(instances())
def test_bfd_split_keeps_every_token_once(instance):
    seq_length, lengths = instance
    examples = make_examples(lengths)
    packed, stats = pack_dataset(examples, seq_length, "bfd_split", return_source=True, return_stats=True)
    fragments = check_common(packed, examples, seq_length)
    assert_tiles_every_example(fragments, lengths)
    assert sorted(t for row in packed["input_ids"] for t in row) == list(range(sum(lengths)))
    # Fragments are the seq_length-sized pieces of each example, in order.
    assert all(off % seq_length == 0 and n == min(seq_length, lengths[src] - off) for src, off, n in fragments)
    assert stats.num_tokens_dropped == 0 and stats.num_tokens_kept == sum(lengths)
    assert stats.num_split_examples == sum(n > seq_length for n in lengths)


@SETTINGS
@given(instances())
def test_wrapped_keeps_every_token_once_in_order(instance):
    seq_length, lengths = instance
    examples = make_examples(lengths)
    packed, stats = pack_dataset(examples, seq_length, "wrapped", return_source=True, return_stats=True)
    fragments = check_common(packed, examples, seq_length)
    assert_tiles_every_example(fragments, lengths)
    assert [t for row in packed["input_ids"] for t in row] == list(range(sum(lengths)))
    assert all(len(row) == seq_length for row in packed["input_ids"][:-1])
    assert stats.num_rows == stats.lower_bound_rows == -(-sum(lengths) // seq_length)


@SETTINGS
@given(instances())
def test_bfd_drops_exactly_the_overflow(instance):
    seq_length, lengths = instance
    examples = make_examples(lengths)
    packed, stats = pack_dataset(examples, seq_length, "bfd", return_source=True, return_stats=True)
    fragments = check_common(packed, examples, seq_length)
    assert sorted(src for src, _, _ in fragments) == [i for i, n in enumerate(lengths) if n > 0]
    assert all(off == 0 and n == min(lengths[src], seq_length) for src, off, n in fragments)
    overflow = sum(max(n - seq_length, 0) for n in lengths)
    assert stats.num_tokens_dropped == overflow
    assert stats.num_tokens_kept == sum(len(row) for row in packed["input_ids"]) == sum(lengths) - overflow
    assert stats.num_truncated_examples == sum(n > seq_length for n in lengths)
    assert stats.num_empty_examples == lengths.count(0) and stats.num_examples == len(lengths)


@st.composite
def tie_heavy_instances(draw):
    """Few distinct lengths and many items, so bins often share a capacity (FIFO ties matter)."""
    seq_length = draw(st.integers(2, 24))
    long = draw(st.lists(st.integers(seq_length // 2 + 1, seq_length), min_size=1, max_size=6))
    short = draw(st.lists(st.integers(1, max(seq_length // 2, 1)), min_size=1, max_size=3)) + [1]
    lengths = long + draw(st.lists(st.sampled_from(short), min_size=1, max_size=100))
    return seq_length, lengths


@SETTINGS
@given(st.one_of(instances(max_examples=60), tie_heavy_instances()), st.sampled_from(["bfd", "bfd_split"]))
@example((20, [16, 13, 3, 3, 3, 1, 1]), "bfd")  # two bins reach room 1 in one step: FIFO decides
def test_bins_equal_plain_best_fit_decreasing(instance, strategy):
    seq_length, lengths = instance
    plan = plan_packing(lengths, seq_length, strategy)
    fragments = sorted(zip(plan.source_indices.tolist(), plan.source_offsets.tolist(), plan.fragment_lengths.tolist()))
    fragment_ids = {(s, o): f for f, (s, o, _) in enumerate(fragments)}
    got = [[fragment_ids[(s, o)] for s, o in zip(plan.source_indices[a:b].tolist(), plan.source_offsets[a:b].tolist())]
           for a, b in zip(plan.row_offsets[:-1], plan.row_offsets[1:])]
    assert got == reference_bfd([n for _, _, n in fragments], seq_length)


@SETTINGS
@given(instances(), st.sampled_from(["bfd", "bfd_split", "wrapped"]), st.integers(1, 12))
def test_window_packs_each_window_on_its_own(instance, strategy, window):
    seq_length, lengths = instance
    plan = plan_packing(lengths, seq_length, strategy, window=window)
    rows, sources = [], []
    for start in range(0, len(lengths), window):
        part = plan_packing(lengths[start:start + window], seq_length, strategy)
        rows += part.seq_lengths()
        sources += (part.source_indices + start).tolist()
    assert plan.seq_lengths() == rows and plan.source_indices.tolist() == sources
    for a, b in zip(plan.row_offsets[:-1], plan.row_offsets[1:]):
        assert len(set(plan.source_indices[a:b] // window)) <= 1


@SETTINGS
@given(instances(), st.sampled_from(["bfd", "bfd_split", "wrapped"]))
def test_plan_materialize_equals_pack_dataset(instance, strategy):
    seq_length, lengths = instance
    examples = make_examples(lengths)
    packed = pack_dataset(examples, seq_length, strategy, return_source=True)
    plan = plan_packing(lengths, seq_length, strategy)
    values, token_offsets = plan.materialize(np.arange(sum(lengths)), np.concatenate([[0], np.cumsum(lengths)]))
    assert [values[a:b].tolist() for a, b in zip(token_offsets[:-1], token_offsets[1:])] == packed["input_ids"]
    assert plan.seq_lengths() == packed["seq_lengths"]
    assert plan.row_lengths().tolist() == [len(row) for row in packed["input_ids"]]


@SETTINGS
@given(instances(), st.sampled_from(["bfd", "bfd_split", "wrapped"]), st.booleans())
def test_collated_rows_restart_positions_and_keep_segments_contiguous(instance, strategy, padding_free):
    seq_length, lengths = instance
    if not sum(lengths):
        return  # nothing to collate
    examples = make_examples(lengths)
    packed = pack_dataset(examples, seq_length, strategy, return_source=True)
    rows = [{"input_ids": ids, "seq_lengths": sl} for ids, sl in zip(packed["input_ids"], packed["seq_lengths"])]
    batch = collate(rows, padding_free=padding_free)
    docs = [n for sl in packed["seq_lengths"] for n in sl]
    assert np.diff(batch.cu_seqlens).tolist() == docs
    for r in range(batch.input_ids.shape[0]):
        seg, pos = batch.segment_ids[r], batch.position_ids[r]
        used = seg != 0
        segments = seg[used]
        # Segments are 1..k, each one contiguous run; positions restart at 0 in each.
        assert segments[0] == 1 and np.all(np.diff(segments) >= 0) and np.all(np.diff(segments) <= 1)
        for s in np.unique(segments):
            assert pos[seg == s].tolist() == list(range(int((seg == s).sum())))
    # Each document's tokens are one fragment of one source example.
    expected = [examples["input_ids"][src][off:off + n]
                for r in range(len(packed["input_ids"]))
                for src, off, n in zip(packed["source_indices"][r], packed["source_offsets"][r],
                                       packed["seq_lengths"][r])]
    flat_ids = batch.input_ids[batch.segment_ids != 0]
    assert [c.tolist() for c in np.split(flat_ids, batch.cu_seqlens[1:-1])] == expected


@SETTINGS
@given(st.lists(st.integers(0, 5000), min_size=1, max_size=300), st.sampled_from([64, 100, 2048]))
def test_rows_respect_the_first_fit_bound(lengths, seq_length):
    """Any BFD packing leaves at most one row at most half full, so rows <= 2 * lower bound + 1."""
    plan = plan_packing(lengths, seq_length, "bfd_split")
    row_lengths = plan.row_lengths()
    assert row_lengths.max(initial=0) <= seq_length
    assert (row_lengths <= seq_length // 2).sum() <= 1
    assert plan.num_rows <= 2 * plan.stats.lower_bound_rows + 1


def test_bins_equal_plain_best_fit_decreasing_on_a_seeded_sweep():
    """Equal-capacity ties decide bins only in specific shapes (long items, then many copies of
    a few short lengths); hypothesis rarely draws them, so sweep 1000 seeded instances too."""
    rng = np.random.default_rng(0)
    for _ in range(1000):
        seq_length = int(rng.integers(2, 25))
        long = rng.integers(seq_length // 2 + 1, seq_length + 1, rng.integers(1, 7)).tolist()
        short = rng.integers(1, seq_length // 2 + 1, rng.integers(1, 4)).tolist() + [1]
        lengths = long + rng.choice(short, rng.integers(1, 101)).tolist()
        plan = plan_packing(lengths, seq_length, "bfd")
        got = [plan.source_indices[a:b].tolist() for a, b in zip(plan.row_offsets[:-1], plan.row_offsets[1:])]
        assert got == reference_bfd(lengths, seq_length), (seq_length, lengths)
