"""`mhc_pre` (kernels/fused/ops/mhc_pre.py) against the float64 reference: the coefficients and u from one read of x,
u in or after the coefficient kernel, the x pass (projection.py) with du and dx_in, u in the branch's dtype, and the
fallback."""

import pytest
import torch
from helpers import fast_first
from kernel_checks import (
    CUDA,
    DEV,
    ITERS,
    SHAPES,
    TOL,
    boundary_inputs,
    check,
    check_u_in_the_branchs_dtype,
    coef_inputs,
    config_changed,
    on_launch,
    poisoned_outputs,
    run_boundary,
    run_pre,
)

from mhc_lightning.kernels import MHCOptions, fused
from mhc_lightning.kernels import reference as R
from mhc_lightning.kernels.fused import launch_config, partial_sums, projection
from mhc_lightning.kernels.fused.ops import mhc_coefficients

pytestmark = pytest.mark.usefixtures(poisoned_outputs.__name__)


def test_reference_mhc_pre_is_the_composition():
    torch.manual_seed(12)
    x, phi, bias, alpha = coef_inputs((5,), 8, 4, torch.float64)
    opts = MHCOptions(sinkhorn_iters=3, exact_axis="cols", res_layout="dst_src")
    u, *h = R.mhc_pre(x, phi, bias, alpha, opts)
    h_ref = R.mhc_coefficients(x, phi, bias, alpha, opts)
    for a, b in zip(h, h_ref):
        assert torch.equal(a, b)
    assert torch.equal(u, R.stream_pre(x, h_ref[0]))


@fast_first("n", [1, 2, 4, 8])
@fast_first("mode", ["rows", "cols", "identity"])
def test_mhc_pre_fp32(n, mode):
    torch.manual_seed(60 + n + len(mode))
    for lead, c in SHAPES:
        inputs = coef_inputs(lead, c, n, torch.float32, with_res=mode != "identity")
        run_pre(
            inputs,
            torch.float32,
            sinkhorn_iters=ITERS,
            exact_axis="cols" if mode == "cols" else "rows",
            res_layout="dst_src" if n == 2 else "src_dst",
        )


def test_mhc_pre_bf16_partial_grads_and_both_sinkhorn_launches(monkeypatch):
    """bf16 (both phi dtypes), only some outputs used. An fp32 phi runs Sinkhorn in the coefficient kernel, a bf16 phi
    in a launch of its own (`_coef_tail`; checked both ran). Without a gradient of its own for h_pre the per-token
    kernel starts dh_pre at zero (`HAS_DPRE` off; checked that both ways ran)."""
    torch.manual_seed(70)
    seen, sinks = set(), set()
    real = mhc_coefficients.token_backward
    monkeypatch.setattr(mhc_coefficients, "token_backward", lambda *a, **k: seen.add(a[6] is None) or real(*a, **k))
    on_launch(monkeypatch, ("_coef_fwd",), lambda _, kw: sinks.add(kw["SINK"]))
    lead, c = SHAPES[1]
    for phi_dtype, used in (
        (torch.float32, (True, False, True, True)),
        (torch.bfloat16, (False, True, True, True)),
        (torch.float32, (True, True, False, False)),
    ):
        inputs = coef_inputs(lead, c, 4, torch.bfloat16, phi_dtype=phi_dtype)
        run_pre(inputs, torch.bfloat16, used=used, sinkhorn_iters=ITERS)
    # 20 iterations on saturated logits (near-permutation H^res): the O(iters) Sinkhorn walk-back
    inputs = coef_inputs(SHAPES[0][0], SHAPES[0][1], 4, torch.float32, gate=10.0)
    run_pre(inputs, torch.float32, sinkhorn_iters=20)
    assert seen == {True, False} and sinks == {True, False}


@fast_first("u_inside_max_c", [0, 4096])
@fast_first(
    "n,dtype,phi_dtype",
    [
        (4, torch.bfloat16, torch.float32),
        (4, torch.bfloat16, torch.bfloat16),
        (4, torch.bfloat16, torch.float16),
        (2, torch.float32, torch.float32),
    ],
)
def test_mhc_pre_u_in_or_after_the_coefficient_kernel(u_inside_max_c, n, dtype, phi_dtype):
    """u in the coefficient kernel's own loop, or by stream_pre's kernel after it (CONFIG coef_fwd u_inside_max_c, in
    each tile set), at every dot the projection takes: phi as pairs, native, tf32 (a phi of another 16-bit dtype),
    fp32."""
    torch.manual_seed(75 + n)
    subs = {k: dict(launch_config.CONFIG["coef_fwd"][k], u_inside_max_c=u_inside_max_c) for k in ("tf32", "pairs")}
    with config_changed("coef_fwd", u_inside_max_c=u_inside_max_c, **subs):
        lead, c = SHAPES[1]
        run_pre(coef_inputs(lead, c, n, dtype, phi_dtype=phi_dtype), dtype, sinkhorn_iters=ITERS)


def test_x_pass_adds_the_other_consumers_gradient():
    """The x pass with dx_in: dx = (its own dx) + dx_in, in the same pass."""
    torch.manual_seed(77)
    lead, c = SHAPES[1]
    x, phi, _, _ = coef_inputs(lead, c, 4, torch.bfloat16)
    x = x.detach().reshape(-1, 4, c)
    N = x.shape[0]
    dl, dss = torch.randn(N, phi.shape[1], device=DEV), torch.randn(N, device=DEV)
    h_pre, du = torch.rand(N, 4, device=DEV), torch.randn(N, c, device=DEV).to(x.dtype)
    dx_in = torch.randn_like(x)
    plain, summed = torch.empty_like(x), torch.empty_like(x)
    projection.x_pass(x, phi.detach(), dl, dss, plain, h_pre=h_pre, du=du)
    projection.x_pass(x, phi.detach(), dl, dss, summed, h_pre=h_pre, du=du, dx_in=dx_in)
    check(summed, plain.double() + dx_in.double(), TOL[torch.bfloat16][2], "dx + dx_in")


def _check_x_pass(lead, c, n, phi_dtype, with_u=True):
    """The x pass alone (fp32 dx and dphi buffers: no rounding to the stream's or phi's dtype) against float64 at
    1e-4: dphi = x^T dL, dx = dL phi^T + 2 x d(sum x^2) (+ h_pre_j du)."""
    x, phi, _, _ = coef_inputs(lead, c, n, torch.bfloat16, phi_dtype=phi_dtype)
    x, phi = x.detach().reshape(-1, n, c), phi.detach()
    N = x.shape[0]
    dl, dss = torch.randn(N, phi.shape[1], device=DEV), torch.randn(N, device=DEV)
    h_pre, du = torch.rand(N, n, device=DEV), torch.randn(N, c, device=DEV).to(x.dtype)
    dx = torch.empty(x.shape, device=DEV)
    dphi = torch.empty(phi.shape, device=DEV)
    u_args = dict(h_pre=h_pre, du=du) if with_u else {}
    partial_sums.sum_partials(projection.x_pass(x, phi, dl, dss, dx, **u_args), dphi)
    xd, dld = x.double().reshape(N, -1), dl.double()
    check(dphi, xd.t() @ dld, 1e-4, "dphi")
    ref_dx = (dld @ phi.double().t()).reshape(N, n, c) + 2 * x.double() * dss.double()[:, None, None]
    if with_u:
        ref_dx += h_pre.double()[:, :, None] * du.double()[:, None, :]
    check(dx, ref_dx, 1e-4, "dx")


@fast_first(
    "n,phi_dtype",
    [(4, torch.float32), (4, torch.bfloat16), (1, torch.float32), (2, torch.bfloat16), (8, torch.float32)],
)
def test_x_pass_on_16_bit_parts(n, phi_dtype):
    """With bf16 x the x pass's dots take dL and phi as bf16 hi + lo parts (`projection.grad_dots`). The phi gradient
    x^T dL and dx (into an fp32 buffer) keep 16 mantissa bits of dL and phi (checked at 1e-4 against float64, tighter
    than tf32's 11 bits allow); then the whole pre op and the boundary op with it against the float64 composition."""
    torch.manual_seed(79 + n)
    lead, c = SHAPES[1]
    assert projection.grad_dots(torch.bfloat16, phi_dtype)["SPLIT"]
    _check_x_pass(lead, c, n, phi_dtype)
    run_pre(coef_inputs(lead, c, n, torch.bfloat16, phi_dtype=phi_dtype), torch.bfloat16, sinkhorn_iters=ITERS)
    run_boundary(boundary_inputs(lead, c, n, torch.bfloat16, phi_dtype=phi_dtype), torch.bfloat16, sinkhorn_iters=ITERS)


TMA_SHAPE = ((150,), 64) if not CUDA else ((2, 1031), 1024)  # C a multiple of the x pass's BK: u's columns tile


@fast_first("n,phi_dtype", [(4, torch.float32), (2, torch.bfloat16), (8, torch.float32)])
def test_x_pass_by_tma_descriptors(n, phi_dtype, monkeypatch):
    """mHC's x pass loads x, dL, dx_in, du and stores dx by TMA descriptor. A token count no multiple of the token
    block and several token splits (rows past the end read as zero, none written; no block reaches into the next
    split), against float64: the pass alone, the whole pre op (dx_in with the write-back), the boundary op. It must
    engage where the tensors allow, and fall back to pointers where they do not (u's columns not whole tiles: C no
    multiple of BK; an odd row length: a row stride not 16-byte aligned; one-stream rows, n = 1)."""
    torch.manual_seed(97 + n)
    launched = []
    on_launch(monkeypatch, ("_coef_bwd_x",), lambda name, kwargs: launched.append(kwargs["TMA"]))
    lead, c = TMA_SHAPE  # several token splits on the CPU too (3 of 64 tokens: num_sms 1, 4 column blocks)
    _check_x_pass(lead, c, n, phi_dtype)
    assert launched == [True]
    run_pre(coef_inputs(lead, c, n, torch.bfloat16, phi_dtype=phi_dtype), torch.bfloat16, sinkhorn_iters=ITERS)
    run_boundary(boundary_inputs(lead, c, n, torch.bfloat16, phi_dtype=phi_dtype), torch.bfloat16, sinkhorn_iters=ITERS)
    assert len(launched) >= 3 and all(launched)
    launched.clear()
    _check_x_pass(lead, 40, n, phi_dtype)  # C = 40: u's tiles would straddle two streams
    _check_x_pass((37,), 3, 4, torch.float32, with_u=False)  # rows of 12 bf16: 24 bytes, 16 does not divide
    _check_x_pass((37,), c, 1, phi_dtype)  # one stream: HC's tiles, pointers
    assert launched == [False, False, False]


@fast_first("op", ["mhc_pre", "mhc_enter", "mhc_boundary"])
def test_u_in_the_branchs_dtype_is_the_cast_bitwise(op, monkeypatch):
    """kernel_checks.check_u_in_the_branchs_dtype on mHC's three ops that hand a branch its input."""
    torch.manual_seed(91)
    lead, c = SHAPES[1]
    opts = MHCOptions(sinkhorn_iters=ITERS)
    inputs = (boundary_inputs if op == "mhc_boundary" else coef_inputs)(lead, c, 4, torch.bfloat16)
    call = getattr(fused, op)
    check_u_in_the_branchs_dtype(op, lambda i, d: call(*i, opts, d), inputs, monkeypatch)


def test_u_dtype_in_the_reference_is_the_cast():
    torch.manual_seed(92)
    x, phi, bias, alpha = coef_inputs((5,), 8, 4, torch.bfloat16)
    opts = MHCOptions(sinkhorn_iters=3)
    plain, wide = R.mhc_pre(x, phi, bias, alpha, opts), R.mhc_pre(x, phi, bias, alpha, opts, torch.float32)
    assert plain[0].dtype == torch.bfloat16 and wide[0].dtype == torch.float32
    assert torch.equal(wide[0], plain[0].float())
    b_in = boundary_inputs((5,), 8, 4, torch.bfloat16)
    assert torch.equal(R.mhc_boundary(*b_in, opts, torch.float32)[1], R.mhc_boundary(*b_in, opts)[1].float())


def test_mhc_pre_fallback_matches_reference():
    torch.manual_seed(13)
    x, phi, bias, alpha = coef_inputs((5,), 8, 4, torch.float32)
    opts = MHCOptions(sinkhorn_iters=3, start="exp")
    a = fused.mhc_pre(x, phi, bias, alpha, opts)
    b = R.mhc_pre(x, phi, bias, alpha, opts)
    # the fallback takes the reference coefficients (bitwise) and the fused H_pre aggregation (own sum order)
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-6)
    for u, v in zip(a[1:], b[1:]):
        assert torch.equal(u, v)
