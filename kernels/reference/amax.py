"""Amax Gain Magnitude of single and composite H^res products (docs/design.md §7).

Input is always H^res in left-multiplying orientation, per layer and per token: [L, T, n, n].
Per-token products are built first and aggregated after (the order the spec requires).
"""

import torch


def composite_products(h_res: torch.Tensor) -> torch.Tensor:
    """Suffix products P_l = H_{L-1} ... H_l for every l: [L, ..., n, n] -> [L, ..., n, n]."""
    out = torch.empty_like(h_res)
    acc = h_res[-1]
    out[-1] = acc
    for l in range(h_res.shape[0] - 2, -1, -1):
        acc = acc @ h_res[l]
        out[l] = acc
    return out


def gain_metrics(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-matrix gains over the last two dims of p [..., n, n]."""
    rows, cols = p.sum(dim=-1), p.sum(dim=-2)
    return {
        "fwd": rows.abs().amax(dim=-1),  # max_i |sum_j P_ij|: forward signal gain (headline)
        "bwd": cols.abs().amax(dim=-1),  # max_j |sum_i P_ij|: backward gradient gain (headline)
        "fwd_abs": p.abs().sum(dim=-1).amax(dim=-1),  # infinity-norm reading; differs from fwd for HC only
        "bwd_abs": p.abs().sum(dim=-2).amax(dim=-1),
        "min_colsum": cols.amin(dim=-1),  # attenuation, invisible to a max
        "max_abs_log_colsum": cols.abs().clamp_min(1e-30).log().abs().amax(dim=-1),
    }


def gain_report(h_res: torch.Tensor) -> dict[str, torch.Tensor]:
    """All aggregations for h_res [L, T, n, n], each a [L] tensor, keyed '<single|composite>_<metric>_<agg>'.

    agg A ('tokmean'): metric of the token-averaged matrix (paper Fig. 8);
    agg B ('mean', 'max', 'min'): metric per token, then mean / max / min over tokens (Fig. 3; max shows spikes, min
    the worst token of a metric where small is bad, such as min_colsum).
    """
    h = h_res.double()
    out: dict[str, torch.Tensor] = {}
    for kind, p in (("single", h), ("composite", composite_products(h))):
        for name, v in gain_metrics(p.mean(dim=1)).items():
            out[f"{kind}_{name}_tokmean"] = v
        for name, v in gain_metrics(p).items():
            out[f"{kind}_{name}_mean"] = v.mean(dim=1)
            out[f"{kind}_{name}_max"] = v.amax(dim=1)
            out[f"{kind}_{name}_min"] = v.amin(dim=1)
    return out
