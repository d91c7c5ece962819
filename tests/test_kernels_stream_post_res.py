"""`stream_post_res` (kernels/fused/ops/stream_post_res.py), the write-back x_next = H^res x + h_post f, against
the float64 reference at each of its backward tiles."""

import math

import pytest
import torch
from helpers import fast_first
from kernel_checks import (
    CUDA,
    DEV,
    SHAPES,
    TOL,
    check,
    config_changed,
    f64,
    grads,
    leaf,
    on_launch,
    poisoned_outputs,
    upstream,
)

from mhc_lightning.kernels import fused
from mhc_lightning.kernels import reference as R

pytestmark = pytest.mark.usefixtures(poisoned_outputs.__name__)


# The write-back's backward with several C blocks per row (partials summed afterwards) and with one C block per row
# (direct writes). C=1024 on CUDA: 4 blocks of 256; on CPU (C = 24, 40) 2-3 blocks of 16. "looped": fewer programs
# than token blocks, each walking several blocks in its pipelined loop; on the CPU one SM, so 2 programs (with
# partials: one per C block) and 37 / 38 tokens leave a partial last block of BT 4; on an H200 one row per program.
POST_BWD_TILES = {
    "partials": dict(BT=8, BC=256 if CUDA else 16, rows_max_c=0),
    "rows": dict(BT=4, BC=4096, rows_max_c=0),
    "looped": dict(BT=1 if CUDA else 4, BC=4096, rows_max_c=0, loop_stages=2, programs_per_sm=2),
    "looped partials": dict(BT=8, BC=256 if CUDA else 16, rows_max_c=0, loop_stages=3, programs_per_sm=2),
}


@fast_first(
    "n,dtype,tiles",
    [
        (1, torch.float32, "rows"),
        (2, torch.bfloat16, "partials"),
        (4, torch.float32, "partials"),
        (4, torch.bfloat16, "rows"),
        (8, torch.float32, "rows"),
        (8, torch.bfloat16, "partials"),
        (2, torch.float32, "looped"),
        (4, torch.bfloat16, "looped"),
        (8, torch.bfloat16, "looped partials"),
    ],
)
@fast_first("with_res", [True, False])
def test_stream_post_res(n, dtype, tiles, with_res, monkeypatch):
    launches = []
    on_launch(monkeypatch, ("_post_bwd_2d",), lambda name, kw: launches.append((kw["grid"], kw["LOOP_STAGES"])))
    cfg = POST_BWD_TILES[tiles]
    with config_changed("post_bwd", **cfg):
        _check_stream_post_res(n, dtype, with_res)
    stages = cfg.get("loop_stages", 0)
    assert launches and all(s == stages for _, s in launches)
    if stages:  # each program walked several token blocks
        tokens = [math.prod(lead) for lead, _ in SHAPES]
        assert all(g[0] * cfg["BT"] * 2 <= t for (g, _), t in zip(launches, tokens)), (launches, tokens)


def _check_stream_post_res(n, dtype, with_res):
    torch.manual_seed(40 + n + 2 * with_res)
    for lead, c in SHAPES:
        x = leaf(torch.randn(*lead, n, c, device=DEV).to(dtype))
        f = leaf(torch.randn(*lead, c, device=DEV).to(dtype))
        hp = leaf(2 * torch.rand(*lead, n, device=DEV))
        hr = leaf(torch.rand(*lead, n, n, device=DEV)) if with_res else None
        ins = [x, f, hp] + ([hr] if with_res else [])
        out = fused.stream_post_res(x, f, hp, hr)
        assert out.dtype == dtype
        ref_in = f64(ins)
        ref = R.stream_post_res(*ref_in[:3], ref_in[3] if with_res else None)
        g = upstream(ref, out)
        tol = TOL[dtype]
        check(out, ref, tol[0], "x_next")
        names = ("dx", "df", "dh_post", "dh_res")
        for name, a, b in zip(names, grads([out], ins, [g]), grads([ref], ref_in, [g])):
            check(a, b, tol[2], name)
