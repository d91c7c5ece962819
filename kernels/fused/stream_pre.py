"""Fused layer-input read-out u = sum_j h_pre_j x_j (docs/design.md §1, §8) and its backward.

Forward: one read of x [N, n, C], one write of u [N, C] (fp32 accumulate, rounded to x.dtype; stored in
u's dtype, which may be wider: ops CONFIG "u").
Backward, one kernel per token block: reads du and x once, writes dx_j = h_pre_j du and reduces
dh_pre_j = <du, x_j> over C in registers.
"""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["N"])
def _pre_fwd(
    x_ptr, h_ptr, u_ptr, N, C, stride_xt, stride_xn,
    NS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    m2 = rmask[:, None] & (cc[None, :] < C)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(NS):
        h = tl.load(h_ptr + rows64 * NS + j, mask=rmask, other=0.0).to(tl.float32)
        xj = tl.load(x_ptr + rows64[:, None] * stride_xt + j * stride_xn + cc[None, :], mask=m2, other=0.0)
        acc += h[:, None] * xj.to(tl.float32)
    # rounded to x's dtype first: a wider u (the branch's dtype, ops "u") holds the values a cast of x's would
    tl.store(u_ptr + rows64[:, None] * C + cc[None, :], acc.to(x_ptr.dtype.element_ty).to(u_ptr.dtype.element_ty),
             mask=m2)


@triton.jit(do_not_specialize=["N"])
def _pre_bwd(
    x_ptr, h_ptr, du_ptr, dx_ptr, dh_ptr, N, C, stride_xt, stride_xn,
    NS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    nn = tl.arange(0, NS)
    h = tl.load(h_ptr + rows64[:, None] * NS + nn[None, :], mask=rmask[:, None] & (nn[None, :] < NS), other=0.0)
    h = h.to(tl.float32)
    dh = tl.zeros([BT, NS], dtype=tl.float32)
    for c0 in range(0, C, BC):
        cc = c0 + tl.arange(0, BC)
        m2 = rmask[:, None] & (cc[None, :] < C)
        du = tl.load(du_ptr + rows64[:, None] * C + cc[None, :], mask=m2, other=0.0).to(tl.float32)
        for j in tl.static_range(NS):
            hj = tl.sum(tl.where(nn[None, :] == j, h, 0.0), axis=1)  # column j of the register tile
            off = rows64[:, None] * (NS * C) + j * C + cc[None, :]
            tl.store(dx_ptr + off, (hj[:, None] * du).to(dx_ptr.dtype.element_ty), mask=m2)
            xj = tl.load(x_ptr + rows64[:, None] * stride_xt + j * stride_xn + cc[None, :], mask=m2, other=0.0)
            dj = tl.sum(du * xj.to(tl.float32), axis=1)
            dh += tl.where(nn[None, :] == j, dj[:, None], 0.0)
    tl.store(dh_ptr + rows64[:, None] * NS + nn[None, :], dh, mask=rmask[:, None] & (nn[None, :] < NS))
