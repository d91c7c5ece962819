"""Learning-rate sensitivity from a grid that scans `model.optim.lr` (conf/experiments/lr_scan_grid.yaml): each
variant at its own best learning rate, the highest learning rate at which it still trains, and the curves of final
val bits/byte against the learning rate with divergence marked (the small-scale stability proxy of Wortsman et al.
2023, "Small-scale proxies for large-scale Transformer training instabilities").
"""

from __future__ import annotations

import math
import statistics as st
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from . import plots
from .tables import frame

LR_KEY = "model.optim.lr"
# A byte-level model at or above 6 bits/byte has not even learned the byte frequencies (English text's unigram
# entropy is about 4.5 bits/byte; uniform bytes are 8): it diverged, or never trained.
DIVERGED_BPB = 6.0


def diverged(val_bpb: float) -> bool:
    return not math.isfinite(val_bpb) or val_bpb >= DIVERGED_BPB


def _points(groups: dict[tuple, list], keys: list[str], value: Callable) -> dict[tuple, dict[float, list[float]]]:
    """(variant, *other keys but lr) -> lr -> the runs' values."""
    at = keys.index(LR_KEY)
    out: dict[tuple, dict[float, list[float]]] = {}
    for gk, runs in groups.items():
        rest = tuple(x for i, x in enumerate(gk) if i != at)
        out.setdefault(rest, {})[float(gk[at])] = [value(d) for d in runs]
    return out


def _best_lr(by_lr: dict[float, list[float]]) -> Optional[float]:
    trained = {lr: vals for lr, vals in by_lr.items() if not any(diverged(v) for v in vals)}
    return min(trained, key=lambda lr: st.fmean(trained[lr])) if trained else None


def at_best_lr(groups: dict[tuple, list], keys: list[str], value: Callable) -> tuple[dict[tuple, list], list[str]]:
    """The groups without the lr key, each holding the runs of its best lr (none: the group is left out)."""
    at = keys.index(LR_KEY)
    best = {rest: _best_lr(by_lr) for rest, by_lr in _points(groups, keys, value).items()}
    chosen = {}
    for gk, runs in groups.items():
        rest = tuple(x for i, x in enumerate(gk) if i != at)
        if best.get(rest) is not None and float(gk[at]) == best[rest]:
            chosen[rest] = runs
    return chosen, [k for k in keys if k != LR_KEY]


def lr_table(groups: dict[tuple, list], keys: list[str], value: Callable):
    """One row per variant (and other keys): the best lr among those where no run diverged, the val bits/byte there,
    the highest lr at which every run trained, and the lrs where some run diverged."""
    rest_keys = [k for k in keys if k != LR_KEY]
    rows = []
    for rest, by_lr in _points(groups, keys, value).items():
        trained = {lr: vals for lr, vals in by_lr.items() if not any(diverged(v) for v in vals)}
        best = _best_lr(by_lr)
        vals = trained.get(best, [])
        spread = st.stdev(vals) if len(vals) > 1 else 0.0
        rows.append(
            {
                **{k: str(v) for k, v in zip(rest_keys, rest)},
                "best lr": f"{best:g}" if best is not None else "–",
                "val bits/byte at best lr": f"{st.fmean(vals):.4f} ± {spread:.4f}" if vals else "–",
                "runs at best lr": str(len(vals)),
                "highest lr that trains": f"{max(trained):g}" if trained else "none",
                "diverged at": ", ".join(f"{lr:g}" for lr in sorted(set(by_lr) - set(trained))) or "–",
                "best lr is an end of the scan": "yes" if best in (min(by_lr), max(by_lr)) else "no",
            }
        )
    return frame(rows)


def lr_figure(groups: dict[tuple, list], keys: list[str], value: Callable, path: Path) -> Optional[Path]:
    """Final val bits/byte against lr, one panel per value of the other keys (depth), one line per variant."""
    rest_keys = [k for k in keys if k != LR_KEY]
    panels: dict[str, dict[str, list]] = {}
    for rest, by_lr in _points(groups, keys, value).items():
        title = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(rest_keys[1:], rest[1:]))
        series = panels.setdefault(title, {}).setdefault(str(rest[0]), [])
        for lr, vals in by_lr.items():
            ok = [v for v in vals if not diverged(v)]
            series.append(
                (lr, st.fmean(ok) if ok else math.nan, st.stdev(ok) if len(ok) > 1 else 0.0, len(ok) < len(vals))
            )
    if not panels:
        return None
    return plots.lr_sensitivity(panels, "final val bits/byte (mean ± std over seeds)", DIVERGED_BPB, path)
