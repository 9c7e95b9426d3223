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

Backward of one chunk, ``h = gate(gate_up)``, ``w`` the copy's routing weight, ``dy`` the output's gradient at
the copy's token, ``b`` the down bias (zero without one)::

    g = dy @ down_proj[e]          # [C, I]
    d w = sum(g * h, -1) + sum(dy * b[e], -1);  d down_proj[e] = (w * dy).T @ h;  d b[e] = sum(w * dy)
    d gate_up = vjp(gate, gate_up)(w * g)
    d gate_up_proj[e] = d gate_up.T @ x[t];  d gate_up_bias[e] = sum(d gate_up);  d x[t] += d gate_up @ gate_up_proj[e]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

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


def route(top_k_index_TK: torch.Tensor, num_experts: int, chunk_rows: Optional[int] = None) -> Routing:
    """Sort the copies of ``top_k_index_TK`` by expert and cut them into chunks of whole experts of about
    ``chunk_rows`` rows (default ``T / CHUNK_DIVISOR``; an expert is never split, and gets at most ``T`` copies).

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
        if e == num_experts - 1 or rows + counts[e + 1] > limit:
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
        y_TH = torch.zeros_like(x_TH)
        gate_up_SF = x_TH.new_empty((routing.token_S.numel(), layout.input_side(gate_up_E).shape[2]))
        for (e0, e1, r0, r1), offs in zip(routing.chunks, routing.offsets):
            if r0 == r1:
                continue
            token_C = routing.token_S[r0:r1]
            gate_up_CF = _grouped_mm(x_TH[token_C], layout.input_side(gate_up_E[e0:e1]), offs)
            if gate_up_bias_EF is not None:
                gate_up_CF += gate_up_bias_EF[routing.expert_S[r0:r1]]
            gate_up_SF[r0:r1] = gate_up_CF
            h_CI = layout.apply_gate(gate_up_CF)
            del gate_up_CF
            out_CH = _grouped_mm(h_CI, layout.input_side(down_E[e0:e1]), offs)
            del h_CI
            if down_bias_EH is not None:
                out_CH += down_bias_EH[routing.expert_S[r0:r1]]
            if out_CH.dtype == weight_S.dtype:  # in place: one [C, H] temporary less
                y_TH.index_add_(0, token_C, out_CH.mul_(weight_S[r0:r1, None]).to(y_TH.dtype))
            else:
                y_TH.index_add_(0, token_C, (out_CH * weight_S[r0:r1, None]).to(y_TH.dtype))
        ctx.save_for_backward(x_TH, weight_S, gate_up_E, down_E, gate_up_bias_EF, down_bias_EH, gate_up_SF)
        ctx.routing, ctx.layout = routing, layout
        return y_TH

    @staticmethod
    def backward(ctx: Any, dy_TH: torch.Tensor):  # type: ignore[override]
        x_TH, weight_S, gate_up_E, down_E, gate_up_bias_EF, down_bias_EH, gate_up_SF = ctx.saved_tensors
        routing, layout = ctx.routing, ctx.layout
        need = ctx.needs_input_grad
        dx_TH = torch.zeros_like(x_TH) if need[0] else None
        dweight_S = torch.zeros_like(weight_S) if need[1] else None
        # every expert's slice is written below (an expert with no copy: zeroed by _zero_empty)
        dgate_up = torch.empty_like(gate_up_E) if need[2] else None
        ddown = torch.empty_like(down_E) if need[3] else None
        dgate_up_bias = torch.zeros_like(gate_up_bias_EF) if need[4] else None
        ddown_bias = torch.zeros_like(down_bias_EH) if need[5] else None
        for (e0, e1, r0, r1), offs in zip(routing.chunks, routing.offsets):
            if r0 == r1:
                continue
            token_C, expert_C, w_C1 = routing.token_S[r0:r1], routing.expert_S[r0:r1], weight_S[r0:r1, None]
            dy_CH = dy_TH[token_C]
            with torch.enable_grad():
                gate_up_CF = gate_up_SF[r0:r1].detach().requires_grad_(True)
                h_CI = layout.apply_gate(gate_up_CF)
            g_CI = _grouped_mm(dy_CH, layout.input_side(down_E[e0:e1]).transpose(-2, -1), offs)
            if dweight_S is not None:
                dw_C = (g_CI * h_CI.detach()).sum(-1)
                if down_bias_EH is not None:
                    dw_C += (dy_CH * down_bias_EH[expert_C]).sum(-1)
                dweight_S[r0:r1] = dw_C.to(dweight_S.dtype)
            dout_CH = dy_CH.mul_(w_C1) if dy_CH.dtype == w_C1.dtype else (dy_CH * w_C1).to(dy_CH.dtype)
            del dy_CH
            if ddown is not None:
                ddown[e0:e1] = layout.weight_grad(h_CI.detach(), dout_CH, offs)
            if ddown_bias is not None:
                ddown_bias.index_add_(0, expert_C, dout_CH.to(ddown_bias.dtype))
            del dout_CH
            (dgate_up_CF,) = torch.autograd.grad(h_CI, gate_up_CF, g_CI * w_C1.to(g_CI.dtype))
            del g_CI, h_CI, gate_up_CF
            if dgate_up is not None:
                dgate_up[e0:e1] = layout.weight_grad(x_TH[token_C], dgate_up_CF, offs)
            if dgate_up_bias is not None:
                dgate_up_bias.index_add_(0, expert_C, dgate_up_CF.to(dgate_up_bias.dtype))
            if dx_TH is not None:
                gate_up_T = layout.input_side(gate_up_E[e0:e1]).transpose(-2, -1)
                dx_TH.index_add_(0, token_C, _grouped_mm(dgate_up_CF, gate_up_T, offs))
        for grad in (dgate_up, ddown):
            _zero_empty(grad, routing)
        return dx_TH, dweight_S, dgate_up, ddown, dgate_up_bias, ddown_bias, None, None


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
    item = experts.down_proj.element_size()
    if any((n * item) % GROUPED_MM_ALIGN_BYTES for n in experts.down_proj.shape[1:]):
        return f"hidden or intermediate size {tuple(experts.down_proj.shape[1:])} not a multiple of 16 bytes"
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
