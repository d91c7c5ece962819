"""`mhc compare` on runs written straight to an MLflow store (no training): table, plots, logging, errors."""

from __future__ import annotations

import csv
import time

import matplotlib.image as mpimg
import numpy as np
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param

from mhc_lightning.reports.cli import main as compare_main

TAB = [(0.12, 0.47, 0.71), (1.0, 0.50, 0.05), (0.17, 0.63, 0.17)]  # matplotlib C0, C1, C2


def colour_pixels(path, rgb, tol=0.06) -> int:
    img = mpimg.imread(path)[..., :3]
    return int((np.abs(img - np.array(rgb)).max(axis=-1) < tol).sum())


def fake_run(client, exp_id, name, mode, final, amax=None, tps=1000.0, tags=None, extra=None) -> str:
    """A run shaped like `mhc fit` output: hparams and provenance as params, step metrics, a per-layer diagnostics
    artifact."""
    tags = {"mhc.data.train_sha256": "ab" * 32, **(tags or {})}
    run = client.create_run(exp_id, run_name=name, tags=tags)
    rid, now = run.info.run_id, int(time.time() * 1000)
    params = {
        "model.arch.hyper.residual_mode": mode,
        "model.arch.hyper.n_streams": "4",
        "model.arch.hyper.sinkhorn_iters": "20",
        "model.optim.lr": "0.002",
        "model.arch.n_layers": "2",
        "trainer.max_steps": "40",
        "trainer.gradient_clip_val": "1.0",
        "seed_everything": "1",
        "data.seed": "1",
        "data.corpus": "shakespeare",
        **(extra or {}),
    }
    metrics = []
    for step in range(0, 40):
        metrics.append(Metric("train/grad_norm", 1.0 + (amax or 1.0) * step / 40, now, step))
        metrics.append(Metric("train/tokens_per_sec", tps * (1 + 0.05 * np.sin(step)), now, step))
    for i, step in enumerate((9, 19, 29, 39)):
        metrics.append(Metric("val/loss", final + 1.5 / (i + 1) - 1.5 / 4, now, step))
    metrics.append(Metric("val/bpb", final / np.log(2), now, 39))
    client.log_batch(rid, metrics=metrics, params=[Param(k, v) for k, v in params.items()])
    if amax is not None:
        layers = 4
        per_layer = {
            "composite_fwd_max": [amax ** ((layers - l) / layers) for l in range(layers)],
            "composite_bwd_max": [amax ** ((l + 1) / layers) for l in range(layers)],
        }
        client.log_dict(rid, per_layer, "diagnostics/per_layer_step0000020.json")
        client.log_dict(rid, {k: [1.0] * layers for k in per_layer}, "diagnostics/per_layer_step0000005.json")
    client.set_terminated(rid, "FINISHED")
    return rid


@pytest.fixture
def runs(mlflow_uri):
    client = MlflowClient(mlflow_uri)
    exp = client.create_experiment("cmp")
    ids = {
        "mhc": fake_run(client, exp, "mhc-run", "mhc", 2.0, amax=1.0),
        "hc": fake_run(client, exp, "hc-run", "hc", 2.3, amax=300.0, tps=1500.0),
        "residual": fake_run(client, exp, "res-run", "residual", 2.6, tps=2500.0),
    }
    return client, ids


def test_compare_experiment_table_plots_and_logging(runs, mlflow_uri, tmp_path, capsys):
    client, ids = runs
    out = tmp_path / "report"
    assert compare_main(["--experiment", "cmp", "--tracking-uri", mlflow_uri, "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "runs.csv")))
    assert [r["run"] for r in rows] == ["mhc-run", "hc-run", "res-run"]  # best val/loss first
    assert float(rows[0]["val/loss"]) == pytest.approx(2.0) and rows[0]["steps"] == "40"  # steps 0..39
    assert float(rows[2]["tokens/s (median)"]) == pytest.approx(2500.0, rel=0.05)
    # settings a mode does not use are left blank instead of showing the config default
    sinkhorn, streams = "model.arch.hyper.sinkhorn_iters", "model.arch.hyper.n_streams"
    assert rows[1][sinkhorn] == "" and rows[2][streams] == "" and rows[0][sinkhorn] == "20"
    assert "model.optim.lr" not in rows[0]  # equal in every run: says nothing about the difference
    md = (out / "runs.md").read_text().splitlines()
    assert md[0].startswith("| run |") and len(md) == 2 + 3

    for name in ("val_loss", "grad_norm", "tokens_per_sec", "amax_vs_layer"):
        assert (out / f"{name}.png").stat().st_size > 10_000, name
    # three runs -> three curve colours in the loss plot
    assert all(colour_pixels(out / "val_loss.png", c) > 300 for c in TAB)
    # Amax plot: the two multi-stream runs only (the residual baseline has no diagnostics), from the last file
    assert (
        colour_pixels(out / "amax_vs_layer.png", TAB[0]) > 300
        and colour_pixels(out / "amax_vs_layer.png", TAB[1]) > 300
    )
    assert colour_pixels(out / "amax_vs_layer.png", TAB[2]) < 50

    exp = client.get_experiment_by_name("cmp")
    logged = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("mhc.kind") == "comparison"]
    assert len(logged) == 1 and logged[0].info.status == "FINISHED"
    arts = {a.path for a in client.list_artifacts(logged[0].info.run_id, "comparison")}
    assert {
        "comparison/runs.md",
        "comparison/runs.csv",
        "comparison/val_loss.png",
        "comparison/amax_vs_layer.png",
        "comparison/grad_norm.png",
        "comparison/tokens_per_sec.png",
    } <= arts
    # a second comparison does not compare the first comparison run
    assert compare_main(["--experiment", "cmp", "--tracking-uri", mlflow_uri, "--out", str(out), "--no-log"]) == 0
    assert len(list(csv.DictReader(open(out / "runs.csv")))) == 3


def test_the_table_shows_run_ids_and_the_settings_that_differ(mlflow_uri, tmp_path):
    """Every setting that differs is a column (HC and HC without clipping differ in trainer.gradient_clip_val only),
    in `mhc fit` spelling, old stores' param names read alike; runs.md shows run ids and the steps run."""
    client = MlflowClient(mlflow_uri)
    exp = client.create_experiment("differ")
    base = fake_run(client, exp, "base", "mhc", 2.0)
    ids = [base] + [
        fake_run(client, exp, name, "mhc", 2.1 + i / 10, extra=extra, tags=tags)
        for i, (name, extra, tags) in enumerate(
            [
                ("longer", {"trainer.max_steps": "80"}, None),
                ("seed2", {"seed_everything": "2", "data.seed": "2"}, None),
                ("other-text", {"data.corpus": "/data/wiki.txt"}, {"mhc.data.train_sha256": "cd" * 32}),
                ("noclip", {"trainer.gradient_clip_val": "None"}, None),
            ]
        )
    ]
    out = tmp_path / "differ"
    assert compare_main(["--experiment", "differ", "--tracking-uri", mlflow_uri, "--out", str(out), "--no-log"]) == 0
    rows = {r["run"]: r for r in csv.DictReader(open(out / "runs.csv"))}
    assert [rows[n]["run_id"] for n in ("base", "longer", "seed2", "other-text", "noclip")] == ids
    assert rows["longer"]["trainer.max_steps"] == "80" and rows["base"]["trainer.max_steps"] == "40"
    assert (rows["seed2"]["seed_everything"], rows["seed2"]["data.seed"]) == ("2", "2")
    assert rows["other-text"]["data.corpus"] == "/data/wiki.txt" and rows["other-text"]["data.train_sha256"] == "cd" * 6
    assert rows["noclip"]["trainer.gradient_clip_val"] == "None" and rows["base"]["trainer.gradient_clip_val"] == "1.0"
    assert {r["steps"] for r in rows.values()} == {"40"} and "model.optim.lr" not in rows["base"]
    md = (out / "runs.md").read_text().splitlines()
    header = [c.strip() for c in md[0].strip("|").split("|")]
    assert header[:2] == ["run", "run_id"]
    settings = {"trainer.max_steps", "seed_everything", "data.seed", "data.corpus", "data.train_sha256"}
    assert settings | {"trainer.gradient_clip_val"} <= set(header)
    old = client.create_run(exp, run_name="old-names").info.run_id  # a store written before the CLI names
    old_names = {
        "arch/hyper/residual_mode": "hc",
        "model.optim.lr": "0.002",
        "trainer/max_steps": "40",
        "_instantiator": "x",
    }
    client.log_batch(old, params=[Param(k, v) for k, v in old_names.items()])
    client.set_terminated(old, "FINISHED")
    assert compare_main(["--runs", base, old, "--tracking-uri", mlflow_uri, "--out", str(out), "--no-log"]) == 0
    rows = {r["run"]: r for r in csv.DictReader(open(out / "runs.csv"))}
    assert rows["old-names"]["model.arch.hyper.residual_mode"] == "hc" and "trainer.max_steps" not in rows["base"]
    assert not any(k.startswith(("arch/", "trainer/", "_")) for k in rows["base"])
    assert f"| base | `{base[:8]}` |" in md[2 + [r.split("|")[1].strip() for r in md[2:]].index("base")]


def test_compare_run_ids_and_study(runs, mlflow_uri, tmp_path):
    client, ids = runs
    out = tmp_path / "two"
    assert (
        compare_main(
            ["--runs", ids["hc"], ids["residual"], "--tracking-uri", mlflow_uri, "--out", str(out), "--no-log"]
        )
        == 0
    )
    assert [r["run"] for r in csv.DictReader(open(out / "runs.csv"))] == ["hc-run", "res-run"]
    exp = client.get_experiment_by_name("cmp").experiment_id
    parent = client.create_run(
        exp, run_name="study", tags={"optuna.role": "study", "optuna.study_name": "s1"}
    ).info.run_id
    for n in range(2):
        fake_run(
            client,
            exp,
            f"s1-t{n}",
            "mhc",
            2.0 + n,
            amax=2.0,
            tags={
                "optuna.role": "trial",
                "optuna.study_name": "s1",
                "optuna.trial": str(n),
                "optuna.state": "COMPLETE",
                "mlflow.parentRunId": parent,
            },
        )
    out = tmp_path / "study"
    assert compare_main(["--study", "s1", "--tracking-uri", mlflow_uri, "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "runs.csv")))
    assert [r["trial"] for r in rows] == ["0", "1"] and {r["state"] for r in rows} == {"COMPLETE"}
    # a study's comparison goes into its parent run
    assert "comparison/runs.md" in {a.path for a in client.list_artifacts(parent, "comparison")}


def test_compare_errors(mlflow_uri, tmp_path, capsys):
    assert compare_main(["--experiment", "nope", "--tracking-uri", mlflow_uri, "--out", str(tmp_path)]) == 2
    assert "experiment 'nope' not found" in capsys.readouterr().err
    assert compare_main(["--study", "nope", "--tracking-uri", mlflow_uri, "--out", str(tmp_path)]) == 2
    assert "no trial runs of study 'nope'" in capsys.readouterr().err
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert (
        compare_main(["--experiment", "x", "--tracking-uri", f"http://127.0.0.1:{port}", "--out", str(tmp_path)]) == 2
    )
    assert f"http://127.0.0.1:{port}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare_main(["--experiment", "a", "--study", "b"])  # exactly one selection


def test_evaluation_runs_are_kept_apart_and_never_mislabelled(runs, mlflow_uri, tmp_path):
    """An `mhc validate` run (tag stage=validate) shares the training run's name and config but trained nothing: it is
    left out by default, included (and marked) with --include-eval, and the Amax plot's caption names it for what it
    is, not as a residual baseline."""
    from mhc_lightning.reports.compare import layers_caption
    from mhc_lightning.reports.runs import load, search

    client, ids = runs
    exp = client.get_experiment_by_name("cmp").experiment_id
    ev = client.create_run(exp, run_name="mhc-run", tags={"stage": "validate"}).info.run_id
    client.log_metric(ev, "val/loss", 1.9)
    client.set_terminated(ev, "FINISHED")
    out = tmp_path / "default"
    assert compare_main(["--experiment", "cmp", "--tracking-uri", mlflow_uri, "--out", str(out), "--no-log"]) == 0
    rows = list(csv.DictReader(open(out / "runs.csv")))
    assert ev not in {r["run_id"] for r in rows} and len(rows) == 3 and "stage" not in rows[0]
    out = tmp_path / "with_eval"
    assert (
        compare_main(
            ["--experiment", "cmp", "--tracking-uri", mlflow_uri, "--out", str(out), "--no-log", "--include-eval"]
        )
        == 0
    )
    rows = {r["run_id"]: r for r in csv.DictReader(open(out / "runs.csv"))}
    assert rows[ev]["stage"] == "validate" and rows[ids["mhc"]]["stage"] == "fit"

    data = load(mlflow_uri, search(mlflow_uri, experiment="cmp", include_evaluation=True), [])
    have = [d for d in data if d.per_layer]
    caption = layers_caption(data, have)
    assert "mhc-run [validate] (validate run: no training steps)" in caption
    assert "res-run (residual: one stream, no H_res)" in caption
    assert caption.count("residual") == 1  # only the residual run is called one


def test_only_evaluation_runs_is_a_clear_error(mlflow_uri, tmp_path, capsys):
    client = MlflowClient(mlflow_uri)
    exp = client.create_experiment("evals")
    client.set_terminated(client.create_run(exp, run_name="v", tags={"stage": "test"}).info.run_id, "FINISHED")
    assert compare_main(["--experiment", "evals", "--tracking-uri", mlflow_uri, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "only evaluation runs" in err and "--include-eval" in err


def test_the_best_run_is_drawn_over_a_run_that_trains_alike(tmp_path):
    """Two runs with the same curve (as CI once had: residual and mHC at one Sinkhorn iteration, the same lr): the
    first listed, the best, is the one seen; drawn in list order it was hidden under the second."""
    from mhc_lightning.reports import plots

    steps, values = [2, 4, 6], [4.1, 3.3, 3.16]
    path = plots.curves(
        [("best", steps, values, None), ("alike", steps, values, None)], "t", "val/loss", tmp_path / "c.png"
    )
    img = mpimg.imread(path)[..., :3]
    px = [
        int((np.abs(img - np.array(rgb)).max(axis=-1) < 0.06).sum()) for rgb in ((0.12, 0.47, 0.71), (1.0, 0.50, 0.05))
    ]
    assert px[0] > 500 and px[1] < px[0] // 10, px


def test_amax_plot_keeps_the_default_colours_in_another_style(tmp_path):
    """Optuna's plots switch the process's style to ggplot (a sweep's summary runs them before `mhc compare` in the
    same process: a test order in CI caught it). The Amax figure is drawn (saved) after its own style context has
    ended, so its line colours must be fixed inside it, not looked up as "C<i>" at draw time."""
    import matplotlib.pyplot as plt

    from mhc_lightning.reports import plots

    series = [
        ("flat", {"composite_fwd_max": [1.0, 1.0, 1.0], "composite_bwd_max": [1.0, 1.0, 1.0]}),
        ("growing", {"composite_fwd_max": [30.0, 8.0, 2.0], "composite_bwd_max": [2.0, 8.0, 30.0]}),
    ]
    with plt.style.context("ggplot"):
        path = plots.save(plots.amax_vs_layer(series), tmp_path / "amax.png")
    assert colour_pixels(path, TAB[0]) > 300 and colour_pixels(path, TAB[1]) > 300


def test_the_h_res_heatmap_shows_a_small_deviation_from_the_identity(tmp_path):
    """mHC's H_res stays within ≈ 0.02 of I: on a ±1 scale it looked like step 0. The H_l − I rows get a scale fitted
    to their range, symmetric-log beside an HC run whose H_res moves by units; the composites keep theirs."""
    from mhc_lightning.reports import plots

    n, layers = 4, 3
    rng = np.random.default_rng(0)
    near = [np.eye(n) + 0.02 * (rng.random((n, n)) - 0.5) for _ in range(layers)]
    far = [np.eye(n) + 3.0 * (rng.random((n, n)) - 0.5) for _ in range(layers)]

    def contrast(fig, run, row):  # colour distance between 0 and +0.01 in one row's first matrix
        im = fig.axes[(run * 2 + row) * layers].images[0]
        zero, small = (np.array(im.cmap(im.norm(v))[:3]) for v in (0.0, 0.01))
        return float(np.abs(zero - small).max())

    alone = plots.h_res_heatmaps([("mhc", [m.tolist() for m in near])])
    assert contrast(alone, 0, 0) > 0.3  # ±1 symmetric-log: 0.01 was 0.005 of the colour range
    assert "largest |H_l − I| entry: 0.0" in alone.texts[0].get_text()
    both = plots.h_res_heatmaps([("mhc", [m.tolist() for m in near]), ("hc", [m.tolist() for m in far])])
    assert contrast(both, 0, 0) > 0.15 and contrast(both, 1, 0) > 0.15  # one scale for both runs' H_l − I
    composite = both.axes[1 * layers].images[0].norm
    assert composite.vmax >= 1.0 and composite.vmin <= -1.0  # P_l: linear within ±1, log beyond
    plots.save(both, tmp_path / "h_res.png")
