"""Host helpers every fused op shares: output allocation, the layouts the kernels read, small integer maths and the
device's SM count."""
import functools
import os
from typing import Optional

import torch

Tensor = torch.Tensor
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Tests set this: outputs start as NaN, so any element a kernel fails to write fails the comparison.
POISON = False


def empty(shape, dtype, device) -> Tensor:
    """An output the kernels write in full."""
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def fake_like(t: Tensor) -> Tensor:
    """A fake impl's output for a tensor the op allocates itself: contiguous whatever t's strides (a transposed
    h_res, as HC passes, must not give its strides to dH: compiled graphs assert the fake strides)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def grads_or_zeros(device, d_pre: Optional[Tensor], *grads_and_shapes) -> tuple[Optional[Tensor], ...]:
    """A coefficient op's incoming gradients: d_pre as autograd gave it (None when h_pre was read only through u, as
    the model does; the kernels then take it as zero without a tensor, `HAS_DPRE`), the others or fp32 zeros of
    their shapes where autograd left them out (an output nothing used)."""
    return (d_pre, *(torch.zeros(shape, dtype=torch.float32, device=device) if g is None else g
                     for g, shape in grads_and_shapes))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def np2(v: int, lo: int = 1) -> int:
    """The next power of 2 from v, at least lo."""
    return max(lo, 1 if v <= 1 else 1 << (v - 1).bit_length())


def token_rows(x: Tensor) -> Tensor:
    """[N, n, C] with each token's n*C values contiguous (the coefficient GEMM reads rows of n*C)."""
    c = x.shape[2]
    return x if (x.stride(2) == 1 and x.stride(1) == c) or x.shape[0] == 0 else x.contiguous()


def c_contig(x: Tensor) -> Tensor:
    """x with contiguous last-axis values (the kernels' inner loads)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def or_(t: Optional[Tensor], fallback: Tensor) -> Tensor:
    """t, or a pointer the kernel will not read where t is absent."""
    return fallback if t is None else t


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (1 elsewhere: the interpreter runs one program at a time)."""
    if device.type != "cuda":
        return 1
    return _sms(device.index if device.index is not None else torch.cuda.current_device())
