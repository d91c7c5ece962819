"""`mhc report`: runs grouped by their tags, mean +- std over seeds, tables, plots and the markdown report."""

import json
import math
import time

import mlflow
import pytest
from helpers import md_table
from mlflow.entities import Metric, Param

from mhc_lightning.fit.cli import main


def make_runs(uri: str):
    """Two variants x two depths x two seeds with known metrics; one FAILED run, counted as failed and averaged
    nowhere."""
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("grid")
    for variant, gain in (("hc", 10.0), ("mhc", 1.0)):
        for depth in (2, 4):
            for seed in (1, 2):
                run = client.create_run(
                    exp,
                    run_name=f"{variant}-L{depth}-s{seed}",
                    tags={
                        "variant": variant,
                        "model.arch.n_layers": str(depth),
                        "seed_everything": str(seed),
                        "mhc.code": "abc123def",
                    },
                )
                rid, now = run.info.run_id, int(time.time() * 1000)
                metrics = [Metric("val/bpb", 2.0 + 0.1 * seed, now, 50)]
                for step in range(0, 50, 10):
                    metrics += [
                        Metric("train/grad_norm", 1.0 + (9.0 if step == 30 and variant == "hc" else 0.0), now, step),
                        Metric(
                            "amax/composite_fwd_max",
                            1.0 + (gain - 1) * depth * step / 40 if variant == "hc" else 1.0,
                            now,
                            step,
                        ),
                        Metric(
                            "amax/composite_bwd_max",
                            1.0 + (gain - 1) * depth * step / 50 if variant == "hc" else 1.0,
                            now,
                            step,
                        ),
                        Metric("train/tokens_per_sec", 1000.0 * seed, now, step),
                    ]
                client.log_batch(rid, metrics=metrics, params=[Param("optim/warmup_steps", "0")])
                with open("per_layer.json", "w") as f:
                    json.dump({"composite_fwd_max": [gain, 1.0], "composite_bwd_max": [gain, 1.0]}, f)
                client.log_artifact(rid, "per_layer.json", "diagnostics")  # not per_layer_step*: ignored
                # the loader looks for per_layer_stepNNNNNNN.json
                client.log_dict(
                    rid,
                    {"composite_fwd_max": [gain, 1.0], "composite_bwd_max": [gain, 1.0]},
                    "diagnostics/per_layer_step0000040.json",
                )
                client.set_terminated(rid, "FINISHED")
    broken = client.create_run(exp, run_name="hc-L2-s3", tags={"variant": "hc", "model.arch.n_layers": "2"})
    client.log_metric(broken.info.run_id, "val/bpb", 99.0)
    client.set_terminated(broken.info.run_id, "FAILED")


def test_report_groups_over_seeds(mlflow_uri, tmp_path, capsys):
    make_runs(mlflow_uri)
    notes = tmp_path / "notes.md"
    notes.write_text("## Reading\nhand-written text\n")
    out, rep = tmp_path / "results", tmp_path / "results.md"
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "report",
                "--experiment",
                "grid",
                "--group-by",
                "variant,model.arch.n_layers",
                "--tracking-uri",
                mlflow_uri,
                "--out",
                str(out),
                "--report",
                str(rep),
                "--notes",
                str(notes),
            ]
        )
    assert exc.value.code == 0
    table = (out / "groups.md").read_text().splitlines()
    assert len(table) == 2 + 4  # header, rule, 4 groups; the FAILED run is counted, not averaged
    hc4 = next(l for l in table if l.startswith("| hc | 4 |"))
    header = [c.strip() for c in table[0].strip("|").split("|")]
    cells = dict(zip(header, (c.strip() for c in hc4.strip("|").split("|"))))
    assert (cells["finished"], cells["diverged"], cells["failed"]) == ("2", "0", "0") and cells["code"] == "abc123def"
    hc2 = dict(zip(header, (c.strip() for c in next(l for l in table if l.startswith("| hc | 2 |")).split("|")[1:])))
    assert (hc2["finished"], hc2["failed"]) == ("2", "1") and hc2["val bits/byte"].startswith("2.1500")
    assert cells["val bits/byte"] == f"2.1500 ± {math.sqrt(0.005):.4f}"  # val bpb 2.1 and 2.2: mean, sample std
    assert cells["composite Amax fwd (worst token, peak)"].startswith("37 ± 0")  # peak Amax 1 + 9 * 4 = 37
    spikes = next(v for h, v in cells.items() if h.startswith("grad spikes"))
    assert "1 ± 0" in spikes or "1 ±" in spikes  # one grad spike in each hc run
    mhc2 = next(l for l in table if l.startswith("| mhc | 2 |"))
    assert "| 1 ± 0 |" in mhc2
    for png in ("bpb_vs_depth", "amax_vs_depth", "amax_over_training", "amax_vs_layer", "grad_norm", "val_bpb_curves"):
        assert (out / f"{png}.png").stat().st_size > 5000
    text = rep.read_text()
    assert (
        "mhc compare --experiment grid" in text
        and "hand-written text" in text
        and "](results/amax_vs_depth.png)" in text
    )


def test_report_names_missing_group_tags(mlflow_uri, tmp_path, capsys):
    make_runs(mlflow_uri)
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "report",
                "--experiment",
                "grid",
                "--group-by",
                "variant,depth",
                "--tracking-uri",
                mlflow_uri,
                "--out",
                str(tmp_path / "r"),
            ]
        )
    assert exc.value.code == 2
    assert "depth" in capsys.readouterr().err


def make_effect_runs(uri: str, code: dict[str, str] = None, experiment: str = "effects"):
    """residual / mhc / hc at one depth over 6 seeds: mhc lower by 0.03 under a seed spread of 0.05, hc equal to the
    residual; `code` gives some runs (by name) another mhc.code tag."""
    import random

    rng, client = random.Random(5), mlflow.MlflowClient(uri)
    exp = client.create_experiment(experiment)
    for seed in range(1, 7):
        shared = rng.gauss(0, 0.05)
        for variant, effect in (("residual", 0.0), ("mhc", -0.03), ("hc", 0.0)):
            name = f"{variant}-s{seed}"
            tags = {
                "variant": variant,
                "model.arch.n_layers": "4",
                "seed_everything": str(seed),
                "mhc.code": (code or {}).get(name, "abc123def"),
            }
            rid = client.create_run(exp, run_name=name, tags=tags).info.run_id
            client.log_metric(rid, "val/bpb", 2.0 + shared + effect + rng.gauss(0, 0.003), step=10)
            client.set_terminated(rid, "FINISHED")


def test_report_baseline_prints_paired_intervals(mlflow_uri, tmp_path, capsys):
    make_effect_runs(mlflow_uri)
    out, rep = tmp_path / "r", tmp_path / "report.md"
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "report",
                "--experiment",
                "effects",
                "--group-by",
                "variant,model.arch.n_layers",
                "--baseline",
                "residual",
                "--tracking-uri",
                mlflow_uri,
                "--out",
                str(out),
                "--report",
                str(rep),
            ]
        )
    assert exc.value.code == 0
    rows = {r["variant"]: r for r in md_table(out / "vs_residual.md")}
    assert set(rows) == {"hc", "mhc"}
    mhc, hc = rows["mhc"], rows["hc"]
    assert mhc["verdict"] == "lower" and mhc["test"] == "paired by seed, n=6" and float(mhc["difference"]) < 0
    low, high = (float(x) for x in mhc["95% CI"].strip("[]").split(","))
    assert low < -0.03 < high < 0
    assert hc["verdict"] == "cannot tell apart" and hc["left out"] == "none" and hc["diverged"] == "0/6 vs 0/6"
    assert "abc123def" in (out / "groups.md").read_text()  # the code each group ran
    printed = capsys.readouterr().out
    assert "difference in val_bpb to residual" in printed and "cannot tell apart" in printed
    text = rep.read_text()
    assert "paired by seed" in text and "record where their data seed came from" in text  # runs without the tag


def test_report_refuses_to_pool_runs_of_different_code(mlflow_uri, tmp_path, capsys):
    make_effect_runs(mlflow_uri, code={"mhc-s2": "abc123def+1234abcd", "mhc-s5": "0f0f0f0f0"})
    args = [
        "report",
        "--experiment",
        "effects",
        "--group-by",
        "variant,model.arch.n_layers",
        "--tracking-uri",
        mlflow_uri,
        "--out",
        str(tmp_path / "r"),
    ]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "mhc-s2 (abc123def+1234abcd)" in err and "mhc-s5 (0f0f0f0f0)" in err and "--allow-mixed-code" in err
    with pytest.raises(SystemExit) as exc:
        main(args + ["--allow-mixed-code"])
    assert exc.value.code == 0
    # runs of unknown code (no provenance) are each their own code state: never pooled as one
    make_effect_runs(mlflow_uri, code={"hc-s1": "unknown", "hc-s2": "unknown"}, experiment="unknowns")
    with pytest.raises(SystemExit) as exc:
        main([a if a != "effects" else "unknowns" for a in args])
    assert exc.value.code == 2 and "hc-s1 (unknown:" in capsys.readouterr().err


def test_baseline_needs_group_by(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--experiment", "x", "--baseline", "residual"])
    assert exc.value.code == 2 and "--baseline needs --group-by" in capsys.readouterr().err


def test_lr_scan_report_compares_each_variant_at_its_best_lr(mlflow_uri, tmp_path):
    """Known curves: the residual is best at 2e-3 and diverges at 8e-3; mHC is best at 4e-3 and trains at 8e-3."""
    client = mlflow.MlflowClient(mlflow_uri)
    exp = client.create_experiment("lrs")
    curve = {
        "residual": {1e-3: 2.10, 2e-3: 2.00, 4e-3: 2.05, 8e-3: 7.5},
        "mhc": {1e-3: 2.12, 2e-3: 2.02, 4e-3: 1.96, 8e-3: 2.20},
    }
    for variant, by_lr in curve.items():
        for lr, bpb in by_lr.items():
            for seed in (1, 2, 3):
                rid = client.create_run(
                    exp,
                    run_name=f"{variant}-lr{lr}-s{seed}",
                    tags={"variant": variant, "model.optim.lr": str(lr), "seed_everything": str(seed), "mhc.code": "c"},
                ).info.run_id
                client.log_metric(rid, "val/bpb", bpb + 0.01 * seed, step=5)
                client.set_terminated(rid, "FINISHED")
    out, rep = tmp_path / "r", tmp_path / "r.md"
    with pytest.raises(SystemExit) as exc:
        main(
            [
                "report",
                "--experiment",
                "lrs",
                "--group-by",
                "variant,model.optim.lr",
                "--baseline",
                "residual",
                "--tracking-uri",
                mlflow_uri,
                "--out",
                str(out),
                "--report",
                str(rep),
            ]
        )
    assert exc.value.code == 0
    lines = (out / "lr_sensitivity.md").read_text().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {
        r["variant"]: r for r in (dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:])
    }
    assert rows["residual"]["best lr"] == "0.002" and rows["residual"]["highest lr that trains"] == "0.004"
    assert rows["residual"]["diverged at"] == "0.008"
    assert rows["mhc"]["best lr"] == "0.004" and rows["mhc"]["highest lr that trains"] == "0.008"
    assert rows["mhc"]["val bits/byte at best lr"] == "1.9800 ± 0.0100"
    diff = (out / "vs_residual.md").read_text()  # mhc at 4e-3 against the residual at 2e-3, paired by seed
    assert "-0.0400" in diff and "paired by seed, n=3" in diff
    assert (out / "lr_sensitivity.png").stat().st_size > 5000 and (out / "at_best_lr.md").exists()
    assert "Learning-rate sensitivity" in rep.read_text()


def test_seed_note_says_what_the_seed_spread_covers():
    from mhc_lightning.reports.grouped import seed_note
    from mhc_lightning.reports.runs import RunData

    def run(source, seed="1"):
        tags = {"seed_everything": seed} | ({} if source is None else {"mhc.data.seed_source": source})
        return RunData("id", "r", "FINISHED", "0", {}, tags, {})

    assert "the initialisation and the data order" in seed_note([run("seed_everything")] * 2)
    seeds = [run("seed_everything", s) for s in "12"]
    assert "the initialisation and the data order" in seed_note(seeds, {("mhc",): seeds})
    replicates = [run("seed_everything")] * 2
    assert "run-to-run spread" in seed_note(replicates, {("mhc",): replicates})
    assert "initialisation only" in seed_note([run("seed_everything"), run(None)])
    assert "data.seed" in seed_note([run("data.seed")])


def test_the_confirmation_grid_needs_a_whole_scan_and_a_best_lr_inside_it(mlflow_uri, tmp_path, capsys):
    """scripts/lr_confirm_grid.py: each variant at its best lr on fresh seeds, refused while a (variant, lr) of the scan
    lacks a seed's run, or while a variant's best lr is an end of the scanned range."""
    import importlib.util

    import yaml
    from helpers import REPO

    spec = importlib.util.spec_from_file_location("lr_confirm_grid", REPO / "scripts" / "lr_confirm_grid.py")
    confirm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(confirm)
    scan = tmp_path / "scan.yaml"
    scan.write_text(
        yaml.safe_dump(
            {
                "experiment": "lrs",
                "configs": ["conf/experiments/stability.yaml"],
                "variants": {"residual": {"model.arch.hyper.residual_mode": "residual"}, "mhc": None},
                "axes": {"model.optim.lr": [1e-3, 2e-3, 4e-3], "model.arch.n_layers": [24], "seed_everything": [1, 2]},
            }
        )
    )
    client = mlflow.MlflowClient(mlflow_uri)
    exp = client.create_experiment("lrs")

    def scanned(curve: dict) -> None:
        for variant, by_lr in curve.items():
            for lr, bpb in by_lr.items():
                for seed in (1, 2):
                    tags = {"variant": variant, "model.optim.lr": str(lr), "seed_everything": str(seed)}
                    rid = client.create_run(exp, run_name=f"{variant}-lr{lr}-s{seed}", tags=tags).info.run_id
                    client.log_metric(rid, "val/bpb", bpb + 0.01 * seed, step=5)
                    client.set_terminated(rid, "FINISHED")

    scanned({"residual": {1e-3: 2.1, 2e-3: 2.0, 4e-3: 2.05}, "mhc": {1e-3: 2.1, 2e-3: 2.0}})
    assert confirm.main(mlflow_uri, str(scan)) == 1
    assert "the scan is not complete (finished or diverged runs): mhc at 0.004: 0 of 2" in capsys.readouterr().err
    scanned({"mhc": {4e-3: 1.9}})  # mHC's best is the largest lr scanned
    assert confirm.main(mlflow_uri, str(scan)) == 1
    assert "best lr at an end of the scan (0.001 .. 0.004): mhc at 0.004" in capsys.readouterr().err
    scan.write_text(scan.read_text().replace("- 0.004", "- 0.004\n  - 0.008"))
    scanned({"residual": {8e-3: 7.5}, "mhc": {8e-3: 2.2}})  # the residual diverges at 8e-3
    assert confirm.main(mlflow_uri, str(scan)) == 0
    grid = yaml.safe_load(capsys.readouterr().out)
    assert grid["experiment"] == "lr-confirm" and grid["axes"]["seed_everything"] == list(range(3, 11))
    assert grid["variants"] == {
        "residual": {"model.arch.hyper.residual_mode": "residual", "model.optim.lr": 0.002},
        "mhc": {"model.optim.lr": 0.004},
    }
