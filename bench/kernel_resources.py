"""Registers, spills and shared memory of every fused kernel at its launch configuration, without a GPU.

    python bench/kernel_resources.py [--arch 90] [--out kernel_resources.json]

Each kernel is compiled ahead of time by Triton for the target (sm_90 = H100 / H200) with the constexprs the ops
pass on the model's path (bf16 stream, n = 4, ops.CONFIG's tiles at C = 1024), and the PTX is assembled with
the ptxas that ships with Triton. Too many registers per thread cap the CTAs an SM can hold (65536
registers per SM), and a stack frame (spills) turns register traffic into local-memory traffic: both are read
before a GPU run. cuobjdump (shipped with Triton) reads the cubin Triton assembled. Pointers and the integers a launch
specialises carry the 16-divisibility a real launch gives them (`divisible_args`). Use the GPU machine's Triton
(3.6: `pip install --target DIR triton==3.6.0` and PYTHONPATH=DIR): so run, it matched ncu's register counts on the
H200 (round 11, docs/kernels.md); another Triton version compiles another program.
"""
import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mhc_lightning.kernels.fused import launch_config as ops
from mhc_lightning.kernels.fused.hc import _hc_tail_bwd
from mhc_lightning.kernels.fused.mhc import _coef_bwd_tok, _coef_fwd
from mhc_lightning.kernels.fused.projection import DOT_NATIVE, DOT_TF32, _coef_bwd_x
from mhc_lightning.kernels.fused.read_out import _pre_bwd, _pre_fwd
from mhc_lightning.kernels.fused.sinkhorn import _coef_tail
from mhc_lightning.kernels.fused.write_back import _post_bwd_2d, _post_fwd

FLOATS = {"eps", "rms_eps", "pre_eps", "post_mult", "inv_c"}
# sm_90's shared memory per SM (228 KiB) and what the driver reserves per CTA (1 KiB; ncu's "Driver Shared Memory Per
# Block"): a pipelined loop's async-copy buffers can cap the CTAs per SM below the registers' limit
SHARED_PER_SM, SHARED_RESERVED_PER_CTA = 228 * 1024, 1024
NS, M, MP = 4, 24, 32


def _launch_config(entry):
    """CONFIG entry name, or (name, sub-entry): the entry with that sub-entry's tiles merged in (ops._cfg)."""
    return ops._cfg(*entry) if isinstance(entry, tuple) else ops.CONFIG[entry]


def _tiles(entry, *keys):
    return {k: _launch_config(entry)[k] for k in keys}


def grad_dots(entry):
    """The dot constexprs (DOT, SPLIT, PHI_LO) ops picks for a gradient pass at this CONFIG entry, bf16 x and phi."""
    return ops._grad_dots(torch.bfloat16, torch.bfloat16, ops.CONFIG[entry])


def xpass(entry):
    """`_coef_bwd_x`'s constexprs at a CONFIG entry (bf16 x and phi)."""
    return dict(NS=NS, M=M, MP=MP, ALIGNED=True, LOOP_STAGES=ops.CONFIG[entry].get("loop_stages"),
                DPHI_FIRST=ops.CONFIG[entry]["dphi_first"], **grad_dots(entry), **_tiles(entry, "BT", "BK"))


def xpass_descs(entry):
    """The x pass's tiles ops.bwd_x hands it as TMA descriptors, and their blocks."""
    bt, bk = _tiles(entry, "BT", "BK").values()
    return dict(x_ptr=(bt, bk), dl_ptr=(bt, MP), dx_ptr=(bt, bk), dxin_ptr=(bt, bk), du_ptr=(bt, bk))


def cases():
    """(label, kernel, constexprs, bf16 pointer names, CONFIG entry for num_warps / num_stages)."""
    res = dict(NS=NS, M=M, HAS_RES=True, T_IN=True, T_OUT=False)
    fwd = dict(res, MP=MP, SINK=False, HAS_U=True, DOT=DOT_NATIVE)
    return [
        ("mhc_pre fwd (coef + u)", _coef_fwd, dict(fwd, **_tiles("coef_fwd", "BT", "BK", "BC")), {"x_ptr", "phi_ptr", "u_ptr"},
         "coef_fwd"),
        ("mhc_pre fwd, fp32 phi, tf32 (phi_split false)", _coef_fwd,
         dict(fwd, DOT=DOT_TF32, **_tiles(("coef_fwd", "tf32"), "BT", "BK", "BC")),
         {"x_ptr", "u_ptr"}, ("coef_fwd", "tf32")),
        ("mhc_pre fwd, fp32 phi, phi_split interleaved (the default)", _coef_fwd,
         dict(fwd, SPLIT=2, **_tiles(("coef_fwd", "split"), "BT", "BK", "BC")), {"x_ptr", "phi_ptr", "u_ptr"},
         ("coef_fwd", "split")),
        # the trainer's launch at C = 1024 (the split tiles' split_tail false and u_inside_max_c 0): Sinkhorn inside,
        # u by stream_pre's kernel afterwards
        ("mhc_pre fwd, fp32 phi, as the trainer launches it", _coef_fwd,
         dict(fwd, SPLIT=2, SINK=not _launch_config(("coef_fwd", "split"))["split_tail"],
              HAS_U=1024 <= _launch_config(("coef_fwd", "split"))["u_inside_max_c"],
              **_tiles(("coef_fwd", "split"), "BT", "BK", "BC")), {"x_ptr", "phi_ptr", "u_ptr"}, ("coef_fwd", "split")),
        ("mhc_pre fwd, fp32 phi, phi_split dots", _coef_fwd,
         dict(fwd, SPLIT=1, **_tiles(("coef_fwd", "split"), "BT", "BK", "BC")), {"x_ptr", "phi_ptr", "phil_ptr", "u_ptr"},
         ("coef_fwd", "split")),
        ("HC coefficients (hc_coef: projection + tail)", _coef_fwd,
         dict(fwd, NS=1, M=6, MP=16, HAS_RES=False, HAS_U=False, TAIL=False, DOT=DOT_NATIVE, BC=16, SPLIT=2,
              HC_TAIL=1, NH=4, **_tiles("rms_proj", "BT", "BK")), {"x_ptr", "phi_ptr"}, "rms_proj"),
        ("HC tail backward (+ <du, x>, hc_enter)", _hc_tail_bwd,
         dict(M=6, NH=4, TANH=True, HAS_U=True, **_tiles("hc_tail_bwd", "BT", "BC")),
         {"x_ptr", "du_ptr"}, "hc_tail_bwd"),
        ("HC tail backward, fp32 du (the trainer's)", _hc_tail_bwd,
         dict(M=6, NH=4, TANH=True, HAS_U=True, DU_NARROW=True, **_tiles("hc_tail_bwd", "BT", "BC")),
         {"x_ptr", "dun_ptr"}, "hc_tail_bwd"),
        ("HC x pass (dx + dw + h_pre du + dx_in, hc_enter)", _coef_bwd_x,
         dict(xpass("hc_bwd_x"), NS=1, M=6, MP=16, HAS_U=True, HAS_DX=True, ACC=True, U_ROWS=4),
         {"x_ptr", "phi_ptr", "dx_ptr", "du_ptr", "dxin_ptr"}, "hc_bwd_x"),
        ("HC projection (rms_proj, tf32)", _coef_fwd,
         dict(fwd, NS=1, M=6, MP=16, HAS_RES=False, HAS_U=False, TAIL=False, DOT=DOT_TF32, BC=16,
              **_tiles("rms_proj", "BT", "BK")), {"x_ptr"}, "rms_proj"),
        ("Sinkhorn tail", _coef_tail, dict(NS=NS, M=M, T_IN=True, T_OUT=False, BT=ops.CONFIG["coef_tail"]["BT"]),
         set(), "coef_tail"),
        ("coef bwd per token (+ <du, x>)", _coef_bwd_tok,
         dict(res, HAS_U=True, LOOP_STAGES=ops.CONFIG["coef_bwd_tok"]["loop_stages"],
              **_tiles("coef_bwd_tok", "BT", "BC")), {"x_ptr", "du_ptr"}, "coef_bwd_tok"),
        # the trainer's: du in the branch's fp32 (ops CONFIG "u"), rounded to bf16 and stored for the x pass
        ("coef bwd per token, fp32 du (the trainer's)", _coef_bwd_tok,
         dict(res, HAS_U=True, DU_NARROW=True, LOOP_STAGES=ops.CONFIG["coef_bwd_tok"]["loop_stages"],
              **_tiles("coef_bwd_tok", "BT", "BC")), {"x_ptr", "dun_ptr"}, "coef_bwd_tok"),
        ("coef bwd x pass (dx + dphi, mhc_enter)", _coef_bwd_x,
         dict(xpass("coef_bwd_x"), HAS_U=True, HAS_DX=True, ACC=True), {"x_ptr", "phi_ptr", "dx_ptr", "du_ptr", "dxin_ptr"}, "coef_bwd_x"),
        ("coef bwd x pass, fp32 phi (the trainer's)", _coef_bwd_x,
         dict(xpass("coef_bwd_x"), HAS_U=True, HAS_DX=True, ACC=True, PHI_LO=True),
         {"x_ptr", "dx_ptr", "du_ptr", "dxin_ptr"}, "coef_bwd_x"),
        ("coef bwd x pass, fp32 phi, TMA descriptors", _coef_bwd_x,
         dict(xpass("coef_bwd_x"), HAS_U=True, HAS_DX=True, ACC=True, PHI_LO=True, TMA=True),
         {"x_ptr", "dx_ptr", "du_ptr", "dxin_ptr"}, "coef_bwd_x", xpass_descs("coef_bwd_x")),
        ("boundary bwd dphi pass", _coef_bwd_x, dict(xpass("bnd_dphi"), HAS_U=False, HAS_DX=False),
         {"x_ptr", "phi_ptr", "dx_ptr", "du_ptr"}, "bnd_dphi"),
        ("boundary bwd 2-D pass", _post_bwd_2d,
         dict(NS=NS, HAS_RES=True, COEF=True, M=M, MP=MP, **grad_dots("bnd_bwd"), **_tiles("bnd_bwd", "BT", "BC")),
         {"x_ptr", "f_ptr", "g_ptr", "dx_ptr", "df_ptr", "xn_ptr", "du_ptr", "phi_ptr"}, "bnd_bwd"),
        ("stream_post_res fwd", _post_fwd, dict(NS=NS, HAS_RES=True, **_tiles("post_fwd", "BT", "BC")),
         {"x_ptr", "f_ptr", "out_ptr"}, "post_fwd"),
        ("stream_post_res bwd", _post_bwd_2d,
         dict(NS=NS, HAS_RES=True, COEF=False, M=1, MP=16, DOT=DOT_TF32, **_tiles("post_bwd", "BT", "BC")),
         {"x_ptr", "f_ptr", "g_ptr", "dx_ptr", "df_ptr"}, "post_bwd"),
        # the trainer's tiles (C <= rows_max_c: whole rows), one token block per program or walked in a pipelined loop
        *((f"stream_post_res bwd, rows, {stages or 'no'} loop stages", _post_bwd_2d,
           dict(NS=NS, HAS_RES=True, COEF=False, M=1, MP=16, DOT=DOT_TF32, LOOP_STAGES=stages,
                **_tiles(("post_bwd", "rows"), "BT", "BC")),
           {"x_ptr", "f_ptr", "g_ptr", "dx_ptr", "df_ptr"}, ("post_bwd", "rows")) for stages in (0, 2, 3)),
        # with HyperConfig.rebuild_branch_input: the branch's fp32 u written too (`request_u`)
        ("stream_post_res bwd, rows, u on request", _post_bwd_2d,
         dict(NS=NS, HAS_RES=True, COEF=False, M=1, MP=16, DOT=DOT_TF32, HAS_U=True,
              LOOP_STAGES=ops.CONFIG["post_bwd"]["rows"]["loop_stages"], **_tiles(("post_bwd", "rows"), "BT", "BC")),
         {"x_ptr", "f_ptr", "g_ptr", "dx_ptr", "df_ptr"}, ("post_bwd", "rows")),
        ("stream_post_res bwd, u on request", _post_bwd_2d,
         dict(NS=NS, HAS_RES=True, COEF=False, M=1, MP=16, DOT=DOT_TF32, HAS_U=True, **_tiles("post_bwd", "BT", "BC")),
         {"x_ptr", "f_ptr", "g_ptr", "dx_ptr", "df_ptr"}, "post_bwd"),
        ("stream_pre fwd", _pre_fwd, dict(NS=NS, **_tiles("pre_fwd", "BT", "BC")), {"x_ptr", "u_ptr"}, "pre_fwd"),
        ("stream_pre fwd, fp32 u (the trainer's)", _pre_fwd, dict(NS=NS, **_tiles("pre_fwd", "BT", "BC")), {"x_ptr"},
         "pre_fwd"),
        ("stream_pre bwd", _pre_bwd, dict(NS=NS, **_tiles("pre_bwd", "BT", "BC")), {"x_ptr", "du_ptr", "dx_ptr"},
         "pre_bwd"),
    ]


def divisible_args(kernel, constexprs) -> list[str]:
    """The arguments a real launch specialises as divisible by 16 (Triton's "tt.divisibility" attribute, which lets it
    vectorise loads and stores): every pointer (torch allocations are aligned) and every integer the kernel does not
    mark do_not_specialize (C, K, strides at the model's shapes) except phi's row stride, M = n^2 + 2n (24 at n = 4;
    48, divisible, for the interleaved pairs of SPLIT = 2). Without these the compiled code is another program:
    scalar accesses and far more registers than the GPU's (round 11: 255 + spills for the x pass vs ncu's 187)."""
    out = []
    for q in kernel.params:
        if q.is_constexpr or q.name in constexprs or q.name in FLOATS or q.do_not_specialize:
            continue
        if q.name == "stride_phi" and constexprs.get("SPLIT") != 2:
            continue
        out.append(q.name)
    return out


def compile_one(kernel, constexprs, bf16, launch, arch, descs=None):
    """descs: {pointer name: block shape} for the arguments passed as TMA descriptors."""
    names = kernel.arg_names
    # constexprs a case leaves out keep their defaults (else the signature would make them runtime integers)
    constexprs = {**{q.name: q.default for q in kernel.params if q.is_constexpr and q.name not in constexprs
                     and q.default is not inspect.Parameter.empty}, **constexprs}
    sig = {n: "constexpr" if n in constexprs else ("*bf16" if n in bf16 else "*fp32") if n.endswith("_ptr")
           else "fp32" if n in FLOATS else "i32" for n in names}
    for n, block in (descs or {}).items():  # tiles as host TMA descriptors (the kernels' TMA), by block shape
        sig[n] = f"tensordesc<{sig[n][1:]}[{', '.join(str(b) for b in block)}]>"
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in divisible_args(kernel, constexprs)}
    src = ASTSource(kernel, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    opts = ops._launch(launch)  # the launch options a real launch passes (warps, stages, a register cap)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    # the cubin Triton assembled (with the ptxas it picks for the target); cuobjdump reads its resource usage
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(compiled.asm["cubin"])
        out = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", out).group(1))
    stack = int(re.search(r"STACK:(\d+)", out).group(1))
    local = int(re.search(r"LOCAL:(\d+)", out).group(1))
    warps = compiled.metadata.num_warps
    shared = compiled.metadata.shared
    return dict(registers=regs, stack_bytes=stack, local_bytes=local, shared_bytes=shared, num_warps=warps,
                ctas_per_sm_by_registers=65536 // (regs * 32 * warps),
                ctas_per_sm_by_shared=SHARED_PER_SM // (shared + SHARED_RESERVED_PER_CTA))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--out", default=None)
    p.add_argument("--only", default="", help="the cases whose label contains this text")
    args = p.parse_args()
    rows = []
    for label, kernel, constexprs, bf16, cfg_name, *descs in cases():
        if args.only not in label:
            continue
        launch = _launch_config(cfg_name)
        r = dict(kernel=label, config=launch, **compile_one(kernel, constexprs, bf16, launch, args.arch, *descs))
        rows.append(r)
        print(f"{label:<34} regs {r['registers']:>3}  stack {r['stack_bytes']:>4}  local {r['local_bytes']:>4} "
              f"smem {r['shared_bytes']:>6}  warps {r['num_warps']}  CTAs/SM: regs {r['ctas_per_sm_by_registers']}, "
              f"smem {r['ctas_per_sm_by_shared']}",
              flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(triton=triton.__version__, arch=args.arch, python=sys.version.split()[0], kernels=rows), fh,
                      indent=1)


if __name__ == "__main__":
    main()
