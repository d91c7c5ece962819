"""The small per-sublayer passes over the coefficient parameters, one launch each (docs/kernels.md, "Small launches").

- `_phi_pairs` (forward): an fp32 phi [K, M] as interleaved 16-bit parts [K, 2M], hi at column 2j and lo = phi - hi
  at 2j + 1, for `_coef_fwd`'s one wide dot (SPLIT = 2). In torch that was four launches (cast, subtract, cast,
  stack) per sublayer.
- `_param_grad_sum` (backward): the gradient kernels leave partial sums, the weight's per token split
  [S, K * M] (`_coef_bwd_x`) and the small vectors' per token block [P, PW] (`_coef_bwd_tok`, `_hc_tail_bwd`:
  bias then alpha, or HC's statics). One launch sums both and writes each gradient in its parameter's dtype into its
  own tensor (custom-op outputs may not alias). In torch: two reductions and two copies per sublayer, the tall
  [P, PW] one the slowest of them.
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


@triton.jit(do_not_specialize=["S", "P", "KM"])
def _param_grad_sum(
    wpart_ptr, vpart_ptr, dw_ptr, da_ptr, db_ptr, S, P, KM,
    A: tl.constexpr, PW: tl.constexpr, PWP: tl.constexpr, BL: tl.constexpr, BP: tl.constexpr,
):
    """Programs below cdiv(KM, BL): dw[i] = sum_s wpart[s, i] over a BL slice. The last program: the vectors,
    v = sum_p vpart[p, :], columns < A to da, the rest (PW - A) to db."""
    pid = tl.program_id(0)
    if pid * BL < KM:
        offs = pid.to(tl.int64) * BL + tl.arange(0, BL)
        mask = offs < KM
        acc = tl.zeros([BL], dtype=tl.float32)
        for s in range(S):
            acc += tl.load(wpart_ptr + s * KM + offs, mask=mask, other=0.0)
        tl.store(dw_ptr + offs, acc.to(dw_ptr.dtype.element_ty), mask=mask)
    else:
        cols = tl.arange(0, PWP)
        acc2 = tl.zeros([BP, PWP], dtype=tl.float32)
        for p0 in range(0, P, BP):
            rows = p0 + tl.arange(0, BP)
            acc2 += tl.load(vpart_ptr + rows[:, None] * PW + cols[None, :],
                            mask=(rows[:, None] < P) & (cols[None, :] < PW), other=0.0)
        v = tl.sum(acc2, axis=0)
        tl.store(da_ptr + cols, v.to(da_ptr.dtype.element_ty), mask=cols < A)
        tl.store(db_ptr + (cols - A), v.to(db_ptr.dtype.element_ty), mask=(cols >= A) & (cols < PW))
