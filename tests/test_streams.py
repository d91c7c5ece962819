"""mHC that is mHC (docs/design.md §6): the default init keeps H_res ~ I at t = 0, yet the streams part and H_res
learns; an init that keeps the streams identical is refused at start-up and caught by the detector at run time."""

import pytest
import torch
from helpers import fast_first, quick_model, recorded, text_batches, tiny_fit, tiny_module, train

from mhc_lightning.callbacks import InstabilityDetector, channel_of
from mhc_lightning.model import HyperConfig
from mhc_lightning.model.branch_input import stream_spread
from mhc_lightning.training.diagnostics import h_res_distances, summarize


@pytest.mark.slow
@fast_first("mode", ["mhc", "identity"])
def test_default_init_parts_the_streams_and_h_res_learns(mode):
    m = quick_model(mode)
    probe = text_batches(1)[0][:, :-1]
    before = recorded(m, probe)
    # one embedding copied into n streams, H_post equal, H_res symmetric: the streams differ by rounding only
    assert before["spread"].abs().max().item() < 1e-6
    train(m)
    after = recorded(m, probe)
    # rounding of fp32 is ~1e-7 relative; parted streams differ by percents
    assert after["spread"][-1].mean().item() > 1e-2
    assert after["h_pre"].std(dim=-1).min().item() > 1e-3  # each sublayer reads its streams differently
    if mode == "mhc":
        moved = (after["h_res"] - before["h_res"]).abs().amax().item()
        assert moved > 1e-3, moved  # H_res left its initial value
        assert torch.allclose(after["h_res"].sum(-1), torch.ones(()), atol=1e-5)  # rows stay exact
    else:
        assert torch.equal(after["h_res"][0, 0], torch.eye(4))


@fast_first("mode", ["mhc", "identity"])
def test_symmetric_init_keeps_the_streams_identical_bit_for_bit(mode):
    """The trap the default avoids: phi = 0 with symmetric biases (run here only with the explicit opt-in)."""
    m = quick_model(mode, bias_init="zeros", allow_identical_streams=True)
    rec = recorded(m, train(m, steps=20))
    assert rec["spread"].abs().max().item() == 0.0
    if mode == "mhc":
        assert torch.allclose(rec["h_res"], torch.full_like(rec["h_res"], 0.25), atol=1e-6)


@fast_first("scheme", ["zeros", "near_identity"])
@fast_first("mode", ["mhc", "identity"])
def test_identical_stream_configs_are_refused_naming_the_keys(mode, scheme):
    with pytest.raises(
        ValueError,
        match=r"bias_init=.* with phi_init=zeros keeps all 4 streams identical.*"
        r"set bias_init to one of \['home', 'a6', 'hc_identity'\].*"
        r"phi_init to one of \['normal', 'xavier'\].*allow_identical_streams",
    ):
        HyperConfig(residual_mode=mode, bias_init=scheme)
    HyperConfig(residual_mode=mode, bias_init=scheme, phi_init="normal")  # random phi parts them: allowed
    HyperConfig(residual_mode="hc", bias_init=scheme)  # HC has its own (home-stream) init
    HyperConfig(residual_mode=mode, bias_init=scheme, n_streams=1)  # one stream: nothing to part


def test_cli_refuses_identical_streams_naming_the_keys(capsys):
    from helpers import CONF

    from mhc_lightning.fit.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["fit", "-c", str(CONF / "base.yaml"), "--model.arch.hyper.bias_init=zeros"])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "model.arch.hyper.bias_init=zeros with phi_init=zeros keeps all 4 streams identical" in err


@pytest.mark.slow
def test_sinkhorn_count_changes_h_res_in_the_default_config():
    """At t = 0 the default H_res logits are symmetric, so every count gives the same (exact) matrix; once training
    has made them asymmetric the count matters, as it does in the paper."""
    m = quick_model("mhc")

    def h_res_at(iters: int, idx) -> torch.Tensor:
        for layer in m.sublayers:
            layer.sinkhorn_iters = iters
        return recorded(m, idx)["h_res"]

    idx = text_batches(1)[0][:, :-1]
    assert torch.allclose(h_res_at(1, idx), h_res_at(20, idx), atol=1e-6)
    idx = train(m)
    one, twenty = h_res_at(1, idx), h_res_at(20, idx)
    assert (one - twenty).abs().max().item() > 1e-5
    assert (one.sum(-2) - 1).abs().max() > (twenty.sum(-2) - 1).abs().max()  # more iterations: columns closer


@fast_first(
    "scheme,extra,diag",
    [
        ("home", {}, 0.99256),
        ("home", {"res_gap": 4.0}, 0.94794),
        ("a6", {}, 0.99256),
        ("hc_identity", {}, 0.47537),
        ("zeros", {"allow_identical_streams": True}, 0.25),
        ("near_identity", {"allow_identical_streams": True}, 0.99986),
    ],
)
def test_bias_init_schemes_give_documented_h_res(scheme, extra, diag):
    """docs/design.md §6 table: H_res at step 0 with phi = 0 and n = 4."""
    m = quick_model("mhc", bias_init=scheme, **extra)
    h = recorded(m, text_batches(1)[0][:1, :-1])["h_res"]
    assert h.diagonal(dim1=-2, dim2=-1).mean().item() == pytest.approx(diag, abs=2e-4)
    home = [layer.bias[:4].argmax().item() for layer in m.sublayers]
    if scheme in ("home", "a6", "hc_identity"):
        assert home == [k % 4 for k in range(len(m.sublayers))]  # sublayer k reads stream k mod n


def test_diagnostics_report_spread_and_h_res_distances():
    x = torch.randn(2, 5, 4, 16, dtype=torch.float64)
    same = x[..., :1, :].expand(2, 5, 4, 16)
    assert stream_spread(same).abs().max().item() == 0.0
    mean = x.mean(-2)
    expected = max((x[0, 0, i] - mean[0, 0]).norm().item() for i in range(4)) / mean[0, 0].norm().item()
    assert stream_spread(x)[0, 0].item() == pytest.approx(expected)
    eye, uniform = torch.eye(4, dtype=torch.float64), torch.full((4, 4), 0.25, dtype=torch.float64)
    d_i, d_u = h_res_distances(torch.stack([eye, uniform]))
    assert d_i.tolist() == pytest.approx([0.0, 3**0.5]) and d_u.tolist() == pytest.approx([3**0.5, 0.0])
    scalars, per_layer = summarize(recorded(quick_model("mhc"), text_batches(1)[0][:1, :-1]))
    assert scalars["streams/spread_last"] < 1e-6  # t = 0: the streams have not parted yet (rounding only)
    assert scalars["hres/dist_identity"] == pytest.approx(0.01711, abs=1e-4)  # res_gap 6: H_res ~ I
    assert scalars["hres/dist_uniform_min"] == pytest.approx(1.7150, abs=1e-3)
    assert len(per_layer["stream_spread"]) == len(per_layer["h_res_dist_identity"]) == 6


def _degenerate_events(module):
    return [e for e in channel_of(module).events if e.kind == "degenerate_streams"]


def test_detector_reports_degenerate_hyper_connections(tiny_corpus):
    module = tiny_module(bias_init="zeros", allow_identical_streams=True, diagnostics_every=5)
    det = InstabilityDetector(degenerate_after=10)
    _, module = tiny_fit(tiny_corpus, [det], steps=22, module=module)
    events = _degenerate_events(module)
    assert [(e.step, e.action) for e in events] == [(10, "log")]  # once, at the first diagnostics after warm-up
    assert "degenerate hyper-connections" in events[0].detail and "model.arch.hyper.bias_init" in events[0].detail
    assert events[0].value == 0.0


def test_detector_is_quiet_for_the_default_init(tiny_corpus):
    module = tiny_module(diagnostics_every=5)
    _, module = tiny_fit(tiny_corpus, [InstabilityDetector(degenerate_after=10)], steps=22, module=module)
    assert _degenerate_events(module) == []
    assert module.last_diagnostics["streams/spread_last"] > 1e-4
