#!/usr/bin/env python3
"""DDP on GPUs through the platform itself: a correctness check, then scaling of residual and mHC training.

Every run is a real `mhc fit` (started as `python -m mhc_lightning.cli fit ...`, which Lightning's DDP launcher
re-executes once per extra rank) composed from the repo's presets: conf/machine/gpu.yaml for one GPU,
conf/machine/ddp.yaml for two, conf/machine/fsdp.yaml for the FSDP check. No downloads: the text is generated.

1. check (fp32, small mHC model with the fused kernels, corpus order, same global batch 8 everywhere):
   1 GPU vs DDP on 2 vs FSDP on 2 — per-step loss of the global batch, identical weights / optimizer state /
   diagnostics on every DDP rank, one MLflow run for the DDP fit (when mlflow is importable).
2. bench (bf16-mixed, C=1024, 12 blocks, B=8 per GPU, T=2048, kernel_backend auto = Triton on CUDA):
   steady-state tokens/s of residual and mHC on 1 and 2 GPUs, from CUDA events at every step end after warm-up
   (no extra synchronisation inside the timed window). Scaling efficiency = tok/s(2) / (2 x tok/s(1)).

    python bench/bench_ddp.py --out $OUT          # GPU machine with >= 2 GPUs, ~4-5 minutes
    python bench/bench_ddp.py --smoke             # CPU, gloo, tiny shapes: exercises every code path
Writes bench_ddp.json and bench_ddp_logs.txt (the runs' logs) to --out (default $OUT, else ./out/bench_ddp).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Optional

import lightning as L
import torch

from mhc_lightning.data.synthetic import english_like_text
from profiling import idle_gaps, print_rows, time_per_name

try:
    import resource
except ImportError:  # not on Windows
    resource = None

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
def make_corpus(path: Path, n_bytes: int, seed: int = 0) -> None:
    path.write_text(english_like_text(n_bytes, seed))


# ---- callbacks loaded inside the `mhc fit` processes (bench/ is on their PYTHONPATH) -------------------------
# The points of a step where Throughput marks host and device time; a phase runs from one mark to the next.
PHASE_MARKS = ("batch_start", "before_backward", "after_backward", "batch_end")
PHASES = ("forward", "backward", "optimizer", "between_steps")


def preemptions() -> Optional[int]:
    """Involuntary context switches of the calling thread so far (Linux), else None."""
    who = getattr(resource, "RUSAGE_THREAD", None) if resource is not None else None
    return None if who is None else resource.getrusage(who).ru_nivcsw


def launcher_misses() -> int:
    """Launches of the fused kernels that took Triton's own path so far (0 where the kernels are not loaded)."""
    launch = sys.modules.get("mhc_lightning.kernels.fused.launch_cache")
    return 0 if launch is None else launch.Launcher.misses


class Throughput(L.Callback):
    """Step times after `warmup` optimizer steps; rank 0 writes them (and tokens/s of the global batch) to `out`.

    On CUDA: one event recorded at every step end, read after training, so the timed window has no host sync.
    Also per phase (forward + loss, backward, clipping + optimizer, Lightning's loop between steps): the host's time
    to issue it (perf_counter between hooks) beside the device's time for it (events at the same hooks). Where the
    host needs longer than the device, the device waits (unless it still has earlier work queued). Beside the host's
    wall time, the main thread's CPU time per phase and its involuntary context switches per step (Linux): wall well
    above CPU time with many switches means the thread was preempted (a busy host); wall close to CPU time means the
    thread ran the whole phase (its own work, or spinning in a launch that waits for room in the device's queue).
    And the kernel launches that took Triton's own path in the timed steps (a launch key the fused ops had not kept,
    kernels/fused/launch.py): 0 in a steady state. And Python's cyclic garbage collections in the timed steps, by
    generation, with their time: a full collection of a large heap stalls the host (and a host-bound step with it).
    Per step too (`phase_steps`, gc's `ms_per_step`), so that a bimodal run can be attributed step by step.
    """

    def __init__(self, warmup: int, out: str):
        self.warmup, self.out = warmup, out
        self.events: list = []
        self.walls: list[float] = []
        self.tokens_per_step = 0
        self.marks: list[dict] = []  # per timed step: mark -> (perf_counter, event | None, thread CPU s, switches)
        self.misses_at_warmup: Optional[int] = None
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
            self.marks.append({})
        if not self.marks:
            return
        if self.misses_at_warmup is None:
            self.misses_at_warmup = launcher_misses()
            gc.callbacks.append(self._on_gc)
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
        return ({name: {"host_ms": med(host[name]), "host_cpu_ms": med(cpu[name]), "device_ms": med(dev[name])}
                 for name in PHASES},
                {name: {"host_ms": host[name], "device_ms": dev[name] or None} for name in PHASES})

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
        return {"collections": {g: n for g, (n, _) in by_gen.items()}, "ms": {g: t for g, (_, t) in by_gen.items()},
                "longest_ms": max((ms for _, _, ms in self.gc_events), default=0.0), "ms_per_step": per_step}

    def preempted_per_step(self) -> Optional[float]:
        """Median involuntary context switches of the main thread per timed step (None where not counted)."""
        steps = [nxt["batch_start"][3] - m["batch_start"][3] for m, nxt in zip(self.marks, self.marks[1:])
                 if "batch_start" in m and "batch_start" in nxt and m["batch_start"][3] is not None]
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
            "mode": cfg.hyper.residual_mode, "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__, "precision": str(trainer.precision),
            "kernel_backend": cfg.hyper.kernel_backend, "d_model": cfg.d_model, "n_layers": cfg.n_layers,
            "kernel_config": os.environ.get("MHC_KERNEL_CONFIG"),  # as this process saw it
            "params": sum(p.numel() for p in pl_module.parameters()),
            "tokens_per_step": self.tokens_per_step, "timed_steps": len(times),
            "step_ms_mean": mean, "step_ms_median": med, "step_ms_min": min(times), "step_ms_max": max(times),
            "tokens_per_s": self.tokens_per_step / (mean / 1e3),
            "tokens_per_s_median_step": self.tokens_per_step / (med / 1e3),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "phases": phases,
            "phase_steps": phase_steps,
            "gc": collections,
            "preempted_per_step": self.preempted_per_step(),
            "launcher_misses": None if self.misses_at_warmup is None else launcher_misses() - self.misses_at_warmup,
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
        record = {"steps": self.steps, "wall_us_per_step": wall_us, "busy_us_per_step": total,
                  "device_time": cuda, "top": rows[:80]}
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


class CheckProbe(L.Callback):
    """Per rank: the global-batch loss of each step, state digests (not under FSDP: shards differ by design),
    the diagnostics each rank holds, and how the optimizer groups weight decay -> <dirpath>/rank<r>.json."""

    def __init__(self, dirpath: str):
        self.dirpath = Path(dirpath)
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from mhc_lightning.distributed import mean_across_ranks

        loss = outputs["loss"].detach().float() if isinstance(outputs, dict) else torch.tensor(float("nan"))
        self.losses.append(float(mean_across_ranks(loss, pl_module.device)))

    def on_train_end(self, trainer, pl_module) -> None:
        from mhc_lightning.distributed import sharded, state_digests

        groups = [{"weight_decay": g["weight_decay"], "params": len(g["params"]),
                   "numel": sum(p.numel() for p in g["params"]), "matrices": sum(p.ndim == 2 for p in g["params"])}
                  for g in trainer.optimizers[0].param_groups]
        record = {"rank": trainer.global_rank, "world_size": trainer.world_size,
                  "strategy": type(trainer.strategy).__name__, "losses": self.losses,
                  "digests": None if sharded(trainer) else state_digests(trainer, pl_module),
                  "per_layer": pl_module.last_per_layer, "param_groups": groups}
        self.dirpath.mkdir(parents=True, exist_ok=True)
        (self.dirpath / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


# ---- driver -----------------------------------------------------------------------------------------------
def _cb(cls: str, **init_args) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": cls, "init_args": init_args})


def _env(smoke: bool, kernel_config: Optional[str] = None) -> dict:
    env = dict(os.environ)  # keeps the machine's NCCL settings (e.g. NCCL_NVLS_ENABLE=0)
    if kernel_config is not None:  # a --kernel-config variant: launch-config overrides (kernels/fused/ops.py)
        env["MHC_KERNEL_CONFIG"] = kernel_config
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), str(REPO / "bench"), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1" if smoke else "4")
    env.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


def run_fit(name: str, args: list[str], work: Path, smoke: bool, timeout: int,
            kernel_config: Optional[str] = None) -> tuple[int, float, str]:
    log = work / f"{name}.log"
    t0 = time.time()
    cmd = [sys.executable, "-m", "mhc_lightning.cli", "fit", *args]
    try:
        with log.open("w") as f:
            f.write(" ".join(cmd) + "\n\n")
            f.flush()
            rc = subprocess.run(cmd, cwd=work, env=_env(smoke, kernel_config), stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    dt = time.time() - t0
    text = log.read_text()
    print(f"  {name}: exit {rc} in {dt:.0f} s" + ("" if rc == 0 else f"\n{text[-3000:]}"), flush=True)
    return rc, dt, text


def machine_args(smoke: bool, devices: int, fsdp: bool = False) -> list[str]:
    if smoke:
        if devices == 1:
            return ["-c", str(CONF / "machine" / "cpu.yaml")]
        return ["-c", str(CONF / "machine" / "ddp-cpu.yaml"), f"--trainer.devices={devices}"]
    if devices == 1:
        return ["-c", str(CONF / "machine" / "gpu.yaml")]
    preset = "fsdp.yaml" if fsdp else "ddp.yaml"
    return ["-c", str(CONF / "machine" / preset), f"--trainer.devices={devices}"]


def common_args(corpus: Path, root: Path, steps: int, d_model: int, layers: int, heads: int, seq: int,
                batch: int, diagnostics_every: int) -> list[str]:
    return [
        "--seed_everything=1234", f"--data.corpus={corpus}", f"--data.seq_len={seq}", f"--data.batch_size={batch}",
        "--data.val_fraction=0.02", f"--model.arch.d_model={d_model}", f"--model.arch.n_layers={layers}",
        f"--model.arch.n_heads={heads}", f"--model.diagnostics_every={diagnostics_every}",
        "--model.optim.lr=1e-3", "--model.optim.warmup_steps=5",
        f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
        "--trainer.val_check_interval=null", "--trainer.check_val_every_n_epoch=null",
        "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=10", f"--trainer.default_root_dir={root}",
    ]


def _mlflow_available() -> bool:
    try:
        import mlflow  # noqa: F401
    except ImportError:
        return False
    return True


def check_phase(args, work: Path, corpus: Path, out: dict, save) -> dict:
    """1 device vs DDP on 2 (vs FSDP on 2 on GPUs): same global batch, fp32, corpus order."""
    print("check: DDP (and FSDP) against one device at the same global batch, fp32", flush=True)
    steps, global_batch = 6, 8
    shape = dict(d_model=64, layers=2, heads=2, seq=64) if args.smoke else dict(d_model=256, layers=4, heads=4, seq=256)
    runs = [("one", 1, False), ("ddp", 2, False)] + ([] if args.smoke else [("fsdp", 2, True)])
    use_mlflow = _mlflow_available()
    out.update(steps=steps, global_batch=global_batch, **shape, runs={})
    for name, devices, fsdp in runs:
        probe = work / "check" / name
        a = ["-c", str(CONF / "base.yaml"), "-c", str(CONF / "model" / "mhc.yaml"), *machine_args(args.smoke, devices, fsdp),
             *common_args(corpus, work / "check" / "root", steps, batch=global_batch // devices,
                          diagnostics_every=2, **shape),
             "--data.shuffle=false", "--trainer.precision=32-true", "--trainer.gradient_clip_val=null",
             _cb("bench_ddp.CheckProbe", dirpath=str(probe))]
        if name == "ddp":
            a.append(_cb("mhc_lightning.callbacks.RankConsistencyCheck", every_n_steps=1, on_mismatch="warn"))
        if use_mlflow:
            logger = {"class_path": "lightning.pytorch.loggers.MLFlowLogger", "init_args": {
                "experiment_name": f"check-{name}", "run_name": name, "log_model": False,
                "tracking_uri": f"sqlite:///{work / 'check' / 'mlflow.db'}"}}
            a += ["--trainer.logger=" + json.dumps(logger), "--trainer.log_every_n_steps=1"]
        else:
            a.append("--trainer.logger=false")
        rc, dt, text = run_fit(f"check-{name}", a, work, args.smoke, args.timeout)
        rec = {"exit": rc, "seconds": round(dt, 1)}
        files = sorted(probe.glob("rank*.json")) if rc == 0 else []
        if files:
            ranks = [json.loads(f.read_text()) for f in files]
            rec.update(losses=ranks[0]["losses"], world_size=ranks[0]["world_size"],
                       param_groups=ranks[0]["param_groups"], strategy=ranks[0]["strategy"])
            if ranks[0]["digests"] is not None:
                rec["ranks_equal_state"] = all(r["digests"] == ranks[0]["digests"] for r in ranks)
            rec["ranks_equal_diagnostics"] = all(r["per_layer"] == ranks[0]["per_layer"] for r in ranks)
            rec["diagnostics_recorded"] = bool(ranks[0]["per_layer"])
            rec["rank_consistency_warning"] = "RankConsistencyCheck" in text and "hold different" in text
        out["runs"][name] = rec
        save()
    ref = out["runs"]["one"].get("losses")
    for name in [r for r in out["runs"] if r != "one"]:
        rec = out["runs"][name]
        if ref and rec.get("losses"):
            rel = [abs(a - b) / abs(b) for a, b in zip(rec["losses"], ref)]
            rec["max_rel_loss_diff_vs_one"] = max(rel)
            rec["losses_match"] = len(rec["losses"]) == len(ref) and max(rel) <= 1e-3
    if use_mlflow and out["runs"]["ddp"].get("exit") == 0:
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{work / 'check' / 'mlflow.db'}")
        exp = client.get_experiment_by_name("check-ddp")
        found = client.search_runs([exp.experiment_id]) if exp else []
        out["mlflow_ddp_runs"] = len(found)
        if found:
            hist = client.get_metric_history(found[0].info.run_id, "train/loss")
            out["mlflow_ddp_train_loss_points"] = len(hist)
            out["mlflow_ddp_has_amax"] = "amax/composite_fwd_max" in found[0].data.metrics
    for name, rec in out["runs"].items():
        extra = ""
        if "max_rel_loss_diff_vs_one" in rec:
            extra = f" max rel loss diff vs 1 device {rec['max_rel_loss_diff_vs_one']:.2e}"
        if "ranks_equal_state" in rec:
            extra += f", ranks equal state {rec['ranks_equal_state']}"
        if "ranks_equal_diagnostics" in rec:
            extra += f", ranks equal diagnostics {rec['ranks_equal_diagnostics']}"
        print(f"  {name}: exit {rec['exit']}{extra}", flush=True)
    return out


def _headline(runs: list[dict]) -> dict:
    """Of repeated runs of one variant, the one with the median mean step (the lower middle one for an even count),
    with every run's times beside it: on a shared host a process's step time varies by 10 % or more."""
    ok = sorted((r for r in runs if "step_ms_mean" in r), key=lambda r: r["step_ms_mean"])
    head = dict(ok[(len(ok) - 1) // 2]) if ok else dict(runs[-1])
    # every run's times and phases too: an outlier run (round 13: 101 ms among 78.5 ms runs) can then be attributed
    head["repeats"] = [{k: r.get(k) for k in ("step_ms_mean", "step_ms_median", "exit", "seconds", "phases",
                                              "preempted_per_step", "launcher_misses", "step_ms", "phase_steps", "gc")
                        if k in r} for r in runs]
    for k in ("step_ms", "phase_steps", "gc"):  # kept once, with the run they belong to
        head.pop(k, None)
    return head


def bench_fit_args(args, work: Path, corpus: Path, variant: str, devices: int, steps: int, callback: str) -> list[str]:
    """`mhc fit` arguments of one bench run of MODE or MODE@NAME: the mode's preset at the bench shape, bf16-mixed, no
    logger, callback, --fit-args, then NAME's --variant-args."""
    mode, _, name = variant.partition("@")
    return ["-c", str(CONF / "base.yaml"), "-c", str(CONF / "model" / f"{mode}.yaml"), *machine_args(args.smoke, devices),
            *common_args(corpus, work / "root", steps, args.d_model, args.layers, args.heads, args.seq, args.batch,
                         args.diagnostics_every),
            f"--trainer.precision={'32-true' if args.smoke else 'bf16-mixed'}", "--trainer.logger=false", callback,
            *shlex.split(args.fit_args), *shlex.split(args.variant_args.get(name, ""))]


def bench_phase(args, work: Path, corpus: Path, results: dict, save, profiles: dict) -> dict:
    print(f"bench: {args.modes} on 1 and {args.gpus} devices, C={args.d_model}, {args.layers} blocks, "
          f"B={args.batch}/device, T={args.seq}, {args.warmup} warm-up + {args.steps} timed steps"
          + (f", each {args.repeat} times, alternating" if args.repeat > 1 else ""), flush=True)
    for devices in sorted({1, args.gpus}):
        runs: dict = {}
        for rep in range(args.repeat):
            for variant in args.modes:
                mode, _, config_name = variant.partition("@")
                name = f"{variant}-{devices}"
                run_name = name if args.repeat == 1 else f"{name}-r{rep}"
                out = work / f"{run_name}.json"
                a = bench_fit_args(args, work, corpus, variant, devices, args.warmup + args.steps,
                                   _cb("bench_ddp.Throughput", warmup=args.warmup, out=str(out)))
                rc, dt, _ = run_fit(run_name, a, work, args.smoke, args.timeout, args.kernel_configs.get(config_name))
                rec = json.loads(out.read_text()) if rc == 0 and out.exists() else {"exit": rc}
                rec["seconds"] = round(dt, 1)
                runs.setdefault(name, []).append(rec)
                results[name] = rec if args.repeat == 1 else _headline(runs[name])
                save()
                if "tokens_per_s" in rec:
                    print(f"    {rec['tokens_per_s']:,.0f} tok/s, step {rec['step_ms_mean']:.1f} ms mean / "
                          f"{rec['step_ms_median']:.1f} median, peak {rec['peak_mem_gib'] or 0:.1f} GiB", flush=True)
                    print("    host / device ms: " + ", ".join(
                        f"{k} {v['host_ms'] or 0:.1f} (cpu {v['host_cpu_ms'] or 0:.1f}) / {v['device_ms'] or 0:.1f}"
                        for k, v in rec["phases"].items()) + f"; preempted {rec.get('preempted_per_step')} per step, "
                        f"{rec.get('launcher_misses')} launcher misses; gc {rec['gc']['collections']} in "
                        f"{sum(rec['gc']['ms'].values()):.1f} ms (longest {rec['gc']['longest_ms']:.1f})", flush=True)
    if args.profile:
        print(f"profile: {args.profile} steps after {args.warmup} warm-up steps, one more run per variant", flush=True)
        for variant in args.modes:
            mode, _, config_name = variant.partition("@")
            out = work / f"{variant}-profile.json"
            a = bench_fit_args(args, work, corpus, variant, 1, args.warmup + args.profile,
                               _cb("bench_ddp.ProfileSteps", warmup=args.warmup, steps=args.profile, out=str(out)))
            rc, _, _ = run_fit(f"{variant}-profile", a, work, args.smoke, args.timeout,
                               args.kernel_configs.get(config_name))
            rec = json.loads(out.read_text()) if rc == 0 and out.exists() else {"exit": rc}
            profiles[variant] = rec
            save()
            if "top" in rec:
                busy, wall = rec["busy_us_per_step"], rec["wall_us_per_step"]
                print(f"  {variant}: {wall / 1e3:.1f} ms per profiled step, kernels {busy / 1e3:.1f} ms "
                      f"({100 * busy / wall:.0f} %)", flush=True)
                print_rows(rec["top"], busy, top=15)
                if "idle" in rec:
                    idle = rec["idle"]
                    print(f"  idle: {idle['host_us_per_step'] / 1e3:.1f} ms per step waiting on the host "
                          f"({idle['gaps_per_step']:.0f} gaps), {idle['queued_us_per_step'] / 1e3:.1f} ms on queued "
                          "work; by the host ops that launched the next work:", flush=True)
                    for r in idle["by_outer_ops"][:12]:
                        print(f"    {r['us_per_step']:9.0f} us  {r['name']}", flush=True)
                    for r in idle["by_inner_op"][:8]:
                        print(f"    {r['us_per_step']:9.0f} us  (innermost) {r['name']}", flush=True)
                    for r in rec["syncs"][:4]:
                        print(f"  synchronizing call, {r['per_step']:.1f} per step, from:\n{r['stack']}", flush=True)
                    print("  host time per step by op (own time; the profiler's own cost included):", flush=True)
                    print_rows(rec["host_top"], sum(r["us_per_step"] for r in rec["host_top"]), top=15)
    return results


def summary(results: dict, modes: list[str], gpus: int) -> dict:
    """Scaling efficiency, and x residual by mean step and by median step (`x_residual_median`): one slow step moves
    a 20-step mean by ~1 % (round 23: the residual's mean 52.9 against its median 52.0 ms), the median not."""
    s: dict = {"scaling_efficiency": {}, "x_residual": {}, "x_residual_median": {}}
    for mode in modes:
        one, many = results.get(f"{mode}-1", {}), results.get(f"{mode}-{gpus}", {})
        if "tokens_per_s" in one and "tokens_per_s" in many:
            s["scaling_efficiency"][mode] = many["tokens_per_s"] / (gpus * one["tokens_per_s"])
    if "residual" in modes:
        for mode in modes:
            for d in (1, gpus):
                r, m = results.get(f"residual-{d}", {}), results.get(f"{mode}-{d}", {})
                for key, stat in (("x_residual", "step_ms_mean"), ("x_residual_median", "step_ms_median")):
                    if stat in r and stat in m:
                        s[key].setdefault(mode, {})[str(d)] = m[stat] / r[stat]
    return s


def print_table(results: dict, s: dict, modes: list[str], gpus: int) -> None:
    print(f"\n| variant | tok/s, 1 device | tok/s, {gpus} devices | scaling efficiency | step ms 1 / {gpus} | "
          f"x residual, 1 | x residual, {gpus} | median step ms, 1 | x residual by median, 1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        one, many = results.get(f"{mode}-1", {}), results.get(f"{mode}-{gpus}", {})
        eff = s["scaling_efficiency"].get(mode)
        xr, xm = s["x_residual"].get(mode, {}), s["x_residual_median"].get(mode, {})
        f = lambda v, fmt: format(v, fmt) if v is not None else "n/a"  # noqa: E731
        print(f"| {mode} | {f(one.get('tokens_per_s'), ',.0f')} | {f(many.get('tokens_per_s'), ',.0f')} | "
              f"{f(eff * 100 if eff is not None else None, '.1f')} % | {f(one.get('step_ms_mean'), '.1f')} / "
              f"{f(many.get('step_ms_mean'), '.1f')} | {f(xr.get('1'), '.3f')} | {f(xr.get(str(gpus)), '.3f')} | "
              f"{f(one.get('step_ms_median'), '.1f')} | {f(xm.get('1'), '.3f')} |")


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "lightning": L.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host_cpus": os.cpu_count()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpus"] = torch.cuda.device_count()
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        try:
            env["topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                             timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            env["topology"] = None
    env["nccl_env"] = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM_"))}
    env["mhc_kernel_config"] = os.environ.get("MHC_KERNEL_CONFIG")  # launch-config overrides (kernels/fused/ops.py)
    return env


def with_config_variants(modes: list[str], configs: dict) -> list[str]:
    """modes plus MODE@NAME for each --kernel-config NAME and each mode but residual, unless --modes already names a
    variant of NAME: then those are NAME's only runs (a config of mHC's kernels need not run HC twice; round 14's
    `hc@r13` ran the default HC launch under another name)."""
    named = {m.partition("@")[2] for m in modes if "@" in m}
    return modes + [f"{m}@{name}" for name in configs if name not in named for m in modes
                    if m != "residual" and "@" not in m]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny shapes (checks the script, not speed)")
    p.add_argument("--out", default=os.environ.get("OUT") or "out/bench_ddp")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--modes", default="residual,mhc")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12, help="blocks (each = attention + MLP sublayer)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="per device")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=40, help="timed steps")
    p.add_argument("--diagnostics-every", type=int, default=0,
                   help="0: pure training throughput; the check phase always runs the diagnostics")
    p.add_argument("--timeout", type=int, default=240, help="seconds per `mhc fit`")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each variant this many times, the variants alternating; the table reports the run with "
                        "the median mean step (A/Bs on hosts whose speed varies between processes)")
    p.add_argument("--kernel-config", action="append", default=[], metavar="NAME=JSON",
                   help="one more variant of every mode but residual, named MODE@NAME, run with MHC_KERNEL_CONFIG=JSON "
                        "(launch-config overrides, docs/kernels.md); with --repeat, an A/B inside one call. Naming "
                        "MODE@NAME in --modes runs only the variants named there")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after the timed runs, one more run per variant with torch.profiler over STEPS steps: device "
                        "time per kernel, and kernels against wall time (the GPU waiting on the host)")
    p.add_argument("--work", default=None, help="folder for runs and logs (default: a new temporary folder)")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--no-bench", action="store_true")
    p.add_argument("--fit-args", default="", help="more `mhc fit` arguments for the bench runs, e.g. "
                   "'--model.arch.stream_dtype=float32'")
    p.add_argument("--variant-args", action="append", default=[], metavar="NAME=ARGS", dest="variant_args_given",
                   help="more `mhc fit` arguments for the variants MODE@NAME only (with or without a --kernel-config "
                        "NAME), e.g. chain='--model.arch.hyper.chain_sublayers=true': a model option A/B in one call")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    args.kernel_configs = {}
    for item in args.kernel_config:
        name, sep, text = item.partition("=")
        if not sep or not name or "@" in name or "-" in name:
            p.error(f"--kernel-config: expected NAME=JSON with a NAME of letters, digits and _, got {item!r}")
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            p.error(f"--kernel-config {name}: not JSON ({exc.msg}); e.g. {name}='{{\"coef_fwd\": {{\"phi_split\": true}}}}'")
        args.kernel_configs[name] = text
    args.variant_args = {}
    for item in args.variant_args_given:
        name, sep, text = item.partition("=")
        if not sep or not name or "@" in name or "-" in name:
            p.error(f"--variant-args: expected NAME=ARGS with a NAME of letters, digits and _, got {item!r}")
        args.variant_args[name] = text
    variants = {**dict.fromkeys(args.kernel_configs), **dict.fromkeys(args.variant_args)}
    for mode in args.modes:  # a variant named in --modes must be defined (else it would run the default)
        if "@" in mode and mode.partition("@")[2] not in variants:
            p.error(f"--modes {mode}: {mode.partition('@')[2]!r} is no --kernel-config or --variant-args NAME; allowed: "
                    f"{', '.join(variants) or 'none given'} (each NAME adds MODE@NAME by itself)")
    args.modes = with_config_variants(args.modes, variants)
    if args.smoke:
        args.d_model, args.layers, args.heads, args.seq, args.batch = 64, 2, 2, 64, 4
        args.warmup, args.steps, args.timeout = 3, 5, min(args.timeout, 300)
    elif torch.cuda.device_count() < args.gpus:  # --gpus 1: the one-device runs only
        print(f"needs {args.gpus} CUDA devices, found {torch.cuda.device_count()} (use --smoke on CPU)")
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # runs, logs and the corpus stay outside --out: only the JSON and one log file go back from a device machine
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="bench_ddp_"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    corpus = work / "corpus.txt"
    # enough windows for the longest run: every device its own batches, plus the validation split
    need = int((args.warmup + args.steps + 8) * args.batch * args.gpus * (args.seq + 1) * 1.2) + 2_000_000
    make_corpus(corpus, need if not args.smoke else 400_000)
    report: dict = {"args": vars(args), "environment": environment()}
    print(json.dumps({k: v for k, v in report["environment"].items() if k != "topology"}), flush=True)
    if report["environment"].get("topology"):
        print(report["environment"]["topology"], flush=True)
    path = out / "bench_ddp.json"

    def save() -> None:
        # after every run, so a run cut short by a time limit still returns what it measured
        report["seconds"] = round(time.time() - t0, 1)
        path.write_text(json.dumps(report, indent=1))
        with open(out / "bench_ddp_logs.txt", "w") as f:  # the runs' logs in one file (few files travel back)
            for log in sorted(work.glob("*.log"), key=lambda q: q.stat().st_mtime):
                f.write(f"==== {log.name}\n{log.read_text()[-20000:]}\n")

    if not args.no_check:
        report["check"] = {}
        check_phase(args, work, corpus, report["check"], save)
    if not args.no_bench:
        report["bench"], report["profile"] = {}, {}
        bench_phase(args, work, corpus, report["bench"], save, report["profile"])
        report["summary"] = summary(report["bench"], args.modes, args.gpus)
        print_table(report["bench"], report["summary"], args.modes, args.gpus)
    save()
    print(f"\nwrote {path} ({report['seconds']:.0f} s)")
    ok_check = all(r.get("exit") == 0 for r in report.get("check", {}).get("runs", {}).values())
    ok_bench = all("tokens_per_s" in r for r in report.get("bench", {}).values())
    return 0 if ok_check and ok_bench else 1


if __name__ == "__main__":
    sys.exit(main())
