"""Cost of the mHC diagnostics (Amax gain, Sinkhorn residuals, coefficient ranges) per training step.

    python -m bench diagnostics [--accelerator gpu] [--k 25]

Trains the same small mHC model (3 blocks, C = 128, T = 128, B = 16; reference ops on the CPU, fused kernels on a GPU)
with diagnostics off, every step, and every k steps (the default), times each optimizer step (synchronised), and
reports the median step: one diagnostics step costs (every step - off), spread over k steps. Generated text: no
downloads. A diagnostics step records one sequence's coefficients during the normal forward and computes the float64
Amax report and Sinkhorn residuals, so its cost does not grow with the batch.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from bench import harness
from mhc_lightning.data import ByteTextDataModule
from mhc_lightning.data.synthetic import english_like_text
from mhc_lightning.model import GPTConfig, HyperConfig
from mhc_lightning.training.module import LitLM

COLUMNS = [
    ("diagnostics", "diagnostics", ""),
    ("median_ms", "median ms/step", ".2f"),
    ("mean_ms", "mean ms/step", ".2f"),
]


class StepTimer(L.Callback):
    def __init__(self, cuda: bool):
        self.cuda, self.times, self.t0 = cuda, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        harness.sync("cuda" if self.cuda else "cpu")
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        harness.sync("cuda" if self.cuda else "cpu")
        self.times.append(time.perf_counter() - self.t0)


def run(every: int, args, corpus: Path) -> list[float]:
    L.seed_everything(0, verbose=False)
    arch = GPTConfig(
        n_layers=args.layers, d_model=args.width, n_heads=4, context=args.seq, hyper=HyperConfig(residual_mode="mhc")
    )
    model = LitLM(arch=arch, diagnostics_every=every)
    data = ByteTextDataModule(corpus=str(corpus), seq_len=args.seq, batch_size=args.batch)
    timer = StepTimer(args.accelerator == "gpu")
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[timer],
        precision="bf16-mixed" if args.accelerator == "gpu" else "32-true",
    )
    trainer.fit(model, datamodule=data)
    return timer.times[args.warmup :]


def main(argv=None) -> int:
    p = harness.parser("diagnostics", __doc__)
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--k", type=int, default=25, help="the default diagnostics_every")
    p.add_argument("--corpus", default=None, help="text file (default: generated)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    report = harness.Report("diagnostics", args, argv or [], "cuda" if args.accelerator == "gpu" else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(args.corpus) if args.corpus else Path(tmp) / "corpus.txt"
        if not args.corpus:
            corpus.write_text(english_like_text(1_000_000))
        for label, every in (("off", 0), ("every step", 1), (f"every {args.k} (default)", args.k)):
            ts = run(every, args, corpus)
            # medians: a shared machine has outlier steps that swamp a mean
            report.add(
                {
                    "diagnostics": label,
                    "every": every,
                    "median_ms": 1e3 * statistics.median(ts),
                    "mean_ms": 1e3 * statistics.fmean(ts),
                }
            )
    base = report.rows[0]["median_ms"]
    per_diag = report.rows[1]["median_ms"] - base  # one diagnostics step over a plain step
    report.rows[2].update(per_diagnostic_ms=per_diag, overhead_at_k=per_diag / args.k / base)
    harness.print_table(report.rows, COLUMNS)
    print(
        f"one diagnostics step costs {per_diag:.2f} ms extra; at k={args.k}: "
        f"{100 * per_diag / args.k / base:.2f} % of step time"
    )
    print("wrote", report.save())
    return 0
