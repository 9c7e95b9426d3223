"""QLoRA's NF4 storage of a MoE layer's fused expert tensors, numpy only: ``quantize_nf4`` and ``dequantize_nf4``.

The numbers are bitsandbytes' (0.50, ``quantize_4bit(..., blocksize=64, quant_type="nf4", compress_statistics=
False)``, its device-neutral kernel, which the torch backend runs): the tensor is flattened and cut into blocks of
``NF4_BLOCKSIZE`` numbers; a block stores one float32 ``absmax = max |w|`` and, per number, the 4-bit index of the
NF4 value nearest ``w / absmax`` (``NF4_CODE``, ties to the lower value), two codes per byte, the first number of a
pair in the high nibble. Dequantised, ``w[i] = NF4_CODE[code[i]] * absmax[i // 64]`` in float32::

    >>> codes, absmax = quantize_nf4(np.linspace(-1, 1, 64, dtype=np.float32))
    >>> codes.shape, absmax.tolist(), hex(codes[0])        # -1.0 and -0.968...: codes 0 and 0
    ((32,), [1.0], '0x0')
    >>> float(dequantize_nf4(codes, absmax, (64,))[-1])
    1.0

An expert of ``[E, a, b]`` is ``a * b`` numbers, a whole number of blocks when ``a * b % 64 == 0``, so it is one
contiguous run of ``a * b / 2`` bytes and ``a * b / 64`` absmax values and dequantises alone (both backends'
kernels dequantise one expert, or a chunk of them, at a time). Storage: 0.5 byte per number plus 4 / 64 bytes of
absmax (0.5625 B, 14% of float32; no double quantisation).
"""

from __future__ import annotations

import numpy as np

from twinseq.common.models.peft import NF4_BLOCKSIZE

__all__ = ["NF4_CODE", "quantize_nf4", "dequantize_nf4"]

NF4_CODE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)
"""The 16 NF4 values by code, float32: bitsandbytes' ``get_4bit_type("nf4")`` (quantiles of N(0, 1), QLoRA)."""

_BOUNDS = (NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2)
"""The float32 midpoints between neighbouring codes: bitsandbytes' bucket bounds."""


def quantize_nf4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes uint8 ``[n / 2]``, absmax float32 ``[n / 64]``) of the ``n`` numbers of ``w`` flattened (C order);
    ``n`` must be a multiple of ``NF4_BLOCKSIZE``. bitsandbytes' arithmetic, op for op in float32:
    ``scaled = clip(w * (1 / max(absmax, 1e-38)), -1, 1)``, then the bucket of ``scaled`` among the midpoints."""
    flat = np.asarray(w, np.float32).reshape(-1)
    if flat.size % NF4_BLOCKSIZE:
        raise ValueError(
            f"quantize_nf4: {flat.size} numbers is not a multiple of the NF4 block ({NF4_BLOCKSIZE}); pass whole blocks"
        )
    blocks = flat.reshape(-1, NF4_BLOCKSIZE)
    absmax = np.abs(blocks).max(axis=1)
    inverse = np.float32(1) / np.maximum(absmax, np.float32(1e-38))
    scaled = np.clip(blocks * inverse[:, None], np.float32(-1), np.float32(1)).reshape(-1)
    index = np.searchsorted(_BOUNDS, scaled, side="left").astype(np.uint8)  # torch.bucketize(right=False)
    return (index[0::2] << 4) | index[1::2], absmax.astype(np.float32)


def dequantize_nf4(codes: np.ndarray, absmax: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """float32 ``shape``: ``NF4_CODE[code] * absmax[block]`` of ``quantize_nf4``'s storage (high nibble first)."""
    codes = np.asarray(codes, np.uint8).reshape(-1)
    values = np.stack((NF4_CODE[codes >> 4], NF4_CODE[codes & 0xF]), axis=-1).reshape(-1, NF4_BLOCKSIZE)
    return (values * np.asarray(absmax, np.float32).reshape(-1, 1)).reshape(shape)
