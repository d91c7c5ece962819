"""Lightning callbacks that `python -m bench trainer` loads into its `mhc fit` processes (the repo root on their
PYTHONPATH): step times and phases (`Throughput`), and a profiled run's kernels and idle gaps (`ProfileSteps`)."""

from __future__ import annotations

import gc
import json
import statistics
import time
import traceback
import warnings
from pathlib import Path
from typing import Optional

import lightning as L
import torch

from bench.profiling import idle_gaps, time_per_name

try:
    import resource
except ImportError:  # not on Windows
    resource = None

# The points of a step where Throughput marks host and device time; a phase runs from one mark to the next.
PHASE_MARKS = ("batch_start", "before_backward", "after_backward", "batch_end")
PHASES = ("forward", "backward", "optimizer", "between_steps")


def preemptions() -> Optional[int]:
    """Involuntary context switches of the calling thread so far (Linux), else None."""
    who = getattr(resource, "RUSAGE_THREAD", None) if resource is not None else None
    return None if who is None else resource.getrusage(who).ru_nivcsw


class Throughput(L.Callback):
    """Step times after `warmup` optimizer steps; rank 0 writes them (and tokens/s of the global batch) to `out`.

    On CUDA: one event recorded at every step end, read after training, so the timed window has no host sync.
    Also per phase (forward + loss, backward, clipping + optimizer, Lightning's loop between steps): the host's time
    to issue it (perf_counter between hooks) beside the device's time for it (events at the same hooks). Where the
    host needs longer than the device, the device waits (unless it still has earlier work queued). Beside the host's
    wall time, the main thread's CPU time per phase and its involuntary context switches per step (Linux): wall well
    above CPU time with many switches means the thread was preempted (a busy host); wall close to CPU time means the
    thread ran the whole phase. And Python's cyclic garbage collections in the timed steps, by generation, with their
    time: a full collection of a large heap stalls the host (and a host-bound step with it). Per step too
    (`phase_steps`, gc's `ms_per_step`), so that a bimodal run can be attributed step by step.
    """

    def __init__(self, warmup: int, out: str):
        self.warmup, self.out = warmup, out
        self.events: list = []
        self.walls: list[float] = []
        self.tokens_per_step = 0
        self.marks: list[dict] = []  # per timed step: mark -> (perf_counter, event | None, thread CPU s, switches)
        self.gc_events: list[tuple[int, int, float]] = []  # (timed step, generation, ms)
        self._gc_t0 = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self.marks:
            self.gc_events.append((len(self.marks) - 1, info["generation"], 1e3 * (time.perf_counter() - self._gc_t0)))

    def _mark(self, trainer, pl_module, name: str) -> None:
        if trainer.global_step < self.warmup:
            return
        if name == "batch_start":
            if not self.marks:
                gc.callbacks.append(self._on_gc)
            self.marks.append({})
        if not self.marks:
            return
        ev = None
        if pl_module.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.marks[-1][name] = (time.perf_counter(), ev, time.thread_time(), preemptions())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._mark(trainer, pl_module, "batch_start")

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._mark(trainer, pl_module, "before_backward")

    def on_after_backward(self, trainer, pl_module) -> None:
        self._mark(trainer, pl_module, "after_backward")

    def phase_ms(self) -> tuple[dict, dict]:
        """Median host ms (wall and the main thread's CPU) and device ms per phase over the timed steps (after the
        events have completed), and the same per step."""
        host: dict = {k: [] for k in PHASES}
        cpu: dict = {k: [] for k in PHASES}
        dev: dict = {k: [] for k in PHASES}
        for m, nxt in zip(self.marks, self.marks[1:]):
            if not all(k in m for k in PHASE_MARKS) or "batch_start" not in nxt:
                continue
            points = [m[k] for k in PHASE_MARKS] + [nxt["batch_start"]]
            for name, (a, b) in zip(PHASES, zip(points, points[1:])):
                host[name].append(1e3 * (b[0] - a[0]))
                cpu[name].append(1e3 * (b[2] - a[2]))
                if a[1] is not None:
                    dev[name].append(a[1].elapsed_time(b[1]))
        med = lambda v: statistics.median(v) if v else None  # noqa: E731
        return (
            {
                name: {"host_ms": med(host[name]), "host_cpu_ms": med(cpu[name]), "device_ms": med(dev[name])}
                for name in PHASES
            },
            {name: {"host_ms": host[name], "device_ms": dev[name] or None} for name in PHASES},
        )

    def gc_record(self) -> dict:
        """The timed steps' collections: count and ms by generation, the longest, and ms per step."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        per_step = [0.0] * len(self.marks)
        by_gen: dict = {}
        for step, gen, ms in self.gc_events:
            per_step[step] += ms
            n, total = by_gen.get(str(gen), (0, 0.0))
            by_gen[str(gen)] = (n + 1, total + ms)
        return {
            "collections": {g: n for g, (n, _) in by_gen.items()},
            "ms": {g: t for g, (_, t) in by_gen.items()},
            "longest_ms": max((ms for _, _, ms in self.gc_events), default=0.0),
            "ms_per_step": per_step,
        }

    def preempted_per_step(self) -> Optional[float]:
        """Median involuntary context switches of the main thread per timed step (None where not counted)."""
        steps = [
            nxt["batch_start"][3] - m["batch_start"][3]
            for m, nxt in zip(self.marks, self.marks[1:])
            if "batch_start" in m and "batch_start" in nxt and m["batch_start"][3] is not None
        ]
        return statistics.median(steps) if steps else None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # optimizer steps done, this one included
        if step < self.warmup:
            return
        self._mark(trainer, pl_module, "batch_end")
        if step == self.warmup:
            self.tokens_per_step = batch[0].numel() * trainer.world_size
        if pl_module.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events.append(ev)
        self.walls.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        cuda = pl_module.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]
        else:
            times = [1e3 * (b - a) for a, b in zip(self.walls, self.walls[1:])]
        collections = self.gc_record()
        if trainer.global_rank != 0 or not times:
            return
        phases, phase_steps = self.phase_ms()
        mean = sum(times) / len(times)
        med = statistics.median(times)
        cfg = pl_module.arch
        record = {
            "mode": cfg.hyper.residual_mode,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "precision": str(trainer.precision),
            "kernel_backend": cfg.hyper.kernel_backend,
            "d_model": cfg.d_model,
            "n_layers": cfg.n_layers,
            "params": sum(p.numel() for p in pl_module.parameters()),
            "tokens_per_step": self.tokens_per_step,
            "timed_steps": len(times),
            "step_ms_mean": mean,
            "step_ms_median": med,
            "step_ms_min": min(times),
            "step_ms_max": max(times),
            "tokens_per_s": self.tokens_per_step / (mean / 1e3),
            "tokens_per_s_median_step": self.tokens_per_step / (med / 1e3),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "phases": phases,
            "phase_steps": phase_steps,
            "gc": collections,
            "preempted_per_step": self.preempted_per_step(),
            "step_ms": times,
        }
        Path(self.out).write_text(json.dumps(record, indent=1))


class SyncFinder:
    """While on: every synchronizing CUDA call (torch.cuda.set_sync_debug_mode) counted by the Python stack that made
    it. A sync inside a step makes the host wait for the GPU; the next work then starts on an idle GPU."""

    def __init__(self):
        self.stacks: dict[str, int] = {}
        self._warnings = None

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        stack = "".join(traceback.format_stack(limit=14)[:-2])
        if "set_sync_debug_mode" not in stack:  # not the switch itself
            self.stacks[stack] = self.stacks.get(stack, 0) + 1

    def start(self) -> None:
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self, steps: int) -> list[dict]:
        torch.cuda.set_sync_debug_mode(0)
        self._warnings.__exit__(None, None, None)
        return [{"per_step": c / steps, "stack": s} for s, c in sorted(self.stacks.items(), key=lambda kv: -kv[1])]


class ProfileSteps(L.Callback):
    """torch.profiler over `steps` optimizer steps after `warmup` (rank 0): device time per kernel, and the steps'
    wall time beside the sum of their kernels — the gap is time the GPU waited on the host. Its own run: a profiled
    step is slower than a timed one."""

    def __init__(self, warmup: int, steps: int, out: str):
        self.warmup, self.steps, self.out = warmup, steps, out
        self.prof = None
        self.syncs: Optional[SyncFinder] = None
        self.t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup and self.prof is None and trainer.global_rank == 0:
            from torch.profiler import ProfilerActivity, profile

            cuda = pl_module.device.type == "cuda"
            if cuda:
                torch.cuda.synchronize()
            # host ops too on CUDA: the idle analysis charges each wait to the host op that launched the work after it
            self.prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            self.prof.__enter__()
            self.syncs = SyncFinder() if cuda else None
            if self.syncs:
                self.syncs.start()
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.prof is None or trainer.global_step != self.warmup + self.steps:
            return
        cuda = pl_module.device.type == "cuda"
        syncs = self.syncs.stop(self.steps) if self.syncs else None
        if cuda:
            torch.cuda.synchronize()
        wall_us = 1e6 * (time.perf_counter() - self.t0) / self.steps
        self.prof.__exit__(None, None, None)
        total, rows = time_per_name(self.prof, self.steps, device=cuda)
        record = {
            "steps": self.steps,
            "wall_us_per_step": wall_us,
            "busy_us_per_step": total,
            "device_time": cuda,
            "top": rows[:80],
        }
        if cuda:
            record["syncs"] = syncs
            _, host = time_per_name(self.prof, self.steps, device=False)
            record["host_top"] = host[:30]
            trace = Path(self.out).with_suffix(".trace.json")
            self.prof.export_chrome_trace(str(trace))
            record["idle"] = idle_gaps(json.loads(trace.read_text()), self.steps)
            trace.unlink()
        Path(self.out).write_text(json.dumps(record, indent=1))
        self.prof = None
