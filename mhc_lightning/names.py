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


def path_name_problem(name) -> Optional[str]:
    """Why `name` cannot name a file or folder inside another one, or None when it can."""
    if not isinstance(name, str) or not name:
        return f"must be a non-empty string, got {name!r}"
    if name in (".", "..") or _UNSAFE.search(name):
        return f"{name!r} cannot be a file or folder name ({ALLOWED})"
    return None


def file_name(name: str) -> str:
    """`name` as one file name in its folder: separators and control characters become '_', a leading '.' too."""
    safe = _UNSAFE.sub("_", name)
    return "_" + safe[1:] if safe.startswith(".") else safe or "_"
