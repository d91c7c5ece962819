"""kernels/fused/launch_cache.py: launches that skip Triton's per-call path once a call's key is kept.

The key is checked on the CPU; the launches themselves need compiled kernels (CUDA): there the fast path must give
bit-identical outputs to Triton's own, keep one kernel per key, hand a misaligned tensor its own key, and step
aside while a launch hook is installed.
"""

import importlib

import pytest
import torch
from kernel_checks import CUDA, DEV, ITERS, coef_inputs, hc_inputs, needs_cuda

from mhc_lightning.kernels import MHCOptions, fused
from mhc_lightning.kernels import reference as R
from mhc_lightning.kernels.fused import launch_cache, projection
from mhc_lightning.kernels.fused.launch_cache import Launcher, call_key, launcher
from mhc_lightning.kernels.fused.ops import mhc_coefficients, stream_post_res, stream_pre

MODULES = [
    importlib.import_module(f"mhc_lightning.kernels.fused.{m}")
    for m in (
        "hc_operands",
        "ops.hc_coefficients",
        "ops.mhc_coefficients",
        "ops.rope_qkv",
        "ops.stream_post_res",
        "ops.stream_pre",
        "partial_sums",
        "projection",
        "sinkhorn",
        "stream_rows",
    )
]
KERNELS = {
    "_coef_bwd_tok",
    "_coef_bwd_x",
    "_coef_fwd",
    "_coef_tail",
    "_expand",
    "_hc_fwd",
    "_hc_operand_grads",
    "_hc_operands",
    "_hc_tail_bwd",
    "_param_grad_sum",
    "_post_bwd_2d",
    "_post_fwd",
    "_pre_bwd",
    "_pre_fwd",
    "_rope_bwd",
    "_rope_fwd",
    "_sum_streams",
}


def test_every_kernel_is_launched_through_its_launcher(monkeypatch):
    """The fused ops launch each Triton kernel of kernels/fused/ through its one Launcher (`launch_cache.launcher`):
    an mHC chain, an HC sublayer, RoPE and the stream's ends, forward and backward, launch all the kernels, none of
    them bare (`kernel[grid]` outside `Launcher.launch`)."""
    kernels = {name: v for m in MODULES for name, v in vars(m).items() if name in KERNELS}
    assert set(kernels) == KERNELS
    through, bare = [], []
    real_launch, kernel_type = Launcher.launch, type(kernels["_pre_fwd"])
    real_getitem = kernel_type.__getitem__

    def launch(self, grid, args, kwargs):
        through.append(self.fn.__name__)
        try:
            return real_launch(self, grid, args, kwargs)
        finally:
            through.append(None)

    def getitem(self, grid):
        if not through or through[-1] != self.__name__:
            bare.append(self.__name__)
        return real_getitem(self, grid)

    monkeypatch.setattr(Launcher, "launch", launch)
    monkeypatch.setattr(kernel_type, "__getitem__", getitem)
    torch.manual_seed(3)
    opts = MHCOptions(sinkhorn_iters=ITERS)
    x, phi, bias, alpha = coef_inputs((9,), 16, 4, torch.bfloat16, phi_dtype=torch.bfloat16)  # Sinkhorn's own launch
    x0 = fused.expand_streams(x.sum(1), 4, torch.bfloat16)
    xt, u, _, h_post, h_res = fused.mhc_enter(x0, phi, bias, alpha, opts)
    xb, u, _, h_post, h_res = fused.mhc_boundary(xt, torch.tanh(u), h_post, h_res, phi, bias, alpha, opts)
    out = fused.stream_post_res(
        xb, torch.tanh(fused.stream_pre(xb, h_pre=fused.mhc_pre(xb, phi, bias, alpha, opts)[1])), h_post, h_res
    )
    hx, *params = hc_inputs((9,), 16, 4, torch.bfloat16)
    hxt, hu, _, hh_post, hh_res = fused.hc_enter(hx, *params)
    hout = fused.stream_post_res(hxt, torch.tanh(hu), hh_post, hh_res)
    cos, sin = (t.to(DEV) for t in R.rope_tables(9, 16, 10000.0))  # the kernel runs only with both on its device
    q, k, v = fused.rope_qkv(torch.randn(1, 9, 3 * 2 * 16, device=DEV, requires_grad=True), cos, sin, 2)
    loss = fused.sum_streams(out, torch.float32).sum() + hout.float().sum() + (q * k).sum() + v.sum()
    loss = loss + fused.rms_proj(hx, params[3]).sum()
    loss.backward()
    assert not bare, bare
    assert {name for name in through if name} == KERNELS
    for name, kernel in kernels.items():
        assert launcher(kernel).fn is kernel and launcher(kernel) is launcher(kernel), name
        assert launcher(kernel).fast is CUDA  # the interpreter always takes Triton's path


def test_keyword_launches_reach_the_kernel_in_its_order():
    """The ops launch by name; the launcher hands Triton's path, the key and the fast path the runtime arguments in
    the kernel's order, and keeps constexprs and launch options as keywords."""
    x, h, u = (torch.empty(1) for _ in range(3))
    passed = dict(NS=4, u_ptr=u, x_ptr=x, N=5, h_ptr=h, C=6, stride_xn=7, stride_xt=8, BT=16, BC=32, num_warps=4)
    args, kwargs = launcher(stream_pre._pre_fwd).positional((), passed)
    assert args == (x, h, u, 5, 6, 8, 7) and kwargs == dict(NS=4, BT=16, BC=32, num_warps=4)


def test_call_key_tells_apart_what_triton_specialises_on():
    x = torch.randn(8, 64, device=DEV, dtype=torch.bfloat16)
    base = call_key(0, (x, 7, 1024, 1e-6, None), dict(BT=4, num_warps=4))
    assert call_key(0, (torch.randn_like(x), 7, 1024, 1e-6, None), dict(BT=4, num_warps=4)) == base  # another tensor
    others = [
        call_key(1, (x, 7, 1024, 1e-6, None), dict(BT=4, num_warps=4)),  # device
        call_key(0, (x.float(), 7, 1024, 1e-6, None), dict(BT=4, num_warps=4)),  # dtype
        call_key(0, (x.view(-1)[2:], 7, 1024, 1e-6, None), dict(BT=4, num_warps=4)),  # 4-byte offset: not 16-aligned
        call_key(0, (x, 8, 1024, 1e-6, None), dict(BT=4, num_warps=4)),  # an int (the token count) by value
        call_key(0, (x, 7, 1024, 1e-5, None), dict(BT=4, num_warps=4)),  # a float by value
        call_key(0, (x, 7, 1024, 1e-6, x), dict(BT=4, num_warps=4)),  # None against a tensor
        call_key(0, (x, 7, 1024, 1e-6, None), dict(BT=8, num_warps=4)),  # a constexpr
        call_key(0, (x, 7, 1024, 1e-6, None), dict(num_warps=4, BT=4)),  # keywords by name, not by place
        call_key(0, (x, 7, 1024, 1e-6, None), dict(BT=4, num_warps=4, num_stages=2)),  # a launch option
    ]
    assert all(k != base for k in others) and len(set(others)) == len(others)
    assert (x.view(-1)[8:].data_ptr() & 15) == 0 and call_key(0, (x.view(-1)[8:],), {}) == call_key(0, (x,), {})


def test_call_key_keeps_tma_descriptors_by_dtype_and_block():
    """A TMA descriptor argument (the x pass's tiles, projection.x_pass) is kept by its dtype and block shape, what
    Triton specialises it on: another tensor or token count of the same kind takes the kept launch (the launcher encodes
    each call's descriptor); another block or dtype does not."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(t, block=(64, 64)):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))

    x = torch.randn(128, 256, device=DEV, dtype=torch.bfloat16)
    base = call_key(0, (desc(x), 128), dict(BT=64))
    assert call_key(0, (desc(torch.randn(96, 256, device=DEV, dtype=torch.bfloat16)), 128), dict(BT=64)) == base
    others = [
        call_key(0, (desc(x, (32, 64)), 128), dict(BT=64)),
        call_key(0, (desc(x.float()), 128), dict(BT=64)),
        call_key(0, (x, 128), dict(BT=64)),
    ]
    assert all(k != base for k in others) and len(set(others)) == len(others)


def test_descriptors_after_the_first_of_a_block_skip_only_tritons_checks():
    """launch_cache.descriptor: the same TensorDescriptor as Triton's constructor (every field, the base by identity);
    Triton's checks run for the first descriptor of a block shape and dtype (a block Triton refuses fails there)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block = [16, 32]  # a block no other test uses: its first descriptor here is the checked one
    launch_cache._checked_blocks.discard((tuple(block), torch.bfloat16))
    for rows in (64, 48, 16):  # the first descriptor checked, the others built directly
        x = torch.randn(rows, 4, 256, device=DEV, dtype=torch.bfloat16)
        d = launch_cache.descriptor(x, [rows, 1024], [1024, 1], block)
        ref = TensorDescriptor(x, [rows, 1024], [1024, 1], block)
        assert type(d) is TensorDescriptor and d.base is x
        assert {k: v for k, v in vars(d).items() if k != "base"} == {k: v for k, v in vars(ref).items() if k != "base"}
        assert projection.rows_descriptor(x, tuple(block)).shape == [rows, 1024]  # the x pass's own route to it
    with pytest.raises(
        (AssertionError, ValueError)
    ):  # not a power of two: Triton's check, on the block's first descriptor
        launch_cache.descriptor(x, [16, 1024], [1024, 1], [16, 24])


def _post_fwd_inputs(tokens: int, c: int = 1024, n: int = 4, offset: int = 0):
    x = torch.randn(tokens * n * c + offset, device=DEV, dtype=torch.bfloat16)[offset:].view(tokens, n, c)
    f = torch.randn(tokens, c, device=DEV, dtype=torch.bfloat16)
    return x, f, torch.rand(tokens, n, device=DEV), torch.rand(tokens, n, n, device=DEV)


def _both_paths(monkeypatch, fn, *args):
    """fn(*args) through Triton's path (as while a launch hook is installed), then through the launcher's (twice: the
    first keeps, the second hits)."""
    with monkeypatch.context() as m:
        m.setattr(launch_cache, "_hooked", lambda: True)
        ref = fn(*args)
    fn(*args)
    return ref, fn(*args)


@pytest.mark.gpu
@needs_cuda
def test_fast_launches_equal_tritons_and_keep_one_kernel_per_key(monkeypatch):
    kept = launcher(stream_post_res._post_fwd)
    kept.kept.clear()
    misses = Launcher.misses
    compiled = lambda: len(kept.fn.device_caches[torch.cuda.current_device()][0])  # noqa: E731
    first = None
    for tokens in (1000, 1000, 1031, 4096):
        ref, out = _both_paths(monkeypatch, stream_post_res.post_forward, *_post_fwd_inputs(tokens))
        assert torch.equal(ref, out)
        first = compiled() if first is None else first
    assert len(kept.kept) == 3  # one per token count: the repeated call hit
    assert Launcher.misses - misses == 3  # the three new keys, not the hit
    assert compiled() == first  # N is a runtime argument: Triton compiled nothing more
    # a stream at a 2-element offset (not 16-byte aligned) gets its own key, and Triton its own specialisation
    ref, out = _both_paths(monkeypatch, stream_post_res.post_forward, *_post_fwd_inputs(1000, offset=2))
    assert torch.equal(ref, out) and len(kept.kept) == 4


@pytest.mark.gpu
@needs_cuda
def test_the_coefficient_op_through_the_launcher_equals_tritons_path(monkeypatch):
    """The launch with the most arguments (the GEMM + Sinkhorn kernel on phi's pairs, u's streaming pass)."""
    x = torch.randn(777, 4, 1024, device=DEV, dtype=torch.bfloat16)
    phi = torch.randn(4 * 1024, 24, device=DEV) * 0.02
    bias, alpha = torch.randn(24, device=DEV), torch.full((3,), 0.5, device=DEV)
    ref, out = _both_paths(
        monkeypatch, mhc_coefficients.forward, x, phi, bias, alpha, 20, 1e-6, False, False, 1e-6, 0.0, 2.0, True
    )
    assert all(torch.equal(a, b) for a, b in zip(ref, out))
    assert len(launcher(mhc_coefficients._coef_fwd).kept) >= 1


@pytest.mark.gpu
@needs_cuda
def test_a_launch_hook_sends_every_launch_through_triton():
    """Triton's profiler hooks launches; with a hook installed the launcher must not bypass it."""
    from triton import knobs

    seen = []
    hook = seen.append
    inputs = _post_fwd_inputs(64)
    stream_post_res.post_forward(*inputs)  # kept
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        stream_post_res.post_forward(*inputs)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1
    stream_post_res.post_forward(*inputs)
    assert len(seen) == 1


def test_eager_ops_enter_autograd_by_its_c_apply(monkeypatch):
    """The eager mHC sublayer (enter op, then the write-back) enters autograd by its C++ apply, without
    Function.apply's Python wrapper; while a functorch transform is active the wrapper runs, and its error (these
    Functions have no setup_context) still reaches the user."""
    from torch.autograd import Function

    calls = []
    plain = Function.__dict__["apply"]  # a classmethod, or a C descriptor in newer torch: both bind by __get__
    monkeypatch.setattr(
        Function,
        "apply",
        classmethod(lambda cls, *a, **k: calls.append(cls.__name__) or plain.__get__(None, cls)(*a, **k)),
    )
    torch.manual_seed(7)
    n, c = 4, 32
    x = torch.randn(6, n, c, device=DEV, requires_grad=True)
    phi = (0.1 * torch.randn(n * c, n * n + 2 * n, device=DEV)).requires_grad_()
    bias = torch.randn(n * n + 2 * n, device=DEV, requires_grad=True)
    alpha = torch.rand(3, device=DEV, requires_grad=True)
    f_w = torch.randn(c, c, device=DEV) / c**0.5

    def sublayer():
        xt, u, h_pre, h_post, h_res = fused.mhc_enter(x, phi, bias, alpha)
        out = fused.stream_post_res(xt, torch.tanh(u @ f_w), h_post, h_res)
        g = torch.randn_like(out, generator=torch.Generator(DEV).manual_seed(3))
        return [out, *torch.autograd.grad(out, (x, phi, bias, alpha), g)]

    sublayer()
    assert not [name for name in calls if name.endswith("_eager")], calls  # the wrapper was not entered
    monkeypatch.setattr(torch._C, "_are_functorch_transforms_active", lambda: True)
    with pytest.raises(RuntimeError, match="functorch transforms"):  # torch's own line
        sublayer()
    assert calls == ["mhc_pre_fwd_through_eager"]
