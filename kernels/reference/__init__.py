"""Pure-PyTorch reference ops: the semantics source and the oracle every fused kernel is tested against.

They accept float64 and are differentiable by autograd (exact gradients through the unrolled Sinkhorn).
The model runs these when no fused kernel is selected; no other copy of this math exists.
"""

from .amax import composite_products, gain_metrics, gain_report
from .birkhoff import LITE_STREAMS, birkhoff_res, permutation_basis, permutation_count
from .coefficients import (
    columnwise_matmul,
    compute_dtype,
    gated_logits,
    hc_coefficients,
    hc_from_projection,
    hc_projection_weights,
    head_weights,
    mhc_coefficients,
    mhc_logit_count,
    mhc_res_logits,
    rms_proj,
)
from .exact_coefficients import (
    KROM,
    LITE,
    ExactFamily,
    exact_coefficients,
    exact_enter,
    exact_res_logits,
    krom_enter,
    lite_enter,
)
from .kronecker import KROM_STREAMS, factor_count, factor_masks, kronecker_res
from .mhc_boundary import mhc_boundary
from .pre import hc_enter, in_dtype, mhc_enter, mhc_pre, rebuild_u, request_u
from .rope import apply_rope, rope_qkv, rope_tables
from .sinkhorn import sinkhorn, sinkhorn_residuals
from .streams import expand_streams, stream_post_res, stream_pre, sum_streams

__all__ = [
    "KROM",
    "KROM_STREAMS",
    "LITE",
    "LITE_STREAMS",
    "ExactFamily",
    "birkhoff_res",
    "exact_coefficients",
    "exact_enter",
    "exact_res_logits",
    "krom_enter",
    "lite_enter",
    "factor_count",
    "factor_masks",
    "gated_logits",
    "kronecker_res",
    "permutation_basis",
    "permutation_count",
    "apply_rope",
    "columnwise_matmul",
    "composite_products",
    "compute_dtype",
    "expand_streams",
    "gain_metrics",
    "gain_report",
    "hc_coefficients",
    "hc_enter",
    "hc_from_projection",
    "hc_projection_weights",
    "head_weights",
    "in_dtype",
    "mhc_boundary",
    "mhc_coefficients",
    "mhc_enter",
    "mhc_logit_count",
    "mhc_res_logits",
    "mhc_pre",
    "rebuild_u",
    "request_u",
    "rms_proj",
    "rope_qkv",
    "rope_tables",
    "sinkhorn",
    "sinkhorn_residuals",
    "stream_post_res",
    "stream_pre",
    "sum_streams",
]
