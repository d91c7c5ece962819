"""Real servers for the tracking-server tests: fresh PostgreSQL databases at 127.0.0.1:5432, an `mlflow server` on a
free loopback port that can crash and come back, and a TCP relay that can play a dead server."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests

PG = dict(host="127.0.0.1", port=5432, user="postgres")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pg_admin(sql: str) -> None:
    import psycopg2

    conn = psycopg2.connect(dbname="test", connect_timeout=5, **PG)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(sql)
    conn.close()


def pg_url(db: str) -> str:
    return f"postgresql+psycopg2://{PG['user']}@{PG['host']}:{PG['port']}/{db}"


@contextlib.contextmanager
def fresh_databases(*names: str):
    """Fresh PostgreSQL databases on the local server (skips when none answers), dropped afterwards: {name: URL}."""
    try:
        pg_admin("select 1")
    except Exception as err:
        pytest.skip(f"PostgreSQL unreachable at {PG['host']}:{PG['port']} as user {PG['user']}: {err}")
    tag = uuid.uuid4().hex[:10]
    dbs = {n: f"mhc_test_{n}_{tag}" for n in names}
    for db in dbs.values():
        pg_admin(f'create database "{db}"')
    try:
        yield {k: pg_url(v) for k, v in dbs.items()}
    finally:
        for db in dbs.values():
            try:
                pg_admin(
                    f"select pg_terminate_backend(pid) from pg_stat_activity where datname = '{db}' "
                    "and pid <> pg_backend_pid()"
                )
                pg_admin(f'drop database if exists "{db}"')
            except Exception as err:  # never hide the test's own result behind cleanup
                print(f"could not drop {db}: {err}", file=sys.stderr)


def clean_env() -> dict[str, str]:
    """The environment of the processes started here: no tracking URI or storage of the caller's."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "OPTUNA_STORAGE")}
    env.update(
        MLFLOW_ENABLE_ASYNC_LOGGING="false",
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
        MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false",
        PYTHONUNBUFFERED="1",
    )
    return env


def stop(proc: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM the process group we started, then SIGKILL; always bounded."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=timeout)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=timeout)


class MlflowServer:
    """`mlflow server` with a PostgreSQL backend store and a served artifact store, as in docker-compose.yml; it can
    be killed (SIGKILL, as a crash) and started again on the same port and stores."""

    def __init__(self, backend: str, root: Path, extra_hosts: tuple[str, ...] = ()):
        self.backend, self.root, self.port = backend, root, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        p = self.port
        self.hosts = ",".join(
            ["mlflow", f"mlflow:{p}", "localhost", f"localhost:{p}", "127.0.0.1", f"127.0.0.1:{p}", *extra_hosts]
        )
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 240) -> None:
        log = open(self.root / "server.log", "a")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--backend-store-uri",
                self.backend,
                "--artifacts-destination",
                str(self.root / "artifacts"),
                "--serve-artifacts",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
            ],
            # allowed hosts from the environment, as docker-compose.yml gives them
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**clean_env(), "MLFLOW_SERVER_ALLOWED_HOSTS": self.hosts},
            start_new_session=True,
            cwd=self.root,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"mlflow server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server not healthy after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the server's whole process group (workers included): a crash, not a shutdown."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)

    def log_tail(self) -> str:
        return (self.root / "server.log").read_text()[-3000:]


class Proxy:
    """A TCP relay in front of the MLflow server; `down()` refuses connections like a dead server, `up()` restores."""

    def __init__(self, target_port: int, port: int):
        self.target, self.port = target_port, port
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        self.listener = None
        self.up()

    def up(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", self.port))
        ls.listen(16)
        self.listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def down(self) -> None:
        ls, self.listener = self.listener, None
        if ls is not None:
            try:
                ls.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept(); close() alone leaves it listening
            except OSError:
                pass
            ls.close()
        with self.lock:
            for c in self.conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
            self.conns.clear()

    def _accept(self, ls) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a, b) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.close()
                except OSError:
                    pass
