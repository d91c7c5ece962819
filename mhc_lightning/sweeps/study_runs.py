"""The study's MLflow runs: one parent run per study (found again by tags, so re-runs and other machines share it)
and one child run per trial, created before the trial trains so that even a trial that fails early is recorded;
at the end, the best trial(s), counts, trials table and Optuna's plots on the parent run.

Writes go through the spool (loggers/spool.py), so a tracking-server outage between trials loses nothing.
"""

from __future__ import annotations

import functools
import re
import time
import warnings
from pathlib import Path
from typing import Any, Optional

from ..loggers.filters import equals
from ..loggers.spool import GuardedClient
from ..loggers.store import ensure_experiment, is_outage, quiet_store_errors, redact, use_fast_http_failures

PARENT_TAG, TRIAL_TAG, STUDY_TAG, ROLE_TAG, STATE_TAG = (
    "mlflow.parentRunId",
    "optuna.trial",
    "optuna.study_name",
    "optuna.role",
    "optuna.state",
)
PARENT_WAIT_S = 30.0  # how long a process that did not create the study waits for its creator's parent run
FLUSH_TIMEOUT_S = 30.0  # how long the summary's writes are retried at the end, as a fit's (then they wait in the spool)


def _safe_key(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_/. -]+", "_", key)


class SweepTracker:
    """One parent run per study (found again by tags, so re-runs and other machines share it) and one
    child run per trial, created before the trial trains so that even a trial that fails early is recorded."""

    def __init__(
        self, tracking_uri: str, experiment: str, study_name: str, storage_label: str, spool_root: str = "mlflow_spool"
    ):
        from mlflow import MlflowClient

        use_fast_http_failures()
        quiet_store_errors()
        self.uri, self.experiment_name = tracking_uri, experiment
        self.study_name, self.storage_label = study_name, storage_label
        self.raw = MlflowClient(tracking_uri)
        self.client = GuardedClient(self.raw, spool_root, label=f" at {redact(tracking_uri)}")
        self._experiment_id: Optional[str] = None
        self.parent_id: Optional[str] = None

    @property
    def experiment_id(self) -> str:
        if self._experiment_id is None:
            self._experiment_id = ensure_experiment(self.raw, self.experiment_name)
        return self._experiment_id

    def _find_parents(self):
        flt = (
            f"tags.`{ROLE_TAG}` = 'study' and {equals(f'tags.`{STUDY_TAG}`', self.study_name)} "
            f"and {equals('tags.`optuna.storage`', self.storage_label)}"
        )
        runs = [
            r
            for r in self.raw.search_runs([self.experiment_id], flt, max_results=50)
            if r.data.tags.get(STUDY_TAG) == self.study_name
        ]
        return sorted(runs, key=lambda r: (r.info.start_time, r.info.run_id))

    def ensure_parent(self, study, spec=None, creator: bool = True, wait_s: float = PARENT_WAIT_S) -> str:
        """The study's parent run: from the study's user attrs, else by tags, else a new one.

        creator: whether this process created the study (Sweep.created). Launchers started at the same moment on a
        fresh store would each create a parent run, and which ones they see of each other's depends on when each
        store commit lands (CI once saw two parents). So only the study's creator makes one; every other process
        waits (up to wait_s) for the creator's run id in the study's user attrs, and falls back to the search by tags,
        then to a new run, only if the creator died before recording it."""
        pid = study.user_attrs.get("mlflow_parent_run_id")
        deadline = time.monotonic() + (0.0 if creator else wait_s)
        while not pid and time.monotonic() < deadline:
            time.sleep(0.25)
            pid = study.user_attrs.get("mlflow_parent_run_id")
        if not pid and not creator:
            warnings.warn(
                f"study {self.study_name!r}: its creator recorded no MLflow parent run within "
                f"{wait_s:.0f} s; looking for one by tags",
                RuntimeWarning,
                stacklevel=1,
            )
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
                tags = {
                    ROLE_TAG: "study",
                    STUDY_TAG: self.study_name,
                    "optuna.storage": self.storage_label,
                    "optuna.directions": ",".join(d.name.lower() for d in study.directions),
                }
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

    def start_trial(
        self,
        trial,
        values: dict[str, Any],
        worker: dict[str, Any],
        retry_of: Optional[int] = None,
        wait_s: float = 300.0,
    ) -> str:
        """Create the trial's child run; wait (bounded) if the server is down between trials."""
        tags = {
            PARENT_TAG: self.parent_id,
            ROLE_TAG: "trial",
            STUDY_TAG: self.study_name,
            TRIAL_TAG: str(trial.number),
            "optuna.storage": self.storage_label,
            STATE_TAG: "RUNNING",
            **{f"optuna.worker.{k}": str(v) for k, v in worker.items()},
        }
        if retry_of is not None:
            tags["optuna.retry_of"] = str(retry_of)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                run = self.raw.create_run(
                    self.experiment_id, run_name=f"{self.study_name}-t{trial.number:04d}", tags=tags
                )
                break
            except Exception as err:
                if not is_outage(err) or time.monotonic() > deadline:
                    raise
                warnings.warn(
                    f"MLflow {redact(self.uri)} unreachable before trial {trial.number}; retrying",
                    RuntimeWarning,
                    stacklevel=1,
                )
                time.sleep(5)
        run_id = run.info.run_id
        trial.set_user_attr("mlflow_run_id", run_id)
        from mlflow.entities import Param

        self.client.log_batch(run_id, params=[Param(_safe_key(f"trial.{k}"), str(v)[:500]) for k, v in values.items()])
        return run_id

    def end_trial(
        self,
        run_id: str,
        state: str,
        values: Optional[dict[str, float]] = None,
        error: Optional[str] = None,
        extra_tags: Optional[dict] = None,
    ) -> None:
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
        counts = {
            s.name.lower(): sum(t.state == s for t in trials)
            for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING, TrialState.WAITING)
        }
        pid = self.parent_id
        for k, v in counts.items():
            self.client.log_metric(pid, f"trials/{k}", v, step=len(trials))
        summary: dict[str, Any] = {"counts": counts, "parent_run_id": pid}
        labels = [o.label for o in spec.objectives]
        done = [t for t in trials if t.state == TrialState.COMPLETE]
        if done and not spec.multi_objective:
            best = study.best_trial
            summary["best"] = {
                "trial": best.number,
                "value": best.value,
                "params": best.params,
                "run_id": best.user_attrs.get("mlflow_run_id"),
            }
            self.client.set_tag(pid, "best.trial", str(best.number))
            self.client.set_tag(pid, "best.run_id", str(best.user_attrs.get("mlflow_run_id")))
            self.client.set_tag(pid, "best.value", repr(best.value))
            for k, v in best.params.items():
                self.client.set_tag(pid, _safe_key(f"best.param.{k}"), str(v))
            self.client.log_metric(pid, _safe_key(f"best/{labels[0]}"), best.value, step=len(trials))
        elif done:
            front = study.best_trials
            summary["pareto_front"] = [
                {"trial": t.number, "values": t.values, "params": t.params, "run_id": t.user_attrs.get("mlflow_run_id")}
                for t in front
            ]
            self.client.set_tag(pid, "pareto.trials", ",".join(str(t.number) for t in front))
        self.client.log_dict(pid, summary, "best_trial.json")
        with tempfile.TemporaryDirectory() as tmp:
            try:
                df = study.trials_dataframe()
                df.to_csv(Path(tmp) / "trials.csv", index=False)
                self.client.log_artifact(pid, str(Path(tmp) / "trials.csv"))
            except Exception as err:  # pandas missing or an empty study
                warnings.warn(f"trials.csv not written: {err}", RuntimeWarning, stacklevel=1)
            skipped = self._log_plots(study, spec, Path(tmp))
        summary["plots_skipped"] = skipped
        self.client.set_tag(pid, "sweep.status", "complete" if complete else "incomplete")
        if complete:
            self.client.set_terminated(pid, "FINISHED")
        self.client.drain(FLUSH_TIMEOUT_S)  # what is left is named at the end of the command (supervisor.py)
        return summary

    def _log_plots(self, study, spec, tmp: Path) -> dict[str, str]:
        """Optuna's matplotlib plots as PNGs under plots/; each one that cannot be drawn is listed with why."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import optuna.visualization.matplotlib as ovm

        targets = (
            [(None, spec.objectives[0].label)]
            if not spec.multi_objective
            else [(functools.partial(lambda i, t: t.values[i], i), o.label) for i, o in enumerate(spec.objectives)]
        )
        jobs = []
        for i, (target, name) in enumerate(targets):
            suffix = "" if target is None else f"_{i}"
            kw = {} if target is None else {"target": target, "target_name": name}
            jobs += [
                (f"history{suffix}", ovm.plot_optimization_history, kw),
                (f"param_importances{suffix}", ovm.plot_param_importances, kw),
                (f"parallel_coordinate{suffix}", ovm.plot_parallel_coordinate, kw),
            ]
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
