"""The sublayer boundary op (kernels/fused/ops/mhc_boundary.py, `mhc_boundary`) against the float64 reference
composition: sublayer l's write-back and sublayer l + 1's coefficients and input, every output and every input's
gradient."""

import pytest
import torch
from helpers import fast_first
from kernel_checks import ITERS, SHAPES, boundary_inputs, poisoned_outputs, run_boundary

from mhc_lightning.kernels import MHCOptions, fused
from mhc_lightning.kernels import reference as R
from mhc_lightning.kernels.fused import projection
from mhc_lightning.kernels.fused.ops import mhc_boundary

pytestmark = pytest.mark.usefixtures(poisoned_outputs.__name__)


@fast_first("n", [1, 2, 4, 8])
@fast_first("exact_axis", ["rows", "cols"])
def test_boundary_fp32(n, exact_axis):
    torch.manual_seed(80 + n + len(exact_axis))
    for lead, c in SHAPES:
        run_boundary(
            boundary_inputs(lead, c, n, torch.float32),
            torch.float32,
            sinkhorn_iters=ITERS,
            exact_axis=exact_axis,
            res_layout="dst_src" if n == 4 else "src_dst",
        )


@fast_first(
    "prev_res,next_res",
    [(False, False), (False, True), (True, False)],
    ids=["identity", "identity-mhc", "mhc-identity"],
)
@fast_first("n", [2, 4])
def test_boundary_identity_hc(prev_res, next_res, n):
    """H^res = I on either side of the boundary (identity-HC sublayers), in any combination."""
    torch.manual_seed(90 + n + 2 * prev_res + next_res)
    lead, c = SHAPES[1]
    run_boundary(boundary_inputs(lead, c, n, torch.float32, prev_res, next_res), torch.float32, sinkhorn_iters=ITERS)


def test_boundary_bf16_partial_grads():
    """bf16 streams with both phi dtypes (Sinkhorn in the coefficient kernel with an fp32 phi, in its own launch with
    a bf16 one) and unused outputs (no upstream gradient)."""
    torch.manual_seed(95)
    lead, c = SHAPES[1]
    for phi_dtype, used in (
        (torch.float32, (True, True, False, True, True)),
        (torch.bfloat16, (True, False, True, False, True)),
    ):
        inputs = boundary_inputs(lead, c, 4, torch.bfloat16, phi_dtype=phi_dtype)
        run_boundary(inputs, torch.bfloat16, used=used, sinkhorn_iters=ITERS, exact_axis="cols")


def test_boundary_backward_by_the_x_pass(monkeypatch):
    """The boundary's backward runs the per-sublayer kernels: the x pass on x_next with the downstream gradient of
    x_next added in (dx_in), so that it writes x_next's whole gradient, then the write-back's backward reading it.
    Against float64 (the whole op's gradients)."""
    torch.manual_seed(99)
    seen = []
    real_x, real_post = projection.x_pass, mhc_boundary.post_backward
    monkeypatch.setattr(
        projection, "x_pass", lambda *a, **k: seen.append(("x pass", k.get("dx_in") is not None)) or real_x(*a, **k)
    )
    monkeypatch.setattr(
        mhc_boundary, "post_backward", lambda *a, **k: seen.append(("write-back", True)) or real_post(*a, **k)
    )
    lead, c = SHAPES[1]
    run_boundary(boundary_inputs(lead, c, 4, torch.bfloat16), torch.bfloat16, sinkhorn_iters=ITERS)
    assert seen == [("x pass", True), ("write-back", True)], seen


def test_boundary_fallback_matches_reference():
    """Options the kernels do not cover: the composition of the ops that do cover their part."""
    torch.manual_seed(14)
    inputs = boundary_inputs((5,), 8, 4, torch.float32)
    opts = MHCOptions(sinkhorn_iters=3, start="log_domain")
    a = fused.mhc_boundary(*inputs, opts)
    x_next = fused.stream_post_res(*inputs[:4])
    assert torch.equal(a[0], x_next)
    for u, v in zip(a[1:], fused.mhc_pre(x_next, *inputs[4:], opts)):
        assert torch.equal(u, v)
    b = R.mhc_boundary(*inputs, opts)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)
