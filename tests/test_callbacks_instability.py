"""InstabilityDetector with injected faults on a tiny CPU model (figures: docs/stability.md)."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch
from helpers import NaNGradAt, StepRecorder, fast_first, params_finite, tiny_fit, tiny_module

from mhc_lightning.callbacks import GradientSnapshots, InstabilityDetector, StabilityEvent, channel_of


def _events(module) -> list[StabilityEvent]:
    return channel_of(module).events


def test_nan_gradient_detected_and_skipped_with_mlflow_record(tiny_corpus, mlflow_uri, tmp_path):
    import mlflow
    from lightning.pytorch.loggers import MLFlowLogger

    logger = MLFlowLogger(experiment_name="stability", tracking_uri=mlflow_uri)
    rec = StepRecorder()
    trainer, module = tiny_fit(
        tiny_corpus, [NaNGradAt(12), InstabilityDetector(), rec], steps=25, logger=logger, log_every_n_steps=1
    )
    events = _events(module)
    assert [(e.step, e.kind, e.action) for e in events] == [(12, "nonfinite_grad", "skip")]
    assert trainer.global_step == 25 and params_finite(module)
    assert math.isfinite(rec.final_loss())

    client = logger.experiment
    path = mlflow.artifacts.download_artifacts(
        run_id=logger.run_id,
        artifact_path="stability/events.json",
        tracking_uri=mlflow_uri,
        dst_path=str(tmp_path / "dl"),
    )
    table = json.loads(open(path).read())
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert rows[0]["step"] == 12 and rows[0]["kind"] == "nonfinite_grad" and rows[0]["action"] == "skip"
    assert {"threshold", "value", "detail"} <= set(rows[0])
    metrics = client.get_run(logger.run_id).data.metrics
    assert metrics["stability/events_total"] == 1.0 and metrics["train/skipped_step"] == 1.0
    assert "stability/loss_z" in metrics and "stability/grad_norm_ratio" in metrics


def test_nan_gradient_rolled_back(tiny_corpus):
    det = InstabilityDetector(on_nonfinite_grad="rollback")
    snaps = GradientSnapshots(every_n_steps=5, cooldown_steps=0)
    rec = StepRecorder()
    trainer, module = tiny_fit(tiny_corpus, [NaNGradAt(12), det, snaps, rec], steps=25)
    kinds = [(e.step, e.kind, e.action) for e in _events(module)]
    assert kinds == [(12, "nonfinite_grad", "rollback"), (12, "rollback", "restored")]
    assert _events(module)[1].value == 10.0  # newest snapshot before the fault
    assert params_finite(module) and math.isfinite(rec.final_loss())


def test_stop_action_stops_with_message(tiny_corpus):
    det = InstabilityDetector(on_nonfinite_grad="stop")
    with pytest.warns(UserWarning, match=r"stopping at step 8: nonfinite_grad"):
        trainer, module = tiny_fit(tiny_corpus, [NaNGradAt(8), det], steps=30)
    assert trainer.global_step == 9 and params_finite(module)


def test_rollback_without_snapshots_degrades_to_skip(tiny_corpus):
    rec = StepRecorder()
    with pytest.warns(UserWarning, match="no GradientSnapshots"):
        _, module = tiny_fit(
            tiny_corpus, [NaNGradAt(6), InstabilityDetector(on_nonfinite_grad="rollback"), rec], steps=10
        )
    (event,) = _events(module)
    assert event.action == "skip" and "rollback unavailable" in event.detail
    assert params_finite(module)


def test_hc_amax_growth_reported_while_mhc_stays_near_one(tiny_corpus):
    """Aggressive LR (3e-2, no clipping) and 8 sublayers: HC's composite gain grows; mHC's forward gain stays
    exactly 1 (rows exact) and its backward gain near 1, with streams that have parted (the mechanism engaged)."""
    seen = {}
    for mode in ("hc", "mhc"):
        module = tiny_module(mode, lr=3e-2, n_layers=4, diagnostics_every=5)
        det = InstabilityDetector(amax_bound=2.0, on_loss_spike="log", on_grad_explosion="log")  # report only
        _, module = tiny_fit(tiny_corpus, [det], steps=31, module=module)
        seen[mode] = [e for e in _events(module) if e.kind == "amax"]
        if mode == "mhc":
            d = module.last_diagnostics
            seen["mhc_fwd"], seen["mhc_bwd"] = d["amax/composite_fwd_max"], d["amax/composite_bwd_max"]
            seen["mhc_spread"] = d["streams/spread_last"]
    assert len(seen["hc"]) >= 3 and seen["hc"][-1].value > 10 * seen["hc"][0].value > 20
    assert [e.value for e in seen["hc"]] == sorted(e.value for e in seen["hc"])  # growth
    assert seen["mhc"] == [] and abs(seen["mhc_fwd"] - 1.0) < 1e-5
    assert 1.0 <= seen["mhc_bwd"] < 1.5  # column sums: approximate after 20 iterations, bounded
    assert seen["mhc_spread"] > 1e-3


def test_amp_overflow_is_the_scalers_job_until_scale_collapses():
    det = InstabilityDetector(min_loss_scale=1.0)
    for scale, kinds in ((1024.0, ["amp_overflow"]), (0.5, ["amp_overflow", "nonfinite_grad"])):
        scaler = types.SimpleNamespace(get_scale=lambda s=scale: s)
        trainer = types.SimpleNamespace(precision_plugin=types.SimpleNamespace(scaler=scaler))
        module = types.SimpleNamespace(last_diagnostics_step=-1, last_diagnostics={})
        events = det._evaluate(trainer, module, 3, 2.5, float("inf"), [1.0, float("inf")], 1.0)
        assert [e.kind for e in events] == kinds
        assert events[0].value == scale and events[0].action == "log"


def test_loss_spike_and_grad_explosion_thresholds():
    det = InstabilityDetector(loss_window=20, loss_min_history=10, grad_min_history=10, grad_window=20)
    trainer = types.SimpleNamespace(precision_plugin=types.SimpleNamespace())
    module = types.SimpleNamespace(last_diagnostics_step=-1, last_diagnostics={})
    gen = torch.Generator().manual_seed(0)
    for i in range(15):
        noise = float(torch.randn((), generator=gen)) * 0.02
        assert det._evaluate(trainer, module, i, 3.0 + noise, 1.0 + noise, [0.5, 0.5], 1.0) == []
    events = det._evaluate(trainer, module, 15, 4.0, 50.0, [0.5, 40.0], 1.0)
    assert [e.kind for e in events] == ["loss_spike", "grad_explosion", "layer_grad_explosion"]
    assert events[0].value > 6 and events[1].value > 10 and "sublayers [1]" in events[2].detail
    assert len(det.losses) == 15  # the spike did not enter the window
    assert det._evaluate(trainer, module, 16, 2.0, 1.0, [0.5, 0.5], 1.0) == []  # a falling loss is fine


@fast_first(
    "kwargs, match",
    [
        (
            {"on_loss_spike": "explode"},
            r"InstabilityDetector.on_loss_spike must be one of \['log', 'skip', 'rollback', 'stop'\]",
        ),
        ({"loss_z_threshold": -1.0}, r"InstabilityDetector.loss_z_threshold must be a number > 0"),
        ({"loss_min_history": 500}, r"InstabilityDetector.loss_min_history must be an integer >= 2 and <= 100"),
        ({"grad_factor": 0.5}, r"InstabilityDetector.grad_factor must be a number > 1"),
    ],
)
def test_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        InstabilityDetector(**kwargs)
