"""How the fused ops meet autograd and torch.compile (docs/kernels.md, "Eager path and compiled path").

Each op body is registered as a `torch.library` custom op: what a compiled graph sees, opaque, with a fake impl whose
shapes are symbolic in the token count. Called eagerly, a custom op costs tens of microseconds of host time per call
(dispatcher, argument defaults, a dynamo-disable frame, the autograd wrapper), and an eager step calls a few per
sublayer; so outside torch.compile the same body runs under one plain `autograd.Function` with the same setup and
backward functions (`eager_op`). A compiled graph at run time reaches each body through the dispatcher and the op's
own autograd kernel, past torch.library's wrappers (`run_body_directly`). `Routed` is the x an enter op hands its
write-back under torch.compile.
"""
from typing import NamedTuple

import torch

Tensor = torch.Tensor
OPS: dict = {}  # every fused custom op by name (python -m bench host --ops times each against its body)
# False: every call takes torch.library's own path (`run_body_directly`); python -m bench host times both
DIRECT = True


def custom_op(name: str, body):
    """body registered as the custom op mhc_lightning::name; `op.plain` keeps the body for the eager path."""
    op = torch.library.custom_op(f"mhc_lightning::{name}", body, mutates_args=())
    op.plain = body
    run_body_directly(op, body)
    OPS[name] = op
    return op


def _any_requires_grad(*args) -> bool:
    return any(isinstance(a, Tensor) and a.requires_grad for a in args)


def run_body_directly(op, body) -> None:
    """A compiled graph calls each op through the dispatcher: the custom op's autograd kernel, its redispatch, the
    backend wrapper (aliasing checks, a dynamo-disable frame), then the body: tens of microseconds of host time per
    call over the body's own (`python -m bench host --ops`). Where none of it can act (no gradient to record, no
    tensor subclass, dispatch mode or functionalization on the call: the compiled graph at run time), the op's
    autograd kernel for CPU and CUDA runs the body itself; every other call (tracing, fake tensors, calls that record
    a gradient) takes the custom op's own autograd kernel, as before. Torch versions without that kernel's factory
    keep the custom op's path throughout."""
    make = getattr(getattr(torch._library, "autograd", None), "make_autograd_impl", None)
    if make is None:  # pragma: no cover - torch without torch._library.autograd.make_autograd_impl
        return
    own = make(op._opoverload, op)  # reads the op's autograd registration at call time
    grad_enabled, requires_grad = torch.is_grad_enabled, getattr(torch._C, "_any_requires_grad", _any_requires_grad)
    # keys on which a call cannot go straight to the body: tensor subclasses and dispatch modes (fake tensors,
    # tracing), functionalization
    keys = torch._C.DispatchKey
    python, snapshot, functionalize = keys.Python, keys.PythonTLSSnapshot, keys.Functionalize

    def autograd_kernel(keyset, *args, **kwargs):
        if (not DIRECT or keyset.has(python) or keyset.has(snapshot) or keyset.has(functionalize)
                or (grad_enabled() and requires_grad(*args))):
            return own(keyset, *args, **kwargs)
        return body(*args, **kwargs)

    for key in ("AutogradCPU", "AutogradCUDA"):  # more specific than the custom op's kernel for all of Autograd
        op._lib.impl(op._name, autograd_kernel, key, with_keyset=True)


def body_of(ctx, op):
    """In a backward: the backward's custom op where autograd recorded the forward's custom op (compiled graphs), its
    body where the eager path recorded it."""
    return op.plain if getattr(ctx, "eager", False) else op


class Routed(NamedTuple):
    """x as `mhc_enter` / `hc_enter` hand it to the sublayer's write-back under torch.compile, where an op may not
    return an alias of its input: x itself, and `route`, an output of the enter op with x's shape and no storage
    (one broadcast element). The write-back reads x and returns its gradient of x as route's, so that it reaches
    the enter op's backward, whose x pass adds it into the one dx it writes (`ACC`, as eager's alias does) instead
    of inductor summing two stream-sized gradients (docs/kernels.md, "How the model calls them")."""
    x: Tensor
    route: Tensor


def route_of(x: Tensor) -> Tensor:
    return x.new_empty((1, 1, 1)).expand(x.shape)


def register_routed(op, setup, backward) -> None:
    """Autograd of a routed enter op (its outputs: the plain op's, then the route): the plain op's setup and backward,
    the route's gradient given to the backward as the write-back's gradient of x (contiguous for the x pass; a zero
    gradient materialised for the storage-less route would not be)."""
    def routed_backward(ctx, *grads):
        *grads, d_route = grads
        return backward(ctx, *grads, dx_next=None if d_route is None else d_route.contiguous())

    op.register_autograd(routed_backward, setup_context=lambda ctx, inputs, output: setup(ctx, inputs, output[:-1]))


class CoefScalars(NamedTuple):
    """`MHCOptions` as the coefficient ops' schemas take it, in their order: a custom op takes no dataclass."""
    iters: int
    eps: float
    t_in: bool
    t_out: bool
    rms_eps: float
    pre_eps: float
    post_mult: float


def coef_scalars(opts) -> CoefScalars:
    """opts flattened into the coefficient ops' scalars. The kernels run the rows-exact K(w) on w = R^T or R and
    transpose the result for "cols" (t_in, t_out; docs/design.md §3)."""
    cols = opts.exact_axis == "cols"
    return CoefScalars(iters=int(opts.sinkhorn_iters), eps=float(opts.sinkhorn_eps),
                       t_in=(opts.res_layout == "src_dst") != cols, t_out=cols, rms_eps=float(opts.rms_eps),
                       pre_eps=float(opts.pre_eps), post_mult=float(opts.post_mult))


def with_options(call, at: int):
    """call as the public wrappers take it: `MHCOptions` whole at argument `at`, flattened here, at the custom-op
    boundary and nowhere else, into the schema's scalars."""
    def call_with_options(*args):
        return call(*args[:at], *coef_scalars(args[at]), *args[at + 1:])

    return call_with_options


def eager_op(op, setup, backward, routed=None):
    """op as the public wrappers call it: outside torch.compile its body under a plain autograd.Function (the same
    setup and backward), under compile (or on fake / traced tensors) the custom op itself.

    routed (the enter ops): the Function also returns its first input x, as its first output (an alias autograd
    tracks), and backward receives that output's gradient first; under compile the op `routed` (op's outputs and a
    route) runs instead, and the first output is the `Routed` pair of x and its route."""
    through = routed is not None

    def forward(ctx, *args):
        out = op.plain(*args)
        ctx.eager = True
        ctx.set_materialize_grads(False)  # unused outputs' grads arrive as None, as with the custom op
        setup(ctx, args, out)
        return (args[0], *out) if through else out

    # named at creation: autograd names the backward node after the class (e.g. post_fwd_eagerBackward)
    name = op.plain.__name__.replace("_body", "").strip("_") + ("_through" if through else "") + "_eager"
    Fn = type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(backward)})
    # Function.apply is a Python wrapper around autograd's C++ apply: it binds default arguments (only for Functions
    # with a setup_context; this one has none), checks for functorch transforms, and unwraps dead functorch wrappers
    # by a generator over every argument, about half its host time. The same steps here, on the tensor arguments
    # only; under a functorch transform the wrapper runs, so torch's error for a Function without setup_context still
    # stops it.
    c_apply = super(torch.autograd.Function, Fn).apply
    unwrap_if_dead = torch._C._functorch.unwrap_if_dead

    def call(*args):
        if torch.compiler.is_compiling() or type(args[0]) is not Tensor:
            if not through:
                return op(*args)
            *out, route = routed(*args)
            return (Routed(args[0], route), *out)
        if torch._C._are_functorch_transforms_active():
            return Fn.apply(*args)
        return c_apply(*[unwrap_if_dead(a) if type(a) is Tensor else a for a in args])

    return call
