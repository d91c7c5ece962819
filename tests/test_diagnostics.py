"""The logged diagnostics (mhc_lightning/training/diagnostics.py) say what their names say: worst token vs token
mean."""

import torch

from mhc_lightning.training.diagnostics import grad_norm_summary, summarize


def _recorded(h_res: torch.Tensor) -> dict[str, torch.Tensor]:
    L, T, n, _ = h_res.shape
    return {"h_res": h_res, "h_pre": torch.ones(L, T, n), "h_post": torch.ones(L, T, n)}


def test_min_colsum_is_the_worst_token_and_the_token_mean_beside_it():
    """Two tokens through two layers: token 0's composite columns sum to 1, token 1's smallest column to 0.25."""
    eye = torch.eye(2, dtype=torch.float64)
    squash = torch.tensor([[1.0, 0.5], [0.0, 0.5]], dtype=torch.float64)  # rows sum to 1, columns to 1 and 1
    lossy = torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64) @ torch.diag(
        torch.tensor([1.5, 0.5], dtype=torch.float64)
    )
    h_res = torch.stack([torch.stack([eye, lossy]), torch.stack([eye, squash])])  # [L=2, T=2, 2, 2]
    scalars, _ = summarize(_recorded(h_res))
    composite_1 = squash @ lossy  # token 1: layer 1 after layer 0
    assert scalars["amax/composite_min_colsum_worst"] == composite_1.sum(0).min().item()
    mean_product = (eye @ eye + composite_1) / 2  # the composite of each token, averaged over tokens
    assert scalars["amax/composite_min_colsum_tokmean"] == mean_product.sum(0).min().item()
    assert scalars["amax/composite_min_colsum_worst"] < scalars["amax/composite_min_colsum_tokmean"] < 1
    assert "amax/composite_min_colsum" not in scalars  # the old name read the best token


def test_logit_range_summary():
    rec = _recorded(torch.eye(2).expand(3, 4, 2, 2).clone())
    rec["logit_range"] = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 8.0], [1.0, 1.0, 1.0, 1.0]])
    scalars, per_layer = summarize(rec)
    assert scalars["sinkhorn/logit_range_max"] == 8.0 and scalars["sinkhorn/logit_range_mean"] == 22.0 / 12
    assert per_layer["res_logit_range_max"] == [4.0, 8.0, 1.0]


def test_grad_norm_summary_counts_every_step_warmup_apart():
    norms = torch.tensor([50.0, 40.0, 1.0, 1.1, 0.9, 9.0, 1.0, 1.2])
    after = {"train/grad_norm_max": 9.0, "train/grad_spikes": 1.0}
    assert grad_norm_summary(norms, warmup=2) == {"train/grad_norm_max_warmup": 50.0, **after}
    assert grad_norm_summary(norms, warmup=0) == {"train/grad_norm_max": 50.0, "train/grad_spikes": 3.0}
    # a run that never leaves warmup (max_steps <= warmup_steps) still has its max
    assert grad_norm_summary(norms, warmup=8) == {"train/grad_norm_max_warmup": 50.0}
