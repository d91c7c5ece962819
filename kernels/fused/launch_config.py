"""The launch table: each kernel's tiles and launch options (`CONFIG`), and `MHC_KERNEL_CONFIG`, which overrides them
for one process (docs/kernels.md, "The launch table").

Entries hold numbers only: tiles (BT tokens or rows, BK / BC / BL / BR / BP elements), num_warps, num_stages, the
software-pipelining depth of a kernel's main loop (loop_stages; None: Triton's default), programs per SM, a register
cap (maxnreg), and the C thresholds of the two shape rules (u_inside_max_c, rows_max_c). A nested entry is a second
tile set of the same kernel, taken by a dtype or shape rule in the op that launches it. Tiles shrink to the problem
where the op asks (`tiles`).
"""
import json
import os
from typing import Optional

from .host import INTERPRET

CONFIG = {
    # the mHC coefficient kernel (x phi, sum x^2, gates, u, Sinkhorn): BK tiles the flat n*C row, BC the C loop of u,
    # which this kernel sums while the token block is still in L2 (C <= u_inside_max_c; above, stream_pre's kernel)
    "coef_fwd": dict(BT=64, BK=128, num_warps=8, num_stages=3, BC=16, u_inside_max_c=1024,
                     # an fp32 phi beside 16-bit x as pairs (the trainer's): a dot twice as wide, u after the kernel
                     pairs=dict(BT=64, BK=64, num_warps=4, num_stages=5, u_inside_max_c=0),
                     # a phi of another 16-bit dtype than x's as tf32: fp32 operand tiles, BK 128 spills
                     tf32=dict(BT=128, BK=64, num_warps=4, u_inside_max_c=0)),
    # HC's projection (one stream per row, K = C) with its tail, and rms_proj: the fastest tile in HC's trainer
    "rms_proj": dict(BT=128, BK=64, num_warps=8, num_stages=3),
    # HC's tail backward (a few floats per row; BC: C tile of hc_enter's <du, x_i>): not swept
    "hc_tail_bwd": dict(BT=128, num_warps=4, BC=64),
    # Sinkhorn in its own launch: small token blocks, so no serial tail waits behind a GEMM loop
    "coef_tail": dict(BT=8, num_warps=2),
    # the per-token backward: one warp keeps the Sinkhorn tiles' reductions in shuffles; its <du, x_j> loop unpipelined
    "coef_bwd_tok": dict(BT=4, num_warps=1, BC=64, loop_stages=None),
    # mHC's x pass: capped at 128 registers (4 CTAs per SM instead of 2), every load of the token loop pipelined
    "coef_bwd_x": dict(BT=64, BK=64, num_warps=4, num_stages=2, programs_per_sm=12, maxnreg=128, loop_stages=2),
    # the same kernel on one-stream rows (HC, rms_proj's backward, n = 1): the cap as mHC's, timed on HC's trainer
    "hc_bwd_x": dict(BT=64, BK=64, num_warps=4, num_stages=2, programs_per_sm=8, maxnreg=128, loop_stages=None),
    # stream_pre's streaming kernels (memory-bound: a few tokens by a wide C block per program)
    "pre_fwd": dict(BT=4, BC=512, num_warps=4),
    "pre_bwd": dict(BT=4, BC=256, num_warps=4),
    # the write-back's forward (memory-bound, as stream_pre's)
    "post_fwd": dict(BT=4, BC=256, num_warps=4),
    # the write-back's backward: whole rows up to rows_max_c (no partials to sum), walked in a pipelined loop by a few
    # programs per SM (fewer when it also writes u: more registers); above, per-C-block partials, unlooped
    "post_bwd": dict(BT=4, BC=256, num_warps=4, rows_max_c=1024, loop_stages=0, programs_per_sm=8, u_programs_per_sm=8,
                     rows=dict(BT=1, BC=1024, num_warps=4, loop_stages=2, programs_per_sm=7, u_programs_per_sm=5)),
    # the partial sums of the parameter gradients: BL elements per program, BP partial rows per step; not swept
    "param_sum": dict(BL=256, BP=256, num_warps=4),
    # HC's nine parameters made into its kernels' operands and back: BR channels per program; not swept
    "hc_operands": dict(BR=128, num_warps=4),
    # RoPE on the qkv projection: BR tokens per program (memory-bound elementwise passes); not swept
    "rope": dict(BR=64, num_warps=4),
    # the stream's ends (copies): BT rows, BC channels per program; not swept
    "stream_ends": dict(BT=4, BC=512, num_warps=4),
}

# Under the Triton interpreter a kernel's programs run one after another in Python, so the GPU's small token tiles cost
# their number of programs in CPU time: 32 tokens per program there (the tests' 37 and 38 tokens still take two
# programs, the second ragged). Tests of a particular tile set it themselves; compiled kernels keep CONFIG's tiles.
INTERPRETER_TILES = {"post_bwd": dict(BT=32, rows=dict(BT=32)), "coef_bwd_tok": dict(BT=32), "pre_fwd": dict(BT=32),
                     "pre_bwd": dict(BT=32), "post_fwd": dict(BT=32), "coef_tail": dict(BT=32),
                     "stream_ends": dict(BT=32)}


def tiles(name: str, variant: Optional[str] = None, **caps) -> dict:
    """CONFIG[name] with its nested tile set `variant` merged in, each tile in caps at most its cap (never wider than
    the problem: the caps are powers of 2, at least 16 where a dot needs it)."""
    cfg = dict(CONFIG[name])
    if variant:
        cfg.update(cfg[variant])
    for key, cap in caps.items():
        if key in cfg:
            cfg[key] = min(cfg[key], cap)
    return cfg


def launch_options(cfg: dict) -> dict:
    """The entry's options for Triton's launch itself (maxnreg: a per-thread register cap, ptx .maxnreg)."""
    return {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages", "maxnreg") and v is not None}


def merge(changes: dict, entries: Optional[dict] = None, where: str = "MHC_KERNEL_CONFIG") -> None:
    """{kernel: {key: value}} into CONFIG, nested tile sets key by key. Only CONFIG's kernels and keys, and integers
    (null also for loop_stages: Triton's default pipelining): anything else stops with one line naming what is
    allowed."""
    entries = CONFIG if entries is None else entries
    for name, change in changes.items():
        if name not in entries:
            raise ValueError(f"{where}: unknown kernel {name!r}; allowed: {', '.join(entries)}")
        if not isinstance(change, dict):
            raise ValueError(f"{where}.{name}: expected an object of launch-table keys, got {change!r}")
        entry = entries[name]
        for key, value in change.items():
            if key not in entry:
                raise ValueError(f"{where}.{name}: unknown key {key!r}; allowed: {', '.join(entry)}")
            old = entry[key]
            if isinstance(old, dict):
                merge({key: value}, {key: old}, f"{where}.{name}")
            elif not (_is_number(value) or (value is None and key == "loop_stages")):
                raise ValueError(f"{where}.{name}.{key}: {value!r} is not a number; the launch table holds tiles only")
            else:
                entry[key] = value


def _is_number(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def apply_environment(text: str) -> None:
    """MHC_KERNEL_CONFIG, a JSON object {kernel: {key: value}}, merged into CONFIG at import: a launch config tried in
    whole training runs (python -m bench trainer --kernel-config) without editing this file."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"MHC_KERNEL_CONFIG is not JSON ({exc.msg}); expected e.g. '{{\"coef_fwd\": {{\"BT\": 32}}}}'"
                         ) from None
    if not isinstance(data, dict):
        raise ValueError("MHC_KERNEL_CONFIG must be an object of objects, {kernel: {key: value}}")
    merge(data)


if INTERPRET:
    merge(INTERPRETER_TILES, where="INTERPRETER_TILES")
if os.environ.get("MHC_KERNEL_CONFIG"):
    apply_environment(os.environ["MHC_KERNEL_CONFIG"])
