"""The package's layout: no import cycles between its modules, imports that go one way only (docs/design.md §14),
module names that say one thing, every module imports in a fresh interpreter, no private Optuna API in the sweeps, no
citation of documents that are not in the repository."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from collections import defaultdict
from pathlib import Path

import pytest
from helpers import REPO, fast_first, tiny_fit

# source folder -> the package name it is imported as (kernels/ is installed as mhc_lightning.kernels)
ROOTS = {REPO / "mhc_lightning": "mhc_lightning", REPO / "kernels": "mhc_lightning.kernels"}


def modules() -> dict[str, Path]:
    out = {}
    for root, package in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            if not name.startswith("mhc_lightning.kernels") or package == "mhc_lightning.kernels":
                out[name] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that `name` imports, anywhere in the file (a function-level import is a dependency
    too); a package's own submodules importing it implicitly do not count."""
    is_pkg = path.name == "__init__.py"
    base = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                mod = f"{pkg}.{node.module}" if node.module else pkg
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = import_graph()
    assert graph["mhc_lightning.reports.compare"] >= {"mhc_lightning.reports.runs", "mhc_lightning.reports.plots"}
    assert cycles(graph) == []


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def within(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


# package -> the packages above it, which it must not import (docs/design.md §14); each package may import what is
# below it and the shared basics at the top level (errors, files, names, provenance)
ABOVE = {
    # the training core: LitLM and all it imports. What a run logs beyond metrics (per-layer artifacts, stability
    # events) is a callback's job, never the module's.
    "mhc_lightning.training": (
        "mhc_lightning.callbacks",
        "mhc_lightning.loggers",
        "mhc_lightning.reports",
        "mhc_lightning.data",
        "mhc_lightning.fit",
        "mhc_lightning.grids",
        "mhc_lightning.sweeps",
        "mhc_lightning.commands",
    ),
    "mhc_lightning.callbacks": (
        "mhc_lightning.fit",
        "mhc_lightning.grids",
        "mhc_lightning.sweeps",
        "mhc_lightning.commands",
    ),
    # `mhc fit` itself: the tools that start fits (grids, sweeps) and the reports sit above it
    "mhc_lightning.fit": ("mhc_lightning.grids", "mhc_lightning.sweeps", "mhc_lightning.reports"),
    "mhc_lightning.grids": ("mhc_lightning.sweeps", "mhc_lightning.reports"),
    "mhc_lightning.sweeps": ("mhc_lightning.grids",),
}
# the reports' figures, drawn for a callback too (callbacks/per_layer_artifacts.py): below the callbacks
SHARED = {"mhc_lightning.reports.plots"}


def test_packages_import_nothing_above_them():
    """Every module of a package and all it imports, directly or through others (one test, so that every rule
    runs in the fast tier)."""
    graph = import_graph()
    assert set(ABOVE) <= set(graph)
    upward = {
        f"{name} imports {dep}"
        for package, above in ABOVE.items()
        for name in graph
        if within(name, package)
        for dep in reachable(graph, name)
        if within(dep, *above) and dep not in SHARED
    }
    assert sorted(upward) == []


def test_the_training_core_stays_below_the_cli():
    """LitLM in particular: the rule above names it, and the CLI does import it."""
    graph = import_graph()
    assert "mhc_lightning.training.module" in reachable(graph, "mhc_lightning.fit.cli")
    assert not any(within(m, "mhc_lightning.fit") for m in reachable(graph, "mhc_lightning.training.module"))


# What the package's top level holds: the `mhc` dispatcher (the console script), the shared basics every layer may
# use, and the packages, each named for what it does (docs/design.md §14). Anything else belongs in a package.
TOP_LEVEL_MODULES = {"__init__", "commands", "errors", "files", "names", "provenance"}
PACKAGES = {"callbacks", "data", "fit", "grids", "loggers", "model", "reports", "sweeps", "training"}


def test_the_top_level_holds_only_the_entry_point_and_shared_basics():
    root = REPO / "mhc_lightning"
    assert {p.stem for p in root.glob("*.py")} == TOP_LEVEL_MODULES
    packages = {p.parent.name for p in root.glob("*/__init__.py")}
    assert packages == PACKAGES
    stray = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in PACKAGES | {"__pycache__"})
    assert stray == []
    for name in PACKAGES:  # each says what it is for in its docstring
        doc = ast.get_docstring(ast.parse((root / name / "__init__.py").read_text()))
        assert doc, name


def test_a_checkpoint_names_no_module_of_the_package(tiny_corpus, tmp_path):
    """A checkpoint holds tensors and plain values (LitLM's hyperparameters as dicts, each callback's state under its
    class name, the MLflow run's ids as strings): it loads with weights_only=True, as Lightning loads it, and no
    module path of the package is in it, so a module that moves to another package leaves every checkpoint loadable."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    from mhc_lightning.callbacks import GradientSnapshots, InstabilityDetector, SinkhornScheduler
    from mhc_lightning.callbacks.graceful_stop import GracefulStop

    callbacks = [InstabilityDetector(), GradientSnapshots(every_n_steps=1), SinkhornScheduler(every=1), GracefulStop()]
    trainer, _ = tiny_fit(tiny_corpus, callbacks, steps=2)
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    assert get_unsafe_globals_in_checkpoint(ckpt) == []
    with zipfile.ZipFile(ckpt) as archive:
        (pickle,) = [name for name in archive.namelist() if name.endswith("/data.pkl")]
        assert b"mhc_lightning" not in archive.read(pickle)


def external_imports(path: Path) -> set[str]:
    """Top-level names of the absolute imports in a file (relative imports are the package's own)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add((node.module or "").partition(".")[0])
    return out - {"__future__"}


@fast_first(
    "package, allowed_inside, allowed_outside",
    [
        # the model: plain nn.Modules over the kernels, usable without Lightning, MLflow or the rest of the package
        ("mhc_lightning.model", ("mhc_lightning.model", "mhc_lightning.kernels"), {"torch"}),
        # the kernels: the reference ops and the fused Triton kernels, below everything else
        ("mhc_lightning.kernels", ("mhc_lightning.kernels",), {"torch", "triton"}),
    ],
)
def test_lower_layers_import_only_what_is_below_them(package, allowed_inside, allowed_outside):
    graph, mods = import_graph(), modules()
    inside = {
        f"{name} imports {dep}"
        for name in graph
        if within(name, package)
        for dep in graph[name]
        if not within(dep, *allowed_inside)
    }
    outside = {
        f"{name} imports {top}"
        for name, path in mods.items()
        if within(name, package)
        for top in external_imports(path) - allowed_outside - set(sys.stdlib_module_names)
    }
    assert sorted(inside | outside) == []


# Module names that may repeat, because each copy is the same job in another place: every command's argparse front
# end is its package's cli.py; the fused kernels mirror the reference ops file by file.
REPEATABLE = {"cli"}
# a reference op and its fused kernels share a stem: shared parts in kernels.fused, one module per op in fused.ops
MIRRORS = (
    ("mhc_lightning.kernels.fused", "mhc_lightning.kernels.reference"),
    ("mhc_lightning.kernels.fused.ops", "mhc_lightning.kernels.reference"),
)


def test_module_names_say_one_thing():
    """No two unrelated modules share a name (there were three called launch and two called preflight)."""
    by_stem = defaultdict(list)
    for name, path in modules().items():
        if path.name not in ("__init__.py", "__main__.py"):
            package, _, stem = name.rpartition(".")
            by_stem[stem].append(package)
    repeated = {
        stem: packages
        for stem, packages in by_stem.items()
        if len(packages) > 1 and stem not in REPEATABLE and tuple(sorted(packages)) not in MIRRORS
    }
    assert repeated == {}


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.slow
def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(n for n in modules() if not n.endswith("__main__"))
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    res = subprocess.run(
        [sys.executable, "-c", code, *names],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "TRITON_INTERPRET": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]


def test_sweeps_use_no_private_optuna_api():
    private = re.compile(r"\._storage\b|\._trial_id\b|\._study_id\b|optuna\.[a-z_.]*\._[a-z]")
    hits = [
        f"{p.name}:{i + 1}"
        for p in (REPO / "mhc_lightning" / "sweeps").glob("*.py")
        for i, line in enumerate(p.read_text().splitlines())
        if private.search(line)
    ]
    assert hits == []


OWNED_TEXT = [
    "mhc_lightning/sweeps",
    "mhc_lightning/reports",
    "mhc_lightning/loggers",
    "mhc_lightning/callbacks/snapshots.py",
    "mhc_lightning/callbacks/snapshot_state.py",
    "mhc_lightning/callbacks/snapshot_files.py",
    "mhc_lightning/callbacks/rank_consistency.py",
    "mhc_lightning/fit/child_processes.py",
    "mhc_lightning/grids/cli.py",
    "mhc_lightning/fit/resume.py",
    "mhc_lightning/training/distributed.py",
    "conf",
    "sweeps",
    "docs/sweeps.md",
    "docs/stability.md",
    "docs/distributed.md",
]


def test_no_citations_of_documents_outside_the_repo():
    bad = re.compile(r"mhc-math|ecosystem-notes")
    files = [
        f
        for entry in OWNED_TEXT
        for f in ([REPO / entry] if (REPO / entry).is_file() else (REPO / entry).rglob("*"))
        if f.is_file() and f.suffix in (".py", ".md", ".yaml")
    ]
    hits = [
        f"{f.relative_to(REPO)}:{i + 1}"
        for f in files
        for i, line in enumerate(f.read_text().splitlines())
        if bad.search(line)
    ]
    assert hits == []
