"""What every benchmark of `python -m bench` shares: timing, the environment a result was measured in, and the one
JSON layout each writes, `{"benchmark", "env", "args", "rows": [...]}`, with its table printed."""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]


# ---- arguments -------------------------------------------------------------------------------------------------
def parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The benchmark's parser, with the --out every benchmark takes; its description is the module docstring."""
    p = argparse.ArgumentParser(prog=f"python -m bench {name}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, metavar="JSON",
                   help=f"where the JSON goes (default: $OUT/{name}.json if OUT is set, else out/bench/{name}.json)")
    return p


def out_path(name: str, out: Optional[str]) -> Path:
    if out:
        return Path(out)
    return Path(os.environ["OUT"]) / f"{name}.json" if os.environ.get("OUT") else Path("out") / "bench" / f"{name}.json"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- timing ----------------------------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], Any], iters: int, warmup: int, device: str) -> float:
    """Median ms per call of fn after `warmup` calls: CUDA events around each call on a GPU (the device's time, however
    early the host returns), perf_counter on the CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def host_ms(fn: Callable[[], Any], iters: int, device: str) -> float:
    """Median ms the host needs to issue fn, the device idle at each start: near a GPU step's time, the GPU waits."""
    times = []
    for _ in range(iters):
        sync(device)
        t = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t))
    sync(device)
    return statistics.median(times)


# ---- environment -----------------------------------------------------------------------------------------------
def _version(dist: str) -> Optional[str]:
    # from the installed metadata: importing triton or lightning here would fix the Triton interpreter's mode early
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> Optional[str]:
    try:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment(device: str) -> dict:
    """Where and with what a result was measured: date, host, device, versions, the tree's commit and whether it had
    uncommitted changes, and the environment variables that change what runs."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(), "cpus": os.cpu_count(), "device": device,
        "python": platform.python_version(), "torch": torch.__version__, "triton": _version("triton"),
        "lightning": _version("lightning"), "git_commit": commit, "git_dirty": None if status is None else bool(status),
        "variables": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM_"))
                      or k in ("MHC_KERNEL_CONFIG", "TRITON_INTERPRET")},
    }
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(), cuda=torch.version.cuda,
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    else:
        env["gpu"] = None
    return env


# ---- the JSON and the table ------------------------------------------------------------------------------------
def _plain(value):
    """JSON for argparse values (paths, dicts of them)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


class Report:
    """One benchmark run's JSON, rewritten after every row: a run cut short by a time limit still leaves its rows."""

    def __init__(self, benchmark: str, args: argparse.Namespace, argv: Sequence[str], device: str):
        self.path = out_path(benchmark, getattr(args, "out", None))
        env = environment(device)
        env["command"] = shlex.join(["python", "-m", "bench", benchmark, *argv])
        self.data = {"benchmark": benchmark, "env": env, "args": _plain(vars(args)), "rows": []}

    @property
    def env(self) -> dict:
        return self.data["env"]

    @property
    def rows(self) -> list:
        return self.data["rows"]

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        self.save()
        return row

    def save(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))
        return self.path


def print_table(rows: Iterable[dict], columns: Sequence[tuple[str, str, str]], file=None) -> None:
    """rows as a fixed-width table; columns are (key, header, format spec); a missing value prints as "-"."""
    def cell(row, key, fmt):
        value = row.get(key)
        if value is None:
            return "-"
        try:
            return format(value, fmt)
        except (TypeError, ValueError):
            return str(value)

    body = [[cell(r, key, fmt) for key, _, fmt in columns] for r in rows]
    widths = [max([len(h)] + [len(line[i]) for line in body]) for i, (_, h, _) in enumerate(columns)]
    out = file or sys.stdout

    def line(cells):
        first = cells[0].ljust(widths[0])
        return "  ".join([first] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])])

    print(line([h for _, h, _ in columns]), file=out)
    for cells in body:
        print(line(cells), file=out)
    out.flush()
