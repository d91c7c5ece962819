"""`sum_streams` (kernels/fused/ops/sum_streams.py), the "sum" collapse of the n streams, one kernel each way,
against float64."""

import pytest
import torch
from helpers import fast_first
from kernel_checks import DEV, SHAPES, TOL, check, f64, grads, leaf, poisoned_outputs, upstream

from mhc_lightning.kernels import fused
from mhc_lightning.kernels import reference as R

pytestmark = pytest.mark.usefixtures(poisoned_outputs.__name__)


@fast_first("n", [1, 2, 4, 8])
@fast_first(
    "h_dtype,stream_dtype",
    [(torch.float32, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)],
)
def test_sum_streams(n, h_dtype, stream_dtype):
    """Values and gradients against float64, with random upstream gradients (each stream's gradient its own copy)."""
    torch.manual_seed(30 + n)
    for lead, c in SHAPES:
        xs = leaf(torch.randn(*lead, n, c, device=DEV).to(stream_dtype))
        out = fused.sum_streams(xs, h_dtype)
        assert type(out.grad_fn).__name__ == "SumStreamsBackward" and out.dtype == h_dtype
        ref_xs = f64([xs])
        ref_out = R.sum_streams(*ref_xs)
        g = upstream(ref_out, out)
        check(out, ref_out, TOL[h_dtype][0] * n, "sum")
        check(grads([out], [xs], [g])[0], grads([ref_out], ref_xs, [g])[0], TOL[stream_dtype][2], "dx")
