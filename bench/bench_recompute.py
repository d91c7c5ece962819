"""Selective recompute (docs/design.md §9): activation bytes kept for the backward, and the step-time cost.

One GPT (default: mHC, 24 sublayers, C = 256, n = 4) is run with GPTConfig.recompute_block = 0 (off) and
each block size in --blocks ("auto" = L_r*). Per configuration: bytes of activation memory alive between
forward and backward per token (model/recompute.live_activation_bytes: every storage the forward created and
autograd still holds, counted once), the CUDA peak on a GPU, and the median forward + backward time.
For the no-recompute row, saved_tensors_hooks give the same bytes (printed as a cross-check).
    python bench/bench_recompute.py [--device cuda] [--autocast] [--out bench_recompute.json]
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

from mhc_lightning.model import GPT, GPTConfig, HyperConfig
from mhc_lightning.model.recompute import live_activation_bytes, saved_tensor_bytes


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


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
        sync(args.device)
        t0 = time.perf_counter()
        step(m, idx, args).backward()
        sync(args.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    out["step_ms"] = 1e3 * statistics.median(times)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--out", default="bench_recompute.json")
    args = p.parse_args()

    torch.manual_seed(0)
    hyper = HyperConfig(residual_mode=args.mode, kernel_backend=args.backend)
    cfg = GPTConfig(n_layers=args.layers, d_model=args.width, n_heads=args.heads, context=args.seq, hyper=hyper)
    L, n, C = cfg.n_sublayers, hyper.streams, args.width
    ref = GPT(cfg).to(args.device)
    idx = torch.randint(0, 256, (args.batch, args.seq), device=args.device)
    elem = 2 if args.autocast else 4
    rows = []
    for block in ["0"] + args.blocks.split(","):
        cfg.recompute_block = block if block == "auto" else int(block)
        m = GPT(cfg).to(args.device)
        m.load_state_dict(ref.state_dict())
        r = {"recompute_block": block, "L_r": m.recompute_block, **measure(m, idx, args)}
        if m.recompute_block:  # §9: the x_l of the sublayers that start no block are no longer kept
            r["stream_bytes_dropped_per_token"] = (L - math.ceil(L / m.recompute_block)) * n * C * elem
        if block == "0":
            r["saved_tensors_hooks_bytes_per_token"] = hooked_bytes(m, idx, args) / idx.numel()
        rows.append(r)
        print(r, flush=True)
    plain = rows[0]
    print(f"\n{args.mode}, L={L}, C={C}, n={n}, tokens={idx.numel()}, {args.device}, backend={args.backend}, "
          f"{'bf16 autocast' if args.autocast else 'fp32'}; torch {torch.__version__}")
    print(f"{'L_r':>6} {'KiB/token':>10} {'vs off':>7} {'stream x_l dropped':>19} {'step ms':>9} {'vs off':>7}")
    for r in rows:
        drop = r.get("stream_bytes_dropped_per_token")
        ms = f"{r['step_ms']:9.1f} {r['step_ms'] / plain['step_ms']:7.2f}" if r["step_ms"] else ""
        print(f"{str(r['L_r']) + ('*' if r['recompute_block'] == 'auto' else ''):>6} "
              f"{r['bytes_per_token'] / 1024:10.1f} {r['bytes_per_token'] / plain['bytes_per_token']:7.2f} "
              f"{'' if drop is None else f'{drop / 1024:.1f} KiB':>19} {ms}")
    meta = {"mode": args.mode, "L": L, "C": C, "n": n, "tokens": idx.numel(), "device": args.device,
            "backend": args.backend, "autocast_bf16": args.autocast, "torch": torch.__version__,
            "threads": torch.get_num_threads()}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
