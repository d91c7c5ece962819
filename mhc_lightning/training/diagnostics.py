"""mHC diagnostics from recorded per-layer coefficients: Amax gain, Sinkhorn residuals, H_pre/H_post ranges, and
whether the streams differ at all (stream spread, H_res's distance from I and from the uniform J/n).

Computed in float64 on one sequence every k steps (docs/design.md §7), never on a kernel's storage layout.
"""

import torch

from ..kernels.reference import gain_report, sinkhorn_residuals

# A grad norm (after warmup) above this many times the run's median counts as a spike (module.py logs the count over
# every step; reports count it on the logged curve of runs from before that).
GRAD_SPIKE_FACTOR = 4.0


def grad_norm_summary(norms: torch.Tensor, warmup: int) -> dict[str, float]:
    """Statistics of the per-step grad norms [steps], warmup apart (its early steps are large by design): the max over
    the warmup steps (`train/grad_norm_max_warmup`), and the max and spike count over the steps after it; each where
    the run has such steps, so a run that never leaves warmup still has its max."""
    gn = norms.double()
    out = {"train/grad_norm_max_warmup": gn[:warmup].max().item()} if gn[:warmup].numel() else {}
    after = gn[warmup:]
    if after.numel():
        out["train/grad_norm_max"] = after.max().item()
        out["train/grad_spikes"] = float((after > GRAD_SPIKE_FACTOR * after.median()).sum().item())
    return out


def h_res_distances(h_res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Frobenius distance of each H_res [..., n, n] from I and from J/n (every entry 1/n)."""
    n = h_res.shape[-1]
    eye = torch.eye(n, dtype=h_res.dtype, device=h_res.device)
    return (h_res - eye).flatten(-2).norm(dim=-1), (h_res - 1.0 / n).flatten(-2).norm(dim=-1)


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
        # the smallest column sum of any token's composite product, and of the token-mean product (the paper's
        # reading, as the _tokmean gains above); below 1 a gradient through the stack is attenuated
        "amax/composite_min_colsum_worst": report["composite_min_colsum_min"].min().item(),
        "amax/composite_min_colsum_tokmean": report["composite_min_colsum_tokmean"].min().item(),
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
    if "logit_range" in recorded:  # mHC: how far Sinkhorn's start is from flat (exp(range): largest / smallest)
        logit_range = recorded["logit_range"].double()  # [L, T]
        scalars["sinkhorn/logit_range_max"] = logit_range.max().item()
        scalars["sinkhorn/logit_range_mean"] = logit_range.mean().item()
    if "spread" in recorded:
        spread = recorded["spread"].double()  # [L, T]: the streams each sublayer wrote
        d_eye, d_uniform = (d.mean(dim=1) for d in h_res_distances(h_res))  # [L], token means
        scalars.update(
            {
                "streams/spread_last": spread[-1].mean().item(),  # what the collapse sums; 0 = the streams never parted
                "hres/dist_identity": d_eye.mean().item(),
                "hres/dist_identity_max": d_eye.max().item(),
                "hres/dist_uniform_min": d_uniform.min().item(),  # near 0: some layer averages its streams flat
            }
        )
    per_layer = {k: v.tolist() for k, v in report.items()}
    per_layer["sinkhorn_row_residual_max"] = row_res.amax(dim=1).tolist()
    per_layer["sinkhorn_col_residual_max"] = col_res.amax(dim=1).tolist()
    per_layer["h_res_tokmean"] = h_res.mean(dim=1).tolist()
    if "logit_range" in recorded:
        per_layer["res_logit_range_max"] = recorded["logit_range"].double().amax(dim=1).tolist()
    if "spread" in recorded:
        per_layer["stream_spread"] = recorded["spread"].double().mean(dim=1).tolist()
        per_layer["h_res_dist_identity"], per_layer["h_res_dist_uniform"] = (
            d.mean(dim=1).tolist() for d in h_res_distances(h_res)
        )
    return scalars, per_layer
