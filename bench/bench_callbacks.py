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


def run(args, with_callbacks: bool, corpus: Path) -> dict:
    L.seed_everything(0, verbose=False)
    arch = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads, context=args.seq,
                     hyper=HyperConfig(residual_mode="mhc", n_streams=4, sinkhorn_iters=20))
    model = LitLM(arch=arch, optim=OptimConfig(lr=args.lr), diagnostics_every=args.diagnostics_every)
    data = ByteTextDataModule(corpus=str(corpus), seq_len=args.seq, batch_size=args.batch)
    timer = StepTimer(args.accelerator == "gpu")
    stability = [InstabilityDetector(), GradientSnapshots(), SinkhornScheduler()] if with_callbacks else []
    trainer_ref: list = []
    clock = HookClock(stability, trainer_ref)
    snap_at = args.steps - 2
    extra = [TimeOneSnapshot(stability[1], snap_at, args.accelerator == "gpu")] if with_callbacks else []
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
    if with_callbacks:
        out["hook_mean_s"] = statistics.fmean(clock.per_step.get(k, 0.0) for k in keep)
        out["snapshot_s"] = extra[0].seconds
        out["snapshot_every"] = stability[1].every_n_steps
        out["sinkhorn_iters_final"] = list(stability[2].iters)
        out["events"] = len(model.stability_channel.events)
    return out


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
    p.add_argument("--out", default=None, help="JSON path (default: bench_callbacks_<accelerator>.json)")
    args = p.parse_args()
    args.precision = args.precision or ("bf16-mixed" if args.accelerator == "gpu" else "32-true")
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(args.corpus) if args.corpus else make_corpus(Path(tmp) / "corpus.txt")
        runs = {"baseline": [], "stability": []}
        for _ in range(args.repeats):  # alternate, so slow phases of a shared machine hit both
            runs["baseline"].append(run(args, False, corpus))
            runs["stability"].append(run(args, True, corpus))

    base = min(r["median_s"] for r in runs["baseline"])
    best = min(runs["stability"], key=lambda r: r["median_s"])
    steady = best["median_s"] / base - 1
    amortised = statistics.median(r["snapshot_s"] for r in runs["stability"]) / best["snapshot_every"] / base
    hook_share = statistics.median(r["hook_mean_s"] / r["median_s"] for r in runs["stability"])
    device = torch.cuda.get_device_name(0) if args.accelerator == "gpu" else platform.processor() or platform.machine()
    result = {
        "device": device, "accelerator": args.accelerator, "precision": args.precision,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "lr": args.lr, "model": {"layers": args.layers, "width": args.width, "seq": args.seq, "batch": args.batch, "streams": 4,
                  "sinkhorn_iters": 20, "mode": "mhc"},
        "baseline_median_step_s": base, "stability_median_step_s": best["median_s"],
        "steady_overhead": steady, "snapshot_amortised_overhead": amortised, "total_overhead": steady + amortised,
        "hook_time_share": hook_share, "hook_total_overhead": hook_share + amortised,
        "runs": runs,
    }
    print(f"\nstability callbacks at defaults, {device} ({args.accelerator}, {args.precision}, "
          f"{torch.get_num_threads()} threads), mHC n=4 L={2 * args.layers} C={args.width} seq={args.seq} "
          f"batch={args.batch}, {args.repeats} x {args.steps - args.warmup} steps per configuration")
    print(f"{'configuration':<28}{'median step ms':>16}{'mean step ms':>14}{'events':>8}")
    for name, rs in runs.items():
        for r in rs:
            print(f"{name:<28}{1e3 * r['median_s']:>16.2f}{1e3 * r['mean_s']:>14.2f}{r.get('events', '-'):>8}")
    print(f"steady-state overhead (best medians)        {100 * steady:+.2f} %")
    print(f"snapshot {1e3 * best['snapshot_s']:.1f} ms every {best['snapshot_every']} steps, amortised "
          f"{100 * amortised:+.3f} %")
    print(f"total (A/B)                                  {100 * (steady + amortised):+.2f} %")
    print(f"time inside the callbacks' hooks             {100 * hook_share:+.2f} % of a step "
          f"(+ snapshots: {100 * (hook_share + amortised):+.2f} %)")
    out = Path(args.out or f"bench_callbacks_{args.accelerator}.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
