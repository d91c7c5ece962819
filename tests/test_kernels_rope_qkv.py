"""The fused RoPE op (kernels/fused/ops/rope_qkv.py) against its float64 reference: q, k, v and the gradient of qkv.

Without CUDA the kernels run under the Triton interpreter at small shapes. Outputs start NaN-filled
(kernel_checks.poisoned_outputs), so an element a kernel fails to write fails the comparison.
"""

import pytest
import torch
from helpers import fast_first
from kernel_checks import CUDA, DEV, poisoned_outputs

from mhc_lightning.kernels import fused, reference

pytestmark = pytest.mark.usefixtures(poisoned_outputs.__name__)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}  # bf16: one rounding of each output (the reference rounds more)
SHAPES = [(2, 37, 3, 16), (1, 19, 2, 24)] if not CUDA else [(4, 1031, 16, 64), (2, 515, 6, 24)]  # B, T, H, D


def _close(out, ref, tol, name):
    assert out.shape == ref.shape, name
    out = out.detach().double()
    assert torch.isfinite(out).all(), f"{name}: non-finite elements"
    torch.testing.assert_close(
        out, ref.detach(), atol=tol * max(1.0, ref.abs().max().item()), rtol=tol, msg=lambda m: f"{name}: {m}"
    )


@fast_first("dtype", [torch.float32, torch.bfloat16])
@fast_first("shape", SHAPES)
def test_rope_qkv_matches_float64_forward_and_gradient(shape, dtype):
    B, T, H, D = shape
    torch.manual_seed(0)
    cos, sin = (t.to(DEV) for t in reference.rope_tables(T + 5, D, 10000.0))  # more rows than T, as the model's
    qkv = torch.randn(B, T, 3 * H * D, device=DEV, dtype=dtype)
    grads = [torch.randn(B, H, T, D, device=DEV, dtype=torch.float64) for _ in range(3)]
    leaf, leaf64 = qkv.clone().requires_grad_(), qkv.double().requires_grad_()
    out = fused.rope_qkv(leaf, cos, sin, H)
    ref = reference.rope_qkv(leaf64, cos, sin, H)
    assert type(out[0].grad_fn).__name__ == "RopeQKVBackward"  # the kernel ran, not the reference
    assert out[0].is_contiguous() and out[1].is_contiguous()  # what attention takes without another copy
    assert out[2].data_ptr() == leaf.data_ptr() + 2 * H * D * leaf.element_size()  # v: a view of qkv, not a copy
    for name, a, b in zip("qkv", out, ref):
        _close(a, b, TOL[dtype], name)
    sum((o.double() * g).sum() for o, g in zip(out, grads)).backward()
    sum((o * g).sum() for o, g in zip(ref, grads)).backward()
    _close(leaf.grad, leaf64.grad, TOL[dtype], "d(qkv)")


def test_rope_qkv_of_a_projection_with_strided_channels():
    """A qkv whose channels are not contiguous (every other element of a wider tensor: its rows still flatten to a
    view, with channel stride 2) is read correctly too."""
    B, T, H, D = 2, 9, 2, 16
    cos, sin = (t.to(DEV) for t in reference.rope_tables(T, D, 10000.0))
    qkv = torch.randn(B, T, 2 * 3 * H * D, device=DEV)[..., ::2]
    assert qkv.reshape(B * T, -1).stride(-1) == 2
    for name, a, b in zip("qkv", fused.rope_qkv(qkv, cos, sin, H), reference.rope_qkv(qkv.double(), cos, sin, H)):
        _close(a, b, TOL[torch.float32], name)


def test_rope_qkv_gradient_with_unused_outputs_and_strided_gradients():
    """Only q feeds the loss (dk, dv arrive as None: zeros), and dq arrives as a transposed (strided) tensor."""
    B, T, H, D = 2, 21, 2, 16
    torch.manual_seed(1)
    cos, sin = (t.to(DEV) for t in reference.rope_tables(T, D, 500.0))
    qkv = torch.randn(B, T, 3 * H * D, device=DEV)
    g = torch.randn(B, T, H, D, device=DEV).transpose(1, 2)  # [B, H, T, D] with (t, h) strides swapped
    leaf, leaf64 = qkv.clone().requires_grad_(), qkv.double().requires_grad_()
    (fused.rope_qkv(leaf, cos, sin, H)[0] * g).sum().backward()
    (reference.rope_qkv(leaf64, cos, sin, H)[0] * g.double()).sum().backward()
    _close(leaf.grad, leaf64.grad, TOL[torch.float32], "d(qkv)")
    assert leaf.grad[..., H * D :].abs().max() == 0  # k's and v's columns


def test_rope_qkv_takes_the_reference_for_float64():
    """float64 (the reference's own dtype, the oracle tier) is not a kernel dtype: the reference runs, exactly."""
    cos, sin = (t.to(DEV) for t in reference.rope_tables(8, 16, 10000.0))
    qkv = torch.randn(1, 8, 3 * 2 * 16, device=DEV, dtype=torch.float64)
    for a, b in zip(fused.rope_qkv(qkv, cos, sin, 2), reference.rope_qkv(qkv, cos, sin, 2)):
        assert torch.equal(a, b)


def test_rope_qkv_under_torch_compile_traces_the_reference():
    """Under torch.compile (fullgraph: no break) the fused wrapper hands inductor the reference's torch ops, which it
    fuses; the compiled result equals the reference's, gradient included."""
    from torch._dynamo.testing import CompileCounterWithBackend

    B, T, H, D = 2, 12, 2, 16
    cos, sin = (t.to(DEV) for t in reference.rope_tables(T, D, 10000.0))
    qkv = torch.randn(B, T, 3 * H * D, device=DEV, requires_grad=True)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda t: fused.rope_qkv(t, cos, sin, H), fullgraph=True, backend=counter)
    out = compiled(qkv)
    ref = reference.rope_qkv(qkv, cos, sin, H)
    assert counter.frame_count == 1 and all(o.grad_fn is not None for o in out)
    assert all(type(o.grad_fn).__name__ != "RopeQKVBackward" for o in out)  # the kernel's Function is not traced
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b)
    g = torch.autograd.grad(sum(o.square().sum() for o in out), qkv)[0]
    torch.testing.assert_close(g, torch.autograd.grad(sum(o.square().sum() for o in ref), qkv)[0])
