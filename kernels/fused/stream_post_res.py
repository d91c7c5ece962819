"""Fused write-back x_next_i = sum_j H^res_ij x_j + h_post_i f (mhc-math.md §1, §8) and its backward.

Forward: reads x [N, n, C] and f [N, C] once, writes x_next [N, n, C]: (n+1)C read, nC written, the
paper's fused post-res count. H^res = None (identity-HC) is the constexpr HAS_RES = False path.
Backward (two kernels, ops.CONFIG["post_bwd"]["impl"] picks), reading dx_next, x and f once:
  dx_j = sum_i H_ij dx_next_i,  df = sum_i h_post_i dx_next_i,
  dH_ij = <dx_next_i, x_j>,      dh_post_i = <dx_next_i, f>   (C-reductions kept in registers).
"""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N"])
def _post_fwd(
    x_ptr, f_ptr, hp_ptr, hr_ptr, out_ptr, N, C, stride_xt, stride_xn, stride_ft,
    NS: tl.constexpr, HAS_RES: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    ii = tl.arange(0, NS)
    m2 = rmask[:, None] & (cc[None, :] < C)
    m3 = m2[:, None, :] & (ii[None, :, None] < NS)
    tokn = rmask[:, None] & (ii[None, :] < NS)
    f = tl.load(f_ptr + rows64[:, None] * stride_ft + cc[None, :], mask=m2, other=0.0).to(tl.float32)
    hp = tl.load(hp_ptr + rows64[:, None] * NS + ii[None, :], mask=tokn, other=0.0).to(tl.float32)
    acc = hp[:, :, None] * f[:, None, :]
    if HAS_RES:
        for j in tl.static_range(NS):
            xj = tl.load(x_ptr + rows64[:, None] * stride_xt + j * stride_xn + cc[None, :], mask=m2, other=0.0)
            hj = tl.load(hr_ptr + rows64[:, None] * (NS * NS) + ii[None, :] * NS + j, mask=tokn, other=0.0)
            acc += hj.to(tl.float32)[:, :, None] * xj.to(tl.float32)[:, None, :]
    else:
        x = tl.load(x_ptr + rows64[:, None, None] * stride_xt + ii[None, :, None] * stride_xn + cc[None, None, :],
                    mask=m3, other=0.0)
        acc += x.to(tl.float32)
    off = rows64[:, None, None] * (NS * C) + ii[None, :, None] * C + cc[None, None, :]
    tl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=m3)


@triton.jit(do_not_specialize=["N"])
def _post_bwd(
    x_ptr, f_ptr, hp_ptr, hr_ptr, g_ptr, dx_ptr, df_ptr, dhp_ptr, dhr_ptr,
    N, C, stride_xt, stride_xn, stride_ft,
    NS: tl.constexpr, HAS_RES: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    ii = tl.arange(0, NS)
    tokn = rmask[:, None] & (ii[None, :] < NS)
    hp = tl.load(hp_ptr + rows64[:, None] * NS + ii[None, :], mask=tokn, other=0.0).to(tl.float32)
    dhp = tl.zeros([BT, NS], dtype=tl.float32)
    dhr = tl.zeros([BT, NS, NS], dtype=tl.float32)
    for c0 in range(0, C, BC):
        cc = c0 + tl.arange(0, BC)
        m2 = rmask[:, None] & (cc[None, :] < C)
        m3 = m2[:, None, :] & (ii[None, :, None] < NS)
        off3 = rows64[:, None, None] * (NS * C) + ii[None, :, None] * C + cc[None, None, :]
        g = tl.load(g_ptr + off3, mask=m3, other=0.0).to(tl.float32)
        f = tl.load(f_ptr + rows64[:, None] * stride_ft + cc[None, :], mask=m2, other=0.0).to(tl.float32)
        tl.store(df_ptr + rows64[:, None] * C + cc[None, :], tl.sum(hp[:, :, None] * g, axis=1).to(df_ptr.dtype.element_ty),
                 mask=m2)
        dhp += tl.sum(g * f[:, None, :], axis=2)
        if HAS_RES:
            for j in tl.static_range(NS):
                hj = tl.load(hr_ptr + rows64[:, None] * (NS * NS) + ii[None, :] * NS + j, mask=tokn, other=0.0)
                dxj = tl.sum(hj.to(tl.float32)[:, :, None] * g, axis=1)
                tl.store(dx_ptr + rows64[:, None] * (NS * C) + j * C + cc[None, :], dxj.to(dx_ptr.dtype.element_ty), mask=m2)
                xj = tl.load(x_ptr + rows64[:, None] * stride_xt + j * stride_xn + cc[None, :], mask=m2, other=0.0)
                dj = tl.sum(g * xj.to(tl.float32)[:, None, :], axis=2)  # [BT, n]: column j of dH
                dhr += tl.where(ii[None, None, :] == j, dj[:, :, None], 0.0)
        else:
            tl.store(dx_ptr + off3, g.to(dx_ptr.dtype.element_ty), mask=m3)
    tl.store(dhp_ptr + rows64[:, None] * NS + ii[None, :], dhp, mask=tokn)
    if HAS_RES:
        m3h = tokn[:, :, None] & (ii[None, None, :] < NS)
        tl.store(dhr_ptr + rows64[:, None, None] * (NS * NS) + ii[None, :, None] * NS + ii[None, None, :], dhr, mask=m3h)


@triton.jit(do_not_specialize=["N"])
def _post_bwd_2d(
    x_ptr, f_ptr, hp_ptr, hr_ptr, g_ptr, dx_ptr, df_ptr, dhp_ptr, dhr_ptr,
    N, C, stride_xt, stride_xn, stride_ft,
    NS: tl.constexpr, HAS_RES: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    """Backward on the forward's 2-D grid (token block x C block), no C loop: every stream sum is a broadcast
    multiply-add and the only reductions are over this C block. dH [.., n, n] and dh_post [.., n] go to
    dhr_ptr / dhp_ptr at row (C block * N + token): with one C block (BC >= C) those are the outputs themselves
    (no partial buffer, no second launch); otherwise per-C-block partials [n_cblk, N, ...] summed afterwards."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cb = tl.program_id(1)
    cc = cb * BC + tl.arange(0, BC)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    prow = cb.to(tl.int64) * N + rows64  # row of the (partial) dH / dh_post outputs
    ii = tl.arange(0, NS)
    m2 = rmask[:, None] & (cc[None, :] < C)
    m3 = m2[:, None, :] & (ii[None, :, None] < NS)
    tokn = rmask[:, None] & (ii[None, :] < NS)
    f = tl.load(f_ptr + rows64[:, None] * stride_ft + cc[None, :], mask=m2, other=0.0).to(tl.float32)
    df = tl.zeros([BT, BC], dtype=tl.float32)
    dhp = tl.zeros([BT, NS], dtype=tl.float32)
    if HAS_RES:
        x3 = tl.load(x_ptr + rows64[:, None, None] * stride_xt + ii[None, :, None] * stride_xn + cc[None, None, :],
                     mask=m3, other=0.0).to(tl.float32)
        dx = tl.zeros([BT, NS, BC], dtype=tl.float32)
    for i in tl.static_range(NS):
        gi = tl.load(g_ptr + rows64[:, None] * (NS * C) + i * C + cc[None, :], mask=m2, other=0.0).to(tl.float32)
        hpi = tl.load(hp_ptr + rows64 * NS + i, mask=rmask, other=0.0).to(tl.float32)  # L1-resident scalar/token
        df += hpi[:, None] * gi
        dhp += tl.where(ii[None, :] == i, tl.sum(gi * f, axis=1)[:, None], 0.0)
        if HAS_RES:
            hri = tl.load(hr_ptr + rows64[:, None] * (NS * NS) + i * NS + ii[None, :], mask=tokn, other=0.0)
            dx += hri.to(tl.float32)[:, :, None] * gi[:, None, :]  # dx_j += H_ij g_i for all j
            tl.store(dhr_ptr + prow[:, None] * (NS * NS) + i * NS + ii[None, :], tl.sum(gi[:, None, :] * x3, axis=2),
                     mask=tokn)
        else:
            tl.store(dx_ptr + rows64[:, None] * (NS * C) + i * C + cc[None, :], gi.to(dx_ptr.dtype.element_ty), mask=m2)
    tl.store(df_ptr + rows64[:, None] * C + cc[None, :], df.to(df_ptr.dtype.element_ty), mask=m2)
    tl.store(dhp_ptr + prow[:, None] * NS + ii[None, :], dhp, mask=tokn)
    if HAS_RES:
        off = rows64[:, None, None] * (NS * C) + ii[None, :, None] * C + cc[None, None, :]
        tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=m3)
