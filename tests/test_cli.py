"""`mhc fit|validate|test` end to end: MLflow runs with params, metrics and artifacts; configs; errors."""

import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import lightning.pytorch as pl
import mlflow
import pytest
import yaml
from helpers import CONF, fast_first, tiny_fit_args

from mhc_lightning.errors import UserError
from mhc_lightning.fit.cli import TOOLS, TRAINER_COMMANDS, build_cli, main
from mhc_lightning.loggers.tags import CHECKPOINT_TAG, SOURCE_RUN_TAG
from mhc_lightning.model.modes import RESIDUAL_MODES


def runs_of(uri: str, experiment: str = "tests"):
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id]) if exp else []


def artifact_paths(client, run_id: str, path: str = "") -> list[str]:
    out = []
    for a in client.list_artifacts(run_id, path):
        out += artifact_paths(client, run_id, a.path) if a.is_dir else [a.path]
    return out


def test_diagnostics_are_logged_at_the_steps_they_were_taken(tiny_corpus, mlflow_uri, tmp_path):
    """Every diagnostics step reaches MLflow under its own step, whatever the logger's flush cadence (through
    self.log, k = 7 with a flush every 10 steps had logged step 7's values as step 9 and lost step 0's), and the
    per-layer artifact is named after the step it was recorded at."""
    main(
        tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / "root", steps=16)
        + ["--model.diagnostics_every=7", "--trainer.log_every_n_steps=10", "--trainer.val_check_interval=16"]
    )
    client, (run,) = runs_of(mlflow_uri)
    for key in ("amax/composite_bwd_max", "streams/spread_last", "hres/dist_identity"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [0, 7, 14], key
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [9, 15]
    arts = artifact_paths(client, run.info.run_id, "diagnostics")
    assert "diagnostics/per_layer_step0000014.json" in arts


@fast_first("mode", ["residual", "hc", "mhc", "identity"])
def test_fit_writes_an_mlflow_run(mode, tiny_corpus, mlflow_uri, tmp_path):
    main(tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / "root", mode=mode, run_name=f"fit-{mode}"))
    client, runs = runs_of(mlflow_uri)
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == f"fit-{mode}"
    assert run.data.params["model.arch.hyper.residual_mode"] == mode
    assert run.data.params["model.arch.vocab_size"] == "256"  # linked from the datamodule
    assert run.data.params["model.arch.context"] == "32"  # linked from data.seq_len
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
    assert not any(a.endswith(".ckpt") for a in arts) and list(
        (tmp_path / "root").glob("*/*/checkpoints/last.ckpt")
    )  # one copy (log_model: false)
    if mode != "residual":
        assert any(a.startswith("diagnostics/amax_per_layer") and a.endswith(".png") for a in arts)
    cfg = yaml.safe_load(
        Path(
            mlflow.artifacts.download_artifacts(
                run_id=run.info.run_id, artifact_path="config.yaml", tracking_uri=mlflow_uri
            )
        ).read_text()
    )
    assert cfg["model"]["arch"]["hyper"]["residual_mode"] == mode


@pytest.mark.slow
def test_validate_and_test_subcommands_open_their_own_runs(tiny_corpus, mlflow_uri, tmp_path, capsys):
    args = tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / "root", mode="mhc", run_name="quick")
    args.append("--model.diagnostics_every=0")  # no per-layer figures: seconds, and nothing here reads them
    main(args)
    _, runs = runs_of(mlflow_uri)
    source = runs[0].info.run_id
    # The run that wrote it is recorded in the checkpoint itself: found wherever the file was moved to.
    ckpt = tmp_path / "elsewhere" / "model.ckpt"
    ckpt.parent.mkdir()
    shutil.copy(next((tmp_path / "root").rglob("last.ckpt")), ckpt)
    capsys.readouterr()
    for sub in ("validate", "test"):
        main([sub] + args[1:] + [f"--ckpt_path={ckpt}"])
        out = capsys.readouterr().out
        assert f"final metrics: {'val' if sub == 'validate' else 'test'}/bpb=" in out
    client, runs = runs_of(mlflow_uri)
    by_stage = {r.data.tags.get("stage"): r for r in runs}
    assert sorted(by_stage) == ["fit", "test", "validate"]
    assert by_stage["fit"].info.run_name == "quick" and by_stage["fit"].info.run_id == source
    for sub in ("validate", "test"):
        run = by_stage[sub]
        assert run.info.run_name == f"quick-{sub}" and run.info.status == "FINISHED"
        assert run.data.tags[SOURCE_RUN_TAG] == source and run.data.tags[CHECKPOINT_TAG] == str(ckpt)
        assert f"{'val' if sub == 'validate' else 'test'}/bpb" in run.data.metrics
    assert "mhc.source_run_id" not in by_stage["fit"].data.tags


SHIPPED = sorted(p for p in CONF.rglob("*.yaml") if "experiments" not in p.parts)


@fast_first("path", SHIPPED, ids=lambda p: str(p.relative_to(CONF)))
def test_every_shipped_config_parses(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    extra = [] if path.name in ("base.yaml", "quickstart.yaml") else ["-c", str(CONF / "base.yaml")]
    if path.name == "fsdp.yaml":  # Lightning refuses FSDP on CPU; tests/test_distributed.py checks this preset
        extra += ["--trainer.strategy=auto"]
    cli = build_cli(
        extra[:2]
        + ["-c", str(path)]
        + extra[2:]
        + ["--trainer.logger=false", "--trainer.accelerator=cpu", "--trainer.precision=32-true"],
        run=False,
    )
    assert cli.model.arch.hyper.residual_mode in RESIDUAL_MODES
    # jsonargparse reads `limit_val_batches: 1` as the float 1.0, i.e. 100 % of the batches: never ship it
    raw = yaml.safe_load(path.read_text()) or {}
    assert (raw.get("trainer") or {}).get("limit_val_batches") != 1


def test_interpolation_follows_later_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = build_cli(
        [
            "-c",
            str(CONF / "base.yaml"),
            "-c",
            str(CONF / "model" / "hc.yaml"),
            "--model.arch.d_model=64",
            "--trainer.logger.init_args.tracking_uri=sqlite:///x.db",
        ],
        run=False,
    )
    assert cli.trainer.logger._run_name == "hc-L4-C64"


@fast_first(
    "arg,message",
    [
        ("--model.arch.hyper.residual_mode=dense", "residual_mode"),
        ("--model.arch.hyper.n_streams=0", "model.arch.hyper.n_streams must be >= 1"),
        ("--model.arch.hyper.sinkhorn_iters=0", "model.arch.hyper.sinkhorn_iters must be >= 1"),
        ("--model.arch.n_heads=3", "model.arch.d_model must be divisible by n_heads"),
        ("--model.optim.lr=-0.1", "model.optim.lr must be > 0"),
        (
            "--model.optim.fused=true --trainer.precision=16-mixed",
            "model.optim.fused=true needs a precision without loss scaling, not trainer.precision=16-mixed",
        ),
        ("--model.arch.hyper.bias_init=ones", "bias_init"),
        (
            "--model.compile=true --model.arch.hyper.chain_sublayers=true",
            "model.compile=true with model.arch.hyper.chain_sublayers=true is refused",
        ),
        ("--model.arch.hyper.chain_sublayers=sometimes", "chain_sublayers"),
        (
            "--model.compile=true --model.arch.hyper.rebuild_branch_input=true",
            "model.compile=true with model.arch.hyper.rebuild_branch_input=true is refused",
        ),
        (
            "--model.arch.recompute_block=2 --model.arch.hyper.rebuild_branch_input=true",
            "recompute_block=2 with hyper.rebuild_branch_input=true is refused",
        ),
        ("--model.compile_mode=fast", "model.compile_mode: 'fast' is not a torch.compile mode; allowed: default,"),
    ],
)
def test_bad_values_fail_at_parse_time(arg, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["fit", "-c", str(CONF / "base.yaml"), *arg.split()])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert message in err
    if "residual_mode" in arg:
        assert "'residual', 'hc', 'mhc', 'identity'" in err


# ---- discoverability -------------------------------------------------------------------------------------


@fast_first("argv", [[], ["--help"], ["-h"]])
def test_help_lists_every_command_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in [*TRAINER_COMMANDS, *TOOLS, "sweep", "compare", "report", "grid"]:
        lines = [ln for ln in out.splitlines() if ln.split()[:1] == [name]]
        assert len(lines) == 1 and len(lines[0].split()) > 2, (name, out)  # the name, then what it does
    assert "predict" not in out  # no predict data or writer: not offered


@fast_first("command", [*TRAINER_COMMANDS, *TOOLS])
def test_every_command_has_its_own_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: mhc") and command in out.splitlines()[0]


def test_unknown_command_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["predict", "-c", str(CONF / "base.yaml")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "mhc: error: unknown command 'predict'; the commands are fit, validate, test, sweep, compare, "
        "report, prepare, grid, export (`mhc --help` says what each does)"
    )


def test_user_error_from_a_tool_is_one_line(monkeypatch, capsys):
    """Any UserError a tool lets through (e.g. an unreachable tracking server) is printed as one line, exit 2."""
    import mhc_lightning.reports.cli as compare

    class ServerDown(UserError):
        pass

    def down(argv):
        raise ServerDown("MLflow tracking server http://127.0.0.1:1 is unreachable; start it or pass --tracking-uri")

    monkeypatch.setattr(compare, "main", down)
    with pytest.raises(SystemExit) as exc:
        main(["compare", "--experiment", "x"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "mhc compare: error: MLflow tracking server http://127.0.0.1:1 is "
        "unreachable; start it or pass --tracking-uri\n"
    )


@pytest.mark.slow
def test_console_script_help():
    exe = Path(sys.executable).with_name("mhc")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == ""
    assert all(f"  {name} " in out.stdout for name in [*TRAINER_COMMANDS, *TOOLS])


# ---- the end of a fit: a last validation, and how to look at the run --------------------------------------


@fast_first(
    "steps,interval,validated_at",
    [
        (3, 2, [2, 3]),  # not a multiple: one more validation at the end
        pytest.param(4, 2, [2, 4], marks=pytest.mark.slow),  # a multiple: the last validation is not repeated
        pytest.param(2, 100, [2], marks=pytest.mark.slow),  # below the interval: the only validation
    ],
)
def test_fit_ends_with_one_validation_of_the_final_weights(
    steps, interval, validated_at, tiny_corpus, mlflow_uri, tmp_path
):
    args = tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / "root", steps=steps)[1:]
    # no per-layer diagnostics: their figures cost seconds per validation, and nothing here reads them
    cli = build_cli(args + [f"--trainer.val_check_interval={interval}", "--model.diagnostics_every=0"], run=False)
    seen = []

    class Spy(pl.Callback):
        def on_validation_end(self, trainer, pl_module):
            if not trainer.sanity_checking:
                seen.append(trainer.global_step)

    cli.trainer.callbacks.append(Spy())
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert seen == validated_at  # the last step validated exactly once
    assert "val/loss" in cli.trainer.progress_bar_metrics
    client, runs = runs_of(mlflow_uri)
    history = client.get_metric_history(runs[0].info.run_id, "val/loss")
    assert len(history) == len(validated_at)
    assert history[-1].value == pytest.approx(float(cli.trainer.callback_metrics["val/loss"]))


def _free_port(low: int = 5400, high: int = 5500) -> int:
    for port in range(low, high):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    pytest.skip("no free port in 5400-5499")


@pytest.mark.slow
def test_printed_ui_hint_runs_as_printed(tiny_corpus, tmp_path, _mlflow_template):
    """The installed `mhc` entry point, as a user runs it: `mhc fit` in one folder with the default relative
    ./mlflow.db; its `view it:` command, run exactly as printed from another folder, with no venv on PATH, serves
    that run, FINISHED."""
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir(), elsewhere.mkdir()
    shutil.copy(_mlflow_template, work / "mlflow.db")  # a migrated store: migrations cost seconds
    exe = Path(sys.executable).with_name("mhc")
    # no diagnostics: their figures cost seconds and the hint does not depend on them
    args = [*tiny_fit_args(tiny_corpus, "sqlite:///mlflow.db", work / "runs", steps=2), "--model.diagnostics_every=0"]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    fit = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, cwd=work, env=env)
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "val/bpb=" in fit.stdout
    run_id = fit.stdout.split("MLflow run ", 1)[1].split()[0]
    # started from a folder outside the checkout: the run still names the code it ran (callbacks/run_provenance.py)
    from mhc_lightning.provenance import run_code

    run = mlflow.MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_run(run_id)
    tags, params = run.data.tags, run.data.params
    # the data seed followed seed_everything (conf/base.yaml: 1234), and the logged hyperparameter says so
    assert params["data.seed"] == params["seed_everything"] == "1234"
    assert tags["mhc.git.commit"] == run_code().commit and tags["mhc.code"] == run_code().label
    assert tags["mhc.env.torch"] and tags["mhc.data.train_sha256"]
    hint = next(ln for ln in fit.stdout.splitlines() if ln.startswith("view it:"))
    command = hint[len("view it:") :].split("   (then open")[0].strip()
    port = _free_port()
    bare = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "MLFLOW_PORT": str(port)}
    ui = subprocess.Popen(
        shlex.split(command),
        cwd=elsewhere,
        env=bare,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline, body = time.time() + 120, None
        while time.time() < deadline and ui.poll() is None:
            try:
                url = f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/get?run_id={run_id}"
                body = urllib.request.urlopen(url, timeout=5).read().decode()
                break
            except OSError:
                time.sleep(0.25)
        assert body is not None, ui.stderr.read().decode()[-3000:] if ui.poll() is not None else "no answer"
        assert run_id in body and '"status": "FINISHED"' in body.replace('"status":"', '"status": "')
    finally:
        os.killpg(ui.pid, 15)
        ui.wait(timeout=30)
