"""One Optuna trial = one `mhc fit` of the sweep's base configs plus the trial's values: built in this process
(`trial.launcher: in_process`), or run as a child `mhc fit` process (`subprocess`, e.g. a multi-process DDP trial)."""
from __future__ import annotations

import contextlib
import io
import json
import math
import shlex
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import optuna
from lightning.pytorch.callbacks import Callback

from .pruning import StepPruning
from .spec import SweepSpec, sample, trial_args

LOGGER_CLASS = "mhc_lightning.sweeps.logger.ResilientMLFlowLogger"
LINK_CLASS = "mhc_lightning.sweeps.link.TrialLink"


class TrialConfigError(ValueError):
    """The trial's arguments were rejected by the `mhc fit` parser (message is the parser's)."""


class MetricRecorder(Callback):
    """Values of the objective metrics over the trial, for `reduce` (last / min / max / mean / median).

    val/* metrics are read at each validation end; the others (logged per step, e.g. tokens/s, Amax)
    whenever their value in trainer.callback_metrics changes, since that dict keeps the last value.
    """

    def __init__(self, metrics: list[str]):
        self.history: dict[str, list[tuple[int, float]]] = {m: [] for m in metrics}

    def _grab(self, trainer, validation: bool) -> None:
        for m, h in self.history.items():
            if m.startswith("val/") != validation:
                continue
            v = trainer.callback_metrics.get(m)
            if v is None:
                continue
            v = float(v)
            if validation or not h or h[-1][1] != v:
                h.append((trainer.global_step, v))

    def on_train_batch_end(self, trainer, *args) -> None:
        self._grab(trainer, validation=False)

    def on_train_end(self, trainer, pl_module) -> None:
        self._grab(trainer, validation=False)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._grab(trainer, validation=True)

    @classmethod
    def from_history(cls, history: dict[str, list]) -> "MetricRecorder":
        """A recorder holding the history another process recorded (a subprocess trial's result file)."""
        rec = cls(list(history))
        rec.history = {m: [(int(step), float(v)) for step, v in h] for m, h in history.items()}
        return rec

    def value(self, metric: str, reduce: str) -> float:
        vals = [v for _, v in self.history[metric]]
        if not vals:
            raise ValueError(f"objective metric {metric!r} was never logged during the trial")
        return {"last": lambda: vals[-1], "min": lambda: min(vals), "max": lambda: max(vals),
                "mean": lambda: statistics.fmean(vals), "median": lambda: statistics.median(vals)}[reduce]()


def build_trial_cli(args: list[str], callbacks: list[Callback]):
    """The project's LightningCLI with run=False; parser errors become TrialConfigError, not SystemExit."""
    from ..cli import build_cli

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), warnings.catch_warnings():
            # args are the whole command line here; sys.argv belongs to `mhc sweep`
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            return build_cli(args, run=False, trainer_defaults={"callbacks": callbacks})
    except SystemExit as exc:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        raise TrialConfigError("mhc fit rejected the trial's arguments: " + (lines[-1] if lines else str(exc))) from None


def fit_command(args: list[str]) -> str:
    return "mhc fit " + shlex.join(args)


class TrialRunner:
    """The Optuna objective. Keeps MLflow's child run in step with the trial's fate."""

    def __init__(self, spec: SweepSpec, tracker, tracking_uri: str, worker: dict[str, Any], spool_dir: str,
                 storage_url: Optional[str] = None):
        self.spec, self.tracker, self.uri, self.worker, self.spool_dir = spec, tracker, tracking_uri, worker, spool_dir
        self.storage_url = storage_url  # for subprocess trials, which report to the study themselves
        self.current: Optional[optuna.Trial] = None

    def logger_config(self, trial, run_id: str) -> dict:
        return {"class_path": LOGGER_CLASS, "init_args": {
            "experiment_name": self.spec.mlflow["experiment"], "run_name": f"{self.spec.name}-t{trial.number:04d}",
            "tracking_uri": self.uri, "run_id": run_id, "log_model": self.spec.mlflow["log_model"],
            "spool_dir": self.spool_dir}}

    def __call__(self, trial: optuna.Trial):
        self.current = trial
        spec = self.spec
        values = sample(trial, spec)
        # Optuna has no public accessor for a running trial's system attrs (where the retry callback
        # records the original trial), hence the storage call.
        sys_attrs = trial.study._storage.get_trial_system_attrs(trial._trial_id)
        # a re-queued trial inherits the original's user attributes: clear the outcome of the old attempt
        trial.set_user_attr("error", None)
        trial.set_user_attr("interrupted", False)
        trial.set_user_attr("worker", self.worker["id"])
        trial.set_user_attr("sampler_seed", self.worker["seed"])
        run_id = self.tracker.start_trial(trial, values, self.worker, retry_of=sys_attrs.get("failed_trial"))
        args = trial_args(spec, values, self.logger_config(trial, run_id))
        self.tracker.client.log_text(run_id, fit_command(args) + "\n", "trial_command.txt")
        metrics = list(dict.fromkeys(o.metric for o in spec.objectives))
        fit = self._fit_child if spec.trial["launcher"] == "subprocess" else self._fit_in_process
        t0 = time.time()
        try:
            recorder, pruned_at, logged = fit(trial, run_id, args, metrics)
        except BaseException as err:
            msg = f"{type(err).__name__}: {err}"
            interrupted = isinstance(err, (KeyboardInterrupt, SystemExit))
            self.tracker.end_trial(run_id, "FAILED", error=msg, extra_tags={"optuna.interrupted": interrupted} if interrupted else None)
            trial.set_user_attr("error", msg[:1000])
            if interrupted:
                trial.set_user_attr("interrupted", True)
                # Lightning turns Ctrl-C / SIGTERM into SystemExit, which Optuna would not catch (the trial
                # would stay RUNNING until its heartbeat expires): hand it a KeyboardInterrupt instead.
                raise KeyboardInterrupt(msg) from err
            raise
        extra = {"optuna.duration_s": f"{time.time() - t0:.1f}"}
        if pruned_at is not None:
            self.tracker.end_trial(run_id, "PRUNED", extra_tags={**extra, "optuna.pruned_at_step": pruned_at})
            raise optuna.TrialPruned(f"pruned at step {pruned_at}")
        try:
            result = {o.label: recorder.value(o.metric, o.reduce) for o in spec.objectives}
        except ValueError as err:
            msg = f"{err}; logged metrics: {logged}"
            self.tracker.end_trial(run_id, "FAILED", error=msg, extra_tags=extra)
            trial.set_user_attr("error", msg[:1000])
            raise ValueError(msg) from None
        if not all(math.isfinite(v) for v in result.values()):
            msg = f"non-finite objective {result}"
            self.tracker.end_trial(run_id, "FAILED", error=msg, extra_tags=extra)
            trial.set_user_attr("error", msg)
            raise ValueError(msg)
        self.tracker.end_trial(run_id, "COMPLETE", result, extra_tags=extra)
        out = tuple(result.values())
        return out if spec.multi_objective else out[0]

    # Both return (the recorded objective metrics, the step the trial was pruned at or None, the logged metric names).
    def _fit_in_process(self, trial, run_id: str, args: list[str], metrics: list[str]):
        recorder = MetricRecorder(metrics)
        pruning = StepPruning(trial, self.spec.objectives[0].metric) if self.spec.pruning else None
        cli = build_trial_cli(args, [recorder] + ([pruning] if pruning else []))
        if cli.trainer.world_size > 1:
            # Lightning would start the other ranks by re-running this process's command line: `mhc sweep`
            raise TrialConfigError(f"the trial asks for {cli.trainer.world_size} processes "
                                   f"({type(cli.trainer.strategy).__name__}); multi-process trials need "
                                   "`trial: {launcher: subprocess}` in the sweep file")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        return recorder, pruning.pruned_at if pruning else None, sorted(cli.trainer.callback_metrics)

    def _fit_child(self, trial, run_id: str, args: list[str], metrics: list[str]):
        """`mhc fit` as a child process; its rank 0 reports to the trial through the storage (link.py) and leaves
        the recorded metrics in a result file. Its output is logged to the trial's run as trial.log."""
        from .child import ChildFailed, run_child

        spec = self.spec
        with tempfile.TemporaryDirectory(prefix=f"mhc-trial-{trial.number}-") as tmp:
            result, log = Path(tmp) / "result.json", Path(tmp) / "trial.log"
            link: dict[str, Any] = {"result_path": str(result), "metrics": metrics}
            if spec.pruning:
                link.update(study_name=trial.study.study_name, trial_id=trial._trial_id,
                            monitor=spec.objectives[0].metric, pruner=spec.pruner)
            link_arg = "--trainer.callbacks+=" + json.dumps({"class_path": LINK_CLASS, "init_args": link})
            try:
                run_child([*args, link_arg], log, self.storage_url, spec.trial["timeout_s"])
                if not result.is_file():
                    raise ChildFailed("`mhc fit` exited 0 without writing its result (did fit run?)", log)
            except BaseException:
                self.tracker.client.set_terminated(run_id, "FAILED")  # a killed child never closed its run
                raise
            finally:
                if log.is_file():
                    self.tracker.client.log_artifact(run_id, str(log))
            out = json.loads(result.read_text())
        return MetricRecorder.from_history(out["history"]), out["pruned_at"], out["logged"]
