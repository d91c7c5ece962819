"""MLflow for sweeps: writes that survive a tracking-server outage, and the study's parent/child runs.

(The Lightning logger built on this is in logger.py, so that launchers need not import Lightning.)

Outage policy (docs/sweeps.md, "When the MLflow server is down"):
- at start, an unreachable server is an error that names the URL (`check_tracking`);
- during a run, every write that fails because the server is unreachable is kept, in order, in a
  spool file on local disk (artifacts are copied there) and retried after `retry_every` seconds,
  then after twice as long while it keeps failing (up to 10 min); training waits on the server for
  at most one failed request per retry;
- at the end of fit the spool is retried for up to `flush_timeout` seconds; what is still left stays
  on disk and `mhc sweep replay <spool dir> --tracking-uri URI` sends it later, original timestamps kept.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import socket
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Optional

# Fail fast instead of MLflow's default 7 retries with exponential backoff (minutes per call).
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                  "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
PARENT_TAG, TRIAL_TAG, STUDY_TAG, ROLE_TAG, STATE_TAG = (
    "mlflow.parentRunId", "optuna.trial", "optuna.study_name", "optuna.role", "optuna.state")


class TrackingUnreachable(RuntimeError):
    """The MLflow tracking store cannot be reached; the message names the URI."""


def redact(url: str) -> str:
    """user:password@host -> user:***@host, for tags and messages."""
    return re.sub(r"(//[^:/@]+:)[^@]*@", r"\1***@", url)


def is_outage(err: BaseException) -> bool:
    """True for errors that mean 'the server is not there right now', as opposed to a bad request."""
    import requests
    from mlflow.exceptions import MlflowException, RestException

    if isinstance(err, RestException):
        return err.get_http_status_code() >= 500
    if isinstance(err, (requests.RequestException, ConnectionError, TimeoutError)):
        return True
    if isinstance(err, MlflowException):
        msg = str(err)
        code = re.search(r"error code (\d{3})", msg)  # a non-JSON HTTP answer, e.g. the Host-header check's 403
        if code:
            return int(code.group(1)) >= 500
        return any(s in msg for s in ("API request to", "Max retries exceeded", "Connection", "database is locked"))
    return False


def use_fast_http_failures() -> None:
    for k, v in _HTTP_DEFAULTS.items():
        os.environ.setdefault(k, v)


def check_tracking(uri: str, timeout: float = 10.0) -> None:
    """Raise TrackingUnreachable (naming the URI) unless the tracking store answers."""
    from mlflow import MlflowClient

    if uri.startswith(("http://", "https://")):
        import requests

        try:
            requests.get(uri.rstrip("/") + "/health", timeout=timeout).raise_for_status()
        except requests.RequestException as err:
            raise TrackingUnreachable(
                f"MLflow tracking server {redact(uri)} is unreachable ({type(err).__name__}: {err}). Start it "
                "(`docker compose up -d mlflow`, or `mlflow server ...`) or pass another --tracking-uri.") from err
    # /health skips the server's Host-header check; one API call does not
    try:
        MlflowClient(uri).search_experiments(max_results=1)
    except Exception as err:
        hint = (" (add this host name to the server's --allowed-hosts / MLFLOW_ALLOWED_HOSTS)"
                if "Invalid Host header" in str(err) else "")
        raise TrackingUnreachable(f"MLflow tracking store {redact(uri)} refused the connection: {err}{hint}") from err


# ---- spool: failed writes kept on disk, replayed in order ------------------------------------------
class GuardedClient:
    """Wraps MlflowClient: writes that fail because the server is down go to a spool instead of raising."""

    WRITES = {"log_batch", "log_metric", "log_param", "set_tag", "delete_tag", "log_text", "log_dict",
              "log_figure", "log_artifact", "log_artifacts", "set_terminated", "update_run"}

    def __init__(self, client, spool_root, retry_every: float = 30.0, label: str = ""):
        self._client = client
        self.spool_root = Path(spool_root)
        self.retry_every = retry_every
        self.label = label
        self._file: Optional[Path] = None  # this guard's journal; created at the first failure
        self._pending = 0
        self._last_try = 0.0
        self._delay = retry_every  # doubles while retries keep failing (a black-holed server costs a timeout each)
        self.dropped = 0

    @property
    def pending(self) -> int:
        return self._pending

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        return functools.partial(self._write, name) if name in self.WRITES else attr

    def _write(self, name: str, *args, **kwargs):
        if self._pending and not self.flush():
            self._spool(name, args, kwargs)  # keep order: nothing overtakes what is already queued
            return None
        try:
            return getattr(self._client, name)(*args, **kwargs)
        except Exception as err:
            if not is_outage(err):
                raise
            self._last_try = time.monotonic()
            warnings.warn(f"MLflow unreachable{self.label}: {type(err).__name__}; keeping writes in {self.spool_root} "
                          "and training on", RuntimeWarning, stacklevel=3)
            self._spool(name, args, kwargs)
            return None

    def flush(self, force: bool = False) -> bool:
        """Send the spooled writes; True when nothing is left. Tries at most every retry_every seconds."""
        if not self._pending:
            return True
        if not force and time.monotonic() - self._last_try < self._delay:
            return False
        self._last_try = time.monotonic()
        left = replay_file(self._file, self._client)
        self._pending = left
        if left:
            self._delay = min(2 * self._delay, max(self.retry_every, 600.0))
        else:
            self._file = None  # replay_file removed it; the next outage starts a new one
            self._delay = self.retry_every
        return left == 0

    def drain(self, timeout: float, uri: str = "") -> bool:
        """Retry until the spool is empty or timeout seconds have passed (end of fit)."""
        deadline = time.monotonic() + timeout
        while not self.flush(force=True):
            if time.monotonic() >= deadline:
                warnings.warn(
                    f"MLflow server {redact(uri)} still unreachable: {self._pending} writes kept in {self._file.parent}. "
                    f"Send them later with:  mhc sweep replay {self.spool_root} --tracking-uri {redact(uri)}",
                    RuntimeWarning, stacklevel=2)
                return False
            time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        return True

    # Each record is self-contained JSON; artifacts are copied into the spool so that rotated
    # checkpoints or temporary directories can still be uploaded later.
    def _spool(self, name: str, args: tuple, kwargs: dict) -> None:
        run_id = kwargs.get("run_id", args[0] if args else "unknown")
        if self._file is None:
            self._file = self.spool_root / str(run_id) / f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        self._file.parent.mkdir(parents=True, exist_ok=True)
        try:
            record = _to_record(name, args, kwargs, self._file.parent / "files" / uuid.uuid4().hex[:12])
        except Exception as err:  # an object we cannot serialise: say so rather than fail the run
            self.dropped += 1
            warnings.warn(f"could not keep MLflow call {name} for later ({err}); dropped", RuntimeWarning)
            return
        record["t"] = time.time()
        with open(self._file, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._pending += 1


def _bind(fn, args, kwargs) -> dict:
    import inspect

    bound = inspect.signature(fn).bind(*args, **kwargs)
    return dict(bound.arguments)


def _to_record(name: str, args: tuple, kwargs: dict, files: Path) -> dict:
    from mlflow import MlflowClient

    a = _bind(getattr(MlflowClient, name), (None, *args), kwargs)
    a.pop("self", None)
    run_id = a.pop("run_id")
    if name == "log_batch":
        return {"op": name, "run_id": run_id,
                "metrics": [[m.key, m.value, m.timestamp, m.step] for m in a.get("metrics") or []],
                "params": [[p.key, p.value] for p in a.get("params") or []],
                "tags": [[t.key, t.value] for t in a.get("tags") or []]}
    if name in ("log_text", "log_dict", "log_figure"):
        artifact_file = a["artifact_file"]
        files.mkdir(parents=True, exist_ok=True)
        local = files / Path(artifact_file).name
        if name == "log_text":
            local.write_text(a["text"])
        elif name == "log_dict":
            import yaml

            with open(local, "w") as f:
                if local.suffix in (".yaml", ".yml"):
                    yaml.safe_dump(a["dictionary"], f)
                else:
                    json.dump(a["dictionary"], f, indent=2)
        else:
            a["figure"].savefig(local, **(a.get("save_kwargs") or {}))
        parent = str(Path(artifact_file).parent)
        return {"op": "log_artifact", "run_id": run_id, "local_path": str(local),
                "artifact_path": None if parent == "." else parent}
    if name == "log_artifact":
        files.mkdir(parents=True, exist_ok=True)
        local = files / Path(a["local_path"]).name
        shutil.copy2(a["local_path"], local)
        return {"op": name, "run_id": run_id, "local_path": str(local), "artifact_path": a.get("artifact_path")}
    if name == "log_artifacts":
        local = files / "dir"
        shutil.copytree(a["local_dir"], local)
        return {"op": name, "run_id": run_id, "local_dir": str(local), "artifact_path": a.get("artifact_path")}
    a.pop("synchronous", None)
    json.dumps(a)  # raises for values that cannot be kept
    return {"op": name, "run_id": run_id, "kwargs": a}


def _apply(client, rec: dict) -> None:
    from mlflow.entities import Metric, Param, RunTag

    op, run_id = rec["op"], rec["run_id"]
    if op == "log_batch":
        client.log_batch(run_id, metrics=[Metric(k, v, ts, st) for k, v, ts, st in rec["metrics"]],
                         params=[Param(k, v) for k, v in rec["params"]], tags=[RunTag(k, v) for k, v in rec["tags"]])
    elif op == "log_artifact":
        client.log_artifact(run_id, rec["local_path"], rec["artifact_path"])
    elif op == "log_artifacts":
        client.log_artifacts(run_id, rec["local_dir"], rec["artifact_path"])
    else:
        getattr(client, op)(run_id, **rec["kwargs"])


def replay_file(path: Optional[Path], client) -> int:
    """Apply a spool file's records in order; rewrite it with what is left; return how many are left."""
    if path is None or not path.exists():
        return 0
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    done = 0
    for rec in records:
        try:
            _apply(client, rec)
        except Exception as err:
            if not is_outage(err):
                # a write the server refuses (e.g. a param logged twice on replay): skip it, keep going
                warnings.warn(f"spooled MLflow call {rec['op']} refused: {err}", RuntimeWarning)
            else:
                break
        done += 1
    left = records[done:]
    if left:
        path.write_text("".join(json.dumps(r) + "\n" for r in left))
    else:
        path.unlink()
        if path.parent.exists() and not any(p.suffix == ".jsonl" for p in path.parent.iterdir()):
            shutil.rmtree(path.parent, ignore_errors=True)
    return len(left)


def replay_spool(spool_root, tracking_uri: str) -> dict[str, int]:
    """`mhc sweep replay`: send every spooled write under spool_root; returns {run_id: writes left}."""
    from mlflow import MlflowClient

    check_tracking(tracking_uri)
    client = MlflowClient(tracking_uri)
    out = {}
    for run_dir in sorted(p for p in Path(spool_root).iterdir() if p.is_dir()):
        # several writers per run (logger, sweep): merge by time so that set_terminated comes last
        files = sorted(run_dir.glob("*.jsonl"))
        records = sorted((json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()),
                         key=lambda r: r["t"])
        merged = run_dir / "merged.jsonl"
        merged.write_text("".join(json.dumps(r) + "\n" for r in records))
        for f in files:
            if f != merged:
                f.unlink()
        out[run_dir.name] = replay_file(merged, client)
    return out


# ---- the study's runs ---------------------------------------------------------------------------
def _safe_key(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_/. -]+", "_", key)


class SweepTracker:
    """One parent run per study (found again by tags, so re-runs and other machines share it) and one
    child run per trial, created before the trial trains so that even a trial that fails early is recorded."""

    def __init__(self, tracking_uri: str, experiment: str, study_name: str, storage_label: str,
                 spool_root: str = "mlflow_spool"):
        from mlflow import MlflowClient

        use_fast_http_failures()
        self.uri, self.experiment_name, self.study_name, self.storage_label = tracking_uri, experiment, study_name, storage_label
        self.raw = MlflowClient(tracking_uri)
        self.client = GuardedClient(self.raw, spool_root, label=f" at {redact(tracking_uri)}")
        self._experiment_id: Optional[str] = None
        self.parent_id: Optional[str] = None

    @property
    def experiment_id(self) -> str:
        if self._experiment_id is None:
            exp = self.raw.get_experiment_by_name(self.experiment_name)
            if exp is None:
                try:
                    self._experiment_id = self.raw.create_experiment(self.experiment_name)
                except Exception:  # another worker created it first
                    exp = self.raw.get_experiment_by_name(self.experiment_name)
                    if exp is None:
                        raise
            if exp is not None:
                if exp.lifecycle_stage == "deleted":
                    self.raw.restore_experiment(exp.experiment_id)
                self._experiment_id = exp.experiment_id
        return self._experiment_id

    def _find_parents(self):
        flt = (f"tags.`{ROLE_TAG}` = 'study' and tags.`{STUDY_TAG}` = '{self.study_name}' "
               f"and tags.`optuna.storage` = '{self.storage_label}'")
        runs = self.raw.search_runs([self.experiment_id], flt, max_results=50)
        return sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))

    def ensure_parent(self, study, spec=None) -> str:
        """The study's parent run: from the study's user attrs, else by tags, else a new one (race-safe)."""
        pid = study.user_attrs.get("mlflow_parent_run_id")
        if pid:
            try:
                if self.raw.get_run(pid).info.lifecycle_stage == "active":
                    self.parent_id = pid
            except Exception as err:
                if is_outage(err):
                    raise
        if self.parent_id is None:
            found = self._find_parents()
            if found:
                self.parent_id = found[0].info.run_id
            else:
                tags = {ROLE_TAG: "study", STUDY_TAG: self.study_name, "optuna.storage": self.storage_label,
                        "optuna.directions": ",".join(d.name.lower() for d in study.directions)}
                if spec is not None and spec.path is not None:
                    tags["mhc.sweep_file"] = str(spec.path)
                mine = self.raw.create_run(self.experiment_id, run_name=self.study_name, tags=tags).info.run_id
                first = self._find_parents()[0].info.run_id  # two launchers at once: the older run wins
                if first != mine:
                    self.raw.delete_run(mine)
                elif spec is not None:
                    if spec.raw_text:
                        self.raw.log_text(mine, spec.raw_text, "sweep.yaml")
                    if spec.description:
                        self.raw.set_tag(mine, "mlflow.note.content", spec.description)
                self.parent_id = first
            study.set_user_attr("mlflow_parent_run_id", self.parent_id)
            study.set_user_attr("mlflow_tracking_uri", redact(self.uri))
            study.set_user_attr("mlflow_experiment_id", self.experiment_id)
        if self.raw.get_run(self.parent_id).info.status != "RUNNING":
            self.raw.update_run(self.parent_id, status="RUNNING")  # a resumed study
        return self.parent_id

    def start_trial(self, trial, values: dict[str, Any], worker: dict[str, Any], retry_of: Optional[int] = None,
                    wait_s: float = 300.0) -> str:
        """Create the trial's child run; wait (bounded) if the server is down between trials."""
        tags = {PARENT_TAG: self.parent_id, ROLE_TAG: "trial", STUDY_TAG: self.study_name, TRIAL_TAG: str(trial.number),
                "optuna.storage": self.storage_label, STATE_TAG: "RUNNING",
                **{f"optuna.worker.{k}": str(v) for k, v in worker.items()}}
        if retry_of is not None:
            tags["optuna.retry_of"] = str(retry_of)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                run = self.raw.create_run(self.experiment_id, run_name=f"{self.study_name}-t{trial.number:04d}", tags=tags)
                break
            except Exception as err:
                if not is_outage(err) or time.monotonic() > deadline:
                    raise
                warnings.warn(f"MLflow {redact(self.uri)} unreachable before trial {trial.number}; retrying", RuntimeWarning)
                time.sleep(5)
        run_id = run.info.run_id
        trial.set_user_attr("mlflow_run_id", run_id)
        from mlflow.entities import Param

        self.client.log_batch(run_id, params=[Param(_safe_key(f"trial.{k}"), str(v)[:500]) for k, v in values.items()])
        return run_id

    def end_trial(self, run_id: str, state: str, values: Optional[dict[str, float]] = None,
                  error: Optional[str] = None, extra_tags: Optional[dict] = None) -> None:
        self.client.set_tag(run_id, STATE_TAG, state)
        for k, v in (extra_tags or {}).items():
            self.client.set_tag(run_id, k, str(v))
        if error:
            self.client.set_tag(run_id, "optuna.error", error[:4000])
        for label, v in (values or {}).items():
            self.client.log_metric(run_id, _safe_key(f"objective/{label}"), float(v))

    def reconcile(self, study) -> int:
        """Make each child run's optuna.state match Optuna (trials failed by heartbeat, killed workers, ...)."""
        from optuna.trial import TrialState

        fixed = 0
        for t in study.get_trials(deepcopy=False):
            run_id = t.user_attrs.get("mlflow_run_id")
            if not run_id or t.state in (TrialState.RUNNING, TrialState.WAITING):
                continue
            state = {TrialState.COMPLETE: "COMPLETE", TrialState.PRUNED: "PRUNED", TrialState.FAIL: "FAILED"}[t.state]
            try:
                run = self.raw.get_run(run_id)
            except Exception as err:
                if is_outage(err):
                    raise
                continue
            if run.data.tags.get(STATE_TAG) != state:
                self.client.set_tag(run_id, STATE_TAG, state)
                fixed += 1
            if run.info.status == "RUNNING":
                self.client.set_terminated(run_id, "FAILED" if state == "FAILED" else "FINISHED")
        return fixed

    def finalize(self, study, spec, complete: bool) -> dict[str, Any]:
        """Best trial(s), counts, trials table and Optuna's plots on the parent run."""
        import tempfile

        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        counts = {s.name.lower(): sum(t.state == s for t in trials) for s in
                  (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING, TrialState.WAITING)}
        pid = self.parent_id
        for k, v in counts.items():
            self.client.log_metric(pid, f"trials/{k}", v, step=len(trials))
        summary: dict[str, Any] = {"counts": counts, "parent_run_id": pid}
        labels = [o.label for o in spec.objectives]
        done = [t for t in trials if t.state == TrialState.COMPLETE]
        if done and not spec.multi_objective:
            best = study.best_trial
            summary["best"] = {"trial": best.number, "value": best.value, "params": best.params,
                               "run_id": best.user_attrs.get("mlflow_run_id")}
            self.client.set_tag(pid, "best.trial", str(best.number))
            self.client.set_tag(pid, "best.run_id", str(best.user_attrs.get("mlflow_run_id")))
            self.client.set_tag(pid, "best.value", repr(best.value))
            for k, v in best.params.items():
                self.client.set_tag(pid, _safe_key(f"best.param.{k}"), str(v))
            self.client.log_metric(pid, _safe_key(f"best/{labels[0]}"), best.value, step=len(trials))
        elif done:
            front = study.best_trials
            summary["pareto_front"] = [{"trial": t.number, "values": t.values, "params": t.params,
                                        "run_id": t.user_attrs.get("mlflow_run_id")} for t in front]
            self.client.set_tag(pid, "pareto.trials", ",".join(str(t.number) for t in front))
        self.client.log_dict(pid, summary, "best_trial.json")
        with tempfile.TemporaryDirectory() as tmp:
            try:
                df = study.trials_dataframe()
                df.to_csv(Path(tmp) / "trials.csv", index=False)
                self.client.log_artifact(pid, str(Path(tmp) / "trials.csv"))
            except Exception as err:  # pandas missing or an empty study
                warnings.warn(f"trials.csv not written: {err}", RuntimeWarning)
            skipped = self._log_plots(study, spec, Path(tmp))
        summary["plots_skipped"] = skipped
        self.client.set_tag(pid, "sweep.status", "complete" if complete else "incomplete")
        if complete:
            self.client.set_terminated(pid, "FINISHED")
        self.client.flush(force=True)
        return summary

    def _log_plots(self, study, spec, tmp: Path) -> dict[str, str]:
        """Optuna's matplotlib plots as PNGs under plots/; each one that cannot be drawn is listed with why."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import optuna.visualization.matplotlib as ovm

        targets = [(None, spec.objectives[0].label)] if not spec.multi_objective else [
            (functools.partial(lambda i, t: t.values[i], i), o.label) for i, o in enumerate(spec.objectives)]
        jobs = []
        for i, (target, name) in enumerate(targets):
            suffix = "" if target is None else f"_{i}"
            kw = {} if target is None else {"target": target, "target_name": name}
            jobs += [(f"history{suffix}", ovm.plot_optimization_history, kw),
                     (f"param_importances{suffix}", ovm.plot_param_importances, kw),
                     (f"parallel_coordinate{suffix}", ovm.plot_parallel_coordinate, kw)]
        if spec.multi_objective and len(spec.objectives) in (2, 3):
            jobs.append(("pareto_front", ovm.plot_pareto_front, {"target_names": [o.label for o in spec.objectives]}))
        skipped = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, fn, kw in jobs:
                try:
                    ax = fn(study, **kw)
                    ax = ax.flat[0] if hasattr(ax, "flat") else ax
                    fig = ax.figure
                    fig.set_size_inches(max(fig.get_size_inches()[0], 8), max(fig.get_size_inches()[1], 5))
                    path = tmp / f"{name}.png"
                    fig.savefig(path, dpi=110, bbox_inches="tight")
                    plt.close(fig)
                    self.client.log_artifact(self.parent_id, str(path), "plots")
                except Exception as err:  # too few trials, one parameter, ...
                    skipped[name] = f"{type(err).__name__}: {err}"
                    plt.close("all")
        if skipped:
            self.client.log_dict(self.parent_id, skipped, "plots/skipped.json")
        return skipped
