"""The MLflow outage spool, without a server: a client that fails like an unreachable server on demand."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import Metric  # noqa: E402
from mlflow.exceptions import MlflowException, RestException  # noqa: E402

from mhc_lightning.loggers.spool import GuardedClient  # noqa: E402
from mhc_lightning.loggers.store import TrackingUnreachable, check_tracking, is_outage  # noqa: E402

DOWN = MlflowException(
    "API request to http://mlflow:5000/api/2.0/mlflow/runs/log-batch failed with exception "
    "HTTPConnectionPool(host='mlflow', port=5000): Max retries exceeded"
)


class Flaky:
    """Wraps a real client; while `down`, every call fails the way MLflow reports an unreachable server."""

    def __init__(self, real):
        self.real, self.down, self.calls = real, False, 0

    def __getattr__(self, name):
        attr = getattr(self.real, name)

        def call(*args, **kwargs):
            self.calls += 1
            if self.down:
                raise DOWN
            return attr(*args, **kwargs)

        return call


def test_outage_classification():
    assert is_outage(DOWN) and is_outage(ConnectionError("refused"))
    assert not is_outage(RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "bad key"}))
    assert not is_outage(
        MlflowException(
            "API request to endpoint /x failed with error code 403 != 200. Response body: 'Invalid Host header'"
        )
    )
    assert is_outage(MlflowException("API request to endpoint /x failed with error code 503 != 200."))


def test_writes_are_kept_in_order_and_flushed_when_the_server_returns(mlflow_uri, tmp_path):
    real = MlflowClient(mlflow_uri)
    run_id = real.create_run(real.create_experiment("spool")).info.run_id
    flaky = Flaky(real)
    guard = GuardedClient(flaky, tmp_path / "spool", retry_every=0.0)
    guard.log_batch(run_id, metrics=[Metric("loss", 3.0, 1, 0)])  # up: goes straight through
    flaky.down = True
    with pytest.warns(RuntimeWarning, match="MLflow unreachable"):
        guard.log_batch(run_id, metrics=[Metric("loss", 2.0, 2, 1)])
    guard.log_metric(run_id, "loss", 1.5, step=2)
    guard.log_dict(run_id, {"a": [1, 2]}, "diagnostics/per_layer_step0000002.json")
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    guard.log_figure(run_id, fig, "diagnostics/plot.png")
    plt.close(fig)  # the caller closes its figure right away: the spool has its own PNG copy
    guard.set_tag(run_id, "k", "v")
    assert guard.pending == 5 and len(list((tmp_path / "spool").rglob("*.jsonl"))) == 1
    flaky.down = False
    guard.log_metric(run_id, "loss", 1.0, step=3)  # the next write sends the backlog first
    assert guard.pending == 0 and not list((tmp_path / "spool").rglob("*.jsonl"))
    hist = [(m.step, m.value) for m in real.get_metric_history(run_id, "loss")]
    assert sorted(hist) == [(0, 3.0), (1, 2.0), (2, 1.5), (3, 1.0)]
    arts = {a.path for a in real.list_artifacts(run_id, "diagnostics")}
    assert arts == {"diagnostics/per_layer_step0000002.json", "diagnostics/plot.png"}
    assert real.get_run(run_id).data.tags["k"] == "v"


def test_retries_back_off_and_refused_writes_still_raise(mlflow_uri, tmp_path):
    real = MlflowClient(mlflow_uri)
    run_id = real.create_run(real.create_experiment("backoff")).info.run_id
    flaky = Flaky(real)
    guard = GuardedClient(flaky, tmp_path / "spool", retry_every=0.01)
    flaky.down = True
    with pytest.warns(RuntimeWarning):
        guard.set_tag(run_id, "a", "1")
    calls = flaky.calls
    for i in range(50):  # while the server is away most writes do not even try: no training time lost
        guard.set_tag(run_id, f"t{i}", "x")
    assert flaky.calls - calls < 15 and guard.pending == 51
    flaky.down = False
    with pytest.raises(MlflowException):  # a request the server rejects is a bug, not an outage
        GuardedClient(real, tmp_path / "other").log_param("no-such-run", "p", 1)


def test_replay_after_the_run_ended(mlflow_uri, tmp_path, capsys):
    """What is left at the end of fit waits on disk; `mhc sweep replay` sends it later."""
    real = MlflowClient(mlflow_uri)
    run_id = real.create_run(real.create_experiment("later")).info.run_id
    flaky = Flaky(real)
    flaky.down = True
    guard = GuardedClient(flaky, tmp_path / "spool", retry_every=0.0)
    with pytest.warns(RuntimeWarning):
        guard.log_batch(run_id, metrics=[Metric("loss", 2.0, 2, 7)])
        guard.set_terminated(run_id, "FINISHED")
        assert not guard.drain(0.2)
    assert real.get_run(run_id).info.status == "RUNNING"
    from mhc_lightning.sweeps.cli import main

    assert main(["replay", str(tmp_path / "spool"), "--tracking-uri", mlflow_uri]) == 0
    assert "all writes sent" in capsys.readouterr().out
    assert real.get_run(run_id).info.status == "FINISHED"
    assert [m.step for m in real.get_metric_history(run_id, "loss")] == [7]
    assert not list((tmp_path / "spool").rglob("*.jsonl"))


def test_check_tracking_names_the_store(mlflow_uri):
    with pytest.raises(TrackingUnreachable, match="http://127.0.0.1:9/"):
        check_tracking("http://127.0.0.1:9/", timeout=2)
    check_tracking(mlflow_uri)
