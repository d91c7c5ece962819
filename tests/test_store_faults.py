"""A local MLflow store (SQLite) that stops taking writes in the middle of a fit: the writes are kept in the spool as
for a server outage, one line says so, the command's last line says what is not in the store yet, and
`mhc sweep replay` sends it, the run ending FINISHED with every step once. The fault is SQLite's own: the store's
connections are switched to read-only (PRAGMA query_only), as a store file made read-only or a full disk gives."""

from __future__ import annotations

import logging

import lightning as L
import pytest
from helpers import derived_spec, mlflow_logger_arg, one_thread, tiny_fit_args
from mlflow import MlflowClient
from sqlalchemy import event
from sqlalchemy.pool import Pool

from mhc_lightning.fit.cli import main
from mhc_lightning.loggers.store import quiet_store_errors

READ_ONLY = {"on": False}


def _query_only(dbapi_connection, record, proxy) -> None:
    dbapi_connection.execute(f"PRAGMA query_only = {int(READ_ONLY['on'])}")


@pytest.fixture
def breakable_store():
    """Every SQLite connection MLflow checks out in this process is read-only while READ_ONLY['on']."""
    event.listen(Pool, "checkout", _query_only)
    try:
        yield READ_ONLY
    finally:
        READ_ONLY["on"] = False
        event.remove(Pool, "checkout", _query_only)


class ReadOnlyStoreFrom(L.Callback):
    """Fault: the tracking store refuses every write from optimizer step `step` on."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            READ_ONLY["on"] = True


def test_a_store_that_stops_taking_writes_mid_run_loses_nothing(
    breakable_store, tiny_corpus, mlflow_uri, tmp_path, capfd, recwarn
):
    steps, spool = 8, tmp_path / "spool"
    args = tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / "root", steps=steps)
    args[-1] = mlflow_logger_arg(mlflow_uri, spool_dir=str(spool), retry_every=0.2, flush_timeout=0.5)
    args += [
        "--trainer.val_check_interval=4",
        "--model.diagnostics_every=0",
        '--trainer.callbacks+={"class_path": "test_store_faults.ReadOnlyStoreFrom", "init_args": {"step": 3}}',
    ]
    with one_thread():
        main(args)  # returns: the fit trained to the end
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "SQL" not in err, err[-3000:]
    said = [str(w.message) for w in recwarn if "MLflow" in str(w.message)]
    assert len(said) == 2 and all("\n" not in line for line in said), said  # the outage once; last system metrics
    assert "MLflow unreachable at sqlite:" in said[0] and "(attempt to write a readonly database)" in said[0]
    last = out.strip().splitlines()[-1]
    assert last.startswith("not sent yet: ") and "(attempt to write a readonly database)" in last
    assert f"mhc sweep replay {spool} --tracking-uri {mlflow_uri}" in last
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "RUNNING" and run.info.run_id in last  # the store cannot say otherwise yet

    breakable_store["on"] = False
    from mhc_lightning.sweeps.cli import main as sweep_main

    assert sweep_main(["replay", str(spool), "--tracking-uri", mlflow_uri]) == 0
    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED"
    history = lambda key: sorted(m.step for m in client.get_metric_history(run.info.run_id, key))  # noqa: E731
    assert history("train/loss") == list(range(steps))  # each step once, those after the fault from the spool
    assert history("val/loss") == [3, 7]  # the validation of step 4 ran with the store refusing writes
    assert "mhc.weights_sha256" in run.data.tags and not list(spool.rglob("*.jsonl"))


def test_store_errors_print_one_line(capfd):
    """MLflow logs a traceback per failed store write and its system-metrics thread the whole SQL error; the spool says
    it once, so the first is dropped and the second cut to its first line and the database's reason."""
    quiet_store_errors()
    logging.getLogger("mlflow.store.db.utils").exception("SQLAlchemy database error. The following exception is ...")
    logging.getLogger("mlflow.system_metrics.system_metrics_monitor").warning(
        "Failed to get mlflow run: (sqlite3.OperationalError) database is locked\n[SQL: SELECT runs.run_uuid ...]\n"
        "(Background on this error at: https://sqlalche.me/e/21/e3q8)."
    )
    err = capfd.readouterr().err
    assert "SQLAlchemy" not in err and err.count("\n") == 1
    assert err.strip().endswith("Failed to get mlflow run: (sqlite3.OperationalError) database is locked")


@pytest.mark.slow
def test_a_sweep_ending_against_a_store_that_takes_no_writes_says_so_last(
    breakable_store, tiny_corpus, mlflow_uri, tmp_path, monkeypatch, capsys
):
    """One trial trains; then the store stops taking writes, so the study's summary and the parent run's end wait in
    the spool. The sweep's last line says how many writes wait, where, and the command that sends them."""
    import mhc_lightning.sweeps.study_runs as study_runs
    from mhc_lightning.sweeps.cli import main as sweep_main

    finalize = study_runs.SweepTracker.finalize

    def finalize_read_only(self, *args, **kwargs):
        breakable_store["on"] = True
        return finalize(self, *args, **kwargs)

    monkeypatch.setattr(study_runs.SweepTracker, "finalize", finalize_read_only)
    monkeypatch.setattr(study_runs, "FLUSH_TIMEOUT_S", 0.2)
    fixed = {"trainer.max_steps": 2, "trainer.val_check_interval": 2, "model.diagnostics_every": 0}
    spec = derived_spec(tmp_path / "s.yaml", "ends-read-only", enqueue=[], fixed=fixed, budget={"n_trials": 1})
    spool = tmp_path / "spool"
    code = sweep_main(
        ["run", str(spec), "--storage", f"sqlite:///{tmp_path / 'sweeps.db'}", "--tracking-uri", mlflow_uri]
        + ["--set", f"data.corpus={tiny_corpus}", "--set", f"trainer.default_root_dir={tmp_path / 'runs'}"]
        + ["--spool-dir", str(spool)]
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert code == 0  # the study holds its budget; what MLflow lacks is said, and kept
    assert last.startswith("[mhc sweep] ") and "MLflow writes not in the store yet" in last, last
    assert "(attempt to write a readonly database)" in last
    assert last.endswith(f"mhc sweep replay {spool} --tracking-uri {mlflow_uri}")
    breakable_store["on"] = False
    assert sweep_main(["replay", str(spool), "--tracking-uri", mlflow_uri]) == 0
    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name("ends-read-only")
    (parent,) = client.search_runs([exp.experiment_id], "tags.`optuna.role` = 'study'")
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep.status"] == "complete"


def test_an_interrupted_fit_whose_store_refuses_its_end_says_where_it_waits(tmp_path, capsys):
    """Ctrl-C / SIGTERM marks the run KILLED through the spool; a store that refuses it leaves the write there, and the
    interrupt's last line says so (instead of only 'marked KILLED')."""
    import signal

    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE  # what MLflow raises a SQLite OperationalError as

    from mhc_lightning.callbacks.graceful_stop import STOP
    from mhc_lightning.fit.interrupts import finish
    from mhc_lightning.loggers.spool import GuardedClient

    class ReadOnlyStore:
        tracking_uri = "sqlite:///store.db"

        def set_terminated(self, run_id, status):
            raise MlflowException(
                "(sqlite3.OperationalError) attempt to write a readonly database", error_code=TEMPORARILY_UNAVAILABLE
            )

    guard = GuardedClient(ReadOnlyStore(), tmp_path / "spool")
    STOP.signum, STOP.step, STOP.runs = signal.SIGTERM, 3, [(guard, "a" * 32)]
    with pytest.warns(RuntimeWarning, match="attempt to write a readonly database"):
        assert finish(["fit", "-c", "x.yaml"]) == 128 + signal.SIGTERM
    *_, stopped, last = capsys.readouterr().err.strip().splitlines()
    assert "stopped by SIGTERM at step 3" in stopped and "marked KILLED" in stopped
    assert last.startswith("mhc fit: 1 MLflow writes not in the store yet (attempt to write a readonly database)")
    assert f"kept in {tmp_path / 'spool' / ('a' * 32)}" in last and "--tracking-uri sqlite:///store.db" in last
