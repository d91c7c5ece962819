"""Per-token mixing coefficients H^pre, H^post, H^res for mHC (docs/design.md §2) and HC (§5).

Conventions shared by every op here and by the fused kernels:
- x is the n-stream residual [..., n, C]; row i is stream i.
- h_pre, h_post are [..., n]; h_res is [..., n, n] and LEFT-multiplies the stream vector.
- Coefficient maths runs in promote(x.dtype, float32): fp32 for bf16/fp16/fp32 inputs, fp64 for fp64.
"""

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from ..options import DEFAULT_OPTIONS, RES_LAYOUTS, MHCOptions
from .sinkhorn import sinkhorn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def no_autocast(fn):
    """Run an op with autocast off: under bf16-mixed its fp32 coefficient maths must stay fp32."""

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        with torch.autocast(x.device.type, enabled=False):
            return fn(x, *args, **kwargs)

    return wrapper


def mhc_logit_count(n: int, with_res: bool = True) -> int:
    """Columns of the fused projection: [pre (n) | post (n) | res (n^2)]."""
    return 2 * n + (n * n if with_res else 0)


def gated_logits(
    x: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, rms_eps: float, matmul=torch.matmul
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """alpha * (x phi) / rms(x) + b split into (pre [..., n], post [..., n], res [..., r] | None when phi has only the
    2n pre/post columns): the projection every H^res parameterisation shares (docs/design.md §2, §15). matmul: how x
    is multiplied by phi (columnwise_matmul inside a checkpointed forward)."""
    n = x.shape[-2]
    cd = compute_dtype(x.dtype)
    flat = x.flatten(-2).to(cd)
    logits = matmul(flat, phi.to(cd))
    rinv = torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + rms_eps)
    a, b = alpha.to(cd), bias.to(cd)
    pre = a[0] * rinv * logits[..., :n] + b[:n]
    post = a[1] * rinv * logits[..., n : 2 * n] + b[n : 2 * n]
    if phi.shape[-1] == 2 * n:
        return pre, post, None
    return pre, post, a[2] * rinv * logits[..., 2 * n :] + b[2 * n :]


def _mhc_logits(
    x: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, opts: MHCOptions, matmul=torch.matmul
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(pre logits [..., n], post logits [..., n], res logits [..., n, n] in H^res's orientation, or None for
    identity-HC): everything before the squashing functions (docs/design.md §2)."""
    n = x.shape[-2]
    with_res = phi.shape[-1] == mhc_logit_count(n, True)
    if not with_res and phi.shape[-1] != mhc_logit_count(n, False):
        raise ValueError(f"phi has {phi.shape[-1]} columns; expected {mhc_logit_count(n)} or {2 * n} for n={n}")
    if opts.res_layout not in RES_LAYOUTS:
        raise ValueError(f"res_layout must be one of {list(RES_LAYOUTS)}, got {opts.res_layout!r}")
    pre, post, res = gated_logits(x, phi, bias, alpha, opts.rms_eps, matmul)
    if res is None:
        return pre, post, None
    r = res.unflatten(-1, (n, n))
    return pre, post, r.transpose(-1, -2) if opts.res_layout == "src_dst" else r


@no_autocast
def mhc_coefficients(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    opts: MHCOptions = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """mHC Eq. 14-19: one GEMM on the flattened un-normalised stream, norm applied after it.

    phi: [n*C, n^2+2n] (or [n*C, 2n] for identity-HC, which returns h_res=None); bias: same
    column count; alpha: [3] gates (pre, post, res). The res block is read row-major as R;
    res_layout "src_dst" (DeepSeek, canonical) means H^res = R^T, "dst_src" (Liger) means H^res = R.
    """
    pre, post, z = _mhc_logits(x, phi, bias, alpha, opts)
    h_pre = torch.sigmoid(pre) + opts.pre_eps
    h_post = opts.post_mult * torch.sigmoid(post)
    if z is None:
        return h_pre, h_post, None
    return h_pre, h_post, sinkhorn(z, opts.sinkhorn_iters, opts.sinkhorn_eps, opts.exact_axis, opts.start)


def columnwise_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b one column of b at a time, by products and sums: no matmul op. A selective activation checkpoint
    (model/recompute.py) caches matmul outputs by their order of call, so an extra matmul inside a checkpointed
    forward that its replay does not repeat would shift every later cached one."""
    return torch.stack([(a * b[:, j]).sum(dim=-1) for j in range(b.shape[-1])], dim=-1)


@no_autocast
def mhc_res_logits(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    opts: MHCOptions = DEFAULT_OPTIONS,
    matmul=torch.matmul,
) -> Optional[torch.Tensor]:
    """The res logits Sinkhorn starts from, [..., n, n] in H^res's orientation (None for identity-HC). Their range
    per token says how saturated the projection is: exp(range) is the ratio of its largest to smallest start entry.
    matmul: how x is multiplied by phi (columnwise_matmul inside a checkpointed forward)."""
    return _mhc_logits(x, phi, bias, alpha, opts, matmul)[2]


@no_autocast
def head_weights(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    rms_eps: float = 1e-6,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Learned stream collapse weights (DeepSeek mhc_head): sigma(alpha * x.phi / r + b) + eps, [..., n]."""
    cd = compute_dtype(x.dtype)
    flat = x.flatten(-2).to(cd)
    rinv = torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + rms_eps)
    return torch.sigmoid(alpha.to(cd) * rinv * (flat @ phi.to(cd)) + bias.to(cd)) + eps


def rms_proj(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = RMSNorm(x) w without a gain ([..., C] @ [C, M] -> [..., M]), in compute_dtype(x): HC's projection, with
    the norm's gain folded into w (`hc_projection_weights`)."""
    cd = compute_dtype(x.dtype)
    return F.rms_norm(x.to(cd), (x.shape[-1],), None, eps) @ w.to(cd)


def hc_projection_weights(
    norm_weight: torch.Tensor, w_beta: torch.Tensor, w_m: torch.Tensor, w_r: torch.Tensor
) -> torch.Tensor:
    """[C, n + 2] = diag(g) [w_beta | w_m | W_r]: RMSNorm(x; g) w = RMSNorm(x) (diag(g) w), so one projection of the
    normalised stream gives every HC logit (columns: beta, m, then the n of r)."""
    cd = compute_dtype(w_r.dtype)
    w = torch.cat([w_beta.to(cd)[:, None], w_m.to(cd)[:, None], w_r.to(cd)], dim=1)
    return norm_weight.to(cd)[:, None] * w


def hc_from_projection(y, s_alpha, s_beta, b_static, am_static, ar_static, use_tanh: bool = True):
    """HC's coefficients from the projection y [..., n, n + 2] of `hc_projection_weights`."""
    cd = y.dtype
    act = torch.tanh(y) if use_tanh else y
    h_post = b_static.to(cd) + s_beta.to(cd) * act[..., 0]
    h_pre = am_static.to(cd) + s_alpha.to(cd) * act[..., 1]
    a_r = ar_static.to(cd) + s_alpha.to(cd) * act[..., 2:]
    return h_pre, h_post, a_r.transpose(-1, -2)


@no_autocast
def hc_coefficients(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    w_beta: torch.Tensor,
    w_m: torch.Tensor,
    w_r: torch.Tensor,
    s_alpha: torch.Tensor,
    s_beta: torch.Tensor,
    b_static: torch.Tensor,
    am_static: torch.Tensor,
    ar_static: torch.Tensor,
    *,
    dynamic: bool = True,
    use_tanh: bool = True,
    norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dynamic Hyper-Connections (HC paper Eq. 1-5), in mHC notation.

    Each stream is normalised on its own (RMSNorm over C) and yields its own row:
    B_i = s_beta tanh(xn_i w_beta) + B_i;  A_m,i = s_alpha tanh(xn_i w_m) + A_m,i;
    A_r,i: = s_alpha tanh(xn_i W_r) + A_r,i:.  Then H^pre = A_m^T, H^post = B, H^res = A_r^T.
    Unbounded and signed: this is the unconstrained baseline.
    """
    cd = compute_dtype(x.dtype)
    if not dynamic:
        shape = x.shape[:-2]
        return (
            am_static.to(cd).expand(*shape, -1),
            b_static.to(cd).expand(*shape, -1),
            ar_static.to(cd).expand(*shape, -1, -1).transpose(-1, -2),
        )
    y = rms_proj(x, hc_projection_weights(norm_weight, w_beta, w_m, w_r), norm_eps)
    return hc_from_projection(y.to(cd), s_alpha, s_beta, b_static, am_static, ar_static, use_tanh)
