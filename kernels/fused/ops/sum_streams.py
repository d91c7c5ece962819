"""`sum_streams`, the "sum" collapse of the n streams, one kernel each way (docs/design.md §4, docs/kernels.md "The
stream's ends"): `stream_rows.sum_rows` forward, `stream_rows.expand_rows` backward. Eager only: under torch.compile
the reference's sum and cast run, which inductor fuses with their neighbours.
"""
import torch

from ..stream_rows import expand_rows, sum_rows

Tensor = torch.Tensor


class SumStreams(torch.autograd.Function):
    """The streams summed into dtype; backward: the gradient copied to every stream in the stream's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, dtype: torch.dtype):
        ctx.x_dtype, ctx.n = x.dtype, x.shape[-2]
        return sum_rows(x, dtype)

    @staticmethod
    def backward(ctx, g):
        return expand_rows(g, ctx.n, ctx.x_dtype), None
