"""The streamed safetensors writer: what it writes is what safetensors' own readers read, byte for byte as its
own writer would store the values, and it holds one produced tensor at a time."""

from __future__ import annotations

import gc
import json
import struct
import weakref

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from twinseq.common.models.safetensors_stream import LazyArray, write_safetensors


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((7, 5)).astype(np.float32),
        "scalar_step": np.asarray(np.float32(3.0)),  # 0-d, as an optimizer's step count
        "empty": np.zeros((0, 4), np.float32),
        "ids": rng.integers(0, 1000, (3, 2)).astype(np.int64),
        "half": rng.standard_normal(6).astype(np.float16),
        "mask": np.array([True, False, True]),
        "codes": rng.integers(0, 255, 9).astype(np.uint8),
    }


def test_a_streamed_file_reads_back_equal_to_what_was_given(tmp_path):
    tensors = _tensors()
    path = tmp_path / "streamed.safetensors"
    write_safetensors(path, {k: LazyArray.of(v) for k, v in tensors.items()}, metadata={"format": "pt"})
    got = load_file(str(path))
    assert set(got) == set(tensors)
    for name, value in tensors.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        np.testing.assert_array_equal(got[name], value)
    # the header is the format's: little-endian u64 length, JSON padded to 8 bytes, contiguous offsets
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert length % 8 == 0
    header = json.loads(raw[8 : 8 + length])
    assert header["__metadata__"] == {"format": "pt"}
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans[0][0] == 0
    assert 8 + length + spans[-1][1] == len(raw)


def test_the_tensor_bytes_equal_safetensors_own_writer(tmp_path):
    tensors = _tensors()
    write_safetensors(tmp_path / "ours.safetensors", tensors)
    save_file(tensors, str(tmp_path / "theirs.safetensors"))
    ours, theirs = load_file(str(tmp_path / "ours.safetensors")), load_file(str(tmp_path / "theirs.safetensors"))
    for name in tensors:
        assert ours[name].tobytes() == theirs[name].tobytes(), name


def test_bfloat16_as_raw_words_reads_back_as_bfloat16(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as load_torch

    values = torch.randn(4, 3).to(torch.bfloat16)
    lazy = LazyArray((4, 3), "bfloat16", lambda: values.view(torch.int16).numpy())
    write_safetensors(tmp_path / "bf16.safetensors", {"w": lazy})
    got = load_torch(str(tmp_path / "bf16.safetensors"))["w"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, values)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert lazy.values().dtype == ml_dtypes.bfloat16


def test_one_produced_tensor_is_alive_at_a_time(tmp_path):
    """The invariant that makes a save cost one tensor: each produced array is released before the next
    producer runs (a leak here is a second copy of the model during every save)."""
    alive: list[weakref.ref] = []
    seen_alive: list[int] = []

    def producer(i: int):
        def produce() -> np.ndarray:
            gc.collect()
            seen_alive.append(sum(ref() is not None for ref in alive))
            array = np.full((64, 64), i, np.float32)  # a fresh buffer, as a gather or a cast makes
            alive.append(weakref.ref(array))
            return array

        return produce

    write_safetensors(
        tmp_path / "s.safetensors", {f"t{i}": LazyArray((64, 64), "float32", producer(i)) for i in range(6)}
    )
    assert seen_alive == [0] * 6
    got = load_file(str(tmp_path / "s.safetensors"))
    assert [int(got[f"t{i}"][0, 0]) for i in range(6)] == list(range(6))


def test_a_producer_that_breaks_its_promise_leaves_no_file(tmp_path):
    path = tmp_path / "bad.safetensors"
    lazy = {"a": LazyArray((2,), "float32", lambda: np.zeros(3, np.float32))}
    with pytest.raises(ValueError, match=r"'a' promised \(2,\) float32"):
        write_safetensors(path, lazy)
    assert not path.exists()
    with pytest.raises(TypeError, match="complex64"):
        write_safetensors(path, {"z": np.zeros(2, np.complex64)})
