"""`mhc_enter` (kernels/fused/ops/mhc_enter.py) with its write-back against the float64 reference: the write-back's
gradient of x added in the enter op's x pass, the trainer's sublayer without avoidable launches, and the gradient
loops' pipelining depth."""

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
from mhc_lightning.kernels.fused import projection

pytestmark = pytest.mark.usefixtures(poisoned_outputs.__name__)


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
