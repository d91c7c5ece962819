"""Grouped results report: runs aggregated over seeds (mean +- std) into markdown tables and plots, and each group's
difference to a baseline group with a paired confidence interval (stats.py).

    mhc compare --experiment stability --group-by variant,model.arch.n_layers --baseline residual \
        --tracking-uri http://127.0.0.1:5000 --out docs/results --report docs/results.md \
        --notes docs/results_notes.md --context docs/results/context.txt

Groups come from what ran: a key is read from the run's settings (its params, `mhc fit` spelling, e.g.
model.arch.hyper.residual_mode: plain `mhc fit` runs group as well as a grid's), else from its tags (a grid's
`variant`). Each group counts its runs finished / diverged / failed (outcomes.py); means, intervals and plots are over
finished runs. A group pools runs of one code state only (tag `mhc.code`: commit, and a digest of any uncommitted
change; runs of unknown code never pool), unless allow_mixed_code is set, and a group whose runs differ in any other
setting than the grouping keys and the seed is flagged. Reads local stores and servers alike (runs.py).
"""

from __future__ import annotations

import math
import os
import statistics as st
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

from ..training.diagnostics import GRAD_SPIKE_FACTOR as SPIKE_FACTOR
from . import outcomes, plots, sensitivity
from .outcomes import COUNTED, counts, only, outcome
from .runs import SEED_KEY, CompareError, RunData, code_label, load, search, seed_of, tokenizer_of
from .stats import difference, divergence_p, format_difference, one_seed
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
    ("val_loss", "val nats/token", "{:.4f}"),  # per token of the run's tokenizer (tokenizers() below)
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
    ("grad_norm_max_warmup", "max grad norm in warmup (pre-clip)", "{:.3g}"),
    ("grad_norm_max", "max grad norm after warmup (pre-clip)", "{:.3g}"),
    ("grad_spikes", f"grad spikes after warmup (>{SPIKE_FACTOR:g}x median)", "{:.2g}"),
    ("tokens_per_sec", "tokens/s", "{:.3g}"),
]


def run_summary(d: RunData) -> dict[str, float]:
    """Per-run scalars: final validation, the extreme gains seen over training, spikes, throughput.

    Grad-norm maxima and spikes, warmup apart (diagnostics.grad_norm_summary), come from the run's every-step summary
    (`train/grad_norm_max*`, `train/grad_spikes`, logged by the module) where it has one; older runs only have the
    logged curve, every log_every_n_steps-th step.
    """

    def peak(key):
        vals = [v for _, v in d.curves.get(key, [])]
        return max(vals) if vals else math.nan  # residual: one stream, no H_res ("–" in the table)

    def lowest(key):
        vals = [v for _, v in d.curves.get(key, [])]
        return min(vals) if vals else math.nan

    warmup = int(d.resolved.get("model.optim.warmup_steps", 0))  # early steps are large by design, not spikes
    gn = [v for step, v in d.curves.get("train/grad_norm", []) if step >= warmup]
    in_warmup = [v for step, v in d.curves.get("train/grad_norm", []) if step < warmup]
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
        "grad_norm_max_warmup": d.metrics.get("train/grad_norm_max_warmup", max(in_warmup) if in_warmup else math.nan),
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
    """Refuse a group that pools runs of different or unknown code (commits, uncommitted changes, sources): one line
    naming them."""
    for gk, runs in only(groups, COUNTED).items():
        labels = {d.run_id: code_label(d) for d in runs}
        if len(set(labels.values())) > 1 or any("," in v for v in labels.values()):
            named = ", ".join(f"{d.name} ({labels[d.run_id]})" for d in runs)
            raise CompareError(
                f"group {' '.join(map(str, gk))} pools runs of different or unknown code: {named}; "
                "compare runs of one commit (rerun them), or pass --allow-mixed-code to pool them anyway"
            )


def tokenizers(data: list[RunData], metric: str) -> Optional[str]:
    """Refuse nats per token across tokenizers (a token is not the same unit); else, where the runs use several, the
    line that says so. Bits per byte compare across tokenizers."""
    used = sorted({tokenizer_of(d)[:12] for d in data if outcome(d) in COUNTED})
    if len(used) < 2:
        return None
    if metric == "val_loss":
        raise CompareError(
            f"the runs use {len(used)} tokenizers ({', '.join(used)}): val_loss is nats per token of each one's "
            "tokens and does not compare across them; compare --metric val_bpb (bits per byte) instead"
        )
    return (
        f"The runs use {len(used)} tokenizers ({', '.join(used)}): bits per byte compare across them, nats per "
        "token do not (each is per token of its run's tokenizer)."
    )


def setting(d: RunData, key: str) -> Optional[str]:
    """What the run ran with for `key` (its params, `mhc fit` spelling), else its tag of that name (a grid's variant);
    None when it has neither."""
    value = d.resolved.get(key)
    return value if value is not None else d.tags.get(key)


def group(data: list[RunData], keys: list[str]) -> dict[tuple, list[RunData]]:
    """Runs by their values of `keys`. A failed or unfinished run without them (it stopped before logging its
    settings) is left out; a finished or diverged one is an error naming what the run has."""
    groups: dict[tuple, list[RunData]] = defaultdict(list)
    for d in data:
        missing = [k for k in keys if setting(d, k) is None]
        if missing and outcome(d) not in COUNTED:
            continue
        if missing:
            tags = sorted(k for k in d.tags if not k.startswith(("mlflow.", "mhc.", "optuna.")))
            raise CompareError(
                f"run {d.name} has no setting or tag {missing}; group by a setting in `mhc fit` spelling "
                f"(e.g. {sensitivity.LR_KEY}; the run has {len(d.resolved)}) or a tag it carries: {tags}"
            )
        groups[tuple(_num(setting(d, k)) for k in keys)].append(d)
    return dict(
        sorted(
            groups.items(),
            key=lambda kv: tuple((isinstance(x, str), x if not isinstance(x, str) else 0, str(x)) for x in kv[0]),
        )
    )


SEED_KEYS = (SEED_KEY, "data.seed")  # vary within a group by design


def differing_settings(runs: list[RunData], keys: list[str]) -> list[str]:
    """Settings, other than the grouping keys and the seeds, in which the group's runs differ (a key some runs lack
    counts as differing)."""
    names = {k for d in runs for k in d.resolved} - set(keys) - set(SEED_KEYS)
    return sorted(k for k in names if len({d.resolved.get(k) for d in runs}) > 1)


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
    """(numbers: mean and std columns, for the CSV; text: 'mean ± std' cells under readable headers, for markdown;
    a group of one finished run shows its value, std blank). Runs are counted by outcome; means are over the finished
    runs."""
    records, cells = [], []
    finished = {gk: only({gk: runs}, ("finished",)).get(gk, []) for gk, runs in groups.items()}
    replicated = any(len({seed_of(d) for d in runs}) < len(runs) for runs in finished.values())
    differing = {gk: differing_settings(only({gk: runs}, COUNTED).get(gk, []), keys) for gk, runs in groups.items()}
    unfinished = any(counts(runs)["unfinished"] for runs in groups.values())
    for gk, runs in groups.items():
        sums = [run_summary(d) for d in finished[gk]]
        c = counts(runs)
        code = ",".join(sorted({code_label(d) for d in only({gk: runs}, COUNTED).get(gk, [])}))
        rec = dict(zip(keys, gk), **{k: c[k] for k in outcomes.OUTCOMES if k != "unfinished" or unfinished})
        rec["code"] = code
        row = {**{k: str(v) for k, v in zip(keys, gk)}, **{k: str(v) for k, v in rec.items() if k in c}}
        row["code"] = code
        if any(differing.values()):
            rec["settings that differ"] = row["settings that differ"] = ", ".join(differing[gk]) or "–"
        if replicated:  # the same seed run more than once: the run-to-run spread beside the seed spread
            rec["replicate_sd"] = replicate_sd(finished[gk])
            row["replicate SD of val bits/byte"] = (
                "–" if math.isnan(rec["replicate_sd"]) else (f"{rec['replicate_sd']:.4f}")
            )
        for key, header, f in COLUMNS:
            vals = [x[key] for x in sums if not math.isnan(x[key])]
            m, s = mean_std(vals)
            alone = len(vals) == 1  # one run has no spread: its value, not "± 0"
            rec[key], rec[key + "_std"] = m, math.nan if alone else s
            row[header] = "–" if math.isnan(m) else (f.format(m) if alone else f"{f.format(m)} ± {f.format(s)}")
        records.append(rec)
        cells.append(row)
    return frame(records), frame(cells)


def _no_verdict(pairs: list[list], sides: list[list[RunData]], metric: str) -> str:
    """Why a difference has no interval: a side without the metric (the residual has no Amax), a side with one seed
    (its replicate spread shown instead), or too few seeds."""
    for side, ps, rs in zip(("group", "baseline"), pairs, sides):
        if rs and not ps:
            return f"{side} has no {metric}"
    for side, ps, rs in zip(("group", "baseline"), pairs, sides):
        if one_seed(ps):
            sd = replicate_sd(rs, metric)
            spread = "–" if math.isnan(sd) else f"{sd:.4f}"
            return f"{side} has one seed ({len(ps)} runs): replicate SD {spread} only"
    return "too few seeds"


def baseline_differences(groups: dict[tuple, list[RunData]], keys: list[str], baseline: str, metric: str = "val_bpb"):
    """Each group's difference in `metric` to the group that has `baseline` as its first key and the same other keys,
    over finished runs, replicates averaged within their seed: paired by seed where seeds pair, Welch otherwise
    (stats.difference); the runs left out and why; the divergence rates with Fisher's exact p. Returns the DataFrame
    of rows."""
    if not any(str(gk[0]) == baseline for gk in groups):
        raise CompareError(
            f"--baseline {baseline!r}: no group has {keys[0]}={baseline}; "
            f"groups: {sorted({str(gk[0]) for gk in groups})}"
        )
    by_key = {tuple(str(x) for x in gk): runs for gk, runs in groups.items()}
    value = lambda d: run_summary(d)[metric]  # noqa: E731
    rows = []
    for gk, runs in groups.items():
        if str(gk[0]) == baseline:
            continue
        base = by_key.get((baseline, *(str(x) for x in gk[1:])))
        if base is None:
            continue
        sides = [[d for d in rs if outcome(d) == "finished"] for rs in (runs, base)]
        pairs = [[(seed_of(d), value(d)) for d in rs if not math.isnan(value(d))] for rs in sides]
        diff = difference(*pairs)
        cells = format_difference(diff, why_none=_no_verdict(pairs, sides, metric))
        left_out = [outcomes.dropped(rs, value) for rs in (runs, base)]
        (c, cb) = counts(runs), counts(base)
        rates = f"{c['diverged']}/{c['diverged'] + c['finished']} vs {cb['diverged']}/{cb['diverged'] + cb['finished']}"
        p_div = divergence_p(c["diverged"], c["finished"], cb["diverged"], cb["finished"])
        rows.append(
            {
                **{k: str(v) for k, v in zip(keys, gk)},
                "vs": baseline,
                **cells,
                "left out": "; ".join(f"{w}: {t}" for w, t in zip(("group", baseline), left_out) if t) or "none",
                "diverged": rates,
                "divergence p (Fisher exact)": f"{p_div:.3g}",
            }
        )
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
        tracking_uri, search(tracking_uri, experiment=experiment, include_evaluation=include_evaluation), HISTORIES
    )
    if not any(outcome(d) in COUNTED for d in data):
        raise CompareError(f"experiment {experiment!r} has no finished or diverged runs")
    mixed_tokenizers = tokenizers(data, metric)
    groups = group(data, keys)
    if not allow_mixed_code:
        check_one_code(groups)
    numbers, text = tables(groups, keys)
    md_path, _ = write_table(numbers, out, "groups", md_df=text, formatter=str)
    figures, lr_path, best_path = {}, None, None
    compared, compared_keys = groups, keys
    if sensitivity.LR_KEY in keys:  # an lr scan: compare each variant at its own best lr
        counted = only(groups, COUNTED)
        value = lambda d: run_summary(d)["val_bpb"] if outcome(d) == "finished" else math.nan  # noqa: E731
        lr_path, _ = write_table(sensitivity.lr_table(counted, keys, value), out, "lr_sensitivity", formatter=str)
        figure = sensitivity.lr_figure(counted, keys, value, out / "lr_sensitivity.png")
        if figure is not None:
            figures["lr_sensitivity"] = figure
        compared, compared_keys = sensitivity.at_best_lr(counted, keys, value)
        if compared:
            best_numbers, best_text = tables(compared, compared_keys)
            best_path, _ = write_table(best_numbers, out, "at_best_lr", md_df=best_text, formatter=str)
    diff_path = None
    if baseline is not None:
        diff_path, _ = write_table(
            baseline_differences(compared, compared_keys, baseline, metric), out, f"vs_{baseline}", formatter=str
        )
    if only(compared, ("finished",)):
        figures.update(make_plots(only(compared, ("finished",)), compared_keys, out))
    said = outcomes.lines(data, groups) + ([mixed_tokenizers] if mixed_tokenizers else [])
    if report_path:
        rel = os.path.relpath(out, report_path.parent)
        parts = [
            f"# Results: experiment `{experiment}`\n",
            f"Generated {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by:\n\n    {command}\n",
        ]
        if context and context.exists():
            parts.append("Context:\n\n" + "".join(f"    {line}\n" for line in context.read_text().splitlines()) + "\n")
        parts.append(
            f"{said[0]} Grouped by {', '.join(keys)}; mean ± std over the finished runs of each group (a "
            "group of one run: its value alone). "
            f"{seed_note(data, groups)}\n\n" + md_path.read_text() + "".join(f"\n{line}\n" for line in said[1:])
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
                f"Difference in {metric} to `{baseline}` over finished runs (group − {baseline}; 95 % confidence "
                "interval; replicates of a seed averaged first, no verdict from a single seed; paired by seed where "
                'both groups ran the same seeds, Welch otherwise; "cannot tell apart": the interval holds 0), the '
                "runs left out and why, and the divergence rates with Fisher's exact p (two-sided):\n\n"
                + diff_path.read_text()
            )
        parts.append("\n".join(f"![{k}]({rel}/{p.name})" for k, p in figures.items()) + "\n")
        if notes and notes.exists():
            parts.append(notes.read_text())
        report_path.write_text("\n".join(parts))
    return {
        "runs": len(data),
        "said": said,
        "groups": len(groups),
        "table": md_path,
        "plots": figures,
        "differences": diff_path,
        "lr_sensitivity": lr_path,
    }
