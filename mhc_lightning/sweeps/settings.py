"""A sweep as the launcher and its workers share it: the spec plus the resolved storage, tracking URI and spool, and
the study's counts that decide when work stops."""

from __future__ import annotations

from typing import Optional

from .factories import make_pruner, make_storage
from .spec import SpecError, SweepSpec

# Study user attribute set when the sweep itself cannot go on (e.g. an objective metric the model never logs):
# every worker stops at its next poll, the launcher reports the reason; the next launch clears it.
STOP_ATTR = "mhc_stopped"
TRACKING_ENV = "MHC_SWEEP_TRACKING_URI"  # the launcher's tracking URI for its workers: not on their command lines
BUDGET_ATTR = "mhc_n_trials"  # the largest budget.n_trials a launch asked of the study (`--n-trials` extends it)


class Sweep:
    def __init__(self, spec: SweepSpec, storage_url: str, tracking_uri: str, spool_dir: str):
        self.spec, self.storage_url, self.tracking_uri, self.spool_dir = spec, storage_url, tracking_uri, spool_dir
        self.created = False  # set by study(): whether this process created the study

    @property
    def storage_label(self) -> str:
        from ..loggers.store import redact

        return redact(self.storage_url)

    def storage(self):
        return make_storage(self.storage_url, self.spec.storage)

    def study(self, sampler=None, storage=None):
        """The sweep's study, created by the first caller and loaded by every other. `self.created` says whether this
        call created it: creating a study is atomic in every Optuna storage, so of several launchers started at once
        exactly one creates it, and that one makes the study's MLflow parent run (SweepTracker.ensure_parent)."""
        import optuna

        directions = [o.direction for o in self.spec.objectives]
        kw = dict(
            storage=storage or self.storage(),
            study_name=self.spec.name,
            directions=directions,
            sampler=sampler,
            pruner=make_pruner(self.spec),
        )
        try:
            study, self.created = optuna.create_study(**kw), True
        except optuna.exceptions.DuplicatedStudyError:
            study, self.created = optuna.create_study(**kw, load_if_exists=True), False
        have = [d.name.lower() for d in study.directions]
        if have != directions:
            raise SpecError(
                f"study {self.spec.name!r} in {self.storage_label} was created with directions {have}, "
                f"the sweep file asks for {directions}: use another name"
            )
        return study

    def tracker(self):
        from .study_runs import SweepTracker

        return SweepTracker(
            self.tracking_uri, self.spec.mlflow["experiment"], self.spec.name, self.storage_label, self.spool_dir
        )


def counts(study, since: Optional[float] = None) -> dict[str, int]:
    """Trials by state. `errors` (what budget.max_failed limits) counts trials whose objective raised, started at or
    after `since` (epoch seconds: this launch), not interrupted, not heartbeat-failed and not duplicates: so a study
    stopped by too many failures continues once the cause is fixed and the command is run again."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    c = {s: sum(t.state == s for t in trials) for s in TrialState}

    def error(t) -> bool:
        a = t.user_attrs
        recent = since is None or (t.datetime_start is not None and t.datetime_start.timestamp() >= since)
        return (
            t.state == TrialState.FAIL
            and bool(a.get("error"))
            and not a.get("interrupted")
            and a.get("duplicate_of") is None
            and recent
        )

    return {
        "complete": c[TrialState.COMPLETE],
        "pruned": c[TrialState.PRUNED],
        "failed": c[TrialState.FAIL],
        "running": c[TrialState.RUNNING],
        "waiting": c[TrialState.WAITING],
        "errors": sum(map(error, trials)),
    }
