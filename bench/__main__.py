"""python -m bench NAME [options]: run one benchmark; python -m bench --help lists them.

Each benchmark is the module bench/NAME.py with a `main(argv)`; every one writes the JSON layout of bench/harness.py.
Without a GPU the fused Triton kernels run under Triton's interpreter, chosen here before anything imports triton.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from pathlib import Path

BENCHMARKS = (
    "trainer",
    "curve",
    "stack",
    "host",
    "traffic",
    "resources",
    "callbacks",
    "diagnostics",
    "recompute",
    "data",
)


def summary(name: str) -> str:
    """The first line of the benchmark's module docstring, read without importing it (torch imports take seconds)."""
    source = (Path(__file__).parent / f"{name}.py").read_text()
    return (ast.get_docstring(ast.parse(source)) or "").splitlines()[0]


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [f"  {name.ljust(width)}  {summary(name)}" for name in BENCHMARKS]
    return (
        "usage: python -m bench NAME [options]   (python -m bench NAME --help: its options)\n\nbenchmarks:\n"
        + "\n".join(lines)
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"python -m bench: unknown benchmark {name!r}; allowed: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    module = importlib.import_module(f"bench.{name}")
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
