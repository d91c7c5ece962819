"""Command lines of the reports: `mhc compare` (and its grouped form `--group-by`) and `mhc report`.

mhc compare --study smoke --tracking-uri sqlite:///$PWD/mlflow.db
mhc compare --experiment mhc_lightning --tracking-uri http://localhost:5000 --out reports/today
mhc compare --runs 1a2b... 3c4d... --no-log
mhc compare --experiment stability --group-by variant,model.arch.n_layers --report docs/results.md ...
mhc report --experiment stability --group-by variant,model.arch.n_layers --baseline residual
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

from ..errors import UserError

# run_summary's keys (grouped.py) that --metric may name; kept here so that --help needs no pandas or mlflow
METRICS = [
    "val_bpb",
    "val_loss",
    "amax_fwd_peak",
    "amax_bwd_peak",
    "amax_bwd_tokmean_peak",
    "min_colsum",
    "min_colsum_tokmean",
    "logit_range_peak",
    "grad_norm_max_warmup",
    "grad_norm_max",
    "grad_spikes",
    "tokens_per_sec",
]


def _default_uri() -> str:
    from ..loggers.store import default_tracking_uri

    return default_tracking_uri()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mhc compare", description="Table and plots comparing MLflow runs.")
    sel = p.add_mutually_exclusive_group(required=True)
    sel.add_argument("--experiment", help="every training run of this MLflow experiment")
    sel.add_argument("--study", help="the trial runs of this Optuna study (tag optuna.study_name)")
    sel.add_argument("--runs", nargs="+", metavar="RUN_ID", help="these runs")
    p.add_argument(
        "--tracking-uri",
        help="sqlite:///abs/mlflow.db or http://host:5000 (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)",
    )
    p.add_argument(
        "--out",
        help="output folder (default, one per report: reports/<experiment>, reports/study_<study>, with --group-by "
        "reports/<experiment>/by_<keys>, with --runs reports/runs_<ids>)",
    )
    p.add_argument("--top", type=int, default=12, help="runs drawn in the plots (best by val/loss); the table has all")
    p.add_argument(
        "--include-eval",
        action="store_true",
        help="also the evaluation runs of `mhc validate` / `mhc test` (tag stage), left out by default",
    )
    p.add_argument("--no-log", action="store_true", help="do not log the table and plots to MLflow")
    p.add_argument("--log-run-id", help="log into this run instead")
    g = p.add_argument_group("grouped report (mean +- std over seeds; = mhc report)")
    g.add_argument("--group-by", help="comma-separated run tags, e.g. variant,model.arch.n_layers")
    g.add_argument("--report", help="with --group-by: write a markdown report here")
    g.add_argument("--notes", help="with --group-by: markdown appended to the report")
    g.add_argument("--context", help="with --group-by: text file (GPU, versions) quoted in the report")
    g.add_argument(
        "--baseline",
        metavar="VALUE",
        help="with --group-by: each group's difference to the group whose first key has this value (same "
        "other keys), with a 95%% CI, n and p, paired by seed where the seeds pair (Welch otherwise)",
    )
    g.add_argument(
        "--metric",
        default="val_bpb",
        choices=METRICS,
        help="with --baseline: the per-run value compared (default: val_bpb, the final val bits/byte)",
    )
    g.add_argument(
        "--allow-mixed-code",
        action="store_true",
        help="with --group-by: pool runs of different commits or uncommitted changes in one group "
        "(refused by default; tag mhc.code)",
    )
    return p


def default_out(args) -> Path:
    """Each report its own folder, so that one report never overwrites another's tables and plots."""
    from ..names import file_name

    if args.group_by:
        return Path("reports") / file_name(args.experiment) / file_name(f"by_{args.group_by}")
    if args.runs:
        more = f"_and_{len(args.runs) - 3}_more" if len(args.runs) > 3 else ""
        return Path("reports") / file_name("runs_" + "_".join(r[:8] for r in args.runs[:3]) + more)
    # a sweep's experiment is named after its study by default: the two reports must not share a folder
    return Path("reports") / file_name(args.experiment if args.experiment else f"study_{args.study}")


def grouped_command(args, uri: str) -> list[str]:
    """The canonical `mhc compare` arguments of a grouped report, as its header quotes them."""
    cmd = ["--experiment", args.experiment, "--group-by", args.group_by, "--tracking-uri", uri]
    for flag, value in (
        ("--out", args.out),
        ("--report", args.report),
        ("--notes", args.notes),
        ("--context", args.context),
        ("--baseline", args.baseline),
    ):
        if value:
            cmd += [flag, str(value)]
    if args.baseline and args.metric != "val_bpb":
        cmd += ["--metric", args.metric]
    return (
        cmd
        + (["--include-eval"] if args.include_eval else [])
        + (["--allow-mixed-code"] if args.allow_mixed_code else [])
    )


def _grouped(args, uri: str) -> int:
    from .grouped import report

    out = Path(args.out) if args.out else default_out(args)
    res = report(
        uri,
        args.experiment,
        args.group_by.split(","),
        out,
        Path(args.report) if args.report else None,
        Path(args.notes) if args.notes else None,
        Path(args.context) if args.context else None,
        "mhc compare " + " ".join(grouped_command(args, uri)),
        args.include_eval,
        args.baseline,
        args.metric,
        args.allow_mixed_code,
    )
    print(f"{res['said'][0]} {res['groups']} groups (means over finished runs) -> {res['table']}")
    print(Path(res["table"]).read_text())
    for line in res["said"][1:]:
        print(line)
    if res["differences"] is not None:
        print(
            f"difference in {args.metric} to {args.baseline} (95% CI over seeds, replicates averaged; paired by seed "
            "where seeds pair; divergence rates by Fisher's exact test) "
            f"-> {res['differences']}"
        )
        print(Path(res["differences"]).read_text())
    return 0


def _compare(args, uri: str) -> int:
    from .compare import compare

    out = args.out or str(default_out(args))
    res = compare(
        uri, out, args.experiment, args.study, args.runs, not args.no_log, args.top, args.log_run_id, args.include_eval
    )
    print(f"{res['runs']} runs -> {res['table_md']}, {res['table_csv']}")
    for name, path in res["plots"].items():
        print(f"  {name}: {path}")
    if "logged_to" in res:
        print(f"logged to MLflow run {res['logged_to']} (artifacts under comparison/)")
    print(Path(res["table_md"]).read_text())
    return 0


def main(argv: Optional[list[str]] = None, prog: str = "mhc compare") -> int:
    parser = build_parser()
    parser.prog = prog
    args = parser.parse_args(argv)
    if args.group_by and not args.experiment:
        parser.error("--group-by needs --experiment")
    for flag, value in (("--baseline", args.baseline), ("--allow-mixed-code", args.allow_mixed_code)):
        if value and not args.group_by:
            parser.error(f"{flag} needs --group-by (the groups it compares)")
    from ..loggers.credentials import clean_tracking_env, take_credentials

    clean_tracking_env()  # a password in the URI goes to MLflow's credential variables, never into printed lines
    uri = take_credentials(args.tracking_uri) or _default_uri()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one bar per downloaded file otherwise
    try:
        return _grouped(args, uri) if args.group_by else _compare(args, uri)
    except UserError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2


def report_main(argv: Optional[list[str]] = None) -> int:
    """`mhc report ...` == `mhc compare --group-by ...` (--experiment and --group-by required)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    wants_help = any(a in ("-h", "--help") for a in argv)
    if not wants_help and ("--group-by" not in argv or "--experiment" not in argv):
        print(
            "mhc report: error: --experiment and --group-by are required "
            "(e.g. --experiment stability --group-by variant,model.arch.n_layers)",
            file=sys.stderr,
        )
        return 2
    return main(argv, prog="mhc report")
