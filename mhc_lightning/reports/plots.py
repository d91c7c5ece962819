"""Every plot the platform draws: curves over optimizer steps, means with error bars along an axis, throughput bars,
and the one Amax-vs-layer plot (a run's diagnostics during training, `mhc compare`, the grouped report).

Figures use matplotlib's default style whatever the caller set (Optuna's plots switch the global style to ggplot) and
the Agg backend (no display needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional

DIRECTIONS = (("fwd", "forward"), ("bwd", "backward"))
STAT_STYLE = {"max": ("-o", "max over tokens"), "tokmean": ("--", "token-mean matrix")}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    plt = _pyplot()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _scale(ax, values: Sequence[float]) -> None:
    """Log when the values span more than a decade (HC blow-ups), else linear with 1.0 in view and no offset (mHC sits
    within 1e-6 of 1, which an offset axis would hide)."""
    pos = [v for v in values if v > 0]
    if pos and max(pos) / min(pos) > 10:
        ax.set_yscale("log")
    elif values:
        ax.set_ylim(min(0.9, min(values) - 0.05), max(1.1, max(values) + 0.05))
        ax.ticklabel_format(axis="y", useOffset=False)


def amax_vs_layer(
    series: Sequence[tuple[str, dict]],
    kinds: Sequence[str] = ("composite",),
    stats: Sequence[str] = ("max",),
    title: str = "",
    note: str = "",
):
    """Amax gain per sublayer l, one panel per kind (single H_res, composite product l..L-1) and direction, one colour
    per series (a run, or a group's mean), one line style per statistic. Returns the figure."""
    plt = _pyplot()
    from matplotlib.colors import to_rgba
    from matplotlib.ticker import MaxNLocator

    with plt.style.context("default"):
        panels = [(kind, d, word) for kind in kinds for d, word in DIRECTIONS]
        cols = 2
        rows = len(panels) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(12, 4.4 * rows), constrained_layout=True, squeeze=False)
        for ax, (kind, d, word) in zip(axes.flat, panels):
            values = []
            for i, (label, per_layer) in enumerate(series):
                for stat in stats:
                    ys = per_layer.get(f"{kind}_{d}_{stat}")
                    if not ys:
                        continue
                    style, what = STAT_STYLE[stat]
                    name = label if len(stats) == 1 else (f"{label} ({what})" if label else what)
                    # "C<i>" resolved here, in the default style: a "C<i>" string is looked up when the figure is
                    # drawn, which for this returned figure is after the style context, in whatever style the
                    # caller's process has (ggplot's colours after Optuna's plots)
                    ax.plot(range(len(ys)), ys, style, color=to_rgba(f"C{i}"), ms=3, lw=1.5, label=name)
                    values += list(ys)
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            _scale(ax, values)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            composite = " (product of H_res from l to the last sublayer)" if kind == "composite" else ""
            ax.set_xlabel("sublayer l" + composite)
            ax.set_ylabel("Amax gain")
            ax.set_title(f"{kind} H_res, {word}")
            ax.grid(alpha=0.3, which="both")
            if ax is axes.flat[len(panels) - 1]:
                ax.legend(fontsize=7, loc="best")
        if title or note:
            fig.suptitle("\n".join(x for x in (title, note) if x), fontsize=9 if note else 11)
    return fig


def diagnostics_figure(per_layer: dict, title: str):
    """A training run's own Amax-vs-layer figure (logged as diagnostics/amax_per_layer_step*.png)."""
    return amax_vs_layer([("", per_layer)], kinds=("single", "composite"), stats=("max", "tokmean"), title=title)


def composite_of(h_res_tokmean: Sequence) -> list:
    """The suffix products P_l = H_{L-1} ... H_l of a run's token-mean H_res matrices [L][n][n] (the reference op)."""
    import torch

    from ..kernels.reference import composite_products

    return composite_products(torch.tensor(h_res_tokmean, dtype=torch.float64)).tolist()


def _deviation_norm(devs):
    """The colour scale of the H_l − I rows, fitted to their range: linear over ±(largest deviation); symmetric-log
    when the runs' deviations span more than a decade (HC beside mHC), linear within the smallest run's, so that
    mHC's ≈ 0.02 is not one flat colour beside HC's units."""
    from matplotlib.colors import Normalize, SymLogNorm

    tops = [d for d in devs if d > 0]
    if not tops:
        return Normalize(-1.0, 1.0)  # every H_l is I (identity-HC): nothing to fit
    lo, hi = min(tops), max(tops)
    if hi / lo > 10:
        return SymLogNorm(linthresh=lo, vmin=-hi, vmax=hi)
    return Normalize(-hi, hi)


def h_res_heatmaps(series: Sequence[tuple[str, Sequence]], title: str = "", note: str = ""):
    """Every sublayer's n x n mixing matrix as a heatmap, two rows per series (a run): the token-mean H_l minus the
    identity, and the composite P_l = H_{L-1} ... H_l of those (what reaches the last sublayer from sublayer l).
    H_l − I has its own colour scale fitted to its range (_deviation_norm): near I, as mHC's H_res stays, a ±1 scale
    shows nothing. P_l keeps one scale linear within ±1 and logarithmic beyond (HC's composites reach hundreds;
    mHC's stay in [0, 1]). Each scale is shared by the whole figure, so that runs side by side compare cell by cell;
    each run's label gives its largest |H_l − I| entry. Returns the figure."""
    plt = _pyplot()
    import numpy as np
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize, SymLogNorm

    blocks = []
    for label, h in series:
        h = np.asarray(h, dtype=float)
        dev = h - np.eye(h.shape[-1])
        top = float(np.abs(dev).max())
        blocks.append(
            (
                f"{label}  (largest |H_l − I| entry: {top:.3g})".lstrip(),
                dev,
                top,
                np.asarray(composite_of(h), dtype=float),
            )
        )
    n_cols = max(len(dev) for _, dev, _, _ in blocks)
    dev_norm = _deviation_norm([top for _, _, top, _ in blocks])
    vmax = max(1.0, max(float(np.abs(p).max()) for _, _, _, p in blocks))
    p_norm = SymLogNorm(linthresh=1.0, vmin=-vmax, vmax=vmax) if vmax > 1 else Normalize(-1.0, 1.0)
    key = "H_l − I: token-mean H_res of sublayer l minus I; P_l = H_{L-1} ... H_l; entries: row = to, column = from"
    heading = "\n".join(x for x in (title, note, key) if x)
    # Laid out by hand, in inches: a grid of small matrices with a run's name above its two rows (constrained layout
    # collapsed such grids). Every matrix is `cell` inches square.
    cell, gap, left, right, label_h = 0.5, 0.08, 0.6, 1.5, 0.3
    top = 0.25 + 0.16 * heading.count("\n")
    run_h = label_h + 2 * cell + gap + 0.15  # name, H_l row (with l= titles), P_l row, space
    longest = max([len(label) for label, *_ in blocks] + [len(x) for x in heading.splitlines()])
    width = max(left + n_cols * (cell + gap), 0.058 * longest) + right  # ~0.058 inch a character at 8-9 pt
    height = top + 0.2 + len(blocks) * run_h + 0.45  # room below for the two colour bars' labels
    with plt.style.context("default"):
        fig = plt.figure(figsize=(width, height))
        W, H = fig.get_size_inches()

        def box(x, y, w, h):  # inches from the top left -> figure fraction
            return [x / W, 1 - (y + h) / H, w / W, h / H]

        for i, (label, dev, _, p) in enumerate(blocks):
            y0 = top + 0.2 + i * run_h
            fig.text(left / W, 1 - (y0 + 0.05) / H, label, fontsize=8, va="top")
            for r, (name, mats, norm) in enumerate((("H_l − I", dev, dev_norm), ("P_l", p, p_norm))):
                y = y0 + label_h + r * (cell + gap)
                for l, m in enumerate(mats):
                    ax = fig.add_axes(box(left + l * (cell + gap), y, cell, cell))
                    ax.imshow(m, cmap="RdBu_r", norm=norm)
                    ax.set_xticks([])
                    ax.set_yticks([])
                    if r == 0:
                        ax.set_title(f"l={l}", fontsize=6, pad=2)
                    if l == 0:
                        ax.set_ylabel(name, fontsize=8, rotation=0, ha="right", va="center")
        bar_h = height - top - 0.65
        for j, (norm, what) in enumerate(((dev_norm, "H_l − I"), (p_norm, "P_l"))):
            cax = fig.add_axes(box(W - right + 0.15 + j * 0.7, top + 0.2, 0.13, bar_h))
            bar = fig.colorbar(ScalarMappable(norm, "RdBu_r"), cax=cax)
            bar.ax.tick_params(labelsize=6)
            cax.set_xlabel(what, fontsize=7)
        fig.suptitle(heading, fontsize=9, y=1 - 0.08 / H, va="top")
    return fig


def curves(
    lines: Sequence[tuple[str, Sequence[int], Sequence[float], Optional[tuple]]],
    title: str,
    ylabel: str,
    path: Path,
    logy: bool = False,
) -> Optional[Path]:
    """Metric histories over optimizer steps: (label, steps, values, band or None); band = (low, high) per step.
    The first line is drawn on top, the last at the bottom: callers list the best run (or group) first, and a later
    run whose curve matches it (two configurations that train alike) must not hide it."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    if not lines:
        return None
    with plt.style.context("default"):
        fig, ax = plt.subplots(figsize=(9, 5), constrained_layout=True)
        for i, (label, steps, values, band) in enumerate(lines):
            ax.plot(
                steps,
                values,
                marker="o" if len(steps) < 12 else None,
                ms=3,
                lw=1.5,
                label=label,
                zorder=2 + len(lines) - i,
            )  # lines default to zorder 2, the bands (1) stay below them
            if band is not None:
                ax.fill_between(steps, band[0], band[1], alpha=0.2)
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _finish(ax, title, ylabel, logy)
        return save(fig, path)


def errorbars(
    series: dict[str, list[tuple[float, float, float]]], xlabel: str, ylabel: str, path: Path, logy: bool = False
) -> Path:
    """One line per series of (x, mean, std) points, std as error bars."""
    plt = _pyplot()
    with plt.style.context("default"):
        fig, ax = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
        for name, pts in series.items():
            xs, ms, ss = zip(*sorted(pts)) if pts else ((), (), ())
            ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, label=str(name))
        ax.set_xlabel(xlabel)
        _finish(ax, "", ylabel, logy)
        return save(fig, path)


def lr_sensitivity(
    panels: dict[str, dict[str, list[tuple[float, float, float, bool]]]], ylabel: str, ceiling: float, path: Path
) -> Path:
    """One panel per title, one line per series of (lr, mean, std, diverged) points on a log lr axis; a point where
    a run diverged is drawn as an x at `ceiling` (its value would flatten every other line)."""
    plt = _pyplot()
    with plt.style.context("default"):
        fig, axes = plt.subplots(
            1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False, constrained_layout=True, sharey=True
        )
        for ax, (title, series) in zip(axes[0], panels.items()):
            for i, (name, pts) in enumerate(series.items()):
                colour = f"C{i}"
                ok = sorted((x, m, s) for x, m, s, bad in pts if not bad)
                if ok:
                    xs, ms, ss = zip(*ok)
                    ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, color=colour, label=str(name))
                bad = [x for x, _, _, b in pts if b]
                if bad:
                    ax.scatter(
                        bad, [ceiling] * len(bad), marker="x", s=60, color=colour, label=None if ok else str(name)
                    )
            ax.set_xscale("log")
            ax.set_xlabel("learning rate")
            ax.axhline(ceiling, color="grey", lw=0.8, ls=":")
            _finish(ax, title, ylabel, False)
        return save(fig, path)


def throughput(bars: Sequence[tuple[str, float, tuple[float, float]]], path: Path) -> Optional[Path]:
    """Horizontal bars: (label, median tokens/s, (below, above) interquartile distances)."""
    plt = _pyplot()
    if not bars:
        return None
    with plt.style.context("default"):
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(bars) + 1.6), constrained_layout=True)
        labels, vals, errs = zip(*bars)
        ax.barh(range(len(bars)), vals, xerr=list(zip(*errs)), color="tab:blue", alpha=0.8, capsize=3)
        ax.set_yticks(range(len(bars)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("training tokens / s (median over steps, bars = interquartile range)")
        ax.set_title("throughput")
        ax.grid(alpha=0.3, axis="x")
        return save(fig, path)


def _finish(ax, title: str, ylabel: str, logy: bool) -> None:
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="best")
