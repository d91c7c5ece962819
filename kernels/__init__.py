"""mHC ops: pure-PyTorch references (`reference/`) and fused Triton kernels (`fused/`).

The model reaches every op through `get_ops(backend, device)`, the single dispatch point.
Both backends expose the same functions with the same signatures and conventions:
    mhc_coefficients(x, phi, bias, alpha, **sinkhorn_and_gate_options) -> (h_pre, h_post, h_res | None)
    stream_pre(x, h_pre) -> u
    stream_post_res(x, f, h_post, h_res | None) -> x_next
"""
from types import ModuleType
from typing import Literal

import torch

from . import reference

KernelBackend = Literal["auto", "triton", "torch"]
KERNEL_BACKENDS = ("auto", "triton", "torch")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_ops(backend: str, device: torch.device) -> ModuleType:
    """auto = fused Triton kernels on CUDA, the reference elsewhere; torch = always the reference."""
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return reference
    if not triton_available():
        if backend == "triton":
            raise RuntimeError("kernel_backend='triton' needs the triton package; install it or use 'torch'")
        return reference
    from . import fused

    return fused
