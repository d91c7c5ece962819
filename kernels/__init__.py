"""mHC ops: pure-PyTorch references (`reference/`) and fused Triton kernels (`fused/`).

The model reaches every op through `get_ops(backend, device)`, the single dispatch point.
Both backends expose the same functions with the same signatures and conventions (opts: `MHCOptions`):
    mhc_coefficients(x, phi, bias, alpha, opts) -> (h_pre, h_post, h_res | None)
    mhc_pre(x, phi, bias, alpha, opts, u_dtype=None) -> (u, h_pre, h_post, h_res | None)   (u_dtype: u's, as its
                                                  branch takes it; its values are those of u in x's dtype)
    mhc_enter(x, phi, bias, alpha, opts, u_dtype=None) -> (x', u, h_pre, h_post, h_res | None)   (x' for the
                                                  write-back to read; fused, under torch.compile: a pair only the
                                                  write-back reads)
    mhc_boundary(x, f, h_post, h_res | None, phi, bias, alpha, opts, u_dtype=None) -> (x_next, u, h_pre, h_post,
                                                  h_res | None)
    hc_coefficients(x, norm_weight, w_beta, w_m, w_r, s_alpha, s_beta, b_static, am_static, ar_static, *, dynamic,
                    use_tanh, norm_eps) -> (h_pre, h_post, h_res)      (HC, unconstrained)
    hc_enter(x, <the same ten parameters>, *, dynamic, use_tanh, norm_eps, u_dtype=None) -> (x', u, h_pre, h_post,
                                                  h_res)
    rms_proj(x, w, eps) -> RMSNorm(x) w                                  (HC's projection)
    expand_streams(h, n, dtype=None) -> x_0                              (the embedding into n streams)
    sum_streams(x, dtype=None) -> the streams summed                     (the "sum" collapse)
    stream_pre(x, h_pre) -> u
    rebuild_u(x, h_pre, u_dtype=None) -> u          (no autograd: u as the ops above handed it to the branch, bitwise)
    request_u(x, h_pre, u_dtype=None) -> request | None   (fused: the backward of the write-back reading x sets
                                                  request.u to that u, from tiles it reads anyway; reference: None)
    stream_post_res(x, f, h_post, h_res | None) -> x_next
    rope_qkv(qkv, cos, sin, n_heads) -> (q, k, v)                      (the attention's RoPE, any residual mode)
"""

from types import ModuleType

import torch

from . import reference
from .options import KERNEL_BACKENDS, MHCOptions

__all__ = ["KERNEL_BACKENDS", "MHCOptions", "get_ops", "reference"]


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_ops(backend: str, device: torch.device) -> ModuleType:
    """auto = fused Triton kernels on CUDA, the reference elsewhere; torch = always the reference. Every sublayer asks
    twice per forward: the answer is kept per (backend, device type)."""
    key = (backend, device.type)
    ops = _CHOSEN.get(key)
    if ops is None:
        ops = _CHOSEN[key] = _choose(backend, device)
    return ops


_CHOSEN: dict = {}


def _choose(backend: str, device: torch.device) -> ModuleType:
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend must be one of {list(KERNEL_BACKENDS)}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return reference
    if not _triton_importable():
        if backend == "triton":
            raise RuntimeError("kernel_backend='triton' needs the triton package; install it or use 'torch'")
        return reference
    from . import fused

    return fused
