"""The small per-sublayer passes over the coefficient parameters, one launch each (docs/kernels.md, "Small launches").

- `_phi_pairs` (forward): an fp32 phi [K, M] as interleaved 16-bit parts [K, 2M], hi at column 2j and lo = phi - hi
  at 2j + 1, for `_coef_fwd`'s one wide dot (SPLIT = 2). In torch that was four launches (cast, subtract, cast,
  stack) per sublayer.
- `_param_grad_sum` (backward): the gradient kernels leave partial sums, the weight's per token split
  [S, K * M] (`_coef_bwd_x`) and the small vectors' per token block, one row per vector element [PW, P]
  (`_coef_bwd_tok`, `_hc_tail_bwd`: bias then alpha, or HC's statics). One launch sums both and writes each gradient
  in its parameter's dtype into its own tensor (custom-op outputs may not alias). In torch: two reductions and two
  copies per sublayer. The same launch sums the write-back backward's per-C-block partials of dh_post and dH (two
  wide sums, no vectors). Each program loads whole [rows, columns] tiles: a loop of one-row loads was latency-bound
  (20 us a launch). The vectors' P partials (2048 to 4096 per sublayer in the trainer) are summed by one program per
  element, each over a contiguous row: laid out [P, PW] they were one program's serial loop, 12 us a launch at 2048
  rows and 20 us at 4096 (round 17, docs/benchmarks.md), which kept the per-token backward at 8 tokens a program.
- `_hc_operands` (forward) and `_hc_operand_grads` (backward): HC's nine parameters as the kernels take them, the
  projection weights W = diag(g) [w_beta | w_m | W_r] [C, n + 2] (with its 16-bit pairs, as `_phi_pairs` makes them)
  and the packed statics [s_beta, s_alpha, B, A_m, A_r]; and back, the nine parameter gradients from dW and the
  statics' gradient. In torch these were three launches and a dozen autograd nodes per HC sublayer forward (about
  40 % of its eager forward's host time, docs/kernels.md), and as many backward nodes.
Each is an exact reformulation of the torch code it replaces (same values, summation in fp32); the float64 tests of
the ops that call them cover them.
"""
import triton
import triton.language as tl


@triton.jit
def _phi_pairs(phi_ptr, out_ptr, KM, BL: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BL + tl.arange(0, BL)
    mask = offs < KM
    p = tl.load(phi_ptr + offs, mask=mask, other=0.0)
    hi = p.to(out_ptr.dtype.element_ty)
    lo = (p - hi.to(tl.float32)).to(out_ptr.dtype.element_ty)
    pair = tl.reshape(tl.join(hi, lo), [2 * BL])  # [BL, 2] row-major: hi, lo of each element side by side
    o2 = tl.program_id(0).to(tl.int64) * (2 * BL) + tl.arange(0, 2 * BL)
    tl.store(out_ptr + o2, pair, mask=o2 < 2 * KM)


@triton.jit
def _wide_sum(part_ptr, out_ptr, S, L, blk, BL: tl.constexpr, BS: tl.constexpr):
    """out[i] = sum_s part[s, i] over one BL slice: BS partial rows per load, so a few loads cover all S."""
    offs = blk.to(tl.int64) * BL + tl.arange(0, BL)
    ss = tl.arange(0, BS)
    acc = tl.zeros([BS, BL], dtype=tl.float32)
    for s0 in range(0, S, BS):
        rows = s0 + ss
        acc += tl.load(part_ptr + rows.to(tl.int64)[:, None] * L + offs[None, :],
                       mask=(rows[:, None] < S) & (offs[None, :] < L), other=0.0)
    tl.store(out_ptr + offs, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=offs < L)


@triton.jit(do_not_specialize=["S1", "L1", "S2", "L2", "P"])
def _param_grad_sum(
    w1_ptr, o1_ptr, S1, L1, w2_ptr, o2_ptr, S2, L2, v_ptr, da_ptr, db_ptr, P,
    HAS_W2: tl.constexpr, HAS_V: tl.constexpr, A: tl.constexpr, BL: tl.constexpr, BS: tl.constexpr,
    BP: tl.constexpr,
):
    """Programs [0, cdiv(L1, BL)): o1 = w1 [S1, L1] summed over S1; then (HAS_W2) o2 likewise from w2 [S2, L2]; then
    (HAS_V) one program per row i of v [PW, P]: its sum to da[i] for i < A, else to db[i - A]."""
    pid = tl.program_id(0)
    n1 = tl.cdiv(L1, BL)
    n2 = tl.cdiv(L2, BL) if HAS_W2 else 0
    if pid < n1:
        _wide_sum(w1_ptr, o1_ptr, S1, L1, pid, BL, BS)
    elif pid < n1 + n2:
        _wide_sum(w2_ptr, o2_ptr, S2, L2, pid - n1, BL, BS)
    elif HAS_V:
        i = pid - n1 - n2
        row = v_ptr + i.to(tl.int64) * P
        acc = tl.zeros([BP], dtype=tl.float32)
        for p0 in range(0, P, BP):
            pp = p0 + tl.arange(0, BP)
            acc += tl.load(row + pp, mask=pp < P, other=0.0)
        v = tl.sum(acc, axis=0)
        if i < A:
            tl.store(da_ptr + i, v.to(da_ptr.dtype.element_ty))
        else:
            tl.store(db_ptr + (i - A), v.to(db_ptr.dtype.element_ty))


@triton.jit
def _hc_cat_tile(g_ptr, wb_ptr, wm_ptr, wr_ptr, C, NH: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
                 BR: tl.constexpr):
    """One program's rows of HC's weights: (rows, cols, mask, g [BR] and [w_beta | w_m | W_r] [BR, MP], fp32)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, MP)
    rmask = rows < C
    mask = rmask[:, None] & (cols[None, :] < M)
    g = tl.load(g_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    wb = tl.load(wb_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    wm = tl.load(wm_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    wr = tl.load(wr_ptr + rows[:, None] * NH + (cols[None, :] - 2), mask=mask & (cols[None, :] >= 2),
                 other=0.0).to(tl.float32)
    cat = tl.where(cols[None, :] == 0, wb[:, None], tl.where(cols[None, :] == 1, wm[:, None], wr))
    return rows, cols, mask, g, cat


@triton.jit
def _hc_operands(g_ptr, wb_ptr, wm_ptr, wr_ptr, sa_ptr, sb_ptr, b_ptr, am_ptr, ar_ptr, w_ptr, pairs_ptr, st_ptr, C,
                 NH: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, PW: tl.constexpr, PWP: tl.constexpr,
                 PAIRS: tl.constexpr, BR: tl.constexpr):
    """W [C, M] fp32 (M = n + 2), with PAIRS also its interleaved 16-bit parts [C, 2M] (hi at 2j, lo at 2j + 1, as
    `_phi_pairs`); program 0 also writes the statics [s_beta, s_alpha, B (n), A_m (n), A_r (n x n, row-major)]."""
    rows, cols, mask, g, cat = _hc_cat_tile(g_ptr, wb_ptr, wm_ptr, wr_ptr, C, NH, M, MP, BR)
    w = g[:, None] * cat
    offs = rows[:, None] * M + cols[None, :]
    tl.store(w_ptr + offs, w, mask=mask)
    if PAIRS:
        # the pairs of W as stored: on the GPU the compiler would contract g * cat - hi into one FMA (lo of the
        # unrounded product, one ulp off `_phi_pairs` of W), so W is read back after a barrier
        tl.debug_barrier()
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        hi = w.to(pairs_ptr.dtype.element_ty)
        lo = (w - hi.to(tl.float32)).to(pairs_ptr.dtype.element_ty)
        pc = tl.arange(0, 2 * MP)
        tl.store(pairs_ptr + rows[:, None] * (2 * M) + pc[None, :], tl.reshape(tl.join(hi, lo), [BR, 2 * MP]),
                 mask=(rows[:, None] < C) & (pc[None, :] < 2 * M))
    if tl.program_id(0) == 0:
        k = tl.arange(0, PWP)
        v = tl.load(b_ptr + (k - 2), mask=(k >= 2) & (k < 2 + NH), other=0.0).to(tl.float32)
        v += tl.load(am_ptr + (k - 2 - NH), mask=(k >= 2 + NH) & (k < 2 + 2 * NH), other=0.0).to(tl.float32)
        v += tl.load(ar_ptr + (k - 2 - 2 * NH), mask=(k >= 2 + 2 * NH) & (k < PW), other=0.0).to(tl.float32)
        v = tl.where(k == 0, tl.load(sb_ptr).to(tl.float32), tl.where(k == 1, tl.load(sa_ptr).to(tl.float32), v))
        tl.store(st_ptr + k, v, mask=k < PW)


@triton.jit
def _hc_operand_grads(dw_ptr, dst_ptr, g_ptr, wb_ptr, wm_ptr, wr_ptr, dg_ptr, dwb_ptr, dwm_ptr, dwr_ptr, dsa_ptr,
                      dsb_ptr, db_ptr, dam_ptr, dar_ptr, C, NH: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
                      PW: tl.constexpr, PWP: tl.constexpr, BR: tl.constexpr):
    """The backward of `_hc_operands`: from dW [C, M] and the statics' gradient [PW], each of HC's nine parameters'
    gradients in its own dtype: dg = sum_k dW_k [w_beta | w_m | W_r]_k, d[w_beta | w_m | W_r] = g dW, and the statics
    split back onto s_beta, s_alpha, B, A_m, A_r."""
    rows, cols, mask, g, cat = _hc_cat_tile(g_ptr, wb_ptr, wm_ptr, wr_ptr, C, NH, M, MP, BR)
    dw = tl.load(dw_ptr + rows[:, None] * M + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rmask = rows < C
    tl.store(dg_ptr + rows, tl.sum(dw * cat, axis=1).to(dg_ptr.dtype.element_ty), mask=rmask)
    dcat = dw * g[:, None]
    tl.store(dwb_ptr + rows, tl.sum(tl.where(cols[None, :] == 0, dcat, 0.0), axis=1).to(dwb_ptr.dtype.element_ty),
             mask=rmask)
    tl.store(dwm_ptr + rows, tl.sum(tl.where(cols[None, :] == 1, dcat, 0.0), axis=1).to(dwm_ptr.dtype.element_ty),
             mask=rmask)
    tl.store(dwr_ptr + rows[:, None] * NH + (cols[None, :] - 2), dcat.to(dwr_ptr.dtype.element_ty),
             mask=mask & (cols[None, :] >= 2))
    if tl.program_id(0) == 0:
        k = tl.arange(0, PWP)
        d = tl.load(dst_ptr + k, mask=k < PW, other=0.0)
        tl.store(dsb_ptr + k, d.to(dsb_ptr.dtype.element_ty), mask=k == 0)
        tl.store(dsa_ptr + (k - 1), d.to(dsa_ptr.dtype.element_ty), mask=k == 1)
        tl.store(db_ptr + (k - 2), d.to(db_ptr.dtype.element_ty), mask=(k >= 2) & (k < 2 + NH))
        tl.store(dam_ptr + (k - 2 - NH), d.to(dam_ptr.dtype.element_ty), mask=(k >= 2 + NH) & (k < 2 + 2 * NH))
        tl.store(dar_ptr + (k - 2 - 2 * NH), d.to(dar_ptr.dtype.element_ty), mask=(k >= 2 + 2 * NH) & (k < PW))
