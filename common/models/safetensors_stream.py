"""A safetensors writer that streams: one tensor in memory at a time, however many the file holds.

``safetensors.numpy.save_file`` (and the torch one) builds the whole file's bytes before writing, a second
copy of everything saved. For a full fine-tune that copy is the model plus its optimizer state: a save
would need more memory than the training step. ``write_safetensors`` writes the header from each tensor's
shape and dtype alone, then asks for the tensors one by one (``LazyArray.produce``) and writes each one's
bytes straight from its buffer. A producer can return a view of a live parameter (no copy at all), gather
one sharded tensor (a collective on every rank), or cast one tensor; nothing else is held.

The file is the safetensors format as its readers check it: an 8-byte little-endian header length, a JSON
header padded with spaces to a multiple of 8 bytes, then the tensors' bytes back to back.

>>> import tempfile, pathlib
>>> from safetensors.numpy import load_file
>>> path = pathlib.Path(tempfile.mkdtemp()) / "t.safetensors"
>>> lazy = LazyArray((2, 3), "float32", lambda: np.arange(6, dtype=np.float32).reshape(2, 3))
>>> write_safetensors(path, {"a": lazy, "b": np.int64(7)}, metadata={"format": "pt"})
>>> loaded = load_file(str(path))
>>> loaded["a"].tolist(), loaded["b"].shape, int(loaded["b"])
([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], (), 7)
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

# safetensors dtype codes by numpy dtype name (bfloat16: ml_dtypes' name, or raw 16-bit words, see ``LazyArray``)
DTYPE_CODES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}


@dataclass(frozen=True)
class LazyArray:
    """A tensor known by its shape and dtype, whose values are produced only when written.

    ``produce()`` returns a numpy array holding exactly ``shape`` x ``dtype``'s bytes. A bfloat16 tensor may be
    produced as its raw 16-bit words (``int16``/``uint16``, the bits of torch's ``view(torch.int16)``), so no
    bfloat16 numpy type is needed.
    """

    shape: tuple[int, ...]
    dtype: str
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _itemsize(self.dtype)

    def values(self) -> np.ndarray:
        """The produced array with its own numpy dtype (raw bfloat16 words viewed as ``ml_dtypes.bfloat16``)."""
        array = np.asarray(self.produce())
        if self.dtype == "bfloat16" and array.dtype in (np.int16, np.uint16):
            import ml_dtypes  # optional dependency: ships with jax; numpy has no native bfloat16

            return array.view(ml_dtypes.bfloat16)
        return array

    @classmethod
    def of(cls, array: np.ndarray) -> "LazyArray":
        """An array that is already there (a zero-copy view of a live buffer, typically)."""
        return cls(tuple(np.shape(array)), str(np.asarray(array).dtype), lambda: np.asarray(array))


Tensor = Union[np.ndarray, np.generic, LazyArray]


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def as_lazy(value: Tensor) -> LazyArray:
    """``value`` as a ``LazyArray`` (an array that is already there produces itself)."""
    return value if isinstance(value, LazyArray) else LazyArray.of(np.asarray(value))


def write_safetensors(
    path: Union[str, os.PathLike], tensors: Mapping[str, Tensor], metadata: Optional[Mapping[str, str]] = None
) -> None:
    """Write ``tensors`` (numpy arrays or ``LazyArray``s) to ``path`` in that order, one in memory at a time.

    Each produced array is checked against its promised byte count before it is written: a producer that
    returns another shape or dtype is a bug, and the file is removed rather than left inconsistent.
    """
    lazy = {name: as_lazy(value) for name, value in tensors.items()}
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, tensor in lazy.items():
        if tensor.dtype not in DTYPE_CODES:
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        end = offset + tensor.nbytes
        header[name] = {"dtype": DTYPE_CODES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, end]}
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for name, tensor in lazy.items():
                array = np.ascontiguousarray(tensor.produce())
                if array.nbytes != tensor.nbytes:
                    raise ValueError(
                        f"tensor {name!r} promised {tensor.shape} {tensor.dtype} ({tensor.nbytes} bytes) but its "
                        f"producer returned {array.shape} {array.dtype} ({array.nbytes} bytes)"
                    )
                f.write(array.reshape(-1).view(np.uint8).data)
                del array
    except BaseException:
        if os.path.exists(path):
            os.unlink(path)
        raise
