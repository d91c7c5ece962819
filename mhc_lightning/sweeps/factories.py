"""Factories every part of a sweep builds from the spec: Optuna storages, samplers, pruners, and the default URLs.

The launcher, its workers and the child side of a subprocess trial (link.py) all import them from here, so the
same sweep file gives the same objects everywhere. Cheap to import: Optuna is imported inside the functions.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Optional

from .spec import PRUNERS, SAMPLERS, SpecError, SweepSpec


def default_storage(tracking_uri: str) -> str:
    """One SQLite file beside a local MLflow store (or in the current directory)."""
    if tracking_uri.startswith("sqlite:///"):
        return f"sqlite:///{Path(tracking_uri[len('sqlite:///') :]).resolve().parent / 'sweeps.db'}"
    return f"sqlite:///{Path.cwd() / 'sweeps.db'}"


def resolve_storage_url(explicit: Optional[str], spec: SweepSpec, tracking_uri: str) -> str:
    """--storage, else the sweep file's storage.url, else $OPTUNA_STORAGE, else sweeps.db beside the MLflow store."""
    return explicit or spec.storage["url"] or os.environ.get("OPTUNA_STORAGE") or default_storage(tracking_uri)


def is_journal(url: str) -> bool:
    return url.startswith("journal:") or url.endswith((".journal", ".journal.log"))


def normalize_db_url(url: str) -> str:
    """postgres:// and postgresql:// -> postgresql+psycopg2://: SQLAlchemy 2.1 defaults to psycopg 3, which the
    project does not install (psycopg2-binary is its PostgreSQL driver, also in the compose images)."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg2://" + url[len(prefix) :]
    return url


def make_storage(url: str, cfg: dict[str, Any]):
    """sqlite:/postgresql:/mysql: -> RDBStorage with heartbeat + retry; journal:PATH or *.journal.log -> JournalStorage.

    Heartbeat: a RUNNING trial whose worker stopped beating for grace_period seconds is marked FAIL by the
    next worker that polls, and re-queued (same parameters) up to max_retry times.
    """
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    if is_journal(url):
        from optuna.storages.journal import JournalFileBackend

        path = Path(url[len("journal:") :] if url.startswith("journal:") else url).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    url = normalize_db_url(url)
    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        engine_kwargs = {"connect_args": {"timeout": 60}}  # several local processes share the file
    hb = cfg.get("heartbeat_interval")

    def build():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return RDBStorage(
                url,
                engine_kwargs=engine_kwargs,
                heartbeat_interval=hb,
                grace_period=cfg.get("grace_period") if hb else None,
                heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=cfg.get("max_retry"))
                if hb
                else None,
            )

    if url.startswith("sqlite:///"):
        # The first RDBStorage on a new file creates its tables; two launchers doing that at once collide.
        from filelock import FileLock

        from ..loggers.store import lock_path

        db = Path(url[len("sqlite:///") :]).expanduser().resolve()
        db.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(lock_path(db), timeout=300):
            return build()
    return build()


def make_sampler(spec: SweepSpec, seed: Optional[int]):
    import optuna.samplers as S

    name, opts = spec.sampler["name"], dict(spec.sampler["options"])
    try:
        return getattr(S, SAMPLERS[name])(seed=seed, **opts)
    except (TypeError, ValueError, ImportError) as err:
        raise SpecError(f"{spec.path}: sampler: cannot build {name} with options {opts}: {err}") from err


def make_pruner(spec: SweepSpec):
    return build_pruner(spec.pruner, where=str(spec.path))


def build_pruner(block: dict[str, Any], where: str = "<sweep>"):
    """The pruner of a spec's `pruner` block ({name, options}); also built by a subprocess trial (link.py)."""
    import optuna.pruners as P

    name, opts = block["name"], dict(block.get("options") or {})
    try:
        if name == "patient":
            opts.setdefault("wrapped_pruner", None)
        return getattr(P, PRUNERS[name])(**opts)
    except (TypeError, ValueError) as err:
        raise SpecError(f"{where}: pruner: cannot build {name} with options {opts}: {err}") from err
