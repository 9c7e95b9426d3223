"""twinseq's grouped-matmul experts for transformers' fused MoE layouts (``qwen3_moe``, ``mixtral``, ``gpt_oss``).

transformers 5 stores a MoE layer's experts as 3D parameters, ``gate_up_proj [E, 2I, H]`` (gate rows then up rows)
and ``down_proj [E, H, I]`` for Qwen3-MoE and Mixtral; gpt_oss stores them transposed (``[E, H, 2I]`` with gate and
up interleaved column by column, ``[E, I, H]``) with biases and a clamped SwiGLU. It picks the experts' forward by
name from its ``ExpertsInterface`` (``config._experts_implementation``). ``twinseq_grouped`` is registered there
(``register_experts``, lazily) and ``build_model`` selects it on CPU (``select_experts_implementation``).

Naive equivalent (transformers' ``eager`` per-expert loop, which the tests compare against; Qwen3-MoE's layout)::

    y = zeros(T, H)
    for e in range(E):
        t, j = where(top_k_index == e)                   # tokens routed to e, and which of their k slots
        gate, up = (x[t] @ gate_up_proj[e].T).chunk(2, -1)
        y[t] += (act(gate) * up) @ down_proj[e].T * top_k_weights[t, j, None]

Here the ``T * K`` token copies are sorted by expert (a stable sort: no padding to a capacity, no token dropped)
and every projection is one ``torch.nn.functional.grouped_mm`` over the experts' row ranges. The copies are walked
in chunks of whole experts of about ``T / 2`` rows, so the temporaries of a chunk (the gathered inputs ``[C, H]``, the
gated product ``[C, I]``, the down output ``[C, H]``) have the size of one dense layer's, whatever ``K`` is. Saved
for backward: the input ``x`` (the caller holds it anyway), the sorted token ids, the sorted routing weights and the
gate/up pre-activations ``[T * K, 2I]``; backward re-gathers ``x`` and recomputes the gate (the experts' own
``_apply_gate``, under autograd) chunk by chunk. A dense gated MLP of the same active width (``K * I``) saves gate,
up, ``act(gate)`` and the product (``4 K I`` per token); this saves ``2 K I``.

QLoRA (``quantize_experts_``): the two fused tensors are stored as NF4 (bitsandbytes' ``Params4bit`` of the flattened
tensor, a float32 absmax per 64 numbers) and the module's forward becomes ``nf4_experts_forward`` on any device:
``GroupedNF4Experts`` walks the same chunks, at most ``NF4_EXPERTS_PER_CHUNK`` experts each, dequantises the chunk's
experts (``dequantize_experts``; plus ``scaling * B_e @ A_e`` with LoRA on them, ``NF4ExpertLoRA``), uses them and
drops them, in forward and again in backward; the base gets no gradient, the LoRA factors get theirs from each
chunk's weight gradient.

Backward of one chunk, ``h = gate(gate_up)``, ``w`` the copy's routing weight, ``dy`` the output's gradient at
the copy's token, ``b`` the down bias (zero without one)::

    g = dy @ down_proj[e]          # [C, I]
    d w = sum(g * h, -1) + sum(dy * b[e], -1);  d down_proj[e] = (w * dy).T @ h;  d b[e] = sum(w * dy)
    d gate_up = vjp(gate, gate_up)(w * g)
    d gate_up_proj[e] = d gate_up.T @ x[t];  d gate_up_bias[e] = sum(d gate_up);  d x[t] += d gate_up @ gate_up_proj[e]
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, cast

import torch
from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

from twinseq.common.models.peft import NF4_EXPERTS_PER_CHUNK

logger = logging.getLogger(__name__)

EXPERTS_HF_NAME = "twinseq_grouped"
"""The name ``twinseq_grouped_experts_forward`` is registered under in transformers' ``ExpertsInterface``."""

GROUPED_MM_ALIGN_BYTES = 16
"""``grouped_mm`` on CPU needs every stride of its operands to be a multiple of 16 bytes."""


CHUNK_DIVISOR = 2
"""Chunks of ``T / 2`` copies: a chunk's temporaries (``[C, H]`` gathers and outputs) then stay under a dense
layer's activations when ``H`` is close to the active width ``K * I`` (Mixtral's shape); smaller chunks cost more
kernel launches."""


@dataclass(frozen=True)
class Routing:
    """The token copies sorted by expert, and the chunks of whole experts they are walked in.

    ``token_S``: the token of each sorted copy (int64 [T * K]); ``expert_S``: its expert; ``perm_S``: its index in
    ``top_k_index.reshape(-1)``; ``chunks``: ``(first expert, end expert, first row, end row)`` per chunk;
    ``offsets``: per chunk, the int32 end row of each of its experts counted from the chunk's first row
    (``grouped_mm``'s ``offs``); ``empty_experts``: the experts no copy is routed to.
    """

    token_S: torch.Tensor
    expert_S: torch.Tensor
    perm_S: torch.Tensor
    chunks: tuple[tuple[int, int, int, int], ...]
    offsets: tuple[torch.Tensor, ...]
    empty_experts: tuple[int, ...]


def route(
    top_k_index_TK: torch.Tensor, num_experts: int, chunk_rows: Optional[int] = None, max_experts: Optional[int] = None
) -> Routing:
    """Sort the copies of ``top_k_index_TK`` by expert and cut them into chunks of whole experts of about
    ``chunk_rows`` rows (default ``T / CHUNK_DIVISOR``; an expert is never split, and gets at most ``T`` copies), and
    of at most ``max_experts`` experts (an NF4 base dequantises one chunk's experts at a time).

    >>> r = route(torch.tensor([[2, 0], [0, 3]]), 4, chunk_rows=2)
    >>> r.token_S.tolist(), r.chunks
    ([0, 1, 0, 1], ((0, 2, 0, 2), (2, 4, 2, 4)))
    """
    num_tokens, top_k = top_k_index_TK.shape
    expert_S = top_k_index_TK.reshape(-1)
    sorted_S, perm_S = torch.sort(expert_S, stable=True)
    counts = torch.bincount(expert_S, minlength=num_experts).tolist()
    assert len(counts) == num_experts, f"expert index out of range: {len(counts)} > {num_experts} experts"
    limit = max(chunk_rows or -(-num_tokens // CHUNK_DIVISOR), 1)
    chunks, offsets, first, row, rows = [], [], 0, 0, 0
    for e in range(num_experts):
        rows += counts[e]
        if e == num_experts - 1 or rows + counts[e + 1] > limit or e + 1 - first == (max_experts or num_experts):
            ends = torch.tensor(counts[first : e + 1], dtype=torch.int64).cumsum(0).to(torch.int32)
            chunks.append((first, e + 1, row, row + rows))
            offsets.append(ends.to(top_k_index_TK.device))
            first, row, rows = e + 1, row + rows, 0
    token_S = torch.div(perm_S, top_k, rounding_mode="floor")
    empty = tuple(e for e, n in enumerate(counts) if n == 0)
    return Routing(token_S, sorted_S, perm_S, tuple(chunks), tuple(offsets), empty)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.grouped_mm`` (a 2D ``a`` sliced by ``offs`` against a 3D ``b``, or two 2D operands
    sliced along their shared dimension, which gives one matrix per group)."""
    return torch.nn.functional.grouped_mm(a, b, offs=offs)


@dataclass(frozen=True)
class Layout:
    """How an experts module stores its weights: ``transposed`` (gpt_oss: ``gate_up_proj [E, H, 2I]``,
    ``down_proj [E, I, H]``) or not (``[E, 2I, H]``, ``[E, H, I]``), and its gate (``experts._apply_gate``:
    ``act(gate) * up`` of the two halves, or gpt_oss's clamped SwiGLU of interleaved columns)."""

    transposed: bool
    apply_gate: Any

    def input_side(self, w_E: torch.Tensor) -> torch.Tensor:
        """``w_E`` as ``[E, in, out]`` (the right operand of ``rows @ w``)."""
        return w_E if self.transposed else w_E.transpose(-2, -1)

    def weight_grad(self, rows_in_CN: torch.Tensor, rows_out_CM: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Per expert ``rows_in.T @ rows_out``, in the stored layout (``[E, in, out]`` or ``[E, out, in]``)."""
        if self.transposed:
            return _grouped_mm(rows_in_CN.t(), rows_out_CM, offs)
        return _grouped_mm(rows_out_CM.t(), rows_in_CN, offs)


ChunkWeights = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
"""``(e0, e1) -> (gate_up, down)``: experts ``e0:e1``'s weights in their stored layout, as the kernel uses them."""
GradSink = Callable[[str, int, int, torch.Tensor], None]
"""``(name, e0, e1, grad)``: receives the gradient of experts ``e0:e1``'s ``gate_up`` or ``down`` weight, per chunk."""


def _forward_chunks(
    x_TH: torch.Tensor,
    weight_S: torch.Tensor,
    weights: ChunkWeights,
    biases: tuple[Optional[torch.Tensor], Optional[torch.Tensor]],
    routing: Routing,
    layout: Layout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y_TH, gate_up_SF)``: the experts' output and the gate/up pre-activations backward reuses, a chunk of
    experts at a time (their weights read by ``weights`` per chunk, dropped after it)."""
    gate_up_bias_EF, down_bias_EH = biases
    y_TH = torch.zeros_like(x_TH)
    gate_up_SF: Optional[torch.Tensor] = None
    for (e0, e1, r0, r1), offs in zip(routing.chunks, routing.offsets):
        if r0 == r1:
            continue
        gate_up_nW, down_nW = weights(e0, e1)
        if gate_up_SF is None:
            gate_up_SF = x_TH.new_empty((routing.token_S.numel(), layout.input_side(gate_up_nW).shape[2]))
        token_C = routing.token_S[r0:r1]
        gate_up_CF = _grouped_mm(x_TH[token_C], layout.input_side(gate_up_nW), offs)
        if gate_up_bias_EF is not None:
            gate_up_CF += gate_up_bias_EF[routing.expert_S[r0:r1]]
        gate_up_SF[r0:r1] = gate_up_CF
        h_CI = layout.apply_gate(gate_up_CF)
        del gate_up_CF, gate_up_nW
        out_CH = _grouped_mm(h_CI, layout.input_side(down_nW), offs)
        del h_CI, down_nW
        if down_bias_EH is not None:
            out_CH += down_bias_EH[routing.expert_S[r0:r1]]
        if out_CH.dtype == weight_S.dtype:  # in place: one [C, H] temporary less
            y_TH.index_add_(0, token_C, out_CH.mul_(weight_S[r0:r1, None]).to(y_TH.dtype))
        else:
            y_TH.index_add_(0, token_C, (out_CH * weight_S[r0:r1, None]).to(y_TH.dtype))
    if gate_up_SF is None:  # no token copy at all: backward has no chunk to read it
        gate_up_SF = x_TH.new_empty((0, 0))
    return y_TH, gate_up_SF


def _backward_chunks(
    dy_TH: torch.Tensor,
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    weights: ChunkWeights,
    biases: tuple[Optional[torch.Tensor], Optional[torch.Tensor]],
    routing: Routing,
    layout: Layout,
    need: tuple[bool, bool, bool, bool, bool, bool],
    sink: GradSink,
) -> tuple[Optional[torch.Tensor], ...]:
    """``(dx_TH, dweight_S, dgate_up_bias_EF, ddown_bias_EH)`` (None where ``need`` says so) of the module docstring's
    backward, a chunk of experts at a time; the chunk's weight gradients go to ``sink`` (``need[2]``: gate_up,
    ``need[3]``: down). ``saved``: ``(x_TH, weight_S, gate_up_SF)``."""
    x_TH, weight_S, gate_up_SF = saved
    gate_up_bias_EF, down_bias_EH = biases
    dx_TH = torch.zeros_like(x_TH) if need[0] else None
    dweight_S = torch.zeros_like(weight_S) if need[1] else None
    dgate_up_bias = torch.zeros_like(gate_up_bias_EF) if need[4] and gate_up_bias_EF is not None else None
    ddown_bias = torch.zeros_like(down_bias_EH) if need[5] and down_bias_EH is not None else None
    for (e0, e1, r0, r1), offs in zip(routing.chunks, routing.offsets):
        if r0 == r1:
            continue
        gate_up_nW, down_nW = weights(e0, e1)
        token_C, expert_C, w_C1 = routing.token_S[r0:r1], routing.expert_S[r0:r1], weight_S[r0:r1, None]
        dy_CH = dy_TH[token_C]
        with torch.enable_grad():
            gate_up_CF = gate_up_SF[r0:r1].detach().requires_grad_(True)
            h_CI = layout.apply_gate(gate_up_CF)
        g_CI = _grouped_mm(dy_CH, layout.input_side(down_nW).transpose(-2, -1), offs)
        del down_nW
        if dweight_S is not None:
            dw_C = (g_CI * h_CI.detach()).sum(-1)
            if down_bias_EH is not None:
                dw_C += (dy_CH * down_bias_EH[expert_C]).sum(-1)
            dweight_S[r0:r1] = dw_C.to(dweight_S.dtype)
        dout_CH = dy_CH.mul_(w_C1) if dy_CH.dtype == w_C1.dtype else (dy_CH * w_C1).to(dy_CH.dtype)
        del dy_CH
        if need[3]:
            sink("down", e0, e1, layout.weight_grad(h_CI.detach(), dout_CH, offs))
        if ddown_bias is not None:
            ddown_bias.index_add_(0, expert_C, dout_CH.to(ddown_bias.dtype))
        del dout_CH
        (dgate_up_CF,) = torch.autograd.grad(h_CI, gate_up_CF, g_CI * w_C1.to(g_CI.dtype))
        del g_CI, h_CI, gate_up_CF
        if need[2]:
            sink("gate_up", e0, e1, layout.weight_grad(x_TH[token_C], dgate_up_CF, offs))
        if dgate_up_bias is not None:
            dgate_up_bias.index_add_(0, expert_C, dgate_up_CF.to(dgate_up_bias.dtype))
        if dx_TH is not None:
            gate_up_T = layout.input_side(gate_up_nW).transpose(-2, -1)
            dx_TH.index_add_(0, token_C, _grouped_mm(dgate_up_CF, gate_up_T, offs))
        del gate_up_nW
    return dx_TH, dweight_S, dgate_up_bias, ddown_bias


class GroupedExperts(torch.autograd.Function):
    """``y_TH`` of the module docstring's naive loop; see there for what is saved and recomputed. The biases
    (gpt_oss) are optional: ``None`` where the experts have none."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x_TH: torch.Tensor,
        weight_S: torch.Tensor,
        gate_up_E: torch.Tensor,
        down_E: torch.Tensor,
        gate_up_bias_EF: Optional[torch.Tensor],
        down_bias_EH: Optional[torch.Tensor],
        routing: Routing,
        layout: Layout,
    ) -> torch.Tensor:
        weights = _slices(gate_up_E, down_E)
        y_TH, gate_up_SF = _forward_chunks(x_TH, weight_S, weights, (gate_up_bias_EF, down_bias_EH), routing, layout)
        ctx.save_for_backward(x_TH, weight_S, gate_up_E, down_E, gate_up_bias_EF, down_bias_EH, gate_up_SF)
        ctx.routing, ctx.layout = routing, layout
        return y_TH

    @staticmethod
    def backward(ctx: Any, dy_TH: torch.Tensor):  # type: ignore[override]
        x_TH, weight_S, gate_up_E, down_E, gate_up_bias_EF, down_bias_EH, gate_up_SF = ctx.saved_tensors
        need = ctx.needs_input_grad
        # every expert's slice is written by the sink (an expert with no copy: zeroed by _zero_empty)
        grads = {
            "gate_up": torch.empty_like(gate_up_E) if need[2] else None,
            "down": torch.empty_like(down_E) if need[3] else None,
        }

        def sink(name: str, e0: int, e1: int, grad: torch.Tensor) -> None:
            grads[name][e0:e1] = grad  # type: ignore[index]  # need[] asked for it

        dx_TH, dweight_S, dgate_up_bias, ddown_bias = _backward_chunks(
            dy_TH,
            (x_TH, weight_S, gate_up_SF),
            _slices(gate_up_E, down_E),
            (gate_up_bias_EF, down_bias_EH),
            ctx.routing,
            ctx.layout,
            need[:6],
            sink,
        )
        for grad in grads.values():
            _zero_empty(grad, ctx.routing)
        return dx_TH, dweight_S, grads["gate_up"], grads["down"], dgate_up_bias, ddown_bias, None, None


def _slices(gate_up_E: torch.Tensor, down_E: torch.Tensor) -> ChunkWeights:
    return lambda e0, e1: (gate_up_E[e0:e1], down_E[e0:e1])


# --------------------------------------------------------------------------------------
# QLoRA: the experts' NF4 base, dequantised a chunk of experts at a time
# --------------------------------------------------------------------------------------


def dequantize_experts(weight: torch.Tensor, e0: int, e1: int) -> torch.Tensor:
    """float32 experts ``e0:e1`` of an NF4 expert tensor (``quantize_experts_``): ``[e1 - e0, *shape[1:]]``.

    ``weight`` is a bitsandbytes ``Params4bit`` holding the packed codes of the flattened ``[E, a, b]`` tensor
    (two 4-bit codes per byte, high nibble first) and ``quant_state`` (``absmax`` per block of ``blocksize``, the
    NF4 ``code`` table, the shape). An expert is ``a * b`` numbers, a whole number of blocks, so experts ``e0:e1`` are
    one contiguous run of bytes and of blocks: ``code[nibble] * absmax[block]``, bitsandbytes' own dequantisation,
    done in torch on any device (bitsandbytes' CPU kernel misreads blocks that straddle a row of ``[a, b]``). Besides
    the float32 result it holds an int32 index per byte (2 B per number) while it runs.
    """
    state = cast(Any, weight).quant_state  # a Params4bit (bitsandbytes is untyped)
    per_expert = math.prod(state.shape[1:])
    codes = weight.data.reshape(-1)[e0 * per_expert // 2 : e1 * per_expert // 2]
    absmax = state.absmax[e0 * per_expert // state.blocksize : e1 * per_expert // state.blocksize]
    code = state.code.to(device=codes.device, dtype=torch.float32)
    byte_values = torch.arange(256, device=codes.device)
    pairs = torch.stack((code[byte_values >> 4], code[byte_values & 0xF]), dim=-1)  # [256, 2]: high nibble first
    values = pairs.index_select(0, codes.to(torch.int32)).view(-1, state.blocksize)
    return values.mul_(absmax.to(torch.float32)[:, None]).view(e1 - e0, *state.shape[1:])


def is_nf4_experts(experts: Any) -> bool:
    """Whether ``experts``' fused tensors are an NF4 base (``quantize_experts_`` ran on it)."""
    return type(experts) in _NF4_CLASSES.values()


def quantize_experts_(experts: torch.nn.Module, to_nf4: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """``experts``' ``gate_up_proj`` and ``down_proj`` replaced by ``to_nf4`` of each (the caller's bitsandbytes
    ``Params4bit`` of the flattened tensor, ``quant_state.shape`` the 3-D one, ``dequantize_experts``' layout), and
    its forward by ``nf4_experts_forward``, in place; biases (gpt_oss) stay float. Returns how many tensors.
    ``ValueError`` where the kernel cannot run these experts (``unsupported_reason``)."""
    reason = unsupported_reason(experts)
    if reason is not None:
        raise ValueError(reason)
    for name in ("gate_up_proj", "down_proj"):
        setattr(experts, name, to_nf4(getattr(experts, name).detach()))
    experts.__class__ = nf4_experts_class(type(experts))
    return 2


@dataclass(frozen=True)
class ExpertLoRAFactors:
    """LoRA factors of one expert tensor in PEFT's ``ParamWrapper`` layout: ``lora_A`` ``[E * r, in]`` (rows
    expert-major), ``lora_B`` ``[out, r * E]`` (columns expert-minor); expert ``e``'s delta ``scaling * B_e @ A_e``
    (``common.models.peft.expert_factors``) adds to its ``[out, in]`` weight."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float
    num_experts: int

    def per_expert(self, e0: int, e1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_nRI ``[n, r, in]``, B_nOR ``[n, out, r]``) of experts ``e0:e1``."""
        a_ERI = self.lora_A.view(self.num_experts, -1, self.lora_A.shape[1])
        b_EOR = self.lora_B.view(self.lora_B.shape[0], -1, self.num_experts).permute(2, 0, 1)
        return a_ERI[e0:e1], b_EOR[e0:e1]


NF4_NAMES = ("gate_up", "down")


class GroupedNF4Experts(torch.autograd.Function):
    """``GroupedExperts`` over a frozen NF4 base (``dequantize_experts``), with optional LoRA factors per tensor:
    each chunk's experts are dequantised (``scaling * B_e @ A_e`` added) when the chunk runs and dropped after it,
    in forward and again in backward, so no more than ``NF4_EXPERTS_PER_CHUNK`` experts are ever in float. The
    gradients are the input's, the routing weights', the biases' and the LoRA factors' (``dW`` of a chunk, per
    expert: ``dB_e = s dW_e A_e^T``, ``dA_e = s B_e^T dW_e``); the NF4 base has none."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x_TH: torch.Tensor,
        weight_S: torch.Tensor,
        gate_up_bias_EF: Optional[torch.Tensor],
        down_bias_EH: Optional[torch.Tensor],
        routing: Routing,
        layout: Layout,
        base: tuple[torch.Tensor, torch.Tensor],
        scalings: tuple[Optional[float], Optional[float]],
        *factors: Optional[torch.Tensor],
    ) -> torch.Tensor:
        lora = _lora_factors(factors, scalings, routing)
        weights = _nf4_slices(base, lora)
        y_TH, gate_up_SF = _forward_chunks(x_TH, weight_S, weights, (gate_up_bias_EF, down_bias_EH), routing, layout)
        ctx.save_for_backward(x_TH, weight_S, gate_up_bias_EF, down_bias_EH, gate_up_SF, *factors)
        ctx.routing, ctx.layout, ctx.base, ctx.scalings = routing, layout, base, scalings
        return y_TH

    @staticmethod
    def backward(ctx: Any, dy_TH: torch.Tensor):  # type: ignore[override]
        x_TH, weight_S, gate_up_bias_EF, down_bias_EH, gate_up_SF, *factors = ctx.saved_tensors
        routing, need = ctx.routing, ctx.needs_input_grad
        lora = _lora_factors(factors, ctx.scalings, routing)
        grads: list[Optional[torch.Tensor]] = [
            torch.zeros_like(f) if f is not None and need[8 + i] else None for i, f in enumerate(factors)
        ]

        def sink(name: str, e0: int, e1: int, dw_nOI: torch.Tensor) -> None:
            i = NF4_NAMES.index(name)
            factor = lora[i]
            assert factor is not None, f"no LoRA on the NF4 {name} experts, so no gradient was asked for"
            empty = [e - e0 for e in routing.empty_experts if e0 <= e < e1]
            if empty:  # grouped_mm leaves an empty group's output as is
                dw_nOI[empty] = 0
            a_nRI, b_nOR = factor.per_expert(e0, e1)
            num_experts = factor.num_experts
            if grads[2 * i] is not None:
                da = torch.bmm(b_nOR.transpose(-2, -1), dw_nOI).mul_(factor.scaling)
                grads[2 * i].view(num_experts, -1, da.shape[-1])[e0:e1] = da  # type: ignore[union-attr]
            if grads[2 * i + 1] is not None:
                db = torch.bmm(dw_nOI, a_nRI.transpose(-2, -1)).mul_(factor.scaling)
                grads[2 * i + 1].view(db.shape[1], -1, num_experts)[:, :, e0:e1] = db.permute(1, 2, 0)  # type: ignore

        wanted = tuple(any(need[8 + 2 * i : 10 + 2 * i]) for i in range(2))
        dx_TH, dweight_S, dgate_up_bias, ddown_bias = _backward_chunks(
            dy_TH,
            (x_TH, weight_S, gate_up_SF),
            _nf4_slices(ctx.base, lora),
            (gate_up_bias_EF, down_bias_EH),
            routing,
            ctx.layout,
            (need[0], need[1], wanted[0], wanted[1], need[2], need[3]),
            sink,
        )
        return (dx_TH, dweight_S, dgate_up_bias, ddown_bias, None, None, None, None, *grads)


def _lora_factors(
    factors: tuple[Optional[torch.Tensor], ...], scalings: tuple[Optional[float], Optional[float]], routing: Routing
) -> tuple[Optional[ExpertLoRAFactors], Optional[ExpertLoRAFactors]]:
    """Per tensor (gate_up, down), its ``ExpertLoRAFactors`` from the flat ``(A, B, A, B)`` or None."""
    num_experts = routing.chunks[-1][1]  # the chunks cover every expert
    out = []
    for i, scaling in enumerate(scalings):
        a, b = factors[2 * i], factors[2 * i + 1]
        out.append(None if a is None or b is None or scaling is None else ExpertLoRAFactors(a, b, scaling, num_experts))
    return out[0], out[1]


def _nf4_slices(
    base: tuple[torch.Tensor, torch.Tensor], lora: tuple[Optional[ExpertLoRAFactors], Optional[ExpertLoRAFactors]]
) -> ChunkWeights:
    """Experts ``e0:e1`` of each NF4 tensor dequantised, plus ``scaling * B_e @ A_e`` where it has LoRA."""

    def weights(e0: int, e1: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for weight, factor in zip(base, lora):
            w_nOI = dequantize_experts(weight, e0, e1)
            if factor is not None:
                a_nRI, b_nOR = factor.per_expert(e0, e1)
                w_nOI.baddbmm_(b_nOR.to(w_nOI.dtype), a_nRI.to(w_nOI.dtype), alpha=factor.scaling)
            out.append(w_nOI)
        return out[0], out[1]

    return weights


def nf4_experts_forward(
    experts: Any,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    lora: Optional[dict[str, ExpertLoRAFactors]] = None,
) -> torch.Tensor:
    """transformers' experts-forward signature over an NF4 base (``quantize_experts_``), on any device:
    ``GroupedNF4Experts`` in chunks of at most ``NF4_EXPERTS_PER_CHUNK`` experts; ``lora``: factors by tensor name
    (``gate_up_proj``, ``down_proj``), from ``NF4ExpertLoRA``."""
    lora = lora or {}
    routing = route(top_k_index, experts.num_experts, max_experts=NF4_EXPERTS_PER_CHUNK)
    weight_S = top_k_weights.reshape(-1)[routing.perm_S]
    layout = Layout(experts.is_transposed, experts._apply_gate)
    biases = (experts.gate_up_proj_bias, experts.down_proj_bias) if experts.has_bias else (None, None)
    factors = [lora.get(name) for name in ("gate_up_proj", "down_proj")]
    flat = [t for f in factors for t in ((f.lora_A, f.lora_B) if f is not None else (None, None))]
    scalings = tuple(f.scaling if f is not None else None for f in factors)
    base = (experts.gate_up_proj, experts.down_proj)
    return GroupedNF4Experts.apply(hidden_states, weight_S, *biases, routing, layout, base, scalings, *flat)


_NF4_CLASSES: dict[type, type] = {}


def nf4_experts_class(cls: type) -> type:
    """``cls`` whose forward is ``nf4_experts_forward`` whatever ``config._experts_implementation`` says (one
    subclass per experts class, so ``isinstance`` and the module's attributes stay transformers')."""
    if cls not in _NF4_CLASSES:

        def forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
            return nf4_experts_forward(self, hidden_states, top_k_index, top_k_weights)

        _NF4_CLASSES[cls] = type(f"NF4{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
    return _NF4_CLASSES[cls]


class NF4ExpertLoRA(torch.nn.Module):
    """LoRA on one fused expert tensor over an NF4 base, in the place and under the names of PEFT's
    ``lora.ParamWrapper`` (which cannot wrap an NF4 tensor): ``base_layer`` (the experts module, or the wrapper of
    the previous targeted tensor, nested as PEFT nests), ``lora_A.default`` (``nn.Linear(in, r * E)``) and
    ``lora_B.default`` (``nn.Linear(r * E, out)``), so the saved keys are PEFT's (``...experts.lora_A.weight``).
    Its forward runs ``nf4_experts_forward`` on the experts module with every enabled wrapper's factors."""

    def __init__(self, base_layer: torch.nn.Module, parameter_name: str, rank: int, scaling: float) -> None:
        super().__init__()
        experts = _nf4_experts_under(base_layer)
        num_experts, out_features, in_features = cast(Any, getattr(experts, parameter_name)).quant_state.shape
        self.base_layer = base_layer
        self.parameter_name, self.scaling, self.num_experts = parameter_name, scaling, num_experts
        self.disable_adapters = False
        device = cast(Any, getattr(experts, parameter_name)).device
        self.lora_A = torch.nn.ModuleDict(
            {"default": torch.nn.Linear(in_features, rank * num_experts, bias=False, device=device)}
        )
        self.lora_B = torch.nn.ModuleDict(
            {"default": torch.nn.Linear(rank * num_experts, out_features, bias=False, device=device)}
        )

    def factors(self) -> ExpertLoRAFactors:
        a, b = cast(torch.Tensor, self.lora_A["default"].weight), cast(torch.Tensor, self.lora_B["default"].weight)
        return ExpertLoRAFactors(a, b, self.scaling, self.num_experts)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        lora: dict[str, ExpertLoRAFactors] = {}
        module: torch.nn.Module = self
        while isinstance(module, NF4ExpertLoRA):
            if not module.disable_adapters:
                lora[module.parameter_name] = module.factors()
            module = module.base_layer
        return nf4_experts_forward(module, hidden_states, top_k_index, top_k_weights, lora)


def _nf4_experts_under(module: torch.nn.Module) -> torch.nn.Module:
    while isinstance(module, NF4ExpertLoRA):
        module = module.base_layer
    if not is_nf4_experts(module):
        raise ValueError(f"{type(module).__name__} is not an NF4 experts module; run quantize_experts_ on it first")
    return module


def _zero_empty(grad_E: Optional[torch.Tensor], routing: Routing) -> None:
    """Zero the gradient of every expert no copy reached (``grouped_mm`` leaves an empty group's output as is)."""
    if grad_E is not None and routing.empty_experts:
        grad_E[list(routing.empty_experts)] = 0


def twinseq_grouped_experts_forward(
    self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts-forward signature: ``hidden_states [T, H]``, ``top_k_index``/``top_k_weights [T, K]``
    -> ``[T, H]``. An experts module this kernel does not cover (``unsupported_reason``) runs transformers'
    ``grouped_mm``, and the log says so once."""
    reason = unsupported_reason(self)
    if reason is not None:
        _log_once(f"MoE experts: transformers' grouped_mm runs {type(self).__name__} ({reason})")
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    # read once: under peft's target_parameters each read of a parametrized weight recomputes W + BA
    gate_up, down = self.gate_up_proj, self.down_proj
    biases = (self.gate_up_proj_bias, self.down_proj_bias) if self.has_bias else (None, None)
    routing = route(top_k_index, self.num_experts)
    weight_S = top_k_weights.reshape(-1)[routing.perm_S]
    layout = Layout(self.is_transposed, self._apply_gate)
    return GroupedExperts.apply(hidden_states, weight_S, gate_up, down, *biases, routing, layout)


def unsupported_reason(experts: Any) -> Optional[str]:
    """Why ``twinseq_grouped`` cannot run ``experts`` (None when it can): it covers gated experts in either stored
    layout, with or without biases, with any ``_apply_gate``, no post-expert norm, unsharded, and hidden and
    intermediate sizes a multiple of 16 bytes (``grouped_mm``'s strides on CPU)."""
    if not getattr(experts, "has_gate", True) or getattr(experts, "has_post_expert_norm", False):
        return "gate-less experts or a post-expert norm"
    if getattr(experts, "_is_expert_parallel", False):
        return "transformers' expert parallelism"
    down = experts.down_proj
    # an NF4 tensor (quantize_experts_) runs dequantised to float32, in its logical shape
    shape, item = (down.quant_state.shape, 4) if hasattr(down, "quant_state") else (down.shape, down.element_size())
    if any((n * item) % GROUPED_MM_ALIGN_BYTES for n in shape[1:]):
        return f"hidden or intermediate size {tuple(shape[1:])} not a multiple of 16 bytes"
    return None


def register_experts() -> None:
    """Register ``twinseq_grouped`` with transformers (idempotent; called lazily, never at import)."""
    if EXPERTS_HF_NAME not in ExpertsInterface._global_mapping:
        ExpertsInterface.register(EXPERTS_HF_NAME, twinseq_grouped_experts_forward)


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every fused-experts module of ``model`` (transformers' ``@use_experts_implementation`` classes)."""
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "_apply_gate")]


def select_experts_implementation(model: Any, device: torch.device) -> Optional[str]:
    """Make ``model``'s MoE experts run ``twinseq_grouped`` on CPU and CUDA; return the implementation its experts run
    (None for a model without experts). Experts the kernel does not cover (``unsupported_reason``) run transformers'
    ``eager`` loop on CPU and keep transformers' choice on CUDA; on other devices transformers' choice stays. The log
    says which and why.

    On CUDA transformers' own choice is ``grouped_mm``, faster and heavier: on an H200, one Qwen3-30B-A3B layer at
    16,384 bfloat16 tokens, forward + backward, twinseq's kernel peaked at 0.55x its memory with the weights trained
    and 0.36x frozen, in 1.54x its time (benchmarks/results/moe_gpu_h200-140gb_2026-11-27.md)."""
    experts = experts_modules(model)
    if not experts:
        return None
    current = model.config._experts_implementation
    if device.type not in ("cpu", "cuda"):
        logger.info(
            "MoE experts: transformers' %r kept on %s (%r runs on CPU and CUDA)", current, device, EXPERTS_HF_NAME
        )
        return current
    reasons = {r for r in map(unsupported_reason, experts) if r is not None}
    if reasons:
        # transformers' grouped_mm needs the same 16-byte strides on CPU: its per-expert loop is what runs anywhere
        fallback = "eager" if device.type == "cpu" else current
        loop = " loop" if fallback == "eager" else ""
        logger.info(
            "MoE experts: transformers' %r%s, not %r (%s)", fallback, loop, EXPERTS_HF_NAME, "; ".join(sorted(reasons))
        )
        model.set_experts_implementation(fallback)
        return fallback
    register_experts()
    model.set_experts_implementation(EXPERTS_HF_NAME)
    return EXPERTS_HF_NAME


_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.info(message)
