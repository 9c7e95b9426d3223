"""Triton kernel of ``AdamWBF16`` on CUDA: one pass over a bfloat16 parameter, its gradient and both moments.

An undecorated Triton source; ``bf16_adamw._kernel`` wraps it with ``triton.jit`` for CUDA, or with Triton's
interpreter (numpy, CPU tensors) for the CPU tests. The bfloat16 tensors come in as their int16 bit patterns (the
interpreter has no bfloat16): a bfloat16 is the upper half of a float32, so ``bits << 16`` is its exact float32, and
stochastic rounding is ``(float32 bits + r) >> 16`` with ``r`` uniform in [0, 2**16). Three 16-bit draws per element
(weight, first and second moment) come from one Philox call keyed by the step's seed for this tensor and the
element's index. The float32 update is ``torch.optim.AdamW``'s (``lerp`` for the first moment, the bias-corrected
denominator), computed once and written once: the torch loop of ``AdamWBF16`` reads and writes float32
temporaries about fifteen times.
"""

import triton.language as tl


def adamw_bf16_kernel(
    P_ptr,
    G_ptr,
    M_ptr,
    V_ptr,
    SEED_ptr,
    n,
    beta1,
    beta2,
    decay_factor,
    step_size,
    bias2_sqrt,
    eps,
    LERP_FROM_START: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``P``, ``G``, ``M``, ``V``: int16 views of bfloat16 tensors of ``n`` elements; ``SEED_ptr``: one int64."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    p = (tl.load(P_ptr + offs, mask=ok, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    g = (tl.load(G_ptr + offs, mask=ok, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    m = (tl.load(M_ptr + offs, mask=ok, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    v = (tl.load(V_ptr + offs, mask=ok, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    w1 = 1.0 - beta1
    if LERP_FROM_START:  # torch's lerp: start + w (end - start) for w < 0.5, else end - (end - start)(1 - w)
        m = m + w1 * (g - m)
    else:
        m = g - (g - m) * (1.0 - w1)
    v = v * beta2 + (1.0 - beta2) * (g * g)
    denom = tl.sqrt_rn(v) / bias2_sqrt + eps
    p = p * decay_factor
    p = p + (-step_size) * (m / denom)
    seed = tl.load(SEED_ptr)
    r0, r1, r2, _ = tl.randint4x(seed, offs.to(tl.uint32))
    mask16 = 0xFFFF
    p_bits = p.to(tl.int32, bitcast=True) + (r0 & mask16).to(tl.int32)
    m_bits = m.to(tl.int32, bitcast=True) + (r1 & mask16).to(tl.int32)
    v_bits = v.to(tl.int32, bitcast=True) + (r2 & mask16).to(tl.int32)
    tl.store(P_ptr + offs, (p_bits >> 16).to(tl.int16), mask=ok)
    tl.store(M_ptr + offs, (m_bits >> 16).to(tl.int16), mask=ok)
    tl.store(V_ptr + offs, (v_bits >> 16).to(tl.int16), mask=ok)
