"""The one table writer: a pandas DataFrame to CSV (full precision) and to a markdown table (values formatted)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Optional


def fmt(v) -> str:
    """4 significant digits for floats (and float-looking strings), plain text otherwise; blanks for missing."""
    if v is None or (isinstance(v, float) and v != v):
        return ""
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


def markdown(df, formatter: Callable = fmt, hidden: tuple[str, ...] = ()) -> str:
    cols = [c for c in df.columns if c not in hidden]
    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(formatter(row[c]) for c in cols) + " |" for _, row in df.iterrows()]
    return "\n".join(lines) + "\n"


def write_table(
    df, out: Path, stem: str, md_df=None, hidden: tuple[str, ...] = (), formatter: Callable = fmt
) -> tuple[Path, Path]:
    """<stem>.csv from `df`; <stem>.md from `md_df` (default: `df`) without the `hidden` columns, each cell through
    `formatter` (str: cells that are formatted text already)."""
    out.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out / f"{stem}.csv", out / f"{stem}.md"
    df.to_csv(csv_path, index=False)
    md_path.write_text(markdown(df if md_df is None else md_df, formatter=formatter, hidden=hidden))
    return md_path, csv_path


def frame(rows: list[dict], columns: Optional[list[str]] = None):
    """A DataFrame of dict rows, columns in first-seen order; missing cells blank."""
    import pandas as pd

    cols = columns or list(dict.fromkeys(k for r in rows for k in r))
    return pd.DataFrame([{c: r.get(c, "") for c in cols} for r in rows], columns=cols)
