"""`mhc_coefficients` (kernels/fused/ops/mhc_coefficients.py, projection.py, sinkhorn.py) against the float64
reference: h_pre, h_post, H^res and their gradients, the projection's dot by dtype, and the fallbacks."""

import pytest
import torch
from helpers import fast_first
from kernel_checks import DEV, ITERS, SHAPES, TOL, check, coef_inputs, f64, grads, poisoned_outputs, upstream

from mhc_lightning.kernels import MHCOptions, fused
from mhc_lightning.kernels import reference as R
from mhc_lightning.kernels.fused import host, projection
from mhc_lightning.kernels.fused.ops import mhc_coefficients

pytestmark = pytest.mark.usefixtures(poisoned_outputs.__name__)


def test_checker_rejects_nan_and_unwritten():
    ref = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(AssertionError):
        check(torch.tensor([0.0, float("nan"), 0.0, 0.0]), ref, 1e-3)
    with pytest.raises(AssertionError):
        check(torch.full((4,), float("nan")), ref, 1e-3)


def test_projection_of_bf16_x_with_fp32_phi_is_more_precise_than_tf32():
    """The trainer's case (bf16 stream, fp32 phi): the coefficient GEMM takes phi as bf16 hi / lo pairs made in the
    kernel (`projection.forward_dot`). Its raw projection must match float64 to ~1e-5 (phi to 16 mantissa bits):
    tf32's rounding of phi alone gives ~2e-4, bf16's ~2e-3 (on the GPU the dots are the tensor-core ones)."""
    torch.manual_seed(31)
    x, phi, bias, alpha = [t.detach() for t in coef_inputs((37,), 40, 4, torch.bfloat16)]
    assert phi.dtype == torch.float32 and projection.forward_dot(x, phi) == (projection.native_dot(), True)
    lg = mhc_coefficients.coef_fwd.plain(x, phi, bias, alpha, 3, 1e-6, True, False, 1e-6, 1e-6, 2.0)[3]
    ref = x.double().reshape(37, -1) @ phi.double()
    err = ((lg.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 4e-5, err
    # the bound separates the pairs from tf32 (phi rounded to 10 mantissa bits) and from phi in bf16 alone
    tf32 = ((phi.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)
    for rounded in (tf32, phi.bfloat16()):
        coarse = x.double().reshape(37, -1) @ rounded.double()
        assert ((coarse - ref).abs().max() / ref.abs().max()).item() > 1e-4


def test_the_projections_dot_by_dtype():
    """fp32 x: fp32 products; phi in x's dtype: native dots; an fp32 phi beside 16-bit x: the pairs, at every width
    (n = 8: M = 80 too); a phi of another 16-bit dtype: tf32."""
    x = torch.randn(2, 8, device=DEV)
    native = projection.native_dot()
    assert projection.forward_dot(x, torch.randn(8, 24, device=DEV)) == (projection.DOT_IEEE, False)
    for m in (24, 80):
        assert projection.forward_dot(x.bfloat16(), torch.randn(8, m, device=DEV)) == (native, True)
    assert projection.forward_dot(x.bfloat16(), torch.randn(8, 24, device=DEV).bfloat16()) == (native, False)
    assert projection.forward_dot(x.bfloat16(), torch.randn(8, 24, device=DEV).half()) == (projection.DOT_TF32, False)


def _run_coef(inputs, dtype, **kw):
    x, phi, bias, alpha = inputs
    out = fused.mhc_coefficients(x, phi, bias, alpha, MHCOptions(**kw))
    ref_in = f64(inputs)
    ref = R.mhc_coefficients(*ref_in, MHCOptions(**kw))
    gs = [upstream(r, o) for r, o in zip(ref, out)]
    g_out = grads(out, inputs, gs)
    g_ref = grads(ref, ref_in, gs)
    t_h, t_res, t_g = TOL[dtype]
    check(out[0], ref[0], t_h, "h_pre")
    check(out[1], ref[1], t_h, "h_post")
    if ref[2] is None:
        assert out[2] is None
    else:
        check(out[2], ref[2], t_res, "h_res")
    for name, a, b in zip(("dx", "dphi", "dbias", "dalpha"), g_out, g_ref):
        check(a, b, t_g, name)
    return out


@fast_first("n", [1, 2, 4, 8])
@fast_first("exact_axis", ["rows", "cols"])
@fast_first("res_layout", ["src_dst", "dst_src"])
def test_coefficients_fp32(n, exact_axis, res_layout):
    torch.manual_seed(n * 7 + len(exact_axis) + len(res_layout))
    for lead, c in SHAPES:
        out = _run_coef(
            coef_inputs(lead, c, n, torch.float32),
            torch.float32,
            sinkhorn_iters=ITERS,
            exact_axis=exact_axis,
            res_layout=res_layout,
        )
        h_res = out[2].detach()
        assert (h_res >= 0).all()
        rows, cols = R.sinkhorn_residuals(h_res)
        exact = rows if exact_axis == "rows" else cols
        assert exact.max().item() <= 1e-5 * n, "the exact axis must sum to 1"


def test_coefficients_fp32_20_iters_and_saturation():
    torch.manual_seed(11)
    lead, c = SHAPES[0]
    _run_coef(coef_inputs(lead, c, 4, torch.float32), torch.float32, sinkhorn_iters=20)
    # x10 logits: near-permutation H^res, the slow-convergence regime trained models reach
    _run_coef(coef_inputs(lead, c, 4, torch.float32, gate=10.0), torch.float32, sinkhorn_iters=ITERS, exact_axis="cols")


@fast_first("n", [1, 2, 4, 8])
def test_coefficients_identity_hc(n):
    """phi with 2n columns: no res block, h_res is None."""
    torch.manual_seed(100 + n)
    for lead, c in SHAPES:
        _run_coef(coef_inputs(lead, c, n, torch.float32, with_res=False), torch.float32)


@fast_first("phi_dtype", [torch.float32, torch.bfloat16])
@fast_first("exact_axis", ["rows", "cols"])
def test_coefficients_bf16(phi_dtype, exact_axis):
    torch.manual_seed(3)
    for lead, c in SHAPES:
        _run_coef(
            coef_inputs(lead, c, 4, torch.bfloat16, phi_dtype=phi_dtype),
            torch.bfloat16,
            sinkhorn_iters=ITERS,
            exact_axis=exact_axis,
        )


def test_coefficient_fallbacks_match_reference():
    """Options the kernels do not cover go to the reference: identical results."""
    torch.manual_seed(5)
    x, phi, bias, alpha = coef_inputs((5,), 8, 4, torch.float32)
    for start in ("exp", "log_domain"):
        opts = MHCOptions(sinkhorn_iters=3, start=start)
        a = fused.mhc_coefficients(x, phi, bias, alpha, opts)
        b = R.mhc_coefficients(x, phi, bias, alpha, opts)
        for u, v in zip(a, b):
            assert torch.equal(u, v)
    with pytest.raises(ValueError, match="exact_axis"):
        fused.mhc_coefficients(x, phi, bias, alpha, MHCOptions(exact_axis="diag"))
    assert host.POISON  # the fixture is on: every kernel output above started as NaN
