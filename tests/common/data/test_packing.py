"""pack_dataset and plan_packing: TRL parity, datasets layouts, stats, logging, speed-free bounds."""

import doctest
import logging
import subprocess
import sys

import datasets
import numpy as np
import pyarrow as pa
import pytest

from twinseq.common.data import packing
from twinseq.common.data import packing_plan
from twinseq.common.data.batching import collate
from twinseq.common.data.packing import gather_rows, pack_dataset, plan_packing

datasets.disable_progress_bars()
STRATEGIES = ("bfd", "bfd_split", "wrapped")


def anchors_lengths(n):
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(mean=5.5, sigma=1.0, size=n), 1, 16384).astype(int)


def random_dataset(num_examples=400, max_len=40, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, num_examples)
    ids = [rng.integers(0, 1000, n).tolist() for n in lengths]
    return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * n for n in lengths],
                                       "labels": [[-t for t in row] for row in ids]})


def without_seq_lengths(d):
    return {k: v for k, v in d.items() if k != "seq_lengths"}


def test_docstring_examples():
    for module in (packing, packing_plan):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("window", [None, 64])
def test_same_rows_as_trl_for_one_window(strategy, window):
    """Globally, or per window, the bins are exactly TRL's for the same batch of examples."""
    trl_data_utils = pytest.importorskip("trl.data_utils")
    ds = random_dataset(num_examples=700)  # below TRL's map batch of 1000: one TRL batch
    ours = pack_dataset(ds, 32, strategy, window=window)
    theirs = trl_data_utils.pack_dataset(ds, 32, strategy, map_kwargs={"batch_size": window or 1000})
    if strategy == "wrapped":  # TRL's wrapped rows carry no document boundaries
        assert without_seq_lengths(ours.to_dict()) == theirs.to_dict()
        assert ours.features["input_ids"] == theirs.features["input_ids"]
    else:
        assert ours.to_dict() == theirs.to_dict()
        assert ours.features == theirs.features
    assert ours.format == theirs.format or strategy == "wrapped"


def test_global_bfd_uses_fewer_rows_than_trl_batches():
    trl_data_utils = pytest.importorskip("trl.data_utils")
    lengths = anchors_lengths(5000)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.arange(offsets[-1], dtype=np.int32)))
    ds = datasets.Dataset(pa.table({"input_ids": column}))
    ours, stats = pack_dataset(ds, 2048, "bfd_split", return_stats=True)
    theirs = trl_data_utils.pack_dataset(ds, 2048, "bfd_split")
    assert len(ours) == stats.num_rows < len(theirs)
    tokens = ours.data.table.column("input_ids").combine_chunks().flatten().to_numpy()
    assert np.array_equal(np.sort(tokens), np.arange(offsets[-1]))


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split"])
def test_rows_within_target_of_lower_bound_on_anchors_distribution(strategy):
    """ANCHORS target: rows <= ceil(tokens / 2048) * 1.0001 (TRL: * 1.0033), on 100k lengths."""
    plan = plan_packing(anchors_lengths(100_000), 2048, strategy)
    assert plan.num_rows <= plan.stats.lower_bound_rows * 1.0001
    assert plan.row_lengths().max() <= 2048
    assert plan.stats.num_tokens_kept == int(plan.fragment_lengths.sum())


def test_wrapped_hits_the_lower_bound_on_anchors_distribution():
    plan = plan_packing(anchors_lengths(100_000), 2048, "wrapped")
    assert plan.num_rows == plan.stats.lower_bound_rows
    assert plan.stats.num_tokens_kept == plan.stats.num_tokens


def test_wrapped_does_not_repeat_tokens_across_windows():
    """TRL #6669: wrapped packing repeated the first map batch. Windows here keep each token once."""
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]]})
    assert pack_dataset(ds, 4, "wrapped")["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert pack_dataset(ds, 4, "wrapped", window=3)["input_ids"] == [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10], [11, 12]]
    assert pack_dataset(ds, 4, "wrapped")["seq_lengths"] == [[2, 2], [2, 2], [2, 2]]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_indices_mapping_slices_and_chunks_read_the_right_rows(strategy):
    """A shuffled, selected or multi-chunk Dataset packs exactly like its flattened copy."""
    ds = random_dataset()
    shuffled = ds.shuffle(seed=3).select(range(50, 350))
    assert shuffled._indices is not None
    chunked = datasets.concatenate_datasets([ds.select(range(0, 150)), ds.select(range(150, 400))])
    assert chunked.data.table.column("input_ids").num_chunks == 2
    for variant in (shuffled, chunked, ds.select(range(100, 200))):
        got = pack_dataset(variant, 32, strategy, return_source=True)
        want = pack_dataset(variant.flatten_indices(), 32, strategy, return_source=True)
        assert got.to_dict() == want.to_dict()
        for row in got.select(range(5)):
            start = 0
            for src, off, n in zip(row["source_indices"], row["source_offsets"], row["seq_lengths"]):
                assert row["input_ids"][start:start + n] == variant[src]["input_ids"][off:off + n]
                start += n


def test_format_and_features_are_kept():
    ds = random_dataset().with_format("numpy", columns=["input_ids"])
    packed = pack_dataset(ds, 32, "bfd", return_source=True)
    assert packed.format["type"] == "numpy"
    assert packed.format["columns"] == ["input_ids", "seq_lengths", "source_indices", "source_offsets"]
    assert isinstance(packed[0]["input_ids"], np.ndarray)
    assert packed.column_names == ["input_ids", "attention_mask", "labels", "seq_lengths", "source_indices",
                                   "source_offsets"]
    assert packed.features["attention_mask"] == ds.features["attention_mask"]


def test_large_list_columns_stay_large_lists():
    ids = pa.array([[1, 2, 3], [4], [5, 6]], pa.large_list(pa.int64()))
    packed = pack_dataset(datasets.Dataset(pa.table({"input_ids": ids})), 4, "bfd_split")
    assert packed.data.table.schema.field("input_ids").type == pa.large_list(pa.int64())
    assert packed["input_ids"] == [[1, 2, 3, 4], [5, 6]]


def test_dataset_dict_packs_each_split():
    dd = datasets.DatasetDict({"train": random_dataset(seed=1), "test": random_dataset(50, seed=2)})
    packed, stats = pack_dataset(dd, 32, "bfd_split", return_stats=True)
    assert set(packed) == set(stats) == {"train", "test"}
    for name in dd:
        assert len(packed[name]) == stats[name].num_rows
        assert stats[name].num_tokens_kept == sum(map(len, dd[name]["input_ids"]))


def test_iterable_dataset_packs_window_by_window():
    ds = random_dataset()
    lazy = pack_dataset(ds.to_iterable_dataset(), 32, "bfd_split", window=100, return_source=True)
    assert isinstance(lazy, datasets.IterableDataset)
    eager = pack_dataset(ds, 32, "bfd_split", window=100, return_source=True)
    assert list(lazy) == eager.to_list()


def test_bfd_truncation_is_logged_and_counted(caplog):
    data = {"input_ids": [[1, 2, 3, 4, 5, 6], [7], [], [8, 9, 10, 11, 12]]}
    with caplog.at_level(logging.INFO, logger="twinseq.common.data.packing"):
        packed, stats = pack_dataset(data, 4, "bfd", return_stats=True)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "truncated 2 examples" in warnings[0].getMessage() and "dropping 3 of 12 tokens" in warnings[0].getMessage()
    assert (stats.num_tokens_dropped, stats.num_truncated_examples, stats.num_empty_examples) == (3, 2, 1)
    assert packed["input_ids"] == [[1, 2, 3, 4], [8, 9, 10, 11], [7]]
    assert stats.to_dict()["num_tokens_dropped"] == 3 and "truncated" in stats.summary()


def test_bfd_split_logs_no_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="twinseq.common.data.packing"):
        pack_dataset({"input_ids": [[1, 2, 3, 4, 5, 6], [7]]}, 4, "bfd_split")
    assert not caplog.records


def test_map_kwargs_on_a_dataset_are_reported_not_silently_dropped(caplog):
    with caplog.at_level(logging.WARNING, logger="twinseq.common.data.packing"):
        pack_dataset(random_dataset(20), 32, "bfd_split", map_kwargs={"batch_size": 10})
    assert any("ignores map_kwargs" in r.getMessage() for r in caplog.records)


def test_all_empty_examples_give_no_rows_but_are_counted():
    packed, stats = pack_dataset({"input_ids": [[], []]}, 8, "bfd", return_stats=True)
    assert packed["input_ids"] == [] and packed["seq_lengths"] == []
    assert (stats.num_examples, stats.num_empty_examples, stats.num_rows) == (2, 2, 0)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gather_rows_matches_materialised_rows_and_collates(strategy):
    ds = random_dataset()
    lengths = [len(x) for x in ds["input_ids"]]
    plan = plan_packing(lengths, 32, strategy)
    packed = pack_dataset(ds, 32, strategy)
    rows = [5, 0, plan.num_rows - 1]
    for source in (ds, ds.to_dict()):
        gathered = gather_rows(plan, source, rows)
        for r, row in zip(rows, gathered):
            for name in ("input_ids", "attention_mask", "labels", "seq_lengths"):
                assert row[name].tolist() == packed[r][name]
    batch = collate(gathered, padding_free=True)
    assert np.diff(batch.cu_seqlens).tolist() == [n for r in rows for n in packed[r]["seq_lengths"]]


def test_materialize_arrow_on_sliced_and_chunked_columns():
    full = pa.array([[0, 1, 2], [3], [4, 5, 6, 7], [8, 9]], pa.list_(pa.int32()))
    sliced = full.slice(1, 3)  # a non-zero array offset, as a datasets map batch has
    plan = plan_packing([1, 4, 2], 3, "bfd_split")
    want = [[4, 5, 6], [8, 9, 3], [7]]  # rows of fragments (1,0:3), (2,0:2)+(0,0:1), (1,3:4)
    assert plan.materialize_arrow(sliced).to_pylist() == want
    assert plan.materialize_arrow(pa.chunked_array([full.slice(1, 1), full.slice(2, 2)])).to_pylist() == want


def test_plan_select_and_token_offsets():
    plan = plan_packing([5, 2, 3, 1], 4, "bfd_split")
    sub = plan.select([2, 0])
    assert sub.seq_lengths() == [[2, 1], [4]] and sub.source_indices.tolist() == [1, 3, 0]
    assert plan.token_offsets().tolist() == [0, 4, 8, 11]


def test_packing_imports_neither_torch_nor_jax():
    # Checked after a real pack in a fresh process (blocking the imports outright trips
    # datasets' own optional-torch probes, which are not ours to test).
    code = ("import sys, datasets\n"
            "from twinseq.common.data.packing import pack_dataset\n"
            "ds = datasets.Dataset.from_dict({'input_ids': [[1, 2, 3], [4]]})\n"
            "assert pack_dataset(ds, 4, 'bfd')['input_ids'] == [[1, 2, 3, 4]]\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'jax', 'flax', 'optax'))\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
