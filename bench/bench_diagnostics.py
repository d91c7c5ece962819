"""Cost of the mHC diagnostics (Amax gain, Sinkhorn residuals, coefficient ranges) per training step.

Runs the same tiny-to-small training with diagnostics off, every step, and every k steps (the default),
times each optimizer step with a callback, and prints one table; writes JSON.
    python bench/bench_diagnostics.py [--accelerator gpu] [--out bench_diagnostics.json]
"""
import argparse
import json
import statistics
import time

import lightning as L
import torch

from mhc_lightning.data import ByteTextDataModule
from mhc_lightning.model import GPTConfig, HyperConfig
from mhc_lightning.module import LitLM


class StepTimer(L.Callback):
    def __init__(self):
        self.times = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.t0)


def run(every: int, args) -> list[float]:
    L.seed_everything(0)
    arch = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=4, context=args.seq,
                     hyper=HyperConfig(residual_mode="mhc"))
    model = LitLM(arch=arch, diagnostics_every=every)
    data = ByteTextDataModule(corpus=args.corpus, seq_len=args.seq, batch_size=args.batch)
    timer = StepTimer()
    trainer = L.Trainer(accelerator=args.accelerator, devices=1, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[timer],
                        precision="bf16-mixed" if args.accelerator == "gpu" else "32-true")
    trainer.fit(model, datamodule=data)
    return timer.times[args.warmup:]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--corpus", default="shakespeare")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--k", type=int, default=25, help="the default diagnostics_every")
    p.add_argument("--out", default="bench_diagnostics.json")
    args = p.parse_args()
    rows = {}
    for label, every in (("off", 0), ("every step", 1), (f"every {args.k} (default)", args.k)):
        ts = run(every, args)
        rows[label] = {"every": every, "median_ms": 1e3 * statistics.median(ts), "mean_ms": 1e3 * statistics.fmean(ts)}
    # medians: a shared 2-core machine has outlier steps that swamp a mean
    base = rows["off"]["median_ms"]
    per_diag = rows["every step"]["median_ms"] - base  # cost of one diagnostics step over a plain step
    result = {"device": torch.cuda.get_device_name() if args.accelerator == "gpu" else "cpu",
              "torch": torch.__version__, "args": vars(args), "rows": rows,
              "per_diagnostic_ms": per_diag, "overhead_at_default_k": per_diag / args.k / base}
    print(f"{'diagnostics':<22}{'median ms/step':>16}{'mean ms/step':>14}")
    for label, r in rows.items():
        print(f"{label:<22}{r['median_ms']:>16.2f}{r['mean_ms']:>14.2f}")
    print(f"one diagnostics step costs {per_diag:.2f} ms extra; at k={args.k}: "
          f"{100 * result['overhead_at_default_k']:.2f} % of step time")
    json.dump(result, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
