"""One Optuna trial = one `mhc fit` of the sweep's base configs plus the trial's values: built in this process
(`trial.launcher: in_process`), or run as a child `mhc fit` process (`subprocess`, e.g. a multi-process DDP trial)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shlex
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState

from ..loggers.credentials import mask
from .pruning import StepPruning
from .recorder import MetricRecorder
from .settings import STOP_ATTR
from .spec import SpecError, SweepSpec
from .trial_args import sample, trial_args

LOGGER_CLASS = "mhc_lightning.loggers.ResilientMLFlowLogger"
LINK_CLASS = "mhc_lightning.sweeps.link.TrialLink"
STORAGE_ENV = "MHC_SWEEP_STORAGE"  # the storage URL for a child's rank 0: it may hold a password, so not in argv


class TrialConfigError(ValueError):
    """The trial's arguments were rejected by the `mhc fit` parser (message is the parser's)."""


class DuplicateTrial(RuntimeError):
    """The sampler proposed exactly the parameters of a trial the study already has; nothing was trained."""


class ObjectiveMetricMissing(SpecError):
    """An objective metric the model never logs: a problem of the sweep file, not of one trial."""


def build_trial_cli(args: list[str], callbacks: list):
    """The project's LightningCLI with run=False; parser errors become TrialConfigError, not SystemExit."""
    from ..fit.cli import build_cli

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), warnings.catch_warnings():
            # args are the whole command line here; sys.argv belongs to `mhc sweep`
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            return build_cli(args, run=False, trainer_defaults={"callbacks": callbacks})
    except SystemExit as exc:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        raise TrialConfigError(
            "mhc fit rejected the trial's arguments: " + (lines[-1] if lines else str(exc))
        ) from None


def fit_command(args: list[str]) -> str:
    return "mhc fit " + shlex.join(args)


class TrialRunner:
    """The Optuna objective. Keeps MLflow's child run in step with the trial's fate."""

    def __init__(
        self,
        spec: SweepSpec,
        tracker,
        tracking_uri: str,
        worker: dict[str, Any],
        spool_dir: str,
        storage_url: Optional[str] = None,
    ):
        self.spec, self.tracker, self.uri, self.worker, self.spool_dir = spec, tracker, tracking_uri, worker, spool_dir
        self.storage_url = storage_url  # for subprocess trials, which report to the study themselves
        self.current: Optional[optuna.Trial] = None
        self.duplicate = False  # the last trial was a duplicate proposal (the worker counts them in a row)

    def logger_config(self, trial, run_id: str) -> dict:
        return {
            "class_path": LOGGER_CLASS,
            "init_args": {
                "experiment_name": self.spec.mlflow["experiment"],
                "run_name": f"{self.spec.name}-t{trial.number:04d}",
                "tracking_uri": self.uri,
                "run_id": run_id,
                "log_model": self.spec.mlflow["log_model"],
                "spool_dir": self.spool_dir,
            },
        }

    def __call__(self, trial: optuna.Trial):
        from ..callbacks.progress_lines import TRIAL_ENV

        self.current, self.duplicate = trial, False
        os.environ[TRIAL_ENV] = str(trial.number)  # the fit's progress lines name the trial (a child inherits it)
        try:
            return self._run(trial)
        except optuna.TrialPruned as err:
            self._say(trial, str(err))
            raise
        except BaseException as err:
            # budget.max_failed counts FAIL trials that carry an error (counts()); one that raised before recording
            # it (in sampling, or creating its MLflow run) would look like a killed worker's and never count.
            self._record_error(trial, err)
            self._say(trial, f"failed: {type(err).__name__}: {err}"[:300])
            raise
        finally:
            os.environ.pop(TRIAL_ENV, None)

    def _say(self, trial: optuna.Trial, what: str) -> None:
        """One line about a trial, naming its worker and number (the fit's own lines name the number too)."""
        print(f"[worker {self.worker['machine']}.{self.worker['index']}, trial {trial.number}] {what}", flush=True)

    @staticmethod
    def _record_error(trial: optuna.Trial, err: BaseException) -> None:
        try:
            if not trial.user_attrs.get("error"):
                trial.set_user_attr("error", f"{type(err).__name__}: {err}"[:1000])
                if isinstance(err, (KeyboardInterrupt, SystemExit)):
                    trial.set_user_attr("interrupted", True)
        except Exception:  # the storage itself failed: the worker's next poll finds out
            pass

    def _run(self, trial: optuna.Trial):
        spec = self.spec
        others = trial.study.get_trials(deepcopy=False)
        me = next(t for t in others if t.number == trial.number)
        retry_of = RetryHeartbeatStaleTrialCallback.retried_trial_number(me)  # set by the heartbeat's retry callback
        # a re-queued trial inherits the original's user attributes: clear the outcome of the old attempt
        trial.set_user_attr("error", None)
        trial.set_user_attr("interrupted", False)
        values = sample(trial, spec)
        trial.set_user_attr("worker", self.worker["id"])
        trial.set_user_attr("sampler_seed", self.worker["seed"])
        if retry_of is None:
            twin = next(
                (
                    t.number
                    for t in others
                    if t.number != trial.number
                    and t.params == trial.params
                    and t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
                ),
                None,
            )
            if twin is not None:
                self.duplicate = True
                trial.set_user_attr("duplicate_of", twin)
                trial.set_user_attr("error", f"same parameters as trial {twin}: not trained")
                raise DuplicateTrial(f"trial {trial.number} has the parameters of trial {twin}")
        run_id = self.tracker.start_trial(trial, values, self.worker, retry_of=retry_of)
        self._say(trial, f"started: {trial.params}, MLflow run {run_id}")
        args = trial_args(spec, values, self.logger_config(trial, run_id))
        self.tracker.client.log_text(run_id, mask(fit_command(args)) + "\n", "trial_command.txt")
        metrics = list(dict.fromkeys(o.metric for o in spec.objectives))
        fit = self._fit_child if spec.trial["launcher"] == "subprocess" else self._fit_in_process
        t0 = time.time()
        try:
            recorder, pruned_at, logged = fit(trial, run_id, args, metrics)
        except BaseException as err:
            msg = f"{type(err).__name__}: {err}"
            interrupted = isinstance(err, (KeyboardInterrupt, SystemExit))
            self.tracker.end_trial(
                run_id, "FAILED", error=msg, extra_tags={"optuna.interrupted": interrupted} if interrupted else None
            )
            trial.set_user_attr("error", msg[:1000])
            if interrupted:
                trial.set_user_attr("interrupted", True)
                # Lightning turns Ctrl-C / SIGTERM into SystemExit, which Optuna would not catch (the trial
                # would stay RUNNING until its heartbeat expires): hand it a KeyboardInterrupt instead.
                raise KeyboardInterrupt(msg) from err
            raise
        extra = {"optuna.duration_s": f"{time.time() - t0:.1f}"}
        if recorder.missing:
            self._missing_metrics(trial, run_id, recorder.missing, logged, extra)
        if pruned_at is not None:
            self.tracker.end_trial(run_id, "PRUNED", extra_tags={**extra, "optuna.pruned_at_step": pruned_at})
            raise optuna.TrialPruned(f"pruned at step {pruned_at}")
        result = {o.label: recorder.value(o.metric, o.reduce) for o in spec.objectives}
        if not all(math.isfinite(v) for v in result.values()):
            msg = f"non-finite objective {result}"
            self.tracker.end_trial(run_id, "FAILED", error=msg, extra_tags=extra)
            trial.set_user_attr("error", msg)
            raise ValueError(msg)
        self.tracker.end_trial(run_id, "COMPLETE", result, extra_tags=extra)
        done = ", ".join(f"{k} {v:.4f}" for k, v in result.items())
        self._say(trial, f"complete: {done} ({extra['optuna.duration_s']} s)")
        out = tuple(result.values())
        return out if spec.multi_objective else out[0]

    def _missing_metrics(self, trial, run_id: str, missing: list[str], logged: list[str], extra: dict) -> None:
        """Fail the trial; stop the whole sweep when no trial could have logged the metric (a val/* metric absent
        after a validation, or any metric no completed trial of the study ever had)."""
        msg = (
            f"objective metric(s) {missing} never logged by `mhc fit`; it logged: {logged}. "
            "Fix objectives[].metric in the sweep file"
        )
        self.tracker.end_trial(run_id, "FAILED", error=msg, extra_tags=extra)
        trial.set_user_attr("error", msg[:1000])
        completed = trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if any(m.startswith("val/") for m in missing) or not completed:
            trial.study.set_user_attr(STOP_ATTR, f"{self.spec.path}: {msg}")
            raise ObjectiveMetricMissing(msg)
        raise ValueError(msg)

    # Both return (the recorder, the step the trial was pruned at or None, the logged metric names).
    def _fit_in_process(self, trial, run_id: str, args: list[str], metrics: list[str]):
        recorder = MetricRecorder(metrics)
        # every single-objective trial reports its curve (optuna-dashboard draws it), pruner or not
        pruning = StepPruning(trial, self.spec.objectives[0].metric) if not self.spec.multi_objective else None
        cli = build_trial_cli(args, [recorder] + ([pruning] if pruning else []))
        if cli.trainer.world_size > 1:
            # Lightning would start the other ranks by re-running this process's command line: `mhc sweep`
            raise TrialConfigError(
                f"the trial asks for {cli.trainer.world_size} processes "
                f"({type(cli.trainer.strategy).__name__}); multi-process trials need "
                "`trial: {launcher: subprocess}` in the sweep file"
            )
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        return recorder, pruning.pruned_at if pruning else None, sorted(cli.trainer.callback_metrics)

    def _fit_child(self, trial, run_id: str, args: list[str], metrics: list[str]):
        """`mhc fit` as a child process; its rank 0 reports to the trial through the storage (link.py) and leaves
        the recorded metrics in a result file. Its output is logged to the trial's run as trial.log."""
        import os

        from ..fit.child_processes import ChildFailed, mhc_command, run

        spec = self.spec
        with tempfile.TemporaryDirectory(prefix=f"mhc-trial-{trial.number}-") as tmp:
            result, log = Path(tmp) / "result.json", Path(tmp) / "trial.log"
            link: dict[str, Any] = {"result_path": str(result), "metrics": metrics}
            if not spec.multi_objective:  # reports with or without a pruner: optuna-dashboard's learning curves
                link.update(
                    study_name=trial.study.study_name,
                    trial_number=trial.number,
                    monitor=spec.objectives[0].metric,
                    pruner=spec.pruner,
                )
            link_arg = "--trainer.callbacks+=" + json.dumps({"class_path": LINK_CLASS, "init_args": link})
            env = dict(os.environ, **({STORAGE_ENV: self.storage_url} if self.storage_url else {}))
            try:
                run([*mhc_command(), "fit", *args, link_arg], log, env, spec.trial["timeout_s"], what="`mhc fit`")
                if not result.is_file():
                    raise ChildFailed("`mhc fit` exited 0 without writing its result (did fit run?)", log)
            except BaseException:
                self.tracker.client.set_terminated(run_id, "FAILED")  # a killed child never closed its run
                raise
            finally:
                if log.is_file():
                    self.tracker.client.log_artifact(run_id, str(log))
            out = json.loads(result.read_text())
        return MetricRecorder.from_result(out["history"], out["missing"]), out["pruned_at"], out["logged"]
