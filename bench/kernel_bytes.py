"""The bytes each fused mHC kernel must move per token, and a profiled kernel's time against them (% of copy).

Each input read once, each output written once, bf16 streams and fp32 coefficients (docs/kernels.md, "Bytes per op").
phi (0.2-0.4 MB, re-read from L2) and the x pass's partial phi gradients (~2 % of its bytes) are left out.
"""

from __future__ import annotations

# each kernel's op, named as its module in kernels/fused/ops (the x pass, projection.py's, is the coefficient op's
# backward; mhc_pre, mhc_enter and mhc_boundary run the coefficient op's kernels)
OP_OF = {
    "_post_fwd": "stream_post_res",
    "_coef_fwd": "mhc_coefficients",
    "_pre_fwd": "stream_pre",
    "_post_bwd_2d": "stream_post_res",
    "_coef_bwd_tok": "mhc_coefficients",
    "_coef_bwd_x": "mhc_coefficients",
    "_expand": "expand_streams",
    "_sum_streams": "sum_streams",
}


def bytes_per_token(c: int, n: int, iters: int, stream_bytes: int = 2, u_bytes: int = 2) -> dict[str, int]:
    """Bytes per token of each kernel at C channels and n streams (`iters` Sinkhorn iterations: the per-token backward
    writes and reads 2 * iters - 1 reciprocal sums of n floats each). u_bytes > stream_bytes: u written and du read in
    the branch's dtype, du's narrow copy written by the per-token pass for the x pass."""
    f32 = 4
    s, u = n * c * stream_bytes, c * stream_bytes  # one n-stream row, one C-wide row
    uw = c * u_bytes  # u / du as the branch takes them
    narrow = u if u_bytes != stream_bytes else 0
    m = n * n + 2 * n  # raw logits per token
    gates = (2 * n + n * n) * f32  # h_pre, h_post, H^res
    return {
        "_post_fwd": s + u + (n + n * n) * f32 + s,  # x, f, h_post, H^res -> x_next
        "_coef_fwd": s + (m + 1) * f32 + gates,  # x -> logits, 1/r, the gates
        "_pre_fwd": s + n * f32 + uw,  # x, h_pre -> u
        "_post_bwd_2d": 2 * s + u + (n + n * n) * f32 + s + u + (n + n * n) * f32,  # G, x, f, gates -> dx, df, dgates
        "_coef_bwd_tok": uw + narrow + s + (m + 1 + n + n * n) * f32 + (m + 1) * f32 + 2 * (2 * iters - 1) * n * f32,
        "_coef_bwd_x": 2 * s + u + (m + 1 + n) * f32 + s,  # x, dx_in, du, dL, d(sum x^2), h_pre -> dx
        # the stream's ends, twice a step each: fp32 embedding (or its gradient) <-> the n streams
        "_expand": c * f32 + s,
        "_sum_streams": s + c * f32,
    }


def efficiency(
    kernels: list[dict], tokens: int, c: int, n: int, iters: int, copy_tbps: float, u_bytes: int = 2
) -> list[dict]:
    """One row per fused kernel among `kernels` (profiler rows: name, us_per_step, calls_per_step): MB per call, its
    floor at copy bandwidth, the measured us per call, % of copy, and ms per step measured and at the floor."""
    seen = {r["name"]: r for r in kernels}
    rows = []
    for name, per_token in bytes_per_token(c, n, iters, u_bytes=u_bytes).items():
        r = seen.get(name)
        if r is None or not r["calls_per_step"]:
            continue
        calls = r["calls_per_step"]
        nbytes = per_token * tokens
        floor_us = nbytes / (copy_tbps * 1e12) * 1e6
        us = r["us_per_step"] / calls
        rows.append(
            dict(
                op=OP_OF[name],
                kernel=name,
                mb_per_call=nbytes / 1e6,
                floor_us=floor_us,
                us=us,
                pct_copy=100 * floor_us / us,
                calls_per_step=calls,
                floor_ms_per_step=floor_us * calls / 1e3,
                ms_per_step=r["us_per_step"] / 1e3,
            )
        )
    return rows


def total(rows: list[dict]) -> dict:
    """The kernels together: ms per step measured and at the floor, and their ratio as % of copy."""
    floor, ms = sum(r["floor_ms_per_step"] for r in rows), sum(r["ms_per_step"] for r in rows)
    pct = 100 * floor / ms if ms else None
    return dict(op="all", kernel="all", floor_ms_per_step=floor, ms_per_step=ms, pct_copy=pct)
