"""What a run records beyond the loss: MLflow system metrics, MFU and peak memory, tokens/s and lr on the progress
bar, the H_res heatmaps; and `mhc compare`'s training-loss curves and heatmaps side by side."""

from __future__ import annotations

import json

import lightning as L
import mlflow
import pytest
from helpers import tiny_fit, tiny_fit_args


def test_progress_bar_shows_tokens_per_sec_and_lr(tiny_corpus):
    trainer, module = tiny_fit(tiny_corpus, [], steps=3, enable_progress_bar=True)
    bar = trainer.progress_bar_metrics
    assert bar["train/tokens_per_sec"] > 0
    assert bar["train/lr"] == pytest.approx(trainer.optimizers[0].param_groups[0]["lr"], rel=1e-6)


def test_model_flops_per_token_is_6n_plus_attention():
    """6 N + 12 L C T: a tied head's weight counted once; an untied embedding is a lookup, left out."""
    from mhc_lightning.callbacks.utilization import model_flops_per_token
    from mhc_lightning.model import GPT, GPTConfig, HyperConfig

    for tied in (True, False):
        arch = GPTConfig(
            n_layers=2, d_model=32, n_heads=2, context=16, tied_head=tied, hyper=HyperConfig(residual_mode="mhc")
        )
        model = GPT(arch)
        n = sum(p.numel() for p in model.parameters()) - (0 if tied else model.embed.weight.numel())
        assert model_flops_per_token(arch) == 6 * n + 12 * 2 * 32 * 16


class SeenTokensPerSec(L.Callback):
    """The tokens/s a callback sees at each step's end (the step before's: the module logs after the callbacks)."""

    def __init__(self):
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        value = trainer.callback_metrics.get("train/tokens_per_sec")
        self.seen.append(float(value) if value is not None else float("nan"))


def test_mfu_with_a_given_peak_and_none_without_one_on_the_cpu(tiny_corpus):
    from mhc_lightning.callbacks.utilization import Utilization

    seen, with_peak, without = SeenTokensPerSec(), Utilization(peak_flops=1e12), Utilization()
    trainer, _ = tiny_fit(tiny_corpus, [seen, with_peak], steps=3, log_every_n_steps=1)
    mfu = float(trainer.callback_metrics["train/mfu"])
    assert mfu == pytest.approx(with_peak.flops_per_token * seen.seen[-1] / 1e12, rel=1e-5)
    assert 0 < mfu < 1
    trainer, _ = tiny_fit(tiny_corpus, [without], steps=2, log_every_n_steps=1)
    assert "train/mfu" not in trainer.callback_metrics  # no peak FLOP/s for a CPU
    assert "train/peak_memory_gib" not in trainer.callback_metrics  # CUDA only
    with pytest.raises(ValueError, match="utilization.peak_flops must be > 0"):
        Utilization(peak_flops=0)


@pytest.mark.slow
def test_fit_logs_system_metrics_mfu_and_h_res_heatmaps_and_compare_draws_them(
    tiny_corpus, mlflow_uri, tmp_path, monkeypatch
):
    """One tiny `mhc fit`: MLflow's system metrics (sampled every second here) in the run, train/mfu with a given
    peak, the per-layer H_res heatmaps as artifacts; then `mhc compare` on it draws the training-loss curve and the
    heatmaps of the run's last diagnostics."""
    from mhc_lightning.fit.cli import main
    from mhc_lightning.reports.compare import compare

    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")
    main(
        tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / "root", steps=4)
        + ["--utilization.peak_flops=1e12", "--trainer.log_every_n_steps=1"]
    )
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    metrics = run.data.metrics
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= metrics.keys()
    assert 0 < metrics["train/mfu"] < 1
    arts = [a.path for a in client.list_artifacts(run.info.run_id, "diagnostics")]
    heatmaps = sorted(a for a in arts if a.startswith("diagnostics/h_res_step"))
    # one per validation (steps 2 and 4), named after the diagnostics step it shows (every 2 steps: 0 and 2)
    assert heatmaps == ["diagnostics/h_res_step0000000.png", "diagnostics/h_res_step0000002.png"]
    local = client.download_artifacts(run.info.run_id, "diagnostics/per_layer_step0000002.json", str(tmp_path))
    h_res = json.loads(open(local).read())["h_res_tokmean"]
    assert len(h_res) == 4 and all(len(m) == 4 and len(m[0]) == 4 for m in h_res)  # 4 sublayers, n = 4

    res = compare(mlflow_uri, tmp_path / "report", experiment="tests", log=False)
    assert {"train_loss", "h_res"} <= res["plots"].keys()
    assert all(p.stat().st_size > 0 for p in res["plots"].values())
