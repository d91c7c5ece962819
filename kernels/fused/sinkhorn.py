"""H^res from its n x n logits (docs/design.md §3, §10): Sinkhorn's forward and backward on register tiles of a token
block, run per token in fp32.

Forward (`res_tail`): w = alpha_res / r * L_res + bias_res, K(w) = softmax_eps start, T_r, then (T_c, T_r) x (iters - 1)
(rows exact; "cols" runs the same K on the transposed logits and transposes the result, T_IN / T_OUT). It runs at the
end of the coefficient kernel, or in its own launch (`_coef_tail`) over many small token blocks so that no serial tail
waits behind a GEMM loop.

Backward (`res_backward`, in the per-token backward pass): replays the iterates once in registers, saving the
2 iters - 1 reciprocal row / column sums (n floats each) to a scratch buffer, then walks back in O(iters), rebuilding
each iterate by undoing its scaling: the exact gradient of the unrolled iterations, no iterate stored.
"""
import triton
import triton.language as tl


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
def res_tail(lg_ptr, bias_ptr, alpha_ptr, hres_ptr, rows64, rmask, rinv, iters, eps,
             NS: tl.constexpr, M: tl.constexpr, T_IN: tl.constexpr, T_OUT: tl.constexpr):
    """H^res of a token block from its logits (lg_ptr, saved by the coefficient kernel) and 1/r."""
    # The n x n logits are loaded and stored as flat rows of n^2 contiguous floats and reshaped: the [BT, n, n] tile
    # then keeps each token's matrix inside one warp, so the loop's row and column sums are register and shuffle
    # reductions (loaded as [BT, n, n] with strided offsets, a matrix axis could spread over warps, and every
    # normalisation went through shared memory).
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


@triton.jit
def res_backward(lg_ptr, bias_ptr, alpha_ptr, dres_ptr, dl_ptr, part_ptr, sc_ptr, pid, NP, rows64, rmask, rinv, N,
                 iters, eps, NS: tl.constexpr, M: tl.constexpr, T_IN: tl.constexpr, T_OUT: tl.constexpr):
    """The res logits' part of the per-token backward: their dL, this program's partial sums of their bias and alpha
    gradients (rows of part_ptr [M + 3, NP]); returns their share of d loss / d rinv."""
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


@triton.jit(do_not_specialize=["N", "iters"])
def _coef_tail(
    lg_ptr, rinv_ptr, bias_ptr, alpha_ptr, hres_ptr, N, iters, eps,
    NS: tl.constexpr, M: tl.constexpr, T_IN: tl.constexpr, T_OUT: tl.constexpr, BT: tl.constexpr,
):
    """Sinkhorn on the logits and 1/r the coefficient kernel saved, in its own launch of small token blocks."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < N
    rinv = tl.load(rinv_ptr + rows, mask=rmask, other=0.0)
    res_tail(lg_ptr, bias_ptr, alpha_ptr, hres_ptr, rows.to(tl.int64), rmask, rinv, iters, eps, NS, M, T_IN, T_OUT)
