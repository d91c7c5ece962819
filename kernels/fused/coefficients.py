"""Fused mHC coefficients (mhc-math.md §2-3, §10): GEMM + sum of squares + sigma / 2 sigma + Sinkhorn.

Forward, one kernel: one read of x [N, nC] yields the raw projection L = x phi [N, M] (fp32 accumulate,
M = n^2 + 2n) and sum(x^2); the per-token tail (norm-after-matmul, gates, bias, sigma, Sinkhorn) runs in
fp32 registers. Only L and 1/r (M + 1 floats per token) are kept for the backward.

Backward, two kernels:
- `_coef_bwd_tok`: per token, recomputes the Sinkhorn iterates in registers (from the start for every
  backward step: O(iters^2) tiny 4x4 ops, nothing per iterate ever touches memory), and turns
  dh_pre / dh_post / dh_res into dL (the gradient of the raw projection) and d(sum x^2); bias and alpha
  gradients are reduced per program into a small partial buffer (deterministic, no atomics).
- `_coef_bwd_x`: one read of x per (column block, token split): dx = dL phi^T + 2 x d(sum x^2) and the
  partial phi gradient x^T dL (tl.dot), summed over splits afterwards.

Token count is a runtime argument (never specialised); strides depend on C only.
"""
import triton
import triton.language as tl

# Dot precision modes (constexpr): native 16-bit operands, tf32 on fp32 casts, full fp32.
DOT_NATIVE, DOT_TF32, DOT_IEEE = 0, 1, 2


@triton.jit
def _dot(a, b, acc, MODE: tl.constexpr):
    if MODE == 0:
        return tl.dot(a, b.to(a.dtype), acc)
    elif MODE == 1:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _rownorm(p, eps):
    # rows of the [BT, n, n] tile (axis 2) sum to 1; one reciprocal per row instead of n divisions
    r = 1.0 / (tl.sum(p, axis=2) + eps)
    return p * r[:, :, None]


@triton.jit
def _colnorm(p, eps):
    r = 1.0 / (tl.sum(p, axis=1) + eps)
    return p * r[:, None, :]


@triton.jit
def _softmax_cols(w, eps):
    # column-wise softmax (over axis 1 = rows i) + eps: T_c o exp with an exact max shift
    m = tl.max(w, axis=1)
    e = tl.exp(w - m[:, None, :])
    return e / tl.sum(e, axis=1)[:, None, :] + eps


@triton.jit
def _sinkhorn_fwd(w, iters, eps):
    """Canonical K(w): softmax_eps start, T_r, then (T_c, T_r) x (iters - 1). Rows exact."""
    p = _rownorm(_softmax_cols(w, eps), eps)
    for _ in range(iters - 1):
        p = _rownorm(_colnorm(p, eps), eps)
    return p


@triton.jit
def _sinkhorn_bwd(w, g, iters, eps):
    """dL/dw for K(w) given g = dL/dK. The 2*iters - 1 normalisations are replayed from the start for each
    backward step (registers only); step k (1-based) is a row normalisation when k is odd."""
    p0 = _softmax_cols(w, eps)
    n_norm = 2 * iters - 1
    for kk in range(n_norm):
        k = n_norm - kk  # backward over normalisation k; its input is p after normalisations 1..k-1
        m = p0
        for t in range(1, k):
            if t % 2 == 1:
                m = _rownorm(m, eps)
            else:
                m = _colnorm(m, eps)
        if k % 2 == 1:
            r = 1.0 / (tl.sum(m, axis=2) + eps)
            y = m * r[:, :, None]
            g = (g - tl.sum(g * y, axis=2)[:, :, None]) * r[:, :, None]
        else:
            r = 1.0 / (tl.sum(m, axis=1) + eps)
            y = m * r[:, None, :]
            g = (g - tl.sum(g * y, axis=1)[:, None, :]) * r[:, None, :]
    s = p0 - eps  # the softmax itself; +eps has no derivative
    return s * (g - tl.sum(g * s, axis=1)[:, None, :])


@triton.jit
def _res_index(NS: tl.constexpr, TRANSPOSE: tl.constexpr):
    """[n, n] offsets into the row-major res block: element (i, j) of the tile <- R[j, i] if TRANSPOSE."""
    ii = tl.arange(0, NS)[:, None]
    jj = tl.arange(0, NS)[None, :]
    if TRANSPOSE:
        return jj * NS + ii
    else:
        return ii * NS + jj


@triton.jit(do_not_specialize=["N"])
def _coef_fwd(
    x_ptr, phi_ptr, bias_ptr, alpha_ptr, lg_ptr, rinv_ptr, hpre_ptr, hpost_ptr, hres_ptr,
    N, K, stride_x, stride_phi, iters, eps, rms_eps, pre_eps, post_mult,
    NS: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, HAS_RES: tl.constexpr,
    T_IN: tl.constexpr, T_OUT: tl.constexpr, DOT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, MP)
    cmask = cols < M
    acc = tl.zeros([BT, MP], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    # one pass over x: projection and sum of squares share every load
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < K
        xt = tl.load(x_ptr + rows64[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        pt = tl.load(phi_ptr + kk[:, None] * stride_phi + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
        xf = xt.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        acc = _dot(xt, pt, acc, DOT)
    rinv = 1.0 / tl.sqrt(ss / K + rms_eps)
    tl.store(lg_ptr + rows64[:, None] * M + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])
    tl.store(rinv_ptr + rows, rinv, mask=rmask)
    # Re-read the projection in per-map shapes (a register tile cannot be sliced); the barrier makes
    # this CTA's stores visible to all its threads.
    tl.debug_barrier()
    nn = tl.arange(0, NS)
    a_pre = tl.load(alpha_ptr).to(tl.float32)
    a_post = tl.load(alpha_ptr + 1).to(tl.float32)
    tok = rmask[:, None] & (nn[None, :] < NS)
    l_pre = tl.load(lg_ptr + rows64[:, None] * M + nn[None, :], mask=tok, other=0.0)
    l_post = tl.load(lg_ptr + rows64[:, None] * M + NS + nn[None, :], mask=tok, other=0.0)
    y_pre = a_pre * rinv[:, None] * l_pre + tl.load(bias_ptr + nn).to(tl.float32)[None, :]
    y_post = a_post * rinv[:, None] * l_post + tl.load(bias_ptr + NS + nn).to(tl.float32)[None, :]
    tl.store(hpre_ptr + rows64[:, None] * NS + nn[None, :], tl.sigmoid(y_pre) + pre_eps, mask=tok)
    tl.store(hpost_ptr + rows64[:, None] * NS + nn[None, :], post_mult * tl.sigmoid(y_post), mask=tok)
    if HAS_RES:
        a_res = tl.load(alpha_ptr + 2).to(tl.float32)
        idx = _res_index(NS, T_IN)
        tok3 = rmask[:, None, None] & (idx[None, :, :] >= 0)
        l_res = tl.load(lg_ptr + rows64[:, None, None] * M + 2 * NS + idx[None, :, :], mask=tok3, other=0.0)
        w = a_res * rinv[:, None, None] * l_res + tl.load(bias_ptr + 2 * NS + idx).to(tl.float32)[None, :, :]
        p = _sinkhorn_fwd(w, iters, eps)
        oidx = _res_index(NS, T_OUT)
        tl.store(hres_ptr + rows64[:, None, None] * (NS * NS) + oidx[None, :, :], p, mask=tok3)


@triton.jit(do_not_specialize=["N"])
def _coef_bwd_tok(
    lg_ptr, rinv_ptr, bias_ptr, alpha_ptr, dpre_ptr, dpost_ptr, dres_ptr, dl_ptr, dss_ptr, part_ptr,
    N, K, iters, eps, post_mult,
    NS: tl.constexpr, M: tl.constexpr, HAS_RES: tl.constexpr, T_IN: tl.constexpr, T_OUT: tl.constexpr,
    BT: tl.constexpr, PW: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    nn = tl.arange(0, NS)
    tok = rmask[:, None] & (nn[None, :] < NS)
    rinv = tl.load(rinv_ptr + rows, mask=rmask, other=0.0)
    a_pre = tl.load(alpha_ptr).to(tl.float32)
    a_post = tl.load(alpha_ptr + 1).to(tl.float32)
    # masked rows load dh = 0, so they contribute nothing to any reduction below
    l_pre = tl.load(lg_ptr + rows64[:, None] * M + nn[None, :], mask=tok, other=0.0)
    s = tl.sigmoid(a_pre * rinv[:, None] * l_pre + tl.load(bias_ptr + nn).to(tl.float32)[None, :])
    dy_pre = tl.load(dpre_ptr + rows64[:, None] * NS + nn[None, :], mask=tok, other=0.0) * s * (1.0 - s)
    l_post = tl.load(lg_ptr + rows64[:, None] * M + NS + nn[None, :], mask=tok, other=0.0)
    s = tl.sigmoid(a_post * rinv[:, None] * l_post + tl.load(bias_ptr + NS + nn).to(tl.float32)[None, :])
    dy_post = tl.load(dpost_ptr + rows64[:, None] * NS + nn[None, :], mask=tok, other=0.0) * post_mult * s * (1.0 - s)
    tl.store(dl_ptr + rows64[:, None] * M + nn[None, :], dy_pre * a_pre * rinv[:, None], mask=tok)
    tl.store(dl_ptr + rows64[:, None] * M + NS + nn[None, :], dy_post * a_post * rinv[:, None], mask=tok)
    # d loss / d rinv, and per-program partial sums of the bias and alpha gradients
    drinv = tl.sum(dy_pre * a_pre * l_pre, axis=1) + tl.sum(dy_post * a_post * l_post, axis=1)
    tl.store(part_ptr + pid * PW + nn, tl.sum(dy_pre, axis=0))
    tl.store(part_ptr + pid * PW + NS + nn, tl.sum(dy_post, axis=0))
    tl.store(part_ptr + pid * PW + M, tl.sum(tl.sum(dy_pre * l_pre, axis=1) * rinv, axis=0))
    tl.store(part_ptr + pid * PW + M + 1, tl.sum(tl.sum(dy_post * l_post, axis=1) * rinv, axis=0))
    if HAS_RES:
        a_res = tl.load(alpha_ptr + 2).to(tl.float32)
        idx = _res_index(NS, T_IN)
        tok3 = rmask[:, None, None] & (idx[None, :, :] >= 0)
        l_res = tl.load(lg_ptr + rows64[:, None, None] * M + 2 * NS + idx[None, :, :], mask=tok3, other=0.0)
        w = a_res * rinv[:, None, None] * l_res + tl.load(bias_ptr + 2 * NS + idx).to(tl.float32)[None, :, :]
        oidx = _res_index(NS, T_OUT)
        g = tl.load(dres_ptr + rows64[:, None, None] * (NS * NS) + oidx[None, :, :], mask=tok3, other=0.0)
        dw = _sinkhorn_bwd(w, g.to(tl.float32), iters, eps)
        tl.store(dl_ptr + rows64[:, None, None] * M + 2 * NS + idx[None, :, :], dw * a_res * rinv[:, None, None], mask=tok3)
        drinv += tl.sum(tl.sum(dw * a_res * l_res, axis=2), axis=1)
        tl.store(part_ptr + pid * PW + 2 * NS + idx, tl.sum(dw, axis=0))
        tl.store(part_ptr + pid * PW + M + 2, tl.sum(tl.sum(tl.sum(dw * l_res, axis=2), axis=1) * rinv, axis=0))
    else:
        tl.store(part_ptr + pid * PW + M + 2, 0.0)
    # rinv = (sumsq / K + rms_eps)^(-1/2)  =>  d rinv / d sumsq = -rinv^3 / (2K)
    tl.store(dss_ptr + rows, -0.5 * drinv * rinv * rinv * rinv / K, mask=rmask)


@triton.jit(do_not_specialize=["N", "tok_per_split"])
def _coef_bwd_x(
    x_ptr, phi_ptr, dl_ptr, dss_ptr, dx_ptr, dphi_ptr,
    N, K, stride_x, stride_phi, tok_per_split,
    M: tl.constexpr, MP: tl.constexpr, DOT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    kk = pid_k * BK + tl.arange(0, BK)
    kmask = kk < K
    cols = tl.arange(0, MP)
    cmask = cols < M
    phi_t = tl.load(phi_ptr + kk[:, None] * stride_phi + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
    phi_t = phi_t.to(tl.float32)
    acc = tl.zeros([BK, MP], dtype=tl.float32)
    t_lo = pid_s * tok_per_split
    t_hi = tl.minimum(N, t_lo + tok_per_split)
    for t0 in range(t_lo, t_hi, BT):
        rows = t0 + tl.arange(0, BT)
        rmask = rows < t_hi
        rows64 = rows.to(tl.int64)
        m2 = rmask[:, None] & kmask[None, :]
        xt = tl.load(x_ptr + rows64[:, None] * stride_x + kk[None, :], mask=m2, other=0.0)
        dlt = tl.load(dl_ptr + rows64[:, None] * M + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        dss = tl.load(dss_ptr + rows, mask=rmask, other=0.0)
        xf = xt.to(tl.float32)
        dx = _dot(dlt, tl.trans(phi_t), 2.0 * xf * dss[:, None], DOT)
        tl.store(dx_ptr + rows64[:, None] * K + kk[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m2)
        acc = _dot(tl.trans(xf), dlt, acc, DOT)
    tl.store(dphi_ptr + (pid_s * K + kk[:, None]).to(tl.int64) * M + cols[None, :], acc, mask=kmask[:, None] & cmask[None, :])
