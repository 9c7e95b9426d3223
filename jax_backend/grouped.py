"""A grouped matmul for the MoE experts that is not dense on CPU: ``grouped_matmul(x_SK, w_EKO, group_sizes_E)``.

Semantics of ``jax.lax.ragged_dot``: the rows of ``x_SK`` are sorted by group, group ``e`` owns the next
``group_sizes_E[e]`` rows, and each row is multiplied by its group's ``w_EKO[e]``; rows past ``sum(group_sizes_E)``
give zeros.

XLA:CPU lowers ``ragged_dot`` to a dense product over every expert (``E`` times the work and ``[E, S, O]``-sized
temporaries, forward and backward). On CPU this module runs a block-sparse form instead: each group is cut into
blocks of ``block_rows`` rows (its last block short), and a ``jax.lax.scan`` over the blocks multiplies each block's
contiguous slice of ``x`` (rows outside the block masked to zero) by ``w[e_block]`` (a dynamic index into ``w``) and
adds the product into the output rows in place: no padded copy of ``x`` or ``y``. Blocks past the last group's are
skipped (``jax.lax.cond``). The number of blocks is static: ``floor((S + min(E, S) * (b - 1)) / b)`` bounds
``sum_e ceil(g_e / b)`` for every ``group_sizes_E``. The gradient is a ``jax.custom_vjp`` whose backward is one more
scan over the same blocks: ``dy_block @ w[e].T`` added into ``dx`` in place and ``x_block.T @ dy_block`` added into a
single ``[E, K, O]`` float32 carry at ``e`` for ``dW`` (autodiff of the forward scan would add a zero-filled
``[E, K, O]`` buffer per block). Nothing is saved for backward but the inputs. Products accumulate in float32 and are
cast to ``x``'s and ``w``'s result type. ``transposed=True`` reads transformers' output-major ``[E, O, K]`` weights
as they are (no transposed copy of the weights or of their gradient).

XLA:GPU lowers it densely too: on an H200 (jax 0.11.2), one Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts of
768, top-8) at 16,384 tokens in bfloat16 compiled to 66.8 GB of temporaries for its forward + input gradient (the
dense MLP of the same active width: 0.8 GB), and with the weights' gradients it did not fit the 139 GB card
(benchmarks/results/moe_gpu_h200-140gb_2026-11-27.md). So the block-sparse form runs on every platform but TPU, whose
``ragged_dot`` lowering is grouped; on a GPU in blocks of ``ACCELERATOR_BLOCK_ROWS`` rows. The platform is read from
``jax.default_backend()`` at trace time (``ragged_dot_is_grouped``).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

BLOCK_ROWS = 32
"""Rows per block on CPU (measured on hidden 1024, 64 experts x 384, top-8, 512 tokens; see the function)."""

ACCELERATOR_BLOCK_ROWS = 256
"""Rows per block on a GPU: fewer, larger steps of the scan (each step is a few kernel launches), at most
``E * 255`` masked rows of extra work. Chosen, not yet timed on a GPU (``benchmarks/gpu/moe_gpu.py`` times it)."""


def ragged_dot_is_grouped() -> bool:
    """True where ``jax.lax.ragged_dot``'s lowering is grouped (TPU); XLA:CPU and XLA:GPU lower it over every expert
    (module docstring), so the block-sparse forms run there."""
    return jax.default_backend() == "tpu"


def default_block_rows() -> int:
    """``BLOCK_ROWS`` on CPU, ``ACCELERATOR_BLOCK_ROWS`` elsewhere."""
    return BLOCK_ROWS if jax.default_backend() == "cpu" else ACCELERATOR_BLOCK_ROWS


def grouped_matmul(
    x_SK: jax.Array,
    w_EKO: jax.Array,
    group_sizes_E: jax.Array,
    block_rows: Optional[int] = None,
    *,
    transposed: bool = False,
) -> jax.Array:
    """``jax.lax.ragged_dot(x_SK, w_EKO, group_sizes_E)`` (-> ``y_SO``), block-sparse but on TPU (module docstring).

    ``transposed=True`` takes the weights output-major, ``w_EOK`` (transformers' ``[E, out, in]``), and multiplies
    by each ``w[e].T`` without a transposed copy of the weights or of their gradient. ``block_rows`` (default
    ``default_block_rows()``) is clipped to ``S``, so tiny inputs run tiny blocks."""
    k_axis = 2 if transposed else 1
    if x_SK.ndim != 2 or w_EKO.ndim != 3 or x_SK.shape[1] != w_EKO.shape[k_axis]:
        raise ValueError(
            f"grouped_matmul: x_SK {x_SK.shape} and w {w_EKO.shape} (transposed={transposed}) must be [S, K] and "
            f"{'[E, O, K]' if transposed else '[E, K, O]'} with the same K; pass the rows sorted by group"
        )
    if group_sizes_E.shape != (w_EKO.shape[0],):
        raise ValueError(
            f"grouped_matmul: group_sizes_E has shape {group_sizes_E.shape}, expected ({w_EKO.shape[0]},): one size "
            "per expert of w"
        )
    if ragged_dot_is_grouped():
        return jax.lax.ragged_dot(x_SK, jnp.swapaxes(w_EKO, 1, 2) if transposed else w_EKO, group_sizes_E)
    if x_SK.shape[0] == 0:
        return jnp.zeros((0, w_EKO.shape[1 if transposed else 2]), jnp.result_type(x_SK, w_EKO))
    block = max(1, min(int(block_rows or default_block_rows()), x_SK.shape[0]))
    return _blocked(block, transposed, x_SK, w_EKO, group_sizes_E.astype(jnp.int32))


def _blocks(group_sizes_E: jax.Array, rows: int, block: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Each group cut into blocks of ``block`` rows, the last one short: (group of each block ``[NB]``, ``E`` where
    the block is past the last group's; first row of its slice ``[NB]``, clamped to ``rows - block``; the rows of
    that slice that are the block's, ``[lo, hi)`` as two ``[NB]``). ``NB`` bounds the count for every
    ``group_sizes_E``: ``sum ceil(g / b) <= (S + min(E, S) * (b - 1)) / b``."""
    experts = group_sizes_E.shape[0]
    num_blocks = max(1, (rows + min(experts, rows) * (block - 1)) // block)
    blocks_E = (group_sizes_E + block - 1) // block
    block_end_E, end_E = jnp.cumsum(blocks_E), jnp.cumsum(group_sizes_E)
    i_B = jnp.arange(num_blocks, dtype=jnp.int32)
    expert_B = jnp.searchsorted(block_end_E, i_B, side="right").astype(jnp.int32)
    e_B = jnp.minimum(expert_B, experts - 1)
    lo_B = end_E[e_B] - group_sizes_E[e_B] + (i_B - (block_end_E[e_B] - blocks_E[e_B])) * block
    hi_B = jnp.minimum(lo_B + block, end_E[e_B])
    return expert_B, jnp.minimum(lo_B, rows - block), lo_B, hi_B


def matmul_f32(a_bI: jax.Array, w_IO: jax.Array, transpose_w: bool) -> jax.Array:
    """``a @ w`` (``a @ w.T`` with ``transpose_w``), accumulated in float32."""
    dims = (((1,), (1 if transpose_w else 0,)), ((), ()))
    return jax.lax.dot_general(a_bI, w_IO, dims, preferred_element_type=jnp.float32)


def scan_blocks(block, group_sizes_E, rows, carry, body):
    """``body(carry, e, start, mask_b1)`` over the blocks of ``group_sizes_E``; blocks past the last group's skipped."""
    experts = group_sizes_E.shape[0]
    expert_B, start_B, lo_B, hi_B = _blocks(group_sizes_E, rows, block)

    def step(carry, block_in):
        e, start, lo, hi = block_in
        row_b = start + jnp.arange(block, dtype=jnp.int32)
        mask_b1 = ((row_b >= lo) & (row_b < hi))[:, None]
        return jax.lax.cond(e < experts, lambda c: body(c, e, start, mask_b1), lambda c: c, carry), None

    return jax.lax.scan(step, carry, (expert_B, start_B, lo_B, hi_B))[0]


def _varying_axes(a: jax.Array) -> frozenset:
    """The manual mesh axes (``jax.shard_map``) ``a`` varies over: ``manual_axis_type.varying`` (jax 0.10), ``vma``
    before."""
    aval = jax.typeof(a)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset(getattr(aval, "vma", ()))


def varying_like(a: jax.Array, *refs: jax.Array) -> jax.Array:
    """``a`` varying over every manual mesh axis that one of ``refs`` varies over, so that a scan carry started from
    zeros has the type of the carry its body returns."""
    axes = frozenset().union(*(_varying_axes(r) for r in refs)) - _varying_axes(a)
    return jax.lax.pcast(a, tuple(sorted(axes)), to="varying") if axes else a


def _add_rows(a_SX: jax.Array, start: jax.Array, rows_bX: jax.Array) -> jax.Array:
    """``a[start : start + b] += rows`` in place."""
    current = jax.lax.dynamic_slice_in_dim(a_SX, start, rows_bX.shape[0])
    return jax.lax.dynamic_update_slice_in_dim(a_SX, current + rows_bX.astype(a_SX.dtype), start, 0)


def _forward(block: int, transposed: bool, x_SK, w_EKO, group_sizes_E):
    rows, out = x_SK.shape[0], w_EKO.shape[1 if transposed else 2]

    def body(y_SO, e, start, mask_b1):
        x_bK = jnp.where(mask_b1, jax.lax.dynamic_slice_in_dim(x_SK, start, block), 0)
        return _add_rows(y_SO, start, matmul_f32(x_bK, w_EKO[e], transposed))

    y_SO = varying_like(jnp.zeros((rows, out), jnp.result_type(x_SK, w_EKO)), x_SK, w_EKO, group_sizes_E)
    return scan_blocks(block, group_sizes_E, rows, y_SO, body)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _blocked(block: int, transposed: bool, x_SK: jax.Array, w_EKO: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    return _forward(block, transposed, x_SK, w_EKO, group_sizes_E)


def _blocked_fwd(block: int, transposed: bool, x_SK, w_EKO, group_sizes_E):
    return _forward(block, transposed, x_SK, w_EKO, group_sizes_E), (x_SK, w_EKO, group_sizes_E)


def _blocked_bwd(block: int, transposed: bool, residuals, dy_SO):
    x_SK, w_EKO, group_sizes_E = residuals

    def body(carry, e, start, mask_b1):
        dx_SK, dw_EKO = carry
        dy_bO = jnp.where(mask_b1, jax.lax.dynamic_slice_in_dim(dy_SO, start, block), 0)
        x_bK = jax.lax.dynamic_slice_in_dim(x_SK, start, block)
        dx_SK = _add_rows(dx_SK, start, matmul_f32(dy_bO, w_EKO[e], not transposed))
        dw = matmul_f32(dy_bO.T, x_bK.T, True) if transposed else matmul_f32(x_bK.T, dy_bO.T, True)  # [O, K] / [K, O]
        return dx_SK, dw_EKO.at[e].add(dw)

    refs = (x_SK, w_EKO, group_sizes_E, dy_SO)
    carry = (
        varying_like(jnp.zeros(x_SK.shape, x_SK.dtype), *refs),
        varying_like(jnp.zeros(w_EKO.shape, jnp.float32), *refs),
    )
    dx_SK, dw_EKO = scan_blocks(block, group_sizes_E, x_SK.shape[0], carry, body)
    return dx_SK, dw_EKO.astype(w_EKO.dtype), None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
