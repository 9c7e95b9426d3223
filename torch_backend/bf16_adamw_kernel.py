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
    w1,
    w2,
    decay_factor,
    step_size,
    bias2_sqrt,
    eps,
    LERP_FROM_START: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``P``, ``G``, ``M``, ``V``: int16 views of bfloat16 tensors of ``n`` elements; ``SEED_ptr``: one int64;
    ``w1``, ``w2``: ``1 - beta1``, ``1 - beta2`` taken in float64 by the caller, as torch does (float32's
    ``1 - 0.999`` is off by 1.3e-5 relative)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    p = (tl.load(P_ptr + offs, mask=ok, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    g = (tl.load(G_ptr + offs, mask=ok, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    m = (tl.load(M_ptr + offs, mask=ok, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    v = (tl.load(V_ptr + offs, mask=ok, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    if LERP_FROM_START:  # torch's lerp: start + w (end - start) for w < 0.5, else end - (end - start)(1 - w)
        m = m + w1 * (g - m)
    else:
        m = g - (g - m) * (1.0 - w1)
    v = v * beta2 + w2 * (g * g)
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


def adamw_bf16_8bit_kernel(
    P_ptr,
    G_ptr,
    MC_ptr,
    MA_ptr,
    VC_ptr,
    VA_ptr,
    SIGNED_ptr,
    UNSIGNED_ptr,
    SIGNED_BOUNDS_ptr,
    UNSIGNED_BOUNDS_ptr,
    SEED_ptr,
    n,
    beta1,
    beta2,
    w1,
    w2,
    decay_factor,
    step_size,
    bias2_sqrt,
    eps,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``AdamWBF16(eight_bit=True)``'s update of a bfloat16 parameter of ``n`` elements, ``ROWS`` quantisation blocks
    of ``BLOCK`` numbers per program: dequantise both moments (uint8 codes ``MC``/``VC``, float32 absmax per block
    ``MA``/``VA``, the 256-value maps), update them in float32 as ``common.run.adamw_8bit``'s rule does, move the
    weight (stochastically rounded, as ``adamw_bf16_kernel``), and store each moment's nearest code under its block's
    new absmax, found by an 8-step binary search over the 255 boundaries (a value on a boundary: the lower code)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    ok = offs < n
    row_ok = rows * BLOCK < n
    p = (tl.load(P_ptr + offs, mask=ok, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    g = (tl.load(G_ptr + offs, mask=ok, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    m_codes = tl.load(MC_ptr + offs, mask=ok, other=0).to(tl.int32)
    v_codes = tl.load(VC_ptr + offs, mask=ok, other=0).to(tl.int32)
    m_scale = tl.load(MA_ptr + rows, mask=row_ok, other=0.0)
    v_scale = tl.load(VA_ptr + rows, mask=row_ok, other=0.0)
    m = tl.load(SIGNED_ptr + m_codes) * m_scale[:, None]
    v = tl.load(UNSIGNED_ptr + v_codes) * v_scale[:, None]
    m = m * beta1 + g * w1  # w1, w2: 1 - beta taken in float64 by the caller, as the rule does
    v = v * beta2 + g * w2 * g
    m = tl.where(ok, m, 0.0)  # the numbers past the end are zeros, as the rule pads the last block
    v = tl.where(ok, v, 0.0)
    denom = tl.sqrt_rn(v) / bias2_sqrt + eps
    p = p * decay_factor
    p = p + (-step_size) * (m / denom)
    seed = tl.load(SEED_ptr)
    r0, _, _, _ = tl.randint4x(seed, offs.to(tl.uint32))
    p_bits = p.to(tl.int32, bitcast=True) + (r0 & 0xFFFF).to(tl.int32)
    tl.store(P_ptr + offs, (p_bits >> 16).to(tl.int16), mask=ok)
    m_max = tl.max(tl.abs(m), axis=1)
    v_max = tl.max(tl.abs(v), axis=1)
    m_norm = m / tl.where(m_max > 0, m_max, 1.0)[:, None]
    v_norm = v / tl.where(v_max > 0, v_max, 1.0)[:, None]
    m_count = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
    v_count = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
    for i in tl.static_range(8):  # 255 boundaries: the count is at most 255
        m_more = m_count + (128 >> i)
        v_more = v_count + (128 >> i)
        m_count = tl.where(tl.load(SIGNED_BOUNDS_ptr + m_more - 1) < m_norm, m_more, m_count)
        v_count = tl.where(tl.load(UNSIGNED_BOUNDS_ptr + v_more - 1) < v_norm, v_more, v_count)
    tl.store(MC_ptr + offs, m_count.to(tl.uint8), mask=ok)
    tl.store(VC_ptr + offs, v_count.to(tl.uint8), mask=ok)
    tl.store(MA_ptr + rows, m_max, mask=row_ok)
    tl.store(VA_ptr + rows, v_max, mask=row_ok)
