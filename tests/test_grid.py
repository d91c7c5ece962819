"""The experiment grid runner: expansion of variants x axes into `mhc fit` argument lists, and `mhc grid` running
them as tagged child processes that die with it."""

import json
import os
import shlex
import subprocess
import time

import pytest
from helpers import CONF, REPO, TINY_GRID, fast_first, tiny_grid_command

from mhc_lightning.fit.cli import build_cli
from mhc_lightning.grids.cli import GridError, expand, load_grid


def test_stability_grid_expands_to_54_distinct_runs():
    spec = load_grid(CONF / "experiments" / "stability_grid.yaml")
    runs = expand(spec, REPO, [])
    assert len(runs) == 6 * 3 * 3  # 6 variants x 3 depths x 3 seeds
    names = [r[0] for r in runs]
    assert len(set(names)) == len(names)
    name, tags, argv = next(r for r in runs if r[0] == "hc_noclip-L24-s3")
    assert tags == {"grid": "stability", "variant": "hc_noclip", "model.arch.n_layers": "24", "seed_everything": "3"}
    assert "--trainer.gradient_clip_val=null" in argv and "--model.arch.n_layers=24" in argv


def test_grid_argv_is_what_the_cli_parses(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = load_grid(CONF / "experiments" / "stability_grid.yaml")
    name, tags, argv = next(
        r
        for r in expand(spec, REPO, ["--trainer.accelerator=cpu", "--trainer.precision=32-true"])
        if r[0] == "hc_noclip-L12-s2"
    )
    cli = build_cli(argv[1:], run=False)  # without the subcommand, as run=False expects
    assert cli.model.arch.hyper.residual_mode == "hc" and cli.model.arch.n_layers == 12
    assert cli.trainer.gradient_clip_val is None
    assert cli.trainer.logger._run_name == name


def test_bad_grid_file_names_the_missing_key(tmp_path):
    bad = tmp_path / "g.yaml"
    bad.write_text(json.dumps({"experiment": "x", "configs": []}))
    with pytest.raises(GridError, match="variants"):
        load_grid(bad)


# That `mhc grid` runs every point as a tagged `mhc fit` is checked on the runs of test_secrets.py's grid test: one
# grid run less (three processes' start-up) in CI.


@pytest.mark.slow
def test_killed_grid_takes_its_runs_along(tiny_corpus, tmp_path):
    """SIGKILL on `mhc grid` (no chance to clean up): its `mhc fit` children die with it
    (child_processes.die_with_parent)."""
    import psutil

    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    grid = subprocess.Popen(
        tiny_grid_command(tmp_path, tiny_corpus, 100000),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        children = []
        while len(children) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
            children = [p for p in psutil.Process(grid.pid).children() if "fit" in p.cmdline()]
        assert len(children) == 2, "the grid never started its two runs"
        time.sleep(3)
    finally:
        grid.kill()
        grid.wait()
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline()[:3] for p in alive]


def test_a_stopped_grid_gives_all_its_runs_the_same_time_to_end(tmp_path):
    """SIGTERM on the grid: every running child is signalled at once and gets the whole grace period to write its
    checkpoint and end its run (signalled one after another, the last of 14 fits would be reached after the others
    had used theirs, and SIGKILL would leave its run RUNNING)."""
    import signal
    import sys
    import threading

    from mhc_lightning.fit.child_processes import run_parallel

    slow_end = (
        "import signal, sys, time\n"
        "def end(*_):\n    time.sleep(1); print('ended its run', flush=True); sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, end)\nprint('started', flush=True)\ntime.sleep(120)\n"
    )
    jobs = [(f"run{i}", [sys.executable, "-c", slow_end], tmp_path / f"run{i}.log") for i in range(4)]
    logs = [log for *_, log in jobs]

    signalled = []

    def stop_when_started():
        deadline = time.monotonic() + 60
        while not all(p.is_file() and "started" in p.read_text() for p in logs) and time.monotonic() < deadline:
            time.sleep(0.1)
        signalled.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt, match="stopped 4 running"):
        run_parallel(jobs, parallel=4, on_done=lambda *a: None, poll_s=0.1)
    assert time.monotonic() - signalled[0] < 3  # together: about 1 s, where one after another took 4
    assert [p.read_text().split() for p in logs] == [["started", "ended", "its", "run"]] * 4


def test_repeats_run_each_point_again_under_its_own_name(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text(json.dumps({**TINY_GRID, "repeats": 2}))
    runs = expand(load_grid(grid), REPO, [])
    assert [(name, tags["replicate"]) for name, tags, _ in runs] == [
        ("mhc-s1-r1", "1"),
        ("hc-s1-r1", "1"),
        ("mhc-s1-r2", "2"),
        ("hc-s1-r2", "2"),
    ]
    assert runs[0][2] == runs[2][2][:-1] + [runs[0][2][-1]]  # the same command but for the run name
    for bad in (0, "2", True):
        grid.write_text(json.dumps({**TINY_GRID, "repeats": bad}))
        with pytest.raises(GridError, match="'repeats' must be an integer >= 1"):
            load_grid(grid)


# ---- checks before anything starts -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_misspelt_set_is_refused_before_any_run_starts(tiny_corpus, tmp_path, monkeypatch, capsys):
    """The grid used to start every `mhc fit`, each exiting 2 with the reason only in grid_logs/. `mhc grid` runs in
    this process: the refusal comes before anything starts, so a process of its own adds only its start-up."""
    from mhc_lightning.commands import main

    cmd = tiny_grid_command(tmp_path, tiny_corpus, 4) + ["--set", "trainer.max_stepz=3"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    capsys.readouterr()
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        main(cmd[1:])
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err[-2000:]
    assert err.strip().splitlines() == [
        f"mhc grid: error: {tmp_path / 'grid.yaml'}: `mhc fit` rejects the arguments of run mhc-s1 and 1 more (from "
        "the grid's configs, variants, axes or --set): unrecognized arguments: --trainer.max_stepz=3; "
        "nothing was started"
    ]
    assert not (tmp_path / "logs").exists() and not (tmp_path / "mlflow.db").exists()
    print(f"[figures] misspelt --set: refused in {time.monotonic() - t0:.1f} s, 0 runs started")


@fast_first(
    "change, says",
    [
        (
            {"variants": {"mhc": {"model.arch.n_heads": 3}}},
            ["run mhc-s1 (", "invalid model configuration: model.arch.d_model must be divisible by n_heads"],
        ),
        (
            {"axes": {"trainer.max_steps": ["many"]}},
            ["run mhc-max_stepsmany and 1 more (", '"trainer.max_steps"', "many"],
        ),
        ({"configs": ["conf/model/nope.yaml"]}, ["run mhc-s1 and 1 more (", "nope.yaml"]),
    ],
)
def test_every_run_is_checked_by_the_fit_parser_with_dry_run_too(change, says, tmp_path, monkeypatch, capsys):
    from mhc_lightning.grids.cli import main

    monkeypatch.chdir(tmp_path)
    grid = tmp_path / "g.yaml"
    grid.write_text(json.dumps({**TINY_GRID, **change}))
    assert main([str(grid), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mhc grid: error: {grid}: `mhc fit` rejects"), err
    assert all(piece in err[0] for piece in says) and err[0].endswith("; nothing was started"), err


@fast_first(
    "grid, says",
    [
        ({**TINY_GRID, "axis": {"seed_everything": [1, 2]}}, "unknown key(s) ['axis']; allowed keys: ['experiment'"),
        (
            {**TINY_GRID, "axes": {"seed_everything": []}},
            "'axes' must be a mapping of `mhc fit` keys to non-empty lists",
        ),
        ({**TINY_GRID, "variants": {"mhc": ["x"]}}, "variants.mhc: must be a mapping"),
        ({**TINY_GRID, "experiment": ""}, "'experiment' must be an MLflow experiment name"),
        ({**TINY_GRID, "configs": "conf/model/mhc.yaml"}, "'configs' must be a list of config files"),
    ],
)
def test_grid_file_mistakes_name_the_key(grid, says, tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(json.dumps(grid))
    with pytest.raises(GridError) as err:
        load_grid(path)
    assert str(err.value).startswith(f"{path}: ") and says in str(err.value)
    path.write_text("variants: [unclosed")
    with pytest.raises(GridError, match="not valid YAML"):
        load_grid(path)


def test_set_without_a_value_and_help_text(tmp_path, capsys):
    from mhc_lightning.grids.cli import build_parser, main

    grid = tmp_path / "g.yaml"
    grid.write_text(json.dumps(TINY_GRID))
    assert main([str(grid), "--set", "trainer.max_steps", "--dry-run"]) == 2
    assert "--set expects KEY=VALUE" in capsys.readouterr().err
    text = build_parser().format_help()
    for piece in ("experiment:", "configs:", "variants:", "axes:", "repeats:", "run names:", "--dry-run", "tags"):
        assert piece in text, piece


def test_a_set_on_an_axis_or_variant_key_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """`--set model.arch.n_layers=2` over an n_layers axis trained 2 blocks under names and tags that said the axis
    value, so reports paired the wrong runs: refused before anything is written."""
    from mhc_lightning.grids.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    grid = tmp_path / "g.yaml"
    grid.write_text(json.dumps(TINY_GRID))
    for item, says in (
        ("seed_everything=7", "seed_everything is an axis of"),
        ("model.arch.hyper.residual_mode=mhc", "variant(s) ['hc'] of"),
    ):
        assert main([str(grid), "--set", item]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"mhc grid: error: --set {item}: ") and says in err[0], err
    assert not (tmp_path / "grid_logs").exists() and not (tmp_path / "mlflow.db").exists()


def test_sinkhorn_keys_for_modes_without_sinkhorn_are_named(tmp_path, capsys):
    """A sinkhorn_iters axis over mhc_lite / kromhc runs identical duplicates: `mhc grid` warns, `mhc fit` says it
    ignores the key (one line, before its inputs are checked)."""
    from mhc_lightning.fit.cli import main as fit_main
    from mhc_lightning.grids.check import sinkhorn_no_ops

    spec = {
        **TINY_GRID,
        "variants": {"mhc": {}, "lite": {"model.arch.hyper.residual_mode": "mhc_lite"}},
        "axes": {"model.arch.hyper.sinkhorn_iters": [5, 20]},
    }
    grid = tmp_path / "g.yaml"
    grid.write_text(json.dumps(spec))
    said = sinkhorn_no_ops(expand(load_grid(grid), REPO, []))
    assert "model.arch.hyper.sinkhorn_iters is a no-op for mhc_lite / kromhc" in said and "['lite']" in said
    assert sinkhorn_no_ops(expand(load_grid(grid), REPO, [])[:1]) is None  # the mhc run uses it
    too_short = tmp_path / "short.txt"  # passes the early checks, refused after the model config is read
    too_short.write_text("a short text\n")
    with pytest.raises(SystemExit) as stopped:
        fit_main(
            ["fit", "-c", str(CONF / "model" / "kromhc.yaml"), "--model.arch.hyper.sinkhorn_iters=5"]
            + [f"--data.corpus={too_short}"]
        )
    assert stopped.value.code == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "has no Sinkhorn" in ln]
    assert lines == ["mhc fit: residual_mode=kromhc has no Sinkhorn: ignoring model.arch.hyper.sinkhorn_iters=5"]


def test_dry_run_prints_pasteable_commands_and_a_grid_names_its_report(tmp_path, monkeypatch, capsys):
    from mhc_lightning.fit.child_processes import mhc_command
    from mhc_lightning.grids.cli import main, report_command

    monkeypatch.chdir(tmp_path)
    grid = tmp_path / "g.yaml"
    spec = {**TINY_GRID, "variants": {**TINY_GRID["variants"], "odd": {"trainer.logger.init_args.tags": {"a b": "$x"}}}}
    grid.write_text(json.dumps(spec))
    assert main([str(grid), "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    runs = expand(load_grid(grid), REPO, [])
    assert [shlex.split(line, comments=True) for line in lines] == [mhc_command() + argv for _, _, argv in runs]
    assert [line.rpartition("   # ")[2] for line in lines] == [name for name, _, _ in runs]
    spec["axes"] = {"model.arch.n_layers": [2, 4], "seed_everything": [1, 2]}
    assert report_command(spec) == [
        "report", "--experiment", "tiny-grid", "--group-by", "variant,model.arch.n_layers", "--baseline", "mhc"
    ]  # fmt: skip


def test_skip_finished_resumes_interrupted_runs_from_their_checkpoint(tmp_path, monkeypatch, mlflow_uri, capsys):
    """Four points in the store: one FINISHED, one diverged (FAILED, tagged): both skipped; one KILLED with a last
    checkpoint: resumed with `--ckpt_path last`; one FAILED before any checkpoint: run again from step 0."""
    from mlflow import MlflowClient

    import mhc_lightning.fit.child_processes as child_processes
    from mhc_lightning.grids.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    grid = tmp_path / "g.yaml"
    grid.write_text(json.dumps({**TINY_GRID, "axes": {"seed_everything": [1, 2]}}))
    client = MlflowClient(mlflow_uri)
    exp = client.create_experiment("tiny-grid")
    for name, status, tags in (
        ("mhc-s1", "FINISHED", {}),
        ("hc-s1", "KILLED", {}),
        ("mhc-s2", "FAILED", {"mhc.diverged": "true"}),
        ("hc-s2", "FAILED", {}),
    ):
        run = client.create_run(exp, run_name=name, tags=tags).info
        client.set_terminated(run.run_id, status)
        if name == "hc-s1":
            (tmp_path / "runs" / exp / run.run_id / "checkpoints").mkdir(parents=True)
            (tmp_path / "runs" / exp / run.run_id / "checkpoints" / "last.ckpt").write_bytes(b"")
    started = {}
    monkeypatch.setattr(
        child_processes, "run_parallel", lambda jobs, *a, **k: started.update({n: argv for n, argv, _ in jobs})
    )
    (tmp_path / "mlflow_spool" / "r1").mkdir(parents=True)  # writes a run's store did not take (loggers/spool.py)
    (tmp_path / "mlflow_spool" / "r1" / "host-1-ab.jsonl").write_text('{"op": "set_tag"}\n{"op": "set_terminated"}\n')
    main([str(grid), "--skip-finished", "--set", f"trainer.default_root_dir={tmp_path / 'runs'}"])
    out = capsys.readouterr().out
    assert "2 runs already finished (1 of them diverged); 2 to go, 1 of them resuming" in out
    assert out.strip().splitlines()[-1].startswith("2 MLflow writes not in the store yet, kept in mlflow_spool ")
    assert sorted(started) == ["hc-s1", "hc-s2"]
    assert started["hc-s1"][-2:] == ["--ckpt_path", "last"] and "--ckpt_path" not in started["hc-s2"]
    # a run that ended untagged (its grid was stopped as it ended) gets the grid's tags, so reports can group it
    finished = client.search_runs([exp], "attributes.run_name = 'mhc-s1'")[0]
    assert {k: finished.data.tags.get(k) for k in ("grid", "variant", "seed_everything")} == {
        "grid": "tiny-grid", "variant": "mhc", "seed_everything": "1"
    }  # fmt: skip

    def ends_as_the_grid_is_stopped(jobs, *a, **k):
        run = client.create_run(exp, run_name="hc-s2").info
        client.set_terminated(run.run_id, "FINISHED")
        raise KeyboardInterrupt("signal 15: stopped 1 running, 0 not started")

    monkeypatch.setattr(child_processes, "run_parallel", ends_as_the_grid_is_stopped)
    assert main([str(grid), "--skip-finished", "--set", f"trainer.default_root_dir={tmp_path / 'runs'}"]) == 130
    tagged = client.search_runs([exp], "attributes.run_name = 'hc-s2' and attributes.status = 'FINISHED'")
    assert tagged[0].data.tags.get("variant") == "hc"


def test_a_run_name_too_long_for_a_file_or_a_run_is_refused_with_dry_run_too(tmp_path, monkeypatch, capsys):
    from mhc_lightning.grids.cli import main

    monkeypatch.chdir(tmp_path)
    grid = tmp_path / "g.yaml"
    for variant, says in (
        ("v" * 300, "variants: 'vvv"),
        ("v" * 300, "is too long for a file name: 300 bytes, at most 255"),
        ("v" * 248, "run name 'vvv"),
        ("v" * 248, "is too long for an MLflow run name: 251 characters, at most 250"),
    ):
        grid.write_text(json.dumps({**TINY_GRID, "variants": {variant: {}}}))
        assert main([str(grid), "--dry-run"]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"mhc grid: error: {grid}: ") and says in line, line
    assert not list(tmp_path.glob("*.db"))


def test_finish_within_starts_only_runs_that_end_in_time(tmp_path, monkeypatch, mlflow_uri, capsys):
    """A grid run in parts under a time limit: a run starts only while runs of its variant (their typical time in the
    store, a resumed run's longer span left out) would still end in time; the others wait for the next part."""
    import sys

    from mlflow import MlflowClient

    import mhc_lightning.fit.child_processes as child_processes
    from mhc_lightning.grids.cli import main, typical_durations

    client = MlflowClient(mlflow_uri)
    exp = client.create_experiment("tiny-grid")
    for variant, took in (("mhc", 100), ("mhc", 110), ("mhc", 4000), ("hc", 50)):  # 4000: stopped, resumed later
        run = client.create_run(exp, start_time=1_000_000, tags={"variant": variant}).info
        client.set_terminated(run.run_id, "FINISHED", end_time=1_000_000 + 1000 * took)
    assert typical_durations(client, exp) == {"mhc": 105.0, "hc": 50.0}

    slow = "import time; time.sleep(0.3)"
    jobs = [(n, [sys.executable, "-c", slow], tmp_path / f"{n}.log") for n in ("a", "b", "c")]
    ended = []
    left = child_processes.run_parallel(
        jobs, 2, lambda n, code: ended.append((n, code)), 0.05, may_start="ac".__contains__
    )
    assert left == ["b"] and sorted(ended) == [("a", 0), ("c", 0)]

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    grid = tmp_path / "g.yaml"
    grid.write_text(json.dumps({**TINY_GRID, "axes": {"seed_everything": [1, 2]}}))
    asked = {}

    def records_what_may_start(jobs, *a, may_start=None, **k):
        asked.update({name: may_start(name) for name, _, _ in jobs})
        return [name for name, ok in asked.items() if not ok]

    monkeypatch.setattr(child_processes, "run_parallel", records_what_may_start)
    assert main([str(grid), "--finish-within", "100"]) == 0
    assert asked == {"mhc-s1": False, "hc-s1": True, "mhc-s2": False, "hc-s2": True}  # 1.1 x 105 s > 100 s
    out = capsys.readouterr().out
    assert "2 runs not started: runs like them take longer than was left of --finish-within 100 s" in out
    assert "2/2 runs finished" in out
    with pytest.raises(SystemExit):
        main([str(grid), "--finish-within", "100", "--launcher", "slurm"])
    assert "--finish-within must be > 0 seconds, with --launcher local" in capsys.readouterr().err
