"""Grouped results report: runs aggregated over seeds (mean +- std) into markdown tables and plots.

    mhc compare --experiment stability --group-by variant,model.arch.n_layers \
        --tracking-uri http://127.0.0.1:5000 --out docs/results --report docs/results.md \
        --notes docs/results_notes.md --context docs/results/context.txt

Groups come from run tags (the grid runner tags every run with its variant and axis values); only
FINISHED runs count. Built on `mhc compare`'s loaders, so it reads local stores and servers alike.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics as st
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

from .compare import CompareError, RunData, _latest_per_layer, select_runs

HISTORIES = ["val/loss", "val/bpb", "train/grad_norm", "train/tokens_per_sec",
             "amax/composite_fwd_max", "amax/composite_bwd_max", "amax/composite_min_colsum"]
SPIKE_FACTOR = 4.0  # a logged grad norm (after warmup) above 4x the run's median counts as a spike


def load(client, runs) -> list[RunData]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in runs:
            d = RunData(r.info.run_id, r.info.run_name, r.info.status, r.info.experiment_id,
                        dict(r.data.params), dict(r.data.tags), dict(r.data.metrics))
            for key in HISTORIES:
                if key in d.metrics:
                    d.curves[key] = sorted((m.step, m.value) for m in client.get_metric_history(d.run_id, key))
            sub = Path(tmp) / d.run_id
            sub.mkdir()
            d.per_layer, d.per_layer_step = _latest_per_layer(client, d.run_id, sub)
            out.append(d)
    return out


def run_summary(d: RunData) -> dict[str, float]:
    """Per-run scalars: final validation, the worst gains seen over training, spikes, throughput."""
    def peak(key):
        vals = [v for _, v in d.curves.get(key, [])]
        return max(vals) if vals else 1.0  # residual has no stream mixing: its gain is 1 by definition

    warmup = int(d.params.get("optim/warmup_steps", 0))  # early steps are large by design, not spikes
    gn = [v for step, v in d.curves.get("train/grad_norm", []) if step >= warmup]
    med = st.median(gn) if gn else math.nan
    tps = [v for _, v in d.curves.get("train/tokens_per_sec", [])]
    colsum = [v for _, v in d.curves.get("amax/composite_min_colsum", [])]
    return {
        "val_bpb": d.metrics.get("val/bpb", math.nan),
        "val_loss": d.metrics.get("val/loss", math.nan),
        "amax_fwd_peak": peak("amax/composite_fwd_max"),
        "amax_bwd_peak": peak("amax/composite_bwd_max"),
        "min_colsum": min(colsum) if colsum else 1.0,
        "grad_norm_max": max(gn) if gn else math.nan,
        "grad_spikes": float(sum(v > SPIKE_FACTOR * med for v in gn)) if gn else math.nan,
        "tokens_per_sec": st.median(tps) if tps else math.nan,
    }


COLUMNS = [  # (summary key, header, format)
    ("val_bpb", "val bits/byte", "{:.4f}"),
    ("amax_fwd_peak", "composite Amax fwd (peak)", "{:.4g}"),
    ("amax_bwd_peak", "composite Amax bwd (peak)", "{:.4g}"),
    ("min_colsum", "min column sum", "{:.3g}"),
    ("grad_norm_max", "max grad norm (pre-clip)", "{:.3g}"),
    ("grad_spikes", f"grad spikes (>{SPIKE_FACTOR:g}x median)", "{:.2g}"),
    ("tokens_per_sec", "tokens/s", "{:.3g}"),
]


def _num(v: str):
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


def group(data: list[RunData], keys: list[str]) -> dict[tuple, list[RunData]]:
    groups: dict[tuple, list[RunData]] = defaultdict(list)
    for d in data:
        missing = [k for k in keys if k not in d.tags]
        if missing:
            raise CompareError(f"run {d.name} has no tag(s) {missing}; group by tags the runs carry: {sorted(d.tags)}")
        groups[tuple(_num(d.tags[k]) for k in keys)].append(d)
    return dict(sorted(groups.items(), key=lambda kv: tuple((isinstance(x, str), x if not isinstance(x, str) else 0, str(x))
                                                               for x in kv[0])))


def mean_std(vals: list[float]) -> tuple[float, float]:
    vals = [v for v in vals if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan
    return st.fmean(vals), (st.stdev(vals) if len(vals) > 1 else 0.0)


def table(groups, keys) -> tuple[list[str], list[list[str]], list[dict]]:
    header = [*keys, "runs"] + [h for _, h, _ in COLUMNS]
    rows, records = [], []
    for gk, runs in groups.items():
        sums = [run_summary(d) for d in runs]
        row, rec = [*map(str, gk), str(len(runs))], dict(zip(keys, gk), runs=len(runs))
        for key, _, fmt in COLUMNS:
            m, s = mean_std([x[key] for x in sums])
            row.append(f"{fmt.format(m)} ± {fmt.format(s)}")
            rec[key], rec[key + "_std"] = m, s
        rows.append(row)
        records.append(rec)
    return header, rows, records


def _markdown(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


# ---- plots ----------------------------------------------------------------------------------------------
def _series_by_first_key(groups, keys):
    """{first key value: [(second key value, runs)]}: e.g. variant -> [(depth, runs)]."""
    out = defaultdict(list)
    for gk, runs in groups.items():
        out[gk[0]].append((gk[1] if len(gk) > 1 else 0, runs))
    return out


def plot_vs_axis(groups, keys, metric: str, ylabel: str, path: Path, logy=False) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
    for name, pts in _series_by_first_key(groups, keys).items():
        xs, ms, ss = [], [], []
        for x, runs in sorted(pts):
            m, s = mean_std([run_summary(d)[metric] for d in runs])
            xs.append(x), ms.append(m), ss.append(s)
        ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, label=str(name))
    ax.set_xlabel(keys[1] if len(keys) > 1 else "")
    return _finish(fig, ax, ylabel, path, logy)


def _finish(fig, ax, ylabel: str, path: Path, logy: bool) -> Path:
    """y label and scale, grid, legend; save and close the figure."""
    import matplotlib.pyplot as plt

    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_curves(groups, keys, metric: str, ylabel: str, path: Path, at: Optional[object], logy=False) -> Path:
    """Mean over seeds (line) and min..max over seeds (band) of a metric's history, one line per group."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
    for gk, runs in groups.items():
        if at is not None and len(gk) > 1 and gk[1] != at:
            continue
        curves = [dict(d.curves[metric]) for d in runs if d.curves.get(metric)]
        if not curves:
            continue
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        vals = [[c[s] for c in curves] for s in steps]
        ax.plot(steps, [st.fmean(v) for v in vals], label=" ".join(map(str, gk)))
        ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], alpha=0.2)
    ax.set_xlabel("optimizer step")
    return _finish(fig, ax, ylabel, path, logy)


def plot_layers(groups, keys, path: Path, at: Optional[object]) -> Path:
    """Composite Amax (fwd, bwd) vs sublayer at each run's last diagnostics, mean over seeds."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for ax, key in zip(axes, ("composite_fwd_max", "composite_bwd_max")):
        for gk, runs in groups.items():
            if at is not None and len(gk) > 1 and gk[1] != at:
                continue
            layers = [d.per_layer[key] for d in runs if d.per_layer and key in d.per_layer]
            if not layers:
                continue
            ax.plot(range(len(layers[0])), [st.fmean(v) for v in zip(*layers)], "-o", ms=2.5,
                    label=" ".join(map(str, gk)))
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_xlabel("sublayer l (product of H_res from l to the last sublayer)")
        ax.set_title(f"{key.replace('_', ' ')} at the last diagnostics step")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("Amax gain (max over tokens), mean over seeds")
    axes[1].legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def make_plots(groups, keys, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    deepest = max((gk[1] for gk in groups if len(gk) > 1), default=None)
    return {
        "bpb_vs_depth": plot_vs_axis(groups, keys, "val_bpb", "validation bits/byte (mean ± std)", out / "bpb_vs_depth.png"),
        "amax_vs_depth": plot_vs_axis(groups, keys, "amax_fwd_peak", "peak composite Amax gain, forward", out / "amax_vs_depth.png", logy=True),
        "amax_over_training": plot_curves(groups, keys, "amax/composite_fwd_max", f"composite Amax fwd ({keys[1] if len(keys) > 1 else ''}={deepest})",
                                          out / "amax_over_training.png", deepest, logy=True),
        "amax_vs_layer": plot_layers(groups, keys, out / "amax_vs_layer.png", deepest),
        "grad_norm": plot_curves(groups, keys, "train/grad_norm", f"grad norm before clipping ({keys[1] if len(keys) > 1 else ''}={deepest})",
                                 out / "grad_norm.png", deepest, logy=True),
        "val_loss": plot_curves(groups, keys, "val/bpb", f"validation bits/byte ({keys[1] if len(keys) > 1 else ''}={deepest})",
                                out / "val_bpb_curves.png", deepest),
    }


def report(tracking_uri: str, experiment: str, keys: list[str], out: Path, report_path: Optional[Path],
           notes: Optional[Path], context: Optional[Path], command: str) -> dict:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    runs = select_runs(client, experiment=experiment, include_failed=False)
    data = load(client, runs)
    groups = group(data, keys)
    out.mkdir(parents=True, exist_ok=True)
    header, rows, records = table(groups, keys)
    md = _markdown(header, rows)
    (out / "groups.md").write_text(md)
    with open(out / "groups.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(records[0]))
        w.writeheader()
        w.writerows(records)
    plots = make_plots(groups, keys, out)
    if report_path:
        rel = os.path.relpath(out, report_path.parent)
        parts = [f"# Results: experiment `{experiment}`\n",
                 f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by:\n\n    {command}\n"]
        if context and context.exists():
            parts.append("Context:\n\n" + "".join(f"    {l}\n" for l in context.read_text().splitlines()) + "\n")
        parts.append(f"{len(data)} finished runs, grouped by {', '.join(keys)}; mean ± std over the runs of each group.\n\n" + md)
        parts.append("\n".join(f"![{k}]({rel}/{p.name})" for k, p in plots.items()) + "\n")
        if notes and notes.exists():
            parts.append(notes.read_text())
        report_path.write_text("\n".join(parts))
    return {"runs": len(data), "groups": len(groups), "table": out / "groups.md", "plots": plots}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="mhc report", description="Runs grouped by tags, mean ± std over seeds.")
    p.add_argument("--experiment", required=True)
    p.add_argument("--group-by", required=True, help="comma-separated run tags, e.g. variant,model.arch.n_layers")
    p.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    p.add_argument("--out", type=Path, default=Path("reports/grouped"))
    p.add_argument("--report", type=Path, help="write a markdown report here")
    p.add_argument("--notes", type=Path, help="markdown appended to the report (the reading of the results)")
    p.add_argument("--context", type=Path, help="text file with GPU / versions, quoted in the report")
    args = p.parse_args(argv)
    command = "mhc compare " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        res = report(args.tracking_uri, args.experiment, args.group_by.split(","), args.out, args.report,
                     args.notes, args.context, command)
    except CompareError as err:
        print(f"mhc report: error: {err}", file=sys.stderr)
        return 2
    print(f"{res['runs']} runs in {res['groups']} groups -> {res['table']}")
    print(Path(res["table"]).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
