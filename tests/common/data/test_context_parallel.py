"""Context-parallel sequence sharding (numpy): zigzag layout, round trips, label shift, block counts."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinseq.common.data.batching import IGNORE_INDEX, collate
from twinseq.common.data.context_parallel import (
    check_seq_len,
    count_attention_blocks,
    cp_permutation,
    imbalance,
    inverse_permutation,
    required_multiple,
    shard_batch,
    shard_sequence,
    split_shards,
    unshard_sequence,
    zigzag_chunks,
)
from twinseq.common.objectives.nll import shift_labels


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_zigzag_chunks_pair_an_early_and_a_late_chunk(cp):
    held = [zigzag_chunks(cp, r) for r in range(cp)]
    assert sorted(c for pair in held for c in pair) == list(range(2 * cp))  # a partition of the chunks
    for r, (early, late) in enumerate(held):
        assert early == r and late == 2 * cp - 1 - r
        assert early < cp <= late  # one from each half: equal causal work
        assert early + late == 2 * cp - 1


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_rank_shard_is_its_two_chunks_in_order(cp):
    seq_len = 2 * cp * 3
    chunks_CL = np.arange(seq_len).reshape(2 * cp, 3)
    shards = split_shards(shard_sequence(np.arange(seq_len), cp), cp)
    for r, shard in enumerate(shards):
        early, late = zigzag_chunks(cp, r)
        np.testing.assert_array_equal(shard, np.concatenate([chunks_CL[early], chunks_CL[late]]))


def test_without_load_balance_shards_are_contiguous():
    np.testing.assert_array_equal(cp_permutation(12, 4, load_balance=False), np.arange(12))
    shards = split_shards(shard_sequence(np.arange(12), 4, load_balance=False), 4)
    np.testing.assert_array_equal(shards[2], [6, 7, 8])


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 8), chunk=st.integers(1, 5), rows=st.integers(1, 3), load_balance=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_shard_then_unshard_is_identity(cp, chunk, rows, load_balance, seed):
    seq_len = 2 * cp * chunk
    x_BTH = np.random.default_rng(seed).integers(0, 1000, size=(rows, seq_len, 2))
    reordered = shard_sequence(x_BTH, cp, load_balance, axis=1)
    assert sorted(reordered.ravel().tolist()) == sorted(x_BTH.ravel().tolist())  # nothing lost or duplicated
    np.testing.assert_array_equal(unshard_sequence(reordered, cp, load_balance, axis=1), x_BTH)
    shards = split_shards(reordered, cp, axis=1)
    assert all(s.shape == (rows, seq_len // cp, 2) for s in shards)
    np.testing.assert_array_equal(unshard_sequence(shards, cp, load_balance, axis=1), x_BTH)
    perm = cp_permutation(seq_len, cp, load_balance)
    np.testing.assert_array_equal(perm[inverse_permutation(perm)], np.arange(seq_len))


def _packed_batch(lengths, multiple, seed=0):
    rng = np.random.default_rng(seed)
    examples = [{"input_ids": rng.integers(1, 500, size=n).tolist()} for n in lengths]
    return collate(examples, padding_free=True, pad_to_multiple_of=multiple)


@settings(max_examples=60, deadline=None)
@given(cp=st.integers(1, 8), lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8),
       load_balance=st.booleans())
def test_shift_before_reorder_keeps_every_target(cp, lengths, load_balance):
    batch = _packed_batch(lengths, required_multiple(cp, load_balance))
    cp_batch = shard_batch(batch, cp, load_balance)
    expected_BT = shift_labels(batch.labels)
    # Every (input token, target) pair of the unsharded shifted loss is on exactly one rank.
    pairs = sorted((tok, tgt) for r in range(cp) for tok, tgt in
                   zip(cp_batch.rank(r)["input_ids"].ravel(), cp_batch.rank(r)["targets"].ravel()))
    assert pairs == sorted(zip(batch.input_ids.ravel(), expected_BT.ravel()))
    np.testing.assert_array_equal(cp_batch.unshard(cp_batch.targets), expected_BT)
    num_targets = int((cp_batch.targets != IGNORE_INDEX).sum())
    assert num_targets == int((expected_BT != IGNORE_INDEX).sum()) == batch.num_items_in_batch
    for name in ("input_ids", "position_ids", "segment_ids"):
        np.testing.assert_array_equal(cp_batch.unshard(getattr(cp_batch, name)), getattr(batch, name))


def test_shifting_after_the_reorder_would_break_targets():
    """Why the shift comes first: shifting the reordered row pairs tokens with wrong targets."""
    batch = _packed_batch([5, 11], multiple=8)
    wrong_BT = unshard_sequence(shift_labels(shard_sequence(batch.labels, 2, axis=1)), 2, axis=1)
    assert not np.array_equal(wrong_BT, shift_labels(batch.labels))
    np.testing.assert_array_equal(shard_batch(batch, cp=2).unshard(shard_batch(batch, cp=2).targets),
                                  shift_labels(batch.labels))


def test_collate_with_pad_to_multiple_of_2cp_feeds_shard_batch():
    batch = _packed_batch([7, 3, 12], multiple=2 * 4)
    assert batch.input_ids.shape[1] % 8 == 0
    ranks = [shard_batch(batch, cp=4).rank(r) for r in range(4)]
    assert all(r["segment_ids"].shape == (1, batch.input_ids.shape[1] // 4) for r in ranks)


def test_unpadded_sequence_raises_with_the_fix():
    with pytest.raises(ValueError, match=r"T=12 .*cp=4.*--pad-to-multiple-of 8"):
        check_seq_len(12, 4)
    with pytest.raises(ValueError, match=r"T=10 .*--pad-to-multiple-of 4"):
        shard_batch(_packed_batch([10], multiple=None), cp=2)
    check_seq_len(12, 4, load_balance=False)  # contiguous shards only need a multiple of cp


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match=r"cp=0 must be a positive integer"):
        shard_sequence(np.arange(8), cp=0)
    with pytest.raises(ValueError, match=r"rank=2 is outside \[0, cp=2\)"):
        shard_batch(_packed_batch([8], multiple=4), cp=2).rank(2)
    with pytest.raises(ValueError, match=r"got 3 shards for cp=2"):
        unshard_sequence([np.arange(2)] * 3, cp=2)
    with pytest.raises(ValueError, match=r"block_size=3 must divide"):
        count_attention_blocks(np.ones(16), np.arange(16), cp=2, block_size=3)


def _brute_force_counts(seg_BT, pos_BT, cp, block_size, load_balance):
    perm = cp_permutation(seg_BT.shape[1], cp, load_balance)
    seg, pos = seg_BT[:, perm], pos_BT[:, perm]
    allowed_BTT = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0) & (pos[:, None, :] <= pos[:, :, None])
    nb = seg.shape[1] // block_size
    blocks = allowed_BTT.any(axis=0).reshape(nb, block_size, nb, block_size).any(axis=(1, 3))
    return blocks.sum(axis=1).reshape(cp, -1).sum(axis=1)


@settings(max_examples=60, deadline=None)
@given(cp=st.sampled_from([1, 2, 4]), lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6),
       rows=st.integers(1, 2), load_balance=st.booleans(), split=st.sampled_from([1, 2]))
def test_block_counter_matches_the_dense_mask(cp, lengths, rows, load_balance, split):
    batches = [_packed_batch(lengths[r:] or lengths, multiple=4 * 2 * cp) for r in range(rows)]
    width = max(b.input_ids.shape[1] for b in batches)
    seg_BT = np.zeros((rows, width), np.int32)
    pos_BT = np.zeros((rows, width), np.int32)
    for r, b in enumerate(batches):
        seg_BT[r, :b.input_ids.shape[1]], pos_BT[r, :b.input_ids.shape[1]] = b.segment_ids[0], b.position_ids[0]
    block_size = width // cp // split
    got = count_attention_blocks(seg_BT, pos_BT, cp, block_size, load_balance)
    np.testing.assert_array_equal(got, _brute_force_counts(seg_BT, pos_BT, cp, block_size, load_balance))


def test_causal_block_counts_balance_only_with_zigzag():
    seq_len, cp = 16384, 8
    seg, pos = np.ones(seq_len, np.int32), np.arange(seq_len)
    chunk = seq_len // (2 * cp)
    balanced = count_attention_blocks(seg, pos, cp, chunk, load_balance=True)
    contiguous = count_attention_blocks(seg, pos, cp, chunk, load_balance=False)
    # Chunk c sees c + 1 chunks: rank r does (r + 1) + (2cp - r) = 2cp + 1 with zigzag, 4r + 3 without.
    np.testing.assert_array_equal(balanced, np.full(cp, 2 * cp + 1))
    np.testing.assert_array_equal(contiguous, 4 * np.arange(cp) + 3)
    assert imbalance(balanced) == 1.0
    assert imbalance(contiguous) == pytest.approx(31 / 17)
    assert balanced.sum() == contiguous.sum()


def test_fully_padded_row_has_no_blocks():
    assert count_attention_blocks(np.zeros(16, np.int32), np.zeros(16), cp=2, block_size=2).tolist() == [0, 0]


def test_module_imports_without_torch_or_jax():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'jax', 'jaxlib', 'flax', 'optax'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import twinseq.common.data.context_parallel\n")
    subprocess.run([sys.executable, "-c", code], check=True)
