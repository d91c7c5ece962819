"""`mhc report` on what ran and what became of it: replicates are not seeds, diverged and failed runs are counted and
shown, groups by any setting in `mhc fit` spelling on plain fits, groups whose runs differ in another setting flagged.
Synthetic runs written straight into a SQLite MLflow store."""

import math

import mlflow
import pytest
from helpers import md_table
from scipy.stats import fisher_exact

from mhc_lightning.reports.cli import main


def _run(client, exp, name, params, bpb, status="FINISHED", tags=None):
    """A plain `mhc fit` run as it is logged: settings as params under their CLI names, no grid tags."""
    rid = client.create_run(exp, run_name=name, tags={"mhc.code": "abc123def", **(tags or {})}).info.run_id
    for k, v in params.items():
        client.log_param(rid, k, str(v))
    if bpb is not None:
        client.log_metric(rid, "val/loss", bpb * math.log(2), step=20)
        client.log_metric(rid, "val/bpb", bpb, step=20)
    client.set_terminated(rid, status)
    return rid


def _report(uri, tmp_path, experiment, group_by, *extra):
    out = tmp_path / experiment
    code = main(
        ["--experiment", experiment, "--group-by", group_by, "--tracking-uri", uri, "--out", str(out), *extra],
        prog="mhc report",
    )
    assert code == 0
    return out


def test_a_replicate_only_group_gives_no_verdict(mlflow_uri, tmp_path):
    """Four replicates of one seed per variant: the 0.1 gap is not judged (Welch on the runs called it 'lower' with
    p < 0.001); the test cell says why in one line and shows the replicate spread."""
    client = mlflow.MlflowClient(mlflow_uri)
    exp = client.create_experiment("reps")
    mode = "model.arch.hyper.residual_mode"
    for variant, base in (("residual", 2.1), ("mhc", 2.0)):
        for r, noise in enumerate((0.0, 0.001, -0.001, 0.0005)):
            _run(client, exp, f"{variant}-r{r}", {mode: variant, "seed_everything": 1}, base + noise)
    out = _report(mlflow_uri, tmp_path, "reps", mode, "--baseline", "residual")
    (row,) = md_table(out / "vs_residual.md")
    assert row["verdict"] == "no verdict" and row["difference"] == "–"
    assert row["test"].startswith("group has one seed (4 runs): replicate SD 0.00")


def test_diverged_and_failed_runs_are_counted_shown_and_compared(mlflow_uri, tmp_path, capsys):
    """hc: two finished runs, one that ended FINISHED with a NaN loss, one FAILED with the divergence tag, one FAILED
    for another reason. Each is counted for what it is, the means are over the finished runs, the comparison says
    what it left out, and the divergence rates are compared by Fisher's exact test."""
    client = mlflow.MlflowClient(mlflow_uri)
    exp = client.create_experiment("div")
    mode = "model.arch.hyper.residual_mode"
    for seed in (1, 2, 3, 4):
        _run(client, exp, f"residual-s{seed}", {mode: "residual", "seed_everything": seed}, 2.0 + 0.01 * seed)
    for seed in (1, 2):
        _run(client, exp, f"hc-s{seed}", {mode: "hc", "seed_everything": seed}, 2.05 + 0.01 * seed)
    _run(client, exp, "hc-s3", {mode: "hc", "seed_everything": 3}, float("nan"))
    _run(
        client,
        exp,
        "hc-s4",
        {mode: "hc", "seed_everything": 4},
        None,
        status="FAILED",
        tags={"mhc.diverged": "true", "mhc.diverged_step": "17"},
    )
    _run(client, exp, "hc-s5", {mode: "hc", "seed_everything": 5}, None, status="FAILED")
    out = _report(mlflow_uri, tmp_path, "div", mode, "--baseline", "residual", "--report", str(tmp_path / "r.md"))
    groups = {r[mode]: r for r in md_table(out / "groups.md")}
    assert (groups["hc"]["finished"], groups["hc"]["diverged"], groups["hc"]["failed"]) == ("2", "2", "1")
    assert groups["hc"]["val bits/byte"].startswith("2.0650 ± ")  # the two finished runs
    assert groups["residual"]["finished"] == "4" and groups["residual"]["diverged"] == "0"
    (row,) = md_table(out / "vs_residual.md")
    assert row["left out"] == "group: 2 diverged, 1 failed" and row["test"] == "paired by seed, n=2"
    assert row["diverged"] == "2/4 vs 0/4"
    assert float(row["divergence p (Fisher exact)"]) == pytest.approx(fisher_exact([[2, 2], [0, 4]]).pvalue, rel=1e-3)
    printed = capsys.readouterr().out
    assert "9 runs: 6 finished, 2 diverged, 1 failed." in printed
    assert "diverged in hc: hc-s3, hc-s4 (step 17)" in printed
    text = (tmp_path / "r.md").read_text()
    assert "over the finished runs" in text and "diverged in hc" in text and "Fisher" in text


def test_plain_fits_group_by_a_cli_key_and_differing_settings_are_flagged(mlflow_uri, tmp_path):
    """Quickstart-style fits (no grid tags) grouped by model.arch.hyper.residual_mode, one of them from a store
    that logged the old names (arch/hyper/residual_mode); a run with another trainer.max_time flags its group."""
    client = mlflow.MlflowClient(mlflow_uri)
    exp = client.create_experiment("plain")
    mode = "model.arch.hyper.residual_mode"
    common = {"model.optim.lr": 0.001, "trainer.max_time": "None", "data.seed": 1}
    for seed in (1, 2, 3):
        _run(client, exp, f"res-{seed}", {**common, mode: "residual", "seed_everything": seed}, 2.2 + 0.01 * seed)
        _run(client, exp, f"mhc-{seed}", {**common, mode: "mhc", "seed_everything": seed}, 2.1 + 0.01 * seed)
    old = {"arch/hyper/residual_mode": "hc", "optim/lr": "0.001", "trainer/max_time": "None", "_instantiator": "x"}
    _run(client, exp, "hc-1", {**old, "seed_everything": 1, "data/seed": 1}, 2.3)
    _run(client, exp, "hc-2", {**old, "trainer/max_time": "60.0", "seed_everything": 2, "data/seed": 2}, 2.3)
    out = _report(mlflow_uri, tmp_path, "plain", mode, "--baseline", "residual")
    groups = {r[mode]: r for r in md_table(out / "groups.md")}
    assert set(groups) == {"hc", "mhc", "residual"} and groups["hc"]["finished"] == "2"
    assert groups["hc"]["settings that differ"] == "trainer.max_time" and groups["mhc"]["settings that differ"] == "–"
    rows = {r[mode]: r for r in md_table(out / "vs_residual.md")}
    assert rows["mhc"]["verdict"] == "lower" and rows["mhc"]["test"] == "paired by seed, n=3"


def test_nats_per_token_are_not_compared_across_tokenizers(mlflow_uri, tmp_path, capsys):
    """A BPE run and a byte run: bits per byte are compared (and the report says why only they are), nats per token
    are refused in one line."""
    client = mlflow.MlflowClient(mlflow_uri)
    exp = client.create_experiment("tok")
    mode = "model.arch.hyper.residual_mode"
    for seed in (1, 2):
        _run(client, exp, f"bytes-s{seed}", {mode: "residual", "seed_everything": seed}, 2.0 + 0.01 * seed)
        bpe = {"mhc.data.tokenizer_sha256": "ab" * 32, "mhc.data.tokenizer": "tokenizer.json"}
        _run(client, exp, f"bpe-s{seed}", {mode: "mhc", "seed_everything": seed}, 1.9 + 0.01 * seed, tags=bpe)
    _report(mlflow_uri, tmp_path, "tok", mode, "--baseline", "residual")
    assert "bits per byte compare across them, nats per token do not" in capsys.readouterr().out
    code = main(["--experiment", "tok", "--group-by", mode, "--tracking-uri", mlflow_uri, "--out", str(tmp_path / "x"),
                 "--baseline", "residual", "--metric", "val_loss"], prog="mhc report")  # fmt: skip
    assert code == 2 and "val_loss is nats per token of each one's tokens" in capsys.readouterr().err


def test_a_group_of_one_run_shows_its_value_and_each_report_has_its_own_folder(mlflow_uri, tmp_path, monkeypatch):
    """One mHC run beside two residual runs: its cells are its values, not "± 0.0000"; a comparison of a metric the
    runs lack says so. Without --out, `mhc report` and `mhc compare` of one experiment write into folders of their own
    under reports/."""
    client = mlflow.MlflowClient(mlflow_uri)
    exp = client.create_experiment("one")
    mode = "model.arch.hyper.residual_mode"
    for seed in (1, 2):
        _run(client, exp, f"res-{seed}", {mode: "residual", "seed_everything": seed}, 2.2 + 0.01 * seed)
    _run(client, exp, "mhc-1", {mode: "mhc", "seed_everything": 1}, 2.15)
    monkeypatch.chdir(tmp_path)
    amax = ["--baseline", "residual", "--metric", "amax_bwd_peak"]
    assert (
        main(["--experiment", "one", "--group-by", mode, "--tracking-uri", mlflow_uri, *amax], prog="mhc report") == 0
    )
    assert main(["--experiment", "one", "--tracking-uri", mlflow_uri, "--no-log"]) == 0
    grouped = tmp_path / "reports" / "one" / f"by_{mode}"
    groups = {r[mode]: r for r in md_table(grouped / "groups.md")}
    assert groups["mhc"]["val bits/byte"] == "2.1500" and groups["residual"]["val bits/byte"].startswith("2.2150 ± ")
    assert "±" not in "".join(groups["mhc"].values())
    (row,) = md_table(grouped / "vs_residual.md")
    assert row["verdict"] == "no verdict" and row["test"] == "group has no amax_bwd_peak"
    assert (tmp_path / "reports" / "one" / "runs.md").is_file() and not (tmp_path / "reports" / "grouped").exists()
