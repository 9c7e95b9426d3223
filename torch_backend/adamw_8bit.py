"""8-bit blockwise AdamW moments on torch, ``common.run.adamw_8bit``'s rule (``optimizer='adamw_bf16_8bit'``).

``bf16_adamw.AdamWBF16(eight_bit=True)`` keeps each moment of a tensor of at least ``MIN_8BIT_SIZE`` numbers as
``uint8`` codes shaped like the tensor plus one float32 absmax per block of ``BLOCK`` numbers: the same maps, blocks
and nearest-code quantiser as the numpy rule and the jax transformation, so the three store the same moments (the
tests hold this module to the rule). bitsandbytes' ``AdamW8bit`` (``adamw_bnb_8bit``) is another quantiser of the
same scheme that needs its CUDA or CPU binary; this one is plain torch, so it runs wherever torch does and composes
with bfloat16 weights, stochastic rounding and ``optimizer_in_backward``.

A step works on ``CHUNK`` numbers at a time (a whole number of blocks), so its float32 temporaries stay a few
hundred MB whatever the tensor.
"""

from __future__ import annotations

import functools

import torch

from twinseq.common.run import adamw_8bit as rule

BLOCK = rule.BLOCK
CHUNK = BLOCK << 16
"""Numbers per step of the chunked update: 16M, a whole number of blocks."""


@functools.lru_cache(maxsize=8)
def code_maps(device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"signed"|"unsigned": (the 256 code values, the 255 boundaries between them)}`` as float32 on ``device``."""
    out = {}
    for name, signed in (("signed", True), ("unsigned", False)):
        values = rule.dynamic_map(signed)
        out[name] = (torch.from_numpy(values).to(device), torch.from_numpy(rule.midpoints(values)).to(device))
    return out


def is_quantized(p: torch.Tensor) -> bool:
    return rule.is_quantized(p.numel())


def init_moment(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero codes shaped like ``p`` and zero absmax per block."""
    return (
        torch.zeros(p.shape, dtype=torch.uint8, device=p.device),
        torch.zeros(rule.n_blocks(p.numel()), dtype=torch.float32, device=p.device),
    )


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, kind: str) -> torch.Tensor:
    """float32 values of flat ``codes`` whose blocks' absmax is ``absmax`` (its first block is the codes' first)."""
    values, _ = code_maps(codes.device)[kind]
    n = codes.numel()
    return values[codes.int()].mul_(absmax.repeat_interleave(BLOCK)[:n])


def quantize_(codes: torch.Tensor, absmax: torch.Tensor, x: torch.Tensor, kind: str) -> None:
    """Write float32 flat ``x`` into flat ``codes`` and ``absmax`` (one entry per block of ``x``): the nearest code
    under the block's largest magnitude, a value on a boundary to the lower code, as ``rule.quantize``."""
    _, bounds = code_maps(x.device)[kind]
    n = x.numel()
    blocks = rule.n_blocks(n)
    padded = x if n == blocks * BLOCK else torch.nn.functional.pad(x, (0, blocks * BLOCK - n))
    padded = padded.view(blocks, BLOCK)
    big = padded.abs().amax(dim=1)
    absmax.copy_(big)
    normed = padded / torch.where(big > 0, big, torch.ones_like(big))[:, None]
    codes.copy_(torch.searchsorted(bounds, normed.view(-1), side="left", out_int32=True)[:n].to(torch.uint8))
