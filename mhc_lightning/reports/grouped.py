"""Grouped results report: runs aggregated over seeds (mean +- std) into markdown tables and plots, and each group's
difference to a baseline group with a paired confidence interval (stats.py).

    mhc compare --experiment stability --group-by variant,model.arch.n_layers --baseline residual \
        --tracking-uri http://127.0.0.1:5000 --out docs/results --report docs/results.md \
        --notes docs/results_notes.md --context docs/results/context.txt

Groups come from run tags (the grid runner tags every run with its variant and axis values); only FINISHED
training runs count. A group pools runs of one code state only (tag `mhc.code`: commit, and a digest of any
uncommitted change), unless allow_mixed_code is set. Reads local stores and servers alike (runs.py).
"""

from __future__ import annotations

import math
import os
import statistics as st
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

from ..diagnostics import GRAD_SPIKE_FACTOR as SPIKE_FACTOR
from . import plots, sensitivity
from .runs import CompareError, RunData, code_label, load, search, seed_of
from .stats import difference, format_difference
from .tables import frame, write_table

HISTORIES = [
    "val/loss",
    "val/bpb",
    "train/grad_norm",
    "train/tokens_per_sec",
    "amax/composite_fwd_max",
    "amax/composite_bwd_max",
    "amax/composite_bwd_tokmean",
    "amax/composite_min_colsum_worst",
    "amax/composite_min_colsum_tokmean",
    "hres/dist_identity_max",
    "sinkhorn/logit_range_max",
]
COLUMNS = [  # (summary key, header, format)
    ("val_bpb", "val bits/byte", "{:.4f}"),
    ("amax_fwd_peak", "composite Amax fwd (worst token, peak)", "{:.4g}"),
    ("amax_bwd_peak", "composite Amax bwd (worst token, peak)", "{:.4g}"),
    ("amax_bwd_tokmean_peak", "composite Amax bwd (token mean, peak)", "{:.4g}"),
    ("min_colsum", "min column sum (worst token)", "{:.3g}"),
    ("min_colsum_tokmean", "min column sum (token mean)", "{:.3g}"),
    ("logit_range_peak", "res logit range (peak)", "{:.3g}"),
    # is the mechanism engaged at all (docs/design.md §6-7): streams that differ, an H_res that moves
    ("stream_spread", "stream spread (last sublayer)", "{:.3g}"),
    ("hres_dist_identity", "‖H_res − I‖ (final, layer mean)", "{:.3g}"),
    ("hres_dist_identity_peak", "‖H_res − I‖ (largest layer, peak)", "{:.3g}"),
    ("grad_norm_max", "max grad norm (pre-clip)", "{:.3g}"),
    ("grad_spikes", f"grad spikes (>{SPIKE_FACTOR:g}x median)", "{:.2g}"),
    ("tokens_per_sec", "tokens/s", "{:.3g}"),
]


def run_summary(d: RunData) -> dict[str, float]:
    """Per-run scalars: final validation, the extreme gains seen over training, spikes, throughput.

    Grad-norm maxima and spikes come from the run's every-step summary (`train/grad_norm_max`, `train/grad_spikes`,
    logged by the module) where it has one; older runs only have the logged curve, every log_every_n_steps-th step.
    """

    def peak(key):
        vals = [v for _, v in d.curves.get(key, [])]
        return max(vals) if vals else math.nan  # residual: one stream, no H_res ("–" in the table)

    def lowest(key):
        vals = [v for _, v in d.curves.get(key, [])]
        return min(vals) if vals else math.nan

    warmup = int(d.params.get("optim/warmup_steps", 0))  # early steps are large by design, not spikes
    gn = [v for step, v in d.curves.get("train/grad_norm", []) if step >= warmup]
    med = st.median(gn) if gn else math.nan
    tps = [v for _, v in d.curves.get("train/tokens_per_sec", [])]
    every_step = "train/grad_norm_max" in d.metrics
    return {
        "val_bpb": d.metrics.get("val/bpb", math.nan),
        "val_loss": d.metrics.get("val/loss", math.nan),
        "amax_fwd_peak": peak("amax/composite_fwd_max"),
        "amax_bwd_peak": peak("amax/composite_bwd_max"),
        "amax_bwd_tokmean_peak": peak("amax/composite_bwd_tokmean"),
        "min_colsum": lowest("amax/composite_min_colsum_worst"),
        "min_colsum_tokmean": lowest("amax/composite_min_colsum_tokmean"),
        "logit_range_peak": peak("sinkhorn/logit_range_max"),
        "stream_spread": d.metrics.get("streams/spread_last", math.nan),
        "hres_dist_identity": d.metrics.get("hres/dist_identity", math.nan),
        "hres_dist_identity_peak": peak("hres/dist_identity_max"),
        "grad_norm_max": d.metrics["train/grad_norm_max"] if every_step else (max(gn) if gn else math.nan),
        "grad_spikes": d.metrics.get("train/grad_spikes", math.nan)
        if every_step
        else (float(sum(v > SPIKE_FACTOR * med for v in gn)) if gn else math.nan),
        "tokens_per_sec": st.median(tps) if tps else math.nan,
    }


def _num(v: str):
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


def check_one_code(groups: dict[tuple, list[RunData]]) -> None:
    """Refuse a group that pools runs of different code (commits, or uncommitted changes): one line naming them."""
    for gk, runs in groups.items():
        labels = {d.run_id: code_label(d) for d in runs}
        if len(set(labels.values())) > 1 or any("," in v for v in labels.values()):
            named = ", ".join(f"{d.name} ({labels[d.run_id]})" for d in runs)
            raise CompareError(
                f"group {' '.join(map(str, gk))} pools runs of different code: {named}; compare runs "
                "of one commit (rerun them), or pass --allow-mixed-code to pool them anyway"
            )


def group(data: list[RunData], keys: list[str]) -> dict[tuple, list[RunData]]:
    groups: dict[tuple, list[RunData]] = defaultdict(list)
    for d in data:
        missing = [k for k in keys if k not in d.tags]
        if missing:
            raise CompareError(f"run {d.name} has no tag(s) {missing}; group by tags the runs carry: {sorted(d.tags)}")
        groups[tuple(_num(d.tags[k]) for k in keys)].append(d)
    return dict(
        sorted(
            groups.items(),
            key=lambda kv: tuple((isinstance(x, str), x if not isinstance(x, str) else 0, str(x)) for x in kv[0]),
        )
    )


def mean_std(vals: list[float]) -> tuple[float, float]:
    vals = [v for v in vals if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan
    return st.fmean(vals), (st.stdev(vals) if len(vals) > 1 else 0.0)


def replicate_sd(runs: list[RunData], metric: str = "val_bpb") -> float:
    """The pooled standard deviation between runs of the same seed (replicates: same code, config and seed); NaN
    when no seed ran twice. It is the run-to-run floor under the seed spread."""
    by_seed: dict = defaultdict(list)
    for d in runs:
        v = run_summary(d)[metric]
        if not math.isnan(v):
            by_seed[seed_of(d)].append(v)
    sq, dof = 0.0, 0
    for vals in by_seed.values():
        if len(vals) > 1:
            m = st.fmean(vals)
            sq += sum((v - m) ** 2 for v in vals)
            dof += len(vals) - 1
    return math.sqrt(sq / dof) if dof else math.nan


def tables(groups, keys):
    """(numbers: mean and std columns, for the CSV; text: 'mean ± std' cells under readable headers, for markdown)."""
    records, cells = [], []
    replicated = any(len({seed_of(d) for d in runs}) < len(runs) for runs in groups.values())
    for gk, runs in groups.items():
        sums = [run_summary(d) for d in runs]
        code = ",".join(sorted({code_label(d) for d in runs}))
        rec = dict(zip(keys, gk), runs=len(runs), code=code)
        row = {**{k: str(v) for k, v in zip(keys, gk)}, "runs": str(len(runs)), "code": code}
        if replicated:  # the same seed run more than once: the run-to-run spread beside the seed spread
            rec["replicate_sd"] = replicate_sd(runs)
            row["replicate SD of val bits/byte"] = (
                "–" if math.isnan(rec["replicate_sd"]) else (f"{rec['replicate_sd']:.4f}")
            )
        for key, header, f in COLUMNS:
            m, s = mean_std([x[key] for x in sums])
            rec[key], rec[key + "_std"] = m, s
            row[header] = "–" if math.isnan(m) else f"{f.format(m)} ± {f.format(s)}"
        records.append(rec)
        cells.append(row)
    return frame(records), frame(cells)


def baseline_differences(groups: dict[tuple, list[RunData]], keys: list[str], baseline: str, metric: str = "val_bpb"):
    """Each group's difference in `metric` to the group that has `baseline` as its first key and the same other keys:
    paired by seed where seeds pair, Welch otherwise (stats.difference). Returns the DataFrame of rows."""
    if not any(str(gk[0]) == baseline for gk in groups):
        raise CompareError(
            f"--baseline {baseline!r}: no group has {keys[0]}={baseline}; "
            f"groups: {sorted({str(gk[0]) for gk in groups})}"
        )
    by_key = {tuple(str(x) for x in gk): runs for gk, runs in groups.items()}
    rows = []
    for gk, runs in groups.items():
        if str(gk[0]) == baseline:
            continue
        base = by_key.get((baseline, *(str(x) for x in gk[1:])))
        if base is None:
            continue
        pairs = [[(seed_of(d), run_summary(d)[metric]) for d in rs] for rs in (runs, base)]
        rows.append({**{k: str(v) for k, v in zip(keys, gk)}, "vs": baseline, **format_difference(difference(*pairs))})
    return frame(rows)


def _at_deepest(groups, at):
    return {gk: runs for gk, runs in groups.items() if at is None or len(gk) < 2 or gk[1] == at}


def make_plots(groups, keys, out: Path) -> dict[str, Path]:
    deepest = max((gk[1] for gk in groups if len(gk) > 1), default=None)
    axis = keys[1] if len(keys) > 1 else ""
    at = f" ({axis}={deepest})" if len(keys) > 1 else ""

    def vs_axis(metric):
        series = defaultdict(list)
        for gk, runs in groups.items():
            series[gk[0]].append((gk[1] if len(gk) > 1 else 0, *mean_std([run_summary(d)[metric] for d in runs])))
        return series

    def band_lines(metric):
        """Mean over seeds (line) and min..max over seeds (band) of a metric's history, one line per group."""
        lines = []
        for gk, runs in _at_deepest(groups, deepest).items():
            hist = [dict(d.curves[metric]) for d in runs if d.curves.get(metric)]
            if not hist:
                continue
            steps = sorted(set.intersection(*(set(h) for h in hist)))
            vals = [[h[s] for h in hist] for s in steps]
            lines.append(
                (
                    " ".join(map(str, gk)),
                    steps,
                    [st.fmean(v) for v in vals],
                    ([min(v) for v in vals], [max(v) for v in vals]),
                )
            )
        return lines

    layer_series = []
    for gk, runs in _at_deepest(groups, deepest).items():
        layers = {
            k: [d.per_layer[k] for d in runs if d.per_layer and k in d.per_layer]
            for k in ("composite_fwd_max", "composite_bwd_max")
        }
        if all(layers.values()):
            means = {k: [st.fmean(v) for v in zip(*ls)] for k, ls in layers.items()}
            layer_series.append((" ".join(map(str, gk)), means))
    layers = None
    if layer_series:
        layers = plots.save(
            plots.amax_vs_layer(
                layer_series, title=f"composite Amax gain at the last diagnostics step, mean over seeds{at}"
            ),
            out / "amax_vs_layer.png",
        )
    result = {
        "bpb_vs_depth": plots.errorbars(
            vs_axis("val_bpb"), axis, "validation bits/byte (mean ± std)", out / "bpb_vs_depth.png"
        ),
        # backward: mHC's forward gain is 1 by construction (rows exact), its column error shows here
        "amax_vs_depth": plots.errorbars(
            vs_axis("amax_bwd_peak"), axis, "peak composite Amax gain, backward", out / "amax_vs_depth.png", logy=True
        ),
        "amax_over_training": plots.curves(
            band_lines("amax/composite_bwd_max"),
            "",
            f"composite Amax bwd{at}",
            out / "amax_over_training.png",
            logy=True,
        ),
        "amax_vs_layer": layers,
        "grad_norm": plots.curves(
            band_lines("train/grad_norm"), "", f"grad norm before clipping{at}", out / "grad_norm.png", logy=True
        ),
        "val_loss": plots.curves(band_lines("val/bpb"), "", f"validation bits/byte{at}", out / "val_bpb_curves.png"),
    }
    return {k: v for k, v in result.items() if v is not None}


def seed_note(data: list[RunData], groups: Optional[dict[tuple, list[RunData]]] = None) -> str:
    """What the ± spread over seeds covers, from the runs' own record of where their data seed came from; when every
    group's runs share one seed (replicates), the spread is the run-to-run spread of one computation."""
    if groups and any(len(runs) > 1 for runs in groups.values()):
        if all(len({seed_of(d) for d in runs}) == 1 and seed_of(runs[0]) for runs in groups.values()):
            return (
                "The runs of each group share their seed (one initialisation, one data order): the ± spread is "
                "the run-to-run spread of the same computation."
            )
    sources = {d.tags.get("mhc.data.seed_source") for d in data}
    if sources == {"seed_everything"}:
        return (
            "A seed set the initialisation and the data order (the windows' offset and shuffle): the ± spread "
            "covers both."
        )
    if None in sources:
        return (
            "Some runs do not record where their data seed came from (tag mhc.data.seed_source): runs made "
            "before the data seed followed seed_everything read the same data in the same order whatever their "
            "seed, so their ± spread covers the initialisation only."
        )
    return f"Data seeds came from: {', '.join(sorted(sources))} (a fixed data.seed holds the data order across seeds)."


def report(
    tracking_uri: str,
    experiment: str,
    keys: list[str],
    out: Path,
    report_path: Optional[Path],
    notes: Optional[Path],
    context: Optional[Path],
    command: str,
    include_evaluation: bool = False,
    baseline: Optional[str] = None,
    metric: str = "val_bpb",
    allow_mixed_code: bool = False,
) -> dict:
    data = load(
        tracking_uri,
        search(tracking_uri, experiment=experiment, include_evaluation=include_evaluation, finished_only=True),
        HISTORIES,
    )
    if not data:
        raise CompareError(f"experiment {experiment!r} has no FINISHED runs")
    groups = group(data, keys)
    if not allow_mixed_code:
        check_one_code(groups)
    numbers, text = tables(groups, keys)
    md_path, _ = write_table(numbers, out, "groups", md_df=text)
    figures, lr_path, best_path = {}, None, None
    compared, compared_keys = groups, keys
    if sensitivity.LR_KEY in keys:  # an lr scan: compare each variant at its own best lr
        value = lambda d: run_summary(d)["val_bpb"]  # noqa: E731
        lr_path, _ = write_table(sensitivity.lr_table(groups, keys, value), out, "lr_sensitivity", formatter=str)
        figure = sensitivity.lr_figure(groups, keys, value, out / "lr_sensitivity.png")
        if figure is not None:
            figures["lr_sensitivity"] = figure
        compared, compared_keys = sensitivity.at_best_lr(groups, keys, value)
        if compared:
            best_numbers, best_text = tables(compared, compared_keys)
            best_path, _ = write_table(best_numbers, out, "at_best_lr", md_df=best_text)
    diff_path = None
    if baseline is not None:
        diff_path, _ = write_table(
            baseline_differences(compared, compared_keys, baseline, metric), out, f"vs_{baseline}", formatter=str
        )
    if compared:
        figures.update(make_plots(compared, compared_keys, out))
    if report_path:
        rel = os.path.relpath(out, report_path.parent)
        parts = [
            f"# Results: experiment `{experiment}`\n",
            f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by:\n\n    {command}\n",
        ]
        if context and context.exists():
            parts.append("Context:\n\n" + "".join(f"    {line}\n" for line in context.read_text().splitlines()) + "\n")
        parts.append(
            f"{len(data)} finished runs, grouped by {', '.join(keys)}; mean ± std over the runs of each "
            f"group. {seed_note(data, groups)}\n\n" + md_path.read_text()
        )
        if lr_path is not None:
            parts.append(
                f"Learning-rate sensitivity (a run at or above {sensitivity.DIVERGED_BPB:g} val bits/byte "
                "counts as diverged; the best lr is chosen among those where no seed diverged):\n\n"
                + lr_path.read_text()
            )
        if best_path is not None:
            parts.append("Each group at its best lr:\n\n" + best_path.read_text())
        if diff_path is not None:
            parts.append(
                f"Difference in {metric} to `{baseline}` (group − {baseline}; 95 % confidence interval, "
                'paired by seed where both groups ran the same seeds, Welch otherwise; "cannot tell apart": '
                "the interval holds 0):\n\n" + diff_path.read_text()
            )
        parts.append("\n".join(f"![{k}]({rel}/{p.name})" for k, p in figures.items()) + "\n")
        if notes and notes.exists():
            parts.append(notes.read_text())
        report_path.write_text("\n".join(parts))
    return {
        "runs": len(data),
        "groups": len(groups),
        "table": md_path,
        "plots": figures,
        "differences": diff_path,
        "lr_sensitivity": lr_path,
    }
