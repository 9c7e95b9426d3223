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
        beta1,
        beta2,
        1 - lr * weight_decay,
        lr / (1 - beta1**step),
        math.sqrt(1 - beta2**step),
        eps,
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
    ``torch.optim.AdamW(foreach=False)`` exactly (plain writes, float32 moments): a test holds it to that."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = float(state["step"])
                mode = uses_kernel(p, p.grad)
                if mode is not None:
                    kernel_step_(
                        p.data, p.grad, state["exp_avg"], state["exp_avg_sq"], lr=lr, beta1=beta1, beta2=beta2,
                        eps=eps, weight_decay=decay, step=step, mode=mode,
                    )  # fmt: skip
                    continue
                bias1, bias2_sqrt = 1 - beta1**step, math.sqrt(1 - beta2**step)
                chunks = zip(
                    *(t.view(-1).split(CHUNK) for t in (p, state["exp_avg"], state["exp_avg_sq"])),
                    p.grad.reshape(-1).split(CHUNK),
                )
                for p_c, m_c, v_c, g_c in chunks:
                    g32 = g_c.float()
                    m32 = m_c.float().lerp_(g32, 1 - beta1)
                    v32 = v_c.float().mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
                    del g32
                    denom = v32.sqrt().div_(bias2_sqrt).add_(eps)
                    p32 = p_c.float()
                    if decay:
                        p32.mul_(1 - lr * decay)
                    p32.addcdiv_(m32, denom, value=-lr / bias1)
                    del denom
                    round_stochastic_(p_c, p32)
                    round_stochastic_(m_c, m32)
                    round_stochastic_(v_c, v32)
        return loss
