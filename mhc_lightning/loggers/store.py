"""The MLflow tracking store as the platform meets it: is it there, is it ready, which experiment.

- `check_tracking`: an unreachable store is a `TrackingUnreachable` (a UserError: one line naming the URI), found
  in seconds rather than after MLflow's default retries (minutes).
- `is_outage`: tells "the store cannot take it right now" (a server away, a SQLite database locked, full or
  read-only: keep the write for later) from "the request is wrong" (a bug: raise); `outage_reason` says which, in a
  few words, and `quiet_store_errors` keeps MLflow from printing a traceback per write the spool keeps.
- `prepare_store`, `store_lock`: a fresh SQLite store is migrated by the first client that opens it (an MlflowClient
  opens its store when it is created); two processes doing that at once corrupt it (alembic's temporary tables), so
  every first open in a process is serialised with an inter-process lock.
- `ensure_experiment`: the experiment, created if needed, tagged so that the MLflow UI opens it in its
  training-runs view (see TRAINING_KIND below).
- `ui_hint`: the command that opens a local store in the MLflow UI, runnable from any folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Optional

from ..errors import UserError
from .credentials import mask

# Fail fast instead of MLflow's default 7 retries with exponential backoff (minutes per call): a training process
# waits on a dead server for at most (retries + 1) x timeout per attempt, and the spool retries later on its own.
HTTP_FAST_FAILURE = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}

# MLflow 3's UI chooses an experiment's default view from the experiment tag `mlflow.experimentKind`:
# "genai_development" opens the GenAI "Evaluations" view, "custom_model_development" the training-runs table
# (the values of the UI's ExperimentKind enum; MLflow's own onboarding guide reads the same tag). Without the tag
# the UI guesses, and guessed GenAI for our runs.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"


class TrackingUnreachable(UserError):
    """The MLflow tracking store cannot be reached; the message names the URI and what to do."""


redact = mask  # the name launchers and messages use: user:***@host, password-like query parameters ***


def is_outage(err: BaseException) -> bool:
    """True for errors that mean 'the store cannot take this right now', as opposed to a bad request: a server that
    does not answer or answers 5xx, a database that is locked, full, read-only or gone (MLflow raises every
    SQLAlchemy OperationalError as TEMPORARILY_UNAVAILABLE)."""
    import requests
    from mlflow.exceptions import MlflowException, RestException

    if isinstance(err, RestException):
        return err.get_http_status_code() >= 500
    if isinstance(err, (requests.RequestException, ConnectionError, TimeoutError)):
        return True
    if isinstance(err, MlflowException):
        if err.error_code == "TEMPORARILY_UNAVAILABLE":
            return True
        msg = str(err)
        code = re.search(r"error code (\d{3})", msg)  # a non-JSON HTTP answer, e.g. the Host-header check's 403
        if code:
            return int(code.group(1)) >= 500
        return any(s in msg for s in ("API request to", "Max retries exceeded", "Connection", "database is locked"))
    return False


_DB_ERROR = re.compile(r"\((?:sqlite3|psycopg2?|pymysql|MySQLdb)[\w.]*\.\w*Error\) ([^\n\[]+)")


def outage_reason(err: BaseException) -> str:
    """An outage in a few words: the database's own reason ("database or disk is full") where there is one, else the
    error's type (MLflow's message for a failed request quotes the SQL, the parameters and the URL)."""
    found = _DB_ERROR.search(str(err))
    return found.group(1).strip() if found else type(err).__name__


def store_error(err: BaseException) -> str:
    """A failed store call in one line: the database's reason, else the first line of the error (URIs masked)."""
    found = _DB_ERROR.search(str(err))
    if found:
        return found.group(1).strip()
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {mask(first)}" if first else type(err).__name__


class _OneLine(logging.Filter):
    """MLflow's store errors as the platform shows them: the session's traceback dropped (the spool keeps the write
    and says so once), the system-metrics thread's warning reduced to its first line and the database's reason."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "mlflow.store.db.utils":
            return not str(record.msg).startswith("SQLAlchemy database error")
        text = record.getMessage()
        if "\n" in text:
            found, first = _DB_ERROR.search(text), text.splitlines()[0].rstrip(" .")
            record.msg = first + (f" ({found.group(1).strip()})" if found and found.group(1) not in first else "")
            record.args = ()
        return True


_ONE_LINE = _OneLine()
_NOISY = ("mlflow.store.db.utils", "mlflow.system_metrics.system_metrics_monitor")


def quiet_store_errors() -> None:
    """Idempotent: install _OneLine on the MLflow loggers that print a failed store write."""
    for name in _NOISY:
        logger = logging.getLogger(name)
        if _ONE_LINE not in logger.filters:
            logger.addFilter(_ONE_LINE)


def use_fast_http_failures() -> None:
    """Lower MLflow's HTTP retries for this process, unless the user set MLFLOW_HTTP_REQUEST_* already."""
    for k, v in HTTP_FAST_FAILURE.items():
        os.environ.setdefault(k, v)


def default_tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def sqlite_path(uri: str) -> Optional[Path]:
    """The database file of a sqlite:/// URI (None for other stores)."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///") :]).expanduser().resolve()


def mlflow_command() -> str:
    """How to start MLflow's CLI from this interpreter, whether or not its venv is activated."""
    exe = Path(sys.executable).with_name("mlflow")
    return shlex.quote(str(exe)) if exe.is_file() else f"{shlex.quote(sys.executable)} -m mlflow"


def absolute_store_uri(uri: str) -> str:
    """sqlite:///relative.db -> sqlite:////abs/relative.db, so that a printed command works from any folder."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix) :].startswith("/") and ":memory:" not in uri:
        return prefix + str(Path(uri[len(prefix) :]).resolve())
    return uri


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def ui_hint(uri: str) -> str:
    """The command that opens a local store in the MLflow UI."""
    return f"{mlflow_command()} ui --backend-store-uri {shlex.quote(absolute_store_uri(uri))}"


_DATABASES = ("postgresql", "postgres", "mysql", "mssql")  # SQLAlchemy schemes MLflow takes as tracking stores


def unopenable(uri: str, err: BaseException) -> TrackingUnreachable:
    """The one line for a tracking store that could not be opened, its URI and the error's first line masked."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    check = (
        "Another process holds a lock on it (a long transaction, an open `sqlite3` shell): let it finish"
        if "database is locked" in first
        else 'Check the URI, that the database answers and that its driver is installed (`pip install -e ".[postgres]"`'
        " for postgresql+psycopg2://)"
    )
    return TrackingUnreachable(
        f"MLflow tracking store {mask(str(uri))} could not be opened ({type(err).__name__}: {mask(first)}). {check}, "
        "or point MLFLOW_TRACKING_URI or --trainer.logger.init_args.tracking_uri at another store."
    )


def probe_database(uri: Optional[str], timeout: int = 5) -> None:
    """Open one connection to a database tracking store (nothing for other stores) and raise `unopenable` if that
    fails: MLflow retries a failed open for about 100 s, logging a warning per attempt, before its traceback."""
    scheme = str(uri or "").partition(":")[0].partition("+")[0].lower()
    if scheme not in _DATABASES:
        return
    import sqlalchemy

    try:
        engine = sqlalchemy.create_engine(
            uri, connect_args={"connect_timeout": timeout} if scheme != "mssql" else {}, poolclass=sqlalchemy.NullPool
        )
        with engine.connect():
            pass
    except Exception as err:
        raise unopenable(uri, err) from None


def check_tracking(
    uri: str, timeout: float = 5.0, option: Optional[str] = "--trainer.logger.init_args.tracking_uri"
) -> None:
    """Raise TrackingUnreachable (naming the URI) unless the tracking store answers; migrate a new SQLite store.
    `option`: the command's own way to name another store, besides MLFLOW_TRACKING_URI (`mhc fit` has no
    --tracking-uri)."""
    if is_server(uri):
        import requests

        from .credentials import basic_auth

        try:  # with the credentials: a reverse proxy in front of the server may guard /health too
            requests.get(uri.rstrip("/") + "/health", timeout=timeout, auth=basic_auth()).raise_for_status()
        except requests.RequestException as err:
            raise TrackingUnreachable(
                f"MLflow tracking server {redact(uri)} is unreachable ({type(err).__name__}). Start it "
                "(`docker compose up -d mlflow`, or `mlflow server ...`), or point MLFLOW_TRACKING_URI"
                + (f" or {option}" if option else "")
                + " at a running one."
            ) from None
    probe_database(uri)
    try:
        prepare_store(uri)  # /health skips the server's Host-header check; one API call does not
    except Exception as err:
        hint = (
            " (add this host name to the server's --allowed-hosts / MLFLOW_ALLOWED_HOSTS)"
            if "Invalid Host header" in str(err)
            else ""
        )
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TrackingUnreachable(
            f"MLflow tracking store {redact(uri)} refused the connection: {mask(first)}{hint}"
        ) from None


def lock_path(db: Path) -> str:
    """An inter-process lock for a SQLite file, in the temp folder (no litter beside the database)."""
    import hashlib
    import tempfile

    return str(Path(tempfile.gettempdir()) / f"mhc-sqlite-{hashlib.sha1(str(db).encode()).hexdigest()[:16]}.lock")


@contextlib.contextmanager
def store_lock(uri: Optional[str]):
    """Hold the inter-process lock of a SQLite store (nothing for other stores) while a client is created or first
    used: creating an MlflowClient opens the store and migrates a new database, which two processes must not do at
    once (parallel first clients collide in alembic and can leave the file unusable)."""
    db = sqlite_path(uri) if uri else None
    if db is None:
        yield
        return
    from filelock import FileLock

    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(lock_path(db), timeout=300):
        yield


def prepare_store(uri: str) -> None:
    """One API call against the store, a new SQLite database migrated under the store's lock (store_lock)."""
    from mlflow import MlflowClient

    with store_lock(uri):
        MlflowClient(uri).search_experiments(max_results=1)


def ensure_experiment(client, name: str) -> str:
    """The id of experiment `name`, created (or restored) if needed and tagged for the training-runs view.

    Safe when several processes race: whoever loses the create finds the winner's experiment. An experiment that
    already has a kind (set by a user or by MLflow) keeps it.
    """
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            exp_id = client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: TRAINING_KIND})
            return exp_id
        except Exception:  # another process created it first
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    if EXPERIMENT_KIND_TAG not in exp.tags:
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
    return exp.experiment_id
