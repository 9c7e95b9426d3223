"""Triton kernels of the linear cross-entropy (``triton_ce``): imported only when Triton is.

The functions below are undecorated Triton sources; ``triton_ce._kernels`` wraps them with
``triton.jit`` for CUDA, or with Triton's interpreter (numpy, CPU tensors) for the CPU tests.

Notation: ``h`` [n, D] hidden rows, ``W`` [V, D] the lm_head, ``x = h @ W.T`` the raw logits,
``z = c * tanh(x / c)`` the soft-capped ones (``z = x`` without a cap), ``lse = logsumexp(z)``,
``p = exp(z - lse)``, the target's log-prob ``logp = z[target] - lse`` and the entropy
``ent = lse - sum(p * z)``. Every tile of logits lives in registers only: forward streams the
vocabulary through an online logsumexp, backward recomputes a [BLOCK_N, BLOCK_V] tile and
adds its share of ``dh`` and ``dW`` with fp32 atomics.
"""

import triton.language as tl


def fwd_kernel(H_ptr, W_ptr, T_ptr, LSE_ptr, LOGP_ptr, ENT_ptr, HIT_ptr, n, V: tl.constexpr, D: tl.constexpr,
               stride_h, stride_w, softcap,
               HAS_CAP: tl.constexpr, WITH_ENT: tl.constexpr, IEEE: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per BLOCK_N rows: stream the vocabulary, keep (max, sum exp, sum exp * z, z[target])."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    tgt = tl.load(T_ptr + rows, mask=row_ok, other=-100)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    zt = tl.zeros((BLOCK_N,), tl.float32)
    dd = tl.arange(0, BLOCK_D)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        x = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + dd
            h = tl.load(H_ptr + rows[:, None] * stride_h + d[None, :], mask=row_ok[:, None] & (d[None, :] < D),
                        other=0.0)
            w = tl.load(W_ptr + cols[None, :] * stride_w + d[:, None], mask=col_ok[None, :] & (d[:, None] < D),
                        other=0.0)
            if IEEE:
                x = tl.dot(h, w, x, input_precision="ieee")
            else:
                x = tl.dot(h, w, x)
        z = x
        if HAS_CAP:  # tanh from exp (the interpreter has no libdevice): |error| ~1e-7; overflow gives +-1
            e = tl.exp(-2.0 * tl.abs(x / softcap))
            z = tl.where(x >= 0, 1.0, -1.0) * ((1.0 - e) / (1.0 + e)) * softcap
        m_new = tl.maximum(m, tl.max(tl.where(col_ok[None, :], z, float("-inf")), 1))
        alpha = tl.exp(m - m_new)
        p = tl.where(col_ok[None, :], tl.exp(z - m_new[:, None]), 0.0)
        s = s * alpha + tl.sum(p, 1)
        if WITH_ENT:
            t = t * alpha + tl.sum(p * z, 1)
        zt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), 1)
        m = m_new
    lse = m + tl.log(s)
    valid = tgt >= 0
    tl.store(LSE_ptr + rows, lse, mask=row_ok)
    tl.store(LOGP_ptr + rows, tl.where(valid, zt - lse, 0.0), mask=row_ok)
    tl.store(HIT_ptr + rows, tl.where(valid & (zt >= m), 1.0, 0.0), mask=row_ok)
    if WITH_ENT:
        tl.store(ENT_ptr + rows, lse - t / s, mask=row_ok)


def bwd_kernel(H_ptr, W_ptr, T_ptr, LSE_ptr, ENT_ptr, GLOGP_ptr, GENT_ptr, DH_ptr, DW_ptr,
               n, V: tl.constexpr, D: tl.constexpr, v_start, v_stop, stride_h, stride_w, stride_dh, stride_dw,
               softcap, filter_eps,
               HAS_CAP: tl.constexpr, WITH_ENT: tl.constexpr, NEED_DH: tl.constexpr, NEED_DW: tl.constexpr,
               FILTER: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
               BLOCK_D: tl.constexpr, GROUP_N: tl.constexpr):
    """One program per (BLOCK_N rows, BLOCK_V vocabulary columns of [v_start, v_stop)) tile.

    ``V`` and ``D`` are compile-time constants (one compilation per model), as the interpreter
    cannot loop over a run-time bound.

    ``dz = g_logp (onehot - p) - g_ent p (z - E[z])`` with ``E[z] = lse - ent``; times ``1 - (z / c)^2``
    with a cap. ``dh[rows] += dz @ W[cols]`` and ``dW[cols - v_start] += dz.T @ h[rows]`` (fp32 atomics).
    Programs are ordered GROUP_N row blocks at a time so that a group's rows stay in L2.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(n, BLOCK_N)
    num_v = tl.cdiv(v_stop - v_start, BLOCK_V)
    per_group = GROUP_N * num_v
    first_n = (pid // per_group) * GROUP_N
    group_size = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_size
    pid_v = (pid % per_group) // group_size
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = v_start + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < n
    col_ok = cols < v_stop
    dd = tl.arange(0, BLOCK_D)
    x = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + dd
        h = tl.load(H_ptr + rows[:, None] * stride_h + d[None, :], mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
        w = tl.load(W_ptr + cols[None, :] * stride_w + d[:, None], mask=col_ok[None, :] & (d[:, None] < D), other=0.0)
        if IEEE:
            x = tl.dot(h, w, x, input_precision="ieee")
        else:
            x = tl.dot(h, w, x)
    z = x
    if HAS_CAP:  # the forward's tanh, bit for bit
        e = tl.exp(-2.0 * tl.abs(x / softcap))
        z = tl.where(x >= 0, 1.0, -1.0) * ((1.0 - e) / (1.0 + e)) * softcap
    tgt = tl.load(T_ptr + rows, mask=row_ok, other=-100)
    valid = row_ok & (tgt >= 0)
    lse = tl.load(LSE_ptr + rows, mask=row_ok, other=0.0)
    p = tl.where(valid[:, None] & col_ok[None, :], tl.exp(z - lse[:, None]), 0.0)
    is_tgt = cols[None, :] == tgt[:, None]
    if WITH_ENT:
        mean_z = lse - tl.load(ENT_ptr + rows, mask=row_ok, other=0.0)
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
    g_lp = tl.where(valid, tl.load(GLOGP_ptr + rows, mask=row_ok, other=0.0), 0.0)
    dz = g_lp[:, None] * (tl.where(is_tgt, 1.0, 0.0) - p)
    if WITH_ENT:
        g_ent = tl.where(valid, tl.load(GENT_ptr + rows, mask=row_ok, other=0.0), 0.0)
        dz -= g_ent[:, None] * p_dev
    if HAS_CAP:
        zc = z / softcap
        dz = dz * (1.0 - zc * zc)
    dz_lo = dz.to(H_ptr.dtype.element_ty)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + dd
        d_ok = d < D
        if NEED_DH:
            w = tl.load(W_ptr + cols[:, None] * stride_w + d[None, :], mask=col_ok[:, None] & d_ok[None, :],
                        other=0.0)
            if IEEE:
                dh = tl.dot(dz_lo, w, input_precision="ieee")
            else:
                dh = tl.dot(dz_lo, w)
            tl.atomic_add(DH_ptr + rows[:, None] * stride_dh + d[None, :], dh, mask=row_ok[:, None] & d_ok[None, :])
        if NEED_DW:
            h = tl.load(H_ptr + rows[:, None] * stride_h + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                        other=0.0)
            if IEEE:
                dw = tl.dot(tl.trans(dz_lo), h, input_precision="ieee")
            else:
                dw = tl.dot(tl.trans(dz_lo), h)
            tl.atomic_add(DW_ptr + (cols - v_start)[:, None] * stride_dw + d[None, :], dw,
                          mask=col_ok[:, None] & d_ok[None, :])
