"""Step-time overhead of the three stability callbacks at their defaults.

InstabilityDetector + GradientSnapshots + SinkhornScheduler, as in conf/presets/stability.yaml.

Trains the same mHC model with and without the three callbacks, alternating the two configurations
`--repeats` times; a step is the wall time from one on_train_batch_start to the next (everything the loop
does, synchronised on CUDA). Steady-state overhead = ratio of the per-run median step times (the best run of
each configuration). The snapshot every `every_n_steps` (default 500) is timed separately and amortised.
Prints one table and writes JSON.

    python bench/bench_callbacks.py                                   # CPU, writes bench_callbacks_cpu.json
    python bench/bench_callbacks.py --accelerator gpu --out bench_callbacks_gpu.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from mhc_lightning.callbacks import GradientSnapshots, InstabilityDetector, SinkhornScheduler
from mhc_lightning.data import ByteTextDataModule
from mhc_lightning.data.synthetic import english_like_text
from mhc_lightning.model import GPTConfig, HyperConfig
from mhc_lightning.module import LitLM, OptimConfig

def make_corpus(path: Path, n_bytes: int = 2_000_000) -> Path:
    """English-like text, so the benchmark needs no download (the GPU host is offline)."""
    path.write_text(english_like_text(n_bytes))
    return path


class StepTimer(L.Callback):
    """Put first in the callback list: times start-to-start, so every other hook falls inside a step."""

    def __init__(self, cuda: bool):
        self.cuda, self.times, self._t = cuda, {}, None

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = self._now()
        if self._t is not None:
            self.times[trainer.global_step - 1] = now - self._t
        self._t = now


class TimeOneSnapshot(L.Callback):
    """Takes (and times) one extra snapshot at `step`, warm: the one at the first batch also pays first-call costs."""

    def __init__(self, snaps: GradientSnapshots, step: int, cuda: bool):
        self.snaps, self.step, self.cuda, self.seconds = snaps, step, cuda, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            if self.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            self.snaps._take(trainer, pl_module, batch, batch_idx)
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds = time.perf_counter() - t0


class HookClock:
    """Time spent inside the stability callbacks' own hooks, per step (exact on CPU; on CUDA a hook that syncs
    also waits for queued GPU work, so there the A/B step time is the number to trust)."""

    HOOKS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")

    def __init__(self, callbacks, trainer_ref: list):
        self.per_step: dict[int, float] = {}
        for cb in callbacks:
            for name in self.HOOKS:
                setattr(cb, name, self._timed(getattr(cb, name), trainer_ref))

    def _timed(self, fn, trainer_ref):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                step = trainer_ref[0].global_step if trainer_ref else -1
                self.per_step[step] = self.per_step.get(step, 0.0) + time.perf_counter() - t0
        return wrapper


CONFIGS = ("baseline", "stability", "pinned", "detector", "snapshots", "scheduler")
HELP_CONFIGS = ("baseline: no callbacks; stability: the three at defaults; pinned: the three, the scheduler's bounds pinned at "
                "the model's count (its mechanics without its decisions: same Sinkhorn work as the baseline); "
                "detector / snapshots / scheduler: one alone, at defaults")


def make_callbacks(config: str, iters: int) -> list:
    detector, snaps = InstabilityDetector(), GradientSnapshots()
    scheduler = SinkhornScheduler(min_iters=iters, max_iters=iters) if config == "pinned" else SinkhornScheduler()
    return {"baseline": [], "stability": [detector, snaps, scheduler], "pinned": [detector, snaps, scheduler],
            "detector": [detector], "snapshots": [snaps], "scheduler": [scheduler]}[config]


def record_updates(scheduler: SinkhornScheduler, log: list) -> None:
    """Keep (step, worst residual, tighten reason, counts) of every scheduler update: why the count moved."""
    update = scheduler.update

    def wrapped(step, residuals, tighten_reason=None):
        iters = update(step, residuals, tighten_reason)
        log.append({"step": step, "residual_max": max(residuals), "reason": tighten_reason, "iters_mean":
                    sum(iters) / len(iters)})
        return iters
    scheduler.update = wrapped


def run(args, config: str, corpus: Path) -> dict:
    L.seed_everything(0, verbose=False)
    arch = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads, context=args.seq,
                     hyper=HyperConfig(residual_mode="mhc", n_streams=4, sinkhorn_iters=20))
    model = LitLM(arch=arch, optim=OptimConfig(lr=args.lr), diagnostics_every=args.diagnostics_every)
    data = ByteTextDataModule(corpus=str(corpus), seq_len=args.seq, batch_size=args.batch)
    timer = StepTimer(args.accelerator == "gpu")
    stability = make_callbacks(config, arch.hyper.sinkhorn_iters)
    snaps = next((c for c in stability if isinstance(c, GradientSnapshots)), None)
    scheduler = next((c for c in stability if isinstance(c, SinkhornScheduler)), None)
    updates: list = []
    if scheduler is not None:
        record_updates(scheduler, updates)
    trainer_ref: list = []
    clock = HookClock(stability, trainer_ref)
    snap_at = args.steps - 2
    extra = [TimeOneSnapshot(snaps, snap_at, args.accelerator == "gpu")] if snaps is not None else []
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, precision=args.precision, max_steps=args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        gradient_clip_val=1.0, callbacks=[timer, *stability, *extra])
    trainer_ref.append(trainer)
    trainer.fit(model, datamodule=data)
    # warm-up steps (and the one carrying the timed extra snapshot) are left out of every statistic
    keep = [k for k in timer.times if k >= args.warmup and k != snap_at]
    times = [timer.times[k] for k in keep]
    out = {"median_s": statistics.median(times), "mean_s": statistics.fmean(times), "steps": len(times)}
    if stability:
        out["hook_mean_s"] = statistics.fmean(clock.per_step.get(k, 0.0) for k in keep)
        out["events"] = len(model.stability_channel.events)
    if snaps is not None:
        out["snapshot_s"] = extra[0].seconds
        out["snapshot_every"] = snaps.every_n_steps
    if scheduler is not None:
        out["sinkhorn_iters_final"] = list(scheduler.iters)
        out["sinkhorn_updates"] = updates
    return out


def summarize(runs: list[dict], base: float) -> dict:
    """Overheads of one configuration against the best baseline median."""
    best = min(runs, key=lambda r: r["median_s"])
    steady = best["median_s"] / base - 1
    amortised = (statistics.median(r["snapshot_s"] for r in runs) / best["snapshot_every"] / base
                 if "snapshot_s" in best else 0.0)
    return {"median_step_s": best["median_s"], "steady_overhead": steady, "snapshot_amortised_overhead": amortised,
            "total_overhead": steady + amortised,
            "hook_time_share": statistics.median(r["hook_mean_s"] / r["median_s"] for r in runs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--precision", default=None, help="default: 32-true on cpu, bf16-mixed on gpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=OptimConfig.lr,
                   help="lower it for wide models: events (skipped steps) make the two configurations differ")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=10, help="steps dropped from the start of each run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--diagnostics-every", type=int, default=25, help="the module default")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--corpus", default=None, help="text file (default: generated)")
    p.add_argument("--configs", default="baseline,stability",
                   help="comma-separated; " + HELP_CONFIGS)
    p.add_argument("--out", default=None, help="JSON path (default: bench_callbacks_<accelerator>.json)")
    args = p.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or "baseline" not in configs or len(configs) < 2:
        p.error(f"--configs: expected 'baseline' and at least one of {', '.join(CONFIGS[1:])}; got {args.configs!r}")
    args.precision = args.precision or ("bf16-mixed" if args.accelerator == "gpu" else "32-true")
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(args.corpus) if args.corpus else make_corpus(Path(tmp) / "corpus.txt")
        runs = {c: [] for c in configs}
        for _ in range(args.repeats):  # alternate, so slow phases of a shared machine hit every configuration
            for c in configs:
                runs[c].append(run(args, c, corpus))

    base = min(r["median_s"] for r in runs["baseline"])
    summary = {name: summarize(rs, base) for name, rs in runs.items() if name != "baseline"}
    device = torch.cuda.get_device_name(0) if args.accelerator == "gpu" else platform.processor() or platform.machine()
    result = {
        "device": device, "accelerator": args.accelerator, "precision": args.precision,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "lr": args.lr, "model": {"layers": args.layers, "width": args.width, "seq": args.seq, "batch": args.batch,
                                 "streams": 4, "sinkhorn_iters": 20, "mode": "mhc"},
        "baseline_median_step_s": base, "summary": summary, "runs": runs,
    }
    print(f"\nstability callbacks at defaults, {device} ({args.accelerator}, {args.precision}, "
          f"{torch.get_num_threads()} threads), mHC n=4 L={2 * args.layers} C={args.width} seq={args.seq} "
          f"batch={args.batch}, {args.repeats} x {args.steps - args.warmup} steps per configuration")
    print(f"{'configuration':<14}{'median step ms':>16}{'mean step ms':>14}{'events':>8}{'final iters':>13}")
    for name, rs in runs.items():
        for r in rs:
            iters = r.get("sinkhorn_iters_final")
            iters = f"{sum(iters) / len(iters):.1f}" if iters else "-"
            print(f"{name:<14}{1e3 * r['median_s']:>16.2f}{1e3 * r['mean_s']:>14.2f}{r.get('events', '-'):>8}"
                  f"{iters:>13}")
    print(f"\n{'vs baseline':<14}{'steady':>10}{'snapshots':>11}{'total':>9}{'in hooks':>10}")
    for name, s in summary.items():
        print(f"{name:<14}{100 * s['steady_overhead']:>+9.2f}%{100 * s['snapshot_amortised_overhead']:>+10.3f}%"
              f"{100 * s['total_overhead']:>+8.2f}%{100 * s['hook_time_share']:>+9.2f}%")
    print(HELP_CONFIGS)
    print("steady = ratio of best run medians; snapshots = one snapshot's time / every_n_steps; in hooks = time "
          "inside the callbacks' hooks per step (on CUDA it includes waiting for the GPU at a sync)")
    out = Path(args.out or f"bench_callbacks_{args.accelerator}.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
