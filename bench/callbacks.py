"""Step-time overhead of the stability callbacks at their defaults (conf/presets/stability.yaml), in paired blocks.

Paired blocks inside one fit: the callbacks under test are switched on and off in blocks of `--block`
optimizer steps (off, on, on, off, off, on, ...: an ABBA order, so a slow drift of the machine cancels), and
each block is timed as a whole, synchronising CUDA only at block edges, so that inside a block steps
pipeline as in training. Overhead = median over block pairs of (on-block time / off-block time) - 1. Timing
separate runs instead (earlier versions of this script) measured the machine: the same configuration's
median step moved by 5-10 % between runs on the H200 and by up to 1.6x on a shared CPU.

Configurations (`--configs`), each one fit:
    stability   InstabilityDetector + GradientSnapshots + SinkhornScheduler
    detector / snapshots / scheduler   one alone
    sinkhorn    no callback: the Sinkhorn count itself, the model's count in off blocks and
                `--scheduled-iters` in on blocks (the scheduler's decisions cost this, not its mechanics)

A snapshot every `every_n_steps` (default 500) is timed once in the steady state (the ring full, so that it
writes into the evicted snapshot's buffers) and amortised; the first `keep` snapshots of a fit also allocate
their pinned buffers (reported apart). While switched off the
callbacks see nothing; the Sinkhorn count the scheduler set stays in force, so off and on blocks do the same
model work. Generated text: no downloads.

    python -m bench callbacks --threads 1 [--configs stability,detector]
    python -m bench callbacks --accelerator gpu --block 5 --pairs 40
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from bench import harness
from mhc_lightning.callbacks import GradientSnapshots, InstabilityDetector, SinkhornScheduler
from mhc_lightning.data import ByteTextDataModule
from mhc_lightning.data.synthetic import english_like_text
from mhc_lightning.model import GPTConfig, HyperConfig
from mhc_lightning.training.module import LitLM, OptimConfig

CONFIGS = ("stability", "detector", "snapshots", "scheduler", "sinkhorn")
_ALWAYS = ("setup", "teardown", "on_train_start", "on_train_end", "on_exception")  # forwarded in every block
_PER_STEP = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)


def make_corpus(path: Path, n_bytes: int = 2_000_000) -> Path:
    """English-like text, so the benchmark needs no download (the GPU host is offline)."""
    path.write_text(english_like_text(n_bytes))
    return path


def set_sinkhorn(pl_module, iters: int) -> None:
    for layer in pl_module.model.sublayers:
        if getattr(layer, "mode", None) == "mhc":
            layer.sinkhorn_iters = iters


class PairedBlocks(L.Callback):
    """Forwards the Lightning hooks to `inner` only in "on" blocks, and times every block."""

    def __init__(self, inner: list, block: int, warmup: int, cuda: bool, on_switch=None):
        self.inner, self.block, self.warmup, self.cuda, self.on_switch = inner, block, warmup, cuda, on_switch
        self.blocks: list[dict] = []  # {"index", "on", "seconds", "steps", "hook_s"}
        self.active = True
        self._t = None
        self._hook_s = 0.0
        for name in _ALWAYS + _PER_STEP:
            setattr(self, name, self._forward(name))

    def is_on(self, step: int) -> bool:
        """On during the (untimed) warm-up, so that the first snapshot and the detector's windows start there."""
        return step < self.warmup or ((step - self.warmup) // self.block) % 4 in (1, 2)

    def _edge(self, trainer, pl_module) -> None:
        step = trainer.global_step
        if step < self.warmup or (step - self.warmup) % self.block:
            return  # the warm-up keeps active = True
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self._t is not None:
            self.blocks.append(
                {
                    "index": (step - self.warmup) // self.block - 1,
                    "on": self.active,
                    "seconds": now - self._t,
                    "steps": self.block,
                    "hook_s": self._hook_s,
                }
            )
        self._t, self._hook_s = now, 0.0
        on = self.is_on(step)
        if on != self.active and self.on_switch is not None:
            self.on_switch(pl_module, on)
        self.active = on

    def _forward(self, name: str):
        def hook(trainer, pl_module, *args, **kwargs):
            if name == "on_train_batch_start":
                self._edge(trainer, pl_module)
            if name in _PER_STEP and not self.active:
                return
            t0 = time.perf_counter()
            for cb in self.inner:
                getattr(cb, name)(trainer, pl_module, *args, **kwargs)
            if name in _PER_STEP:
                self._hook_s += time.perf_counter() - t0

        return hook

    def pairs(self) -> list[float]:
        """on/off time ratio of each complete (off, on) pair, in block order: 0-1, 2-3, ..."""
        by_index = {b["index"]: b for b in self.blocks}
        out = []
        for i in range(0, max(by_index, default=-1), 2):
            a, b = by_index.get(i), by_index.get(i + 1)
            if a and b and a["on"] != b["on"]:
                on, off = (a, b) if a["on"] else (b, a)
                out.append(on["seconds"] / off["seconds"])
        return out


class TimeOneSnapshot(L.Callback):
    """At `step` (after the last block): fills the ring first (those snapshots allocate their pinned buffers, once
    per fit, timed as `first_seconds`), then times one snapshot in the steady state: it reuses the buffers of the
    snapshot it evicts."""

    def __init__(self, snaps: GradientSnapshots, step: int, cuda: bool):
        self.snaps, self.step, self.cuda, self.seconds, self.first_seconds = snaps, step, cuda, None, []

    def _timed(self, trainer, pl_module, batch, batch_idx) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.snaps._take(trainer, pl_module, batch, batch_idx)
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            while len(self.snaps.ring) < self.snaps.ring.maxlen:
                self.first_seconds.append(self._timed(trainer, pl_module, batch, batch_idx))
            self.seconds = self._timed(trainer, pl_module, batch, batch_idx)


def run(args, config: str, corpus: Path) -> dict:
    L.seed_everything(0, verbose=False)
    arch = GPTConfig(
        n_layers=args.layers,
        d_model=args.width,
        n_heads=args.heads,
        context=args.seq,
        hyper=HyperConfig(residual_mode="mhc", n_streams=4, sinkhorn_iters=args.iters),
    )
    model = LitLM(arch=arch, optim=OptimConfig(lr=args.lr), diagnostics_every=args.diagnostics_every)
    data = ByteTextDataModule(corpus=str(corpus), seq_len=args.seq, batch_size=args.batch)
    cuda = args.accelerator == "gpu"
    inner = {
        "stability": lambda: [InstabilityDetector(), GradientSnapshots(), SinkhornScheduler()],
        "detector": lambda: [InstabilityDetector()],
        "snapshots": lambda: [GradientSnapshots()],
        "scheduler": lambda: [SinkhornScheduler()],
        "sinkhorn": lambda: [],
    }[config]()
    on_switch = None
    if config == "sinkhorn":

        def on_switch(pl_module, on):
            set_sinkhorn(pl_module, args.scheduled_iters if on else args.iters)

    blocks = PairedBlocks(inner, args.block, args.warmup, cuda, on_switch)
    last = args.warmup + 2 * args.pairs * args.block  # the last block closes at this step's start
    snaps = next((c for c in inner if isinstance(c, GradientSnapshots)), None)
    timed_snap = [TimeOneSnapshot(snaps, last, cuda)] if snaps is not None else []
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        max_steps=last + 1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        callbacks=[blocks, *timed_snap],
    )
    trainer.fit(model, datamodule=data)
    ratios = blocks.pairs()
    on = [b for b in blocks.blocks if b["on"]]
    off = [b for b in blocks.blocks if not b["on"]]
    out = {
        "config": config,
        "pairs": len(ratios),
        "pair_ratios": ratios,
        "overhead_median": statistics.median(ratios) - 1,
        "overhead_mean": statistics.fmean(ratios) - 1,
        "step_s_off": sum(b["seconds"] for b in off) / sum(b["steps"] for b in off),
        "step_s_on": sum(b["seconds"] for b in on) / sum(b["steps"] for b in on),
        "hook_share": sum(b["hook_s"] for b in on) / sum(b["seconds"] for b in on),
        "events": len(model.stability_channel.events) if hasattr(model, "stability_channel") else 0,
        "blocks": blocks.blocks,
    }
    if snaps is not None:
        out["snapshot_s"] = timed_snap[0].seconds
        out["snapshot_first_s"] = timed_snap[0].first_seconds
        out["snapshot_every"] = snaps.every_n_steps
        out["snapshot_amortised"] = out["snapshot_s"] / snaps.every_n_steps / out["step_s_off"]
    scheduler = next((c for c in inner if isinstance(c, SinkhornScheduler)), None)
    if scheduler is not None:
        out["sinkhorn_iters_final"] = list(scheduler.iters)
        out["sinkhorn_history"] = [(s, sum(i) / len(i)) for s, i in scheduler.history]
    return out


COLUMNS = [
    ("config", "configuration", ""),
    ("step_ms_off", "step off ms", ".2f"),
    ("step_ms_on", "step on ms", ".2f"),
    ("overhead_pct", "overhead %", "+.2f"),
    ("iqr_pct", "IQR of pairs %", ""),
    ("hook_pct", "in hooks %", ".2f"),
    ("snapshot_ms", "snapshot ms", ".0f"),
    ("snapshot_pct", "snapshot %", "+.2f"),
    ("total_pct", "total %", "+.2f"),
    ("events", "events", "d"),
]


def main(argv=None) -> int:
    p = harness.parser("callbacks", __doc__)
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--precision", default=None, help="default: 32-true on cpu, bf16-mixed on gpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--iters", type=int, default=20, help="the model's Sinkhorn iterations")
    p.add_argument(
        "--lr",
        type=float,
        default=OptimConfig.lr,
        help="lower it for wide models: events (skipped steps) make on and off blocks differ",
    )
    p.add_argument("--configs", default="stability", help="comma-separated, from " + ", ".join(CONFIGS))
    p.add_argument("--scheduled-iters", type=int, default=44, help="the sinkhorn configuration's on-block count")
    p.add_argument("--block", type=int, default=10, help="optimizer steps per block")
    p.add_argument("--pairs", type=int, default=10, help="(off, on) block pairs per configuration (made even)")
    p.add_argument("--warmup", type=int, default=20, help="steps before the first block")
    p.add_argument("--diagnostics-every", type=int, default=25, help="the module default")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--corpus", default=None, help="text file (default: generated)")
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        p.error(f"--configs: expected names from {', '.join(CONFIGS)}; got {args.configs!r}")
    for name in ("block", "pairs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    args.pairs += args.pairs % 2
    if args.warmup + 2 * args.pairs * args.block >= GradientSnapshots().every_n_steps:
        p.error(
            "warmup + 2 * pairs * block must stay below the snapshot interval (500): a periodic snapshot "
            "would land in one block; it is timed separately"
        )
    args.precision = args.precision or ("bf16-mixed" if args.accelerator == "gpu" else "32-true")
    if args.threads:
        torch.set_num_threads(args.threads)
    report = harness.Report("callbacks", args, argv or [], "cuda" if args.accelerator == "gpu" else "cpu")
    report.env["threads"] = torch.get_num_threads()
    model = {
        "layers": args.layers,
        "width": args.width,
        "seq": args.seq,
        "batch": args.batch,
        "streams": 4,
        "sinkhorn_iters": args.iters,
        "mode": "mhc",
        "precision": args.precision,
    }
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(args.corpus) if args.corpus else make_corpus(Path(tmp) / "corpus.txt")
        for config in configs:
            r = run(args, config, corpus)
            q = statistics.quantiles([x - 1 for x in r["pair_ratios"]], n=4) if r["pairs"] > 1 else [0, 0, 0]
            r.update(
                model,
                step_ms_off=1e3 * r["step_s_off"],
                step_ms_on=1e3 * r["step_s_on"],
                overhead_pct=100 * r["overhead_median"],
                iqr_pct=f"{100 * q[0]:+.2f}..{100 * q[2]:+.2f}",
                hook_pct=100 * r["hook_share"],
                total_overhead=r["overhead_median"] + r.get("snapshot_amortised", 0.0),
            )
            r["total_pct"] = 100 * r["total_overhead"]
            if "snapshot_s" in r:
                r.update(snapshot_ms=1e3 * r["snapshot_s"], snapshot_pct=100 * r["snapshot_amortised"])
            report.add(r)
    device = report.env["gpu"] if args.accelerator == "gpu" else "cpu"
    print(
        f"\nstability callbacks at defaults, {device} ({args.accelerator}, {args.precision}, "
        f"{torch.get_num_threads()} threads), mHC n=4 L={2 * args.layers} C={args.width} seq={args.seq} "
        f"batch={args.batch}; {args.pairs} pairs of {args.block}-step blocks per configuration"
    )
    harness.print_table(report.rows, COLUMNS)
    print(
        "overhead = median over pairs of on/off block time - 1; in hooks = time inside the callbacks' hooks in "
        "on blocks (on CUDA it includes waiting for the GPU at a sync); snapshot = one warm snapshot, amortised "
        "over every_n_steps"
    )
    print("wrote", report.save())
    return 0
