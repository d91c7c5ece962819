"""The pure-PyTorch reference ops against docs/design.md: Sinkhorn, coefficients, streams, Amax gain."""

import math

import pytest
import torch
from helpers import fast_first
from torch.autograd import gradcheck

from mhc_lightning.kernels import MHCOptions, get_ops, reference
from mhc_lightning.kernels.reference import (
    composite_products,
    gain_metrics,
    gain_report,
    hc_coefficients,
    mhc_coefficients,
    sinkhorn,
    sinkhorn_residuals,
    stream_post_res,
    stream_pre,
)


def logits(*shape, scale=3.0, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype) * scale  # non-symmetric by construction


# ---- Sinkhorn -------------------------------------------------------------------------------------------


@fast_first("start", ["softmax_eps", "exp", "log_domain"])
def test_rows_exact_after_t_iterations(start):
    h = sinkhorn(logits(500, 4, 4).float(), iters=20, start=start)
    rows, cols = sinkhorn_residuals(h)
    assert rows.max() <= 1e-5  # the axis normalised last is exact (docs/design.md §11 invariant)
    assert (h >= 0).all()
    assert cols.max() > 1e-4  # truncation error lands on the other axis at 20 iterations


def test_orientation_option_changes_exact_axis():
    z = logits(500, 4, 4).float()
    rows, cols = sinkhorn_residuals(sinkhorn(z, 20, exact_axis="cols"))
    assert cols.max() <= 1e-5 and rows.max() > 1e-4
    # "cols" is K(Z^T)^T exactly
    torch.testing.assert_close(sinkhorn(z, 20, exact_axis="cols"), sinkhorn(z.mT, 20).mT)


def test_more_iterations_shrink_the_inexact_axis():
    z = logits(1000, 4, 4)
    errs = [sinkhorn_residuals(sinkhorn(z, t))[1].max().item() for t in (5, 20, 100)]
    assert errs[0] > errs[1] > errs[2]
    # measured in docs/design.md §3 on the same kind of matrices: 4.2e-2 at 20 iterations, 5.7e-3 at 100
    assert 1e-2 < errs[1] < 1e-1 and errs[2] < 2e-2


def test_sinkhorn_saturated_logits_stay_finite():
    z = logits(64, 4, 4, scale=30.0)  # x10 logits: near-permutation regime
    for start in ("softmax_eps", "exp", "log_domain"):
        h = sinkhorn(z, 20, start=start)
        assert torch.isfinite(h).all()
        assert sinkhorn_residuals(h)[0].max() < 1e-5


@fast_first("axis", ["rows", "cols"])
@fast_first("start", ["softmax_eps", "exp", "log_domain"])
def test_sinkhorn_gradcheck_float64(axis, start):
    z = logits(3, 4, 4, scale=1.5).requires_grad_()
    assert gradcheck(lambda t: sinkhorn(t, 20, 1e-6, axis, start), (z,), eps=1e-6, atol=1e-6)


def test_sinkhorn_bad_arguments_name_the_field():
    z = logits(2, 4, 4)
    with pytest.raises(ValueError, match="iters"):
        sinkhorn(z, 0)
    with pytest.raises(ValueError, match="exact_axis.*rows"):
        sinkhorn(z, 5, exact_axis="diag")
    with pytest.raises(ValueError, match="start.*softmax_eps"):
        sinkhorn(z, 5, start="sigmoid")


# ---- coefficients ---------------------------------------------------------------------------------------


def mhc_inputs(n=4, C=6, T=5, seed=1, dtype=torch.float64, with_res=True):
    g = torch.Generator().manual_seed(seed)
    m = 2 * n + (n * n if with_res else 0)
    x = torch.randn(T, n, C, generator=g, dtype=dtype)
    phi = torch.randn(n * C, m, generator=g, dtype=dtype) * 0.5
    bias = torch.randn(m, generator=g, dtype=dtype)
    alpha = torch.rand(3, generator=g, dtype=dtype) + 0.5
    return x, phi, bias, alpha


def test_mhc_coefficients_match_the_unfused_equations():
    """Norm-after-matmul (Eq. 14-16) equals RMSNorm-then-project (Eq. 7), layout [pre|post|res], H = R^T."""
    x, phi, bias, alpha = mhc_inputs()
    n, C = x.shape[-2:]
    h_pre, h_post, h_res = mhc_coefficients(x, phi, bias, alpha, MHCOptions(sinkhorn_iters=20))
    flat = x.reshape(-1, n * C)
    xn = flat / torch.sqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    t = xn @ phi
    torch.testing.assert_close(h_pre, torch.sigmoid(alpha[0] * t[:, :n] + bias[:n]) + 1e-6)
    torch.testing.assert_close(h_post, 2 * torch.sigmoid(alpha[1] * t[:, n : 2 * n] + bias[n : 2 * n]))
    R = (alpha[2] * t[:, 2 * n :] + bias[2 * n :]).reshape(-1, n, n)  # R[src, dst]
    torch.testing.assert_close(h_res, sinkhorn(R.mT, 20))
    # Liger's layout reads the same logits as H directly
    _, _, h_liger = mhc_coefficients(x, phi, bias, alpha, MHCOptions(res_layout="dst_src"))
    torch.testing.assert_close(h_liger, sinkhorn(R, 20))


def test_identity_mode_has_no_res():
    x, phi, bias, alpha = mhc_inputs(with_res=False)
    h_pre, h_post, h_res = mhc_coefficients(x, phi, bias, alpha)
    assert h_res is None and h_pre.shape == h_post.shape == x.shape[:-1]
    with pytest.raises(ValueError, match="columns"):
        mhc_coefficients(x, phi[:, :3], bias, alpha)


def test_mhc_coefficients_gradcheck_float64():
    x, phi, bias, alpha = (t.requires_grad_() for t in mhc_inputs(n=3, C=4, T=3))

    def f(x, phi, bias, alpha):
        return mhc_coefficients(x, phi, bias, alpha, MHCOptions(sinkhorn_iters=8))

    assert gradcheck(f, (x, phi, bias, alpha), eps=1e-6, atol=1e-6)


def test_coefficients_stay_fp32_under_autocast():
    x, phi, bias, alpha = (t.float() for t in mhc_inputs())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = mhc_coefficients(x.bfloat16(), phi, bias, alpha)
    assert all(o.dtype == torch.float32 for o in outs)
    ref = mhc_coefficients(x.bfloat16(), phi, bias, alpha)
    for a, b in zip(outs, ref):
        torch.testing.assert_close(a, b)


def test_hc_init_is_a_prenorm_residual():
    n, C, k = 4, 8, 6
    x = torch.randn(5, n, C, dtype=torch.float64)
    z = torch.zeros
    h_pre, h_post, h_res = hc_coefficients(
        x,
        torch.ones(C),
        z(C),
        z(C),
        z(C, n),
        torch.tensor(0.01),
        torch.tensor(0.01),
        torch.ones(n),
        torch.eye(n)[k % n],
        torch.eye(n),
    )
    assert torch.equal(h_pre, torch.eye(n, dtype=x.dtype)[k % n].expand(5, n))
    assert torch.equal(h_post, torch.ones(5, n, dtype=x.dtype))
    assert torch.equal(h_res, torch.eye(n, dtype=x.dtype).expand(5, n, n))


def test_hc_dynamic_rows_come_from_their_own_stream():
    """Row i of A_r (= column i of H^res) depends only on stream i."""
    n, C = 3, 4
    g = torch.Generator().manual_seed(3)
    args = [torch.randn(s, generator=g, dtype=torch.float64) for s in ((C,), (C,), (C,), (C, n))]
    statics = (torch.tensor(0.3), torch.tensor(0.2), torch.ones(n), torch.eye(n)[0], torch.eye(n))
    x = torch.randn(1, n, C, generator=g, dtype=torch.float64)
    _, _, h0 = hc_coefficients(x, *args, *statics)
    x2 = x.clone()
    x2[0, 1] += 1.0
    _, _, h1 = hc_coefficients(x2, *args, *statics)
    changed = (h1 - h0).abs().sum(dim=-2)[0] > 0  # which columns of H^res changed
    assert changed.tolist() == [False, True, False]


# ---- stream ops -----------------------------------------------------------------------------------------


def test_stream_ops_match_the_update_equation():
    x, _, _, _ = mhc_inputs()
    n, C = x.shape[-2:]
    f = torch.randn(x.shape[0], C, dtype=x.dtype)
    h_pre, h_post = torch.rand(x.shape[0], n, dtype=x.dtype), torch.rand(x.shape[0], n, dtype=x.dtype)
    h_res = torch.rand(x.shape[0], n, n, dtype=x.dtype)
    u = stream_pre(x, h_pre)
    torch.testing.assert_close(u, torch.einsum("tj,tjc->tc", h_pre, x))
    out = stream_post_res(x, f, h_post, h_res)
    want = torch.einsum("tij,tjc->tic", h_res, x) + h_post[..., None] * f[:, None, :]
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(stream_post_res(x, f, h_post, None), x + h_post[..., None] * f[:, None, :])


def test_stream_ops_gradcheck_float64():
    x, _, _, _ = mhc_inputs(n=3, C=4, T=2)
    f = torch.randn(2, 4, dtype=x.dtype)
    hp, hq, hr = torch.rand(2, 3, dtype=x.dtype), torch.rand(2, 3, dtype=x.dtype), torch.rand(2, 3, 3, dtype=x.dtype)
    ins = tuple(t.requires_grad_() for t in (x, f, hp, hq, hr))
    assert gradcheck(lambda x, f, hp, hq, hr: (stream_pre(x, hp), stream_post_res(x, f, hq, hr)), ins)


# ---- Amax gain ------------------------------------------------------------------------------------------


def test_amax_definitions_on_hand_built_matrices():
    P = torch.tensor([[2.0, -1.0], [0.5, 0.5]], dtype=torch.float64)
    m = gain_metrics(P)
    assert m["fwd"].item() == 1.0  # row sums 1, 1
    assert m["fwd_abs"].item() == 3.0  # |2| + |-1|: the infinity-norm reading differs for signed HC
    assert m["bwd"].item() == 2.5  # column sums 2.5, -0.5
    assert m["bwd_abs"].item() == 2.5
    assert m["min_colsum"].item() == -0.5
    assert m["max_abs_log_colsum"].item() == pytest.approx(math.log(2.5))  # max(|log 2.5|, |log 0.5|)


def test_composite_product_order_is_deepest_on_the_left():
    h0 = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    h1 = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    p = composite_products(torch.stack([h0, h1]))
    assert torch.equal(p[1], h1)
    assert torch.equal(p[0], h1 @ h0)  # [[0, 2], [1, 0]], not h0 @ h1 = [[0, 1], [2, 0]]
    assert gain_metrics(p[0])["fwd"].item() == 2.0 and gain_metrics(p[0])["bwd"].item() == 2.0


def test_gain_report_aggregations():
    """Token-mean matrix (paper Fig. 8) vs per-token max (Fig. 3): averaging hides one bad token."""
    L, T, n = 3, 8, 4
    h = torch.eye(n).repeat(L, T, 1, 1)
    h[1, 5] = 3 * torch.eye(n)  # one spiking token in the middle layer
    r = gain_report(h)
    assert r["composite_fwd_max"].tolist() == [3.0, 3.0, 1.0]
    assert r["composite_fwd_tokmean"][0].item() == pytest.approx(1.25)
    assert r["composite_fwd_mean"][0].item() == pytest.approx(1.25)
    assert r["single_bwd_max"].tolist() == [1.0, 3.0, 1.0]


def test_mhc_composite_forward_gain_is_one():
    L, T, n = 12, 16, 4
    h = sinkhorn(logits(L, T, n, n, scale=2.0), 20)
    r = gain_report(h)
    assert (r["composite_fwd_max"] - 1).abs().max() < 1e-4  # rows exact -> every product too
    assert (r["composite_bwd_max"] - 1).abs().max() > 1e-6  # the deviation lands on the backward gain


def test_dispatch():
    assert get_ops("auto", torch.device("cpu")) is reference
    assert get_ops("torch", torch.device("cpu")) is reference
    with pytest.raises(ValueError, match="kernel_backend.*auto"):
        get_ops("cuda", torch.device("cpu"))
