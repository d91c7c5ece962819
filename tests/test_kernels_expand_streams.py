"""`expand_streams` (kernels/fused/ops/expand_streams.py), the embedding cast and copied into n streams, one kernel
each way, against float64; under torch.compile, the stream's two ends as the reference's ops."""

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
def test_expand_streams(n, h_dtype, stream_dtype):
    """Values and gradients against float64, each stream's own values (random upstream gradients per stream, so a
    mixed-up stream index fails)."""
    torch.manual_seed(30 + n)
    for lead, c in SHAPES:
        h = leaf(torch.randn(*lead, c, device=DEV).to(h_dtype))
        x = fused.expand_streams(h, n, stream_dtype)
        assert type(x.grad_fn).__name__ == "ExpandStreamsBackward" and x.dtype == stream_dtype
        ref_h = f64([h])
        ref_x = R.expand_streams(*ref_h, n)
        g = upstream(ref_x, x)
        check(x, ref_x, TOL[stream_dtype][0], "x_0")
        check(grads([x], [h], [g])[0], grads([ref_x], ref_h, [g])[0], TOL[stream_dtype][2], "dh")


def test_the_streams_ends_under_compile_are_the_references():
    """Under torch.compile (fullgraph: no break) the reference's cast and copy (or sum) run, for inductor to fuse with
    their neighbours: no custom op or autograd Function of ours in the graph."""
    counts = []

    def backend(gm, example_inputs):
        counts.append(gm.code)
        return gm.forward

    torch._dynamo.reset()
    h = torch.randn(2, 5, 8, device=DEV)
    out = torch.compile(
        lambda t: fused.sum_streams(fused.expand_streams(t, 4, torch.bfloat16), torch.float32),
        fullgraph=True,
        backend=backend,
    )(h)
    torch.testing.assert_close(out, R.sum_streams(R.expand_streams(h, 4, torch.bfloat16), torch.float32))
    assert counts and "mhc_lightning" not in counts[0] and "Streams" not in counts[0]
