"""The gradient kernels' partial sums, summed in one launch (docs/kernels.md, "Partial sums").

The kernels that reduce over tokens leave deterministic partial sums instead of atomics: the parameter's gradient per
token split [S, K * M] (the x pass), the small vectors' per token block, one row per vector element [PW, P] (the
per-token backward: bias then alpha; HC's tail: its statics), and the write-back backward's dh_post and dH per C
block. `_param_grad_sum` sums them all in one launch and writes each gradient in its parameter's dtype into its own
tensor (custom-op outputs may not alias). Each program loads whole [rows, columns] tiles (a loop of one-row loads is
latency-bound), and each vector element's row is summed by a program of its own, in one fixed order.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from .host import cdiv, np2
from .launch_cache import launcher
from .launch_config import launch_options, tiles

Tensor = torch.Tensor


@triton.jit
def _wide_sum(part_ptr, out_ptr, S, L, blk, BL: tl.constexpr, BS: tl.constexpr):
    """out[i] = sum_s part[s, i] over one BL slice: BS partial rows per load, so a few loads cover all S."""
    offs = blk.to(tl.int64) * BL + tl.arange(0, BL)
    ss = tl.arange(0, BS)
    acc = tl.zeros([BS, BL], dtype=tl.float32)
    for s0 in range(0, S, BS):
        rows = s0 + ss
        acc += tl.load(part_ptr + rows.to(tl.int64)[:, None] * L + offs[None, :],
                       mask=(rows[:, None] < S) & (offs[None, :] < L), other=0.0)
    tl.store(out_ptr + offs, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=offs < L)


@triton.jit(do_not_specialize=["S1", "L1", "S2", "L2", "P"])
def _param_grad_sum(
    w1_ptr, o1_ptr, S1, L1, w2_ptr, o2_ptr, S2, L2, v_ptr, da_ptr, db_ptr, P,
    HAS_W2: tl.constexpr, HAS_V: tl.constexpr, A: tl.constexpr, BL: tl.constexpr, BS: tl.constexpr,
    BP: tl.constexpr,
):
    """Programs [0, cdiv(L1, BL)): o1 = w1 [S1, L1] summed over S1; then (HAS_W2) o2 likewise from w2 [S2, L2]; then
    (HAS_V) one program per row i of v [PW, P]: its sum to da[i] for i < A, else to db[i - A]."""
    pid = tl.program_id(0)
    n1 = tl.cdiv(L1, BL)
    n2 = tl.cdiv(L2, BL) if HAS_W2 else 0
    if pid < n1:
        _wide_sum(w1_ptr, o1_ptr, S1, L1, pid, BL, BS)
    elif pid < n1 + n2:
        _wide_sum(w2_ptr, o2_ptr, S2, L2, pid - n1, BL, BS)
    elif HAS_V:
        i = pid - n1 - n2
        row = v_ptr + i.to(tl.int64) * P
        acc = tl.zeros([BP], dtype=tl.float32)
        for p0 in range(0, P, BP):
            pp = p0 + tl.arange(0, BP)
            acc += tl.load(row + pp, mask=pp < P, other=0.0)
        v = tl.sum(acc, axis=0)
        if i < A:
            tl.store(da_ptr + i, v.to(da_ptr.dtype.element_ty))
        else:
            tl.store(db_ptr + (i - A), v.to(db_ptr.dtype.element_ty))


def sum_partials(wpart: Tensor, dw: Tensor, vpart: Optional[Tensor] = None, da: Optional[Tensor] = None,
                 db: Optional[Tensor] = None, wpart2: Optional[Tensor] = None, dw2: Optional[Tensor] = None) -> None:
    """dw = wpart [S, *dw.shape] summed over S (and dw2 from wpart2 likewise); with vpart [PW, P] also its row sums,
    the first da.numel() into da and the rest into db (when given). One launch."""
    cfg = tiles("param_sum")
    l1, l2 = dw.numel(), 0 if dw2 is None else dw2.numel()
    programs = cdiv(l1, cfg["BL"]) + cdiv(l2, cfg["BL"])
    has_v = vpart is not None
    if not has_v:
        vpart, da, db, a = wpart, dw, dw, 0  # no vector program is launched
    else:
        programs += vpart.shape[0]  # one per vector element
        a = da.numel()
        db = da if db is None else db
    s2 = 1 if wpart2 is None else wpart2.shape[0]
    launcher(_param_grad_sum)[(programs,)](
        w1_ptr=wpart, o1_ptr=dw, S1=wpart.shape[0], L1=l1, w2_ptr=wpart if wpart2 is None else wpart2,
        o2_ptr=dw if dw2 is None else dw2, S2=s2, L2=l2, v_ptr=vpart, da_ptr=da, db_ptr=db, P=vpart.shape[1],
        HAS_W2=dw2 is not None, HAS_V=has_v, A=a, BL=cfg["BL"], BS=min(16, np2(max(wpart.shape[0], s2))), BP=cfg["BP"],
        **launch_options(cfg))
