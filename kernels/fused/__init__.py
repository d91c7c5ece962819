"""Fused Triton mHC ops with the reference signatures and return conventions (see kernels/__init__.py).

What the kernels cover: n in {1, 2, 4, 8}; x in bf16 / fp16 / fp32 on CUDA (or anywhere under
TRITON_INTERPRET=1); Sinkhorn start "softmax_eps" with either exact axis and either res layout; any
iteration count (a runtime argument). Everything else (float64, start "exp" / "log_domain", other n,
broadcast coefficient shapes) goes to the reference ops, which define the semantics.
"""
from typing import Optional

import torch

from .. import reference
from ..reference.coefficients import RES_LAYOUTS, mhc_logit_count
from ..reference.sinkhorn import EXACT_AXES
from . import ops

__all__ = ["mhc_coefficients", "mhc_pre", "stream_pre", "stream_post_res", "expand_streams"]

expand_streams = reference.expand_streams
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fusable(x: torch.Tensor) -> bool:
    return (
        x.dim() >= 2
        and x.shape[-2] in (1, 2, 4, 8)
        and x.dtype in _DTYPES
        and (x.is_cuda or ops.INTERPRET)
    )


def _coef_plan(x, phi, bias, alpha, sinkhorn_iters, exact_axis, start, res_layout):
    """(t_in, t_out) launch flags when the kernels cover these inputs and options, else None."""
    n, c = x.shape[-2], x.shape[-1]
    m = phi.shape[-1] if phi.dim() == 2 else -1
    ok = (
        _fusable(x)
        and start == "softmax_eps"
        and exact_axis in EXACT_AXES
        and res_layout in RES_LAYOUTS
        and sinkhorn_iters >= 1
        and phi.dim() == 2
        and phi.shape[0] == n * c
        and m in (mhc_logit_count(n, True), mhc_logit_count(n, False))
        and tuple(bias.shape) == (m,)
        and alpha.numel() == 3
        and phi.device == x.device
    )
    if not ok:
        return None
    cols = exact_axis == "cols"
    # The kernel runs the rows-exact K(w) on w = R^T or R and transposes the result for "cols" (§3.1).
    return (res_layout == "src_dst") != cols, cols


def mhc_coefficients(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    *,
    sinkhorn_iters: int = 20,
    sinkhorn_eps: float = 1e-6,
    exact_axis: str = "rows",
    start: str = "softmax_eps",
    res_layout: str = "src_dst",
    rms_eps: float = 1e-6,
    pre_eps: float = 1e-6,
    post_mult: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    plan = _coef_plan(x, phi, bias, alpha, sinkhorn_iters, exact_axis, start, res_layout)
    if plan is None:
        return reference.mhc_coefficients(
            x, phi, bias, alpha, sinkhorn_iters=sinkhorn_iters, sinkhorn_eps=sinkhorn_eps, exact_axis=exact_axis,
            start=start, res_layout=res_layout, rms_eps=rms_eps, pre_eps=pre_eps, post_mult=post_mult,
        )
    n, c = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    h_pre, h_post, h_res, _, _ = ops.eager.coef(
        x.reshape(-1, n, c), phi, bias, alpha.reshape(3), int(sinkhorn_iters), float(sinkhorn_eps), *plan,
        float(rms_eps), float(pre_eps), float(post_mult),
    )
    h_pre, h_post = h_pre.reshape(*lead, n), h_post.reshape(*lead, n)
    if phi.shape[-1] == mhc_logit_count(n, False):
        return h_pre, h_post, None
    return h_pre, h_post, h_res.reshape(*lead, n, n)


def mhc_pre(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    *,
    sinkhorn_iters: int = 20,
    sinkhorn_eps: float = 1e-6,
    exact_axis: str = "rows",
    start: str = "softmax_eps",
    res_layout: str = "src_dst",
    rms_eps: float = 1e-6,
    pre_eps: float = 1e-6,
    post_mult: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(u, h_pre, h_post, h_res | None) from one read of x; its backward returns a single dx."""
    opts = dict(sinkhorn_iters=sinkhorn_iters, sinkhorn_eps=sinkhorn_eps, exact_axis=exact_axis, start=start,
                res_layout=res_layout, rms_eps=rms_eps, pre_eps=pre_eps, post_mult=post_mult)
    plan = _coef_plan(x, phi, bias, alpha, sinkhorn_iters, exact_axis, start, res_layout)
    if plan is None:  # same composition as the reference, each part fused where it can be
        h_pre, h_post, h_res = mhc_coefficients(x, phi, bias, alpha, **opts)
        return stream_pre(x, h_pre), h_pre, h_post, h_res
    n, c = x.shape[-2], x.shape[-1]
    lead = x.shape[:-2]
    u, h_pre, h_post, h_res, _, _ = ops.eager.mhc_pre(
        x.reshape(-1, n, c), phi, bias, alpha.reshape(3), int(sinkhorn_iters), float(sinkhorn_eps), *plan,
        float(rms_eps), float(pre_eps), float(post_mult),
    )
    u, h_pre, h_post = u.reshape(*lead, c), h_pre.reshape(*lead, n), h_post.reshape(*lead, n)
    if phi.shape[-1] == mhc_logit_count(n, False):
        return u, h_pre, h_post, None
    return u, h_pre, h_post, h_res.reshape(*lead, n, n)


def stream_pre(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
    if not (_fusable(x) and h_pre.shape == x.shape[:-1] and h_pre.device == x.device):
        return reference.stream_pre(x, h_pre)
    n, c = x.shape[-2], x.shape[-1]
    u = ops.eager.stream_pre(x.reshape(-1, n, c), h_pre.reshape(-1, n))
    return u.reshape(*x.shape[:-2], c)


def stream_post_res(
    x: torch.Tensor, f: torch.Tensor, h_post: torch.Tensor, h_res: Optional[torch.Tensor]
) -> torch.Tensor:
    n, c = x.shape[-2], x.shape[-1]
    ok = (
        _fusable(x)
        and f.shape == x.shape[:-2] + (c,)
        and f.dtype in _DTYPES
        and h_post.shape == x.shape[:-1]
        and (h_res is None or h_res.shape == x.shape[:-1] + (n,))
    )
    if not ok:
        return reference.stream_post_res(x, f, h_post, h_res)
    x3 = x.reshape(-1, n, c)
    hr = x3.new_empty((x3.shape[0], 0, 0), dtype=torch.float32) if h_res is None else h_res.reshape(-1, n, n)
    out = ops.eager.stream_post_res(x3, f.reshape(-1, c), h_post.reshape(-1, n), hr)
    return out.reshape(x.shape)
