"""`hc_enter` (kernels/fused/ops/hc_enter.py, hc_operands.py) against the float64 reference: HC's coefficients
and u in one op with its write-back, HC's operands made inside the op, u in the branch's dtype."""

import pytest
import torch
from helpers import fast_first
from kernel_checks import (
    CUDA,
    HC_PARAM_GRADS,
    SHAPES,
    TOL,
    check,
    check_u_in_the_branchs_dtype,
    config_changed,
    consumers,
    f64,
    grads,
    hc_block,
    hc_inputs,
    leaf,
    poisoned_outputs,
    producer,
    upstream,
)

from mhc_lightning.kernels import fused
from mhc_lightning.kernels import reference as R
from mhc_lightning.kernels.fused import hc_operands, projection
from mhc_lightning.kernels.fused.ops import hc_coefficients

pytestmark = pytest.mark.usefixtures(poisoned_outputs.__name__)


def _strided(p: torch.Tensor) -> torch.Tensor:
    """p as a non-contiguous view (every other element of a new tensor), its gradient reaching p."""
    return torch.stack([p, p], -1)[..., 0]


@fast_first("n", [1, 2, 4, 8])
@fast_first("dtype", [torch.float32, torch.bfloat16])
@fast_first("use_tanh", [True, False])
@fast_first("layout", ["contiguous", "strided"])
def test_hc_enter_then_write_back_matches_reference(n, dtype, use_tanh, layout, monkeypatch):
    """HC's one op for coefficients and u (`hc_enter`) with the write-back reading the x it hands on: the stream out
    and the gradient of x and of every parameter against float64. Its backward writes one dx: <du, x_i> in the tail
    pass, h_pre_i du and the write-back's gradient in the x pass (checked: the x pass gets du and dx_in, and no
    autograd sum of stream-sized gradients runs), over several row blocks with a partial last one. Contiguous
    parameters (the model's): HC's operands made inside the op (`HCEnterFolded`); a strided one: by torch ops."""
    torch.manual_seed(120 + n + 10 * use_tanh)
    seen, entries = [], []
    real_pass, real_tiles = projection.x_pass, projection.tiles
    monkeypatch.setattr(
        projection,
        "x_pass",
        lambda *a, **k: seen.append((k.get("du") is not None, k.get("dx_in") is not None)) or real_pass(*a, **k),
    )
    monkeypatch.setattr(projection, "tiles", lambda name, *a, **k: entries.append(name) or real_tiles(name, *a, **k))
    inputs = hc_inputs(SHAPES[0][0], SHAPES[0][1], n, dtype)
    x, g, *params = inputs
    call_params = [g if layout == "contiguous" else _strided(g), *params]
    with config_changed("hc_tail_bwd", BT=16 if not CUDA else 128, BC=16):
        out, xt = hc_block(fused, x, *call_params, use_tanh=use_tanh)
        want = "HCEnterFoldedBackward" if layout == "contiguous" else "hc_enter_fwd_through_eagerBackward"
        assert type(producer(xt)).__name__ == want
        assert (SHAPES[0][0][0] * n) % 16 != 0 and SHAPES[0][1] > 16  # a partial row block, several C tiles
        ref_in = f64(inputs)
        ref, _ = hc_block(R, *ref_in, use_tanh=use_tanh)
        gr = upstream(ref, out)
        t_h, _, t_g = TOL[dtype]
        check(out, ref, t_h, "x_next")
        assert consumers(out, x) == 1  # one dx, written by hc_enter's x pass
        assert consumers(ref, ref_in[0]) > 1  # the reference wiring hands x to several ops
        g_out = grads([out], inputs, [gr])
    for name, a, b in zip(HC_PARAM_GRADS, g_out, grads([ref], ref_in, [gr])):
        check(a, b, t_g, name)
    assert seen == [(True, True)]
    assert [e for e in entries if e.endswith("_bwd_x")] == ["hc_bwd_x"]  # HC's rows at their own tiles


@fast_first("n", [1, 4, 8])
@fast_first("dtype", [torch.float32, torch.bfloat16])
def test_hc_operands_equal_the_torch_composition(n, dtype):
    """`hc_operands.hc_operands` (one launch) gives the projection weights and the packed statics exactly as the torch
    composition does (reference.hc_projection_weights, `hc_coefficients.hc_statics`), over several channel blocks with
    a partial last one; `hc_operand_grads` gives the gradients autograd takes through that composition (float64
    composition, parameters in `dtype`), each in its parameter's dtype."""
    torch.manual_seed(140 + n)
    c = 300  # three blocks of 128 channels, the last partial
    params = [t.to(dtype) for t in hc_inputs((1,), c, n, torch.float32)[1:]]
    g, w_beta, w_m, w_r, s_alpha, s_beta, b_static, am_static, ar_static = params
    w, statics = hc_operands.hc_operands(*params)
    assert torch.equal(w, R.hc_projection_weights(g, w_beta, w_m, w_r).float())
    assert torch.equal(statics, hc_coefficients.hc_statics(s_alpha, s_beta, b_static, am_static, ar_static))
    leaves = [leaf(p.double()) for p in params]
    ref_w = R.hc_projection_weights(*leaves[:4])
    ref_st = hc_coefficients.hc_statics(*leaves[4:]).double()
    dw, dst = torch.randn_like(w), torch.randn_like(statics)
    want = torch.autograd.grad([ref_w, ref_st], leaves, [dw.double(), dst.double()])
    got = hc_operands.hc_operand_grads(dw, dst, *params)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for name, a, b, p in zip(("g", "w_beta", "w_m", "w_r", "s_alpha", "s_beta", "b", "a_m", "a_r"), got, want, params):
        assert a.dtype == p.dtype and a.shape == p.shape, name
        check(a, b, tol, name)


def test_hc_enter_u_and_coefficients_match_the_composition():
    """hc_enter's u and coefficients equal hc_coefficients then stream_pre on the fused ops (same kernels, one op)."""
    torch.manual_seed(13)
    inputs = [t.detach() for t in hc_inputs((9,), 40, 4, torch.bfloat16)]
    xt, u, *coefs = fused.hc_enter(*inputs)
    assert xt.data_ptr() == inputs[0].data_ptr()
    want = fused.hc_coefficients(*inputs)
    for a, b in zip(coefs, want):
        assert torch.equal(a, b)
    assert torch.equal(u, fused.stream_pre(inputs[0], want[0]))


@fast_first("layout", ["contiguous", "strided"])
def test_u_in_the_branchs_dtype_is_the_cast_bitwise(layout, monkeypatch):
    """kernel_checks.check_u_in_the_branchs_dtype on `hc_enter`, its operands made inside the op and by torch."""
    torch.manual_seed(91)
    lead, c = SHAPES[1]
    shape = _strided if layout == "strided" else (lambda p: p)
    check_u_in_the_branchs_dtype(
        "hc_enter",
        lambda i, d: fused.hc_enter(i[0], shape(i[1]), *i[2:], u_dtype=d),
        hc_inputs(lead, c, 4, torch.bfloat16),
        monkeypatch,
    )
