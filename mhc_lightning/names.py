"""Names that become file or folder names: a sweep's study name (sweep_logs/<study>/), a grid's run names (their log
files in grid_logs/). A name holding `../` or a slash would write outside the folder it is meant for, so names chosen
by the user are refused with the reason (`path_name_problem`), and names put together from values (a grid axis over
corpus paths) are turned into one safe file name (`file_name`).
"""

from __future__ import annotations

import re
from typing import Optional

_UNSAFE = re.compile(r"[/\\\x00-\x1f\x7f]")
ALLOWED = "any characters but '/', '\\' and control characters, and not '.' or '..'"
FILE_NAME_MAX = 255  # bytes in one file or folder name (NAME_MAX of Linux and macOS file systems)
RUN_NAME_MAX = 250  # characters in an MLflow run name (its tracking stores' column)


def _short(name: str) -> str:
    return repr(name if len(name) <= 40 else f"{name[:30]}...{name[-6:]}")


def path_name_problem(name, suffix: str = "") -> Optional[str]:
    """Why `name` (+ `suffix`, e.g. '.log') cannot name a file or folder inside another one, or None when it can."""
    if not isinstance(name, str) or not name:
        return f"must be a non-empty string, got {name!r}"
    if name in (".", "..") or _UNSAFE.search(name):
        return f"{name!r} cannot be a file or folder name ({ALLOWED})"
    size = len((name + suffix).encode(errors="surrogateescape"))
    if size > FILE_NAME_MAX:
        return (
            f"{_short(name)} is too long for a file name: {size} bytes{f' with {suffix!r}' if suffix else ''}, "
            f"at most {FILE_NAME_MAX}"
        )
    return None


def run_name_problem(name: str, what: str = "") -> Optional[str]:
    """Why `name` cannot be an MLflow run name (too long), or None; `what`: how the name is made, for the message."""
    if len(name) > RUN_NAME_MAX:
        return (
            f"{_short(name)} is too long for an MLflow run name{what}: {len(name)} characters, at most {RUN_NAME_MAX}"
        )
    return None


def file_name(name: str) -> str:
    """`name` as one file name in its folder: separators and control characters become '_', a leading '.' too."""
    safe = _UNSAFE.sub("_", name)
    return "_" + safe[1:] if safe.startswith(".") else safe or "_"
