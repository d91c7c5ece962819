"""Bad inputs to `mhc fit|validate|test`: one line on stderr, exit status 2, and nothing written.

Each case injects one bad input (corpus, checkpoint, config file, value) and checks that the store holds
no run at all (not even a FAILED one), and that no checkpoint folder or artifact folder was created.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
import torch
from helpers import CONF, fast_first, make_text, tiny_fit_args
from mlflow.entities import ViewType

from mhc_lightning.fit.cli import main
from mhc_lightning.fit.input_checks import arch_mismatches, schedule_warnings


def random_bytes(n: int) -> bytes:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(3), dtype=torch.uint8).numpy().tobytes()


def assert_nothing_written(uri: str, cwd: Path, root: Path) -> None:
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiments = client.search_experiments(view_type=ViewType.ALL)
    assert [e.name for e in experiments] == ["Default"]  # the logger never started
    assert client.search_runs([e.experiment_id for e in experiments], run_view_type=ViewType.ALL) == []
    assert not root.exists()  # no checkpoint folder
    assert not (cwd / "mlruns").exists()  # no artifact folder


def one_error_line(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, out.err  # no traceback, no usage text
    assert lines[0].startswith(f"mhc {args[0]}: error: ")
    return lines[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, _mlflow_template) -> dict:
    """A checkpoint of a real 2-step fit (n_layers=2, d_model=32, seq_len=32), with its run id."""
    base = tmp_path_factory.mktemp("trained")
    corpus = base / "corpus.txt"
    corpus.write_text(make_text(60_000, seed=7))
    shutil.copy(_mlflow_template, base / "mlflow.db")  # a migrated store: migrations cost seconds
    uri = f"sqlite:///{base / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(base)
        main(tiny_fit_args(corpus, uri, base / "root", steps=2, experiment="source"))
    client = mlflow.MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("source").experiment_id])[0]
    return {"ckpt": next((base / "root").rglob("last.ckpt")), "run_id": run.info.run_id, "corpus": corpus}


def _write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


CORPUS_CASES = {  # name: (make the corpus under tmp, what the line must say)
    "missing": (lambda t: t / "no_such.txt", "does not exist"),
    "empty": (lambda t: _write(t / "empty.txt", b""), "is empty"),
    "folder_without_txt": (lambda t: _write(t / "notes" / "a.md", "words").parent, "holds no *.txt files"),
    # seq_len 32, batch_size 4: one train batch needs 129 bytes, one val window 33
    "train_shorter_than_a_batch": (lambda t: _write(t / "short.txt", "To be, or not to be. " * 4), "the train split"),
    "val_shorter_than_a_window": (lambda t: _write(t / "v.txt", make_text(400)), "the val split"),  # 5 % tail
    "random_bytes": (lambda t: _write(t / "random.txt", random_bytes(100_000)), "data.allow_binary=true"),
}


@fast_first("case", CORPUS_CASES)
def test_bad_corpus_is_refused_before_the_run(case, mlflow_uri, tmp_path, capsys):
    make, says = CORPUS_CASES[case]
    corpus = make(tmp_path)
    line = one_error_line(tiny_fit_args(corpus, mlflow_uri, tmp_path / "root"), capsys)
    assert str(corpus) in line and says in line
    assert_nothing_written(mlflow_uri, tmp_path, tmp_path / "root")


def test_bad_value_is_refused_before_the_run(tiny_corpus, mlflow_uri, tmp_path, capsys):
    line = one_error_line(tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / "root") + ["--data.batch_size=0"], capsys)
    assert "data.batch_size must be an integer >= 1, got 0" in line
    assert_nothing_written(mlflow_uri, tmp_path, tmp_path / "root")


def _eval_args(sub: str, corpus, uri, root, ckpt=None) -> list[str]:
    args = [sub] + tiny_fit_args(corpus, uri, root)[1:]
    return args + ([f"--ckpt_path={ckpt}"] if ckpt is not None else [])


@fast_first("sub", ["validate", "test", "fit"])
def test_missing_checkpoint(sub, tiny_corpus, mlflow_uri, tmp_path, capsys):
    missing = tmp_path / "gone" / "last.ckpt"
    line = one_error_line(_eval_args(sub, tiny_corpus, mlflow_uri, tmp_path / "root", missing), capsys)
    assert f"checkpoint {missing} does not exist" in line and "--ckpt_path" in line
    assert_nothing_written(mlflow_uri, tmp_path, tmp_path / "root")


def test_evaluation_without_a_checkpoint(tiny_corpus, mlflow_uri, tmp_path, capsys):
    line = one_error_line(_eval_args("validate", tiny_corpus, mlflow_uri, tmp_path / "root"), capsys)
    assert "pass --ckpt_path" in line
    assert_nothing_written(mlflow_uri, tmp_path, tmp_path / "root")


@fast_first("content", [b"not a checkpoint", "zip"])
def test_file_that_is_not_a_checkpoint(content, tiny_corpus, mlflow_uri, tmp_path, capsys):
    fake = tmp_path / "model.ckpt"
    if content == "zip":  # a zip archive, but not one torch.save wrote
        shutil.make_archive(str(tmp_path / "model"), "zip", root_dir=tiny_corpus.parent, base_dir=tiny_corpus.name)
        (tmp_path / "model.zip").rename(fake)
    else:
        fake.write_bytes(content)
    line = one_error_line(_eval_args("test", tiny_corpus, mlflow_uri, tmp_path / "root", fake), capsys)
    assert str(fake) in line and "mhc fit" in line
    assert_nothing_written(mlflow_uri, tmp_path, tmp_path / "root")


def test_architecture_mismatch_names_every_key(trained, mlflow_uri, tmp_path, capsys):
    args = _eval_args("validate", trained["corpus"], mlflow_uri, tmp_path / "root", trained["ckpt"])
    args += [
        "--model.arch.n_layers=3",
        "--model.arch.hyper.residual_mode=hc",
        "--data.seq_len=16",
        "--model.arch.hyper.kernel_backend=torch",
    ]  # a runtime choice, not a mismatch
    line = one_error_line(args, capsys)
    assert f"checkpoint {trained['ckpt']} was trained with another architecture" in line
    for said in (
        "model.arch.n_layers is 3 here but 2 in the checkpoint",
        "model.arch.hyper.residual_mode is hc here but mhc in the checkpoint",
        "data.seq_len is 16 here but 32 in the checkpoint",
    ):
        assert said in line
    assert "kernel_backend" not in line
    assert line.endswith("--model.arch.n_layers=2 --data.seq_len=32 --model.arch.hyper.residual_mode=mhc")
    assert_nothing_written(mlflow_uri, tmp_path, tmp_path / "root")


def test_the_printed_fix_runs(trained, mlflow_uri, tmp_path, capsys):
    """The flags the mismatch line proposes make the same command work."""
    args = _eval_args("validate", trained["corpus"], mlflow_uri, tmp_path / "root", trained["ckpt"])
    line = one_error_line(args + ["--model.arch.n_layers=3"], capsys)
    fix = line.rsplit("or add: ", 1)[1].split()
    main(args + ["--model.arch.n_layers=3"] + fix)
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert [r.info.status for r in runs] == ["FINISHED"] and "val/loss" in runs[0].data.metrics


def test_arch_mismatches_ignores_runtime_keys_and_compares_floats_loosely():
    trained = {
        "n_layers": 2,
        "mlp_ratio": 8 / 3,
        "stream_dtype": "bfloat16",
        "recompute_block": "auto",
        "hyper": {
            "kernel_backend": "triton",
            "fused_pre": True,
            "n_streams": 4,
            "chain_sublayers": True,
            "rebuild_branch_input": True,
        },
    }
    config = {
        "n_layers": 2,
        "mlp_ratio": 2.666666666666667,
        "stream_dtype": "auto",
        "recompute_block": 0,
        "hyper": {
            "kernel_backend": "torch",
            "fused_pre": False,
            "n_streams": 4,
            "chain_sublayers": "auto",
            "rebuild_branch_input": False,
        },
    }
    assert arch_mismatches(config, trained) == []
    config["hyper"]["n_streams"] = 2
    assert arch_mismatches(config, trained) == [("model.arch.hyper.n_streams", 2, 4)]


def test_yaml_syntax_error_names_the_file_and_line(tiny_corpus, mlflow_uri, tmp_path, capsys):
    bad = _write(tmp_path / "mine.yaml", "trainer:\n  max_steps: 3\n  limit_val_batches: [2\nmodel: {}\n")
    args = tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / "root")
    line = one_error_line(args[:1] + ["-c", str(CONF / "base.yaml"), "-c", str(bad)] + args[1:], capsys)
    assert f"config file {bad}, line 4" in line and "not valid YAML" in line and "line 3" in line
    assert_nothing_written(mlflow_uri, tmp_path, tmp_path / "root")


@fast_first(
    "arg,says",
    [
        ("--trainer.max_steps=abc", "Parser key \"trainer.max_steps\": Expected a <class 'int'>. Got value: abc"),
        ("--trainer.logger.init_args.colour=red", "Option 'colour' is not accepted"),
        ("--model.arch.n_heads=3", "model.arch.d_model must be divisible by n_heads"),
        ("--trainer.callbacks+=nowhere.Callback", "No module named 'nowhere'"),
    ],
)
def test_parser_errors_are_one_line_with_a_pointer_to_help(arg, says, tiny_corpus, mlflow_uri, tmp_path, capsys):
    line = one_error_line(tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / "root") + [arg], capsys)
    assert says in line and line.endswith("(options: `mhc fit --help`)")
    assert_nothing_written(mlflow_uri, tmp_path, tmp_path / "root")


@pytest.mark.slow
@fast_first("case", ["random_corpus", "missing_checkpoint"])
def test_console_script_refuses_with_one_line_and_leaves_nothing(case, tmp_path):
    """As a newcomer types it, in a fresh folder with the default ./mlflow.db store: no store, no folders."""
    work = tmp_path / "work"
    work.mkdir()
    corpus = _write(tmp_path / "data.bin", random_bytes(100_000))
    if case == "random_corpus":
        args = ["fit", "-c", str(CONF / "quickstart.yaml"), f"--data.corpus={corpus}"]
    else:
        args = [
            "validate",
            "-c",
            str(CONF / "quickstart.yaml"),
            "--data.allow_binary=true",
            f"--data.corpus={corpus}",
            f"--ckpt_path={tmp_path / 'runs' / 'last.ckpt'}",
        ]
    exe = Path(sys.executable).with_name("mhc")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the config's default store
    out = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=300, cwd=work, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mhc {args[0]}: error: "), out.stderr
    assert str(corpus if case == "random_corpus" else tmp_path / "runs" / "last.ckpt") in lines[0]
    assert sorted(p.name for p in work.iterdir()) == []  # no mlflow.db, runs/ or mlruns/


def test_a_shortened_quickstart_is_warned_that_it_is_all_warm_up_and_diagnostics_only_at_step_0():
    """conf/quickstart.yaml with --trainer.max_steps=20: warmup_steps 20, diagnostics_every 20."""
    warmup, diagnostics = schedule_warnings(20, 20, 20, "mhc")
    assert warmup.startswith("model.optim.warmup_steps=20 >= trainer.max_steps=20: the whole run is warm-up")
    assert diagnostics.startswith("model.diagnostics_every=20 >= trainer.max_steps=20: diagnostics are taken at step 0")
    assert schedule_warnings(360, 20, 20, "mhc") == [] and schedule_warnings(-1, 20, 20, "mhc") == []
    assert schedule_warnings(20, 5, 20, "residual") == []  # a residual run takes no diagnostics


def test_under_slurm_a_fit_never_restores_another_jobs_requeue_checkpoint(
    tiny_corpus, mlflow_uri, tmp_path, capsys, monkeypatch
):
    """The sbatch recipe's shared default_root_dir holds an hpc_ckpt of another job: Lightning would restore it into
    this new run without a word. Refused in one line; and no fit leaves such a file for the next (requeue off)."""
    from helpers import SLURM_LIKE
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from mhc_lightning.fit.cli import build_cli

    for key, value in {**SLURM_LIKE, "SLURM_JOB_ID": "5151"}.items():
        monkeypatch.setenv(key, value)
    shared = tmp_path / "shared"
    for n in (2, 12):
        _write(shared / f"hpc_ckpt_{n}.ckpt", b"another job's weights")
    args = tiny_fit_args(tiny_corpus, mlflow_uri, shared)
    line = one_error_line(args, capsys)
    assert "holds hpc_ckpt_12.ckpt, a checkpoint of Lightning's SLURM requeue (not this run's)" in line
    assert line.endswith(f"or pass --ckpt_path {shared / 'hpc_ckpt_12.ckpt'} to start from it on purpose")
    assert_nothing_written(mlflow_uri, tmp_path, tmp_path / "no-root")
    assert sorted(p.name for p in shared.iterdir()) == ["hpc_ckpt_12.ckpt", "hpc_ckpt_2.ckpt"]
    environment = build_cli(args[1:], run=False).trainer._accelerator_connector.cluster_environment
    assert isinstance(environment, SLURMEnvironment) and environment.auto_requeue is False
