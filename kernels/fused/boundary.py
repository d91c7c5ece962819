"""Backward of the sublayer boundary op (docs/kernels.md, "The boundary op"), one streaming pass.

The boundary op wrote x_next = H^res x + h_post f and computed the next sublayer's coefficients and input u from it.
Given the per-token coefficient gradients dL [N, M] and d(sum x^2) [N] (`_coef_bwd_tok`), the gradient reaching
x_next is, per stream i,
    G_i = g_i + (dL phi^T)_i + 2 x_next_i d(sum x^2) + h_pre_i du,
and the write-back's backward then gives dx_j = sum_i H_ij G_i, df = sum_i h_post_i G_i, dH_ij = <G_i, x_j>,
dh_post_i = <G_i, f>, while dphi = x_next^T dL. `_bnd_bwd` does all of it in one read of g, x, x_next, f and du
and one write of dx and df.

Grid: (C block, token split). Each program keeps its C block's rows of phi (all n streams) and its partial dphi in
registers for its whole token range, so phi is read once per program rather than once per token block, and dphi
needs no separate pass over x_next. dH / dh_post are per-C-block partials (direct outputs with one C block), dphi a
per-split partial; both are summed afterwards.
"""
import triton
import triton.language as tl

from .coefficients import _dot


@triton.jit(do_not_specialize=["N", "tok_per_split"])
def _bnd_bwd(
    x_ptr, f_ptr, hp_ptr, hr_ptr, g_ptr, dx_ptr, df_ptr, dhp_ptr, dhr_ptr,
    xn_ptr, du_ptr, dl_ptr, dss_ptr, hpre_ptr, phi_ptr, dphi_ptr,
    N, C, stride_xt, stride_xn, stride_ft, stride_phi, tok_per_split,
    NS: tl.constexpr, HAS_RES: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, DOT: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr,
):
    """x [N, n, C] (strided), f [N, C], h_post [N, n], H^res [N, n, n] (HAS_RES) of sublayer l; g, x_next [N, n, C]
    contiguous; du [N, C], dL [N, M] fp32, d(sum x^2) [N], h_pre [N, n] and phi [n*C, M] of sublayer l + 1.
    dphi_ptr: [splits, n*C, M] fp32 partials. BT >= 16 (tl.dot)."""
    cb = tl.program_id(0)
    sp = tl.program_id(1)
    K = NS * C
    ii = tl.arange(0, NS)
    cc = cb * BC + tl.arange(0, BC)
    mm = tl.arange(0, MP)
    mmask = mm < M
    kk = tl.arange(0, NS * BC)  # flat column of the [BT, n * BC] tile -> (stream, channel within the block)
    kcol = cb * BC + kk % BC
    krow = (kk // BC) * C + kcol  # row of phi
    kmask = kcol < C
    phi_t = tl.load(phi_ptr + krow[:, None] * stride_phi + mm[None, :], mask=kmask[:, None] & mmask[None, :],
                    other=0.0)
    acc = tl.zeros([NS * BC, MP], dtype=tl.float32)
    t_lo = sp * tok_per_split
    t_hi = tl.minimum(N, t_lo + tok_per_split)
    for t0 in range(t_lo, t_hi, BT):
        rows = t0 + tl.arange(0, BT)
        rmask = rows < t_hi
        rows64 = rows.to(tl.int64)
        prow = cb.to(tl.int64) * N + rows64  # row of the (partial) dH / dh_post outputs
        m2 = rmask[:, None] & (cc[None, :] < C)
        m3 = m2[:, None, :] & (ii[None, :, None] < NS)
        tokn = rmask[:, None] & (ii[None, :] < NS)
        off3 = rows64[:, None, None] * K + ii[None, :, None] * C + cc[None, None, :]
        dl = tl.load(dl_ptr + rows64[:, None] * M + mm[None, :], mask=rmask[:, None] & mmask[None, :], other=0.0)
        xn = tl.load(xn_ptr + off3, mask=m3, other=0.0)
        acc = _dot(tl.trans(tl.reshape(xn, [BT, NS * BC])), dl, acc, DOT)  # dphi += x_next^T dL
        g = tl.load(g_ptr + off3, mask=m3, other=0.0).to(tl.float32)
        g += tl.reshape(_dot(dl, tl.trans(phi_t), tl.zeros([BT, NS * BC], dtype=tl.float32), DOT), [BT, NS, BC])
        dss2 = 2.0 * tl.load(dss_ptr + rows, mask=rmask, other=0.0)
        du = tl.load(du_ptr + rows64[:, None] * C + cc[None, :], mask=m2, other=0.0).to(tl.float32)
        hpre = tl.load(hpre_ptr + rows64[:, None] * NS + ii[None, :], mask=tokn, other=0.0)
        g += xn.to(tl.float32) * dss2[:, None, None] + hpre[:, :, None] * du[:, None, :]
        f = tl.load(f_ptr + rows64[:, None] * stride_ft + cc[None, :], mask=m2, other=0.0).to(tl.float32)
        hp = tl.load(hp_ptr + rows64[:, None] * NS + ii[None, :], mask=tokn, other=0.0).to(tl.float32)
        tl.store(df_ptr + rows64[:, None] * C + cc[None, :],
                 tl.sum(hp[:, :, None] * g, axis=1).to(df_ptr.dtype.element_ty), mask=m2)
        tl.store(dhp_ptr + prow[:, None] * NS + ii[None, :], tl.sum(g * f[:, None, :], axis=2), mask=tokn)
        if HAS_RES:
            for j in tl.static_range(NS):
                hj = tl.load(hr_ptr + rows64[:, None] * (NS * NS) + ii[None, :] * NS + j, mask=tokn, other=0.0)
                dxj = tl.sum(hj.to(tl.float32)[:, :, None] * g, axis=1)
                tl.store(dx_ptr + rows64[:, None] * K + j * C + cc[None, :], dxj.to(dx_ptr.dtype.element_ty), mask=m2)
                xj = tl.load(x_ptr + rows64[:, None] * stride_xt + j * stride_xn + cc[None, :], mask=m2, other=0.0)
                tl.store(dhr_ptr + prow[:, None] * (NS * NS) + ii[None, :] * NS + j,
                         tl.sum(g * xj.to(tl.float32)[:, None, :], axis=2), mask=tokn)
        else:
            tl.store(dx_ptr + off3, g.to(dx_ptr.dtype.element_ty), mask=m3)
    tl.store(dphi_ptr + (sp * K + krow[:, None]).to(tl.int64) * M + mm[None, :], acc,
             mask=kmask[:, None] & mmask[None, :])
