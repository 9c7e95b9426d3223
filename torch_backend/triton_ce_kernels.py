"""Triton kernels of the linear cross-entropy (``triton_ce``): imported only when Triton is.

The functions below are undecorated Triton sources; ``triton_ce._kernels`` wraps them with
``triton.jit`` for CUDA, or with Triton's interpreter (numpy, CPU tensors) for the CPU tests.

Notation: ``h`` [N, D] hidden rows, ``W`` [V, D] the lm_head, ``x = h @ W.T`` the raw logits,
``z = c * tanh(x / c)`` the soft-capped ones (``z = x`` without a cap), ``lse = logsumexp(z)``,
``p = exp(z - lse)``, the target's log-prob ``logp = z[target] - lse`` and the entropy
``ent = lse - sum(p * z)``. Every tile of logits lives in registers only: forward streams a
vocabulary split through an online logsumexp, backward recomputes a [BLOCK_N, BLOCK_V] tile and
adds its share of ``dh`` and ``dW`` with atomics.

Rows: the kernels work on ``n`` compact rows ``r``; with ``HAS_IDX`` row ``r`` is hidden row
``IDX[r]`` (the rows whose target is not -100, so ignored rows cost nothing and are never copied),
without it ``r`` itself. Per-row inputs and outputs (targets, lse, partial sums, upstream gradients)
are compact; ``h`` and ``dh`` are indexed through ``IDX``.
"""

import triton.language as tl


def fwd_kernel(
    H_ptr,
    W_ptr,
    T_ptr,
    IDX_ptr,
    PM_ptr,
    PS_ptr,
    PT_ptr,
    PZ_ptr,
    n,
    V: tl.constexpr,
    D: tl.constexpr,
    stride_h,
    stride_w,
    softcap,
    HAS_IDX: tl.constexpr,
    HAS_CAP: tl.constexpr,
    WITH_ENT: tl.constexpr,
    IEEE: tl.constexpr,
    V_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per (BLOCK_N rows, V_SPLIT vocabulary columns): stream the split's columns and write the
    split's partial (max, sum exp, sum exp * z, z[target]) to row ``split * n + r`` of the [splits, n] buffers.

    Programs that run together share a split (axis 0 is the row block), so a tile of ``W`` is read from memory
    once and from L2 by the other row blocks. ``triton_ce._combine`` merges the splits.
    """
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    r_ok = r < n
    if HAS_IDX:
        rows = tl.load(IDX_ptr + r, mask=r_ok, other=0)
    else:
        rows = r
    tgt = tl.load(T_ptr + r, mask=r_ok, other=-100)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    zt = tl.zeros((BLOCK_N,), tl.float32)
    dd = tl.arange(0, BLOCK_D)
    for v0 in range(0, V_SPLIT, BLOCK_V):
        cols = split * V_SPLIT + v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        x = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + dd
            h = tl.load(H_ptr + rows[:, None] * stride_h + d[None, :], mask=r_ok[:, None] & (d[None, :] < D), other=0.0)
            w = tl.load(
                W_ptr + cols[None, :] * stride_w + d[:, None], mask=col_ok[None, :] & (d[:, None] < D), other=0.0
            )
            if IEEE:
                x = tl.dot(h, w, x, input_precision="ieee")
            else:
                x = tl.dot(h, w, x)
        z = x
        if HAS_CAP:  # tanh from exp (the interpreter has no libdevice): |error| ~1e-7; overflow gives +-1
            e = tl.exp(-2.0 * tl.abs(x / softcap))
            z = tl.where(x >= 0, 1.0, -1.0) * ((1.0 - e) / (1.0 + e)) * softcap
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(z - m_new[:, None])
        s = s * alpha + tl.sum(p, 1)
        if WITH_ENT:
            t = t * alpha + tl.sum(p * tl.where(col_ok[None, :], z, 0.0), 1)
        zt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), 1)
        m = m_new
    out = split * n + r
    tl.store(PM_ptr + out, m, mask=r_ok)
    tl.store(PS_ptr + out, s, mask=r_ok)
    tl.store(PZ_ptr + out, zt, mask=r_ok)
    if WITH_ENT:
        tl.store(PT_ptr + out, t, mask=r_ok)


def bwd_kernel(
    H_ptr,
    W_ptr,
    T_ptr,
    IDX_ptr,
    LSE_ptr,
    ENT_ptr,
    GLOGP_ptr,
    GENT_ptr,
    DH_ptr,
    DW_ptr,
    n,
    V: tl.constexpr,
    D: tl.constexpr,
    v_start,
    v_stop,
    stride_h,
    stride_w,
    stride_dh,
    stride_dw,
    softcap,
    filter_eps,
    HAS_IDX: tl.constexpr,
    HAS_CAP: tl.constexpr,
    WITH_ENT: tl.constexpr,
    NEED_DH: tl.constexpr,
    NEED_DW: tl.constexpr,
    FILTER: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    """One program per (BLOCK_N rows, BLOCK_V vocabulary columns of [v_start, v_stop)) tile.

    ``V`` and ``D`` are compile-time constants (one compilation per model), as the interpreter
    cannot loop over a run-time bound.

    ``dz = g_logp (onehot - p) - g_ent p (z - E[z])`` with ``E[z] = lse - ent``; times ``1 - (z / c)^2``
    with a cap. ``dh[rows] += dz @ W[cols]`` and ``dW[cols - v_start] += dz.T @ h[rows]`` (atomics, in the
    buffers' dtypes; BLOCK_D2 columns of ``D`` at a time). Programs are ordered GROUP_N row blocks at a time so
    that a group's rows stay in L2.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(n, BLOCK_N)
    num_v = tl.cdiv(v_stop - v_start, BLOCK_V)
    per_group = GROUP_N * num_v
    first_n = (pid // per_group) * GROUP_N
    group_size = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_size
    pid_v = (pid % per_group) // group_size
    r = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok = r < n
    if HAS_IDX:
        rows = tl.load(IDX_ptr + r, mask=r_ok, other=0)
    else:
        rows = r
    cols = v_start + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < v_stop
    dd = tl.arange(0, BLOCK_D)
    x = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + dd
        h = tl.load(H_ptr + rows[:, None] * stride_h + d[None, :], mask=r_ok[:, None] & (d[None, :] < D), other=0.0)
        w = tl.load(W_ptr + cols[None, :] * stride_w + d[:, None], mask=col_ok[None, :] & (d[:, None] < D), other=0.0)
        if IEEE:
            x = tl.dot(h, w, x, input_precision="ieee")
        else:
            x = tl.dot(h, w, x)
    z = x
    if HAS_CAP:  # the forward's tanh, bit for bit
        e = tl.exp(-2.0 * tl.abs(x / softcap))
        z = tl.where(x >= 0, 1.0, -1.0) * ((1.0 - e) / (1.0 + e)) * softcap
    tgt = tl.load(T_ptr + r, mask=r_ok, other=-100)
    valid = r_ok & (tgt >= 0)
    lse = tl.load(LSE_ptr + r, mask=r_ok, other=0.0)
    p = tl.where(valid[:, None] & col_ok[None, :], tl.exp(z - lse[:, None]), 0.0)
    is_tgt = cols[None, :] == tgt[:, None]
    if WITH_ENT:
        mean_z = lse - tl.load(ENT_ptr + r, mask=r_ok, other=0.0)
        p_dev = p * (z - mean_z[:, None])
    if FILTER:
        # gradient filtering, per unit of upstream gradient: skip a tile that holds no target and whose every
        # |d logp / dz| = p (and |d ent / dz| = p |z - E[z]|) is below filter_eps (the cap's derivative is <= 1)
        mag = p
        if WITH_ENT:
            mag = tl.maximum(mag, tl.abs(p_dev))
        num_tgt = tl.sum(tl.sum(tl.where(is_tgt, 1, 0), 1), 0)
        if (tl.max(tl.max(mag, 1), 0) < filter_eps) & (num_tgt == 0):
            return
    g_lp = tl.where(valid, tl.load(GLOGP_ptr + r, mask=r_ok, other=0.0), 0.0)
    dz = g_lp[:, None] * (tl.where(is_tgt, 1.0, 0.0) - p)
    if WITH_ENT:
        g_ent = tl.where(valid, tl.load(GENT_ptr + r, mask=r_ok, other=0.0), 0.0)
        dz -= g_ent[:, None] * p_dev
    if HAS_CAP:
        zc = z / softcap
        dz = dz * (1.0 - zc * zc)
    dz_lo = dz.to(H_ptr.dtype.element_ty)
    dd2 = tl.arange(0, BLOCK_D2)
    for d0 in range(0, D, BLOCK_D2):
        d = d0 + dd2
        d_ok = d < D
        if NEED_DH:
            w = tl.load(W_ptr + cols[:, None] * stride_w + d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                dh = tl.dot(dz_lo, w, input_precision="ieee")
            else:
                dh = tl.dot(dz_lo, w)
            tl.atomic_add(
                DH_ptr + rows[:, None] * stride_dh + d[None, :],
                dh.to(DH_ptr.dtype.element_ty),
                mask=r_ok[:, None] & d_ok[None, :],
                sem="relaxed",
            )
        if NEED_DW:
            h = tl.load(H_ptr + rows[:, None] * stride_h + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                dw = tl.dot(tl.trans(dz_lo), h, input_precision="ieee")
            else:
                dw = tl.dot(tl.trans(dz_lo), h)
            tl.atomic_add(
                DW_ptr + (cols - v_start)[:, None] * stride_dw + d[None, :],
                dw.to(DW_ptr.dtype.element_ty),
                mask=col_ok[:, None] & d_ok[None, :],
                sem="relaxed",
            )
