"""`hc_coefficients` (kernels/fused/ops/hc_coefficients.py) against the float64 reference: HC's h_pre, h_post,
H^res and their gradients, and what goes to the reference."""

import pytest
import torch
from helpers import fast_first
from kernel_checks import (
    CUDA,
    HC_PARAM_GRADS,
    SHAPES,
    TOL,
    check,
    config_changed,
    f64,
    grads,
    hc_inputs,
    poisoned_outputs,
    upstream,
)

from mhc_lightning.kernels import fused
from mhc_lightning.kernels import reference as R
from mhc_lightning.kernels.fused.ops import hc_coefficients

pytestmark = pytest.mark.usefixtures(poisoned_outputs.__name__)


@fast_first("n", [1, 2, 4, 8])
@fast_first("dtype", [torch.float32, torch.bfloat16])
@fast_first("use_tanh", [True, False])
def test_hc_coefficients(n, dtype, use_tanh, monkeypatch):
    """The fused HC coefficients (one op: projection and tail in one kernel, the tail's backward in another, partial
    sums of the static parameters' gradients over several row blocks, the last one partial) against the float64
    reference: the three maps and the gradient of x and of every parameter."""
    torch.manual_seed(110 + n + 10 * use_tanh)
    seen = []
    real = hc_coefficients.hc_coef_eager
    monkeypatch.setattr(hc_coefficients, "hc_coef_eager", lambda *a: seen.append(True) or real(*a))
    inputs = hc_inputs(SHAPES[0][0], SHAPES[0][1], n, dtype)
    with config_changed("hc_tail_bwd", BT=16 if not CUDA else 128):
        out = fused.hc_coefficients(*inputs, use_tanh=use_tanh)
        assert seen == [True] and (SHAPES[0][0][0] * n) % 16 != 0
    ref_in = f64(inputs)
    ref = R.hc_coefficients(*ref_in, use_tanh=use_tanh)
    gs = [upstream(r, o) for r, o in zip(ref, out)]
    t_h, _, t_g = TOL[dtype]
    for name, a, b in zip(("h_pre", "h_post", "h_res"), out, ref):
        check(a, b, t_h, name)
    with config_changed("hc_tail_bwd", BT=16 if not CUDA else 128):
        g_out = grads(out, inputs, gs)
    for name, a, b in zip(HC_PARAM_GRADS, g_out, grads(ref, ref_in, gs)):
        check(a, b, t_g, name)


def test_hc_static_and_float64_go_to_the_reference():
    torch.manual_seed(12)
    inputs = hc_inputs((5,), 8, 4, torch.float32)
    for a, b in zip(fused.hc_coefficients(*inputs, dynamic=False), R.hc_coefficients(*inputs, dynamic=False)):
        assert torch.equal(a, b)
    xd = [t.detach().double() for t in inputs]
    for a, b in zip(fused.hc_coefficients(*xd), R.hc_coefficients(*xd)):
        assert torch.equal(a, b)
