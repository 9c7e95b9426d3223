"""twinseq's grouped MoE experts on CPU, gather and scatter inside: ``grouped_experts(x_NH, weight_S, token_S,
group_sizes_E, gate_up, down, ...) -> y_NH``.

``model.SparseMoeBlock`` routes each token to ``k`` experts and sorts the ``S = N * k`` token copies by expert
(``token_S``: the token of each sorted copy, ``weight_S``: its routing weight, ``group_sizes_E``: copies per expert).
Computed through ``grouped.grouped_matmul`` one projection at a time, autodiff saves every copy's gathered input
``[S, H]``, gate/up ``[S, 2I]``, gated product ``[S, I]`` and output ``[S, H]``: ``k * (2H + 3I)`` numbers per token,
several times a dense MLP of the same active width (``4 k I``: gate, up, ``act(gate)``, product).

Here the copies are walked in blocks of at most ``grouped.BLOCK_ROWS`` rows of one expert (``grouped.scan_blocks``),
and each block gathers its tokens' rows of ``x``, runs the expert's gated MLP and adds its weighted output into
``y_NH`` in place: the temporaries are one block's. Saved for backward: ``x`` (the caller holds it anyway), the
routing and the gate/up pre-activations ``[S, 2I]`` (``2 k I`` per token, half a dense MLP's). Backward re-gathers
``x`` and recomputes the gate of each block. The same kernel as ``torch_backend.moe.GroupedExperts``; naive
equivalent (transformers' per-expert loop, output-major weights)::

    y = zeros(N, H)
    for s in range(S):                            # the sorted copies; e the expert of copy s
        gate_up = x[token[s]] @ gate_up_proj[e].T + gate_up_bias[e]
        y[token[s]] += weight[s] * ((gate(gate_up) @ down_proj[e].T) + down_bias[e])

Backward of one block (``h = gate(gate_up)``, ``dy`` the output's gradient at the copies' tokens, ``w`` their
weights, ``g = dy @ down[e]`` in the output-major layout)::

    d w = sum(g * h) + sum(dy * down_bias[e]);   d down[e] += (w dy).T @ h;   d down_bias[e] += sum(w dy)
    d gate_up = vjp(gate)(w g);   d gate_up_proj[e] += d gate_up.T @ x[token]
    d x[token] += d gate_up @ gate_up_proj[e]

Products accumulate in float32 and are cast to the compute dtype (``x``'s and the weights' result type), as
``grouped_matmul`` does; each weighted copy is summed in ``sum_dtype`` (float32 for Mixtral's float32 routing
weights, the compute dtype otherwise). The expert weight gradients accumulate in one float32 ``[E, ...]`` carry per
tensor.

``grouped_experts`` is the CPU kernel (XLA:CPU has no grouped matmul); ``model.SparseMoeBlock`` keeps the per-
projection ``grouped_matmul`` path (``jax.lax.ragged_dot``) on accelerators and for expert LoRA, whose adapters are
a second pair of grouped matmuls beside each projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from twinseq.jax_backend.grouped import BLOCK_ROWS, matmul_f32, scan_blocks, varying_like


@dataclass(frozen=True)
class GluGate:
    """``act(gate) * up`` of the two halves of ``gate_up`` (Qwen3-MoE, Mixtral: gate rows then up rows)."""

    activation: Callable[[jax.Array], jax.Array]

    def __call__(self, gate_up_SF: jax.Array) -> jax.Array:
        gate_SI, up_SI = jnp.split(gate_up_SF, 2, axis=-1)
        return self.activation(gate_SI) * up_SI


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's gate over interleaved columns (gate ``[..., ::2]``, up ``[..., 1::2]``):
    ``(clip(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)``."""

    limit: float
    alpha: float

    def __call__(self, gate_up_SF: jax.Array) -> jax.Array:
        gate_SI = jnp.minimum(gate_up_SF[..., ::2], self.limit)
        up_SI = jnp.clip(gate_up_SF[..., 1::2], -self.limit, self.limit)
        return (up_SI + 1) * (gate_SI * jax.nn.sigmoid(gate_SI * self.alpha))


@dataclass(frozen=True)
class Layout:
    """How the experts are stored and gated: ``output_major`` (transformers' Qwen3-MoE/Mixtral ``gate_up_proj
    [E, 2I, H]``, ``down_proj [E, H, I]``) or input-major (gpt-oss: ``[E, H, 2I]``, ``[E, I, H]``); ``gate`` maps
    ``gate_up [S, 2I]`` to ``h [S, I]``; ``sum_dtype`` (a dtype name) is what the weighted copies are summed in."""

    output_major: bool
    gate: Callable[[jax.Array], jax.Array]
    sum_dtype: str


def _weight_grad(in_bK: jax.Array, out_bO: jax.Array, output_major: bool) -> jax.Array:
    """``in.T @ out`` in the stored layout (``[O, K]`` output-major, ``[K, O]`` otherwise), float32."""
    a, b = (out_bO, in_bK) if output_major else (in_bK, out_bO)
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _rows(a_S: jax.Array, start: jax.Array, block: int) -> jax.Array:
    """``a[start : start + block]`` (the block's slice; its rows outside the block are masked by the caller)."""
    return jax.lax.dynamic_slice_in_dim(a_S, start, block)


def _set_rows(a_SX: jax.Array, start: jax.Array, rows_bX: jax.Array, mask_b1: jax.Array) -> jax.Array:
    """``a[start : start + b] = rows`` where ``mask``, in place (the other rows of the slice belong to other blocks)."""
    current = jax.lax.dynamic_slice_in_dim(a_SX, start, rows_bX.shape[0])
    new = jnp.where(mask_b1.reshape(mask_b1.shape + (1,) * (current.ndim - 1)), rows_bX.astype(a_SX.dtype), current)
    return jax.lax.dynamic_update_slice_in_dim(a_SX, new, start, 0)


def _bias(b_EX: Optional[jax.Array], e: jax.Array, dtype: Any) -> Any:
    return 0 if b_EX is None else b_EX[e].astype(dtype)


def grouped_experts(
    x_NH: jax.Array,
    weight_S: jax.Array,
    token_S: jax.Array,
    group_sizes_E: jax.Array,
    gate_up_E: jax.Array,
    down_E: jax.Array,
    gate_up_bias_EF: Optional[jax.Array],
    down_bias_EH: Optional[jax.Array],
    layout: Layout,
    block_rows: int = BLOCK_ROWS,
) -> jax.Array:
    """``y_NH`` (in ``layout.sum_dtype``) of the module docstring's loop over the sorted copies: ``token_S`` and
    ``weight_S`` ``[S]``, the copies sorted by expert with ``group_sizes_E`` copies per expert; ``gate_up_E`` and
    ``down_E`` in ``layout``'s storage; the biases ``None`` where the experts have none."""
    copies = token_S.shape[0]
    if weight_S.shape != (copies,) or group_sizes_E.shape != (gate_up_E.shape[0],) or x_NH.ndim != 2:
        raise ValueError(
            f"grouped_experts: x_NH {x_NH.shape}, weight_S {weight_S.shape}, token_S {token_S.shape}, group_sizes_E "
            f"{group_sizes_E.shape} for {gate_up_E.shape[0]} experts; pass x as [N, H], one weight and token per "
            "sorted copy and one size per expert"
        )
    if copies == 0:
        return jnp.zeros(x_NH.shape, layout.sum_dtype)
    block = max(1, min(int(block_rows), copies))
    return _experts(block, layout, x_NH, weight_S, token_S.astype(jnp.int32), group_sizes_E.astype(jnp.int32),
                    gate_up_E, down_E, gate_up_bias_EF, down_bias_EH)  # fmt: skip


def _forward(block, layout, x_NH, weight_S, token_S, group_sizes_E, gate_up_E, down_E, gate_up_bias, down_bias, *,
             keep_gate_up: bool):  # fmt: skip
    """(y_NH, gate_up_SF or None)."""
    compute = jnp.result_type(x_NH, gate_up_E)
    copies, width = token_S.shape[0], gate_up_E.shape[1 if layout.output_major else 2]

    def body(carry, e, start, mask_b1):
        y_NH, gate_up_SF = carry
        token_b = _rows(token_S, start, block)
        gate_up_bF = matmul_f32(x_NH[token_b], gate_up_E[e], layout.output_major).astype(compute)
        gate_up_bF = gate_up_bF + _bias(gate_up_bias, e, compute)
        if gate_up_SF is not None:
            gate_up_SF = _set_rows(gate_up_SF, start, gate_up_bF, mask_b1[:, 0])
        out_bH = matmul_f32(layout.gate(gate_up_bF), down_E[e], layout.output_major).astype(compute)
        out_bH = out_bH + _bias(down_bias, e, compute)
        weighted_bH = (out_bH * _rows(weight_S, start, block)[:, None]).astype(layout.sum_dtype)
        return y_NH.at[token_b].add(jnp.where(mask_b1, weighted_bH, 0)), gate_up_SF

    refs = (x_NH, weight_S, gate_up_E, down_E, group_sizes_E)
    y_NH = varying_like(jnp.zeros(x_NH.shape, layout.sum_dtype), *refs)
    gate_up_SF = varying_like(jnp.zeros((copies, width), compute), *refs) if keep_gate_up else None
    return scan_blocks(block, group_sizes_E, copies, (y_NH, gate_up_SF), body)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _experts(block: int, layout: Layout, x_NH, weight_S, token_S, group_sizes_E, gate_up_E, down_E, gate_up_bias,
             down_bias):  # fmt: skip
    return _forward(block, layout, x_NH, weight_S, token_S, group_sizes_E, gate_up_E, down_E, gate_up_bias,
                    down_bias, keep_gate_up=False)[0]  # fmt: skip


def _experts_fwd(block, layout, x_NH, weight_S, token_S, group_sizes_E, gate_up_E, down_E, gate_up_bias, down_bias):
    y_NH, gate_up_SF = _forward(block, layout, x_NH, weight_S, token_S, group_sizes_E, gate_up_E, down_E,
                                gate_up_bias, down_bias, keep_gate_up=True)  # fmt: skip
    return y_NH, (x_NH, weight_S, token_S, group_sizes_E, gate_up_E, down_E, gate_up_bias, down_bias, gate_up_SF)


def _experts_bwd(block, layout, residuals, dy_NH):
    x_NH, weight_S, token_S, group_sizes_E, gate_up_E, down_E, gate_up_bias, down_bias, gate_up_SF = residuals
    compute = gate_up_SF.dtype
    major = layout.output_major

    def body(carry, e, start, mask_b1):
        dx_NH, dweight_S, dgate_up, ddown, dgate_up_bias, ddown_bias = carry
        token_b, weight_b = _rows(token_S, start, block), _rows(weight_S, start, block)
        # the weighted copy is (out * weight).astype(sum dtype): its cotangent in the product's dtype
        product = jnp.result_type(compute, weight_b)
        dy_bH = jnp.where(mask_b1, dy_NH[token_b], 0).astype(product)
        gate_up_bF = jax.lax.dynamic_slice_in_dim(gate_up_SF, start, block)
        h_bI, gate_vjp = jax.vjp(layout.gate, gate_up_bF)
        g_bI = matmul_f32(dy_bH, down_E[e], not major)  # dy @ down[e] (output-major) or dy @ down[e].T
        dw_b = jnp.sum(g_bI * h_bI.astype(jnp.float32), axis=-1)
        if down_bias is not None:
            dw_b = dw_b + jnp.sum(dy_bH.astype(jnp.float32) * down_bias[e].astype(jnp.float32), axis=-1)
        dweight_S = _set_rows(dweight_S, start, dw_b, mask_b1[:, 0])
        dout_bH = (dy_bH * weight_b[:, None]).astype(compute)
        ddown = ddown.at[e].add(_weight_grad(h_bI, dout_bH, major))
        if ddown_bias is not None:
            ddown_bias = ddown_bias.at[e].add(jnp.sum(dout_bH.astype(jnp.float32), axis=0))
        (dgate_up_bF,) = gate_vjp((g_bI * weight_b[:, None].astype(jnp.float32)).astype(h_bI.dtype))
        dgate_up = dgate_up.at[e].add(_weight_grad(x_NH[token_b], dgate_up_bF, major))
        if dgate_up_bias is not None:
            dgate_up_bias = dgate_up_bias.at[e].add(jnp.sum(dgate_up_bF.astype(jnp.float32), axis=0))
        dx_bH = matmul_f32(dgate_up_bF, gate_up_E[e], not major).astype(dx_NH.dtype)
        dx_NH = dx_NH.at[token_b].add(dx_bH)
        return dx_NH, dweight_S, dgate_up, ddown, dgate_up_bias, ddown_bias

    refs = (x_NH, weight_S, gate_up_E, down_E, group_sizes_E, dy_NH)

    def zeros(a: Optional[jax.Array], dtype: Any = jnp.float32) -> Optional[jax.Array]:
        return None if a is None else varying_like(jnp.zeros(a.shape, dtype), *refs)

    carry = (zeros(x_NH, x_NH.dtype), zeros(weight_S), zeros(gate_up_E), zeros(down_E), zeros(gate_up_bias),
             zeros(down_bias))  # fmt: skip
    dx_NH, dweight_S, dgate_up, ddown, dgate_up_bias, ddown_bias = scan_blocks(
        block, group_sizes_E, token_S.shape[0], carry, body
    )

    def cast(g: Optional[jax.Array], like: Optional[jax.Array]) -> Optional[jax.Array]:
        return None if g is None or like is None else g.astype(like.dtype)

    return (
        dx_NH,
        dweight_S.astype(weight_S.dtype),
        None,
        None,
        dgate_up.astype(gate_up_E.dtype),
        ddown.astype(down_E.dtype),
        cast(dgate_up_bias, gate_up_bias),
        cast(ddown_bias, down_bias),
    )


_experts.defvjp(_experts_fwd, _experts_bwd)
