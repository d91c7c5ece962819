"""Fused Triton kernels vs the float64 reference: forward and every gradient.

Without CUDA the kernels run under the Triton interpreter on small shapes (the env var must be set
before triton is first imported); with CUDA the same tests run at larger shapes. Every kernel output
starts NaN-filled (ops.POISON), so unwritten elements fail; a NaN never compares equal.
Tolerances follow docs/design.md §11 (Liger tiers): fp32 5e-4 / 1e-3 / 2e-3, bf16 1.5e-2 / 2.5e-2 / 5e-2,
with atol scaled by the reference's magnitude (reductions over tokens grow with N).
"""
import json
import math
import os
import subprocess
import sys
from contextlib import ExitStack, contextmanager

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from mhc_lightning.kernels import MHCOptions  # noqa: E402
from mhc_lightning.kernels import fused  # noqa: E402
from mhc_lightning.kernels import reference as R  # noqa: E402
from mhc_lightning.kernels.fused import ops  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
if not CUDA and not ops.INTERPRET:  # imported earlier in this process without the interpreter
    raise RuntimeError("mhc_lightning.kernels.fused was imported before TRITON_INTERPRET=1 was set")

# (leading shape, C): token counts that are not multiples of any block, C not a power of two
SHAPES = [((37,), 24), ((2, 19), 40)] if not CUDA else [((4099,), 1000), ((2, 1031), 1024)]
TOL = {  # (h_pre / h_post / outputs, h_res, gradients)
    torch.float32: (5e-4, 1e-3, 2e-3),
    torch.bfloat16: (1.5e-2, 2.5e-2, 5e-2),
}
ITERS = 4 if not CUDA else 20  # interpreter time grows ~ iters^2 in the backward


@pytest.fixture(autouse=True)
def _poison():
    ops.POISON = True
    yield
    ops.POISON = False


def check(out, ref, tol, name=""):
    assert out is not None and out.shape == ref.shape, f"{name}: shape {None if out is None else out.shape} != {ref.shape}"
    out = out.detach().double()
    assert torch.isfinite(out).all(), f"{name}: {(~torch.isfinite(out)).sum().item()} non-finite elements"
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(out, ref.detach(), atol=tol * scale, rtol=tol, msg=lambda m: f"{name}: {m}")


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _f64(ts):
    return [_leaf(t.double()) for t in ts]


def _upstream(ref, out):
    """A random upstream gradient for a fused output and its float64 reference: drawn for the reference, rounded
    through the fused output's dtype (as autograd hands it to the fused op), so both sides differentiate against the
    same values. Unrounded, a bf16 du alone moved dalpha (a sum over every token that can nearly cancel) by more than
    its tolerance at n = 8 on the GPU."""
    return None if ref is None or out is None else torch.randn_like(ref).to(out.dtype).to(ref.dtype)


def _grads(outs, ins, gs):
    loss = sum((o * g.to(o.dtype)).sum() for o, g in zip(outs, gs) if o is not None and g is not None)
    return torch.autograd.grad(loss, ins)


def _coef_inputs(lead, c, n, dtype, with_res=True, phi_dtype=torch.float32, gate=1.0):
    m = R.mhc_logit_count(n, with_res)
    x = torch.randn(*lead, n, c, device=DEV).to(dtype)
    phi = (torch.randn(n * c, m, device=DEV) / (n * c) ** 0.5).to(phi_dtype)
    bias = torch.randn(m, device=DEV)
    alpha = torch.tensor([0.8, 1.3, 1.7], device=DEV) * gate
    return [_leaf(t) for t in (x, phi, bias, alpha)]


@pytest.mark.parametrize("split", ["dots", "interleaved", "in_kernel"])
def test_projection_of_bf16_x_with_fp32_phi_is_more_precise_than_tf32(split):
    """The trainer's case (bf16 stream, fp32 phi) with CONFIG coef_fwd phi_split: the coefficient GEMM splits phi into two
    bf16 parts (ops._projection), one dot per part ("dots") or one dot on interleaved hi / lo columns.
    Its raw projection must match float64 to ~1e-5 (phi to 16 mantissa bits): tf32's rounding of phi alone gives
    ~2e-4, bf16's ~2e-3 (on the GPU the dots are the tensor-core ones)."""
    torch.manual_seed(31)
    x, phi, bias, alpha = [t.detach() for t in _coef_inputs((37,), 40, 4, torch.bfloat16)]
    with config_changed("coef_fwd", phi_split=split):
        assert phi.dtype == torch.float32 and ops._projection(x, phi)[3] == ops.PHI_SPLITS[split]  # the split is taken
        lg = ops.coef_fwd.plain(x, phi, bias, alpha, 3, 1e-6, True, False, 1e-6, 1e-6, 2.0)[3]
    ref = x.double().reshape(37, -1) @ phi.double()
    err = ((lg.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 4e-5, err
    # the bound separates the split from tf32 (phi rounded to 10 mantissa bits) and from phi in bf16 alone
    tf32 = ((phi.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)
    for rounded in (tf32, phi.bfloat16()):
        coarse = x.double().reshape(37, -1) @ rounded.double()
        assert ((coarse - ref).abs().max() / ref.abs().max()).item() > 1e-4


def test_interleaved_split_only_up_to_its_tile_width():
    """n = 8 (M = 80) takes the pairs made in the kernel under the default phi_split (ops.SPLIT_MAX_MP: its 256-wide
    host-interleaved tile failed the float64 checks on the H200, the in-kernel pairs passed); n = 4 (M = 24) takes
    the host-interleaved pairs."""
    x = torch.randn(2, 8, device=DEV).bfloat16()
    for m, split in ((24, ops.PHI_SPLITS["interleaved"]), (80, ops.PHI_SPLITS["in_kernel"])):
        assert ops._projection(x, torch.randn(8, m, device=DEV))[2:] == (ops._native(), split)
    assert ops.CONFIG["coef_fwd"]["phi_split"] == "interleaved"


def _run_coef(inputs, dtype, **kw):
    x, phi, bias, alpha = inputs
    out = fused.mhc_coefficients(x, phi, bias, alpha, MHCOptions(**kw))
    ref_in = _f64(inputs)
    ref = R.mhc_coefficients(*ref_in, MHCOptions(**kw))
    gs = [_upstream(r, o) for r, o in zip(ref, out)]
    g_out = _grads(out, inputs, gs)
    g_ref = _grads(ref, ref_in, gs)
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


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("exact_axis", ["rows", "cols"])
@pytest.mark.parametrize("res_layout", ["src_dst", "dst_src"])
def test_coefficients_fp32(n, exact_axis, res_layout):
    torch.manual_seed(n * 7 + len(exact_axis) + len(res_layout))
    for lead, c in SHAPES:
        out = _run_coef(_coef_inputs(lead, c, n, torch.float32), torch.float32, sinkhorn_iters=ITERS,
                        exact_axis=exact_axis, res_layout=res_layout)
        h_res = out[2].detach()
        assert (h_res >= 0).all()
        rows, cols = R.sinkhorn_residuals(h_res)
        exact = rows if exact_axis == "rows" else cols
        assert exact.max().item() <= 1e-5 * n, "the exact axis must sum to 1"


def test_coefficients_fp32_20_iters_and_saturation():
    torch.manual_seed(11)
    lead, c = SHAPES[0]
    _run_coef(_coef_inputs(lead, c, 4, torch.float32), torch.float32, sinkhorn_iters=20)
    # x10 logits: near-permutation H^res, the slow-convergence regime trained models reach
    _run_coef(_coef_inputs(lead, c, 4, torch.float32, gate=10.0), torch.float32, sinkhorn_iters=ITERS,
              exact_axis="cols")


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_coefficients_identity_hc(n):
    """phi with 2n columns: no res block, h_res is None."""
    torch.manual_seed(100 + n)
    for lead, c in SHAPES:
        _run_coef(_coef_inputs(lead, c, n, torch.float32, with_res=False), torch.float32)


@pytest.mark.parametrize("phi_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("exact_axis", ["rows", "cols"])
def test_coefficients_bf16(phi_dtype, exact_axis):
    torch.manual_seed(3)
    for lead, c in SHAPES:
        _run_coef(_coef_inputs(lead, c, 4, torch.bfloat16, phi_dtype=phi_dtype), torch.bfloat16,
                  sinkhorn_iters=ITERS, exact_axis=exact_axis)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_pre(n, dtype):
    torch.manual_seed(20 + n)
    for lead, c in SHAPES:
        x = _leaf(torch.randn(*lead, n, c, device=DEV).to(dtype))
        h = _leaf(torch.rand(*lead, n, device=DEV) + 0.1)
        out = fused.stream_pre(x, h)
        assert out.dtype == dtype
        ref_in = _f64([x, h])
        ref = R.stream_pre(*ref_in)
        g = _upstream(ref, out)
        tol = TOL[dtype]
        check(out, ref, tol[0], "u")
        for name, a, b in zip(("dx", "dh_pre"), _grads([out], [x, h], [g]), _grads([ref], ref_in, [g])):
            check(a, b, tol[2], name)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("h_dtype,stream_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16)])
def test_the_streams_ends(n, h_dtype, stream_dtype):
    """expand_streams (the embedding cast and copied into n streams) and sum_streams (the "sum" collapse), one
    kernel each way (kernels/fused/stream_ends.py): values and gradients against float64, each stream's own values
    (random upstream gradients per stream, so a mixed-up stream index fails)."""
    torch.manual_seed(30 + n)
    for lead, c in SHAPES:
        h = _leaf(torch.randn(*lead, c, device=DEV).to(h_dtype))
        x = fused.expand_streams(h, n, stream_dtype)
        assert type(x.grad_fn).__name__ == "ExpandStreamsBackward" and x.dtype == stream_dtype
        ref_h = _f64([h])
        ref_x = R.expand_streams(*ref_h, n)
        g = _upstream(ref_x, x)
        check(x, ref_x, TOL[stream_dtype][0], "x_0")
        check(_grads([x], [h], [g])[0], _grads([ref_x], ref_h, [g])[0], TOL[stream_dtype][2], "dh")

        xs = _leaf(torch.randn(*lead, n, c, device=DEV).to(stream_dtype))
        out = fused.sum_streams(xs, h_dtype)
        assert type(out.grad_fn).__name__ == "SumStreamsBackward" and out.dtype == h_dtype
        ref_xs = _f64([xs])
        ref_out = R.sum_streams(*ref_xs)
        g = _upstream(ref_out, out)
        check(out, ref_out, TOL[h_dtype][0] * n, "sum")
        check(_grads([out], [xs], [g])[0], _grads([ref_out], ref_xs, [g])[0], TOL[stream_dtype][2], "dx")


@contextmanager
def config_changed(name, **changes):
    """Changed launch parameters of one kernel (ops.CONFIG) within the block, restored afterwards."""
    saved = dict(ops.CONFIG[name])
    ops.CONFIG[name] = dict(saved, **changes)
    try:
        yield
    finally:
        ops.CONFIG[name] = saved


# The stream_post_res backward with several C blocks per row (partials summed afterwards) and with one C block per
# row (direct writes). C=1024 on CUDA: 4 blocks of 256; on CPU (C = 24, 40) 2-3 blocks of 16. "looped": fewer
# programs than token blocks, each walking several blocks in its pipelined loop; on the CPU one SM, so 2 programs
# (with partials: one per C block) and 37 / 38 tokens leave a partial last block of BT 4; on an H200 the trainer's
# one row per program.
POST_BWD_TILES = {"partials": dict(BT=8, BC=256 if CUDA else 16, rows_max_c=0), "rows": dict(BT=4, BC=4096, rows_max_c=0),
                  "looped": dict(BT=1 if CUDA else 4, BC=4096, rows_max_c=0, loop_stages=2, programs_per_sm=2),
                  "looped partials": dict(BT=8, BC=256 if CUDA else 16, rows_max_c=0, loop_stages=3,
                                          programs_per_sm=2)}


@pytest.mark.parametrize("n,dtype,tiles", [
    (1, torch.float32, "rows"), (2, torch.bfloat16, "partials"), (4, torch.float32, "partials"),
    (4, torch.bfloat16, "rows"), (8, torch.float32, "rows"), (8, torch.bfloat16, "partials"),
    (2, torch.float32, "looped"), (4, torch.bfloat16, "looped"), (8, torch.bfloat16, "looped partials"),
])
@pytest.mark.parametrize("with_res", [True, False])
def test_stream_post_res(n, dtype, tiles, with_res, monkeypatch):
    grids = []
    _on_launch(monkeypatch, ("_post_bwd_2d",), lambda name, kw: grids.append((kw["grid"], kw["LOOP_STAGES"])))
    cfg = POST_BWD_TILES[tiles]
    with config_changed("post_bwd", **cfg):
        _check_stream_post_res(n, dtype, with_res)
    stages = cfg.get("loop_stages", 0)
    assert grids and all(s == stages for _, s in grids)
    if stages:  # each program walked several token blocks
        tokens = [math.prod(lead) for lead, _ in SHAPES]
        assert all(g[0] * cfg["BT"] * 2 <= t for (g, _), t in zip(grids, tokens)), (grids, tokens)


def _check_stream_post_res(n, dtype, with_res):
    torch.manual_seed(40 + n + 2 * with_res)
    for lead, c in SHAPES:
        x = _leaf(torch.randn(*lead, n, c, device=DEV).to(dtype))
        f = _leaf(torch.randn(*lead, c, device=DEV).to(dtype))
        hp = _leaf(2 * torch.rand(*lead, n, device=DEV))
        hr = _leaf(torch.rand(*lead, n, n, device=DEV)) if with_res else None
        ins = [x, f, hp] + ([hr] if with_res else [])
        out = fused.stream_post_res(x, f, hp, hr)
        assert out.dtype == dtype
        ref_in = _f64(ins)
        ref = R.stream_post_res(*ref_in[:3], ref_in[3] if with_res else None)
        g = _upstream(ref, out)
        tol = TOL[dtype]
        check(out, ref, tol[0], "x_next")
        names = ("dx", "df", "dh_post", "dh_res")
        for name, a, b in zip(names, _grads([out], ins, [g]), _grads([ref], ref_in, [g])):
            check(a, b, tol[2], name)


def test_reference_mhc_pre_is_the_composition():
    torch.manual_seed(12)
    x, phi, bias, alpha = _coef_inputs((5,), 8, 4, torch.float64)
    opts = MHCOptions(sinkhorn_iters=3, exact_axis="cols", res_layout="dst_src")
    u, *h = R.mhc_pre(x, phi, bias, alpha, opts)
    h_ref = R.mhc_coefficients(x, phi, bias, alpha, opts)
    for a, b in zip(h, h_ref):
        assert torch.equal(a, b)
    assert torch.equal(u, R.stream_pre(x, h_ref[0]))


def _run_pre(inputs, dtype, used=(True, True, True, True), **kw):
    """Fused mhc_pre vs the float64 reference composition: outputs and every input gradient, with upstream
    gradients on the outputs in `used` only (du = None exercises the coefficient-only backward)."""
    x, phi, bias, alpha = inputs
    out = fused.mhc_pre(x, phi, bias, alpha, MHCOptions(**kw))
    ref_in = _f64(inputs)
    ref = R.mhc_pre(*ref_in, MHCOptions(**kw))
    gs = [_upstream(r, o) if k else None for r, o, k in zip(ref, out, used)]
    g_out = _grads(out, inputs, gs)
    g_ref = _grads(ref, ref_in, gs)
    t_h, t_res, t_g = TOL[dtype]
    assert out[0].dtype == x.dtype
    for name, a, b, t in zip(("u", "h_pre", "h_post", "h_res"), out, ref, (t_h, t_h, t_h, t_res)):
        if b is None:
            assert a is None
        else:
            check(a, b, t, name)
    for name, a, b in zip(("dx", "dphi", "dbias", "dalpha"), g_out, g_ref):
        check(a, b, t_g, name)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", ["rows", "cols", "identity"])
def test_mhc_pre_fp32(n, mode):
    torch.manual_seed(60 + n + len(mode))
    for lead, c in SHAPES:
        inputs = _coef_inputs(lead, c, n, torch.float32, with_res=mode != "identity")
        _run_pre(inputs, torch.float32, sinkhorn_iters=ITERS, exact_axis="cols" if mode == "cols" else "rows",
                 res_layout="dst_src" if n == 2 else "src_dst")


@pytest.mark.parametrize("split_tail", [False, True])
def test_mhc_pre_bf16_partial_grads_split_tail(split_tail, monkeypatch):
    """bf16 (both phi dtypes), only some outputs used, Sinkhorn in the GEMM kernel or in its own launch (for every
    tile set: the fp32 phi's 16-bit-part tiles carry their own split_tail). Without a gradient of its own for h_pre
    the per-token kernel starts dh_pre at zero (`HAS_DPRE` off; checked that both ways ran)."""
    torch.manual_seed(70 + split_tail)
    seen = set()
    real = ops.bwd_tok
    monkeypatch.setattr(ops, "bwd_tok", lambda *a, **k: seen.add(a[6] is None) or real(*a, **k))
    subs = {k: dict(ops.CONFIG["coef_fwd"][k], split_tail=split_tail) for k in ("tf32", "split")}
    with config_changed("coef_fwd", split_tail=split_tail, **subs):
        lead, c = SHAPES[1]
        for phi_dtype, used in ((torch.float32, (True, False, True, True)), (torch.bfloat16, (False, True, True, True)),
                                (torch.float32, (True, True, False, False))):
            inputs = _coef_inputs(lead, c, 4, torch.bfloat16, phi_dtype=phi_dtype)
            _run_pre(inputs, torch.bfloat16, used=used, sinkhorn_iters=ITERS)
        # 20 iterations on saturated logits (near-permutation H^res): the O(iters) Sinkhorn walk-back
        inputs = _coef_inputs(SHAPES[0][0], SHAPES[0][1], 4, torch.float32, gate=10.0)
        _run_pre(inputs, torch.float32, sinkhorn_iters=20)
    assert seen == {True, False}


@pytest.mark.parametrize("u_inside_max_c", [0, 4096])
@pytest.mark.parametrize("n,dtype,phi_dtype,phi_split", [
    (4, torch.bfloat16, torch.float32, "interleaved"), (4, torch.bfloat16, torch.float32, "in_kernel"),
    (4, torch.bfloat16, torch.float32, False),
    (4, torch.bfloat16, torch.bfloat16, False), (2, torch.float32, torch.float32, False)])
def test_mhc_pre_u_in_or_after_the_coefficient_kernel(u_inside_max_c, n, dtype, phi_dtype, phi_split):
    """u in the coefficient kernel's own loop, or by stream_pre's kernel after it (CONFIG coef_fwd u_inside_max_c),
    at each dot the trainer's fp32 phi can take (16-bit parts, the default, or tf32 at its own tiles)."""
    torch.manual_seed(75 + n)
    subs = {k: dict(ops.CONFIG["coef_fwd"][k], u_inside_max_c=u_inside_max_c) for k in ("tf32", "split")}
    with config_changed("coef_fwd", u_inside_max_c=u_inside_max_c, phi_split=phi_split, **subs):
        assert ops._projection(_coef_inputs((2,), 8, n, dtype, phi_dtype=phi_dtype)[0],
                               torch.zeros(1, 1, dtype=phi_dtype, device=DEV))[2] == (
            ops.DOT_IEEE if dtype == torch.float32 else ops.DOT_TF32 if phi_dtype == torch.float32 and not phi_split
            else ops._native())
        lead, c = SHAPES[1]
        _run_pre(_coef_inputs(lead, c, n, dtype, phi_dtype=phi_dtype), dtype, sinkhorn_iters=ITERS)


def test_kernel_config_override_from_the_environment():
    """MHC_KERNEL_CONFIG merges into ops.CONFIG at import (nested tf32 tiles key by key); a kernel or key CONFIG does
    not have, or text that is not JSON, stops the import with one line naming it and what is allowed."""
    def imported(value):
        code = "import json; from mhc_lightning.kernels.fused import ops; print(json.dumps(ops.CONFIG))"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=dict(os.environ, MHC_KERNEL_CONFIG=value, TRITON_INTERPRET="1"))

    proc = imported('{"coef_fwd": {"phi_split": true, "tf32": {"BT": 32}}, "post_bwd": {"rows": {"BT": 2}}}')
    config = json.loads(proc.stdout)
    cfg = config["coef_fwd"]
    assert cfg["phi_split"] is True and cfg["tf32"]["BT"] == 32
    assert cfg["tf32"]["BK"] == ops.CONFIG["coef_fwd"]["tf32"]["BK"]  # the rest of the nested entry kept
    # under the interpreter its token tiles, and the environment's override after them
    tile = ops.INTERPRETER_TILES["post_bwd"]["BT"]
    assert tile != ops.CONFIG["post_bwd"]["BT"] or ops.INTERPRET  # the GPU's tile is not the interpreter's
    assert config["post_bwd"]["rows"]["BT"] == 2 and config["post_bwd"]["BT"] == tile == config["coef_bwd_tok"]["BT"]
    for value, words in (('{"coef_fwdx": {}}', "unknown kernel 'coef_fwdx'; allowed: coef_fwd,"),
                         ('{"coef_fwd": {"BQ": 1}}', "MHC_KERNEL_CONFIG.coef_fwd: unknown key 'BQ'; allowed: BT,"),
                         ('{"coef_fwd": {"phi_split": "halves"}}',
                          'MHC_KERNEL_CONFIG.coef_fwd.phi_split: \'halves\'; allowed: false, true, "dots", "interleaved", "in_kernel"'),
                         ("{coef", "MHC_KERNEL_CONFIG is not JSON")):
        proc = imported(value)
        assert proc.returncode != 0 and words in proc.stderr.strip().splitlines()[-1]


def test_interpreter_tiles_only_under_the_interpreter():
    """ops.INTERPRETER_TILES (32 tokens per program) replace CONFIG's token tiles under the interpreter only: compiled
    kernels keep the tiles the GPU measurements chose (one row per program in post_bwd's rows tile)."""
    for name, tiles in ops.INTERPRETER_TILES.items():
        for key, value in tiles.items():
            if isinstance(value, dict):
                assert all((ops.CONFIG[name][key][k] == v) == ops.INTERPRET for k, v in value.items()), (name, key)
            else:
                assert (ops.CONFIG[name][key] == value) == ops.INTERPRET, (name, key)


def test_bwd_x_adds_the_other_consumers_gradient():
    """bwd_x with dx_in: dx = (its own dx) + dx_in, in the same pass."""
    torch.manual_seed(77)
    lead, c = SHAPES[1]
    x, phi, _, _ = _coef_inputs(lead, c, 4, torch.bfloat16)
    x = x.detach().reshape(-1, 4, c)
    N = x.shape[0]
    dl, dss = torch.randn(N, phi.shape[1], device=DEV), torch.randn(N, device=DEV)
    h_pre, du = torch.rand(N, 4, device=DEV), torch.randn(N, c, device=DEV).to(x.dtype)
    dx_in = torch.randn_like(x)
    plain, summed = torch.empty_like(x), torch.empty_like(x)
    ops.bwd_x(x, phi.detach(), dl, dss, plain, h_pre=h_pre, du=du)
    ops.bwd_x(x, phi.detach(), dl, dss, summed, h_pre=h_pre, du=du, dx_in=dx_in)
    check(summed, plain.double() + dx_in.double(), TOL[torch.bfloat16][2], "dx + dx_in")


@pytest.mark.parametrize("n,phi_dtype", [(4, torch.float32), (4, torch.bfloat16), (1, torch.float32),
                                         (2, torch.bfloat16), (8, torch.float32)])
def test_x_pass_on_16_bit_parts(n, phi_dtype):
    """`_coef_bwd_x` SPLIT (CONFIG dl_split): dL and phi enter the dots as bf16 hi + lo parts. The phi gradient
    x^T dL and dx (into an fp32 buffer) keep 16 mantissa bits of dL and phi (checked at 1e-4 against float64, tighter
    than tf32's 11 bits allow); then the whole pre op and the boundary op with it against the float64 composition."""
    torch.manual_seed(79 + n)
    lead, c = SHAPES[1]
    with config_changed("coef_bwd_x", dl_split=True), config_changed("bnd_dphi", dl_split=True):
        _check_x_pass(lead, c, n, phi_dtype)
        _run_pre(_coef_inputs(lead, c, n, torch.bfloat16, phi_dtype=phi_dtype), torch.bfloat16, sinkhorn_iters=ITERS)
        _run_boundary(_boundary_inputs(lead, c, n, torch.bfloat16, phi_dtype=phi_dtype), torch.bfloat16,
                      sinkhorn_iters=ITERS)


def _check_x_pass(lead, c, n, phi_dtype):
    """The x pass alone (`ops.bwd_x`, fp32 dx and dphi buffers: no rounding to the stream's or phi's dtype) against
    float64 at 1e-4: dphi = x^T dL, dx = dL phi^T + 2 x d(sum x^2) + h_pre_j du."""
    x, phi, _, _ = _coef_inputs(lead, c, n, torch.bfloat16, phi_dtype=phi_dtype)
    x, phi = x.detach().reshape(-1, n, c), phi.detach()
    N = x.shape[0]
    dl, dss = torch.randn(N, phi.shape[1], device=DEV), torch.randn(N, device=DEV)
    h_pre, du = torch.rand(N, n, device=DEV), torch.randn(N, c, device=DEV).to(x.dtype)
    dx = torch.empty(x.shape, device=DEV)
    dphi = torch.empty(phi.shape, device=DEV)
    ops._sum_partials(ops.bwd_x(x, phi, dl, dss, dx, h_pre=h_pre, du=du), dphi)
    xd, dld = x.double().reshape(N, -1), dl.double()
    check(dphi, xd.t() @ dld, 1e-4, "dphi")
    ref_dx = (dld @ phi.double().t()).reshape(N, n, c) + 2 * x.double() * dss.double()[:, None, None] \
        + h_pre.double()[:, :, None] * du.double()[:, None, :]
    check(dx, ref_dx, 1e-4, "dx")


@pytest.mark.parametrize("dphi_first", [True, False])
def test_x_pass_with_the_phi_gradient_dots_first_or_last(dphi_first):
    """CONFIG dphi_first orders the token loop's two pairs of dots (the phi gradient's before or after dx's: the
    shared memory dx's store can reuse, docs/kernels.md); both orders give the same float64-checked x pass."""
    torch.manual_seed(83)
    lead, c = SHAPES[1]
    with config_changed("coef_bwd_x", dl_split=True, dphi_first=dphi_first):
        _check_x_pass(lead, c, 4, torch.float32)


TMA_SHAPE = ((150,), 64) if not CUDA else ((2, 1031), 1024)  # C a multiple of the x pass's BK: u's columns tile


@pytest.mark.parametrize("n,phi_dtype", [(4, torch.float32), (2, torch.bfloat16), (8, torch.float32)])
def test_x_pass_by_tma_descriptors(n, phi_dtype, monkeypatch):
    """CONFIG tma: the x pass loads x, dL, dx_in, du and stores dx by TMA descriptor. A token count no multiple of the
    token block and several token splits (rows past the end read as zero, none written; no block reaches into the
    next split), against float64: the pass alone, the whole pre op (dx_in with the write-back), the boundary op's
    phi-gradient pass (no dx). It must engage where the tensors allow, and fall back to pointers where they do not
    (u's columns not whole tiles: C no multiple of BK; an odd row length: a row stride not 16-byte aligned)."""
    torch.manual_seed(97 + n)
    launched = []
    _on_launch(monkeypatch, ("_coef_bwd_x",), lambda name, kwargs: launched.append(kwargs["TMA"]))
    lead, c = TMA_SHAPE  # several token splits on the CPU too (3 of 64 tokens: _num_sms 1, 4 column blocks)
    with config_changed("coef_bwd_x", tma=True), config_changed("bnd_dphi", tma=True):
        _check_x_pass(lead, c, n, phi_dtype)
        assert launched == [True]
        _run_pre(_coef_inputs(lead, c, n, torch.bfloat16, phi_dtype=phi_dtype), torch.bfloat16, sinkhorn_iters=ITERS)
        _run_boundary(_boundary_inputs(lead, c, n, torch.bfloat16, phi_dtype=phi_dtype), torch.bfloat16,
                      sinkhorn_iters=ITERS)
        assert len(launched) >= 3 and all(launched)
        launched.clear()
        _check_x_pass(lead, 40, n, phi_dtype)  # C = 40: u's tiles would straddle two streams
        x = torch.randn(37, 4, 3, device=DEV).to(torch.bfloat16)  # rows of 12 bf16: 24 bytes, 16 does not divide
        dl = torch.randn(37, R.mhc_logit_count(4, True), device=DEV)
        phi, dphi = torch.randn(12, dl.shape[1], device=DEV), torch.empty(12, dl.shape[1], device=DEV)
        ops._sum_partials(ops.bwd_x(x, phi, dl, torch.randn(37, device=DEV)), dphi)  # the phi gradient only
        check(dphi, x.double().reshape(37, -1).t() @ dl.double(), 1e-4, "dphi, pointers")
        assert launched == [False, False]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_phi_pairs_are_the_interleaved_hi_and_lo_parts(dtype):
    """`_phi_pairs` (one launch): columns 2j, 2j + 1 hold phi in dtype (hi) and the rest phi - hi (lo); hi + lo keeps
    phi to ~16 bits where hi alone keeps 8-11. On the GPU bit for bit the torch composition (the interpreter's bf16
    cast truncates instead of rounding). An element count that is no multiple of the block, a transposed phi."""
    torch.manual_seed(5)
    for phi in (torch.randn(133, 24, device=DEV), torch.randn(24, 133, device=DEV).t()):
        pairs = ops._phi_pairs_of(phi, dtype)
        assert pairs.shape == (133, 48) and pairs.dtype == dtype
        hi, lo = pairs[:, 0::2], pairs[:, 1::2]
        assert torch.equal(lo, (phi - hi.float()).to(dtype)) or not CUDA and dtype == torch.bfloat16
        if CUDA or dtype == torch.float16:
            assert torch.equal(hi, phi.to(dtype))
        p = phi.double()
        assert ((hi.double() + lo.double() - p).abs() <= 2.0 ** -13 * p.abs() + 2.0 ** -22).all()  # fp16 subnormals
        assert ((hi.double() - p).abs() > 2.0 ** -13 * p.abs()).any()  # the lo part carries bits hi lacks


@pytest.mark.parametrize("splits,rows", [(1, 1), (16, 130), (5, 1100), (3, 4099)])
def test_parameter_gradient_partials_summed_in_one_launch(splits, rows):
    """`_param_grad_sum`: the weight's split partials and the vectors' per-block partials (one row per vector
    element, [PW, programs]: each row summed by its own program) in one launch, each gradient written in its own dtype
    into its own tensor; also the weight alone, one vector (HC's statics), and two weights (the write-back backward's
    dh_post and dH partials). 4099 partials: more than the trainer's 4096 per-token programs, off the load width."""
    torch.manual_seed(splits + rows)
    wpart, vpart = torch.randn(splits, 97, 24, device=DEV), torch.randn(27, rows, device=DEV)
    w_ref, v_ref = wpart.double().sum(0), vpart.double().sum(1)
    dw, da, db = (ops._new(shape, dt, DEV) for shape, dt in (((97, 24), torch.float32), ((24,), torch.float32),
                                                             ((3,), torch.bfloat16)))
    ops._sum_partials(wpart, dw, vpart, da, db)
    check(dw, w_ref, 1e-6, "dw")
    check(da, v_ref[:24], 1e-6, "da")
    check(db, v_ref[24:], 1e-2, "db (bf16)")
    dw16 = ops._new((97, 24), torch.bfloat16, DEV)
    ops._sum_partials(wpart, dw16)
    check(dw16, w_ref, 1e-2, "dw alone (bf16)")
    dv = ops._new((27,), torch.float32, DEV)
    ops._sum_partials(wpart, dw, vpart, dv)
    check(dv, v_ref, 1e-6, "one vector")
    wpart2 = torch.randn(splits + 3, 5, 7, device=DEV)  # a second weight with its own split count (dh_post, dH)
    dw2 = ops._new((5, 7), torch.float32, DEV)
    ops._sum_partials(wpart, dw, wpart2=wpart2, dw2=dw2)
    check(dw, w_ref, 1e-6, "dw beside dw2")
    check(dw2, wpart2.double().sum(0), 1e-6, "dw2")


def _enter_block(ops_, x, phi, bias, alpha, w, opts):
    """One sublayer as the model runs it: mhc_enter, a branch, the write-back reading the stream mhc_enter handed on."""
    xt, u, _, h_post, h_res = ops_.mhc_enter(x, phi, bias, alpha, opts)
    return ops_.stream_post_res(xt, torch.tanh(u * w.to(u.dtype)).to(u.dtype), h_post, h_res), xt


@pytest.mark.parametrize("n,dtype,mode", [(4, torch.bfloat16, "rows"), (2, torch.float32, "cols"),
                                          (4, torch.float32, "identity"), (8, torch.bfloat16, "rows")])
def test_mhc_enter_then_write_back_matches_reference(n, dtype, mode, monkeypatch):
    """x has two consumers (the coefficients and u; the write-back): through mhc_enter the write-back's gradient of x
    enters the pre op's backward and is added in its x pass (checked: bwd_x receives it), matching float64."""
    torch.manual_seed(78 + n)
    seen, entries = [], []
    real, real_cfg = ops.bwd_x, ops._cfg
    monkeypatch.setattr(ops, "bwd_x", lambda *a, **k: seen.append(k.get("dx_in") is not None) or real(*a, **k))
    monkeypatch.setattr(ops, "_cfg", lambda name, *a, **k: entries.append(name) or real_cfg(name, *a, **k))
    lead, c = SHAPES[1]
    opts = MHCOptions(sinkhorn_iters=ITERS, exact_axis="cols" if mode == "cols" else "rows")
    inputs = _coef_inputs(lead, c, n, dtype, with_res=mode != "identity") + [_leaf(torch.randn(c, device=DEV))]
    out, xt = _enter_block(fused, *inputs, opts)
    assert type(_producer(xt)).__name__ == "mhc_pre_fwd_through_eagerBackward"
    ref_in = _f64(inputs)
    ref, _ = _enter_block(R, *ref_in, opts)
    g = _upstream(ref, out)
    t_h, _, t_g = TOL[dtype]
    check(out, ref, t_h, "x_next")
    grads = zip(("dx", "dphi", "dbias", "dalpha", "dw"), _grads([out], inputs, [g]), _grads([ref], ref_in, [g]))
    for name, a, b in grads:
        check(a, b, t_g, name)
    assert seen == [True]
    assert "coef_bwd_x" in entries and "hc_bwd_x" not in entries  # the x pass at mHC's launch (the register cap)


def _on_launch(monkeypatch, names, record):
    """Each kernel in names, as ops launches it (`ops.name[grid](*args, **kwargs)`), calls record(name, kwargs and
    grid=grid) and then launches for real."""
    for name in names:
        real = getattr(ops, name)

        def launch(grid, name=name, real=real):
            def run(*args, **kwargs):
                record(name, dict(kwargs, grid=grid))
                return real[grid](*args, **kwargs)
            return run
        monkeypatch.setattr(ops, name, type("Watched", (), {"__getitem__": lambda self, grid, f=launch: f(grid)})())


def test_the_trainers_sublayer_takes_no_avoidable_launch(monkeypatch):
    """With the trainer's dtypes (bf16 streams, fp32 phi as 16-bit parts) and C <= 1024: Sinkhorn runs in the GEMM
    kernel (no `_coef_tail`), the write-back's backward writes whole rows (no partials to sum: one `_param_grad_sum`,
    the coefficients'), and no zero dh_pre is made (h_pre reaches the loss only through u). With a bf16 phi the tail
    keeps its own launch; above rows_max_c the write-back sums its per-C-block partials."""
    calls = []
    _on_launch(monkeypatch, ("_coef_tail", "_param_grad_sum"), lambda name, kwargs: calls.append(name))
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: calls.append("zeros") or zeros(*a, **k))
    torch.manual_seed(91)
    lead, c = SHAPES[1]
    for phi_dtype, rows_max_c, want in ((torch.float32, 1024, ["_param_grad_sum"]),
                                        (torch.bfloat16, 1024, ["_coef_tail", "_param_grad_sum"]),
                                        (torch.float32, 0, ["_param_grad_sum", "_param_grad_sum"])):
        inputs = _coef_inputs(lead, c, 4, torch.bfloat16, phi_dtype=phi_dtype) + [_leaf(torch.randn(c, device=DEV))]
        calls.clear()
        with config_changed("post_bwd", rows_max_c=rows_max_c, BC=16):
            out, _ = _enter_block(fused, *inputs, MHCOptions(sinkhorn_iters=ITERS))
            out.float().sum().backward()
        assert sorted(calls) == sorted(want), (phi_dtype, rows_max_c, calls)


@pytest.mark.parametrize("stages", [None, 2])
def test_the_gradient_loops_take_their_pipelining_depth_from_config(stages, monkeypatch):
    """CONFIG loop_stages reaches the two gradient kernels' token / channel loops (tl.range num_stages: every load of
    the loop an async copy on the GPU; the interpreter runs the same loop), with the same float64-checked gradients
    either way (the GPU run of this file covers the pipelined code at the defaults)."""
    launched = {}
    _on_launch(monkeypatch, ("_coef_bwd_tok", "_coef_bwd_x"),
               lambda name, kwargs: launched.__setitem__(name, kwargs["LOOP_STAGES"]))
    torch.manual_seed(92)
    lead, c = SHAPES[1]
    inputs = _coef_inputs(lead, c, 4, torch.bfloat16) + [_leaf(torch.randn(c, device=DEV))]
    with config_changed("coef_bwd_tok", loop_stages=stages), config_changed("coef_bwd_x", loop_stages=stages):
        out, _ = _enter_block(fused, *inputs, MHCOptions(sinkhorn_iters=ITERS))
        ref_in = _f64(inputs)
        ref, _ = _enter_block(R, *ref_in, MHCOptions(sinkhorn_iters=ITERS))
        g = _upstream(ref, out)
        grads = _grads([out], inputs, [g])
    assert launched == {"_coef_bwd_tok": stages, "_coef_bwd_x": stages}
    for name, a, b in zip(("dx", "dphi", "dbias", "dalpha", "dw"), grads, _grads([ref], ref_in, [g])):
        check(a, b, TOL[torch.bfloat16][2], name)


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("exact_axis", ["rows", "cols"])
def test_the_per_token_backward_in_either_order(interleave, exact_axis, monkeypatch):
    """CONFIG coef_bwd_tok interleave: odd programs run Sinkhorn's backward before the <du, x_j> loop, even ones after
    it; the flag reaches the launch and the gradients match float64 either way, for the entry op and the boundary op
    (which share the kernel), over token blocks of both parities with a partial last one."""
    launched = []
    _on_launch(monkeypatch, ("_coef_bwd_tok",), lambda name, kwargs: launched.append(kwargs["INTERLEAVE"]))
    torch.manual_seed(93 + interleave)
    lead, c = SHAPES[1]
    assert (lead[0] * lead[1]) % ops.CONFIG["coef_bwd_tok"]["BT"] != 0 and lead[0] * lead[1] > 2 * 8
    opts = MHCOptions(sinkhorn_iters=ITERS, exact_axis=exact_axis)
    inputs = _coef_inputs(lead, c, 4, torch.bfloat16) + [_leaf(torch.randn(c, device=DEV))]
    with config_changed("coef_bwd_tok", interleave=interleave):
        out, _ = _enter_block(fused, *inputs, opts)
        ref_in = _f64(inputs)
        ref, _ = _enter_block(R, *ref_in, opts)
        g = _upstream(ref, out)
        grads = _grads([out], inputs, [g])
        bnd = _boundary_inputs(lead, c, 4, torch.bfloat16)
        _run_boundary(bnd, torch.bfloat16, sinkhorn_iters=ITERS, exact_axis=exact_axis)
    assert launched and set(launched) == {interleave}
    for name, a, b in zip(("dx", "dphi", "dbias", "dalpha", "dw"), grads, _grads([ref], ref_in, [g])):
        check(a, b, TOL[torch.bfloat16][2], name)


@pytest.mark.parametrize("m", [3, 6, 10, 20])  # n + 2 for n = 1, 4, 8; and wider
@pytest.mark.parametrize("dtype,split", [(torch.float32, False), (torch.bfloat16, False),
                                         (torch.bfloat16, "interleaved"), (torch.bfloat16, "in_kernel")])
def test_rms_proj(m, dtype, split):
    """HC's projection RMSNorm(x) w (one read of x; the coefficient kernel without its tail), forward and both
    gradients against float64, over several token blocks and a C that is not a power of two; with bf16 x, the fp32 w
    also as interleaved 16-bit parts (CONFIG coef_fwd phi_split)."""
    torch.manual_seed(100 + m)
    lead, c = SHAPES[1]
    x = _leaf(torch.randn(*lead, 4, c, device=DEV).to(dtype) * 3)
    w = _leaf(torch.randn(c, m, device=DEV) / c ** 0.5)
    with config_changed("coef_fwd", phi_split=split):
        assert ops._projection(x, w)[3] == ops.PHI_SPLITS[split]
        out = fused.rms_proj(x, w)
    assert out.dtype == torch.float32 and out.shape == (*lead, 4, m)
    ref_in = _f64([x, w])
    ref = R.rms_proj(*ref_in)
    g = _upstream(ref, out)
    t_h, _, t_g = TOL[dtype]
    check(out, ref, t_h, "y")
    for name, a, b in zip(("dx", "dw"), _grads([out], [x, w], [g]), _grads([ref], ref_in, [g])):
        check(a, b, t_g, name)


def _hc_inputs(lead, c, n, dtype):
    """x and HC's ten parameters, all away from their (zero / one) inits so every term of the tail is exercised."""
    x = torch.randn(*lead, n, c, device=DEV).to(dtype)
    ps = [torch.rand(c, device=DEV) + 0.5, torch.randn(c, device=DEV) / c ** 0.5, torch.randn(c, device=DEV) / c ** 0.5,
          torch.randn(c, n, device=DEV) / c ** 0.5, torch.tensor(0.4, device=DEV), torch.tensor(0.9, device=DEV),
          torch.randn(n, device=DEV), torch.randn(n, device=DEV), torch.randn(n, n, device=DEV)]
    return [_leaf(t) for t in (x, *ps)]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_tanh", [True, False])
def test_hc_coefficients(n, dtype, use_tanh, monkeypatch):
    """The fused HC coefficients (one op: projection and tail in one kernel, the tail's backward in another, partial
    sums of the static parameters' gradients over several row blocks, the last one partial) against the float64
    reference: the three maps and the gradient of x and of every parameter."""
    torch.manual_seed(110 + n + 10 * use_tanh)
    seen = []
    real = ops.eager.hc_coef
    monkeypatch.setattr(ops.eager, "hc_coef", lambda *a: seen.append(True) or real(*a))
    inputs = _hc_inputs(SHAPES[0][0], SHAPES[0][1], n, dtype)
    with config_changed("hc_tail_bwd", BT=16 if not CUDA else 128):
        out = fused.hc_coefficients(*inputs, use_tanh=use_tanh)
        assert seen == [True] and (SHAPES[0][0][0] * n) % 16 != 0
    ref_in = _f64(inputs)
    ref = R.hc_coefficients(*ref_in, use_tanh=use_tanh)
    gs = [_upstream(r, o) for r, o in zip(ref, out)]
    t_h, _, t_g = TOL[dtype]
    for name, a, b in zip(("h_pre", "h_post", "h_res"), out, ref):
        check(a, b, t_h, name)
    names = ("dx", "dnorm_weight", "dw_beta", "dw_m", "dw_r", "ds_alpha", "ds_beta", "db_static", "dam_static",
             "dar_static")
    with config_changed("hc_tail_bwd", BT=16 if not CUDA else 128):
        grads = _grads(out, inputs, gs)
    for name, a, b in zip(names, grads, _grads(ref, ref_in, gs)):
        check(a, b, t_g, name)


def _consumers(out, leaf) -> int:
    """Autograd nodes in out's graph that take a gradient of leaf directly: with more than one, autograd sums
    stream-sized gradients before leaf gets its own."""
    seen, stack, count = set(), [out.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is not None and getattr(nxt, "variable", None) is leaf:
                count += 1
            stack.append(nxt)
    return count


def _producer(t: torch.Tensor):
    """The autograd node of the op that made t, under any view the wrappers put on it (x' comes out of the enter op
    as the alias of its input: its own node for a flat [N, n, C] stream, under a view of x's shape otherwise)."""
    node = t.grad_fn
    while type(node).__name__.startswith(("View", "Reshape", "UnsafeView")):
        node = node.next_functions[0][0]
    return node


def _hc_block(ops_, x, *params, use_tanh=True):
    """One HC sublayer as the model runs it: hc_enter, a branch on u, the write-back reading the stream it handed on."""
    xt, u, _, h_post, h_res = ops_.hc_enter(x, *params, use_tanh=use_tanh)
    return ops_.stream_post_res(xt, torch.tanh(u), h_post, h_res), xt


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_tanh", [True, False])
@pytest.mark.parametrize("fold", [True, False], ids=["operands_in_op", "operands_by_torch"])
def test_hc_enter_then_write_back_matches_reference(n, dtype, use_tanh, fold, monkeypatch):
    """HC's one op for coefficients and u (`hc_enter`) with the write-back reading the x it hands on: the stream out
    and the gradient of x and of every parameter against float64. Its backward writes one dx: <du, x_i> in the tail
    pass, h_pre_i du and the write-back's gradient in the x pass (checked: bwd_x gets du and dx_in, and no autograd
    sum of stream-sized gradients runs), over several row blocks with a partial last one. fold: HC's operands made
    inside the op from the nine raw parameters (the eager default, `ops.HCEnterFolded`), or by the torch composition
    outside it (CONFIG hc_operands fold false)."""
    torch.manual_seed(120 + n + 10 * use_tanh)
    seen, entries = [], []
    real, real_cfg = ops.bwd_x, ops._cfg
    monkeypatch.setattr(ops, "bwd_x", lambda *a, **k: seen.append((k.get("du") is not None,
                                                                    k.get("dx_in") is not None)) or real(*a, **k))
    monkeypatch.setattr(ops, "_cfg", lambda name, *a, **k: entries.append(name) or real_cfg(name, *a, **k))
    monkeypatch.setitem(ops.CONFIG, "hc_operands", dict(ops.CONFIG["hc_operands"], fold=fold))
    inputs = _hc_inputs(SHAPES[0][0], SHAPES[0][1], n, dtype)
    with config_changed("hc_tail_bwd", BT=16 if not CUDA else 128, BC=16):
        out, xt = _hc_block(fused, *inputs, use_tanh=use_tanh)
        want = "HCEnterFoldedBackward" if fold else "hc_enter_fwd_through_eagerBackward"
        assert type(_producer(xt)).__name__ == want
        assert (SHAPES[0][0][0] * n) % 16 != 0 and SHAPES[0][1] > 16  # a partial row block, several C tiles
        ref_in = _f64(inputs)
        ref, _ = _hc_block(R, *ref_in, use_tanh=use_tanh)
        g = _upstream(ref, out)
        t_h, _, t_g = TOL[dtype]
        check(out, ref, t_h, "x_next")
        assert _consumers(out, inputs[0]) == 1  # one dx, written by hc_enter's x pass
        assert _consumers(ref, ref_in[0]) > 1  # the reference wiring hands x to several ops
        grads = _grads([out], inputs, [g])
    names = ("dx", "dnorm_weight", "dw_beta", "dw_m", "dw_r", "ds_alpha", "ds_beta", "db_static", "dam_static",
             "dar_static")
    for name, a, b in zip(names, grads, _grads([ref], ref_in, [g])):
        check(a, b, t_g, name)
    assert seen == [(True, True)]
    assert "hc_bwd_x" in entries and "coef_bwd_x" not in entries  # HC's rows at their own launch (timed on HC)


@pytest.mark.parametrize("n", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_operands_equal_the_torch_composition(n, dtype):
    """`ops.hc_operands` (one launch) gives the projection weights, their 16-bit pairs and the packed statics exactly
    as the torch composition does (reference.hc_projection_weights, `_phi_pairs`, `hc_statics`), over several channel
    blocks with a partial last one; `ops.hc_operand_grads` gives the gradients autograd takes through that composition
    (float64 composition, parameters in `dtype`), each in its parameter's dtype."""
    torch.manual_seed(140 + n)
    c = 300  # three blocks of 128 channels, the last partial
    params = [t.to(dtype) for t in _hc_inputs((1,), c, n, torch.float32)[1:]]
    g, w_beta, w_m, w_r, s_alpha, s_beta, b_static, am_static, ar_static = params
    x_dtype = torch.bfloat16
    with config_changed("coef_fwd", phi_split="interleaved"):
        w, statics, pairs = ops.hc_operands(x_dtype, *params)
    assert torch.equal(w, R.hc_projection_weights(g, w_beta, w_m, w_r).float())
    assert torch.equal(statics, ops.hc_statics(s_alpha, s_beta, b_static, am_static, ar_static))
    assert pairs is not None and torch.equal(pairs, ops._phi_pairs_of(w, x_dtype))
    with config_changed("coef_fwd", phi_split=False):
        assert ops.hc_operands(x_dtype, *params)[2] is None  # tf32 dots: no pairs made
    leaves = [_leaf(p.double()) for p in params]
    ref_w = R.hc_projection_weights(*leaves[:4])
    ref_st = ops.hc_statics(*leaves[4:]).double()
    dw, dst = torch.randn_like(w), torch.randn_like(statics)
    want = torch.autograd.grad([ref_w, ref_st], leaves, [dw.double(), dst.double()])
    got = ops.hc_operand_grads(dw, dst, *params)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for name, a, b, p in zip(("g", "w_beta", "w_m", "w_r", "s_alpha", "s_beta", "b", "a_m", "a_r"), got, want, params):
        assert a.dtype == p.dtype and a.shape == p.shape, name
        check(a, b, tol, name)


def test_hc_enter_u_and_coefficients_match_the_composition():
    """hc_enter's u and coefficients equal hc_coefficients then stream_pre on the fused ops (same kernels, one op)."""
    torch.manual_seed(13)
    inputs = [t.detach() for t in _hc_inputs((9,), 40, 4, torch.bfloat16)]
    xt, u, *coefs = fused.hc_enter(*inputs)
    assert xt.data_ptr() == inputs[0].data_ptr()
    want = fused.hc_coefficients(*inputs)
    for a, b in zip(coefs, want):
        assert torch.equal(a, b)
    assert torch.equal(u, fused.stream_pre(inputs[0], want[0]))


def test_hc_static_and_float64_go_to_the_reference():
    torch.manual_seed(12)
    inputs = _hc_inputs((5,), 8, 4, torch.float32)
    for a, b in zip(fused.hc_coefficients(*inputs, dynamic=False), R.hc_coefficients(*inputs, dynamic=False)):
        assert torch.equal(a, b)
    xd = [t.detach().double() for t in inputs]
    for a, b in zip(fused.hc_coefficients(*xd), R.hc_coefficients(*xd)):
        assert torch.equal(a, b)


def _boundary_inputs(lead, c, n, dtype, prev_res=True, next_res=True, phi_dtype=torch.float32):
    """Sublayer l's stream, branch output and write-back coefficients, and sublayer l+1's parameters."""
    x = _leaf(torch.randn(*lead, n, c, device=DEV).to(dtype))
    f = _leaf(torch.randn(*lead, c, device=DEV).to(dtype))
    h_post = _leaf(2 * torch.rand(*lead, n, device=DEV))
    h_res = _leaf(torch.rand(*lead, n, n, device=DEV)) if prev_res else None
    return [x, f, h_post, h_res] + _coef_inputs(lead, c, n, dtype, with_res=next_res, phi_dtype=phi_dtype)[1:]


def _run_boundary(inputs, dtype, used=(True,) * 5, **kw):
    """Fused mhc_boundary vs the float64 reference composition: the five outputs and the gradient of every input,
    with upstream gradients on the outputs in `used` only (None elsewhere, as autograd passes them)."""
    out = fused.mhc_boundary(*inputs, MHCOptions(**kw))
    ref_in = [None if t is None else _leaf(t.double()) for t in inputs]
    ref = R.mhc_boundary(*ref_in, MHCOptions(**kw))
    gs = [_upstream(r, o) if k else None for r, o, k in zip(ref, out, used)]
    leaves = [t for t in inputs if t is not None]
    g_out = _grads(out, leaves, gs)
    g_ref = _grads(ref, [t for t in ref_in if t is not None], gs)
    t_h, t_res, t_g = TOL[dtype]
    assert out[0].dtype == out[1].dtype == inputs[0].dtype
    for name, a, b, t in zip(("x_next", "u", "h_pre", "h_post", "h_res"), out, ref, (t_h, t_h, t_h, t_h, t_res)):
        if b is None:
            assert a is None
        else:
            check(a, b, t, name)
    names = [k for k, t in zip(("dx", "df", "dh_post", "dh_res", "dphi", "dbias", "dalpha"), inputs) if t is not None]
    for name, a, b in zip(names, g_out, g_ref):
        check(a, b, t_g, name)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("exact_axis", ["rows", "cols"])
def test_boundary_fp32(n, exact_axis):
    torch.manual_seed(80 + n + len(exact_axis))
    for lead, c in SHAPES:
        _run_boundary(_boundary_inputs(lead, c, n, torch.float32), torch.float32, sinkhorn_iters=ITERS,
                      exact_axis=exact_axis, res_layout="dst_src" if n == 4 else "src_dst")


@pytest.mark.parametrize("prev_res,next_res", [(False, False), (False, True), (True, False)],
                         ids=["identity", "identity-mhc", "mhc-identity"])
@pytest.mark.parametrize("n", [2, 4])
def test_boundary_identity_hc(prev_res, next_res, n):
    """H^res = I on either side of the boundary (identity-HC sublayers), in any combination."""
    torch.manual_seed(90 + n + 2 * prev_res + next_res)
    lead, c = SHAPES[1]
    _run_boundary(_boundary_inputs(lead, c, n, torch.float32, prev_res, next_res), torch.float32, sinkhorn_iters=ITERS)


# Launch variants of the boundary op: the backward's 2-D pass with several C blocks per row (partials summed
# afterwards) or whole rows, or the per-sublayer kernels (x pass, then the write-back's backward); the Sinkhorn tail
# in the GEMM kernel. (With CUDA's C = 1000 / 1024 the phi-tile cap,
# ops._phi_rows_cap, keeps "rows" in partials.)
BOUNDARY_TILES = {
    "partials": dict(bnd_bwd=dict(BC=256 if CUDA else 16, xpass=False)),
    "rows": dict(bnd_bwd=dict(BC=4096, xpass=False)),
    "in-kernel-sinkhorn": dict(coef_fwd=dict(split_tail=False)),
    "16-bit-parts": dict(bnd_bwd=dict(dl_split=True, xpass=False)),
    "x-pass": dict(bnd_bwd=dict(xpass=True)),
}


@pytest.mark.parametrize("tiles", list(BOUNDARY_TILES))
def test_boundary_bf16_partial_grads_and_tiles(tiles):
    """bf16 streams (both phi dtypes), unused outputs (no upstream gradient), and the launch variants above."""
    torch.manual_seed(95)
    with ExitStack() as stack:
        for name, change in BOUNDARY_TILES[tiles].items():
            stack.enter_context(config_changed(name, **change))
        lead, c = SHAPES[1]
        for phi_dtype, used in ((torch.float32, (True, True, False, True, True)),
                                (torch.bfloat16, (True, False, True, False, True))):
            inputs = _boundary_inputs(lead, c, 4, torch.bfloat16, phi_dtype=phi_dtype)
            _run_boundary(inputs, torch.bfloat16, used=used, sinkhorn_iters=ITERS, exact_axis="cols")


@pytest.mark.parametrize("phi_dtype", [torch.float32, torch.bfloat16])
def test_two_d_pass_on_16_bit_parts(phi_dtype):
    """The boundary's 2-D pass with CONFIG bnd_bwd dl_split: with only the dL phi^T part in the gradient of x_next,
    the fp32 outputs dH^res and dh_post carry it at 16 mantissa bits (1e-4 against float64; a bf16 dL alone: 2^-9)."""
    torch.manual_seed(96)
    lead, c = SHAPES[1]
    inputs = _boundary_inputs(lead, c, 4, torch.bfloat16, phi_dtype=phi_dtype)
    x, f, h_post, h_res, phi = [t.detach() for t in inputs[:5]]
    x, f, h_post, h_res = x.reshape(-1, 4, c), f.reshape(-1, c), h_post.reshape(-1, 4), h_res.reshape(-1, 4, 4)
    N = x.shape[0]
    dl, zero = torch.randn(N, phi.shape[1], device=DEV), torch.zeros(N, device=DEV)
    coef = (torch.randn_like(x), torch.zeros_like(f), dl, zero, torch.rand(N, 4, device=DEV), phi)
    with config_changed("bnd_bwd", dl_split=True, BC=16 if not CUDA else 128):
        _, _, dhp, dhr = ops._post_bwd_run(torch.zeros_like(x), x, f, h_post, h_res, coef=coef)
    G = (dl.double() @ phi.double().t()).reshape(N, 4, c)
    check(dhr, torch.einsum("tic,tjc->tij", G, x.double()), 1e-4, "dH^res")
    check(dhp, torch.einsum("tic,tc->ti", G, f.double()), 1e-4, "dh_post")


def test_boundary_backward_by_the_x_pass(monkeypatch):
    """CONFIG bnd_bwd xpass: the boundary's backward runs the per-sublayer kernels, the x pass with the downstream
    gradient of x_next added in (dx_in) and then the write-back's backward without COEF; off, the 2-D pass with COEF.
    Both against float64 (the whole op's gradients)."""
    torch.manual_seed(99)
    seen = []
    real_x, real_post = ops.bwd_x, ops._post_bwd_run
    monkeypatch.setattr(ops, "bwd_x", lambda *a, **k: seen.append(("x pass", k.get("dx_in") is not None)) or
                        real_x(*a, **k))
    monkeypatch.setattr(ops, "_post_bwd_run", lambda *a, **k: seen.append(("write-back", k.get("coef") is not None))
                        or real_post(*a, **k))
    lead, c = SHAPES[1]
    for xpass, expected in ((True, [("x pass", True), ("write-back", False)]),
                            (False, [("x pass", False), ("write-back", True)])):
        with config_changed("bnd_bwd", xpass=xpass):
            seen.clear()
            _run_boundary(_boundary_inputs(lead, c, 4, torch.bfloat16), torch.bfloat16, sinkhorn_iters=ITERS)
            assert seen == expected, (xpass, seen)


def _u_ops():
    """(name, call(inputs, u_dtype) -> outputs, inputs) for the ops that hand a branch its input u, at the trainer's
    dtypes (bf16 stream, fp32 parameters); HC's with its operands made inside the op and by torch."""
    lead, c = SHAPES[1]
    opts = MHCOptions(sinkhorn_iters=ITERS)

    def hc(fold):
        def call(i, d):
            with config_changed("hc_operands", fold=fold):
                return fused.hc_enter(*i, u_dtype=d)
        return call
    return [("mhc_pre", lambda i, d: fused.mhc_pre(*i, opts, d), _coef_inputs(lead, c, 4, torch.bfloat16)),
            ("mhc_enter", lambda i, d: fused.mhc_enter(*i, opts, d), _coef_inputs(lead, c, 4, torch.bfloat16)),
            ("mhc_boundary", lambda i, d: fused.mhc_boundary(*i, opts, d), _boundary_inputs(lead, c, 4, torch.bfloat16)),
            *((f"hc_enter fold={fold}", hc(fold), _hc_inputs(lead, c, 4, torch.bfloat16)) for fold in (True, False))]


@pytest.mark.parametrize("xpass", [True, False])
def test_u_in_the_branchs_dtype_is_the_cast_bitwise(xpass, monkeypatch):
    """u_dtype fp32 on a bf16 stream (the trainer's branch input): the kernels write u in fp32 themselves (CONFIG "u"
    branch_dtype) and the per-token pass (HC's: its tail pass) rounds the fp32 du back for the x pass, where torch's
    cast after the op did both before. Outputs and every input's gradient are bitwise those of the cast, with an fp32 upstream gradient of u
    that bf16 cannot hold on the GPU (the interpreter truncates fp32 -> bf16 where GPUs and torch round to nearest
    even, so there du is drawn on bf16's grid: the wide path without the rounding); checked that the kernels took the
    fp32 u (no cast node) and that the per-token pass narrowed du (DU_NARROW)."""
    torch.manual_seed(91)
    narrowed = []
    _on_launch(monkeypatch, ("_coef_bwd_tok", "_hc_tail_bwd"),
               lambda name, kw: narrowed.append(kw.get("DU_NARROW", False)))
    for name, call, inputs in _u_ops():
        runs = {}
        for inside in (True, False):
            narrowed.clear()
            leaves = [None if t is None else _leaf(t) for t in inputs]
            with config_changed("u", branch_dtype=inside), config_changed("bnd_bwd", xpass=xpass):
                out = call(leaves, torch.float32)
                u = out[0] if name == "mhc_pre" else out[1]
                assert u.dtype == torch.float32
                assert (type(u.grad_fn).__name__ == "ToCopyBackward0") != inside, (name, inside, u.grad_fn)
                torch.manual_seed(5)
                gs = [None if o is None else torch.randn(o.shape, device=DEV, dtype=torch.float32) for o in out]
                gs = gs if CUDA else [None if g is None else g.bfloat16().float() for g in gs]
                grads = _grads(out, [t for t in leaves if t is not None], gs)
            assert narrowed == [inside], (name, inside, narrowed)
            runs[inside] = (out, grads)
        for a, b in zip(*(runs[True][0], runs[False][0])):
            assert (a is None and b is None) or torch.equal(a, b), name
        for a, b in zip(runs[True][1], runs[False][1]):
            assert torch.equal(a, b), name


def test_u_dtype_in_the_reference_is_the_cast():
    torch.manual_seed(92)
    x, phi, bias, alpha = _coef_inputs((5,), 8, 4, torch.bfloat16)
    opts = MHCOptions(sinkhorn_iters=3)
    plain, wide = R.mhc_pre(x, phi, bias, alpha, opts), R.mhc_pre(x, phi, bias, alpha, opts, torch.float32)
    assert plain[0].dtype == torch.bfloat16 and wide[0].dtype == torch.float32
    assert torch.equal(wide[0], plain[0].float())
    b_in = _boundary_inputs((5,), 8, 4, torch.bfloat16)
    assert torch.equal(R.mhc_boundary(*b_in, opts, torch.float32)[1], R.mhc_boundary(*b_in, opts)[1].float())


def test_boundary_fallback_matches_reference():
    """Options the kernels do not cover: the composition of the ops that do cover their part."""
    torch.manual_seed(14)
    inputs = _boundary_inputs((5,), 8, 4, torch.float32)
    opts = MHCOptions(sinkhorn_iters=3, start="log_domain")
    a = fused.mhc_boundary(*inputs, opts)
    x_next = fused.stream_post_res(*inputs[:4])
    assert torch.equal(a[0], x_next)
    for u, v in zip(a[1:], fused.mhc_pre(x_next, *inputs[4:], opts)):
        assert torch.equal(u, v)
    b = R.mhc_boundary(*inputs, opts)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)


def test_mhc_pre_fallback_matches_reference():
    torch.manual_seed(13)
    x, phi, bias, alpha = _coef_inputs((5,), 8, 4, torch.float32)
    opts = MHCOptions(sinkhorn_iters=3, start="exp")
    a = fused.mhc_pre(x, phi, bias, alpha, opts)
    b = R.mhc_pre(x, phi, bias, alpha, opts)
    # the fallback takes the reference coefficients (bitwise) and the fused H_pre aggregation (own sum order)
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-6)
    for u, v in zip(a[1:], b[1:]):
        assert torch.equal(u, v)


def test_checker_rejects_nan_and_unwritten():
    ref = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(AssertionError):
        check(torch.tensor([0.0, float("nan"), 0.0, 0.0]), ref, 1e-3)
    with pytest.raises(AssertionError):
        check(torch.full((4,), float("nan")), ref, 1e-3)


def test_fallbacks_match_reference():
    """Options the kernels do not cover go to the reference: identical results."""
    torch.manual_seed(5)
    x, phi, bias, alpha = _coef_inputs((5,), 8, 4, torch.float32)
    for start in ("exp", "log_domain"):
        opts = MHCOptions(sinkhorn_iters=3, start=start)
        a = fused.mhc_coefficients(x, phi, bias, alpha, opts)
        b = R.mhc_coefficients(x, phi, bias, alpha, opts)
        for u, v in zip(a, b):
            assert torch.equal(u, v)
    x3 = torch.randn(5, 3, 8, device=DEV)  # n = 3: not a kernel size
    h = torch.rand(5, 3, device=DEV)
    assert torch.equal(fused.stream_pre(x3, h), R.stream_pre(x3, h))
    xd = torch.randn(5, 4, 8, dtype=torch.float64, device=DEV)
    hd = torch.rand(5, 4, dtype=torch.float64, device=DEV)
    assert torch.equal(fused.stream_pre(xd, hd), R.stream_pre(xd, hd))
    with pytest.raises(ValueError, match="exact_axis"):
        fused.mhc_coefficients(x, phi, bias, alpha, MHCOptions(exact_axis="diag"))


def _block(x, phi, bias, alpha, w, iters=3):
    h_pre, h_post, h_res = fused.mhc_coefficients(x, phi, bias, alpha, MHCOptions(sinkhorn_iters=iters))
    u = fused.stream_pre(x, h_pre)
    f = torch.tanh(u * w)
    return fused.stream_post_res(x, f, h_post, h_res)


def _block_pre(x, phi, bias, alpha, w, iters=3):
    u, _, h_post, h_res = fused.mhc_pre(x, phi, bias, alpha, MHCOptions(sinkhorn_iters=iters))
    return fused.stream_post_res(x, torch.tanh(u * w), h_post, h_res)


def _block_enter(x, phi, bias, alpha, w, iters=3):
    return _enter_block(fused, x, phi, bias, alpha, w, MHCOptions(sinkhorn_iters=iters))[0]


def _block_chain(x, phi, bias, alpha, w, iters=3):
    """Two sublayers sharing the parameters, chained through the boundary op (as run_sublayers does)."""
    opts = MHCOptions(sinkhorn_iters=iters)
    x, u, _, h_post, h_res = fused.mhc_enter(x, phi, bias, alpha, opts)
    x, u, _, h_post, h_res = fused.mhc_boundary(x, torch.tanh(u * w), h_post, h_res, phi, bias, alpha, opts)
    return fused.stream_post_res(x, torch.tanh(u * w), h_post, h_res)


def _block_hc(x, phi, bias, alpha, w, iters=3):
    """An HC sublayer on the fused ops: rms_proj inside the coefficients, then the stream ops (phi's first rows as
    the HC projection weights, so the test's leaves all get gradients)."""
    n, c = x.shape[-2], x.shape[-1]
    h_pre, h_post, h_res = fused.hc_coefficients(
        x, w + 1.0, phi[:c, 0], phi[:c, 1], phi[:c, 2:2 + n], alpha[0], alpha[1], bias[:n], bias[n:2 * n],
        bias[2 * n:2 * n + n * n].reshape(n, n))
    return fused.stream_post_res(x, torch.tanh(fused.stream_pre(x, h_pre) * w), h_post, h_res)


def _block_hc_enter(x, phi, bias, alpha, w, iters=3):
    """The same HC sublayer through hc_enter (as the model runs it)."""
    n, c = x.shape[-2], x.shape[-1]
    xt, u, _, h_post, h_res = fused.hc_enter(
        x, w + 1.0, phi[:c, 0], phi[:c, 1], phi[:c, 2:2 + n], alpha[0], alpha[1], bias[:n], bias[n:2 * n],
        bias[2 * n:2 * n + n * n].reshape(n, n))
    return fused.stream_post_res(xt, torch.tanh(u * w), h_post, h_res)


def _block_hc_enter_folded(x, phi, bias, alpha, w, iters=3):
    """The same with contiguous parameters: eager makes HC's operands inside the op (`ops.HCEnterFolded`), the compiled
    graph by the torch composition."""
    n, c = x.shape[-2], x.shape[-1]
    params = [t.contiguous() for t in (w + 1.0, phi[:c, 0], phi[:c, 1], phi[:c, 2:2 + n], alpha[0], alpha[1],
                                       bias[:n], bias[n:2 * n], bias[2 * n:2 * n + n * n].reshape(n, n))]
    xt, u, _, h_post, h_res = fused.hc_enter(x, *params)
    return fused.stream_post_res(xt, torch.tanh(u * w), h_post, h_res)


@pytest.mark.slow
@pytest.mark.parametrize("block", [_block, _block_pre, _block_enter, _block_chain, _block_hc, _block_hc_enter,
                                   _block_hc_enter_folded],
                         ids=["three_ops", "mhc_pre", "mhc_enter", "boundary", "hc", "hc_enter", "hc_enter_folded"])
def test_compile_fullgraph_matches_eager(block):
    _compiled_matches_eager(block, 9)


def _compiled_matches_eager(block, seed, before_compile=lambda: None):
    """block's output and every input gradient under torch.compile(fullgraph) against eager; before_compile runs
    between the two (e.g. to start recording what the compiled run calls)."""
    torch.manual_seed(seed)
    backend = "inductor" if CUDA else "aot_eager"  # the CPU check is graph capture + fake impls + autograd
    x, phi, bias, alpha = _coef_inputs((2, 13), 24, 4, torch.float32)
    w = _leaf(torch.randn(24, device=DEV))
    ins = [x, phi, bias, alpha, w]
    eager = block(*ins)
    g = torch.randn_like(eager)
    g_eager = torch.autograd.grad((eager * g).sum(), ins)
    before_compile()
    torch._dynamo.reset()
    out = torch.compile(block, fullgraph=True, backend=backend)(*ins)
    g_comp = torch.autograd.grad((out * g).sum(), ins)
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_fake_impls_give_the_real_outputs_strides():
    """Compiled graphs assert the fake impls' output strides: HC hands the stream ops a transposed H^res and a gate
    sliced out of a wider tensor; every output the op allocates itself is contiguous, in the fake impl too (a fake
    that copied H^res's strides failed inductor's stride assert on the GPU)."""
    torch.manual_seed(12)
    N, n, C = 5, 4, 16
    x, f, g = torch.randn(N, n, C, device=DEV), torch.randn(N, C, device=DEV), torch.randn(N, n, C, device=DEV)
    h_pre = torch.rand(N, n, 2, device=DEV)[..., 0]
    h_post = torch.rand(N, n, device=DEV)
    h_res = torch.rand(N, n, n, device=DEV).transpose(1, 2)
    assert not h_res.is_contiguous() and not h_pre.is_contiguous()
    for op, args in ((ops.post_fwd, (x, f, h_post, h_res)), (ops.post_bwd, (g, x, f, h_post, h_res)),
                     (ops.pre_fwd, (x, h_pre)), (ops.pre_bwd, (f, x, h_pre)),
                     (ops.rms_proj_fwd, (x.reshape(N * n, C), torch.randn(C, n + 2, device=DEV).t().contiguous().t(),
                                         1e-6))):
        torch.library.opcheck(op, args, test_utils=("test_faketensor",))
    # HC's one op, forward and backward (H^res transposed in, contiguous out)
    w, statics = torch.randn(C, n + 2, device=DEV), torch.randn(2 + 2 * n + n * n, device=DEV)
    outs = ops.hc_coef_fwd(x.reshape(N * n, C), w, statics, n, 1e-6, True)
    assert all(t.is_contiguous() for t in outs)
    torch.library.opcheck(ops.hc_coef_fwd, (x.reshape(N * n, C), w, statics, n, 1e-6, True),
                          test_utils=("test_faketensor",))
    grads = (torch.randn(N * n, device=DEV), torch.randn(N * n, device=DEV), h_res)
    torch.library.opcheck(ops.hc_coef_bwd, (*grads, x.reshape(N * n, C), w, statics, outs[3], outs[4], n, True),
                          test_utils=("test_faketensor",))
    # hc_enter: u beside the same outputs; its backward with and without the write-back's dx
    outs = ops.hc_enter_fwd(x, w, statics, 1e-6, True)
    assert all(t.is_contiguous() for t in outs)
    torch.library.opcheck(ops.hc_enter_fwd, (x, w, statics, 1e-6, True), test_utils=("test_faketensor",))
    for dx_in in (None, g):
        torch.library.opcheck(ops.hc_enter_bwd, (*grads, f, x, w, statics, outs[4], outs[5], outs[1], True),
                              {"dx_in": dx_in}, test_utils=("test_faketensor",))


def test_eager_path_skips_the_dispatcher_and_compile_sees_the_custom_ops():
    """Eager calls run the op bodies under a plain autograd.Function (host time); graphs hold the custom ops."""
    torch.manual_seed(11)
    x, phi, bias, alpha = _coef_inputs((2, 13), 24, 4, torch.float32)
    w = _leaf(torch.randn(24, device=DEV))
    out = _block_pre(x, phi, bias, alpha, w)
    node = out.grad_fn.next_functions[0][0]  # under the wrapper's reshape
    assert type(node).__name__ == "post_fwd_eagerBackward"
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    assert type(_block_chain(x, phi, bias, alpha, w).grad_fn.next_functions[0][0]).__name__ == "post_fwd_eagerBackward"
    torch._dynamo.reset()
    torch.compile(_block_chain, fullgraph=True, backend=capture)(x, phi, bias, alpha, w)
    for op in ("mhc_enter", "mhc_boundary", "stream_post_res"):
        assert f"mhc_lightning.{op}" in graphs[0]
    assert "eager" not in graphs[0]


@pytest.mark.slow
@pytest.mark.parametrize("block,x_pass", [(_block_enter, "bwd_x"), (_block_hc_enter, "_hc_bwd")],
                         ids=["mhc_enter", "hc_enter"])
def test_compiled_write_back_hands_its_gradient_of_x_to_the_enter_op(block, x_pass, monkeypatch):
    """Under torch.compile an enter op cannot return x's alias: x' is `ops.Routed` (x, a storage-less route), the
    write-back returns its gradient of x as the route's, and the enter op's x pass adds it (dx_in) into the one dx
    it writes, as eager's alias does, so the graph has no sum of the two gradients of x. Checked: the x pass got
    dx_in, the route has no storage of its own, and the gradients match eager's; with the route switched off too."""
    seen, routes = [], []
    real_pass, real_route = getattr(ops, x_pass), ops._route_of

    def record():
        monkeypatch.setattr(ops, x_pass, lambda *a, **k: seen.append(k.get("dx_in") is not None) or real_pass(*a, **k))
        monkeypatch.setattr(ops, "_route_of", lambda t: routes.append(real_route(t)) or routes[-1])

    _compiled_matches_eager(block, 14, record)
    assert seen == [True]
    real = [r for r in routes if not isinstance(r, torch._subclasses.FakeTensor)]
    assert real and all(r.stride() == (0, 0, 0) and r.untyped_storage().nbytes() == r.element_size() for r in real)
    # CONFIG enter route off (the A/B): x itself is handed on, the x pass gets no dx_in, the gradients still match
    with config_changed("enter", route=False):
        _compiled_matches_eager(block, 14, seen.clear)
    assert seen == [False]


@pytest.mark.slow
def test_token_count_change_does_not_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(10)
    cnt = CompileCounterWithBackend("inductor" if CUDA else "aot_eager")
    torch._dynamo.reset()
    comp = torch.compile(_block_chain, fullgraph=True, backend=cnt)
    w = _leaf(torch.randn(24, device=DEV))
    for i, tokens in enumerate((37, 53, 64, 17)):
        x, phi, bias, alpha = _coef_inputs((tokens,), 24, 4, torch.float32)
        torch._dynamo.mark_dynamic(x, 0)  # the token dim, as a trainer marks batch / sequence
        out = comp(x, phi, bias, alpha, w)
        out.square().sum().backward()
        assert torch.isfinite(x.grad).all() and torch.isfinite(phi.grad).all()
        if i == 0:
            first = cnt.frame_count
    assert cnt.frame_count == first


@pytest.mark.skipif(not CUDA, reason="the Triton JIT cache exists only for compiled (non-interpreted) kernels")
def test_token_or_sinkhorn_count_change_does_not_rejit():
    """Neither a new token count nor a new Sinkhorn count (the scheduler's) compiles a kernel again; Triton would
    otherwise specialise an int argument equal to 1 or divisible by 16 (a ~1 s stall when a count hits 16)."""
    import importlib

    # the package re-exports functions named like its modules: fetch the modules themselves
    mods = [importlib.import_module(f"mhc_lightning.kernels.fused.{m}") for m in ("coefficients", "stream_pre", "stream_post_res")]
    kernels = {k: getattr(m, k) for m in mods for k in dir(m) if k.startswith(("_coef_", "_pre_", "_post_"))
               and hasattr(getattr(m, k), "run")}
    assert {"_coef_fwd", "_coef_bwd_tok", "_coef_bwd_x", "_pre_fwd", "_pre_bwd", "_post_fwd"} <= set(kernels)
    kernels = list(kernels.values())
    dev = torch.cuda.current_device()

    def n_compiled():
        return sum(len(k.device_caches[dev][0]) if hasattr(k, "device_caches") else len(k.cache[dev]) for k in kernels)

    w = torch.randn(64, device=DEV)
    for i, (lead, iters) in enumerate([((1000,), 3), ((1031,), 16), ((4096,), 1), ((777,), 32), ((512,), 44)]):
        x, phi, bias, alpha = _coef_inputs(lead, 64, 4, torch.bfloat16)
        for block in (_block, _block_pre, _block_chain):
            block(x, phi, bias, alpha, w, iters).float().square().sum().backward()
        if i == 0:
            first = n_compiled()
    assert n_compiled() == first


@pytest.mark.parametrize("mode", ["mhc", "identity", "hc", "residual"])
def test_model_training_step_kernels_equal_reference(mode):
    """One training step of the GPT with the fused kernels equals the same step on the reference ops (the residual
    GPT's fused op: RoPE)."""
    import torch.nn.functional as F

    from mhc_lightning.model import GPT, GPTConfig, HyperConfig

    def step(backend):
        torch.manual_seed(0)
        cfg = GPTConfig(n_layers=1, d_model=24, n_heads=2, context=16, hyper=HyperConfig(
            residual_mode=mode, sinkhorn_iters=ITERS, phi_init="normal", bias_init="hc_identity",
            kernel_backend=backend))
        model = GPT(cfg).to(DEV)
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, 256, (2, 17), generator=g).to(DEV)
        loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        return loss, {k: p.grad for k, p in model.named_parameters() if p.grad is not None}

    loss_k, grads_k = step("triton")
    loss_r, grads_r = step("torch")
    torch.testing.assert_close(loss_k, loss_r, rtol=1e-4, atol=1e-5)
    assert grads_k.keys() == grads_r.keys()
    for name in grads_r:
        check(grads_k[name], grads_r[name].double(), 2e-3, name)


@pytest.mark.parametrize("mode,chain", [("mhc", "auto"), ("mhc", False), ("hc", "auto")])
def test_model_hands_each_branch_its_input_without_a_cast(mode, chain):
    """Under bf16 autocast with a bf16 stream (the trainer's), every mHC / HC branch gets u in its parameters' fp32 from
    the op itself (`mhc_enter` one sublayer at a time, the boundary op in the chain, `hc_enter`): no cast node between
    them. The step
    equals the one with torch's cast each way (CONFIG "u" off): bitwise on the GPU; under the interpreter, which
    truncates the backward's fp32 -> bf16 rounding of du where torch rounds to nearest even, the loss bitwise and the
    gradients to 1 % (all together)."""
    import torch.nn.functional as F

    from mhc_lightning.model import GPT, GPTConfig, HyperConfig

    def step(inside):
        torch.manual_seed(0)
        cfg = GPTConfig(n_layers=2, d_model=32, n_heads=2, context=16, stream_dtype="bfloat16", hyper=HyperConfig(
            residual_mode=mode, sinkhorn_iters=ITERS, phi_init="normal", kernel_backend="triton",
            chain_sublayers=chain))
        model = GPT(cfg).to(DEV)
        seen = []

        def producer(t):  # the node that made the branch's input, past reshapes
            fn = t.grad_fn
            while type(fn).__name__ in ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"):
                fn = fn.next_functions[0][0]
            return type(fn).__name__

        for layer in model.sublayers:
            layer.branch.register_forward_pre_hook(lambda m, a: seen.append((a[0].dtype, producer(a[0]))))
        idx = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1)).to(DEV)
        with config_changed("u", branch_dtype=inside), torch.autocast(DEV, dtype=torch.bfloat16):
            logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
        return seen, loss, {k: p.grad for k, p in model.named_parameters()}

    seen, loss, grads = step(True)
    seen_cast, loss_cast, grads_cast = step(False)
    ours = ("eagerBackward", "HCEnterFoldedBackward")  # the fused ops' autograd nodes
    assert len(seen) == 4 and all(d == torch.float32 and fn.endswith(ours) for d, fn in seen), seen
    assert all(d == torch.float32 and fn == "ToCopyBackward0" for d, fn in seen_cast), seen_cast
    assert torch.equal(loss, loss_cast)
    assert grads.keys() == grads_cast.keys()
    if CUDA:
        for name, g in grads_cast.items():
            assert torch.equal(grads[name], g), name
    else:  # all gradients together: single sums over tokens (alpha's) can nearly cancel
        a, b = (torch.cat([gs[k].double().flatten() for k in sorted(gs)]) for gs in (grads, grads_cast))
        assert ((a - b).norm() / b.norm()).item() < 1e-2


def test_rebuilt_u_is_the_ops_u_bitwise(monkeypatch):
    """`rebuild_u` and the write-back's backward on request (`request_u`; HyperConfig.rebuild_branch_input) give the u
    each op handed its branch, bit for bit, in the stream's dtype and in the branch's fp32: u made by stream_pre's
    streaming kernel (phi in fp32, the trainer's), by the sum in `_coef_fwd`'s own loop (phi in bf16 at C <= 1024:
    HAS_U, checked taken), and HC's."""
    torch.manual_seed(93)
    lead, c = SHAPES[1]
    opts = MHCOptions(sinkhorn_iters=ITERS)
    in_gemm = []
    _on_launch(monkeypatch, ("_coef_fwd",), lambda name, kw: in_gemm.append(kw["HAS_U"]))
    bf16_phi = [("mhc_enter, bf16 phi", lambda i, d: fused.mhc_enter(*i, opts, d),
                 _coef_inputs(lead, c, 4, torch.bfloat16, phi_dtype=torch.bfloat16)),
                ("mhc_boundary, bf16 phi", lambda i, d: fused.mhc_boundary(*i, opts, d),
                 _boundary_inputs(lead, c, 4, torch.bfloat16, phi_dtype=torch.bfloat16))]
    for name, call, inputs in _u_ops() + bf16_phi:
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


@pytest.mark.parametrize("mode,chain,via", [("mhc", True, "write-back"), ("mhc", False, "write-back"),
                                            ("hc", "auto", "write-back"), ("identity", True, "write-back"),
                                            ("mhc", True, "rebuild_u")])
def test_model_rebuilds_the_branch_input_bitwise_and_keeps_less(mode, chain, via, monkeypatch):
    """HyperConfig.rebuild_branch_input under the trainer's bf16-mixed: the step (loss, every gradient) is bitwise the
    one that keeps u, and what autograd keeps between forward and backward is smaller by exactly one fp32 u per
    sublayer (C * 4 bytes per token): the branch's norm held u and nothing else did. u comes from the write-back's
    backward (`request_u`: no `rebuild_u` call, every request served), or without requests from `rebuild_u`."""
    import torch.nn.functional as F

    from mhc_lightning.model import GPT, GPTConfig, HyperConfig
    from mhc_lightning.model.recompute import live_activation_bytes

    rebuilt, real_rebuild = [], fused.rebuild_u
    monkeypatch.setattr(fused, "rebuild_u", lambda *a: rebuilt.append(1) or real_rebuild(*a))
    if via == "rebuild_u":
        monkeypatch.setattr(fused, "request_u", lambda *a: None)

    def step(rebuild):
        torch.manual_seed(0)
        cfg = GPTConfig(n_layers=2, d_model=32, n_heads=2, context=16, stream_dtype="bfloat16", hyper=HyperConfig(
            residual_mode=mode, sinkhorn_iters=ITERS, phi_init="normal", kernel_backend="triton",
            chain_sublayers=chain, rebuild_branch_input=rebuild))
        model = GPT(cfg).to(DEV)
        idx = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1)).to(DEV)
        with torch.autocast(DEV, dtype=torch.bfloat16):
            with live_activation_bytes(exclude=list(model.parameters()) + list(model.buffers())) as kept:
                logits = model(idx[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
        return loss, {k: p.grad for k, p in model.named_parameters()}, kept["bytes"]

    loss, grads, kept = step(True)
    assert len(rebuilt) == (4 if via == "rebuild_u" else 0) and len(ops._REQUESTS) == 0, (rebuilt, dict(ops._REQUESTS))
    loss_kept, grads_kept, kept_u = step(False)
    assert torch.equal(loss, loss_kept)
    for name, g in grads_kept.items():
        assert torch.equal(grads[name], g), name
    assert kept_u - kept == 4 * 32 * 4 * 16 * 2, (kept_u, kept)  # sublayers * C * fp32 * tokens


@pytest.mark.parametrize("mode", ["mhc", "identity", "hc", "residual"])
def test_model_step_under_bf16_autocast_matches_float64(mode):
    """A training step as the trainer runs it under bf16-mixed (autocast, bf16 stream) on the fused kernels, against
    the same step in float64 on the reference ops: the loss, and all gradients together (single parameters with a
    near-zero gradient are bf16 noise on both backends: 0.4-0.6 % for the whole vector, either backend)."""
    import torch.nn.functional as F

    from mhc_lightning.model import GPT, GPTConfig, HyperConfig

    def step(backend, dtype):
        torch.manual_seed(0)
        cfg = GPTConfig(n_layers=1, d_model=32, n_heads=2, context=16,
                        stream_dtype="bfloat16" if dtype == torch.bfloat16 else "auto", hyper=HyperConfig(
                            residual_mode=mode, sinkhorn_iters=ITERS, phi_init="normal", bias_init="hc_identity",
                            kernel_backend=backend))
        model = GPT(cfg).to(DEV)
        model = model.double() if dtype == torch.float64 else model
        idx = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1)).to(DEV)
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.double().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        grads = {k: p.grad.double() for k, p in model.named_parameters() if p.grad is not None}
        return loss, torch.cat([grads[k].flatten() for k in sorted(grads)])

    loss, grads = step("triton", torch.bfloat16)
    loss64, grads64 = step("torch", torch.float64)
    assert abs(loss.item() - loss64.item()) / loss64.item() < 1e-3
    assert grads.shape == grads64.shape and torch.isfinite(grads).all()
    assert ((grads - grads64).norm() / grads64.norm()).item() < 2e-2
