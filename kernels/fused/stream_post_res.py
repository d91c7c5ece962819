"""Fused write-back x_next_i = sum_j H^res_ij x_j + h_post_i f (docs/design.md §1, §8) and its backward.

Forward: reads x [N, n, C] and f [N, C] once, writes x_next [N, n, C]: (n+1)C read, nC written, the
paper's fused post-res count. H^res = None (identity-HC) is the constexpr HAS_RES = False path.
Backward (`_post_bwd_2d`), reading dx_next, x and f once:
  dx_j = sum_i H_ij dx_next_i,  df = sum_i h_post_i dx_next_i,
  dH_ij = <dx_next_i, x_j>,      dh_post_i = <dx_next_i, f>   (C-reductions kept in registers).
With COEF it is the sublayer boundary op's backward when CONFIG bnd_bwd xpass is off (docs/kernels.md): x_next
also fed the next sublayer's coefficients and input, so the gradient reaching it is G_i = dx_next_i + (dL phi^T)_i
+ 2 x_next_i d(sum x^2) + h_pre_i du, built in registers from the coefficient backward's per-token dL, d(sum x^2);
dx is written once.
With HAS_U the backward also writes u = sum_j h_pre_j x_j of the sublayer whose write-back this is (its own h_pre):
the stream tiles it reads anyway, so a branch that dropped its input (HyperConfig.rebuild_branch_input) gets it back
without reading x again (docs/design.md §9).
"""
import triton
import triton.language as tl

from .coefficients import _dot


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
def _post_bwd_2d(
    x_ptr, f_ptr, hp_ptr, hr_ptr, g_ptr, dx_ptr, df_ptr, dhp_ptr, dhr_ptr,
    xn_ptr, du_ptr, dl_ptr, dss_ptr, hpre_ptr, phi_ptr, hu_ptr, u_ptr,
    N, C, stride_xt, stride_xn, stride_ft, stride_phi,
    NS: tl.constexpr, HAS_RES: tl.constexpr, COEF: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
    DOT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SPLIT: tl.constexpr = False, PHI_LO: tl.constexpr = False,
    LOOP_STAGES: tl.constexpr = 0, HAS_U: tl.constexpr = False,
):
    """Backward on the forward's 2-D grid (token block x C block), no C loop: every stream sum is a broadcast
    multiply-add and the only reductions are over this C block. dH [.., n, n] and dh_post [.., n] go to
    dhr_ptr / dhp_ptr at row (C block * N + token): with one C block (BC >= C) those are the outputs themselves
    (no partial buffer, no second launch); otherwise per-C-block partials [n_cblk, N, ...] summed afterwards.
    COEF (BT >= 16 for tl.dot): g_i becomes G_i (module docstring) from x_next xn_ptr [N, n, C] (contiguous),
    du [N, C], dL [N, M] fp32, d(sum x^2) [N], the next h_pre [N, n] and phi [n*C, M]. SPLIT (bf16 streams): dL phi^T
    on bf16 parts, dL = hi + lo and phi's hi (+ lo with PHI_LO), as `_coef_bwd_x` SPLIT does.
    LOOP_STAGES > 0: fewer programs than token blocks, each walking token blocks pid, pid + programs, ... in a loop
    pipelined that deep (tl.range num_stages: the next blocks' loads are async copies in flight while this one is
    reduced and stored); 0: one token block per program.
    HAS_U: also u [N, C] (u_ptr's dtype, rounded through x's as the forward ops round it) = sum_j h_j x_j with this
    sublayer's h_pre [N, n] (hu_ptr), summed in `_pre_fwd`'s order."""
    if LOOP_STAGES > 0:
        for tb in tl.range(tl.program_id(0), tl.cdiv(N, BT), tl.num_programs(0), num_stages=LOOP_STAGES):
            _post_bwd_tile(tb, x_ptr, f_ptr, hp_ptr, hr_ptr, g_ptr, dx_ptr, df_ptr, dhp_ptr, dhr_ptr, xn_ptr, du_ptr,
                           dl_ptr, dss_ptr, hpre_ptr, phi_ptr, hu_ptr, u_ptr, N, C, stride_xt, stride_xn, stride_ft,
                           stride_phi, NS, HAS_RES, COEF, M, MP, DOT, BT, BC, SPLIT, PHI_LO, HAS_U)
    else:
        _post_bwd_tile(tl.program_id(0), x_ptr, f_ptr, hp_ptr, hr_ptr, g_ptr, dx_ptr, df_ptr, dhp_ptr, dhr_ptr, xn_ptr,
                       du_ptr, dl_ptr, dss_ptr, hpre_ptr, phi_ptr, hu_ptr, u_ptr, N, C, stride_xt, stride_xn,
                       stride_ft, stride_phi, NS, HAS_RES, COEF, M, MP, DOT, BT, BC, SPLIT, PHI_LO, HAS_U)


@triton.jit
def _post_bwd_tile(
    tb, x_ptr, f_ptr, hp_ptr, hr_ptr, g_ptr, dx_ptr, df_ptr, dhp_ptr, dhr_ptr, xn_ptr, du_ptr, dl_ptr, dss_ptr,
    hpre_ptr, phi_ptr, hu_ptr, u_ptr, N, C, stride_xt, stride_xn, stride_ft, stride_phi,
    NS: tl.constexpr, HAS_RES: tl.constexpr, COEF: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
    DOT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SPLIT: tl.constexpr, PHI_LO: tl.constexpr,
    HAS_U: tl.constexpr,
):
    """`_post_bwd_2d` on token block tb and this program's C block."""
    rows = tb * BT + tl.arange(0, BT)
    cb = tl.program_id(1)
    cc = cb * BC + tl.arange(0, BC)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    prow = cb.to(tl.int64) * N + rows64  # row of the (partial) dH / dh_post outputs
    ii = tl.arange(0, NS)
    m2 = rmask[:, None] & (cc[None, :] < C)
    m3 = m2[:, None, :] & (ii[None, :, None] < NS)
    tokn = rmask[:, None] & (ii[None, :] < NS)
    off3 = rows64[:, None, None] * (NS * C) + ii[None, :, None] * C + cc[None, None, :]  # contiguous [N, n, C]
    # the gradient reaching x_next, all n streams of this block: G [BT, n, BC]
    g = tl.load(g_ptr + off3, mask=m3, other=0.0).to(tl.float32)
    if COEF:  # plus what x_next received through the next sublayer's coefficients and its input u
        mm = tl.arange(0, MP)
        kk = tl.arange(0, NS * BC)
        ks, kc = kk // BC, kk % BC  # flat column -> (stream, channel within the block)
        dl = tl.load(dl_ptr + rows64[:, None] * M + mm[None, :], mask=rmask[:, None] & (mm[None, :] < M), other=0.0)
        phi_t = tl.load(phi_ptr + (ks * C + cb * BC + kc)[:, None] * stride_phi + mm[None, :],
                        mask=((cb * BC + kc) < C)[:, None] & (mm[None, :] < M), other=0.0)
        gd = tl.zeros([BT, NS * BC], dtype=tl.float32)
        if SPLIT:
            dl_hi = dl.to(tl.bfloat16)
            phi_hi = phi_t.to(tl.float32).to(tl.bfloat16)
            gd = _dot(dl_hi, tl.trans(phi_hi), gd, DOT)
            gd = _dot((dl - dl_hi.to(tl.float32)).to(tl.bfloat16), tl.trans(phi_hi), gd, DOT)
            if PHI_LO:
                gd = _dot(dl_hi, tl.trans((phi_t.to(tl.float32) - phi_hi.to(tl.float32)).to(tl.bfloat16)), gd, DOT)
        else:
            gd = _dot(dl, tl.trans(phi_t), gd, DOT)
        g += tl.reshape(gd, [BT, NS, BC])
        dss2 = 2.0 * tl.load(dss_ptr + rows, mask=rmask, other=0.0)
        xn = tl.load(xn_ptr + off3, mask=m3, other=0.0).to(tl.float32)
        du = tl.load(du_ptr + rows64[:, None] * C + cc[None, :], mask=m2, other=0.0).to(tl.float32)
        hpre = tl.load(hpre_ptr + rows64[:, None] * NS + ii[None, :], mask=tokn, other=0.0)
        g += xn * dss2[:, None, None] + hpre[:, :, None] * du[:, None, :]
    f = tl.load(f_ptr + rows64[:, None] * stride_ft + cc[None, :], mask=m2, other=0.0).to(tl.float32)
    hp = tl.load(hp_ptr + rows64[:, None] * NS + ii[None, :], mask=tokn, other=0.0).to(tl.float32)
    tl.store(df_ptr + rows64[:, None] * C + cc[None, :], tl.sum(hp[:, :, None] * g, axis=1).to(df_ptr.dtype.element_ty),
             mask=m2)
    tl.store(dhp_ptr + prow[:, None] * NS + ii[None, :], tl.sum(g * f[:, None, :], axis=2), mask=tokn)
    u = tl.zeros([BT, BC], dtype=tl.float32)
    if HAS_RES:
        for j in tl.static_range(NS):
            # column j of H: dx_j = sum_i H_ij G_i, dH_ij = <G_i, x_j> over this C block
            hj = tl.load(hr_ptr + rows64[:, None] * (NS * NS) + ii[None, :] * NS + j, mask=tokn, other=0.0)
            dxj = tl.sum(hj.to(tl.float32)[:, :, None] * g, axis=1)
            tl.store(dx_ptr + rows64[:, None] * (NS * C) + j * C + cc[None, :], dxj.to(dx_ptr.dtype.element_ty), mask=m2)
            xj = tl.load(x_ptr + rows64[:, None] * stride_xt + j * stride_xn + cc[None, :], mask=m2, other=0.0)
            tl.store(dhr_ptr + prow[:, None] * (NS * NS) + ii[None, :] * NS + j,
                     tl.sum(g * xj.to(tl.float32)[:, None, :], axis=2), mask=tokn)
            if HAS_U:
                u += tl.load(hu_ptr + rows64 * NS + j, mask=rmask, other=0.0).to(tl.float32)[:, None] * xj.to(tl.float32)
    else:
        tl.store(dx_ptr + off3, g.to(dx_ptr.dtype.element_ty), mask=m3)
        if HAS_U:  # H^res = I reads no x: the stream tiles for u alone
            for j in tl.static_range(NS):
                xj = tl.load(x_ptr + rows64[:, None] * stride_xt + j * stride_xn + cc[None, :], mask=m2, other=0.0)
                u += tl.load(hu_ptr + rows64 * NS + j, mask=rmask, other=0.0).to(tl.float32)[:, None] * xj.to(tl.float32)
    if HAS_U:
        tl.store(u_ptr + rows64[:, None] * C + cc[None, :], u.to(x_ptr.dtype.element_ty).to(u_ptr.dtype.element_ty),
                 mask=m2)
