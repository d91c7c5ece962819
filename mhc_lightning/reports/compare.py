"""`mhc compare`: a table and plots for a set of MLflow runs (an experiment, an Optuna study, or run ids).

Writes runs.md and runs.csv (every setting, in `mhc fit` spelling, whose value differs between the runs, and final
metrics, best val/loss first) and six PNGs: val_loss.png and
train_loss.png (curves), amax_vs_layer.png (composite Amax gain per layer, from the runs' last
diagnostics/per_layer_step*.json), h_res.png (each run's n x n H_res − I per sublayer and the composite products,
side by side, from the same files), grad_norm.png (curves) and tokens_per_sec.png (median per run). They are logged to
MLflow too: into the study's parent run for --study, else into a new "compare-..." run in the experiment of the
first run (--no-log to skip).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Optional

from ..model.modes import MODES
from . import plots
from .runs import (
    COMPARISON_TAG,
    DATA_DIGEST,
    MODE_KEY,
    CompareError,
    RunData,
    code_label,
    load,
    search,
    tokenizer_of,
)
from .tables import fmt, frame, write_table

FINAL_METRICS = [
    "val/loss",
    "val/bpb",
    "train/loss",
    "train/grad_norm",
    "amax/composite_fwd_max",
    "amax/composite_bwd_max",
]
CURVES = ["val/loss", "train/loss", "train/grad_norm", "train/tokens_per_sec"]


def differing_columns(configs: list[dict], always=(MODE_KEY,)) -> list[str]:
    """Settings whose values differ between runs (equal everywhere says nothing about the difference; a setting some
    runs lack differs), in sorted order after the residual mode."""
    keys = sorted({k for cfg in configs for k in cfg}, key=lambda k: (k not in always, k))
    return [c for c in keys if c in always or len({cfg.get(c) for cfg in configs}) > 1 or len(configs) == 1]


def steps_done(d: RunData):
    """Optimizer steps the run made: training metrics are logged at the 0-based index of their step, so the last
    index + 1 (a run that logs every k steps reads as its last multiple of k); validation-only runs by their last
    validation step."""
    train = [s for key, curve in d.curves.items() if key.startswith("train/") for s, _ in curve]
    if train:
        return max(train) + 1
    val = [s for curve in d.curves.values() for s, _ in curve]
    return max(val) if val else ""


def markdown_ids(df):
    """The table for runs.md: the run id short (its first 8 characters find it in the UI's search; runs.csv has it
    whole), ids and digests as code, so that one like 1234e567 is not read as a number."""
    md = df.assign(run_id=df["run_id"].str[:8])
    for col in ("run_id", DATA_DIGEST[0]):
        if col in md:
            md[col] = [f"`{v}`" if v else "" for v in md[col]]
    return md


def table_rows(data: list[RunData]) -> list[dict[str, Any]]:
    configs = [d.config() for d in data]
    cols = differing_columns(configs)
    rows = []
    for d, cfg in zip(data, configs):
        row = {"run": d.name, "run_id": d.run_id, "status": d.status, "code": code_label(d)}
        if any(x.evaluation for x in data):
            row["stage"] = d.stage
        if "optuna.trial" in d.tags:
            row["trial"] = d.tags["optuna.trial"]
            row["state"] = d.tags.get("optuna.state", "")
        row.update({c: cfg.get(c, "") for c in cols})
        if len({tokenizer_of(x) for x in data}) > 1:  # nats per token are per token of this tokenizer
            row["tokenizer"] = d.tags.get("mhc.data.tokenizer", "bytes")
        row["steps"] = steps_done(d)
        for m in FINAL_METRICS:
            row[m] = d.metrics.get(m, "")
        tps = d.tokens_per_sec()
        row["tokens/s (median)"] = tps if tps is not None else ""
        rows.append(row)
    return rows


def _label(d: RunData, cols: list[str]) -> str:
    cfg = d.config()
    bits = [f"{c.rsplit('.', 1)[-1]}={fmt(cfg[c])}" if c != MODE_KEY else str(cfg[c]) for c in cols if c in cfg]
    return f"{d.label} " + " ".join(bits)


def layers_caption(shown: list[RunData], have: list[RunData]) -> str:
    """Which runs the Amax-vs-layer plot leaves out, each by name and with its own reason."""

    def why(d: RunData) -> str:
        if d.evaluation:
            return f"{d.stage} run: no training steps"
        mode = MODES.get(d.config().get(MODE_KEY))
        if mode is not None and not mode.multi_stream:
            return f"{mode.name}: one stream, no H_res"
        return "no per-layer diagnostics logged"

    missing = [f"{d.label} ({why(d)})" for d in shown if d not in have]
    return ("not shown: " + "; ".join(missing)) if missing else ""


def make_plots(data: list[RunData], out: Path, top: int) -> dict[str, Path]:
    shown = data[:top]  # legends stay readable; the table has every run
    cols = differing_columns([d.config() for d in shown])[:4]
    sub = f" (best {len(shown)} of {len(data)} by val/loss)" if len(data) > len(shown) else ""

    def lines(key):
        return [(_label(d, cols), *zip(*d.curves[key]), None) for d in shown if d.curves.get(key)]

    result = {
        "val_loss": plots.curves(
            lines("val/loss"), "validation loss" + sub, "val/loss (nats/byte)", out / "val_loss.png"
        ),
        "train_loss": plots.curves(
            lines("train/loss"), "training loss" + sub, "train/loss (nats/byte)", out / "train_loss.png"
        ),
        "grad_norm": plots.curves(
            lines("train/grad_norm"),
            "gradient norm (before clipping)" + sub,
            "train/grad_norm",
            out / "grad_norm.png",
            logy=True,
        ),
    }
    have = [d for d in shown if d.per_layer and "composite_fwd_max" in d.per_layer]
    if have:
        steps = sorted({d.per_layer_step for d in have})
        fig = plots.amax_vs_layer(
            [(f"{_label(d, cols)} (step {d.per_layer_step})", d.per_layer) for d in have],
            title=f"composite Amax gain at each run's last diagnostics (steps {steps})",
            note=layers_caption(shown, have),
        )
        result["amax_vs_layer"] = plots.save(fig, out / "amax_vs_layer.png")
    mixing = [d for d in shown if d.per_layer and d.per_layer.get("h_res_tokmean")]
    if mixing:
        fig = plots.h_res_heatmaps(
            [(f"{_label(d, cols)} (step {d.per_layer_step})", d.per_layer["h_res_tokmean"]) for d in mixing],
            title="H_res per sublayer at each run's last diagnostics",
        )
        result["h_res"] = plots.save(fig, out / "h_res.png")
    bars = []
    for d in shown:
        v = d.tokens_per_sec()
        if v is None:
            continue
        xs = sorted(x for _, x in d.curves.get("train/tokens_per_sec", []))
        iqr = (v - xs[len(xs) // 4], xs[(3 * len(xs)) // 4] - v) if len(xs) >= 4 else (0.0, 0.0)
        bars.append((_label(d, cols), v, iqr))
    result["tokens_per_sec"] = plots.throughput(bars, out / "tokens_per_sec.png")
    return {k: v for k, v in result.items() if v is not None}


def compare(
    tracking_uri: str,
    out,
    experiment: Optional[str] = None,
    study: Optional[str] = None,
    run_ids: Optional[list[str]] = None,
    log: bool = True,
    top: int = 12,
    log_run_id: Optional[str] = None,
    include_evaluation: bool = False,
) -> dict[str, Any]:
    from mlflow import MlflowClient

    from ..loggers.store import check_tracking, use_fast_http_failures

    if sum(x is not None and x != [] for x in (experiment, study, run_ids)) != 1:
        raise CompareError("give exactly one of --experiment, --study, --runs")
    use_fast_http_failures()
    check_tracking(tracking_uri, option="--tracking-uri")
    df = search(tracking_uri, experiment, study, run_ids, include_evaluation)
    data = load(tracking_uri, df, CURVES)
    # best first: lowest final bits per byte (which, unlike nats per token, compare across tokenizers); runs without
    # it last
    data.sort(key=lambda d: (not math.isfinite(d.metrics.get("val/bpb", math.nan)), d.metrics.get("val/bpb", 0.0)))
    out = Path(out)
    df = frame(table_rows(data))
    md, csv_path = write_table(df, out, "runs", md_df=markdown_ids(df))
    figures = make_plots(data, out, top)
    result: dict[str, Any] = {"runs": len(data), "table_md": md, "table_csv": csv_path, "plots": figures}
    if log:
        client = MlflowClient(tracking_uri)
        target = log_run_id
        if target is None and study:
            parent = {d.tags.get("mlflow.parentRunId") for d in data} - {None}
            target = parent.pop() if len(parent) == 1 else None
        created = False
        if target is None:
            name = f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
            target = client.create_run(
                data[0].experiment_id,
                run_name=name,
                tags={COMPARISON_TAG: "comparison", "mhc.compared_runs": ",".join(d.run_id for d in data)[:5000]},
            ).info.run_id
            created = True
        for p in [md, csv_path, *figures.values()]:
            client.log_artifact(target, str(p), "comparison")
        if created:
            client.set_terminated(target, "FINISHED")
        result["logged_to"] = target
    return result
