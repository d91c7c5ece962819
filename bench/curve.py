"""The overhead curve: the trainer's step, residual against mHC and HC, eager and compiled, as the width C grows.

    python -m bench curve                                   # C = 1024, 2048, 4096, 8192 (4 blocks there), n = 4
    python -m bench curve --widths 1024,4096 --kinds compiled
    python -m bench curve --smoke                           # CPU, tiny widths: checks the benchmark, not speed
    python -m bench curve --draw out/bench/curve            # the table and figure again from a folder's JSONs

Each point (width, eager or compiled) is one `python -m bench trainer` call, its JSON `trainer-C<width>-<kind>.json`
in the output folder; then `curve.json` (a row per width, kind and variant: tokens/s, step ratio to the residual by
median, peak memory and its ratio) and `curve.png` (the ratio against C). The stream traffic mHC adds grows as C,
the GEMMs as C², so the ratio should fall with width; the paper's 6.7 % is at a far wider model.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import harness, trainer

KINDS = {"eager": "", "compiled": "--model.compile=true"}
HEAD_DIM = 64  # heads = C / 64, as the trainer's default shape (C = 1024, 16 heads)


def point_path(folder: Path, width: int, kind: str) -> Path:
    return folder / f"trainer-C{width}-{kind}.json"


def run_point(folder: Path, width: int, kind: str, args, blocks: int) -> Path:
    out = point_path(folder, width, kind)
    argv = [
        "--modes",
        args.modes,
        "--d-model",
        str(width),
        "--heads",
        str(max(1, width // HEAD_DIM)),
        "--layers",
        str(blocks),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--out",
        str(out),
    ]
    if args.smoke:
        argv += ["--smoke", "--seq", "32", "--batch", "2"]
    if KINDS[kind]:
        argv += [f"--fit-args={KINDS[kind]}"]
    print(f"== C = {width}, {blocks} blocks, {kind}", flush=True)
    trainer.main(argv)
    return out


def rows_from(folder: Path) -> list[dict]:
    """A row per (width, kind, variant) of the point JSONs in `folder`, with the ratios to that point's residual."""
    rows = []
    for path in sorted(folder.glob("trainer-C*-*.json")):
        width, kind = path.stem.split("-")[1][1:], path.stem.split("-")[2]
        data = json.loads(path.read_text())
        by = {r["variant"]: r for r in data["rows"] if r.get("devices", 1) == 1}
        base = by.get("residual", {})
        for variant, r in by.items():
            row = {
                "width": int(width),
                "kind": kind,
                "variant": variant,
                "blocks": data["args"].get("layers"),
                "tokens_per_s": r.get("tokens_per_s"),
                "step_ms_median": r.get("step_ms_median"),
                "x_residual_median": r.get("x_residual_median"),
                "peak_gib": r.get("peak_gib"),
                "json": path.name,
            }
            if r.get("peak_gib") and base.get("peak_gib"):
                row["peak_x_residual"] = r["peak_gib"] / base["peak_gib"]
            rows.append(row)
    return sorted(rows, key=lambda r: (r["kind"], r["width"], r["variant"]))


def figure(rows: list[dict], path: Path) -> Path | None:
    """Step ratio to the residual against C: a line per variant and kind (eager solid, compiled dashed)."""
    lines = {}
    for r in rows:
        if r["variant"] != "residual" and r.get("x_residual_median"):
            lines.setdefault((r["variant"], r["kind"]), []).append((r["width"], r["x_residual_median"]))
    if not lines:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.style.context("default"):
        fig, ax = plt.subplots(figsize=(6.4, 4.2), constrained_layout=True)
        colours = {v: f"C{i}" for i, v in enumerate(sorted({v for v, _ in lines}))}
        for (variant, kind), pts in sorted(lines.items()):
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, "-o" if kind == "eager" else "--s", color=colours[variant], label=f"{variant}, {kind}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("width C (n = 4 streams)")
        ax.set_ylabel("step time / residual's (median)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return path


COLUMNS = [
    ("width", "C", "d"),
    ("kind", "kind", ""),
    ("variant", "variant", ""),
    ("blocks", "blocks", ""),
    ("tokens_per_s", "tok/s", ",.0f"),
    ("x_residual_median", "x resid", ".3f"),
    ("peak_gib", "peak GiB", ".2f"),
    ("peak_x_residual", "peak x resid", ".3f"),
]


def summarise(folder: Path, args, argv) -> int:
    rows = rows_from(folder)
    report = harness.Report("curve", args, argv, "cpu" if args.smoke else "cuda")
    report.path = folder / "curve.json"
    for row in rows:
        report.add(row)
    harness.print_table(rows, COLUMNS)
    drawn = figure(rows, folder / "curve.png")
    print(f"wrote {report.save()}" + (f" and {drawn}" if drawn else ""))
    return 0 if rows else 1


def main(argv=None) -> int:
    p = harness.parser("curve", __doc__)
    p.add_argument(
        "--widths", default=None, help="comma-separated C values (default 1024,2048,4096,8192; --smoke 32,64)"
    )
    p.add_argument(
        "--blocks",
        action="append",
        default=[],
        metavar="WIDTH=N",
        help="blocks at a width (default 12, and 4 at C = 8192 so that it fits one GPU)",
    )
    p.add_argument("--kinds", default="eager,compiled", help=f"comma-separated: {', '.join(KINDS)}")
    p.add_argument("--modes", default="residual,mhc,hc")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny widths and shapes")
    p.add_argument("--draw", metavar="FOLDER", help="only the table and figure, from the JSONs in FOLDER")
    args = p.parse_args(argv)
    if args.draw:
        return summarise(Path(args.draw), args, argv or [])
    kinds = [k for k in args.kinds.split(",") if k]
    for kind in kinds:
        if kind not in KINDS:
            p.error(f"--kinds {kind}: allowed: {', '.join(KINDS)}")
    widths = [int(w) for w in (args.widths or ("32,64" if args.smoke else "1024,2048,4096,8192")).split(",") if w]
    blocks = {8192: 4}
    for item in args.blocks:
        width, _, n = item.partition("=")
        if not (width.isdigit() and n.isdigit()):
            p.error(f"--blocks {item}: expected WIDTH=N, e.g. 8192=4")
        blocks[int(width)] = int(n)
    folder = harness.out_path("curve", args.out).parent
    folder.mkdir(parents=True, exist_ok=True)
    for width in widths:
        for kind in kinds:
            run_point(folder, width, kind, args, blocks.get(width, 2 if args.smoke else 12))
    return summarise(folder, args, argv or [])
