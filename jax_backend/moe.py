"""twinseq's grouped MoE experts, gather and scatter inside: ``grouped_experts(x_NH, weight_S, token_S,
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

``grouped_experts`` runs on CPU and GPU, where XLA lowers ``jax.lax.ragged_dot`` over every expert
(``grouped.ragged_dot_is_grouped``); ``model.SparseMoeBlock`` keeps the per-projection ``grouped_matmul`` path on TPU
and for expert LoRA on a float base, whose adapters are a second pair of grouped matmuls beside each projection.

QLoRA (``load_in_4bit``): an expert tensor may be an ``NF4Experts`` instead of an array, the frozen NF4 storage of
``common.models.nf4`` (codes ``[E, n / 2]`` uint8, absmax ``[E, n / 64]``, ``n = a * b`` numbers per expert) with,
optionally, the tensor's LoRA factors in PEFT's ``ParamWrapper`` layout. Each step of the scan dequantises the one
expert its block reads (``NF4Experts.expert``: ``NF4_CODE[code] * absmax``, plus ``scaling * B_e @ A_e``), in
forward and again in backward, so at most one expert of each tensor is in float at a time (``4 a b`` bytes, plus an
int32 index per byte, ``2 a b``, while it is built); every platform runs this kernel for an NF4 base. The base gets
no gradient (zero cotangents); the LoRA factors get theirs from each block's weight gradient ``dW_e`` (``dA_e = s
B_e.T dW_e``, ``dB_e = s dW_e A_e.T``, accumulated in float32 ``[E, r, in]`` / ``[E, out, r]`` carries).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from twinseq.common.models.nf4 import NF4_CODE
from twinseq.common.models.peft import NF4_BLOCKSIZE
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


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes_EC", "absmax_EK", "lora_A", "lora_B"],
    meta_fields=["expert_shape", "scaling"],
)
@dataclass(frozen=True)
class NF4Experts:
    """One fused expert tensor ``[E, a, b]`` stored as NF4 (``common.models.nf4``, one row per expert): ``codes_EC``
    uint8 ``[E, a b / 2]``, ``absmax_EK`` ``[E, a b / 64]`` (float32, or the compute dtype under mixed precision);
    with LoRA (output-major tensors only, PEFT's ``ParamWrapper``), ``lora_A`` ``[E r, b]`` (rows expert-major) and
    ``lora_B`` ``[a, r E]`` (columns expert-minor), expert ``e``'s weight ``W_e + scaling * B_e @ A_e``."""

    codes_EC: jax.Array
    absmax_EK: jax.Array
    lora_A: Optional[jax.Array] = None
    lora_B: Optional[jax.Array] = None
    expert_shape: tuple[int, int] = field(default=(0, 0))
    scaling: float = 0.0

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.codes_EC.shape[0], *self.expert_shape)

    @property
    def dtype(self) -> Any:
        return self.absmax_EK.dtype

    def lora_factors(self, e: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(A_e ``[r, b]``, B_e ``[a, r]``) of expert ``e``."""
        assert self.lora_A is not None and self.lora_B is not None
        num_experts = self.codes_EC.shape[0]
        a_ERI = self.lora_A.reshape(num_experts, -1, self.lora_A.shape[-1])
        return a_ERI[e], self.lora_B.reshape(self.lora_B.shape[0], -1, num_experts)[:, :, e]

    def expert(self, e: jax.Array) -> jax.Array:
        """Expert ``e`` dequantised, ``[a, b]`` in ``dtype``: ``NF4_CODE[code] * absmax`` in float32 (torch's
        ``dequantize_experts``, the same numbers), plus ``scaling * B_e @ A_e`` with LoRA."""
        table = jnp.asarray(NF4_CODE)
        codes_C = self.codes_EC[e].astype(jnp.int32)
        values = jnp.stack((table[codes_C >> 4], table[codes_C & 0xF]), axis=-1).reshape(-1, NF4_BLOCKSIZE)
        w_ab = (values * self.absmax_EK[e].astype(jnp.float32)[:, None]).reshape(self.expert_shape)
        if self.lora_A is not None:
            a_RI, b_OR = self.lora_factors(e)
            w_ab = w_ab + self.scaling * (b_OR.astype(jnp.float32) @ a_RI.astype(jnp.float32))
        return w_ab.astype(self.dtype)


Experts = Union[jax.Array, NF4Experts]
"""An expert tensor as the kernel takes it: float ``[E, a, b]`` or its NF4 storage."""


def _expert(w: Experts, e: jax.Array) -> jax.Array:
    """Expert ``e`` of ``w`` in float (an NF4 one dequantised)."""
    return w.expert(e) if isinstance(w, NF4Experts) else w[e]


def _leaf(w: Experts) -> jax.Array:
    """An array of ``w`` (for the carries' mesh axes)."""
    return w.absmax_EK if isinstance(w, NF4Experts) else w


def _grad_carry(w: Experts, refs: tuple) -> Any:
    """The float32 zeros ``w``'s gradient accumulates in: ``[E, a, b]``, or an NF4 tensor's LoRA factors'
    ``([E, r, b], [E, a, r])``; None for an NF4 base without LoRA (frozen)."""
    if not isinstance(w, NF4Experts):
        return varying_like(jnp.zeros(w.shape, jnp.float32), *refs)
    if w.lora_A is None:
        return None
    num_experts, rank = w.shape[0], w.lora_A.shape[0] // w.shape[0]
    shapes = ((num_experts, rank, w.shape[2]), (num_experts, w.shape[1], rank))
    return tuple(varying_like(jnp.zeros(s, jnp.float32), *refs) for s in shapes)


def _add_grad(w: Experts, carry: Any, e: jax.Array, dw: Callable[[], jax.Array]) -> Any:
    """``carry`` plus expert ``e``'s weight gradient ``dw()`` (float32, stored layout), or, for an NF4 tensor, its
    LoRA factors' (``dA_e = s B_e.T dW_e``, ``dB_e = s dW_e A_e.T``); ``dw`` is not computed for a frozen base."""
    if carry is None:
        return None
    if not isinstance(w, NF4Experts):
        return carry.at[e].add(dw())
    dw_ab = dw()
    a_RI, b_OR = (f.astype(jnp.float32) for f in w.lora_factors(e))
    da_ERI, db_EOR = carry
    return da_ERI.at[e].add(w.scaling * (b_OR.T @ dw_ab)), db_EOR.at[e].add(w.scaling * (dw_ab @ a_RI.T))


def _cotangent(w: Experts, grad: Any) -> Any:
    """``w``'s cotangent from its ``_grad_carry``: the gradient in ``w``'s dtype, or an ``NF4Experts`` of zeros for
    the codes and absmax and the LoRA factors' gradients in PEFT's layout."""
    if not isinstance(w, NF4Experts):
        return grad.astype(w.dtype)
    lora_A = lora_B = None
    if grad is not None:
        da_ERI, db_EOR = grad
        assert w.lora_A is not None and w.lora_B is not None
        lora_A = da_ERI.reshape(w.lora_A.shape).astype(w.lora_A.dtype)
        lora_B = jnp.transpose(db_EOR, (1, 2, 0)).reshape(w.lora_B.shape).astype(w.lora_B.dtype)
    codes: Any = np.zeros(w.codes_EC.shape, jax.dtypes.float0)  # an integer input's cotangent
    return NF4Experts(codes, jnp.zeros_like(w.absmax_EK), lora_A, lora_B, w.expert_shape, w.scaling)


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
    gate_up_E: Experts,
    down_E: Experts,
    gate_up_bias_EF: Optional[jax.Array],
    down_bias_EH: Optional[jax.Array],
    layout: Layout,
    block_rows: int = BLOCK_ROWS,
) -> jax.Array:
    """``y_NH`` (in ``layout.sum_dtype``) of the module docstring's loop over the sorted copies: ``token_S`` and
    ``weight_S`` ``[S]``, the copies sorted by expert with ``group_sizes_E`` copies per expert; ``gate_up_E`` and
    ``down_E`` in ``layout``'s storage (float, or ``NF4Experts``); the biases ``None`` where the experts have none."""
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
    compute = jnp.result_type(x_NH, gate_up_E.dtype)
    copies, width = token_S.shape[0], gate_up_E.shape[1 if layout.output_major else 2]

    def body(carry, e, start, mask_b1):
        y_NH, gate_up_SF = carry
        token_b = _rows(token_S, start, block)
        gate_up_bF = matmul_f32(x_NH[token_b], _expert(gate_up_E, e), layout.output_major).astype(compute)
        gate_up_bF = gate_up_bF + _bias(gate_up_bias, e, compute)
        if gate_up_SF is not None:
            gate_up_SF = _set_rows(gate_up_SF, start, gate_up_bF, mask_b1[:, 0])
        out_bH = matmul_f32(layout.gate(gate_up_bF), _expert(down_E, e), layout.output_major).astype(compute)
        out_bH = out_bH + _bias(down_bias, e, compute)
        weighted_bH = (out_bH * _rows(weight_S, start, block)[:, None]).astype(layout.sum_dtype)
        return y_NH.at[token_b].add(jnp.where(mask_b1, weighted_bH, 0)), gate_up_SF

    refs = (x_NH, weight_S, _leaf(gate_up_E), _leaf(down_E), group_sizes_E)
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
        g_bI = matmul_f32(dy_bH, _expert(down_E, e), not major)  # dy @ down[e] (output-major) or dy @ down[e].T
        dw_b = jnp.sum(g_bI * h_bI.astype(jnp.float32), axis=-1)
        if down_bias is not None:
            dw_b = dw_b + jnp.sum(dy_bH.astype(jnp.float32) * down_bias[e].astype(jnp.float32), axis=-1)
        dweight_S = _set_rows(dweight_S, start, dw_b, mask_b1[:, 0])
        dout_bH = (dy_bH * weight_b[:, None]).astype(compute)
        ddown = _add_grad(down_E, ddown, e, lambda: _weight_grad(h_bI, dout_bH, major))
        if ddown_bias is not None:
            ddown_bias = ddown_bias.at[e].add(jnp.sum(dout_bH.astype(jnp.float32), axis=0))
        (dgate_up_bF,) = gate_vjp((g_bI * weight_b[:, None].astype(jnp.float32)).astype(h_bI.dtype))
        dgate_up = _add_grad(gate_up_E, dgate_up, e, lambda: _weight_grad(x_NH[token_b], dgate_up_bF, major))
        if dgate_up_bias is not None:
            dgate_up_bias = dgate_up_bias.at[e].add(jnp.sum(dgate_up_bF.astype(jnp.float32), axis=0))
        dx_bH = matmul_f32(dgate_up_bF, _expert(gate_up_E, e), not major).astype(dx_NH.dtype)
        dx_NH = dx_NH.at[token_b].add(dx_bH)
        return dx_NH, dweight_S, dgate_up, ddown, dgate_up_bias, ddown_bias

    refs = (x_NH, weight_S, _leaf(gate_up_E), _leaf(down_E), group_sizes_E, dy_NH)

    def zeros(a: Optional[jax.Array], dtype: Any = jnp.float32) -> Optional[jax.Array]:
        return None if a is None else varying_like(jnp.zeros(a.shape, dtype), *refs)

    carry = (zeros(x_NH, x_NH.dtype), zeros(weight_S), _grad_carry(gate_up_E, refs), _grad_carry(down_E, refs),
             zeros(gate_up_bias), zeros(down_bias))  # fmt: skip
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
        _cotangent(gate_up_E, dgate_up),
        _cotangent(down_E, ddown),
        cast(dgate_up_bias, gate_up_bias),
        cast(ddown_bias, down_bias),
    )


_experts.defvjp(_experts_fwd, _experts_bwd)
