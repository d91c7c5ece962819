"""The option values of the mHC ops, declared once: the allowed names (model/config.py validates against these
tuples), the Sinkhorn count's default, and `MHCOptions`, the Sinkhorn / gate options every coefficient op takes
(docs/design.md §2-3)."""

from dataclasses import dataclass
from typing import Literal, get_args

ExactAxis = Literal["rows", "cols"]  # rows: forward gain exactly 1 (paper / DeepSeek); cols: backward (Liger)
SinkhornStart = Literal["softmax_eps", "exp", "log_domain"]
ResLayout = Literal["src_dst", "dst_src"]  # how the n^2 res logits are indexed: H^res = R^T or R
KernelBackend = Literal["auto", "triton", "torch"]

EXACT_AXES: tuple[str, ...] = get_args(ExactAxis)
STARTS: tuple[str, ...] = get_args(SinkhornStart)
RES_LAYOUTS: tuple[str, ...] = get_args(ResLayout)
KERNEL_BACKENDS: tuple[str, ...] = get_args(KernelBackend)

SINKHORN_ITERS = 20  # the Sinkhorn count t_max by default (mHC paper); written here only


@dataclass(frozen=True)
class MHCOptions:
    """How H^pre, H^post, H^res are made from the projection (mHC Eq. 14-19, docs/design.md §2-3).

    sinkhorn_iters may change per call (the scheduler sets it per layer at run time): the fused kernels take it
    as a runtime argument, and under torch.compile it is a symbolic int inside this object, not a new graph.
    """

    sinkhorn_iters: int = SINKHORN_ITERS
    sinkhorn_eps: float = 1e-6
    exact_axis: ExactAxis = "rows"
    start: SinkhornStart = "softmax_eps"
    res_layout: ResLayout = "src_dst"
    rms_eps: float = 1e-6
    pre_eps: float = 1e-6
    post_mult: float = 2.0


DEFAULT_OPTIONS = MHCOptions()
