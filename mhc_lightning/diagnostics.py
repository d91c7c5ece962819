"""mHC diagnostics from recorded per-layer coefficients: Amax gain, Sinkhorn residuals, H_pre/H_post ranges.

Computed in float64 on one sequence every k steps (mhc-math.md §7), never on a kernel's storage layout.
"""
import torch

from .kernels.reference import gain_report, sinkhorn_residuals


def summarize(recorded: dict[str, torch.Tensor]) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Scalars to log every k steps, and per-layer curves for artifacts / plots."""
    if not recorded:
        return {}, {}
    h_res = recorded["h_res"].double()
    report = gain_report(h_res)  # each value is a [L] tensor, layer 0 first
    row_res, col_res = sinkhorn_residuals(h_res)  # [L, T]
    scalars = {
        # headline: worst token of the composite product from layer 0 to the end, both directions
        "amax/composite_fwd_max": report["composite_fwd_max"].max().item(),
        "amax/composite_bwd_max": report["composite_bwd_max"].max().item(),
        "amax/composite_fwd_tokmean": report["composite_fwd_tokmean"].max().item(),
        "amax/composite_bwd_tokmean": report["composite_bwd_tokmean"].max().item(),
        "amax/composite_min_colsum": report["composite_min_colsum_max"].min().item(),
        "amax/composite_max_abs_log_colsum": report["composite_max_abs_log_colsum_max"].max().item(),
        "amax/single_fwd_max": report["single_fwd_max"].max().item(),
        "amax/single_bwd_max": report["single_bwd_max"].max().item(),
        "amax/single_fwd_abs_max": report["single_fwd_abs_max"].max().item(),
        "amax/single_bwd_abs_max": report["single_bwd_abs_max"].max().item(),
        "sinkhorn/row_residual_max": row_res.max().item(),
        "sinkhorn/col_residual_max": col_res.max().item(),
        "coef/h_pre_min": recorded["h_pre"].min().item(),
        "coef/h_pre_max": recorded["h_pre"].max().item(),
        "coef/h_post_min": recorded["h_post"].min().item(),
        "coef/h_post_max": recorded["h_post"].max().item(),
        "coef/h_res_min": h_res.min().item(),
    }
    per_layer = {k: v.tolist() for k, v in report.items()}
    per_layer["sinkhorn_row_residual_max"] = row_res.amax(dim=1).tolist()
    per_layer["sinkhorn_col_residual_max"] = col_res.amax(dim=1).tolist()
    per_layer["h_res_tokmean"] = h_res.mean(dim=1).tolist()
    return scalars, per_layer
