"""The residual stream's two ends, one kernel each way (docs/design.md §4, docs/kernels.md "The stream's ends").

`_expand`: x_0[t, j, :] = h[t, :] for every stream j, cast to the stream's dtype: the embedding's one read and the
stream's one write (torch: a cast, then a broadcast copy that cannot vectorise its stride-0 reads). It is also
the backward of the sum collapse (the gradient of the collapsed stream, copied to every stream).
`_sum_streams`: out[t, :] = sum_j x[t, j, :], accumulated in fp32 and stored in out's dtype: the "sum" collapse
before the final norm, and the expansion's backward (torch: a reduction over the middle axis, then a cast).
"""
import triton
import triton.language as tl


@triton.jit
def _tile(N, C, BT: tl.constexpr, BC: tl.constexpr):
    """This program's [BT, BC] block of an [N, C] grid: its rows (int64 offsets), channels and mask."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    return rows.to(tl.int64), cc, (rows < N)[:, None] & (cc[None, :] < C)


@triton.jit(do_not_specialize=["N"])
def _expand(h_ptr, out_ptr, N, C, NS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    rows64, cc, m2 = _tile(N, C, BT, BC)
    h = tl.load(h_ptr + rows64[:, None] * C + cc[None, :], mask=m2, other=0.0).to(out_ptr.dtype.element_ty)
    for j in tl.static_range(NS):
        tl.store(out_ptr + rows64[:, None] * (NS * C) + j * C + cc[None, :], h, mask=m2)


@triton.jit(do_not_specialize=["N"])
def _sum_streams(x_ptr, out_ptr, N, C, NS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    rows64, cc, m2 = _tile(N, C, BT, BC)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(NS):
        acc += tl.load(x_ptr + rows64[:, None] * (NS * C) + j * C + cc[None, :], mask=m2, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows64[:, None] * C + cc[None, :], acc.to(out_ptr.dtype.element_ty), mask=m2)
