"""The kernels of the residual stream's two ends (docs/design.md §4, docs/kernels.md "The stream's ends"), which the
ops `expand_streams` and `sum_streams` (ops/) launch, each the other's backward: `expand_rows` and `sum_rows`.

`_expand`: x_0[t, j, :] = h[t, :] for every stream j, cast to the stream's dtype: the embedding's one read and the
stream's one write (torch: a cast, then a broadcast copy that cannot vectorise its stride-0 reads). It is also
the backward of the sum collapse (the gradient of the collapsed stream, copied to every stream).
`_sum_streams`: out[t, :] = sum_j x[t, j, :], accumulated in fp32 and stored in out's dtype: the "sum" collapse
before the final norm, and the expansion's backward (torch: a reduction over the middle axis, then a cast).
"""
import torch
import triton
import triton.language as tl

from .host import cdiv, empty, np2
from .launch_cache import launcher
from .launch_config import launch_options, tiles

Tensor = torch.Tensor


@triton.jit
def _tile(N, C, BT: tl.constexpr, BC: tl.constexpr):
    """This program's [BT, BC] block of an [N, C] grid: its rows (int64 offsets), channels and mask."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    return rows.to(tl.int64), cc, (rows < N)[:, None] & (cc[None, :] < C)


@triton.jit(do_not_specialize=["N"])
def _expand(src_ptr, out_ptr, N, C, NS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    rows64, cc, m2 = _tile(N, C, BT, BC)
    h = tl.load(src_ptr + rows64[:, None] * C + cc[None, :], mask=m2, other=0.0).to(out_ptr.dtype.element_ty)
    for j in tl.static_range(NS):
        tl.store(out_ptr + rows64[:, None] * (NS * C) + j * C + cc[None, :], h, mask=m2)


@triton.jit(do_not_specialize=["N"])
def _sum_streams(src_ptr, out_ptr, N, C, NS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    rows64, cc, m2 = _tile(N, C, BT, BC)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(NS):
        acc += tl.load(src_ptr + rows64[:, None] * (NS * C) + j * C + cc[None, :], mask=m2, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows64[:, None] * C + cc[None, :], acc.to(out_ptr.dtype.element_ty), mask=m2)


def _launch(kernel, src: Tensor, out: Tensor, N: int, C: int, n: int) -> Tensor:
    """One of the two kernels over an [N, C] grid of rows (src and out contiguous); returns out."""
    if N:
        cfg = tiles("stream_ends", BC=np2(C, 16))
        launcher(kernel)[(cdiv(N, cfg["BT"]), cdiv(C, cfg["BC"]))](
            src_ptr=src, out_ptr=out, N=N, C=C, NS=n, BT=cfg["BT"], BC=cfg["BC"], **launch_options(cfg))
    return out


def expand_rows(h: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """[..., C] -> [..., n, C] in dtype, every stream a copy of h."""
    C = h.shape[-1]
    rows = h.reshape(-1, C).contiguous()
    return _launch(_expand, rows, empty((*h.shape[:-1], n, C), dtype, h.device), rows.shape[0], C, n)


def sum_rows(x: Tensor, dtype: torch.dtype) -> Tensor:
    """[..., n, C] -> [..., C] in dtype, the n streams summed in fp32."""
    n, C = x.shape[-2], x.shape[-1]
    out = empty((*x.shape[:-2], C), dtype, x.device)
    return _launch(_sum_streams, x.contiguous(), out, out.numel() // max(C, 1), C, n)
