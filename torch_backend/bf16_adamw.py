"""AdamW for bfloat16 weights (``optimizer='adamw_bf16'``): 8 bytes of training state per parameter.

The weights, their gradients and both moments are held in bfloat16 (2 + 2 + 2 + 2 bytes, against 16 for float32
weights with float32 AdamW). Each step computes the update in float32, exactly as ``torch.optim.AdamW`` does,
and writes the weights and moments back with stochastic rounding: a value between two neighbouring bfloat16
numbers goes to the upper one with probability equal to its distance from the lower one over their spacing. The
expectation is the float32 value, so an update smaller than half of bfloat16's spacing (``lr * m / sqrt(v)`` is
often 1e-5 of the weight, bfloat16's spacing 2**-8 to 2**-7 of it) still moves the weight on average, where rounding to
nearest would drop it every step and the run would stall.

On CUDA one Triton kernel (``bf16_adamw_kernel``) reads and writes each tensor once. Elsewhere a torch loop
computes the same float32 update; it updates large tensors (the embedding) in chunks of ``CHUNK`` elements, so its
float32 temporaries stay a few hundred MB whatever the model. The random bits come from torch's generator of the
parameters' device (the kernel's seeds too): a checkpoint's ``rng`` entry holds it, so a resumed run draws the same
roundings as an uninterrupted one.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Iterable, Optional

import torch

from twinseq.torch_backend import adamw_8bit
from twinseq.torch_backend.triton_ce import kernel_mode, wrap_kernels

CHUNK = 1 << 24
"""Elements per float32 temporary of the torch update (64 MiB each)."""

BLOCK = 1024
"""Elements per program of the Triton kernel."""

_LOW_HALF_CLEARED = -65536  # 0xFFFF0000 as int32: keeps a float32's sign, exponent and bfloat16's 7 mantissa bits


def round_stochastic_(dst: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``dst`` (bfloat16) <- float32 ``value`` stochastically rounded; ``value`` is used as scratch space.

    The 16 low bits of the float32 pattern are what bfloat16 drops: adding a uniform 16-bit integer carries
    into the kept bits with probability (low bits) / 2**16, which is the distance to the lower neighbour over
    the spacing; the sign is a separate bit, so negative values round away from or towards zero alike. A
    ``dst`` of another dtype gets a plain copy (float32 weights: the exact ``torch.optim.AdamW`` update).

    >>> x = torch.full((100_000,), 1.0 + 2.0**-10)  # an eighth of the way from 1 to the next bfloat16, 1 + 2**-7
    >>> out = torch.empty_like(x, dtype=torch.bfloat16)
    >>> _ = torch.manual_seed(0); _ = round_stochastic_(out, x.clone())
    >>> sorted(set(out.float().tolist())) == [1.0, 1.0 + 2.0**-7], round(out.double().mean().item() - 1, 4)
    (True, 0.001)
    """
    if dst.dtype != torch.bfloat16:
        return dst.copy_(value)
    bits = value.view(torch.int32)
    bits.add_(torch.randint_like(bits, 0, 1 << 16)).bitwise_and_(_LOW_HALF_CLEARED)
    return dst.copy_(bits.view(torch.float32))


@functools.lru_cache(maxsize=2)
def _kernel(mode: str) -> Any:
    from twinseq.torch_backend import bf16_adamw_kernel as k  # optional dependency: imports triton.language

    return wrap_kernels(mode, k.adamw_bf16_kernel, do_not_specialize=["n"])[0]


@functools.lru_cache(maxsize=2)
def _kernel_8bit(mode: str) -> Any:
    from twinseq.torch_backend import bf16_adamw_kernel as k  # optional dependency: imports triton.language

    return wrap_kernels(mode, k.adamw_bf16_8bit_kernel, do_not_specialize=["n"])[0]


def _step_scalars(
    *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: float
) -> tuple[float, ...]:
    """The kernels' scalar arguments after ``n``: the betas, ``1 - beta`` taken here in float64 (float32's
    ``1 - 0.999`` is 1.3e-5 relative off), the decay factor, the bias-corrected step size and denominator, eps."""
    return (
        beta1,
        beta2,
        1 - beta1,
        1 - beta2,
        1 - lr * weight_decay,
        lr / (1 - beta1**step),
        math.sqrt(1 - beta2**step),
        eps,
    )


ROWS_8BIT = 4
"""Quantisation blocks per program of the 8-bit kernel."""


def kernel_step_8bit_(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    mode: str,
) -> None:
    """One ``AdamWBF16(eight_bit=True)`` update of a contiguous bfloat16 ``p`` by the Triton kernel
    (``bf16_adamw_kernel.adamw_bf16_8bit_kernel``): the rule's float32 arithmetic, one read and one write of the
    weight, its gradient, both moments' codes and absmax."""
    n = p.numel()
    maps = adamw_8bit.code_maps(p.device)
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=p.device)
    blocks = -(-n // adamw_8bit.BLOCK)
    _kernel_8bit(mode)[(triton_cdiv(blocks, ROWS_8BIT),)](
        p.view(torch.int16),
        grad.view(torch.int16),
        state["exp_avg_codes"],
        state["exp_avg_absmax"],
        state["exp_avg_sq_codes"],
        state["exp_avg_sq_absmax"],
        maps["signed"][0],
        maps["unsigned"][0],
        maps["signed"][1],
        maps["unsigned"][1],
        seed,
        n,
        *_step_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step),
        ROWS=ROWS_8BIT,
        BLOCK=adamw_8bit.BLOCK,
    )


def kernel_step_(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: float,
    mode: str,
) -> None:
    """One ``AdamWBF16`` update of a contiguous bfloat16 ``p`` by the Triton kernel (``bf16_adamw_kernel``): the
    same float32 arithmetic as the torch loop, one read and one write of each tensor. The seed of the kernel's
    random draws comes from torch's generator of ``p``'s device, as the torch loop's draws do."""
    n = p.numel()
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=p.device)
    as_bits = [t.view(torch.int16) for t in (p, grad, exp_avg, exp_avg_sq)]
    _kernel(mode)[(triton_cdiv(n, BLOCK),)](
        *as_bits,
        seed,
        n,
        *_step_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step),
        LERP_FROM_START=(1 - beta1) < 0.5,
        BLOCK=BLOCK,
    )


def triton_cdiv(n: int, block: int) -> int:
    return -(-n // block)


INTERPRET_ON_CPU = False
"""True: CPU parameters go through the kernel under Triton's interpreter (tests; slow), not the torch loop."""


def uses_kernel(p: torch.Tensor, grad: torch.Tensor) -> Optional[str]:
    """The kernel's mode for this parameter: ``"cuda"`` on a GPU with Triton, ``"interpret"`` on CPU when
    ``INTERPRET_ON_CPU`` and Triton's interpreter are on; None otherwise (the torch loop runs)."""
    if p.dtype != torch.bfloat16 or grad.dtype != torch.bfloat16:
        return None
    if not (p.is_contiguous() and grad.is_contiguous()):
        return None
    mode = kernel_mode(p.device)
    return mode if mode == "cuda" or (mode == "interpret" and INTERPRET_ON_CPU) else None


class AdamWBF16(torch.optim.Optimizer):
    """``torch.optim.AdamW`` (decoupled weight decay, bias-corrected moments) for bfloat16 parameters, with
    bfloat16 moments and stochastically rounded writes (module docstring). On float32 parameters it is
    ``torch.optim.AdamW(foreach=False)`` exactly (plain writes, float32 moments): a test holds it to that.

    ``eight_bit=True`` (``optimizer='adamw_bf16_8bit'``): each moment of a tensor of at least 4,096 numbers is 8-bit
    blockwise (``adamw_8bit``: ``common.run.adamw_8bit``'s rule), smaller tensors keep float32 moments; the weights
    are written as above. ``update_parameter`` steps one parameter (``optimizer_in_backward`` calls it from the
    parameter's gradient hook); ``step`` steps them all."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        eight_bit: bool = False,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.eight_bit = eight_bit
        # a group's index, not the dict: load_state_dict replaces the group dicts (the schedule writes the new ones)
        self.group_index = {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update_parameter(p, group)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict`` casts every floating state tensor to its parameter's dtype; the 8-bit moments'
        absmax, and a small tensor's moments under ``eight_bit``, are float32 whatever the weights: they are put back
        as saved."""
        float32_keys = _FLOAT32_KEYS | ({"exp_avg", "exp_avg_sq"} if self.eight_bit else set())
        kept = {
            pid: {k: v for k, v in entry.items() if k in float32_keys and isinstance(v, torch.Tensor)}
            for pid, entry in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for pid, p in zip(saved_ids, params):
            for key, value in kept.get(pid, {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=torch.float32)

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = torch.tensor(0.0)
        if self.eight_bit and adamw_8bit.is_quantized(p):
            state["exp_avg_codes"], state["exp_avg_absmax"] = adamw_8bit.init_moment(p)
            state["exp_avg_sq_codes"], state["exp_avg_sq_absmax"] = adamw_8bit.init_moment(p)
        else:
            dtype = torch.float32 if self.eight_bit else p.dtype  # the rule keeps small tensors' moments float32
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def update_parameter(self, p: torch.Tensor, group: Optional[dict[str, Any]] = None) -> None:
        """One AdamW step of ``p`` with its gradient ``p.grad`` and its group's hyper-parameters."""
        group = self.param_groups[self.group_index[p]] if group is None else group
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        grad = p.grad
        assert grad is not None, "update_parameter needs the parameter's gradient"
        state = self.state[p] or self._init_state(p)
        state["step"] += 1
        step = float(state["step"])
        if "exp_avg_codes" in state:
            mode = uses_kernel(p, grad)
            if mode is not None:
                kernel_step_8bit_(
                    p.data, grad, state, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=decay, step=step,
                    mode=mode,
                )  # fmt: skip
                return
            self._update_8bit(p, grad, state, lr=lr, beta1=beta1, beta2=beta2, eps=eps, decay=decay, step=step)
            return
        mode = uses_kernel(p, grad) if state["exp_avg"].dtype == p.dtype else None
        if mode is not None:
            kernel_step_(
                p.data, grad, state["exp_avg"], state["exp_avg_sq"], lr=lr, beta1=beta1, beta2=beta2,
                eps=eps, weight_decay=decay, step=step, mode=mode,
            )  # fmt: skip
            return
        bias1, bias2_sqrt = 1 - beta1**step, math.sqrt(1 - beta2**step)
        chunks = zip(
            *(t.view(-1).split(CHUNK) for t in (p, state["exp_avg"], state["exp_avg_sq"])),
            grad.reshape(-1).split(CHUNK),
        )
        for p_c, m_c, v_c, g_c in chunks:
            g32 = g_c.float()
            m32 = m_c.float().lerp_(g32, 1 - beta1)
            v32 = v_c.float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
            del g32
            _move_weight_(p_c, m32, v32, lr=lr, eps=eps, decay=decay, bias1=bias1, bias2_sqrt=bias2_sqrt)
            round_stochastic_(m_c, m32)
            round_stochastic_(v_c, v32)

    def _update_8bit(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float, beta1: float, beta2: float, eps: float,
        decay: float, step: float,
    ) -> None:  # fmt: skip
        """The rule's step (``common.run.adamw_8bit.step``), ``adamw_8bit.CHUNK`` numbers at a time: dequantise, the
        float32 moments as the rule writes them, the weight, re-quantise."""
        bias1, bias2_sqrt = 1 - beta1**step, math.sqrt(1 - beta2**step)
        per = adamw_8bit.CHUNK // adamw_8bit.BLOCK
        flat = [t.view(-1).split(adamw_8bit.CHUNK) for t in (p, state["exp_avg_codes"], state["exp_avg_sq_codes"])]
        absmax = [state[k].split(per) for k in ("exp_avg_absmax", "exp_avg_sq_absmax")]
        for p_c, mc_c, vc_c, g_c, ma_c, va_c in zip(*flat, grad.reshape(-1).split(adamw_8bit.CHUNK), *absmax):
            g32 = g_c.float()
            # the rule's order of operations: beta1 m + (1 - beta1) g, beta2 v + ((1 - beta2) g) g
            m32 = adamw_8bit.dequantize(mc_c, ma_c, "signed").mul_(beta1).add_(g32 * (1 - beta1))
            v32 = adamw_8bit.dequantize(vc_c, va_c, "unsigned").mul_(beta2).add_(g32 * (1 - beta2) * g32)
            del g32  # (g32 is the gradient itself when it is float32: never written)
            _move_weight_(p_c, m32, v32, lr=lr, eps=eps, decay=decay, bias1=bias1, bias2_sqrt=bias2_sqrt)
            adamw_8bit.quantize_(mc_c, ma_c, m32, "signed")
            adamw_8bit.quantize_(vc_c, va_c, v32, "unsigned")


_FLOAT32_KEYS = frozenset({"exp_avg_absmax", "exp_avg_sq_absmax"})


def _move_weight_(
    p_c: torch.Tensor, m32: torch.Tensor, v32: torch.Tensor, *, lr: float, eps: float, decay: float, bias1: float,
    bias2_sqrt: float,
) -> None:  # fmt: skip
    """``p_c <- p_c (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)`` in float32, written back stochastically rounded
    (bfloat16) or plainly (float32)."""
    denom = v32.sqrt().div_(bias2_sqrt).add_(eps)
    p32 = p_c.float()
    if decay:
        p32.mul_(1 - lr * decay)
    p32.addcdiv_(m32, denom, value=-lr / bias1)
    del denom
    round_stochastic_(p_c, p32)
