"""Diagnostics of mhc_lite and kromhc (docs/design.md §7, §15): composite gains exactly 1 over 48 sublayers while
mHC's 20 Sinkhorn iterations drift, the model's recording feeding every reading, and the Sinkhorn tools (scheduler,
sweep dimension) declining the families that have no Sinkhorn."""

import pytest
import torch
from helpers import CONF, fast_first, tiny_fit, tiny_module

from mhc_lightning.callbacks import SinkhornScheduler
from mhc_lightning.kernels import reference as R
from mhc_lightning.model import GPT, GPTConfig, HyperConfig
from mhc_lightning.sweeps.spec import SpecError, parse_spec
from mhc_lightning.training.diagnostics import summarize

EXACT = ["mhc_lite", "kromhc"]
FAMILY = {"mhc_lite": R.LITE, "kromhc": R.KROM}  # each mode's ExactFamily
L, T, N = 48, 64, 4
COMPOSITE = (
    "amax/composite_fwd_max",
    "amax/composite_bwd_max",
    "amax/composite_fwd_tokmean",
    "amax/composite_bwd_tokmean",
    "amax/composite_min_colsum_worst",
    "amax/composite_min_colsum_tokmean",
)


def trained_like_logits(family: str, seed: int = 0) -> torch.Tensor:
    """[L, T, r] float64: what training makes of H_res, near a permutation with some mixing. mHC-lite: one leading
    permutation per token (the identity on half the tokens) over N(0, 2^2) logits; KromHC: factor logits +-4 +
    N(0, 2^2), each factor near keep or near swap."""
    g = torch.Generator().manual_seed(seed)
    r = FAMILY[family].res_count(N)
    z = 2.0 * torch.randn(L, T, r, generator=g, dtype=torch.float64)
    if family == "mhc_lite":
        lead = torch.randint(0, r, (L, T), generator=g)
        lead[:, : T // 2] = 0
        z.scatter_add_(-1, lead[..., None], torch.full((L, T, 1), 5.0, dtype=torch.float64))
    else:
        z += 4.0 * (2 * torch.randint(0, 2, (L, T, r), generator=g) - 1)
    return z


def summary_of(h_res: torch.Tensor) -> tuple[dict, dict]:
    ones = torch.ones(*h_res.shape[:3])
    return summarize({"h_res": h_res, "h_pre": ones, "h_post": ones, "spread": ones[..., 0]})


@fast_first("family", EXACT)
def test_composite_gains_are_one_over_48_sublayers(family):
    """Every composite reading (forward, backward, smallest column sum; worst token and token mean) is 1 to 1e-6 with
    float64 coefficients, and to the accumulated fp32 rounding (48 layers x a few ulps < 1e-5) with the fp32 ones the
    model computes; the same layers are far from identity (this is not an H_res stuck at I)."""
    h = FAMILY[family].res(trained_like_logits(family), N)
    scalars, per_layer = summary_of(h)
    for k in COMPOSITE:
        assert abs(scalars[k] - 1) < 1e-6, (k, scalars[k])
    assert scalars["hres/dist_identity"] > 0.3
    fp32, _ = summary_of(FAMILY[family].res(trained_like_logits(family).float(), N))
    for k in COMPOSITE:
        assert abs(fp32[k] - 1) < 1e-5, (k, fp32[k])
    assert len(per_layer["h_res_tokmean"]) == L and torch.tensor(per_layer["h_res_tokmean"]).shape == (L, N, N)


def test_the_same_reading_catches_sinkhorn_s_drift():
    """The test above can fail: mHC's 20 Sinkhorn iterations on trained-like logits (a leading entry per column)
    leave the composite column sums far from 1 over the same 48 layers, while the rows stay exact."""
    g = torch.Generator().manual_seed(0)
    z = 2.0 * torch.randn(L, T, N, N, generator=g, dtype=torch.float64) + 5.0 * torch.eye(N, dtype=torch.float64)
    scalars, _ = summary_of(R.sinkhorn(z, 20))
    assert abs(scalars["amax/composite_fwd_max"] - 1) < 1e-6
    assert abs(scalars["amax/composite_bwd_max"] - 1) > 1e-3 and scalars["amax/composite_min_colsum_worst"] < 1 - 1e-3


@fast_first("mode", EXACT)
def test_recorded_model_feeds_every_reading(mode):
    """Through the model (24 blocks = 48 sublayers, float64, phi and gates as after training): recorded() carries
    H_res, H_pre, H_post and the stream spread for each sublayer; summarize gives composite gains 1 to 1e-6, H_res's
    distance from I beyond its t = 0 value, and the per-layer curves, heatmap data included."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layers=24, d_model=16, n_heads=2, context=16, hyper=HyperConfig(residual_mode=mode))).double()
    idx = torch.randint(0, 256, (1, 16))
    with m.recording(), torch.no_grad():
        m(idx)
    start, _ = summarize(m.recorded())
    with torch.no_grad():
        for layer in m.sublayers:
            layer.phi.normal_(std=1.0)
            layer.alpha.fill_(1.0)
    with m.recording(), torch.no_grad():
        m(idx)
    rec = m.recorded()
    assert rec["h_res"].shape == (48, 16, N, N) and rec["h_res"].dtype == torch.float64
    assert rec["spread"].shape == (48, 16) and "logit_range" not in rec  # a Sinkhorn reading: mHC only
    scalars, per_layer = summarize(rec)
    for k in COMPOSITE:
        assert abs(scalars[k] - 1) < 1e-6, (k, scalars[k])
    assert scalars["sinkhorn/row_residual_max"] < 1e-12 and scalars["sinkhorn/col_residual_max"] < 1e-12
    assert scalars["hres/dist_identity"] > 10 * start["hres/dist_identity"] > 0.1
    assert scalars["streams/spread_last"] > 1e-2 and start["streams/spread_last"] < 1e-9
    for key in ("h_res_tokmean", "stream_spread", "h_res_dist_identity", "composite_min_colsum_min"):
        assert len(per_layer[key]) == 48, key


@fast_first("mode", EXACT)
def test_sinkhorn_scheduler_declines_in_one_line(mode, tiny_corpus):
    sched = SinkhornScheduler(every=2)
    with pytest.warns(
        UserWarning,
        match=rf"^SinkhornScheduler: residual_mode={mode} makes H_res exactly doubly "
        r"stochastic without Sinkhorn; nothing to schedule\.$",
    ):
        _, module = tiny_fit(tiny_corpus, [sched], steps=3, module=tiny_module(mode))
    assert not sched.history and module.last_diagnostics["amax/composite_bwd_max"] == pytest.approx(1, abs=1e-5)


def sweep(space: dict, fixed: dict = None, base=("base.yaml",)) -> dict:
    return {"name": "s", "base": [str(CONF / b) for b in base], "fixed": fixed or {}, "space": space}


def test_sweep_refuses_a_sinkhorn_dimension_for_the_exact_modes():
    modes = {"type": "categorical", "choices": ["mhc", "mhc_lite", "kromhc"]}
    iters = {"type": "int", "low": 1, "high": 20}
    key, at = "model.arch.hyper.residual_mode", "model.arch.hyper.sinkhorn_iters"
    with pytest.raises(
        SpecError,
        match=rf"space.{at}: residual_mode \['mhc_lite', 'kromhc'\] has no Sinkhorn .*"
        r"sample it only for mhc, when: \{model.arch.hyper.residual_mode: \[mhc\]\}",
    ):
        parse_spec(sweep({key: modes, at: iters}))
    parse_spec(sweep({key: modes, at: {**iters, "when": {key: ["mhc"]}}}))  # allowed: mHC trials only
    with pytest.raises(SpecError, match=r"callbacks.SinkhornScheduler.intensity: residual_mode \['kromhc'\]"):
        parse_spec(
            sweep(
                {"callbacks.SinkhornScheduler.intensity": {"type": "float", "low": 0, "high": 3}}, fixed={key: "kromhc"}
            )
        )
    with pytest.raises(SpecError, match=r"residual_mode \['mhc_lite'\]"):  # the mode from a base config
        parse_spec(sweep({at: iters}, base=("base.yaml", "model/mhc_lite.yaml")))
    parse_spec(sweep({at: iters}))  # conf/base.yaml's mhc
