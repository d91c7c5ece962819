"""Fused Triton mHC ops with the reference signatures and return conventions (see kernels/__init__.py): the public
wrappers, which flatten [..., n, C] to the ops' [N, n, C] and send what the kernels do not cover to the reference.

What the kernels cover: n in {1, 2, 4, 8}; x in bf16 / fp16 / fp32 on CUDA (or anywhere under
TRITON_INTERPRET=1); Sinkhorn start "softmax_eps" with either exact axis and either res layout; any
iteration count (a runtime argument). Everything else (float64, start "exp" / "log_domain", other n,
broadcast coefficient shapes) goes to the reference ops, which define the semantics.

Each op lives in kernels/fused/ops/<op>.py, named as the function here that calls it: its Triton kernels beside their
custom-op registration, fake impls and autograd glue (docs/kernels.md, "Where things are").
"""
from typing import Optional

import torch

from .. import reference
from ..options import DEFAULT_OPTIONS, EXACT_AXES, RES_LAYOUTS, MHCOptions
from ..reference import in_dtype
from ..reference.coefficients import mhc_logit_count
from . import hc_operands, ops
from .custom_ops import Routed
from .host import INTERPRET

__all__ = ["expand_streams", "hc_coefficients", "hc_enter", "mhc_coefficients", "mhc_pre", "mhc_enter", "mhc_boundary",
           "rebuild_u", "request_u", "rms_proj", "rope_qkv", "stream_pre", "stream_post_res", "sum_streams"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fusable(x: torch.Tensor) -> bool:
    return (
        x.dim() >= 2
        and x.shape[-2] in (1, 2, 4, 8)
        and x.dtype in _DTYPES
        and (x.is_cuda or INTERPRET)
    )


def _coefs_fusable(x, phi, bias, alpha, opts: MHCOptions) -> bool:
    """Whether the coefficient kernels cover these inputs and options (they take opts whole, flattened only at the
    custom-op boundary: custom_ops.with_options)."""
    n, c = x.shape[-2], x.shape[-1]
    m = phi.shape[-1] if phi.dim() == 2 else -1
    return (
        _fusable(x)
        and opts.start == "softmax_eps"
        and opts.exact_axis in EXACT_AXES
        and opts.res_layout in RES_LAYOUTS
        and opts.sinkhorn_iters >= 1
        and phi.dim() == 2
        and phi.shape[0] == n * c
        and m in (mhc_logit_count(n, True), mhc_logit_count(n, False))
        and tuple(bias.shape) == (m,)
        and alpha.numel() == 3
        and phi.device == x.device
    )


def _flat(x: torch.Tensor) -> torch.Tensor:
    """x [..., n, C] as the ops' [N, n, C] (itself when already flat: a reshape costs host time, docs/kernels.md)."""
    return x if x.dim() == 3 else x.reshape(-1, *x.shape[-2:])


def _vec3(alpha: torch.Tensor) -> torch.Tensor:
    """The three gates as the kernels take them, [3] (the model's parameter already is)."""
    return alpha if alpha.dim() == 1 else alpha.reshape(3)


def _u_written(x: torch.Tensor, u_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype the op itself writes u in: u_dtype (the branch's) in eager mode, where the kernels round u to x's dtype
    and store it wider, which spares torch's cast each way; else None (x's dtype, and `in_dtype` casts after the op:
    under torch.compile inductor fuses that cast into the branch's norm, where a wide u would cost a write and a
    read)."""
    if u_dtype is None or u_dtype == x.dtype or u_dtype not in _DTYPES or torch.compiler.is_compiling():
        return None
    return u_dtype


def _coefs_out(phi, lead, n, h_pre, h_post, h_res):
    if phi.shape[-1] == mhc_logit_count(n, False):
        h_res = None  # identity-HC: H^res = I
    if len(lead) != 1:  # the ops' outputs are [N, ...]: flat inputs keep them as they are
        h_pre, h_post = h_pre.reshape(*lead, n), h_post.reshape(*lead, n)
        h_res = None if h_res is None else h_res.reshape(*lead, n, n)
    return h_pre, h_post, h_res


def mhc_coefficients(
    x: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, opts: MHCOptions = DEFAULT_OPTIONS
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    if not _coefs_fusable(x, phi, bias, alpha, opts):
        return reference.mhc_coefficients(x, phi, bias, alpha, opts)
    h_pre, h_post, h_res, _, _ = ops.mhc_coefficients.coef_eager(_flat(x), phi, bias, _vec3(alpha), opts)
    return _coefs_out(phi, x.shape[:-2], x.shape[-2], h_pre, h_post, h_res)


def mhc_pre(
    x: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, opts: MHCOptions = DEFAULT_OPTIONS,
    u_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(u, h_pre, h_post, h_res | None) from one read of x; its backward returns a single dx."""
    if not _coefs_fusable(x, phi, bias, alpha, opts):  # the reference's composition, each part fused where it can be
        h_pre, h_post, h_res = mhc_coefficients(x, phi, bias, alpha, opts)
        return in_dtype(stream_pre(x, h_pre), u_dtype), h_pre, h_post, h_res
    lead = x.shape[:-2]
    u, h_pre, h_post, h_res, _, _ = ops.mhc_pre.mhc_pre_eager(_flat(x), phi, bias, _vec3(alpha), opts,
                                                              _u_written(x, u_dtype))
    return (in_dtype(u if len(lead) == 1 else u.reshape(*lead, x.shape[-1]), u_dtype),
            *_coefs_out(phi, lead, x.shape[-2], h_pre, h_post, h_res))


def mhc_enter(
    x: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, opts: MHCOptions = DEFAULT_OPTIONS,
    u_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(x', u, h_pre, h_post, h_res | None): mhc_pre, and x' (an alias of x) for the sublayer's write-back to read.
    The gradient reaching x' enters this op's backward, whose x pass adds it into the one dx it writes: autograd then
    has no sum of the two stream-sized gradients of x to run (docs/kernels.md). Under torch.compile x' is
    `Routed` (x and the route its write-back gradient takes), which only `stream_post_res` / `mhc_boundary` read."""
    if not _coefs_fusable(x, phi, bias, alpha, opts):
        return (x, *mhc_pre(x, phi, bias, alpha, opts, u_dtype))
    lead = x.shape[:-2]
    xt, u, h_pre, h_post, h_res, _, _ = ops.mhc_enter.mhc_enter_eager(_flat(x), phi, bias, _vec3(alpha), opts,
                                                                      _u_written(x, u_dtype))
    return (_handed_on(xt, x), in_dtype(u if len(lead) == 1 else u.reshape(*lead, x.shape[-1]), u_dtype),
            *_coefs_out(phi, lead, x.shape[-2], h_pre, h_post, h_res))


def _handed_on(xt, x: torch.Tensor):
    """x' in x's shape: the alias (eager), or the `Routed` pair with x itself (its route stays [N, n, C])."""
    if isinstance(xt, Routed):
        return Routed(x, xt.route)
    return xt if xt.shape == x.shape else xt.view(x.shape)


def _unrouted(x) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(x, route | None) of a stream handed on by an enter op."""
    return (x.x, x.route) if isinstance(x, Routed) else (x, None)


def _post_res_fusable(x, f, h_post, h_res) -> bool:
    n, c = x.shape[-2], x.shape[-1]
    return (
        _fusable(x)
        and f.shape == x.shape[:-2] + (c,)
        and f.dtype in _DTYPES
        and f.device == x.device
        and h_post.shape == x.shape[:-1]
        and (h_res is None or h_res.shape == x.shape[:-1] + (n,))
    )


def _res3(x3: torch.Tensor, h_res: Optional[torch.Tensor]) -> torch.Tensor:
    """h_res as the kernels take it: [N, n, n], or [N, 0, 0] for H^res = I."""
    if h_res is None:
        return x3.new_empty((x3.shape[0], 0, 0), dtype=torch.float32)
    return h_res if h_res.dim() == 3 else h_res.reshape(-1, x3.shape[1], x3.shape[1])


def mhc_boundary(
    x: torch.Tensor, f: torch.Tensor, h_post: torch.Tensor, h_res: Optional[torch.Tensor],
    phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, opts: MHCOptions = DEFAULT_OPTIONS,
    u_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(x_next, u, h_pre, h_post, h_res | None): sublayer l's write-back and sublayer l+1's coefficients and input in
    one op (kernels/reference/mhc_boundary.py); x_next is written once, and its backward writes dx once."""
    x, _ = _unrouted(x)  # x's gradient then reaches the enter op through x itself (its route gets none)
    if not (_coefs_fusable(x, phi, bias, alpha, opts) and _post_res_fusable(x, f, h_post, h_res)):
        x_next = stream_post_res(x, f, h_post, h_res)
        return (x_next, *mhc_pre(x_next, phi, bias, alpha, opts, u_dtype))
    n, c = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    written = _u_written(x, u_dtype)
    if x.dim() == 3:  # flat already (the model's chain): no reshapes
        x_next, u, h_pre, h_post2, h_res2, _, _ = ops.mhc_boundary.boundary_eager(
            x, f, h_post, _res3(x, h_res), phi, bias, _vec3(alpha), opts, written)
        return (x_next, in_dtype(u, u_dtype), *_coefs_out(phi, lead, n, h_pre, h_post2, h_res2))
    x3 = x.reshape(-1, n, c)
    x_next, u, h_pre, h_post2, h_res2, _, _ = ops.mhc_boundary.boundary_eager(
        x3, f.reshape(-1, c), h_post.reshape(-1, n), _res3(x3, h_res), phi, bias, _vec3(alpha), opts, written)
    return (x_next.reshape(x.shape), in_dtype(u.reshape(*lead, c), u_dtype),
            *_coefs_out(phi, lead, n, h_pre, h_post2, h_res2))


def rebuild_u(x: torch.Tensor, h_pre: torch.Tensor, u_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """u as the enter / boundary ops handed it to the branch, without autograd (reference.rebuild_u): stream_pre's
    streaming kernel, the one the ops write u with (or the same sum in the coefficient kernel's loop), so the bits
    agree."""
    if not (_fusable(x) and h_pre.shape == x.shape[:-1] and h_pre.device == x.device):
        return reference.rebuild_u(x, h_pre, u_dtype)
    n, c = x.shape[-2], x.shape[-1]
    u = ops.stream_pre.pre_u(_flat(x), h_pre.reshape(-1, n), _u_written(x, u_dtype))
    return in_dtype(u if x.dim() == 3 else u.reshape(*x.shape[:-2], c), u_dtype)


def request_u(x: torch.Tensor, h_pre: torch.Tensor, u_dtype: Optional[torch.dtype] = None):
    """Ask the backward of the write-back that reads the flat stream x [N, n, C] (`stream_post_res`, `mhc_boundary`,
    eager) to write u as `rebuild_u` would, from the stream tiles it reads anyway; returns the request, whose .u
    (in the dtype the ops write u in; `in_dtype` gives the branch's) is set there, or None where no fused write-back
    will read x."""
    if not (_fusable(x) and x.dim() == 3 and h_pre.shape == x.shape[:-1] and h_pre.device == x.device):
        return None
    return ops.stream_post_res.request_u(x, h_pre, _u_written(x, u_dtype) or x.dtype)


def stream_pre(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    if not (_fusable(x) and h_pre.shape == x.shape[:-1] and h_pre.device == x.device):
        return reference.stream_pre(x, h_pre)
    n, c = x.shape[-2], x.shape[-1]
    u = ops.stream_pre.stream_pre_eager(x.reshape(-1, n, c), h_pre.reshape(-1, n))
    return u.reshape(*x.shape[:-2], c)


def stream_post_res(
    x: torch.Tensor, f: torch.Tensor, h_post: torch.Tensor, h_res: Optional[torch.Tensor]
) -> torch.Tensor:
    """x may be the `Routed` x' of an enter op (under torch.compile): its gradient of x then leaves by the route."""
    x, route = _unrouted(x)
    if not _post_res_fusable(x, f, h_post, h_res):
        return reference.stream_post_res(x, f, h_post, h_res)
    args = (() if route is None else (route,))
    if x.dim() == 3:  # flat already (the model's sublayers): no reshapes
        return ops.stream_post_res.stream_post_res_eager(x, f, h_post, _res3(x, h_res), *args)
    n, c = x.shape[-2], x.shape[-1]
    x3 = x.reshape(-1, n, c)
    out = ops.stream_post_res.stream_post_res_eager(x3, f.reshape(-1, c), h_post.reshape(-1, n), _res3(x3, h_res),
                                                    *args)
    return out.reshape(x.shape)


def rms_proj(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm(x) w without a gain, [..., C] @ [C, M] -> [..., M] fp32 (reference.rms_proj): one read of x."""
    c = x.shape[-1]
    if not (x.dtype in _DTYPES and (x.is_cuda or INTERPRET) and w.dim() == 2 and w.shape[0] == c
            and w.device == x.device and w.dtype in _DTYPES):
        return reference.rms_proj(x, w, eps)
    y, _, _ = ops.rms_proj.rms_proj_eager(x.reshape(-1, c), w, float(eps))
    return y.reshape(*x.shape[:-1], w.shape[1])


def _hc_fusable(x, norm_weight, w_beta, w_m, w_r, b_static, ar_static, dynamic: bool) -> bool:
    n = x.shape[-2]
    return (dynamic and _fusable(x) and b_static.shape == (n,) and ar_static.shape == (n, n)
            and all(p.device == x.device and p.dtype in _DTYPES for p in (norm_weight, w_beta, w_m, w_r)))


def _hc_weights(x, norm_weight, w_beta, w_m, w_r, s_alpha, s_beta, b_static, am_static,
                ar_static) -> tuple[torch.Tensor, torch.Tensor]:
    """The HC kernels' two parameter operands: the projection weights [C, n + 2] and the packed static parameters,
    built in fp32 as the reference does its coefficient maths (autograd carries their gradients to the leaves)."""
    with torch.autocast(x.device.type, enabled=False):
        return (reference.hc_projection_weights(norm_weight, w_beta, w_m, w_r),
                ops.hc_coefficients.hc_statics(s_alpha, s_beta, b_static, am_static, ar_static))


def _folds_hc_operands(x: torch.Tensor, params: tuple) -> bool:
    """hc_enter builds HC's operands inside its op (`hc_operands.HCEnterFolded`): in eager mode on plain tensors, with
    contiguous parameters of the kernels' shapes (the model's). Elsewhere the torch composition builds them: under
    torch.compile inductor fuses it."""
    n, c = x.shape[-2], x.shape[-1]
    g, w_beta, w_m, w_r, s_alpha, s_beta, _, am_static, _ = params
    return (not torch.compiler.is_compiling() and type(x) is torch.Tensor
            and g.shape == w_beta.shape == w_m.shape == (c,) and w_r.shape == (c, n) and am_static.shape == (n,)
            and s_alpha.numel() == s_beta.numel() == 1 and all(p.is_contiguous() for p in params))


def hc_coefficients(
    x: torch.Tensor, norm_weight: torch.Tensor, w_beta: torch.Tensor, w_m: torch.Tensor, w_r: torch.Tensor,
    s_alpha: torch.Tensor, s_beta: torch.Tensor, b_static: torch.Tensor, am_static: torch.Tensor,
    ar_static: torch.Tensor, *, dynamic: bool = True, use_tanh: bool = True, norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference.hc_coefficients in one op (`ops.hc_coefficients.hc_coef_fwd`): the projection RMSNorm(x) w reads x
    once and keeps no fp32 copy of the streams for the backward, and the per-token tail runs in the same kernel
    (forward) and in one kernel before the x pass (backward), instead of a dozen small torch ops each way. H^res comes
    back contiguous (the reference returns a transposed view; the values are the same)."""
    n, c = x.shape[-2], x.shape[-1]
    params = (norm_weight, w_beta, w_m, w_r, s_alpha, s_beta, b_static, am_static, ar_static)
    if not _hc_fusable(x, norm_weight, w_beta, w_m, w_r, b_static, ar_static, dynamic):
        return reference.hc_coefficients(x, *params, dynamic=dynamic, use_tanh=use_tanh, norm_eps=norm_eps)
    w, statics = _hc_weights(x, *params)
    h_pre, h_post, h_res, _, _ = ops.hc_coefficients.hc_coef_eager(x.reshape(-1, c), w, statics, n, float(norm_eps),
                                                                   bool(use_tanh))
    lead = x.shape[:-2]
    return h_pre.reshape(*lead, n), h_post.reshape(*lead, n), h_res.reshape(*lead, n, n)


def hc_enter(
    x: torch.Tensor, norm_weight: torch.Tensor, w_beta: torch.Tensor, w_m: torch.Tensor, w_r: torch.Tensor,
    s_alpha: torch.Tensor, s_beta: torch.Tensor, b_static: torch.Tensor, am_static: torch.Tensor,
    ar_static: torch.Tensor, *, dynamic: bool = True, use_tanh: bool = True, norm_eps: float = 1e-6,
    u_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x', u, h_pre, h_post, h_res): an HC sublayer's coefficients and input u (in u_dtype, as `mhc_enter`) in one op
    (`ops.hc_enter.hc_enter_fwd`), and x' (an alias of x) for its write-back to read. Its backward writes one dx:
    <du, x_i> joins dh_pre in the tail pass, h_pre_i du and the write-back's gradient of x join dx in the x pass, so
    autograd sums no stream-sized gradients (the coefficients', stream_pre's and the write-back's). Under torch.compile
    x' is `Routed`, as in `mhc_enter`."""
    n, c = x.shape[-2], x.shape[-1]
    params = (norm_weight, w_beta, w_m, w_r, s_alpha, s_beta, b_static, am_static, ar_static)
    if not _hc_fusable(x, norm_weight, w_beta, w_m, w_r, b_static, ar_static, dynamic):
        h_pre, h_post, h_res = hc_coefficients(x, *params, dynamic=dynamic, use_tanh=use_tanh, norm_eps=norm_eps)
        return x, in_dtype(stream_pre(x, h_pre), u_dtype), h_pre, h_post, h_res
    written = _u_written(x, u_dtype)
    if _folds_hc_operands(x, params):
        xt, u, h_pre, h_post, h_res, _, _ = hc_operands.HCEnterFolded.apply(_flat(x), *params, float(norm_eps),
                                                                            bool(use_tanh), written)
    else:
        w, statics = _hc_weights(x, *params)
        xt, u, h_pre, h_post, h_res, _, _ = ops.hc_enter.hc_enter_eager(_flat(x), w, statics, float(norm_eps),
                                                                        bool(use_tanh), written)
    lead = x.shape[:-2]
    h_pre, h_post = h_pre.view(*lead, n), h_post.view(*lead, n)  # the ops give them per (token, stream) row
    if len(lead) != 1:
        u, h_res = u.reshape(*lead, c), h_res.reshape(*lead, n, n)
    return _handed_on(xt, x), in_dtype(u, u_dtype), h_pre, h_post, h_res


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int):
    """As reference.rope_qkv, in one kernel each way in eager mode (kernels/fused/ops/rope_qkv.py). Under torch.compile
    the reference's torch ops run instead: inductor fuses them with their neighbours, which an opaque op would
    prevent."""
    ok = (
        not torch.compiler.is_compiling()
        and qkv.dim() == 3
        and qkv.dtype in _DTYPES
        and (qkv.is_cuda or INTERPRET)
        and qkv.shape[-1] % (6 * n_heads) == 0
        and cos.device == qkv.device
        and cos.shape[0] >= qkv.shape[1]
    )
    if not ok:
        return reference.rope_qkv(qkv, cos, sin, n_heads)
    t = qkv.shape[1]
    return ops.rope_qkv.RopeQKV.apply(qkv, cos[:t].contiguous(), sin[:t].contiguous(), n_heads)


def _ends_fused(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """The stream's ends run their kernels in eager mode; under torch.compile inductor fuses the reference's cast and
    copy (or sum) with their neighbours, which an opaque op would prevent."""
    return (not torch.compiler.is_compiling() and t.dtype in _DTYPES and dtype in _DTYPES
            and (t.is_cuda or INTERPRET))


def expand_streams(h: torch.Tensor, n: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """As reference.expand_streams, in one kernel each way (kernels/fused/ops/expand_streams.py)."""
    dtype = dtype or h.dtype
    if h.dim() < 1 or not _ends_fused(h, dtype):
        return reference.expand_streams(h, n, dtype)
    return ops.expand_streams.ExpandStreams.apply(h, n, dtype)


def sum_streams(x: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """As reference.sum_streams, in one kernel each way (kernels/fused/ops/sum_streams.py)."""
    dtype = dtype or x.dtype
    if x.dim() < 2 or not _ends_fused(x, dtype):
        return reference.sum_streams(x, dtype)
    return ops.sum_streams.SumStreams.apply(x, dtype)
