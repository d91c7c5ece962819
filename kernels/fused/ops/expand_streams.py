"""`expand_streams`, the embedding cast and copied into n streams, one kernel each way (docs/design.md §4,
docs/kernels.md "The stream's ends"): `stream_rows.expand_rows` forward, `stream_rows.sum_rows` backward. Eager only:
under torch.compile the reference's cast and copy run, which inductor fuses with their neighbours.
"""
import torch

from ..stream_rows import expand_rows, sum_rows

Tensor = torch.Tensor


class ExpandStreams(torch.autograd.Function):
    """x_0 = 1_n h in the stream's dtype; backward: the n streams' gradients summed into h's dtype."""

    @staticmethod
    def forward(ctx, h: Tensor, n: int, dtype: torch.dtype):
        ctx.h_dtype = h.dtype
        return expand_rows(h, n, dtype)

    @staticmethod
    def backward(ctx, g):
        return sum_rows(g, ctx.h_dtype), None, None
