"""A password in MLFLOW_TRACKING_URI (`http://user:secret@host`) never shows: not in what `mhc sweep` and `mhc grid`
print, not in their logs, not in any run's params, tags or artifacts (config.yaml, trial_command.txt), not on any
child's command line (/proc/<pid>/cmdline); and it still reaches the server, as HTTP basic auth on every request.

Real processes: an `mlflow server` on a free loopback port behind a relay that records each request's Authorization
header (the server itself ignores basic auth), `mhc sweep` with two worker processes, `mhc grid` with two `mhc fit`
runs.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import lightning as L
import optuna
import psutil
import pytest
import requests
from helpers import derived_spec, make_text, one_thread, tiny_fit_args, tiny_grid_command
from mlflow import MlflowClient
from tracking_servers import MlflowServer, free_port, fresh_databases

from mhc_lightning.fit.cli import MHCLightningCLI, build_cli, main
from mhc_lightning.loggers.credentials import PASSWORD_ENV, USER_ENV, mask, split_credentials, take_credentials

USER, SECRET = "mhc", f"s3cr3t-{uuid.uuid4().hex[:8]}"
BASIC = "Basic " + base64.b64encode(f"{USER}:{SECRET}".encode()).decode()
HOP = {"host", "content-length", "connection", "transfer-encoding", "content-encoding", "keep-alive"}


class Parsed(Exception):
    """Raised by ConfigOnly with the parsed config."""


class ConfigOnly(MHCLightningCLI):
    """`mhc fit`'s parsing, with the project's own checks, stopped before anything is built."""

    def before_instantiate_classes(self) -> None:
        raise Parsed(self.config)


class AuthRecorder:
    """An HTTP relay in front of the MLflow server that records the Authorization header of every request."""

    def __init__(self, upstream: str):
        seen = self.seen = []

        class Relay(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def relay(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen.append((self.command, self.path, self.headers.get("Authorization")))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                r = requests.request(self.command, upstream + self.path, data=body, headers=headers, timeout=120)
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = relay

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Relay)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("secrets_server")
    srv = MlflowServer(f"sqlite:///{root / 'mlflow.db'}", root)
    srv.start()
    relay = AuthRecorder(srv.url)
    try:
        yield {
            "url": f"http://127.0.0.1:{relay.port}",
            "with_secret": f"http://{USER}:{SECRET}@127.0.0.1:{relay.port}",
            "seen": relay.seen,
        }
    finally:
        relay.httpd.shutdown()
        srv.stop()


@pytest.fixture
def corpus(tmp_path) -> Path:
    p = tmp_path / "corpus.txt"
    p.write_text(make_text(60_000, seed=7))
    return p


def run_watching_children(cmd: list[str], cwd: Path, uri: str, timeout: float = 600):
    """Run `cmd` with MLFLOW_TRACKING_URI=uri; return (exit code, output, every descendant's argv and environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "OPTUNA_"))}
    env.update(MLFLOW_TRACKING_URI=uri, MLFLOW_ENABLE_ASYNC_LOGGING="false", PYTHONUNBUFFERED="1")
    log = cwd / "command.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    seen: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                if child.pid not in seen:
                    try:
                        seen[child.pid] = (
                            Path(f"/proc/{child.pid}/cmdline").read_text(),
                            Path(f"/proc/{child.pid}/environ").read_text(),
                        )
                    except OSError:
                        pass
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.1)
    if proc.poll() is None:
        os.killpg(proc.pid, 9)
        pytest.fail(f"{cmd[:3]} still running after {timeout} s:\n{log.read_text()[-3000:]}")
    return proc.returncode, log.read_text(), seen


def stored_text(client: MlflowClient, experiment: str, tmp: Path) -> tuple[int, str]:
    """Every run of the experiment: params, tags and the text of every artifact, as one string; and the run count."""
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    parts = []
    for run in runs:
        parts += [repr(run.data.params), repr(run.data.tags)]
        local = Path(client.download_artifacts(run.info.run_id, "", str(tmp / run.info.run_id)))
        parts += [p.read_text(errors="replace") for p in local.rglob("*") if p.is_file() and p.suffix != ".png"]
    return len(runs), "\n".join(parts)


def files_text(folder: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in folder.rglob("*.log") if p.is_file())


def check_children(children: dict, at_least: int) -> None:
    """Children were seen, none has the secret on its command line, and they got it through the environment."""
    assert len(children) >= at_least, children
    assert not [c for c, _ in children.values() if SECRET in c], "the secret is on a child's command line"
    assert any(f"MLFLOW_TRACKING_PASSWORD={SECRET}" in e for _, e in children.values())


def check_basic_auth(requests_seen: list) -> None:
    """Every request the command sent to the server carried the credentials."""
    assert requests_seen, "no request reached the server"
    assert all(auth == BASIC for _, _, auth in requests_seen), {(m, p, a) for m, p, a in requests_seen if a != BASIC}


def test_credentials_leave_the_uri_for_the_environment(monkeypatch):
    for k in (USER_ENV, PASSWORD_ENV):
        monkeypatch.delenv(k, raising=False)
    assert split_credentials("https://u%40x:p%3Aw@host:5000/p") == ("https://host:5000/p", "u@x", "p:w")
    assert split_credentials("http://host:5000") == ("http://host:5000", None, None)
    db = "postgresql+psycopg2://u:pw@db:5432/mlflow"
    assert split_credentials(db) == (db, None, None)  # MLflow takes no database password from the environment
    assert take_credentials(f"http://{USER}:{SECRET}@127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert (os.environ[USER_ENV], os.environ[PASSWORD_ENV]) == (USER, SECRET)
    text = f"tracking_uri: {db}\nstorage: sqlite:///a@b.db\nmail me@example.com, http://h:1/x"
    assert mask(text) == text.replace("u:pw@", "u:***@")
    assert mask("postgresql://h/db?sslmode=require&password=pw#x") == "postgresql://h/db?sslmode=require&password=***#x"


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_a_fit_config_keeps_the_password_in_the_environment(tiny_corpus, tmp_path, monkeypatch):
    """`--trainer.logger.init_args.tracking_uri` with a password: the parsed config (what config.yaml is written
    from) holds the bare URI, the credentials are in the environment for MLflow's client and the children."""
    monkeypatch.chdir(tmp_path)
    for k in (USER_ENV, PASSWORD_ENV):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(Parsed) as parsed:
        build_cli(
            [
                "fit",
                f"--data.corpus={tiny_corpus}",
                f"--trainer.logger.init_args.tracking_uri=http://{USER}:{SECRET}@127.0.0.1:9",
            ],
            cli_class=ConfigOnly,
        )
    config = parsed.value.args[0]
    assert config.fit.trainer.logger.init_args.tracking_uri == "http://127.0.0.1:9"
    assert SECRET not in repr(config) and os.environ[PASSWORD_ENV] == SECRET


@pytest.mark.slow
def test_sweep_keeps_the_tracking_password_out_of_outputs_artifacts_and_argv(server, corpus, tmp_path):
    name = f"secret-{uuid.uuid4().hex[:6]}"
    spec = derived_spec(
        tmp_path / "s.yaml",
        name,
        enqueue=[],
        pruner={"name": "none"},
        # no per-layer diagnostics: their figures cost seconds per validation and hold no configuration
        fixed={"trainer.max_steps": 4, "trainer.val_check_interval": 2, "model.diagnostics_every": 0},
        budget={"n_trials": 2, "max_failed": 0},
    )
    storage, first = f"sqlite:///{tmp_path / 'sweeps.db'}", len(server["seen"])
    cmd = [
        str(Path(sys.executable).with_name("mhc")),
        "sweep",
        "run",
        str(spec),
        "--workers",
        "2",
        "--storage",
        storage,
        "--set",
        f"data.corpus={corpus}",
        "--set",
        f"trainer.default_root_dir={tmp_path / 'runs'}",
    ]
    code, out, children = run_watching_children(cmd, tmp_path, server["with_secret"])
    assert code == 0, out[-3000:]
    assert SECRET not in out and "s3cr3t" not in files_text(tmp_path / "sweep_logs")
    check_children(children, 2)
    check_basic_auth(server["seen"][first:])
    n_runs, stored = stored_text(MlflowClient(server["url"]), name, tmp_path / "artifacts")
    assert n_runs == 3  # the parent run and 2 trials; trial_command.txt and config.yaml read:
    assert SECRET not in stored and "mhc fit --config" in stored and "tracking_uri:" in stored
    study = optuna.load_study(study_name=name, storage=storage)
    assert SECRET not in repr([(t.user_attrs, t.system_attrs) for t in study.trials] + [study.user_attrs])


@pytest.mark.slow
def test_grid_keeps_the_tracking_password_out_of_outputs_artifacts_and_argv(server, corpus, tmp_path):
    """Also the grid runner's own check, on the same runs (a grid costs three processes' start-up): every point
    ran as an `mhc fit` of its own, tagged with its variant, its axes and the grid."""
    first = len(server["seen"])
    code, out, children = run_watching_children(tiny_grid_command(tmp_path, corpus, 4), tmp_path, server["with_secret"])
    assert code == 0 and "2/2 runs finished" in out, out[-3000:]
    assert SECRET not in out and SECRET not in files_text(tmp_path / "logs")
    check_children(children, 2)
    check_basic_auth(server["seen"][first:])
    client = MlflowClient(server["url"])
    n_runs, stored = stored_text(client, "tiny-grid", tmp_path / "artifacts")
    assert n_runs == 2 and "tracking_uri:" in stored and SECRET not in stored
    exp = client.get_experiment_by_name("tiny-grid")
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"
    runs = client.search_runs([exp.experiment_id])
    assert sorted((r.data.tags["variant"], r.info.status) for r in runs) == [("hc", "FINISHED"), ("mhc", "FINISHED")]
    assert all(r.data.tags["seed_everything"] == "1" and r.data.tags["grid"] == "tiny-grid" for r in runs)


def _one_error_line(text: str) -> str:
    (line,) = [ln for ln in text.splitlines() if ln.strip() and ln != "Seed set to 1234" and ": warning: " not in ln]
    return line


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_unreachable_stores_with_a_password_are_one_masked_line(tiny_corpus, tmp_path, monkeypatch, capfd):
    """An MLflow server and two PostgreSQL stores (with and without their driver) on a closed port, each URI with a
    password (in the user info and as a query parameter): one line naming the store, masked, exit 2, nothing written.
    capfd: MLflow's and SQLAlchemy's own log handlers write to the real stderr."""
    monkeypatch.chdir(tmp_path)
    for k in (USER_ENV, PASSWORD_ENV):
        monkeypatch.delenv(k, raising=False)
    port = free_port()
    for uri in (
        f"http://{USER}:{SECRET}@127.0.0.1:{port}",
        f"postgresql+psycopg2://postgres:{SECRET}@127.0.0.1:{port}/test?password={SECRET}",
        f"postgresql://postgres:{SECRET}@127.0.0.1:{port}/test",  # SQLAlchemy's default driver, not installed
    ):
        args = tiny_fit_args(tiny_corpus, uri, tmp_path / "runs")
        with pytest.raises(SystemExit) as ended:
            main(args)
        out, err = capfd.readouterr()
        assert ended.value.code == 2, err
        line = _one_error_line(out + err)
        assert line.startswith("mhc fit: error: MLflow tracking ") and "127.0.0.1" in line and SECRET not in line
        assert not (tmp_path / "runs").exists()


class SigtermAt(L.Callback):
    """Sends this process SIGTERM after optimizer step `step`."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")
def test_a_fit_on_a_database_store_with_a_password_keeps_it_out_of_outputs_and_the_run(
    tiny_corpus, tmp_path, monkeypatch, capfd
):
    """A real PostgreSQL store (trust auth: any password is accepted) named with a password, and the fit stopped by
    SIGTERM: the resume command it prints, everything else it prints, and the run's params, tags and artifacts
    (config.yaml, provenance) hold the password masked or not at all."""
    monkeypatch.chdir(tmp_path)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a fresh process
    hook = "--trainer.callbacks+=" + json.dumps({"class_path": f"{__name__}.SigtermAt", "init_args": {"step": 2}})
    try:
        with fresh_databases("secret") as dbs:
            uri = dbs["secret"].replace("postgres@", f"postgres:{SECRET}@")
            with one_thread(), pytest.raises(SystemExit) as ended:
                main([*tiny_fit_args(tiny_corpus, uri, tmp_path / "runs", steps=6), hook])
            out, err = capfd.readouterr()
            assert ended.value.code == 143, err
            (resume,) = [ln for ln in err.splitlines() if "Resume with:" in ln]
            assert "postgres:***@" in resume
            assert SECRET not in out + err
            n, stored = stored_text(MlflowClient(uri), "tests", tmp_path / "artifacts")
            assert n == 1 and "postgres:***@" in stored and SECRET not in stored
    finally:
        signal.signal(signal.SIGTERM, previous)
