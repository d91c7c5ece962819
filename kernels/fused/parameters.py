"""The small per-sublayer passes over the coefficient parameters, one launch each (docs/kernels.md, "Small launches").

- `_phi_pairs` (forward): an fp32 phi [K, M] as interleaved 16-bit parts [K, 2M], hi at column 2j and lo = phi - hi
  at 2j + 1, for `_coef_fwd`'s one wide dot (SPLIT = 2). In torch that was four launches (cast, subtract, cast,
  stack) per sublayer.
- `_param_grad_sum` (backward): the gradient kernels leave partial sums, the weight's per token split
  [S, K * M] (`_coef_bwd_x`) and the small vectors' per token block [P, PW] (`_coef_bwd_tok`, `_hc_tail_bwd`:
  bias then alpha, or HC's statics). One launch sums both and writes each gradient in its parameter's dtype into its
  own tensor (custom-op outputs may not alias). In torch: two reductions and two copies per sublayer. The same
  launch sums the write-back backward's per-C-block partials of dh_post and dH (two wide sums, no vectors).
  Each program loads whole [rows, columns] tiles: a loop of one-row loads was latency-bound (20 us a launch).
Both are exact reformulations of the torch code they replace (same values, summation in fp32); the float64 tests of
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
    HAS_W2: tl.constexpr, HAS_V: tl.constexpr, A: tl.constexpr, PW: tl.constexpr, PWP: tl.constexpr,
    BL: tl.constexpr, BS: tl.constexpr, BP: tl.constexpr,
):
    """Programs [0, cdiv(L1, BL)): o1 = w1 [S1, L1] summed over S1; then (HAS_W2) o2 likewise from w2 [S2, L2]; the
    last program (HAS_V): v = sum_p v[p, :] of v [P, PW], columns < A to da, the rest to db."""
    pid = tl.program_id(0)
    n1 = tl.cdiv(L1, BL)
    n2 = tl.cdiv(L2, BL) if HAS_W2 else 0
    if pid < n1:
        _wide_sum(w1_ptr, o1_ptr, S1, L1, pid, BL, BS)
    elif pid < n1 + n2:
        _wide_sum(w2_ptr, o2_ptr, S2, L2, pid - n1, BL, BS)
    elif HAS_V:
        cols = tl.arange(0, PWP)
        acc = tl.zeros([BP, PWP], dtype=tl.float32)
        for p0 in range(0, P, BP):
            rows = p0 + tl.arange(0, BP)
            acc += tl.load(v_ptr + rows[:, None] * PW + cols[None, :],
                           mask=(rows[:, None] < P) & (cols[None, :] < PW), other=0.0)
        v = tl.sum(acc, axis=0)
        tl.store(da_ptr + cols, v.to(da_ptr.dtype.element_ty), mask=cols < A)
        tl.store(db_ptr + (cols - A), v.to(db_ptr.dtype.element_ty), mask=(cols >= A) & (cols < PW))
