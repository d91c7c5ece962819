"""What the fused-kernel tests share (tests/test_kernels_*.py): the float64 check, inputs, launch-table changes and
launch records.

Without CUDA the kernels run under the Triton interpreter on small shapes (the variable must be set before triton
is first imported); with CUDA the same tests run at larger shapes. Every kernel output starts NaN-filled
(`poisoned_outputs`: host.POISON), so unwritten elements fail; a NaN never compares equal.
Tolerances follow docs/design.md §11 (Liger tiers): fp32 5e-4 / 1e-3 / 2e-3, bf16 1.5e-2 / 2.5e-2 / 5e-2, with atol
scaled by the reference's magnitude (reductions over tokens grow with N).
"""

import os
from contextlib import contextmanager

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from mhc_lightning.kernels import MHCOptions, fused  # noqa: E402
from mhc_lightning.kernels import reference as R  # noqa: E402
from mhc_lightning.kernels.fused import host, launch_config  # noqa: E402
from mhc_lightning.kernels.fused.launch_cache import Launcher  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
if not CUDA and not host.INTERPRET:  # imported earlier in this process without the interpreter
    raise RuntimeError("mhc_lightning.kernels.fused was imported before TRITON_INTERPRET=1 was set")

# (leading shape, C): token counts that are not multiples of any block, C not a power of two
SHAPES = [((37,), 24), ((2, 19), 40)] if not CUDA else [((4099,), 1000), ((2, 1031), 1024)]
TOL = {  # (h_pre / h_post / outputs, h_res, gradients)
    torch.float32: (5e-4, 1e-3, 2e-3),
    torch.bfloat16: (1.5e-2, 2.5e-2, 5e-2),
}
ITERS = 4 if not CUDA else 20  # interpreter time grows ~ iters^2 in the backward
needs_cuda = pytest.mark.skipif(not CUDA, reason="compiled kernels (CUDA): the interpreter has no launcher to call")


@pytest.fixture
def poisoned_outputs():
    """Every output a kernel writes starts as NaN (use with pytestmark = pytest.mark.usefixtures(...))."""
    host.POISON = True
    yield
    host.POISON = False


def check(out, ref, tol, name=""):
    assert out is not None and out.shape == ref.shape, (
        f"{name}: shape {None if out is None else out.shape} != {ref.shape}"
    )
    out = out.detach().double()
    assert torch.isfinite(out).all(), f"{name}: {(~torch.isfinite(out)).sum().item()} non-finite elements"
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(out, ref.detach(), atol=tol * scale, rtol=tol, msg=lambda m: f"{name}: {m}")


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def f64(ts):
    return [leaf(t.double()) for t in ts]


def upstream(ref, out):
    """A random upstream gradient for a fused output and its float64 reference: drawn for the reference, rounded
    through the fused output's dtype (as autograd hands it to the fused op), so both sides differentiate against the
    same values. Unrounded, a bf16 du alone moved dalpha (a sum over every token that can nearly cancel) by more than
    its tolerance at n = 8 on the GPU."""
    return None if ref is None or out is None else torch.randn_like(ref).to(out.dtype).to(ref.dtype)


def grads(outs, ins, gs):
    loss = sum((o * g.to(o.dtype)).sum() for o, g in zip(outs, gs) if o is not None and g is not None)
    return torch.autograd.grad(loss, ins)


def coef_inputs(lead, c, n, dtype, with_res=True, phi_dtype=torch.float32, gate=1.0):
    """x and the coefficient parameters phi, bias, alpha of one mHC sublayer (leaves)."""
    m = R.mhc_logit_count(n, with_res)
    x = torch.randn(*lead, n, c, device=DEV).to(dtype)
    phi = (torch.randn(n * c, m, device=DEV) / (n * c) ** 0.5).to(phi_dtype)
    bias = torch.randn(m, device=DEV)
    alpha = torch.tensor([0.8, 1.3, 1.7], device=DEV) * gate
    return [leaf(t) for t in (x, phi, bias, alpha)]


def boundary_inputs(lead, c, n, dtype, prev_res=True, next_res=True, phi_dtype=torch.float32):
    """Sublayer l's stream, branch output and write-back coefficients, and sublayer l+1's parameters."""
    x = leaf(torch.randn(*lead, n, c, device=DEV).to(dtype))
    f = leaf(torch.randn(*lead, c, device=DEV).to(dtype))
    h_post = leaf(2 * torch.rand(*lead, n, device=DEV))
    h_res = leaf(torch.rand(*lead, n, n, device=DEV)) if prev_res else None
    return [x, f, h_post, h_res] + coef_inputs(lead, c, n, dtype, with_res=next_res, phi_dtype=phi_dtype)[1:]


def hc_inputs(lead, c, n, dtype):
    """x and HC's nine parameters, all away from their (zero / one) inits so every term of the tail is exercised."""
    x = torch.randn(*lead, n, c, device=DEV).to(dtype)
    ps = [
        torch.rand(c, device=DEV) + 0.5,
        torch.randn(c, device=DEV) / c**0.5,
        torch.randn(c, device=DEV) / c**0.5,
        torch.randn(c, n, device=DEV) / c**0.5,
        torch.tensor(0.4, device=DEV),
        torch.tensor(0.9, device=DEV),
        torch.randn(n, device=DEV),
        torch.randn(n, device=DEV),
        torch.randn(n, n, device=DEV),
    ]
    return [leaf(t) for t in (x, *ps)]


HC_PARAM_GRADS = (
    "dx",
    "dnorm_weight",
    "dw_beta",
    "dw_m",
    "dw_r",
    "ds_alpha",
    "ds_beta",
    "db_static",
    "dam_static",
    "dar_static",
)


def run_pre(inputs, dtype, used=(True, True, True, True), **kw):
    """Fused mhc_pre vs the float64 reference composition: outputs and every input gradient, with upstream
    gradients on the outputs in `used` only (du = None exercises the coefficient-only backward)."""
    x, phi, bias, alpha = inputs
    out = fused.mhc_pre(x, phi, bias, alpha, MHCOptions(**kw))
    ref_in = f64(inputs)
    ref = R.mhc_pre(*ref_in, MHCOptions(**kw))
    gs = [upstream(r, o) if k else None for r, o, k in zip(ref, out, used)]
    g_out = grads(out, inputs, gs)
    g_ref = grads(ref, ref_in, gs)
    t_h, t_res, t_g = TOL[dtype]
    assert out[0].dtype == x.dtype
    for name, a, b, t in zip(("u", "h_pre", "h_post", "h_res"), out, ref, (t_h, t_h, t_h, t_res)):
        if b is None:
            assert a is None
        else:
            check(a, b, t, name)
    for name, a, b in zip(("dx", "dphi", "dbias", "dalpha"), g_out, g_ref):
        check(a, b, t_g, name)


def run_boundary(inputs, dtype, used=(True,) * 5, **kw):
    """Fused mhc_boundary vs the float64 reference composition: the five outputs and the gradient of every input,
    with upstream gradients on the outputs in `used` only (None elsewhere, as autograd passes them)."""
    out = fused.mhc_boundary(*inputs, MHCOptions(**kw))
    ref_in = [None if t is None else leaf(t.double()) for t in inputs]
    ref = R.mhc_boundary(*ref_in, MHCOptions(**kw))
    gs = [upstream(r, o) if k else None for r, o, k in zip(ref, out, used)]
    leaves = [t for t in inputs if t is not None]
    g_out = grads(out, leaves, gs)
    g_ref = grads(ref, [t for t in ref_in if t is not None], gs)
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


def enter_block(ops, x, phi, bias, alpha, w, opts):
    """One sublayer as the model runs it: mhc_enter, a branch, the write-back reading the stream mhc_enter handed on."""
    xt, u, _, h_post, h_res = ops.mhc_enter(x, phi, bias, alpha, opts)
    return ops.stream_post_res(xt, torch.tanh(u * w.to(u.dtype)).to(u.dtype), h_post, h_res), xt


def hc_block(ops, x, *params, use_tanh=True):
    """One HC sublayer as the model runs it: hc_enter, a branch on u, the write-back reading the stream it handed on."""
    xt, u, _, h_post, h_res = ops.hc_enter(x, *params, use_tanh=use_tanh)
    return ops.stream_post_res(xt, torch.tanh(u), h_post, h_res), xt


def producer(t: torch.Tensor):
    """The autograd node of the op that made t, under any view the wrappers put on it (x' comes out of the enter op
    as the alias of its input: its own node for a flat [N, n, C] stream, under a view of x's shape otherwise)."""
    node = t.grad_fn
    while type(node).__name__.startswith(("View", "Reshape", "UnsafeView")):
        node = node.next_functions[0][0]
    return node


def consumers(out, x) -> int:
    """Autograd nodes in out's graph that take a gradient of the leaf x directly: with more than one, autograd sums
    stream-sized gradients before x gets its own."""
    seen, stack, count = set(), [out.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is not None and getattr(nxt, "variable", None) is x:
                count += 1
            stack.append(nxt)
    return count


@contextmanager
def config_changed(name, **changes):
    """Changed launch-table entries of one kernel (launch_config.CONFIG) within the block, restored afterwards."""
    saved = dict(launch_config.CONFIG[name])
    launch_config.CONFIG[name] = dict(saved, **changes)
    try:
        yield
    finally:
        launch_config.CONFIG[name] = saved


def on_launch(monkeypatch, names, record):
    """Each launch of a kernel in names (by its Triton function's name) calls record(name, kwargs and grid=grid) and
    then launches for real."""
    real = Launcher.launch

    def launch(self, grid, args, kwargs):
        name = self.fn.__name__
        if name in names:
            record(name, dict(kwargs, grid=grid))
        return real(self, grid, args, kwargs)

    monkeypatch.setattr(Launcher, "launch", launch)


def check_u_in_the_branchs_dtype(name, call, inputs, monkeypatch):
    """u_dtype fp32 on a bf16 stream (the trainer's branch input): the op writes u in fp32 itself and its backward's
    per-row pass rounds the fp32 du back for the x pass, where a torch cast after the op did both (`fused._u_written`
    None: the op writes u in the stream's dtype and `in_dtype` casts). Outputs and every input's gradient are bitwise
    those of the cast, with an fp32 upstream gradient of u that bf16 cannot hold on the GPU (the interpreter truncates
    fp32 -> bf16 where GPUs and torch round to nearest even, so there du is drawn on bf16's grid: the wide path without
    the rounding); checked that the op wrote the fp32 u (no cast node) and that the per-row pass narrowed du."""
    narrowed = []
    on_launch(monkeypatch, ("_coef_bwd_tok", "_hc_tail_bwd"), lambda _, kw: narrowed.append(kw.get("DU_NARROW", False)))
    written = fused._u_written
    runs = {}
    for inside in (True, False):
        narrowed.clear()
        monkeypatch.setattr(fused, "_u_written", written if inside else lambda x, u_dtype: None)
        leaves = [None if t is None else leaf(t) for t in inputs]
        out = call(leaves, torch.float32)
        u = out[0] if name == "mhc_pre" else out[1]
        assert u.dtype == torch.float32
        assert (type(u.grad_fn).__name__ == "ToCopyBackward0") != inside, (name, inside, u.grad_fn)
        torch.manual_seed(5)
        gs = [None if o is None else torch.randn(o.shape, device=DEV, dtype=torch.float32) for o in out]
        gs = gs if CUDA else [None if g is None else g.bfloat16().float() for g in gs]
        runs[inside] = (out, grads(out, [t for t in leaves if t is not None], gs))
        assert narrowed == [inside], (name, inside, narrowed)
    monkeypatch.setattr(fused, "_u_written", written)
    for a, b in zip(*(runs[True][0], runs[False][0])):
        assert (a is None and b is None) or torch.equal(a, b), name
    for a, b in zip(runs[True][1], runs[False][1]):
        assert torch.equal(a, b), name
