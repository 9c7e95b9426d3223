"""Bad inputs to packing: each raises ValueError/TypeError naming the field, the value and the fix."""

import datasets
import numpy as np
import pyarrow as pa
import pytest

from twinseq.common.data.packing import gather_rows, pack_dataset, plan_packing

datasets.disable_progress_bars()
IDS = {"input_ids": [[1, 2, 3], [4, 5]]}


def test_non_list_column_in_a_dataset():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], "text": ["a b", "c"]})
    with pytest.raises(TypeError, match=r"'text': 'string'.*not lists.*remove_columns\(\['text'\]\)"):
        pack_dataset(ds, 4)


def test_scalar_column_in_a_dict():
    with pytest.raises(TypeError, match=r"'score': 'double'.*remove_columns"):
        pack_dataset({"input_ids": [[1, 2], [3]], "score": [0.5, 0.1]}, 4)


def test_column_that_is_not_a_list_of_examples():
    with pytest.raises(TypeError, match=r"column 'input_ids' is a str.*dict of lists"):
        pack_dataset({"input_ids": "1 2 3"}, 4)


def test_ragged_parallel_columns():
    data = {"input_ids": [[1, 2], [3, 4, 5]], "attention_mask": [[1, 1], [1, 1]]}
    with pytest.raises(ValueError, match=r"example 1: column 'attention_mask' has 2 values but 'input_ids' has 3.*"
                                         r"equal lengths.*drop 'attention_mask'"):
        pack_dataset(data, 4)


def test_columns_with_different_numbers_of_examples():
    with pytest.raises(ValueError, match=r"different numbers of examples \{'input_ids': 2, 'labels': 1\}"):
        pack_dataset({"input_ids": [[1], [2]], "labels": [[1]]}, 4)


@pytest.mark.parametrize("seq_length", [0, -8])
def test_non_positive_seq_length(seq_length):
    with pytest.raises(ValueError, match=rf"seq_length={seq_length} must be a positive int.*seq_length=2048"):
        pack_dataset(IDS, seq_length)


@pytest.mark.parametrize("seq_length", [2048.0, "2048", True, None])
def test_non_int_seq_length(seq_length):
    with pytest.raises(TypeError, match=r"seq_length=.* must be a positive int; pass an integer"):
        pack_dataset(IDS, seq_length)


def test_unknown_strategy():
    with pytest.raises(ValueError, match=r"strategy='ffd' is not a packing strategy; choose one of "
                                         r"\('bfd', 'bfd_split', 'wrapped'\)"):
        pack_dataset(IDS, 4, strategy="ffd")


def test_non_integer_tokens():
    with pytest.raises(TypeError, match=r"'input_ids' must hold integer token ids, got double; tokenise"):
        pack_dataset({"input_ids": [[1.5, 2.0], [3.0]]}, 4)


def test_string_tokens():
    ds = datasets.Dataset.from_dict({"input_ids": [["hello", "world"]]})
    with pytest.raises(TypeError, match=r"'input_ids' must hold integer token ids, got string"):
        pack_dataset(ds, 4)


def test_null_tokens():
    with pytest.raises(ValueError, match=r"'input_ids' holds null token ids"):
        pack_dataset({"input_ids": [[1, None, 3]]}, 4)


def test_null_example():
    with pytest.raises(ValueError, match=r"example 1: column 'input_ids' is null.*fill them with \[\]"):
        pack_dataset({"input_ids": [[1, 2], None]}, 4)


def test_empty_dataset():
    ds = datasets.Dataset.from_dict({"input_ids": []},
                                    features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))}))
    with pytest.raises(ValueError, match=r"0 examples: there is nothing to pack"):
        pack_dataset(ds, 4)


def test_empty_dict():
    with pytest.raises(ValueError, match=r"empty dict.*\{'input_ids'"):
        pack_dataset({}, 4)


def test_missing_input_ids():
    with pytest.raises(ValueError, match=r"no 'input_ids' column \(columns: \['tokens'\]\).*rename"):
        pack_dataset({"tokens": [[1, 2]]}, 4)


@pytest.mark.parametrize("window", [-1, 0])
def test_non_positive_window(window):
    with pytest.raises(ValueError, match=rf"window={window} must be a positive number of examples"):
        pack_dataset(IDS, 4, window=window)


def test_non_int_window():
    with pytest.raises(TypeError, match=r"window=2.5 \(float\) must be a positive int"):
        plan_packing([1, 2], 4, window=2.5)


def test_already_packed_dataset():
    packed = pack_dataset(IDS, 4)
    with pytest.raises(ValueError, match=r"already has column\(s\) \['seq_lengths'\].*looks packed already"):
        pack_dataset(packed, 4)


def test_unsupported_dataset_type():
    with pytest.raises(TypeError, match=r"dataset has type list; pack_dataset takes a datasets.Dataset"):
        pack_dataset([{"input_ids": [1, 2]}], 4)


def test_iterable_dataset_needs_a_window():
    it = datasets.Dataset.from_dict(IDS).to_iterable_dataset()
    with pytest.raises(ValueError, match=r"IterableDataset is packed window by window: pass window=N"):
        pack_dataset(it, 4)


def test_iterable_dataset_has_no_upfront_stats():
    it = datasets.Dataset.from_dict(IDS).to_iterable_dataset()
    with pytest.raises(ValueError, match=r"return_stats=True needs the whole dataset"):
        pack_dataset(it, 4, window=2, return_stats=True)


def test_map_kwargs_must_be_a_dict():
    with pytest.raises(TypeError, match=r"map_kwargs=\['batch_size'\] must be a dict"):
        pack_dataset(IDS, 4, map_kwargs=["batch_size"])


def test_negative_lengths():
    with pytest.raises(ValueError, match=r"lengths\[1\]=-3 is negative"):
        plan_packing([4, -3], 4)


def test_lengths_of_wrong_shape_or_type():
    with pytest.raises(ValueError, match=r"1-D sequence of example lengths, got shape \(2, 2\)"):
        plan_packing([[1, 2], [3, 4]], 4)
    with pytest.raises(TypeError, match=r"lengths must hold integers, got dtype float64"):
        plan_packing([1.0, 2.5], 4)
    with pytest.raises(ValueError, match=r"lengths is empty"):
        plan_packing([], 4)


def test_materialising_a_plan_with_the_wrong_arrays():
    plan = plan_packing([3, 2], 4, "bfd_split")
    with pytest.raises(ValueError, match=r"fragment .* of example 0, which has 1; the arrays do not match"):
        plan.materialize(np.arange(3), np.array([0, 1, 3]))
    with pytest.raises(ValueError, match=r"reads example 1 but the arrays hold 1 examples"):
        plan.materialize_arrow(pa.array([[1, 2, 3]]))


def test_selecting_rows_out_of_range():
    plan = plan_packing([3, 2], 4, "bfd_split")
    with pytest.raises(ValueError, match=r"rows \[7\] out of range for a plan of 2 rows"):
        gather_rows(plan, IDS, [7])
