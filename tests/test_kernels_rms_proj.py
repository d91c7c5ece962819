"""`rms_proj` (kernels/fused/ops/rms_proj.py), HC's projection RMSNorm(x) w alone, against float64."""

import pytest
import torch
from helpers import fast_first
from kernel_checks import DEV, SHAPES, TOL, check, f64, grads, leaf, poisoned_outputs, upstream

from mhc_lightning.kernels import fused
from mhc_lightning.kernels import reference as R

pytestmark = pytest.mark.usefixtures(poisoned_outputs.__name__)


@fast_first("m", [3, 6, 10, 20])  # n + 2 for n = 1, 4, 8; and wider
@fast_first(
    "dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]
)
def test_rms_proj(m, dtype, w_dtype):
    """HC's projection RMSNorm(x) w (one read of x; the projection without a tail), forward and both gradients
    against float64, over several token blocks and a C that is not a power of two; with bf16 x, an fp32 w as pairs
    or a bf16 w in native dots."""
    torch.manual_seed(100 + m)
    lead, c = SHAPES[1]
    x = leaf(torch.randn(*lead, 4, c, device=DEV).to(dtype) * 3)
    w = leaf((torch.randn(c, m, device=DEV) / c**0.5).to(w_dtype))
    out = fused.rms_proj(x, w)
    assert out.dtype == torch.float32 and out.shape == (*lead, 4, m)
    ref_in = f64([x, w])
    ref = R.rms_proj(*ref_in)
    g = upstream(ref, out)
    t_h, _, t_g = TOL[dtype]
    check(out, ref, t_h, "y")
    for name, a, b in zip(("dx", "dw"), grads([out], [x, w], [g]), grads([ref], ref_in, [g])):
        check(a, b, t_g, name)
