"""`stream_pre` (kernels/fused/ops/stream_pre.py) against the float64 reference: the branch's input
u = sum_j h_pre_j x_j and its gradient, the fallbacks, and u rebuilt for a branch that dropped it (`rebuild_u`,
`request_u`)."""

import pytest
import torch
from helpers import fast_first
from kernel_checks import (
    DEV,
    ITERS,
    SHAPES,
    TOL,
    boundary_inputs,
    check,
    coef_inputs,
    f64,
    grads,
    hc_inputs,
    leaf,
    on_launch,
    poisoned_outputs,
    upstream,
)

from mhc_lightning.kernels import MHCOptions, fused
from mhc_lightning.kernels import reference as R

pytestmark = pytest.mark.usefixtures(poisoned_outputs.__name__)


@fast_first("n", [1, 2, 4, 8])
@fast_first("dtype", [torch.float32, torch.bfloat16])
def test_stream_pre(n, dtype):
    torch.manual_seed(20 + n)
    for lead, c in SHAPES:
        x = leaf(torch.randn(*lead, n, c, device=DEV).to(dtype))
        h = leaf(torch.rand(*lead, n, device=DEV) + 0.1)
        out = fused.stream_pre(x, h)
        assert out.dtype == dtype
        ref_in = f64([x, h])
        ref = R.stream_pre(*ref_in)
        g = upstream(ref, out)
        tol = TOL[dtype]
        check(out, ref, tol[0], "u")
        for name, a, b in zip(("dx", "dh_pre"), grads([out], [x, h], [g]), grads([ref], ref_in, [g])):
            check(a, b, tol[2], name)


def test_stream_pre_fallbacks_match_reference():
    """n = 3 (no kernel size) and float64 go to the reference: identical results."""
    torch.manual_seed(5)
    x3, h = torch.randn(5, 3, 8, device=DEV), torch.rand(5, 3, device=DEV)
    assert torch.equal(fused.stream_pre(x3, h), R.stream_pre(x3, h))
    xd, hd = torch.randn(5, 4, 8, dtype=torch.float64, device=DEV), torch.rand(5, 4, dtype=torch.float64, device=DEV)
    assert torch.equal(fused.stream_pre(xd, hd), R.stream_pre(xd, hd))


def test_rebuilt_u_is_the_ops_u_bitwise(monkeypatch):
    """`rebuild_u` and the write-back's backward on request (`request_u`; HyperConfig.rebuild_branch_input) give the u
    each op handed its branch, bit for bit, in the stream's dtype and in the branch's fp32: u made by stream_pre's
    streaming kernel (phi in fp32, the trainer's), by the sum in the coefficient kernel's own loop (phi in bf16 at
    C <= u_inside_max_c: HAS_U, checked taken), and HC's."""
    torch.manual_seed(93)
    lead, c = SHAPES[1]
    opts = MHCOptions(sinkhorn_iters=ITERS)
    in_gemm = []
    on_launch(monkeypatch, ("_coef_fwd",), lambda name, kw: in_gemm.append(kw["HAS_U"]))
    ops = [
        ("mhc_pre", lambda i, d: fused.mhc_pre(*i, opts, d), coef_inputs(lead, c, 4, torch.bfloat16)),
        ("mhc_enter", lambda i, d: fused.mhc_enter(*i, opts, d), coef_inputs(lead, c, 4, torch.bfloat16)),
        ("mhc_boundary", lambda i, d: fused.mhc_boundary(*i, opts, d), boundary_inputs(lead, c, 4, torch.bfloat16)),
        ("hc_enter", lambda i, d: fused.hc_enter(*i, u_dtype=d), hc_inputs(lead, c, 4, torch.bfloat16)),
        (
            "mhc_enter, bf16 phi",
            lambda i, d: fused.mhc_enter(*i, opts, d),
            coef_inputs(lead, c, 4, torch.bfloat16, phi_dtype=torch.bfloat16),
        ),
        (
            "mhc_boundary, bf16 phi",
            lambda i, d: fused.mhc_boundary(*i, opts, d),
            boundary_inputs(lead, c, 4, torch.bfloat16, phi_dtype=torch.bfloat16),
        ),
    ]
    for name, call, inputs in ops:
        for u_dtype in (None, torch.float32):
            in_gemm.clear()
            with torch.no_grad():
                out = call(inputs, u_dtype)
            if name == "mhc_pre":
                x, u, h_pre = inputs[0], out[0], out[1]
            else:  # the stream u came from: the op's input, or the boundary's x_next
                x, u, h_pre = (out[0] if name.startswith("mhc_boundary") else inputs[0]), out[1], out[2]
            again = fused.rebuild_u(x, h_pre, u_dtype)
            assert again.dtype == u.dtype == (u_dtype or torch.bfloat16) and torch.equal(again, u), (name, u_dtype)
            if "bf16 phi" in name:
                assert in_gemm == [True], (name, in_gemm)
            # the same u from the backward of a write-back that reads this stream (`request_u`), H^res given or I
            n = x.shape[-2]
            flat, h_flat = x.detach().reshape(-1, n, c), h_pre.reshape(-1, n)
            for h_res in (torch.rand(flat.shape[0], n, n, device=DEV), None):
                req = fused.request_u(flat, h_flat, u_dtype)
                f = torch.randn(flat.shape[0], c, device=DEV, dtype=flat.dtype, requires_grad=True)
                out = fused.stream_post_res(flat, f, torch.rand(flat.shape[0], n, device=DEV), h_res)
                out.backward(torch.randn_like(out))
                assert req.u is not None and torch.equal(R.in_dtype(req.u, u_dtype), u.reshape(-1, c)), (name, u_dtype)
