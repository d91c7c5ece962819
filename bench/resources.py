"""Registers, spills and shared memory of every fused Triton kernel as the model's GPU run compiles it (needs a GPU).

    python -m bench resources [--c 1024] [--batch 8] [--seq 2048] [--modes mhc,mhc-rebuilt,hc]

Runs one forward + backward of the GPT per mode (the model class, 2 blocks at the trainer's width and tokens, bf16
autocast, fused kernels in eager mode: the launches the trainer makes) with a fresh Triton cache, then reads every
kernel Triton compiled into it: registers per thread, stack frame (spills) and local memory from its cubin
(cuobjdump, shipped with Triton), shared memory and warps from Triton's metadata, and how many CTAs an SM can hold by
registers and by shared memory (the driver reserves 1 KiB of shared memory per CTA), and the mode whose run first
compiled it. Too many registers cap the CTAs per SM; a stack frame turns register traffic into local-memory traffic.
A kernel compiled for several specialisations (dtypes, divisibility, constexprs) has one row each.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from bench import harness

MODES = {
    "mhc": dict(residual_mode="mhc"),
    "mhc-rebuilt": dict(residual_mode="mhc", rebuild_branch_input=True),
    "mhc-per-sublayer": dict(residual_mode="mhc", chain_sublayers=False),
    "hc": dict(residual_mode="hc", bias_init="hc_identity"),
}
RESERVED_SHARED_PER_CTA = 1024
COLUMNS = [
    ("kernel", "kernel", ""),
    ("registers", "regs", "d"),
    ("stack_bytes", "stack", "d"),
    ("local_bytes", "local", "d"),
    ("shared_bytes", "smem", "d"),
    ("num_warps", "warps", "d"),
    ("num_stages", "stages", ""),
    ("ctas_per_sm_by_registers", "CTAs/SM regs", "d"),
    ("ctas_per_sm_by_shared", "CTAs/SM smem", "d"),
    ("compiled_in", "compiled in", ""),
]


def resource_usage(cuobjdump_text: str) -> dict:
    """Registers, stack and local bytes of the (one) function in `cuobjdump --dump-resource-usage` output."""

    def field(name):
        m = re.search(rf"{name}:(\d+)", cuobjdump_text)
        return int(m.group(1)) if m else None

    return dict(registers=field("REG"), stack_bytes=field("STACK"), local_bytes=field("LOCAL"))


def cuobjdump() -> str:
    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else (shutil.which("cuobjdump") or "cuobjdump")


def compiled_kernels(cache: Path) -> list[dict]:
    """Every cubin in Triton's cache folder, with its metadata and resource usage."""
    props = torch.cuda.get_device_properties(0)
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    shared_per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    rows = []
    for cubin in sorted(cache.glob("*/*.cubin")):
        meta = json.loads(cubin.with_suffix(".json").read_text())
        out = subprocess.run(
            [cuobjdump(), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
        r = dict(
            kernel=meta.get("name", cubin.stem),
            hash=cubin.parent.name,
            num_warps=meta.get("num_warps"),
            num_stages=meta.get("num_stages"),
            maxnreg=meta.get("maxnreg"),
            shared_bytes=meta.get("shared", 0),
            **resource_usage(out),
        )
        if r["registers"] and r["num_warps"]:
            r["ctas_per_sm_by_registers"] = regs_per_sm // (r["registers"] * 32 * r["num_warps"])
        r["ctas_per_sm_by_shared"] = shared_per_sm // (r["shared_bytes"] + RESERVED_SHARED_PER_CTA)
        rows.append(r)
    return rows


def run_modes(modes: list[str], args) -> dict[str, str]:
    """One forward + backward of the GPT per mode; returns kernel hash -> the mode whose run first compiled it (a later
    mode reuses the kernels already compiled in this process)."""
    from mhc_lightning.model import GPT, GPTConfig, HyperConfig

    seen: dict[str, str] = {}
    for mode in modes:
        before = {p.name for p in Path(os.environ["TRITON_CACHE_DIR"]).glob("*")}
        hyper = HyperConfig(n_streams=4, kernel_backend="triton", **MODES[mode])
        model = GPT(GPTConfig(n_layers=2, d_model=args.c, n_heads=args.c // 64, context=args.seq, hyper=hyper)).cuda()
        idx = torch.randint(0, 256, (args.batch, args.seq), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx).float().square().mean()
        loss.backward()
        torch.cuda.synchronize()
        for p in Path(os.environ["TRITON_CACHE_DIR"]).glob("*"):
            if p.name not in before:
                seen[p.name] = mode
        del model, loss
        torch.cuda.empty_cache()
    return seen


def main(argv=None) -> int:
    p = harness.parser("resources", __doc__)
    p.add_argument("--c", type=int, default=1024, help="the model's width (launch configurations depend on it)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--modes", default="mhc,mhc-rebuilt,hc", help=f"comma-separated, from {', '.join(MODES)}")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        p.error(f"--modes: {', '.join(unknown) or 'none'}; allowed: {', '.join(MODES)}")
    if args.c % 64:
        p.error(f"--c {args.c}: a multiple of 64 (64 channels per head)")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device: the kernels are read as the GPU run compiles them")
    report = harness.Report("resources", args, argv or [], "cuda")
    with tempfile.TemporaryDirectory(prefix="bench_triton_cache_") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # read when Triton first compiles: only this run's kernels land there
        import triton

        if hasattr(triton, "knobs"):  # Triton >= 3.4 may have read the variable already
            triton.knobs.cache.dir = cache
        seen = run_modes(modes, args)
        for row in compiled_kernels(Path(cache)):
            row["compiled_in"] = seen.get(row["hash"])
            report.rows.append(row)
    harness.print_table(report.rows, COLUMNS)
    print("wrote", report.save())
    return 0
