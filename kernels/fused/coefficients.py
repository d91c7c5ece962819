"""Fused mHC coefficients (docs/design.md §2-3, §10): GEMM + sum of squares + sigma / 2 sigma + Sinkhorn.

Forward, one kernel (`_coef_fwd`): one read of x [N, n, C] yields the raw projection L = x phi [N, M] (fp32
accumulate, M = n^2 + 2n) and sum(x^2); the per-token tail (norm-after-matmul, gates, bias, sigma, Sinkhorn)
runs in fp32 registers. Only L and 1/r (M + 1 floats per token) are kept for the backward.
- HAS_U (the fused pre op): the same kernel also writes u = sum_j h_pre_j x_j; its C loop re-reads the token
  block it has just streamed. At N = 16384, C = 1024 those re-reads mostly miss the L2 (ncu: 266 MB of DRAM read
  for a 134 MB x), so above CONFIG "u_inside_max_c" ops runs stream_pre's streaming kernel for u instead.
  The sublayer boundary op's forward is `_post_fwd` then this kernel on the x it wrote (docs/kernels.md: the
  write-back fused into this kernel, and a split-K projection, were measured slower).
- `_coef_tail` (CONFIG "split_tail") runs Sinkhorn in its own launch with small token blocks, so the serial tail
  does not sit behind each program's GEMM loop.

Backward, two kernels:
- `_coef_bwd_tok`: per token, replays the Sinkhorn iterates once in registers, saving the 2*iters - 1
  reciprocal row / column sums (n floats each) to a global scratch buffer, then walks back in O(iters),
  rebuilding each iterate by undoing its scaling (exact gradient of the unrolled iterations). It turns
  dh_pre / dh_post / dh_res into dL (the gradient of the raw projection) and d(sum x^2); bias and alpha
  gradients are reduced per program into a small partial buffer (deterministic, no atomics). With HAS_U
  it first reduces dh_pre += <du, x_j> over C (the u path of the fused pre and boundary ops).
- `_coef_bwd_x`: one read of x per (column block, token split): the partial phi gradient x^T dL (tl.dot),
  summed over splits afterwards, and with HAS_DX dx = dL phi^T + 2 x d(sum x^2) (+ h_pre_j du with HAS_U:
  the fused pre op's single dx; + the write-back's gradient of x with ACC, `mhc_enter`; HC's rows with U_ROWS,
  `hc_enter`; the boundary op's whole gradient of x_next with the downstream one as ACC, CONFIG bnd_bwd xpass). With
  xpass off the boundary op computes its dx in `_post_bwd_2d` and uses this kernel for the phi gradient only.

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
def _row_step(p, eps):
    # rows of the [BT, n, n] tile (axis 2) sum to 1; one reciprocal per row instead of n divisions. Returns the
    # reciprocal sums too: the backward's replay stores them
    r = 1.0 / (tl.sum(p, axis=2) + eps)
    return p * r[:, :, None], r


@triton.jit
def _col_step(p, eps):
    r = 1.0 / (tl.sum(p, axis=1) + eps)
    return p * r[:, None, :], r


@triton.jit
def _row_step_back(g, p, r):
    """Through row normalisation y = x r (r = 1 / row sums) backward: g for x, and x rebuilt from y = p."""
    return (g - tl.sum(g * p, axis=2)[:, :, None]) * r[:, :, None], p / r[:, :, None]


@triton.jit
def _col_step_back(g, p, r):
    return (g - tl.sum(g * p, axis=1)[:, None, :]) * r[:, None, :], p / r[:, None, :]


@triton.jit
def _softmax_cols(w, eps):
    # column-wise softmax (over axis 1 = rows i) + eps: T_c o exp with an exact max shift
    m = tl.max(w, axis=1)
    e = tl.exp(w - m[:, None, :])
    return e / tl.sum(e, axis=1)[:, None, :] + eps


@triton.jit
def _sinkhorn_fwd(w, iters, eps):
    """Canonical K(w): softmax_eps start, T_r, then (T_c, T_r) x (iters - 1). Rows exact."""
    p, _ = _row_step(_softmax_cols(w, eps), eps)
    for _ in range(iters - 1):
        p, _ = _col_step(p, eps)
        p, _ = _row_step(p, eps)
    return p


@triton.jit
def _sinkhorn_bwd(w, g, iters, eps, sc_ptr, rows64, rmask, N, NS: tl.constexpr):
    """dL/dw for K(w) given g = dL/dK, O(iters). Forward replay once, storing each normalisation's reciprocal
    sums r_k ([tokens, n], scratch layout [2*iters - 1, N, n]: coalesced per step); backward step k uses the
    iterate y_k = p (the output of normalisation k) and rebuilds its input as y_k / r_k. Normalisation k
    (0-based) is a row normalisation when k is even."""
    p = _softmax_cols(w, eps)
    s = p - eps  # the softmax itself; +eps has no derivative
    nn = tl.arange(0, NS)
    m2 = rmask[:, None] & (nn[None, :] < NS)
    ptr = sc_ptr + rows64[:, None] * NS + nn[None, :]
    step = N * NS  # pointer increments stay 64-bit; N * n < 2^31
    # normalisation k is a row normalisation when k is even: 0, then (1, 2), (3, 4), ... in pairs, so that no step
    # branches on its parity
    p, r = _row_step(p, eps)
    tl.store(ptr, r, mask=m2)
    for _ in range(iters - 1):
        p, r = _col_step(p, eps)
        ptr += step
        tl.store(ptr, r, mask=m2)
        p, r = _row_step(p, eps)
        ptr += step
        tl.store(ptr, r, mask=m2)
    tl.debug_barrier()  # the walk back reads r_k in another layout: make this CTA's stores visible
    for _ in range(iters - 1):  # back through the pairs: row normalisation 2m, then column 2m - 1
        g, p = _row_step_back(g, p, tl.load(ptr, mask=m2, other=1.0))
        ptr -= step
        g, p = _col_step_back(g, p, tl.load(ptr, mask=m2, other=1.0))
        ptr -= step
    g, _ = _row_step_back(g, p, tl.load(ptr, mask=m2, other=1.0))  # normalisation 0 (rows)
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


@triton.jit
def _res_tail(lg_ptr, bias_ptr, alpha_ptr, hres_ptr, rows64, rmask, rinv, iters, eps,
              NS: tl.constexpr, M: tl.constexpr, T_IN: tl.constexpr, T_OUT: tl.constexpr):
    # The n x n logits are loaded and stored as flat rows of n^2 contiguous floats and reshaped: the [BT, n, n] tile
    # then keeps each token's matrix inside one warp (a few lanes), so the Sinkhorn loop's row and column sums are
    # register and shuffle reductions. Loaded as [BT, n, n] with strided offsets, Triton spread a matrix axis over
    # warps whenever BT < 32 * num_warps, and every normalisation went through shared memory (docs/kernels.md).
    a_res = tl.load(alpha_ptr + 2).to(tl.float32)
    q = tl.arange(0, NS * NS)
    tok2 = rmask[:, None] & (q[None, :] < NS * NS)
    l_res = tl.load(lg_ptr + rows64[:, None] * M + 2 * NS + q[None, :], mask=tok2, other=0.0)
    w = a_res * rinv[:, None] * l_res + tl.load(bias_ptr + 2 * NS + q).to(tl.float32)[None, :]
    w = tl.reshape(w, [w.shape[0], NS, NS])  # w[t, a, b] = R[a, b]
    if T_IN:
        w = tl.permute(w, (0, 2, 1))
    p = _sinkhorn_fwd(w, iters, eps)
    if T_OUT:
        p = tl.permute(p, (0, 2, 1))
    tl.store(hres_ptr + rows64[:, None] * (NS * NS) + q[None, :], tl.reshape(p, [p.shape[0], NS * NS]), mask=tok2)


@triton.jit(do_not_specialize=["N", "iters"])
def _coef_fwd(
    x_ptr, phi_ptr, phil_ptr, bias_ptr, alpha_ptr, lg_ptr, rinv_ptr, hpre_ptr, hpost_ptr, hres_ptr, u_ptr,
    N, C, stride_x, stride_phi, iters, eps, rms_eps, pre_eps, post_mult,
    NS: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, HAS_RES: tl.constexpr, SINK: tl.constexpr,
    HAS_U: tl.constexpr, T_IN: tl.constexpr, T_OUT: tl.constexpr,
    DOT: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr, TAIL: tl.constexpr = True,
    SPLIT: tl.constexpr = 0, HC_TAIL: tl.constexpr = 0, NH: tl.constexpr = 1,
):
    """x [N, n*C] rows (stride_x), BK: tile of the flat row in the projection loop, BC: C tile of the u loop.
    TAIL = False (the RMS-normalised projection of HC, `rms_proj`): only the raw projection and 1/r are stored;
    HC_TAIL (1: tanh, 2: linear) then also HC's coefficients from it (`_hc_tail`; rows are (token, stream) pairs of
    NH streams, and bias_ptr holds HC's static parameters).
    SPLIT: phi in two parts of x's dtype, phi = hi + lo (exact 16-bit products, fp32 accumulate: an fp32 phi to 16
    mantissa bits, more than tf32's 11, with native dots). 1: hi at phi_ptr, lo at phil_ptr, one dot each. 2: one
    [K, 2M] matrix at phi_ptr, hi and lo of column j interleaved (columns 2j, 2j + 1): one dot of twice the width,
    x's tile fed to the tensor cores once, the pairs summed after the loop. 3: as 2, the pairs made in the kernel from
    the fp32 phi at phi_ptr (no host-side split: no extra launches, nothing to keep in step with the parameter)."""
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    rmask = rows < N
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, MP)
    cmask = cols < M
    K = NS * C
    W: tl.constexpr = 2 * MP if SPLIT >= 2 else MP  # width of the dot (interleaved hi / lo pairs: twice)
    WS: tl.constexpr = 2 * MP if SPLIT == 2 else MP  # columns of the phi tile as stored
    wcols = tl.arange(0, WS)
    wmask = wcols < (2 * M if SPLIT == 2 else M)
    acc = tl.zeros([BT, W], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    # one pass over x [N, n*C]: projection and sum of squares share every load
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < K
        xt = tl.load(x_ptr + rows64[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        pt = tl.load(phi_ptr + kk[:, None] * stride_phi + wcols[None, :], mask=kmask[:, None] & wmask[None, :],
                     other=0.0)
        xf = xt.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        if SPLIT == 3:
            hi = pt.to(xt.dtype)
            pt = tl.reshape(tl.join(hi, (pt - hi.to(tl.float32)).to(xt.dtype)), [BK, W])
        acc = _dot(xt, pt, acc, DOT)
        if SPLIT == 1:
            pl = tl.load(phil_ptr + kk[:, None] * stride_phi + cols[None, :], mask=kmask[:, None] & cmask[None, :],
                         other=0.0)
            acc = _dot(xt, pl, acc, DOT)
    if SPLIT >= 2:
        hi, lo = tl.split(tl.reshape(acc, [BT, MP, 2]))
        acc = hi + lo
    rinv = 1.0 / tl.sqrt(ss / K + rms_eps)
    tl.store(lg_ptr + rows64[:, None] * M + cols[None, :], acc, mask=rmask[:, None] & cmask[None, :])
    tl.store(rinv_ptr + rows64, rinv, mask=rmask)
    if HC_TAIL > 0:
        _hc_tail(lg_ptr, rinv, bias_ptr, hpre_ptr, hpost_ptr, hres_ptr, rows64, rmask, M, NH, HC_TAIL == 1)
    if TAIL:
        _coef_gates(rinv, x_ptr, bias_ptr, alpha_ptr, lg_ptr, hpre_ptr, hpost_ptr, hres_ptr, u_ptr, rows64, rmask, C,
                    stride_x, iters, eps, pre_eps, post_mult, NS, M, HAS_RES, SINK, HAS_U, T_IN, T_OUT, BT, BC)


@triton.jit
def _row_block(N, BT: tl.constexpr, NS: tl.constexpr):
    """This program's block of BT rows: 64-bit indices, their mask, the NS stream offsets and the [BT, NS] mask."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < N
    nn = tl.arange(0, NS)
    return rows.to(tl.int64), rmask, nn, rmask[:, None] & (nn[None, :] < NS)


@triton.jit
def _hc_act(y, TANH: tl.constexpr):
    if TANH:
        return 2.0 * tl.sigmoid(2.0 * y) - 1.0  # tanh
    else:
        return y


@triton.jit
def _hc_rows(lg_ptr, rinv, rows64, rmask, M: tl.constexpr, NH: tl.constexpr, TANH: tl.constexpr):
    """A block of HC's projection rows (token t, stream i = row % NH): the raw logits L (columns beta, m, then the NH
    of r) and their activations act(L / r)."""
    jj = tl.arange(0, NH)
    m2 = rmask[:, None] & (jj[None, :] < NH)
    l0 = tl.load(lg_ptr + rows64 * M, mask=rmask, other=0.0)
    l1 = tl.load(lg_ptr + rows64 * M + 1, mask=rmask, other=0.0)
    lr = tl.load(lg_ptr + rows64[:, None] * M + 2 + jj[None, :], mask=m2, other=0.0)
    return (l0, l1, lr, _hc_act(l0 * rinv, TANH), _hc_act(l1 * rinv, TANH), _hc_act(lr * rinv[:, None], TANH))


@triton.jit
def _hc_tail(lg_ptr, rinv, st_ptr, hpre_ptr, hpost_ptr, hres_ptr, rows64, rmask, M: tl.constexpr, NH: tl.constexpr,
             TANH: tl.constexpr):
    """HC's coefficients (reference.hc_from_projection) from the projection rows this program has just stored:
    h_post = B_i + s_beta act_0, h_pre = A_m,i + s_alpha act_1, H^res[t, j, i] = A_r,ij + s_alpha act_2+j.
    st_ptr: fp32 [s_beta, s_alpha, B (NH), A_m (NH), A_r (NH x NH)]."""
    tl.debug_barrier()  # this CTA's stores of L, re-read in per-map shapes
    jj = tl.arange(0, NH)
    m2 = rmask[:, None] & (jj[None, :] < NH)
    i = rows64 % NH
    t = rows64 // NH
    _, _, _, a0, a1, ar = _hc_rows(lg_ptr, rinv, rows64, rmask, M, NH, TANH)
    s_beta = tl.load(st_ptr)
    s_alpha = tl.load(st_ptr + 1)
    tl.store(hpost_ptr + rows64, tl.load(st_ptr + 2 + i, mask=rmask, other=0.0) + s_beta * a0, mask=rmask)
    tl.store(hpre_ptr + rows64, tl.load(st_ptr + 2 + NH + i, mask=rmask, other=0.0) + s_alpha * a1, mask=rmask)
    a_static = tl.load(st_ptr + 2 + 2 * NH + i[:, None] * NH + jj[None, :], mask=m2, other=0.0)
    tl.store(hres_ptr + t[:, None] * (NH * NH) + jj[None, :] * NH + i[:, None], a_static + s_alpha * ar, mask=m2)


@triton.jit(do_not_specialize=["R", "NP"])
def _hc_tail_bwd(lg_ptr, rinv_ptr, st_ptr, dpre_ptr, dpost_ptr, dres_ptr, dl_ptr, dss_ptr, part_ptr, x_ptr, du_ptr,
                 dun_ptr, R, NP, C, inv_c, M: tl.constexpr, NH: tl.constexpr, TANH: tl.constexpr, BT: tl.constexpr,
                 HAS_U: tl.constexpr = False, BC: tl.constexpr = 16, HAS_DPRE: tl.constexpr = True,
                 DU_NARROW: tl.constexpr = False):
    """Backward of `_hc_tail` and of y = L / r for a block of rows: dL = dy / r and d(sum x^2) (what `_coef_bwd_x`
    turns into dx and dw), and this program's partial sums of the static parameters' gradients (part [PW, NP]: column
    pid of NP programs, rows laid out as st_ptr; summed afterwards: deterministic, no atomics).
    HAS_U (`hc_enter`, where the op also computed u = sum_i h_pre_i x_i): dh_pre of row (t, i) first gains
    <du_t, x_ti>, reading the block's rows of x (x_ptr, [R, C]) and their tokens' du (du_ptr, [R / NH, C]).
    HAS_DPRE = False: h_pre had no gradient of its own (only through u): dh_pre starts at zero, nothing is read.
    DU_NARROW (with HAS_U): du is wider than x (u in the branch's dtype, ops "u"): rounded to x's dtype as the cast's
    backward would, and stored at dun_ptr ([R / NH, C], by each token's stream-0 row) for the x pass."""
    pid = tl.program_id(0)
    rows64, rmask, jj, m2 = _row_block(R, BT, NH)
    i = rows64 % NH
    t = rows64 // NH
    rinv = tl.load(rinv_ptr + rows64, mask=rmask, other=0.0)
    l0, l1, lr, a0, a1, ar = _hc_rows(lg_ptr, rinv, rows64, rmask, M, NH, TANH)
    s_beta = tl.load(st_ptr)
    s_alpha = tl.load(st_ptr + 1)
    g0 = tl.load(dpost_ptr + rows64, mask=rmask, other=0.0)
    if HAS_DPRE:
        g1 = tl.load(dpre_ptr + rows64, mask=rmask, other=0.0)
    else:
        g1 = tl.zeros([BT], dtype=tl.float32)
    if HAS_U:  # the NH rows of a token share its du row (cache hits after the first)
        for c0 in range(0, C, BC):
            cc = c0 + tl.arange(0, BC)
            mc = rmask[:, None] & (cc[None, :] < C)
            xv = tl.load(x_ptr + rows64[:, None] * C + cc[None, :], mask=mc, other=0.0).to(tl.float32)
            dv = tl.load(du_ptr + t[:, None] * C + cc[None, :], mask=mc, other=0.0)
            if DU_NARROW:
                dv = dv.to(x_ptr.dtype.element_ty)
                tl.store(dun_ptr + t[:, None] * C + cc[None, :], dv, mask=mc & (i == 0)[:, None])
            g1 += tl.sum(xv * dv.to(tl.float32), axis=1)
    gr = tl.load(dres_ptr + t[:, None] * (NH * NH) + jj[None, :] * NH + i[:, None], mask=m2, other=0.0)
    if TANH:
        d0, d1, dr = g0 * s_beta * (1.0 - a0 * a0), g1 * s_alpha * (1.0 - a1 * a1), gr * s_alpha * (1.0 - ar * ar)
    else:
        d0, d1, dr = g0 * s_beta, g1 * s_alpha, gr * s_alpha
    tl.store(dl_ptr + rows64 * M, d0 * rinv, mask=rmask)
    tl.store(dl_ptr + rows64 * M + 1, d1 * rinv, mask=rmask)
    tl.store(dl_ptr + rows64[:, None] * M + 2 + jj[None, :], dr * rinv[:, None], mask=m2)
    # 1/r = (sum x^2 / C + eps)^(-1/2)
    dss = (-0.5 * inv_c) * (d0 * l0 + d1 * l1 + tl.sum(dr * lr, axis=1)) * rinv * rinv * rinv
    tl.store(dss_ptr + rows64, dss, mask=rmask)
    base = part_ptr + pid
    tl.store(base, tl.sum(g0 * a0, axis=0))
    tl.store(base + NP, tl.sum(g1 * a1, axis=0) + tl.sum(tl.sum(gr * ar, axis=1), axis=0))
    onehot = (i[:, None] == jj[None, :]).to(tl.float32)  # [BT, NH]: the stream of each row
    tl.store(base + (2 + jj) * NP, tl.sum(onehot * g0[:, None], axis=0))
    tl.store(base + (2 + NH + jj) * NP, tl.sum(onehot * g1[:, None], axis=0))
    d_ar = tl.sum(onehot[:, :, None] * gr[:, None, :], axis=0)  # [i, j]
    tl.store(base + (2 + 2 * NH + jj[:, None] * NH + jj[None, :]) * NP, d_ar)


@triton.jit
def _coef_gates(rinv, x_ptr, bias_ptr, alpha_ptr, lg_ptr, hpre_ptr, hpost_ptr, hres_ptr, u_ptr, rows64, rmask, C,
                stride_x, iters, eps, pre_eps, post_mult, NS: tl.constexpr, M: tl.constexpr, HAS_RES: tl.constexpr,
                SINK: tl.constexpr, HAS_U: tl.constexpr, T_IN: tl.constexpr, T_OUT: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr):
    """The per-token tail of a token block whose logits and 1/r `_coef_fwd` has just stored: the gates h_pre /
    h_post, optionally u = sum_j h_pre_j x_j (re-reading the block's rows of x) and H^res (SINK)."""
    nn = tl.arange(0, NS)
    tok = rmask[:, None] & (nn[None, :] < NS)
    # Re-read the projection in per-map shapes (a register tile cannot be sliced); the barrier makes
    # this CTA's stores visible to all its threads.
    tl.debug_barrier()
    a_pre = tl.load(alpha_ptr).to(tl.float32)
    a_post = tl.load(alpha_ptr + 1).to(tl.float32)
    l_pre = tl.load(lg_ptr + rows64[:, None] * M + nn[None, :], mask=tok, other=0.0)
    l_post = tl.load(lg_ptr + rows64[:, None] * M + NS + nn[None, :], mask=tok, other=0.0)
    y_pre = a_pre * rinv[:, None] * l_pre + tl.load(bias_ptr + nn).to(tl.float32)[None, :]
    y_post = a_post * rinv[:, None] * l_post + tl.load(bias_ptr + NS + nn).to(tl.float32)[None, :]
    h_pre = tl.sigmoid(y_pre) + pre_eps
    tl.store(hpre_ptr + rows64[:, None] * NS + nn[None, :], h_pre, mask=tok)
    tl.store(hpost_ptr + rows64[:, None] * NS + nn[None, :], post_mult * tl.sigmoid(y_post), mask=tok)
    if HAS_U:
        # u = sum_j h_pre_j x_j: this block of x was just streamed by the same program (L2 hits)
        for c0 in range(0, C, BC):
            cc = c0 + tl.arange(0, BC)
            m2 = rmask[:, None] & (cc[None, :] < C)
            u = tl.zeros([BT, BC], dtype=tl.float32)
            for j in tl.static_range(NS):
                hj = tl.sum(tl.where(nn[None, :] == j, h_pre, 0.0), axis=1)
                xj = tl.load(x_ptr + rows64[:, None] * stride_x + j * C + cc[None, :], mask=m2, other=0.0)
                u += hj[:, None] * xj.to(tl.float32)
            # rounded to the stream's dtype first: a wider u (the branch's dtype, ops "u") holds the same values
            u = u.to(x_ptr.dtype.element_ty).to(u_ptr.dtype.element_ty)
            tl.store(u_ptr + rows64[:, None] * C + cc[None, :], u, mask=m2)
    if HAS_RES and SINK:
        _res_tail(lg_ptr, bias_ptr, alpha_ptr, hres_ptr, rows64, rmask, rinv, iters, eps, NS, M, T_IN, T_OUT)


@triton.jit(do_not_specialize=["N", "iters"])
def _coef_tail(
    lg_ptr, rinv_ptr, bias_ptr, alpha_ptr, hres_ptr, N, iters, eps,
    NS: tl.constexpr, M: tl.constexpr, T_IN: tl.constexpr, T_OUT: tl.constexpr, BT: tl.constexpr,
):
    """Split tail: Sinkhorn on the saved logits, many small programs (see module docstring)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < N
    rinv = tl.load(rinv_ptr + rows, mask=rmask, other=0.0)
    _res_tail(lg_ptr, bias_ptr, alpha_ptr, hres_ptr, rows.to(tl.int64), rmask, rinv, iters, eps, NS, M, T_IN, T_OUT)


@triton.jit
def _tok_du_x(dh_pre, x_ptr, du_ptr, dun_ptr, rows64, rmask, nn, C, stride_x, NS: tl.constexpr, BC: tl.constexpr,
              LOOP_STAGES: tl.constexpr, DU_NARROW: tl.constexpr):
    """dh_pre_j + <du, x_j> for the block's tokens (the fused pre op: u = sum_j h_pre_j x_j; one read of du and x).
    DU_NARROW: du came in wider than x (u handed to the branch in its dtype, ops "u"): each tile is rounded to x's
    dtype, as the cast's backward would have, and stored at dun_ptr for the x pass."""
    for c0 in tl.range(0, C, BC, num_stages=LOOP_STAGES):
        cc = c0 + tl.arange(0, BC)
        m2 = rmask[:, None] & (cc[None, :] < C)
        du = tl.load(du_ptr + rows64[:, None] * C + cc[None, :], mask=m2, other=0.0)
        if DU_NARROW:
            du = du.to(x_ptr.dtype.element_ty)
            tl.store(dun_ptr + rows64[:, None] * C + cc[None, :], du, mask=m2)
        du = du.to(tl.float32)
        for j in tl.static_range(NS):
            xj = tl.load(x_ptr + rows64[:, None] * stride_x + j * C + cc[None, :], mask=m2, other=0.0)
            dh_pre += tl.where(nn[None, :] == j, tl.sum(du * xj.to(tl.float32), axis=1)[:, None], 0.0)
    return dh_pre


@triton.jit
def _tok_res(lg_ptr, bias_ptr, alpha_ptr, dres_ptr, dl_ptr, part_ptr, sc_ptr, pid, NP, rows64, rmask, rinv, N, iters,
             eps, NS: tl.constexpr, M: tl.constexpr, T_IN: tl.constexpr, T_OUT: tl.constexpr):
    """The res logits' part of the per-token backward (Sinkhorn's backward): their dL, this program's partial sums of
    their bias and alpha gradients; returns their share of d loss / d rinv. Needs nothing of the <du, x> loop."""
    a_res = tl.load(alpha_ptr + 2).to(tl.float32)
    idx = _res_index(NS, T_IN)
    tok3 = rmask[:, None, None] & (idx[None, :, :] >= 0)
    l_res = tl.load(lg_ptr + rows64[:, None, None] * M + 2 * NS + idx[None, :, :], mask=tok3, other=0.0)
    w = a_res * rinv[:, None, None] * l_res + tl.load(bias_ptr + 2 * NS + idx).to(tl.float32)[None, :, :]
    oidx = _res_index(NS, T_OUT)
    g = tl.load(dres_ptr + rows64[:, None, None] * (NS * NS) + oidx[None, :, :], mask=tok3, other=0.0)
    dw = _sinkhorn_bwd(w, g.to(tl.float32), iters, eps, sc_ptr, rows64, rmask, N, NS)
    tl.store(dl_ptr + rows64[:, None, None] * M + 2 * NS + idx[None, :, :], dw * a_res * rinv[:, None, None], mask=tok3)
    tl.store(part_ptr + (2 * NS + idx) * NP + pid, tl.sum(dw, axis=0))
    tl.store(part_ptr + (M + 2) * NP + pid, tl.sum(tl.sum(tl.sum(dw * l_res, axis=2), axis=1) * rinv, axis=0))
    return tl.sum(tl.sum(dw * a_res * l_res, axis=2), axis=1)


@triton.jit(do_not_specialize=["N", "NP", "iters"])
def _coef_bwd_tok(
    lg_ptr, rinv_ptr, bias_ptr, alpha_ptr, dpre_ptr, dpost_ptr, dres_ptr, dl_ptr, dss_ptr, part_ptr, sc_ptr,
    x_ptr, du_ptr, dun_ptr, N, NP, K, C, stride_x, iters, eps, post_mult,
    NS: tl.constexpr, M: tl.constexpr, HAS_RES: tl.constexpr, T_IN: tl.constexpr, T_OUT: tl.constexpr,
    HAS_U: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_DPRE: tl.constexpr = True,
    LOOP_STAGES: tl.constexpr = None, INTERLEAVE: tl.constexpr = False, DU_NARROW: tl.constexpr = False,
):
    """HAS_DPRE = False: h_pre had no gradient of its own (the model reads it only through u): dh_pre starts at zero
    (no zero tensor is made and filled for it). LOOP_STAGES: the <du, x_j> loop's pipelining depth (CONFIG
    loop_stages; None: Triton's default, which pipelines only a dot's operands, so none of this loop's loads).
    INTERLEAVE (with HAS_U and HAS_RES): odd programs run Sinkhorn's backward (compute, independent of the loop)
    before the <du, x_j> loop (memory) and even ones after it, so that while some programs of an SM stream du and x
    others compute instead of every program doing the two one after the other in step (timed in round 16: no faster,
    CONFIG keeps it off). DU_NARROW (with HAS_U): du is wider than x; its copy in x's dtype goes to dun_ptr."""
    pid = tl.program_id(0)
    rows64, rmask, nn, tok = _row_block(N, BT, NS)
    rinv = tl.load(rinv_ptr + rows64, mask=rmask, other=0.0)
    a_pre = tl.load(alpha_ptr).to(tl.float32)
    a_post = tl.load(alpha_ptr + 1).to(tl.float32)
    # masked rows load dh = 0, so they contribute nothing to any reduction below
    l_pre = tl.load(lg_ptr + rows64[:, None] * M + nn[None, :], mask=tok, other=0.0)
    s = tl.sigmoid(a_pre * rinv[:, None] * l_pre + tl.load(bias_ptr + nn).to(tl.float32)[None, :])
    if HAS_DPRE:
        dh_pre = tl.load(dpre_ptr + rows64[:, None] * NS + nn[None, :], mask=tok, other=0.0)
    else:
        dh_pre = tl.zeros([BT, NS], dtype=tl.float32)
    drinv = tl.zeros([BT], dtype=tl.float32)
    if HAS_RES:
        if HAS_U and INTERLEAVE:
            if pid % 2 == 1:
                drinv = _tok_res(lg_ptr, bias_ptr, alpha_ptr, dres_ptr, dl_ptr, part_ptr, sc_ptr, pid, NP, rows64,
                                 rmask, rinv, N, iters, eps, NS, M, T_IN, T_OUT)
                dh_pre = _tok_du_x(dh_pre, x_ptr, du_ptr, dun_ptr, rows64, rmask, nn, C, stride_x, NS, BC,
                                   LOOP_STAGES, DU_NARROW)
            else:
                dh_pre = _tok_du_x(dh_pre, x_ptr, du_ptr, dun_ptr, rows64, rmask, nn, C, stride_x, NS, BC,
                                   LOOP_STAGES, DU_NARROW)
                drinv = _tok_res(lg_ptr, bias_ptr, alpha_ptr, dres_ptr, dl_ptr, part_ptr, sc_ptr, pid, NP, rows64,
                                 rmask, rinv, N, iters, eps, NS, M, T_IN, T_OUT)
        else:
            if HAS_U:
                dh_pre = _tok_du_x(dh_pre, x_ptr, du_ptr, dun_ptr, rows64, rmask, nn, C, stride_x, NS, BC,
                                   LOOP_STAGES, DU_NARROW)
            drinv = _tok_res(lg_ptr, bias_ptr, alpha_ptr, dres_ptr, dl_ptr, part_ptr, sc_ptr, pid, NP, rows64, rmask,
                             rinv, N, iters, eps, NS, M, T_IN, T_OUT)
    else:
        if HAS_U:
            dh_pre = _tok_du_x(dh_pre, x_ptr, du_ptr, dun_ptr, rows64, rmask, nn, C, stride_x, NS, BC,
                               LOOP_STAGES, DU_NARROW)
        tl.store(part_ptr + (M + 2) * NP + pid, 0.0)
    dy_pre = dh_pre * s * (1.0 - s)
    l_post = tl.load(lg_ptr + rows64[:, None] * M + NS + nn[None, :], mask=tok, other=0.0)
    s = tl.sigmoid(a_post * rinv[:, None] * l_post + tl.load(bias_ptr + NS + nn).to(tl.float32)[None, :])
    dy_post = tl.load(dpost_ptr + rows64[:, None] * NS + nn[None, :], mask=tok, other=0.0) * post_mult * s * (1.0 - s)
    tl.store(dl_ptr + rows64[:, None] * M + nn[None, :], dy_pre * a_pre * rinv[:, None], mask=tok)
    tl.store(dl_ptr + rows64[:, None] * M + NS + nn[None, :], dy_post * a_post * rinv[:, None], mask=tok)
    # d loss / d rinv, and per-program partial sums of the bias and alpha gradients
    drinv += tl.sum(dy_pre * a_pre * l_pre, axis=1) + tl.sum(dy_post * a_post * l_post, axis=1)
    tl.store(part_ptr + nn * NP + pid, tl.sum(dy_pre, axis=0))
    tl.store(part_ptr + (NS + nn) * NP + pid, tl.sum(dy_post, axis=0))
    tl.store(part_ptr + M * NP + pid, tl.sum(tl.sum(dy_pre * l_pre, axis=1) * rinv, axis=0))
    tl.store(part_ptr + (M + 1) * NP + pid, tl.sum(tl.sum(dy_post * l_post, axis=1) * rinv, axis=0))
    # rinv = (sumsq / K + rms_eps)^(-1/2)  =>  d rinv / d sumsq = -rinv^3 / (2K)
    tl.store(dss_ptr + rows64, -0.5 * drinv * rinv * rinv * rinv / K, mask=rmask)


@triton.jit
def _dphi_dots(acc, xt, dlt, SPLIT: tl.constexpr, DOT: tl.constexpr):
    """acc += x^T dL for one token block (dL fp32; SPLIT: as its two bf16 parts, x as stored)."""
    if SPLIT:
        dh = dlt.to(tl.bfloat16)
        acc = _dot(tl.trans(xt), dh, acc, DOT)
        return _dot(tl.trans(xt), (dlt - dh.to(tl.float32)).to(tl.bfloat16), acc, DOT)
    return _dot(tl.trans(xt.to(tl.float32)), dlt, acc, DOT)


@triton.jit(do_not_specialize=["N", "tok_per_split"])
def _coef_bwd_x(
    x_ptr, phi_ptr, dl_ptr, dss_ptr, dx_ptr, dphi_ptr, hpre_ptr, du_ptr, dxin_ptr,
    N, K, C, stride_x, stride_phi, tok_per_split,
    NS: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, DOT: tl.constexpr, HAS_U: tl.constexpr,
    HAS_DX: tl.constexpr, ALIGNED: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr = False,
    SPLIT: tl.constexpr = False, PHI_LO: tl.constexpr = False, U_ROWS: tl.constexpr = 1,
    LOOP_STAGES: tl.constexpr = None, DPHI_FIRST: tl.constexpr = True, TMA: tl.constexpr = False,
):
    """ACC (with HAS_DX): dx also adds dxin [N, K], the gradient x received from its other consumer (the write-back
    of the same sublayer, `mhc_enter`, `hc_enter`), so that autograd has no sum of two stream-sized gradients to run.
    U_ROWS: rows of x per row of du (HC's rows are (token, stream) pairs, NS = 1: U_ROWS = n, h_pre one per row).
    SPLIT (bf16 x): dL (fp32) enters both dots as two bf16 parts hi + lo, phi as its bf16 part (+ its lo part with
    PHI_LO, for an fp32 phi), and x as it is stored: 16-bit operands (no fp32 copies of x tiles in shared memory),
    exact products in the fp32 accumulator, 16 mantissa bits of dL and phi (tf32: 11).
    LOOP_STAGES: the token loop's pipelining depth (CONFIG loop_stages): every load of the loop an async copy into
    shared memory; None, Triton's default, pipelines only the dots' operands (x, dL), not dx_in, du, h_pre, dss.
    DPHI_FIRST (CONFIG dphi_first): the phi-gradient dots before dx's, so that dL's 16-bit copies in shared memory
    are dead when dx's store converts its layout through shared memory, and the two reuse one buffer (Triton 3.6,
    sm_90, fp32 phi: 49.7 KB instead of 57.9, 4 CTAs per SM instead of 3; bench/kernel_resources.py).
    TMA (CONFIG tma): x, dL, dx_in, du and dx are host tensor descriptors (block [BT, BK], dL's [BT, MP]) instead of
    pointers: the copy engine moves whole tiles, with no per-thread addresses or masks in the loop; rows and columns
    past the tensors' ends read as zero and are not written. Token splits are whole token blocks (ops.bwd_x), so a
    block never reaches into the next split's rows. Needs U_ROWS = 1 and, with HAS_U, ALIGNED."""
    pid_k = tl.program_id(0)
    pid_s = tl.program_id(1)
    kk = pid_k * BK + tl.arange(0, BK)
    kmask = kk < K
    cols = tl.arange(0, MP)
    cmask = cols < M
    if HAS_U:  # flat column k of x is stream k // C, channel k % C
        if ALIGNED:  # BK divides C: one stream per program, a [BT] gate and contiguous du columns
            s0 = (pid_k * BK) // C
            cidx = kk - s0 * C
        else:
            sidx = kk // C
            cidx = kk - sidx * C
    phi_t = tl.load(phi_ptr + kk[:, None] * stride_phi + cols[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0)
    phi_t = phi_t.to(tl.float32)
    if SPLIT:
        phi_hi = phi_t.to(tl.bfloat16)
        phi_lo = (phi_t - phi_hi.to(tl.float32)).to(tl.bfloat16)
    acc = tl.zeros([BK, MP], dtype=tl.float32)
    t_lo = pid_s * tok_per_split
    t_hi = tl.minimum(N, t_lo + tok_per_split)
    for t0 in tl.range(t_lo, t_hi, BT, num_stages=LOOP_STAGES):
        rows = t0 + tl.arange(0, BT)
        rmask = rows < t_hi
        rows64 = rows.to(tl.int64)
        m2 = rmask[:, None] & kmask[None, :]
        if TMA:
            xt = x_ptr.load([t0, pid_k * BK])
            dlt = dl_ptr.load([t0, 0])
        else:
            xt = tl.load(x_ptr + rows64[:, None] * stride_x + kk[None, :], mask=m2, other=0.0)
            dlt = tl.load(dl_ptr + rows64[:, None] * M + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        xf = xt.to(tl.float32)
        if DPHI_FIRST:
            acc = _dphi_dots(acc, xt, dlt, SPLIT, DOT)
        if HAS_DX:
            dss = tl.load(dss_ptr + rows, mask=rmask, other=0.0)
            dx0 = 2.0 * xf * dss[:, None]
            if ACC:
                if TMA:
                    dx0 += dxin_ptr.load([t0, pid_k * BK]).to(tl.float32)
                else:
                    dx0 += tl.load(dxin_ptr + rows64[:, None] * K + kk[None, :], mask=m2, other=0.0).to(tl.float32)
            if HAS_U:  # the u path of the fused pre op: dx_j += h_pre_j du (one dx for the whole op)
                if TMA:
                    duv = du_ptr.load([t0, pid_k * BK - s0 * C])
                else:
                    duv = tl.load(du_ptr + (rows64 // U_ROWS)[:, None] * C + cidx[None, :], mask=m2, other=0.0)
                if ALIGNED:
                    hpj = tl.load(hpre_ptr + rows64 * NS + s0, mask=rmask, other=0.0)
                    dx0 += hpj[:, None] * duv.to(tl.float32)
                else:
                    hpj = tl.load(hpre_ptr + rows64[:, None] * NS + sidx[None, :], mask=m2, other=0.0)
                    dx0 += hpj * duv.to(tl.float32)
            if SPLIT:
                dl_hi = dlt.to(tl.bfloat16)
                dl_lo = (dlt - dl_hi.to(tl.float32)).to(tl.bfloat16)
                dx = _dot(dl_hi, tl.trans(phi_hi), dx0, DOT)
                dx = _dot(dl_lo, tl.trans(phi_hi), dx, DOT)
                if PHI_LO:
                    dx = _dot(dl_hi, tl.trans(phi_lo), dx, DOT)
            else:
                dx = _dot(dlt, tl.trans(phi_t), dx0, DOT)
            if TMA:
                dx_ptr.store([t0, pid_k * BK], dx.to(dx_ptr.dtype))
            else:
                tl.store(dx_ptr + rows64[:, None] * K + kk[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m2)
        if not DPHI_FIRST:
            acc = _dphi_dots(acc, xt, dlt, SPLIT, DOT)
    tl.store(dphi_ptr + (pid_s * K + kk[:, None]).to(tl.int64) * M + cols[None, :], acc, mask=kmask[:, None] & cmask[None, :])
