"""The gradient kernels' partial sums summed in one launch (kernels/fused/partial_sums.py), against float64."""

import pytest
import torch
from helpers import fast_first
from kernel_checks import DEV, check, poisoned_outputs

from mhc_lightning.kernels.fused import host, partial_sums

pytestmark = pytest.mark.usefixtures(poisoned_outputs.__name__)


@fast_first("splits,rows", [(1, 1), (16, 130), (5, 1100), (3, 4099)])
def test_parameter_gradient_partials_summed_in_one_launch(splits, rows):
    """The weight's split partials and the vectors' per-block partials (one row per vector element, [PW, programs]:
    each row summed by its own program) in one launch, each gradient written in its own dtype into its own tensor;
    also the weight alone, one vector (HC's statics), and two weights (the write-back backward's dh_post and dH
    partials). 4099 partials: more than the trainer's 4096 per-token programs, off the load width."""
    torch.manual_seed(splits + rows)
    wpart, vpart = torch.randn(splits, 97, 24, device=DEV), torch.randn(27, rows, device=DEV)
    w_ref, v_ref = wpart.double().sum(0), vpart.double().sum(1)
    dw, da, db = (
        host.empty(shape, dt, DEV)
        for shape, dt in (((97, 24), torch.float32), ((24,), torch.float32), ((3,), torch.bfloat16))
    )
    partial_sums.sum_partials(wpart, dw, vpart, da, db)
    check(dw, w_ref, 1e-6, "dw")
    check(da, v_ref[:24], 1e-6, "da")
    check(db, v_ref[24:], 1e-2, "db (bf16)")
    dw16 = host.empty((97, 24), torch.bfloat16, DEV)
    partial_sums.sum_partials(wpart, dw16)
    check(dw16, w_ref, 1e-2, "dw alone (bf16)")
    dv = host.empty((27,), torch.float32, DEV)
    partial_sums.sum_partials(wpart, dw, vpart, dv)
    check(dv, v_ref, 1e-6, "one vector")
    wpart2 = torch.randn(splits + 3, 5, 7, device=DEV)  # a second weight with its own split count (dh_post, dH)
    dw2 = host.empty((5, 7), torch.float32, DEV)
    partial_sums.sum_partials(wpart, dw, wpart2=wpart2, dw2=dw2)
    check(dw, w_ref, 1e-6, "dw beside dw2")
    check(dw2, wpart2.double().sum(0), 1e-6, "dw2")
