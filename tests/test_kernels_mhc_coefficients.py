"""mHC's coefficients and the sublayer's entry (kernels/fused/mhc.py, projection.py, sinkhorn.py) against the float64
reference: `mhc_coefficients`, `mhc_pre`, `mhc_enter` (with its write-back), the x pass, and the fallbacks."""

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
    enter_block,
    f64,
    grads,
    leaf,
    on_launch,
    poisoned_outputs,
    producer,
    run_boundary,
    run_pre,
    upstream,
)

from mhc_lightning.kernels import MHCOptions, fused
from mhc_lightning.kernels import reference as R
from mhc_lightning.kernels.fused import host, launch_config, mhc, partial_sums, projection

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
    lg = mhc.coef_fwd.plain(x, phi, bias, alpha, 3, 1e-6, True, False, 1e-6, 1e-6, 2.0)[3]
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
    real = mhc.token_backward
    monkeypatch.setattr(mhc, "token_backward", lambda *a, **k: seen.add(a[6] is None) or real(*a, **k))
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


def test_mhc_enter_then_write_back_at_n_8_with_fp32_phi():
    """n = 8 (M = 80: a 256-wide pair tile) with the trainer's dtypes, against float64: the coefficients, u, the
    stream out and every gradient, through mhc_pre, mhc_enter with its write-back, and the boundary op."""
    torch.manual_seed(88)
    lead, c = SHAPES[1]
    run_pre(coef_inputs(lead, c, 8, torch.bfloat16), torch.bfloat16, sinkhorn_iters=ITERS)
    _check_enter_block(8, torch.bfloat16, "rows")
    run_boundary(boundary_inputs(lead, c, 8, torch.bfloat16), torch.bfloat16, sinkhorn_iters=ITERS)


def _check_enter_block(n, dtype, mode):
    lead, c = SHAPES[1]
    opts = MHCOptions(sinkhorn_iters=ITERS, exact_axis="cols" if mode == "cols" else "rows")
    inputs = coef_inputs(lead, c, n, dtype, with_res=mode != "identity") + [leaf(torch.randn(c, device=DEV))]
    out, xt = enter_block(fused, *inputs, opts)
    assert type(producer(xt)).__name__ == "mhc_pre_fwd_through_eagerBackward"
    ref_in = f64(inputs)
    ref, _ = enter_block(R, *ref_in, opts)
    g = upstream(ref, out)
    t_h, _, t_g = TOL[dtype]
    check(out, ref, t_h, "x_next")
    for name, a, b in zip(
        ("dx", "dphi", "dbias", "dalpha", "dw"), grads([out], inputs, [g]), grads([ref], ref_in, [g])
    ):
        check(a, b, t_g, name)


@fast_first(
    "n,dtype,mode",
    [
        (4, torch.bfloat16, "rows"),
        (2, torch.float32, "cols"),
        (4, torch.float32, "identity"),
        (1, torch.bfloat16, "rows"),
    ],
)
def test_mhc_enter_then_write_back_matches_reference(n, dtype, mode, monkeypatch):
    """x has two consumers (the coefficients and u; the write-back): through mhc_enter the write-back's gradient of x
    enters the pre op's backward and is added in its x pass (checked: the x pass receives it), matching float64. The
    x pass takes mHC's tiles for n > 1 (the register cap), the one-stream rows' tiles for n = 1."""
    torch.manual_seed(78 + n)
    seen, entries = [], []
    real_pass, real_tiles = projection.x_pass, projection.tiles
    monkeypatch.setattr(
        projection, "x_pass", lambda *a, **k: seen.append(k.get("dx_in") is not None) or real_pass(*a, **k)
    )
    monkeypatch.setattr(projection, "tiles", lambda name, *a, **k: entries.append(name) or real_tiles(name, *a, **k))
    _check_enter_block(n, dtype, mode)
    assert seen == [True]
    assert [e for e in entries if e.endswith("_bwd_x")] == ["hc_bwd_x" if n == 1 else "coef_bwd_x"]


def test_the_trainers_sublayer_takes_no_avoidable_launch(monkeypatch):
    """With the trainer's dtypes (bf16 streams, fp32 phi as pairs) and C <= rows_max_c: Sinkhorn runs in the GEMM
    kernel (no `_coef_tail`), the write-back's backward writes whole rows (no partials to sum: one `_param_grad_sum`,
    the coefficients'), and no zero dh_pre is made (h_pre reaches the loss only through u). With a bf16 phi the tail
    keeps its own launch; above rows_max_c the write-back sums its per-C-block partials."""
    calls = []
    on_launch(monkeypatch, ("_coef_tail", "_param_grad_sum"), lambda name, kwargs: calls.append(name))
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: calls.append("zeros") or zeros(*a, **k))
    torch.manual_seed(91)
    lead, c = SHAPES[1]
    for phi_dtype, rows_max_c, want in (
        (torch.float32, 1024, ["_param_grad_sum"]),
        (torch.bfloat16, 1024, ["_coef_tail", "_param_grad_sum"]),
        (torch.float32, 0, ["_param_grad_sum", "_param_grad_sum"]),
    ):
        inputs = coef_inputs(lead, c, 4, torch.bfloat16, phi_dtype=phi_dtype) + [leaf(torch.randn(c, device=DEV))]
        calls.clear()
        with config_changed("post_bwd", rows_max_c=rows_max_c, BC=16):
            out, _ = enter_block(fused, *inputs, MHCOptions(sinkhorn_iters=ITERS))
            out.float().sum().backward()
        assert sorted(calls) == sorted(want), (phi_dtype, rows_max_c, calls)


@fast_first("stages", [None, 2])
def test_the_gradient_loops_take_their_pipelining_depth_from_config(stages, monkeypatch):
    """CONFIG loop_stages reaches the two gradient kernels' token / channel loops (tl.range num_stages: every load of
    the loop an async copy on the GPU; the interpreter runs the same loop), with the same float64-checked gradients
    either way."""
    launched = {}
    on_launch(
        monkeypatch,
        ("_coef_bwd_tok", "_coef_bwd_x"),
        lambda name, kwargs: launched.__setitem__(name, kwargs["LOOP_STAGES"]),
    )
    torch.manual_seed(92)
    lead, c = SHAPES[1]
    inputs = coef_inputs(lead, c, 4, torch.bfloat16) + [leaf(torch.randn(c, device=DEV))]
    with config_changed("coef_bwd_tok", loop_stages=stages), config_changed("coef_bwd_x", loop_stages=stages):
        out, _ = enter_block(fused, *inputs, MHCOptions(sinkhorn_iters=ITERS))
        ref_in = f64(inputs)
        ref, _ = enter_block(R, *ref_in, MHCOptions(sinkhorn_iters=ITERS))
        g = upstream(ref, out)
        g_out = grads([out], inputs, [g])
    assert launched == {"_coef_bwd_tok": stages, "_coef_bwd_x": stages}
    for name, a, b in zip(("dx", "dphi", "dbias", "dalpha", "dw"), g_out, grads([ref], ref_in, [g])):
        check(a, b, TOL[torch.bfloat16][2], name)


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
