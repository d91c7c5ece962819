"""What every benchmark of `python -m bench` shares: timing, the environment a result was measured in, and the one
JSON layout each writes, `{"benchmark", "env", "args", "rows": [...]}`, with its table printed."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from mhc_lightning.provenance import code_state
from mhc_lightning.provenance import environment as software

REPO = Path(__file__).resolve().parents[1]


# ---- arguments -------------------------------------------------------------------------------------------------
def parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The benchmark's parser, with the --out every benchmark takes; its description is the module docstring."""
    p = argparse.ArgumentParser(
        prog=f"python -m bench {name}", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="JSON",
        help=f"where the JSON goes (default: $OUT/{name}.json if OUT is set, else out/bench/{name}.json)",
    )
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
def environment(device: str) -> dict:
    """Where and with what a result was measured: date, host, device, the versions and code a run records
    (mhc_lightning/provenance.py: commit, dirty flag, digest of the uncommitted change), and the environment variables
    that change what runs."""
    code = code_state()
    cuda = torch.device("cuda", 0) if torch.cuda.is_available() else None
    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "device": device,
        **software(cuda),
        "git_commit": code.commit,
        "git_dirty": code.dirty,
        "git_diff_sha256": code.diff_sha256,
        "variables": {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM_")) or k in ("MHC_KERNEL_CONFIG", "TRITON_INTERPRET")
        },
    }
    if cuda is None:
        env["gpu"] = None
    else:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
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
