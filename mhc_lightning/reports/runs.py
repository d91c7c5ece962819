"""The one run loader: which MLflow runs a report covers (mlflow.search_runs) and what it reads of each (final
metrics, params, tags, metric histories, the last per-layer diagnostics artifact).

Evaluation runs (`mhc validate` / `mhc test`: MLflow tag `stage` = validate / test) are left out unless asked for: they
share the training run's name and config but trained nothing, so beside training runs they read as duplicates.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..errors import UserError
from ..loggers.filters import equals
from ..loggers.param_names import cli_name, internal
from ..loggers.tags import STAGE_TAG
from ..model.modes import MODES

# The settings a run ran with are its params, under their `mhc fit` names (loggers/param_names.py maps the names of
# older stores); a sweep trial's values also as trial.<key>. The bytes trained on are a tag: one corpus name can hold
# other text.
DATA_DIGEST = ("data.train_sha256", "mhc.data.train_sha256", 12)  # (column, tag, characters shown)
# Settings a mode does not read (Sinkhorn for HC, streams for the residual): shown blank, since a value would mislead.
UNUSED_BY_MODE = {name: tuple(f"model.arch.hyper.{k}" for k in spec.ignores) for name, spec in MODES.items()}
MODE_KEY = "model.arch.hyper.residual_mode"
SEED_KEY = "seed_everything"
FINAL_LOSSES = ("val/loss", "val/bpb")
COMPARISON_TAG = "mhc.kind"  # on the runs `mhc compare` creates to hold its files
EVALUATION_STAGES = ("validate", "test")


class CompareError(UserError):
    """Nothing to report on (no such experiment, study or run); the message says what exists."""


def tokenizer_of(d: RunData) -> str:
    """The run's tokenizer (its sha256 tag); runs without the tag trained on raw bytes."""
    return d.tags.get("mhc.data.tokenizer_sha256") or "bytes"


@dataclass
class RunData:
    run_id: str
    name: str
    status: str
    experiment_id: str
    params: dict[str, str]
    tags: dict[str, str]
    metrics: dict[str, float]
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    per_layer: Optional[dict[str, list[float]]] = None
    per_layer_step: Optional[int] = None

    @property
    def stage(self) -> str:
        return self.tags.get(STAGE_TAG, "fit")

    @property
    def evaluation(self) -> bool:
        return self.stage in EVALUATION_STAGES

    @property
    def label(self) -> str:
        """What a plot calls this run: trial number for sweeps, else the run name; evaluation runs say so."""
        base = f"t{self.tags['optuna.trial']}" if "optuna.trial" in self.tags else self.name
        return f"{base} [{self.stage}]" if self.evaluation else base

    @property
    def resolved(self) -> dict[str, str]:
        """The settings the run ran with, {`mhc fit` key: value}, from its params (a sweep's trial.<key> values
        where the run has no such param)."""
        out = {cli_name(k): v for k, v in self.params.items() if not k.startswith("trial.") and not internal(k)}
        for k, v in self.params.items():
            if k.startswith("trial."):
                out.setdefault(cli_name(k[len("trial.") :]), v)
        return out

    def config(self) -> dict[str, Any]:
        """The resolved settings and the digest of the bytes trained on, without those the run's mode ignores."""
        out: dict[str, Any] = dict(self.resolved)
        column, tag, width = DATA_DIGEST
        if tag in self.tags:
            out[column] = self.tags[tag][:width]
        unused = UNUSED_BY_MODE.get(out.get(MODE_KEY), ())
        return {k: v for k, v in out.items() if not k.startswith(unused)}

    def tokens_per_sec(self) -> Optional[float]:
        vals = [v for _, v in self.curves.get("train/tokens_per_sec", [])]
        return statistics.median(vals) if vals else self.metrics.get("train/tokens_per_sec")


CODE_TAG = "mhc.code"  # commit[:9] (+ digest of the uncommitted change) or src:<digest>: callbacks/run_provenance.py
SOURCES_TAG = "mhc.code.sha256"
UNKNOWN_CODE = "unknown"


def code_label(d: RunData) -> str:
    """The code a run ran, as the reports show and group it: the provenance tag; for a run from before it, MLflow's
    own commit guess marked '?' (it never knew about uncommitted changes). A run whose code is unknown gets a label
    of its own ('unknown:<run id>'), so that unknown runs never pool as one code state."""
    label = d.tags.get(CODE_TAG)
    if label and label != UNKNOWN_CODE:
        return label
    if d.tags.get(SOURCES_TAG):
        return f"src:{d.tags[SOURCES_TAG][:12]}"
    guess = d.tags.get("mlflow.source.git.commit")
    if guess and not label:
        return f"{guess[:9]}?"
    return f"{UNKNOWN_CODE}:{d.run_id[:8]}"


def seed_of(d: RunData) -> Optional[str]:
    """The seed the run ran with (its seed_everything param), else the grid's axis tag; None when neither exists."""
    return d.resolved.get(SEED_KEY) or d.tags.get(SEED_KEY)


def search(
    tracking_uri: str,
    experiment: Optional[str] = None,
    study: Optional[str] = None,
    run_ids: Optional[list[str]] = None,
    include_evaluation: bool = False,
):
    """The runs of an experiment (without sweep parents and comparison runs), of an Optuna study (its trials) or
    these run ids, as mlflow.search_runs' DataFrame (one row per run; columns params.*, tags.*, metrics.*)."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri)
    if run_ids:
        df = mlflow.search_runs(
            search_all_experiments=True,
            filter_string=f"attributes.run_id IN ({', '.join(repr(str(r)) for r in run_ids)})",
        )
        missing = sorted(set(run_ids) - set(df["run_id"])) if len(df) else sorted(run_ids)
        if missing:
            raise CompareError(f"run(s) {missing} not found at {tracking_uri}")
        return df  # asked for by id: kept whatever their stage
    if study:
        df = mlflow.search_runs(
            search_all_experiments=True,
            filter_string=(f"{equals('tags.`optuna.study_name`', study)} and tags.`optuna.role` = 'trial'"),
        )
        if len(df):
            df = df[df["tags.optuna.study_name"] == study]
        if not len(df):
            raise CompareError(f"no trial runs of study {study!r} at this tracking URI")
    else:
        if mlflow.MlflowClient().get_experiment_by_name(experiment) is None:
            names = [e.name for e in mlflow.search_experiments()]
            raise CompareError(f"experiment {experiment!r} not found; experiments: {names}")
        df = mlflow.search_runs(experiment_names=[experiment])
        if "tags.optuna.role" in df:  # a sweep's parent run holds the study, not a training
            df = df[df["tags.optuna.role"] != "study"]
        if f"tags.{COMPARISON_TAG}" in df:  # the runs holding earlier comparisons
            df = df[df[f"tags.{COMPARISON_TAG}"].isna()]
        if not len(df):
            raise CompareError(f"experiment {experiment!r} has no runs")
    col = f"tags.{STAGE_TAG}"
    if not include_evaluation and col in df:
        df = df[~df[col].isin(EVALUATION_STAGES)]
        if not len(df):
            raise CompareError("only evaluation runs (mhc validate / test) match; add --include-eval to compare them")
    return df


def _row_dict(row, prefix: str) -> dict:
    return {
        k[len(prefix) :]: v
        for k, v in row.items()
        if k.startswith(prefix) and v is not None and not (isinstance(v, float) and math.isnan(v))
    }


def _latest_per_layer(client, run_id: str, tmp: Path) -> tuple[Optional[dict], Optional[int]]:
    """The run's last diagnostics/per_layer_step<step>.json (written at each validation) and its step."""
    try:
        files = [a.path for a in client.list_artifacts(run_id, "diagnostics") if a.path.endswith(".json")]
    except Exception:
        return None, None
    steps = {
        f: int(Path(f).stem.removeprefix("per_layer_step")) for f in files if Path(f).name.startswith("per_layer_step")
    }
    if not steps:
        return None, None
    last = max(steps, key=steps.get)
    local = client.download_artifacts(run_id, last, str(tmp))
    return json.loads(Path(local).read_text()), steps[last]


def load(tracking_uri: str, df, histories: list[str]) -> list[RunData]:
    """RunData for each row of `search`'s DataFrame, with the metric histories asked for (those the run has) and the
    last per-layer diagnostics."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for _, row in df.iterrows():
            tags = _row_dict(row, "tags.")
            metrics = {k: float(v) for k, v in _row_dict(row, "metrics.").items()}
            if any(f"metrics.{k}" in row and k not in metrics for k in FINAL_LOSSES):
                # a blank cell is a metric the run never logged or a NaN it did (a diverged run): ask the run
                metrics = dict(client.get_run(row["run_id"]).data.metrics)
            d = RunData(
                row["run_id"],
                tags.get("mlflow.runName") or row["run_id"][:8],
                row["status"],
                str(row["experiment_id"]),
                {k: str(v) for k, v in _row_dict(row, "params.").items()},
                tags,
                metrics,
            )
            for key in histories:
                if key in d.metrics:
                    d.curves[key] = sorted((m.step, m.value) for m in client.get_metric_history(d.run_id, key))
            sub = Path(tmp) / d.run_id
            sub.mkdir()
            d.per_layer, d.per_layer_step = _latest_per_layer(client, d.run_id, sub)
            out.append(d)
    return out
