"""The fused ops under torch.compile (kernels/fused/custom_ops.py): fake impls, the eager path against the custom ops,
compiled against eager, the enter ops' routed gradient, and no recompile or re-JIT on a new token or Sinkhorn count.

On the CPU the compiled checks use aot_eager (graph capture, fake impls and autograd: what inductor would be handed);
with CUDA, inductor.
"""

import importlib
import traceback

import pytest
import torch
from helpers import fast_first
from kernel_checks import CUDA, DEV, coef_inputs, enter_block, leaf, poisoned_outputs

from mhc_lightning.kernels import MHCOptions, fused
from mhc_lightning.kernels.fused import projection
from mhc_lightning.kernels.fused.ops import (
    hc_coefficients,
    hc_enter,
    mhc_coefficients,
    mhc_enter,
    rms_proj,
    stream_post_res,
    stream_pre,
)

pytestmark = pytest.mark.usefixtures(poisoned_outputs.__name__)


def _block(x, phi, bias, alpha, w, iters=3):
    h_pre, h_post, h_res = fused.mhc_coefficients(x, phi, bias, alpha, MHCOptions(sinkhorn_iters=iters))
    u = fused.stream_pre(x, h_pre)
    f = torch.tanh(u * w)
    return fused.stream_post_res(x, f, h_post, h_res)


def _block_pre(x, phi, bias, alpha, w, iters=3):
    u, _, h_post, h_res = fused.mhc_pre(x, phi, bias, alpha, MHCOptions(sinkhorn_iters=iters))
    return fused.stream_post_res(x, torch.tanh(u * w), h_post, h_res)


def _block_enter(x, phi, bias, alpha, w, iters=3):
    return enter_block(fused, x, phi, bias, alpha, w, MHCOptions(sinkhorn_iters=iters))[0]


def _block_chain(x, phi, bias, alpha, w, iters=3):
    """Two sublayers sharing the parameters, chained through the boundary op (as run_sublayers does)."""
    opts = MHCOptions(sinkhorn_iters=iters)
    x, u, _, h_post, h_res = fused.mhc_enter(x, phi, bias, alpha, opts)
    x, u, _, h_post, h_res = fused.mhc_boundary(x, torch.tanh(u * w), h_post, h_res, phi, bias, alpha, opts)
    return fused.stream_post_res(x, torch.tanh(u * w), h_post, h_res)


def _hc_params(x, phi, bias, alpha, w):
    """HC's nine parameters cut from the test's leaves (phi's first rows as the projection weights), so that they all
    get gradients: strided views, as a model's would not be."""
    n, c = x.shape[-2], x.shape[-1]
    return (
        w + 1.0,
        phi[:c, 0],
        phi[:c, 1],
        phi[:c, 2 : 2 + n],
        alpha[0],
        alpha[1],
        bias[:n],
        bias[n : 2 * n],
        bias[2 * n : 2 * n + n * n].reshape(n, n),
    )


def _block_hc(x, phi, bias, alpha, w, iters=3):
    """An HC sublayer on the fused ops: hc_coefficients, then the stream ops."""
    h_pre, h_post, h_res = fused.hc_coefficients(x, *_hc_params(x, phi, bias, alpha, w))
    return fused.stream_post_res(x, torch.tanh(fused.stream_pre(x, h_pre) * w), h_post, h_res)


def _block_hc_enter(x, phi, bias, alpha, w, iters=3):
    """The same HC sublayer through hc_enter (as the model runs it)."""
    xt, u, _, h_post, h_res = fused.hc_enter(x, *_hc_params(x, phi, bias, alpha, w))
    return fused.stream_post_res(xt, torch.tanh(u * w), h_post, h_res)


def _block_hc_enter_folded(x, phi, bias, alpha, w, iters=3):
    """The same with contiguous parameters: eager makes HC's operands inside the op (`HCEnterFolded`), the compiled
    graph by the torch composition."""
    xt, u, _, h_post, h_res = fused.hc_enter(x, *[t.contiguous() for t in _hc_params(x, phi, bias, alpha, w)])
    return fused.stream_post_res(xt, torch.tanh(u * w), h_post, h_res)


def _compiled_matches_eager(block, seed, before_compile=lambda: None):
    """block's output and every input gradient under torch.compile(fullgraph) against eager; before_compile runs
    between the two (e.g. to start recording what the compiled run calls)."""
    torch.manual_seed(seed)
    backend = "inductor" if CUDA else "aot_eager"
    x, phi, bias, alpha = coef_inputs((2, 13), 24, 4, torch.float32)
    w = leaf(torch.randn(24, device=DEV))
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


@pytest.mark.slow
@fast_first(
    "block",
    [_block, _block_pre, _block_enter, _block_chain, _block_hc, _block_hc_enter, _block_hc_enter_folded],
    ids=["three_ops", "mhc_pre", "mhc_enter", "boundary", "hc", "hc_enter", "hc_enter_folded"],
)
def test_compile_fullgraph_matches_eager(block):
    _compiled_matches_eager(block, 9)


def test_fake_impls_give_the_real_outputs_strides():
    """Compiled graphs assert the fake impls' output strides: HC hands the stream ops a transposed H^res and a gate
    sliced out of a wider tensor; every output an op allocates itself is contiguous, in the fake impl too (a fake
    that copied H^res's strides failed inductor's stride assert on the GPU)."""
    torch.manual_seed(12)
    N, n, C = 5, 4, 16
    x, f, g = torch.randn(N, n, C, device=DEV), torch.randn(N, C, device=DEV), torch.randn(N, n, C, device=DEV)
    h_pre = torch.rand(N, n, 2, device=DEV)[..., 0]
    h_post = torch.rand(N, n, device=DEV)
    h_res = torch.rand(N, n, n, device=DEV).transpose(1, 2)
    assert not h_res.is_contiguous() and not h_pre.is_contiguous()
    for op, args in (
        (stream_post_res.post_fwd, (x, f, h_post, h_res)),
        (stream_post_res.post_bwd, (g, x, f, h_post, h_res)),
        (stream_pre.pre_fwd, (x, h_pre)),
        (stream_pre.pre_bwd, (f, x, h_pre)),
        (rms_proj.rms_proj_fwd, (x.reshape(N * n, C), torch.randn(C, n + 2, device=DEV).t().contiguous().t(), 1e-6)),
    ):
        torch.library.opcheck(op, args, test_utils=("test_faketensor",))
    # HC's one op, forward and backward (H^res transposed in, contiguous out)
    w, statics = torch.randn(C, n + 2, device=DEV), torch.randn(2 + 2 * n + n * n, device=DEV)
    outs = hc_coefficients.hc_coef_fwd(x.reshape(N * n, C), w, statics, n, 1e-6, True)
    assert all(t.is_contiguous() for t in outs)
    torch.library.opcheck(
        hc_coefficients.hc_coef_fwd, (x.reshape(N * n, C), w, statics, n, 1e-6, True), test_utils=("test_faketensor",)
    )
    grads = (torch.randn(N * n, device=DEV), torch.randn(N * n, device=DEV), h_res)
    torch.library.opcheck(
        hc_coefficients.hc_coef_bwd,
        (*grads, x.reshape(N * n, C), w, statics, outs[3], outs[4], n, True),
        test_utils=("test_faketensor",),
    )
    # hc_enter: u beside the same outputs; its backward with and without the write-back's dx
    outs = hc_enter.hc_enter_fwd(x, w, statics, 1e-6, True)
    assert all(t.is_contiguous() for t in outs)
    torch.library.opcheck(hc_enter.hc_enter_fwd, (x, w, statics, 1e-6, True), test_utils=("test_faketensor",))
    for dx_in in (None, g):
        torch.library.opcheck(
            hc_enter.hc_enter_bwd,
            (*grads, f, x, w, statics, outs[4], outs[5], outs[1], True),
            {"dx_in": dx_in},
            test_utils=("test_faketensor",),
        )
    # mHC's coefficient op and its backward
    phi, bias, alpha = torch.randn(n * C, 24, device=DEV) * 0.1, torch.randn(24, device=DEV), torch.rand(3, device=DEV)
    args = (x, phi, bias, alpha, 3, 1e-6, False, False, 1e-6, 1e-6, 2.0)
    outs = mhc_coefficients.coef_fwd(*args)
    torch.library.opcheck(mhc_coefficients.coef_fwd, args, test_utils=("test_faketensor",))
    torch.library.opcheck(
        mhc_coefficients.coef_bwd,
        (x, phi, bias, alpha, outs[3], outs[4], None, outs[1], outs[2], 3, 1e-6, False, False, 2.0),
        test_utils=("test_faketensor",),
    )


def test_eager_path_skips_the_dispatcher_and_compile_sees_the_custom_ops():
    """Eager calls run the op bodies under a plain autograd.Function (host time); graphs hold the custom ops."""
    torch.manual_seed(11)
    x, phi, bias, alpha = coef_inputs((2, 13), 24, 4, torch.float32)
    w = leaf(torch.randn(24, device=DEV))
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


def test_compiled_graphs_call_the_op_bodies_past_torch_librarys_wrappers(monkeypatch):
    """At run time a compiled graph's op call goes from the dispatcher straight to the op's body (no torch.library
    autograd or backend wrapper, no dynamo frame); a call that records a gradient, and the trace, take the custom
    op's own path, with the same values."""
    torch.manual_seed(13)
    N, n, C = 5, 4, 16
    x, f = leaf(torch.randn(N, n, C, device=DEV)), leaf(torch.randn(N, C, device=DEV))
    h_post, h_res = torch.rand(N, n, device=DEV), torch.rand(N, n, n, device=DEV)
    calls, real = [], stream_post_res.post_forward

    def spy(*a):
        calls.append({frame.name for frame in traceback.extract_stack()})
        return real(*a)

    monkeypatch.setattr(stream_post_res, "post_forward", spy)
    op = torch.ops.mhc_lightning.stream_post_res.default
    with torch.no_grad():
        direct = op(x, f, h_post, h_res)
    recorded = op(x, f, h_post, h_res)
    assert "backend_impl" not in calls[0] and "backend_impl" in calls[1] and recorded.grad_fn is not None
    torch.testing.assert_close(direct, recorded.detach(), atol=0, rtol=0)
    compiled = torch.compile(
        lambda x, f: fused.stream_post_res(x, f * 2, h_post, h_res), fullgraph=True, backend="aot_eager"
    )
    for _ in range(2):  # the first run still checks the graph under a dispatch mode
        del calls[:]
        out = compiled(x, f)
    assert len(calls) == 1 and not calls[0] & {"backend_impl", "wrapped_fn", "forward_no_grad"}
    out.sum().backward()
    torch.testing.assert_close(f.grad, 2 * (h_post.unsqueeze(-1) * torch.ones_like(x)).sum(1))


@pytest.mark.slow
@fast_first(
    "block,module,x_pass",
    [(_block_enter, projection, "x_pass"), (_block_hc_enter, hc_enter, "backward")],
    ids=["mhc_enter", "hc_enter"],
)
def test_compiled_write_back_hands_its_gradient_of_x_to_the_enter_op(block, module, x_pass, monkeypatch):
    """Under torch.compile an enter op cannot return x's alias: x' is `Routed` (x, a storage-less route), the
    write-back returns its gradient of x as the route's, and the enter op's x pass adds it (dx_in) into the one dx
    it writes, as eager's alias does, so the graph has no sum of the two gradients of x. Checked: the x pass got
    dx_in, the route has no storage of its own, and the gradients match eager's."""
    seen, routes = [], []
    real_pass, real_route = getattr(module, x_pass), mhc_enter.route_of

    def route_of(t):
        routes.append(real_route(t))
        return routes[-1]

    def record():
        monkeypatch.setattr(
            module, x_pass, lambda *a, **k: seen.append(k.get("dx_in") is not None) or real_pass(*a, **k)
        )
        monkeypatch.setattr(mhc_enter, "route_of", route_of)
        monkeypatch.setattr(hc_enter, "route_of", route_of)

    _compiled_matches_eager(block, 14, record)
    assert seen == [True]
    real = [r for r in routes if not isinstance(r, torch._subclasses.FakeTensor)]
    assert real and all(r.stride() == (0, 0, 0) and r.untyped_storage().nbytes() == r.element_size() for r in real)


@pytest.mark.slow
def test_token_count_change_does_not_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(10)
    cnt = CompileCounterWithBackend("inductor" if CUDA else "aot_eager")
    torch._dynamo.reset()
    comp = torch.compile(_block_chain, fullgraph=True, backend=cnt)
    w = leaf(torch.randn(24, device=DEV))
    for i, tokens in enumerate((37, 53, 64, 17)):
        x, phi, bias, alpha = coef_inputs((tokens,), 24, 4, torch.float32)
        torch._dynamo.mark_dynamic(x, 0)  # the token dim, as a trainer marks batch / sequence
        out = comp(x, phi, bias, alpha, w)
        out.square().sum().backward()
        assert torch.isfinite(x.grad).all() and torch.isfinite(phi.grad).all()
        if i == 0:
            first = cnt.frame_count
    assert cnt.frame_count == first


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="the Triton JIT cache exists only for compiled (non-interpreted) kernels")
def test_token_or_sinkhorn_count_change_does_not_rejit():
    """Neither a new token count nor a new Sinkhorn count (the scheduler's) compiles a kernel again; Triton would
    otherwise specialise an int argument equal to 1 or divisible by 16 (a ~1 s stall when a count hits 16)."""
    mods = [
        importlib.import_module(f"mhc_lightning.kernels.fused.{m}")
        for m in ("ops.mhc_coefficients", "projection", "ops.stream_pre", "sinkhorn", "ops.stream_post_res")
    ]
    kernels = {
        k: getattr(m, k)
        for m in mods
        for k in dir(m)
        if k.startswith(("_coef_", "_pre_", "_post_")) and hasattr(getattr(m, k), "run")
    }
    assert {"_coef_fwd", "_coef_bwd_tok", "_coef_bwd_x", "_pre_fwd", "_pre_bwd", "_post_fwd"} <= set(kernels)
    kernels = list(kernels.values())
    dev = torch.cuda.current_device()

    def n_compiled():
        return sum(len(k.device_caches[dev][0]) if hasattr(k, "device_caches") else len(k.cache[dev]) for k in kernels)

    w = torch.randn(64, device=DEV)
    for i, (lead, iters) in enumerate([((1000,), 3), ((1031,), 16), ((4096,), 1), ((777,), 32), ((512,), 44)]):
        x, phi, bias, alpha = coef_inputs(lead, 64, 4, torch.bfloat16)
        for block in (_block, _block_pre, _block_chain):
            block(x, phi, bias, alpha, w, iters).float().square().sum().backward()
        if i == 0:
            first = n_compiled()
    assert n_compiled() == first
