"""The sublayer boundary's forward in one pass over the stream (docs/kernels.md, "The boundary forward in one pass").

At a sublayer boundary x_{l+1} = H^res x_l + h_post f is written and sublayer l+1's coefficients come from it. The
two-kernel path writes x_{l+1} with `_post_fwd` and reads it straight back in `_coef_fwd` for the projection
x_{l+1} phi and sum(x_{l+1}^2). `_bnd_fwd` makes x_{l+1} one stream at a time, as [BT, BC] tiles, from the n tiles of
x_l it loaded for that channel block, stores each, and feeds it (rounded to the stream's dtype: the values
`_coef_fwd` would read back) to a dot against phi's rows i C + c and to the sum of squares: one read of x_{l+1} less
per boundary (n C elements per token). Round 25's kernel built the [BT, n, BC] tile at once and reshaped it into one
dot operand, which took 255 registers and spilled; here every tile is 2-D and the dot is per stream. The per-token
tail (gates, Sinkhorn) is `_coef_fwd`'s; u = sum_j h_pre_j x_{l+1, j} needs h_pre, hence the whole row's projection,
so `_pre_fwd` reads x_{l+1} once more for it. Reference: kernels/reference/boundary.py.
"""
import triton
import triton.language as tl

from .coefficients import _coef_gates, _dot


@triton.jit(do_not_specialize=["N", "iters"])
def _bnd_fwd(
    x_ptr, f_ptr, hp_ptr, hr_ptr, out_ptr, phi_ptr, phil_ptr, bias_ptr, alpha_ptr, lg_ptr, rinv_ptr, hpre_ptr,
    hpost_ptr, hres_ptr, N, C, stride_xt, stride_xn, stride_ft, stride_phi, iters, eps, rms_eps, pre_eps, post_mult,
    NS: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, HAS_RES: tl.constexpr, NEXT_RES: tl.constexpr,
    T_IN: tl.constexpr, T_OUT: tl.constexpr, DOT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    SPLIT: tl.constexpr = 0, LOOP_STAGES: tl.constexpr = None,
):
    """x [N, n, C] (strides stride_xt, stride_xn), f [N, C], h_post [N, n], H^res [N, n, n] (HAS_RES; else H^res = I)
    of sublayer l -> x_{l+1} [N, n, C] contiguous at out_ptr, and sublayer l+1's raw logits [N, M], 1/r, gates and
    (NEXT_RES) H^res, as `_coef_fwd` computes them from x_{l+1} (phi, phil, SPLIT, DOT: as there). One program per
    BT tokens walks C in BC blocks (LOOP_STAGES: tl.range pipelining of that loop's loads)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    K = NS * C
    W: tl.constexpr = 2 * MP if SPLIT >= 2 else MP  # width of the dot (interleaved hi / lo pairs: twice)
    WS: tl.constexpr = 2 * MP if SPLIT == 2 else MP  # columns of the phi tile as stored
    cols = tl.arange(0, MP)
    cmask = cols < M
    wcols = tl.arange(0, WS)
    wmask = wcols < (2 * M if SPLIT == 2 else M)
    acc = tl.zeros([BT, W], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    for c0 in tl.range(0, C, BC, num_stages=LOOP_STAGES):
        cc = c0 + tl.arange(0, BC)
        cm = cc < C
        m2 = rmask[:, None] & cm[None, :]
        f = tl.load(f_ptr + rows64[:, None] * stride_ft + cc[None, :], mask=m2, other=0.0).to(tl.float32)
        xs = ()  # this channel block of every stream of x_l, loaded once for all n outputs
        for j in tl.static_range(NS):
            xs = xs + (tl.load(x_ptr + rows64[:, None] * stride_xt + j * stride_xn + cc[None, :], mask=m2,
                               other=0.0).to(tl.float32),)
        for i in tl.static_range(NS):
            # the write-back in `_post_fwd`'s order of operations: the same x_{l+1} to the bit
            hpi = tl.load(hp_ptr + rows64 * NS + i, mask=rmask, other=0.0).to(tl.float32)
            y = hpi[:, None] * f
            if HAS_RES:
                for j in tl.static_range(NS):
                    hij = tl.load(hr_ptr + rows64 * (NS * NS) + i * NS + j, mask=rmask, other=0.0).to(tl.float32)
                    y += hij[:, None] * xs[j]
            else:
                y += xs[i]
            yq = y.to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows64[:, None] * K + i * C + cc[None, :], yq, mask=m2)
            # the projection and sum of squares of the stored values
            yf = yq.to(tl.float32)
            ss += tl.sum(yf * yf, axis=1)
            kk = i * C + cc
            pt = tl.load(phi_ptr + kk[:, None] * stride_phi + wcols[None, :], mask=cm[:, None] & wmask[None, :],
                         other=0.0)
            if SPLIT == 3:
                hi = pt.to(yq.dtype)
                pt = tl.reshape(tl.join(hi, (pt - hi.to(tl.float32)).to(yq.dtype)), [BC, W])
            acc = _dot(yq, pt, acc, DOT)
            if SPLIT == 1:
                pl = tl.load(phil_ptr + kk[:, None] * stride_phi + cols[None, :], mask=cm[:, None] & cmask[None, :],
                             other=0.0)
                acc = _dot(yq, pl, acc, DOT)
    if SPLIT >= 2:
        hi, lo = tl.split(tl.reshape(acc, [BT, MP, 2]))
        acc = hi + lo
    rinv = 1.0 / tl.sqrt(ss / K + rms_eps)
    tl.store(lg_ptr + rows64[:, None] * M + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])
    tl.store(rinv_ptr + rows64, rinv, mask=rmask)
    # u is left to `_pre_fwd` (HAS_U false: the x and u pointers are not read)
    _coef_gates(rinv, out_ptr, bias_ptr, alpha_ptr, lg_ptr, hpre_ptr, hpost_ptr, hres_ptr, hpre_ptr, rows64, rmask, C,
                K, iters, eps, pre_eps, post_mult, NS, M, NEXT_RES, True, False, T_IN, T_OUT, BT, BC)
