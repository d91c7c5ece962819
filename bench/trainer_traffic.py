"""Each fused mHC kernel of a profiled trainer step against the bytes it must move: its share of copy bandwidth, and
what the whole step would cost if every kernel ran at copy speed (issue 13's "every kernel >= 70 % of copy").

    python bench/trainer_traffic.py BENCH_DDP_JSON --copy-tbps 4.17 [--variant mhc] [--u-bytes 2] [--out traffic.json]

Reads `bench/bench_ddp.py --profile N`'s JSON (device time per kernel per step, the run's shape). Bytes are the
stream-sized traffic per token of the eager one-sublayer-at-a-time path (docs/kernels.md, "Bytes per op"): each
input read once, each output written once, bf16 streams and fp32 coefficients as the trainer holds them. phi (0.2-0.4
MB, re-read from L2) and the x pass's partial phi gradients (~2 % of its bytes) are left out. --copy-tbps: the copy
bandwidth measured on the same GPU (bench_mhc.py prints it; round 14's H200: 4.17 TB/s). u and du are as wide as
the branch takes them (ops CONFIG "u", since round 28): 4 bytes under bf16-mixed unless the variant's kernel config
turns "u" branch_dtype off; --u-bytes 2 for runs from before (torch's cast around the op then).
"""
import argparse
import json
import sys


def bytes_per_token(c: int, n: int, iters: int, stream_bytes: int = 2, u_bytes: int = 2) -> dict[str, int]:
    """Bytes per token of each kernel at C channels and n streams (`iters` Sinkhorn iterations: the per-token
    backward writes and reads 2 * iters - 1 reciprocal sums of n floats each). u_bytes > stream_bytes: u written
    and du read in the branch's dtype, du's narrow copy written by the per-token pass for the x pass."""
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


def u_bytes_of(bench: dict) -> int:
    """u's bytes per element in a run since round 28: fp32 where bf16-mixed gives the branch fp32 parameters and a bf16
    stream, unless its kernel config turned "u" branch_dtype off."""
    config = json.loads(bench.get("kernel_config") or "{}")
    wide = bench.get("precision") == "bf16-mixed" and config.get("u", {}).get("branch_dtype", True)
    return 4 if wide else 2


def table(bench: dict, profile: dict, copy_tbps: float, n: int, iters: int, u_bytes: int) -> list[dict]:
    """One row per kernel the profile saw: MB per call, floor and measured us per call, % of copy, ms per step."""
    tokens, c = bench["tokens_per_step"], bench["d_model"]
    seen = {r["name"]: r for r in profile["top"]}
    rows = []
    for name, per_token in bytes_per_token(c, n, iters, u_bytes=u_bytes).items():
        r = seen.get(name)
        if r is None:
            continue
        calls = r["calls_per_step"]
        nbytes = per_token * tokens
        floor_us = nbytes / (copy_tbps * 1e12) * 1e6
        us = r["us_per_step"] / calls
        rows.append(dict(kernel=name, mb_per_call=nbytes / 1e6, floor_us=floor_us, us=us, pct_copy=100 * floor_us / us,
                         calls_per_step=calls, floor_ms_per_step=floor_us * calls / 1e3,
                         ms_per_step=r["us_per_step"] / 1e3))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bench_ddp_json")
    p.add_argument("--copy-tbps", type=float, required=True, help="copy bandwidth of the GPU, TB/s")
    p.add_argument("--variant", action="append", default=None,
                   help="profiled variant(s) to tabulate (default: every one whose profile has these kernels)")
    p.add_argument("--streams", type=int, default=4, help="n, the model's stream count")
    p.add_argument("--iters", type=int, default=20, help="Sinkhorn iterations of the run")
    p.add_argument("--u-bytes", type=int, choices=(2, 4), default=None,
                   help="bytes per element of u and du for every variant (default: each run's own, since round 28; "
                        "2 for runs from before)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.copy_tbps <= 0:
        p.error(f"--copy-tbps: {args.copy_tbps}; allowed: a bandwidth above 0 (TB/s)")
    with open(args.bench_ddp_json) as fh:
        data = json.load(fh)
    profiles = data.get("profile") or {}
    if not profiles:
        p.error(f"{args.bench_ddp_json}: no profile; allowed: the JSON of `bench_ddp.py --profile N`")
    unknown = sorted(set(args.variant or ()) - set(profiles))
    if unknown:
        p.error(f"--variant: {', '.join(unknown)} not profiled; allowed: {', '.join(profiles)}")
    out = {}
    for variant in args.variant or list(profiles):
        bench = data["bench"][f"{variant}-1"]
        u_bytes = args.u_bytes or u_bytes_of(bench)
        rows = table(bench, profiles[variant], args.copy_tbps, args.streams, args.iters, u_bytes)
        if not rows:
            continue
        floor, ms = sum(r["floor_ms_per_step"] for r in rows), sum(r["ms_per_step"] for r in rows)
        out[variant] = dict(rows=rows, floor_ms_per_step=floor, ms_per_step=ms, tokens=bench["tokens_per_step"],
                            C=bench["d_model"], streams=args.streams, copy_tbps=args.copy_tbps, u_bytes=u_bytes)
        print(f"\n{variant}: {bench['tokens_per_step']} tokens, C = {bench['d_model']}, n = {args.streams}, "
              f"copy {args.copy_tbps:.2f} TB/s, u {u_bytes} bytes")
        print(f"{'kernel':<16} {'MB/call':>8} {'floor us':>9} {'us':>8} {'% copy':>7} {'floor ms':>9} {'ms/step':>8}")
        for r in rows:
            print(f"{r['kernel']:<16} {r['mb_per_call']:8.0f} {r['floor_us']:9.1f} {r['us']:8.1f} {r['pct_copy']:7.0f} "
                  f"{r['floor_ms_per_step']:9.2f} {r['ms_per_step']:8.2f}")
        print(f"{'all':<16} {'':>8} {'':>9} {'':>8} {100 * floor / ms:7.0f} {floor:9.2f} {ms:8.2f}")
    if not out:
        print("no fused mHC kernel in the profiles (residual or HC runs only?)", file=sys.stderr)
        return 1
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(source=args.bench_ddp_json, variants=out), fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
