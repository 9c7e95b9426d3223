"""gpt-oss's released checkpoints store the MoE experts in MXFP4; twinseq trains them dequantized (numpy only).

OpenAI's gpt-oss checkpoints (``config.json``: ``"quantization_config": {"quant_method": "mxfp4", ...}``) keep
each MoE layer's two expert tensors as ``experts.gate_up_proj_blocks`` / ``_scales`` and ``experts.down_proj_blocks``
/ ``_scales``; every other tensor is bfloat16. MXFP4 (the OCP microscaling format): each row is cut into groups of
32 numbers; a group stores 32 FP4 (E2M1) codes, two per byte (``_blocks``, ``[E, rows, groups, 16]`` uint8, the
low nibble first) and one shared power-of-two scale (``_scales``, ``[E, rows, groups]`` uint8, E8M0: ``2 ** (s -
127)``). Dequantized, group ``g`` of a row is::

    row[32 g + 2 j]     = FP4_E2M1[blocks[g, j] & 0x0F] * 2 ** (scales[g] - 127)
    row[32 g + 2 j + 1] = FP4_E2M1[blocks[g, j] >> 4]   * 2 ** (scales[g] - 127)

The stored rows are the output features (``[E, 2I, H]`` for gate/up, ``[E, H, I]`` for down); transformers' fused
gpt-oss tensors are input-major, ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]``, so the dequantized tensor
is transposed on its last two axes, as transformers' own dequantisation does. Every FP4 value times a power of two
is exact in float32 (and in bfloat16 within its exponent range), so the float32 weights are the checkpoint's
numbers exactly. Training needs float weights (MXFP4 has no backward), so both backends load these checkpoints
dequantized; a folder twinseq saves afterwards holds float experts and no ``quantization_config``.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from twinseq.common.errors import CheckpointError

FP4_E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
"""The 16 FP4 (E2M1: sign, 2 exponent bits, 1 mantissa bit) values by code."""

MXFP4_TENSORS = ("gate_up_proj", "down_proj")
"""The expert tensors a gpt-oss MXFP4 checkpoint stores as ``<name>_blocks`` and ``<name>_scales``."""

GROUP = 32
"""Numbers per MXFP4 group (one shared scale)."""


def quant_method(hf_config: dict[str, Any]) -> str | None:
    """The ``quant_method`` of a ``config.json``'s ``quantization_config`` (None without one)."""
    quant = hf_config.get("quantization_config")
    return None if not isinstance(quant, dict) else quant.get("quant_method")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``[..., groups, 16]`` uint8 codes and ``[..., groups]`` uint8 scales -> float32 ``[..., groups * 32]`` (the
    module docstring's formula).

    >>> dequantize_mxfp4(np.array([[0x21] + [0] * 15], np.uint8), np.array([128], np.uint8))[:4].tolist()
    [1.0, 2.0, 0.0, 0.0]
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(
            f"MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales {scales.dtype}{list(scales.shape)}: expected "
            "uint8 [..., groups, 16] and uint8 [..., groups]; the checkpoint's _blocks/_scales pair is corrupt or "
            "from another format: copy the model folder again from its release"
        )
    if blocks.shape[-1] != GROUP // 2:
        raise CheckpointError(
            f"MXFP4 blocks hold blocks.shape[-1]={blocks.shape[-1]} bytes per group, expected {GROUP // 2}: the "
            "tensor is not MXFP4; use the model's float release"
        )
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], GROUP)
    with np.errstate(over="ignore"):  # scale 2 ** 127 times 6 is inf, as in transformers; check_finite names it
        values = np.ldexp(FP4_E2M1[codes], (scales.astype(np.int32) - 127)[..., None])
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * GROUP)


def _dequantized_experts(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A stored ``[E, rows, groups, 16]`` pair -> transformers' input-major ``[E, groups * 32, rows]`` float32."""
    return np.ascontiguousarray(np.swapaxes(dequantize_mxfp4(blocks, scales), 1, 2))


def _dequantized_shape(blocks: tuple[int, ...], scales: tuple[int, ...]) -> tuple[int, ...]:
    experts, rows, groups, _ = blocks
    return experts, groups * GROUP, rows


def unpack_mxfp4_experts_(tensors: dict[str, Any], dequantize: Callable[[Any, Any], Any] = _dequantized_experts) -> int:
    """Every ``...experts.<name>_blocks``/``_scales`` pair of ``tensors`` (``MXFP4_TENSORS``) replaced, in place, by
    ``...experts.<name>``: ``dequantize(blocks, scales)`` (default: the float32 input-major tensor; a shape
    function for a folder's header). Returns the number of pairs; a lone half of a pair is refused."""
    pairs = 0
    for key in [k for k in tensors if k.endswith("_blocks")]:
        base = key[: -len("_blocks")]
        if base.rsplit(".", 1)[-1] not in MXFP4_TENSORS:
            continue
        if base + "_scales" not in tensors:
            raise CheckpointError(
                f"{key} has no {base}_scales beside it: the MXFP4 checkpoint is incomplete; copy the whole model "
                "folder again"
            )
        tensors[base] = dequantize(tensors.pop(key), tensors.pop(base + "_scales"))
        pairs += 1
    orphans = [k for k in tensors if k.endswith("_scales") and k[: -len("_scales")].rsplit(".", 1)[-1] in MXFP4_TENSORS]
    if orphans:
        raise CheckpointError(
            f"tensor {orphans[0]!r} has no _blocks beside it: the MXFP4 checkpoint is incomplete; copy the whole "
            "model folder again"
        )
    return pairs


def unpack_mxfp4_shapes_(shapes: dict[str, tuple[int, ...]]) -> int:
    """``unpack_mxfp4_experts_`` on a folder's tensor shapes (``inspect_model_folder``)."""
    return unpack_mxfp4_experts_(shapes, _dequantized_shape)  # type: ignore[arg-type]
