"""Selective recompute (docs/design.md §9): the activation bytes kept for the backward, and the step's cost.

One GPT (default: mHC, 24 sublayers, C = 256, n = 4) is run with GPTConfig.recompute_block = 0 (off) and
each block size in --blocks ("auto" = L_r*). Per configuration: bytes of activation memory alive between
forward and backward per token (model/recompute.live_activation_bytes: every storage the forward created and
autograd still holds, counted once), the CUDA peak on a GPU, and the median forward + backward time.
For the no-recompute row, saved_tensors_hooks give the same bytes (a cross-check).

    python -m bench recompute [--device cuda] [--autocast] [--blocks 1,2,auto,6,12,24] [--steps 0]
"""

from __future__ import annotations

import math
import statistics
import time

import torch
import torch.nn.functional as F

from bench import harness
from mhc_lightning.model import GPT, GPTConfig, HyperConfig
from mhc_lightning.model.recompute import live_activation_bytes, saved_tensor_bytes


def step(m: GPT, idx: torch.Tensor, args) -> torch.Tensor:
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=args.autocast):
        return F.cross_entropy(m(idx).flatten(0, 1).float(), idx.flatten())


def hooked_bytes(m: GPT, idx: torch.Tensor, args) -> int:
    """Bytes of the tensors autograd saves, one count per storage, parameters and buffers left out."""
    with saved_tensor_bytes(exclude=list(m.parameters()) + list(m.buffers())) as saved:
        loss = step(m, idx, args)
    loss.backward()
    return saved["bytes"]


def measure(m: GPT, idx: torch.Tensor, args) -> dict:
    m.zero_grad(set_to_none=True)
    with live_activation_bytes(exclude=list(m.parameters()) + list(m.buffers())) as live:
        loss = step(m, idx, args)
    loss.backward()
    out = {"bytes_per_token": live["bytes"] / idx.numel()}
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(m, idx, args).backward()
        out["cuda_peak_above_params_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    if not args.steps:  # memory only (e.g. the fused kernels under the Triton interpreter)
        return {**out, "step_ms": None}
    times = []
    for i in range(args.warmup + args.steps):
        m.zero_grad(set_to_none=True)
        harness.sync(args.device)
        t0 = time.perf_counter()
        step(m, idx, args).backward()
        harness.sync(args.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    out["step_ms"] = 1e3 * statistics.median(times)
    return out


COLUMNS = [
    ("L_r", "L_r", ""),
    ("kib_per_token", "KiB/token", ".1f"),
    ("x_off_bytes", "vs off", ".2f"),
    ("dropped_kib_per_token", "stream x_l dropped KiB", ".1f"),
    ("step_ms", "step ms", ".1f"),
    ("x_off_ms", "vs off", ".2f"),
]


def main(argv=None) -> int:
    p = harness.parser("recompute", __doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", default="mhc")
    p.add_argument("--backend", default="auto", help="kernel_backend: auto = fused on CUDA, reference on CPU")
    p.add_argument("--layers", type=int, default=12, help="blocks; sublayers L = 2 * layers")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--blocks", default="1,2,auto,6,12,24")
    p.add_argument("--autocast", action="store_true", help="bf16 autocast (stream_dtype auto -> bf16 stream)")
    p.add_argument("--steps", type=int, default=5, help="timed steps; 0 = measure memory only")
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)

    torch.manual_seed(0)
    hyper = HyperConfig(residual_mode=args.mode, kernel_backend=args.backend)
    cfg = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads, context=args.seq, hyper=hyper)
    L, n, C = cfg.n_sublayers, hyper.streams, args.width
    ref = GPT(cfg).to(args.device)
    idx = torch.randint(0, 256, (args.batch, args.seq), device=args.device)
    elem = 2 if args.autocast else 4
    report = harness.Report("recompute", args, argv or [], args.device)
    meta = {
        "mode": args.mode,
        "L": L,
        "C": C,
        "n": n,
        "tokens": idx.numel(),
        "backend": args.backend,
        "autocast_bf16": args.autocast,
    }
    for block in ["0"] + args.blocks.split(","):
        cfg.recompute_block = block if block == "auto" else int(block)
        m = GPT(cfg).to(args.device)
        m.load_state_dict(ref.state_dict())
        r = {**meta, "recompute_block": block, "L_r": m.recompute_block, **measure(m, idx, args)}
        if m.recompute_block:  # §9: the x_l of the sublayers that start no block are no longer kept
            r["stream_bytes_dropped_per_token"] = (L - math.ceil(L / m.recompute_block)) * n * C * elem
            r["dropped_kib_per_token"] = r["stream_bytes_dropped_per_token"] / 1024
        if block == "0":
            r["saved_tensors_hooks_bytes_per_token"] = hooked_bytes(m, idx, args) / idx.numel()
        report.add(r)
    plain = report.rows[0]
    for r in report.rows:
        r["kib_per_token"] = r["bytes_per_token"] / 1024
        r["x_off_bytes"] = r["bytes_per_token"] / plain["bytes_per_token"]
        if r["step_ms"] and plain["step_ms"]:
            r["x_off_ms"] = r["step_ms"] / plain["step_ms"]
        if r["recompute_block"] == "auto":
            r["L_r"] = f"{r['L_r']}*"
    print(
        f"\n{args.mode}, L={L}, C={C}, n={n}, tokens={idx.numel()}, {args.device}, backend={args.backend}, "
        f"{'bf16 autocast' if args.autocast else 'fp32'}; torch {torch.__version__}"
    )
    harness.print_table(report.rows, COLUMNS)
    print("wrote", report.save())
    return 0
