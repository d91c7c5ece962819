"""`mhc fit|validate|test` end to end: MLflow runs with params, metrics and artifacts; configs; errors."""
import os
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import yaml

from helpers import CONF, REPO, mlflow_logger_arg, tiny_fit_args
from mhc_lightning.cli import build_cli, main
from mhc_lightning.data import CorpusError


def runs_of(uri: str, experiment: str = "tests"):
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id]) if exp else []


def artifact_paths(client, run_id: str, path: str = "") -> list[str]:
    out = []
    for a in client.list_artifacts(run_id, path):
        out += artifact_paths(client, run_id, a.path) if a.is_dir else [a.path]
    return out


@pytest.mark.parametrize("mode", ["residual", "hc", "mhc", "identity"])
def test_fit_writes_an_mlflow_run(mode, tiny_corpus, mlflow_uri, tmp_path):
    main(tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / "root", mode=mode, run_name=f"fit-{mode}"))
    client, runs = runs_of(mlflow_uri)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == f"fit-{mode}"
    assert run.data.params["arch/hyper/residual_mode"] == mode
    assert run.data.params["arch/vocab_size"] == "256"  # linked from the datamodule
    assert run.data.params["arch/context"] == "32"  # linked from data.seq_len
    m = run.data.metrics
    for key in ("train/loss", "train/grad_norm", "train/lr", "val/loss", "val/bpb", "val/ppl"):
        assert key in m, key
    if mode != "residual":
        assert {"amax/composite_fwd_max", "amax/composite_bwd_max", "sinkhorn/col_residual_max"} <= m.keys()
        history = client.get_metric_history(run.info.run_id, "amax/composite_bwd_max")
        assert len(history) >= 2
    if mode == "mhc":
        assert abs(m["amax/composite_fwd_max"] - 1) < 1e-4
    if mode == "hc":  # HC at init is a pre-norm residual: gains start at exactly 1
        assert abs(m["amax/composite_fwd_max"] - 1) < 0.5
    arts = artifact_paths(client, run.info.run_id)
    assert "config.yaml" in arts
    assert not any(a.endswith(".ckpt") for a in arts) and list((tmp_path / "root").glob("*/*/checkpoints/last.ckpt"))  # one copy (log_model: false)
    if mode != "residual":
        assert any(a.startswith("diagnostics/amax_per_layer") and a.endswith(".png") for a in arts)
    cfg = yaml.safe_load(Path(mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, artifact_path="config.yaml", tracking_uri=mlflow_uri)).read_text())
    assert cfg["model"]["arch"]["hyper"]["residual_mode"] == mode


@pytest.mark.slow
def test_validate_and_test_subcommands_open_their_own_runs(tiny_corpus, mlflow_uri, tmp_path):
    args = tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / "root", mode="mhc")
    main(args)
    _, runs = runs_of(mlflow_uri)
    ckpt = next((tmp_path / "root").rglob("last.ckpt"))
    for sub in ("validate", "test"):
        main([sub] + args[1:] + [f"--ckpt_path={ckpt}"])
    client, runs = runs_of(mlflow_uri)
    stages = sorted(r.data.tags.get("stage", "") for r in runs)
    assert stages == ["fit", "test", "validate"]
    test_run = next(r for r in runs if r.data.tags.get("stage") == "test")
    assert "test/bpb" in test_run.data.metrics


@pytest.mark.slow
def test_console_script_subprocess(tiny_corpus, mlflow_uri, tmp_path):
    """The installed `mhc` entry point, as a user runs it."""
    exe = Path(sys.executable).with_name("mhc")
    args = tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / "root", mode="mhc", steps=2)
    out = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MLflow run" in out.stdout and "val/bpb=" in out.stdout
    _, runs = runs_of(mlflow_uri)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"


SHIPPED = sorted(p for p in CONF.rglob("*.yaml") if "experiments" not in p.parts)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(CONF)))
def test_every_shipped_config_parses(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    extra = [] if path.name in ("base.yaml", "quickstart.yaml") else ["-c", str(CONF / "base.yaml")]
    if path.name == "fsdp.yaml":  # Lightning refuses FSDP on CPU; tests/test_distributed.py checks this preset
        extra += ["--trainer.strategy=auto"]
    cli = build_cli(extra[:2] + ["-c", str(path)] + extra[2:] + ["--trainer.logger=false", "--trainer.accelerator=cpu",
                             "--trainer.precision=32-true"], run=False)
    assert cli.model.arch.hyper.residual_mode in ("residual", "hc", "mhc", "identity")
    # jsonargparse reads `limit_val_batches: 1` as 1.0 = 100 % (ecosystem-notes §2.4): never ship it
    raw = yaml.safe_load(path.read_text()) or {}
    assert (raw.get("trainer") or {}).get("limit_val_batches") != 1


def test_interpolation_follows_later_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = build_cli(["-c", str(CONF / "base.yaml"), "-c", str(CONF / "model" / "hc.yaml"),
                     "--model.arch.d_model=64", "--trainer.logger.init_args.tracking_uri=sqlite:///x.db"], run=False)
    assert cli.trainer.logger._run_name == "hc-L4-C64"


@pytest.mark.parametrize("arg,message", [
    ("--model.arch.hyper.residual_mode=dense", "residual_mode"),
    ("--model.arch.hyper.n_streams=0", "model.arch.hyper.n_streams must be >= 1"),
    ("--model.arch.hyper.sinkhorn_iters=0", "model.arch.hyper.sinkhorn_iters must be >= 1"),
    ("--model.arch.n_heads=3", "model.arch.d_model must be divisible by n_heads"),
    ("--model.optim.lr=-0.1", "model.optim.lr must be > 0"),
    ("--model.arch.hyper.bias_init=ones", "bias_init"),
])
def test_bad_values_fail_at_parse_time(arg, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "-c", str(CONF / "base.yaml"), arg])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert message in err
    if "residual_mode" in arg:
        assert "'residual', 'hc', 'mhc', 'identity'" in err


def test_missing_corpus_is_a_clear_error(mlflow_uri, tmp_path):
    missing = tmp_path / "no_such_corpus.txt"
    with pytest.raises(CorpusError, match="no_such_corpus"):
        main(tiny_fit_args(missing, mlflow_uri, tmp_path / "root"))


def test_too_short_corpus_is_a_clear_error(mlflow_uri, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be, that is the question. " * 3)
    with pytest.raises(CorpusError, match="short.txt"):
        main(tiny_fit_args(short, mlflow_uri, tmp_path / "root"))
