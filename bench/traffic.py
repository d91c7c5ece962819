"""Each fused mHC kernel of a profiled trainer step against the bytes it must move: its share of copy bandwidth.

    python -m bench traffic TRAINER_JSON --copy-tbps 4.17 [--variant mhc] [--u-bytes 2]

Reads the JSON of `python -m bench trainer --profile N` (device time per kernel per step, the run's shape); the JSON
of the trainer benchmark before it joined `python -m bench` (its "bench" / "profile" layout) reads the same. Bytes:
bench/kernel_bytes.py. --copy-tbps: the copy bandwidth measured on the same GPU (`python -m bench stack` records it as
env.copy_tb_s; an H200 copies 4.17 TB/s). u and du are as wide as the branch takes them: 4 bytes in an eager bf16-mixed
run (fp32 branch parameters), 2 under torch.compile (the stream's dtype, cast inside inductor's norm) and in pure
bf16; --u-bytes sets one width for every run.
"""

from __future__ import annotations

import json
import sys

from bench import harness, kernel_bytes

COLUMNS = [
    ("variant", "variant", ""),
    ("op", "op", ""),
    ("kernel", "kernel", ""),
    ("mb_per_call", "MB/call", ".0f"),
    ("floor_us", "floor us", ".1f"),
    ("us", "us", ".1f"),
    ("pct_copy", "% copy", ".0f"),
    ("floor_ms_per_step", "floor ms", ".2f"),
    ("ms_per_step", "ms/step", ".2f"),
]


def profiled_runs(data: dict) -> dict[str, tuple[dict, dict]]:
    """variant -> (its one-device run, its profile), from either layout of the trainer benchmark's JSON."""
    if "rows" in data:
        return {
            r["variant"]: (r, r["profile"])
            for r in data["rows"]
            if r.get("devices") == 1 and isinstance(r.get("profile"), dict) and "top" in r["profile"]
        }
    compiled = "model.compile=true" in str(data.get("args", {}).get("fit_args", ""))
    return {
        v: (dict(data["bench"][f"{v}-1"], compiled=compiled), p)
        for v, p in (data.get("profile") or {}).items()
        if "top" in p and f"{v}-1" in data.get("bench", {})
    }


def u_bytes_of(run: dict) -> int:
    return 4 if run.get("precision") == "bf16-mixed" and not run.get("compiled") else 2


def main(argv=None) -> int:
    p = harness.parser("traffic", __doc__)
    p.add_argument("trainer_json")
    p.add_argument("--copy-tbps", type=float, required=True, help="copy bandwidth of the GPU, TB/s")
    p.add_argument(
        "--variant",
        action="append",
        default=None,
        help="profiled variant(s) to tabulate (default: every one whose profile has these kernels)",
    )
    p.add_argument("--streams", type=int, default=4, help="n, the model's stream count")
    p.add_argument("--iters", type=int, default=20, help="Sinkhorn iterations of the run")
    p.add_argument(
        "--u-bytes",
        type=int,
        choices=(2, 4),
        default=None,
        help="bytes per element of u and du for every variant (default: each run's own)",
    )
    args = p.parse_args(argv)
    if args.copy_tbps <= 0:
        p.error(f"--copy-tbps: {args.copy_tbps}; allowed: a bandwidth above 0 (TB/s)")
    with open(args.trainer_json) as fh:
        runs = profiled_runs(json.load(fh))
    if not runs:
        p.error(f"{args.trainer_json}: no profile; allowed: the JSON of `python -m bench trainer --profile N`")
    unknown = sorted(set(args.variant or ()) - set(runs))
    if unknown:
        p.error(f"--variant: {', '.join(unknown)} not profiled; allowed: {', '.join(runs)}")
    report = harness.Report("traffic", args, argv or [], "cpu")
    report.env["copy_tb_s"] = args.copy_tbps
    for variant in args.variant or list(runs):
        run, profile = runs[variant]
        u_bytes = args.u_bytes or u_bytes_of(run)
        rows = kernel_bytes.efficiency(
            profile["top"], run["tokens_per_step"], run["d_model"], args.streams, args.iters, args.copy_tbps, u_bytes
        )
        if rows:
            shape = dict(variant=variant, tokens=run["tokens_per_step"], C=run["d_model"], u_bytes=u_bytes)
            for r in rows + [kernel_bytes.total(rows)]:
                report.rows.append(dict(shape, **r))
    if not report.rows:
        print("no fused mHC kernel in the profiles (residual runs only?)", file=sys.stderr)
        return 1
    harness.print_table(report.rows, COLUMNS)
    print("wrote", report.save())
    return 0
