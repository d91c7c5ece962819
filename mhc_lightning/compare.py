"""`mhc compare`: a table and plots for a set of MLflow runs (an experiment, an Optuna study, or run ids).

    mhc compare --study smoke --tracking-uri sqlite:///$PWD/mlflow.db
    mhc compare --experiment mhc_lightning --tracking-uri http://localhost:5000 --out reports/today
    mhc compare --runs 1a2b... 3c4d... --no-log

Writes runs.md and runs.csv (configs and final metrics, best val/loss first) and four PNGs:
val_loss.png (curves), amax_vs_layer.png (composite Amax gain per layer, from the runs' last
diagnostics/per_layer_step*.json), grad_norm.png (curves) and tokens_per_sec.png (median per run).
They are logged to MLflow too: into the study's parent run for --study, else into a new
"compare-..." run in the experiment of the first run (--no-log to skip).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

# Config columns: (column, MLflow param keys to try). Lightning logs the module's hparams flattened with
# "/", the sweep logs the trial's values as trial.<cli key>.
CONFIG_COLUMNS = [
    ("residual_mode", ["arch/hyper/residual_mode"]),
    ("n_streams", ["arch/hyper/n_streams"]),
    ("sinkhorn_iters", ["arch/hyper/sinkhorn_iters"]),
    ("intensity", ["trial.callbacks.SinkhornScheduler.intensity"]),
    ("alpha_init", ["arch/hyper/alpha_init"]),
    ("bias_init", ["arch/hyper/bias_init"]),
    ("lr", ["optim/lr"]),
    ("n_layers", ["arch/n_layers"]),
    ("d_model", ["arch/d_model"]),
]
SINKHORN_ONLY = ("sinkhorn_iters", "intensity")
UNUSED_BY_RESIDUAL = SINKHORN_ONLY + ("n_streams", "alpha_init", "bias_init")
FINAL_METRICS = ["val/loss", "val/bpb", "train/loss", "train/grad_norm", "amax/composite_fwd_max", "amax/composite_bwd_max"]
CURVES = ["val/loss", "train/grad_norm", "train/tokens_per_sec"]
COMPARISON_TAG = "mhc.kind"


class CompareError(ValueError):
    pass


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

    def config(self) -> dict[str, Any]:
        out = {}
        for col, keys in CONFIG_COLUMNS:
            for k in keys:
                if k in self.params:
                    out[col] = self.params[k]
                    break
        for k, v in self.params.items():  # other swept values, by their last key component
            if k.startswith("trial.") and not any(k in keys for _, keys in CONFIG_COLUMNS):
                out.setdefault(k.rsplit(".", 1)[-1], v)
        # Settings the mode ignores (Sinkhorn for HC, streams for the residual baseline) would only mislead.
        mode = out.get("residual_mode")
        unused = {"residual": UNUSED_BY_RESIDUAL, "hc": SINKHORN_ONLY + ("bias_init",),
                  "identity": SINKHORN_ONLY}.get(mode, ())
        return {k: v for k, v in out.items() if k not in unused}

    def tokens_per_sec(self) -> Optional[float]:
        vals = [v for _, v in self.curves.get("train/tokens_per_sec", [])]
        return statistics.median(vals) if vals else self.metrics.get("train/tokens_per_sec")


# ---- selection ------------------------------------------------------------------------------------
def select_runs(client, experiment: Optional[str] = None, study: Optional[str] = None,
                run_ids: Optional[list[str]] = None, include_failed: bool = True) -> list:
    if run_ids:
        runs = []
        for rid in run_ids:
            try:
                runs.append(client.get_run(rid))
            except Exception as err:
                raise CompareError(f"run {rid!r} not found: {err}") from err
        return runs
    if study:
        flt = f"tags.`optuna.study_name` = '{study}' and tags.`optuna.role` = 'trial'"
        exps = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(exps, flt, max_results=5000) if exps else []
        if not runs:
            raise CompareError(f"no trial runs of study {study!r} at this tracking URI")
    else:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            names = [e.name for e in client.search_experiments()]
            raise CompareError(f"experiment {experiment!r} not found; experiments: {names}")
        runs = [r for r in client.search_runs([exp.experiment_id], max_results=5000)
                if r.data.tags.get("optuna.role") != "study" and COMPARISON_TAG not in r.data.tags]
        if not runs:
            raise CompareError(f"experiment {experiment!r} has no runs")
    return [r for r in runs if include_failed or r.info.status == "FINISHED"]


def _latest_per_layer(client, run_id: str, tmp: Path) -> tuple[Optional[dict], Optional[int]]:
    try:
        files = [a.path for a in client.list_artifacts(run_id, "diagnostics") if a.path.endswith(".json")]
    except Exception:
        return None, None
    files = [f for f in files if Path(f).name.startswith("per_layer_step")]
    if not files:
        return None, None
    last = max(files, key=lambda f: int(Path(f).stem.removeprefix("per_layer_step")))
    local = client.download_artifacts(run_id, last, str(tmp))
    return json.loads(Path(local).read_text()), int(Path(last).stem.removeprefix("per_layer_step"))


def load_runs(client, runs) -> list[RunData]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in runs:
            d = RunData(r.info.run_id, r.info.run_name or r.info.run_id[:8], r.info.status, r.info.experiment_id,
                        dict(r.data.params), dict(r.data.tags), dict(r.data.metrics))
            for key in CURVES:
                if key in d.metrics:
                    hist = client.get_metric_history(d.run_id, key)
                    d.curves[key] = sorted((m.step, m.value) for m in hist)
            sub = Path(tmp) / d.run_id
            sub.mkdir()
            d.per_layer, d.per_layer_step = _latest_per_layer(client, d.run_id, sub)
            out.append(d)
    # best first: lowest final val/loss; runs without it last
    out.sort(key=lambda d: (not math.isfinite(d.metrics.get("val/loss", math.nan)), d.metrics.get("val/loss", 0.0)))
    return out


# ---- table ------------------------------------------------------------------------------------------
def table_rows(data: list[RunData]) -> list[dict[str, Any]]:
    configs = [d.config() for d in data]
    cols = []
    for c in dict.fromkeys(k for cfg in configs for k in cfg):
        vals = {cfg.get(c) for cfg in configs}
        if c == "residual_mode" or len(vals) > 1 or len(data) == 1:
            cols.append(c)  # columns that are equal everywhere say nothing about the difference
    rows = []
    for d, cfg in zip(data, configs):
        row = {"run": d.name, "run_id": d.run_id, "status": d.status}
        if "optuna.trial" in d.tags:
            row["trial"] = d.tags["optuna.trial"]
            row["state"] = d.tags.get("optuna.state", "")
        row.update({c: cfg.get(c, "") for c in cols})
        steps = [s for curve in d.curves.values() for s, _ in curve]
        row["steps"] = max(steps) if steps else ""
        for m in FINAL_METRICS:
            row[m] = d.metrics.get(m, "")
        tps = d.tokens_per_sec()
        row["tokens/s (median)"] = tps if tps is not None else ""
        rows.append(row)
    return rows


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    s = str(v)
    try:
        f = float(s)
        if "." in s or "e" in s.lower():
            return f"{f:.4g}"
    except ValueError:
        pass
    return s


def write_table(rows: list[dict[str, Any]], out: Path) -> tuple[Path, Path]:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    csv_path, md_path = out / "runs.csv", out / "runs.md"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    md_cols = [c for c in cols if c != "run_id"]
    lines = ["| " + " | ".join(md_cols) + " |", "|" + "|".join("---" for _ in md_cols) + "|"]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in md_cols) + " |" for r in rows]
    md_path.write_text("\n".join(lines) + "\n")
    return md_path, csv_path


# ---- plots --------------------------------------------------------------------------------------------
def _label(d: RunData, cols: list[str]) -> str:
    cfg = d.config()
    bits = [f"{c}={_fmt(cfg[c])}" if c != "residual_mode" else str(cfg[c]) for c in cols if c in cfg]
    prefix = f"t{d.tags['optuna.trial']}" if "optuna.trial" in d.tags else d.name
    return f"{prefix} " + " ".join(bits)


def _curve_plot(data, key: str, title: str, ylabel: str, path: Path, cols, logy: bool = False) -> Optional[Path]:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    have = [d for d in data if d.curves.get(key)]
    if not have:
        return None
    fig, ax = plt.subplots(figsize=(9, 5), constrained_layout=True)
    for d in have:
        steps, vals = zip(*d.curves[key])
        ax.plot(steps, vals, marker="o" if len(steps) < 12 else None, ms=3, lw=1.5, label=_label(d, cols))
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _amax_plot(data, path: Path, cols) -> Optional[Path]:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    have = [d for d in data if d.per_layer and "composite_fwd_max" in d.per_layer]
    if not have:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    for ax, key, what in zip(axes, ("composite_fwd_max", "composite_bwd_max"), ("forward", "backward")):
        for d in have:
            ys = d.per_layer[key]
            ax.plot(range(len(ys)), ys, "-o", ms=3, label=f"{_label(d, cols)} (step {d.per_layer_step})")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ys_all = [y for d in have for y in d.per_layer[key] if y > 0]
        if ys_all and max(ys_all) / min(ys_all) > 10:  # log only when gains span decades (HC blow-ups)
            ax.set_yscale("log")
        else:
            ax.ticklabel_format(axis="y", useOffset=False)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("sublayer l (composite product l .. L-1)")
        ax.set_title(f"composite Amax gain, {what} (max over tokens)")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("Amax gain")
    axes[1].legend(fontsize=7, loc="best")
    missing = len(data) - len(have)
    if missing:
        fig.suptitle(f"{missing} run(s) without multi-stream diagnostics (residual baseline) not shown", fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _tokens_plot(data, path: Path, cols) -> Optional[Path]:
    import matplotlib.pyplot as plt

    have = [(d, d.tokens_per_sec()) for d in data if d.tokens_per_sec() is not None]
    if not have:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(have) + 1.6), constrained_layout=True)
    labels = [_label(d, cols) for d, _ in have]
    vals = [v for _, v in have]
    errs = []
    for d, v in have:
        xs = sorted(x for _, x in d.curves.get("train/tokens_per_sec", []))
        errs.append((v - xs[len(xs) // 4], xs[(3 * len(xs)) // 4] - v) if len(xs) >= 4 else (0.0, 0.0))
    ax.barh(range(len(have)), vals, xerr=list(zip(*errs)), color="tab:blue", alpha=0.8, capsize=3)
    ax.set_yticks(range(len(have)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("training tokens / s (median over steps, bars = interquartile range)")
    ax.set_title("throughput")
    ax.grid(alpha=0.3, axis="x")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def make_plots(data: list[RunData], out: Path, top: int) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    shown = data[:top]  # legends stay readable; the table has every run
    configs = [d.config() for d in shown]
    cols = [c for c in dict.fromkeys(k for cfg in configs for k in cfg)
            if c == "residual_mode" or len({cfg.get(c) for cfg in configs}) > 1][:4]
    sub = f" (best {len(shown)} of {len(data)} by val/loss)" if len(data) > len(shown) else ""
    import matplotlib.pyplot as plt

    with plt.style.context("default"):  # Optuna's plots switch the global style to ggplot
        plots = _draw(shown, data, out, cols, sub)
    return {k: v for k, v in plots.items() if v is not None}


def _draw(shown, data, out: Path, cols, sub: str) -> dict[str, Optional[Path]]:
    return {
        "val_loss": _curve_plot(shown, "val/loss", "validation loss" + sub, "val/loss (nats/byte)", out / "val_loss.png", cols),
        "amax_vs_layer": _amax_plot(shown, out / "amax_vs_layer.png", cols),
        "grad_norm": _curve_plot(shown, "train/grad_norm", "gradient norm (before clipping)" + sub, "train/grad_norm",
                                 out / "grad_norm.png", cols, logy=True),
        "tokens_per_sec": _tokens_plot(shown, out / "tokens_per_sec.png", cols),
    }


# ---- entry points -----------------------------------------------------------------------------------
def compare(tracking_uri: str, out, experiment: Optional[str] = None, study: Optional[str] = None,
            run_ids: Optional[list[str]] = None, log: bool = True, top: int = 12,
            log_run_id: Optional[str] = None) -> dict[str, Any]:
    from mlflow import MlflowClient

    from .sweeps.tracking import check_tracking, use_fast_http_failures

    if sum(x is not None and x != [] for x in (experiment, study, run_ids)) != 1:
        raise CompareError("give exactly one of --experiment, --study, --runs")
    use_fast_http_failures()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    check_tracking(tracking_uri)
    client = MlflowClient(tracking_uri)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = load_runs(client, select_runs(client, experiment, study, run_ids))
    rows = table_rows(data)
    md, csv_path = write_table(rows, out)
    plots = make_plots(data, out, top)
    result: dict[str, Any] = {"runs": len(data), "table_md": md, "table_csv": csv_path, "plots": plots}
    if log:
        target = log_run_id
        if target is None and study:
            parent = {d.tags.get("mlflow.parentRunId") for d in data} - {None}
            target = parent.pop() if len(parent) == 1 else None
        created = False
        if target is None:
            name = f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
            target = client.create_run(data[0].experiment_id, run_name=name,
                                       tags={COMPARISON_TAG: "comparison", "mhc.compared_runs": ",".join(d.run_id for d in data)[:5000]}).info.run_id
            created = True
        for p in [md, csv_path, *plots.values()]:
            client.log_artifact(target, str(p), "comparison")
        if created:
            client.set_terminated(target, "FINISHED")
        result["logged_to"] = target
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mhc compare", description="Table and plots comparing MLflow runs.")
    sel = p.add_mutually_exclusive_group(required=True)
    sel.add_argument("--experiment", help="every run of this MLflow experiment")
    sel.add_argument("--study", help="the trial runs of this Optuna study (tag optuna.study_name)")
    sel.add_argument("--runs", nargs="+", metavar="RUN_ID", help="these runs")
    p.add_argument("--tracking-uri", help="sqlite:///abs/mlflow.db or http://host:5000 "
                                          "(default: $MLFLOW_TRACKING_URI, else ./mlflow.db)")
    p.add_argument("--out", help="output folder (default: reports/<experiment|study|runs>)")
    p.add_argument("--top", type=int, default=12, help="runs drawn in the plots (best by val/loss); the table has all")
    p.add_argument("--no-log", action="store_true", help="do not log the table and plots to MLflow")
    p.add_argument("--log-run-id", help="log into this run instead")
    g = p.add_argument_group("grouped report (mean +- std over seeds; see mhc_lightning/report.py)")
    g.add_argument("--group-by", help="comma-separated run tags, e.g. variant,model.arch.n_layers")
    g.add_argument("--report", help="with --group-by: write a markdown report here")
    g.add_argument("--notes", help="with --group-by: markdown appended to the report")
    g.add_argument("--context", help="with --group-by: text file (GPU, versions) quoted in the report")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    from .sweeps.tracking import TrackingUnreachable

    args = build_parser().parse_args(argv)
    uri = args.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    if args.group_by:
        if not args.experiment:
            print("mhc compare: error: --group-by needs --experiment", file=sys.stderr)
            return 2
        from . import report

        cmd = ["--experiment", args.experiment, "--group-by", args.group_by, "--tracking-uri", uri]
        for flag, value in (("--out", args.out), ("--report", args.report), ("--notes", args.notes),
                            ("--context", args.context)):
            if value:
                cmd += [flag, value]
        return report.main(cmd)
    out = args.out or str(Path("reports") / (args.experiment or args.study or "runs"))
    try:
        res = compare(uri, out, args.experiment, args.study, args.runs, not args.no_log, args.top, args.log_run_id)
    except (CompareError, TrackingUnreachable) as err:
        print(f"mhc compare: error: {err}", file=sys.stderr)
        return 2
    print(f"{res['runs']} runs -> {res['table_md']}, {res['table_csv']}")
    for name, path in res["plots"].items():
        print(f"  {name}: {path}")
    if "logged_to" in res:
        print(f"logged to MLflow run {res['logged_to']} (artifacts under comparison/)")
    print(Path(res["table_md"]).read_text())
    return 0
