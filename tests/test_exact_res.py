"""The exactly doubly stochastic H^res references (docs/design.md §15): mHC-lite's convex combination of permutations
and KromHC's Kronecker product of 2 x 2 factors, against constructions written out by hand, in float64 with every
gradient checked by gradcheck, and their exactness."""

import itertools
import math

import pytest
import torch
from helpers import fast_first

from mhc_lightning.kernels import reference as R
from mhc_lightning.kernels.options import MHCOptions

FAMILY = {"mhc_lite": R.LITE, "kromhc": R.KROM}  # each mode's ExactFamily
FAMILIES = [
    ("mhc_lite", 2),
    ("mhc_lite", 3),
    ("mhc_lite", 4),
    ("mhc_lite", 5),
    ("kromhc", 2),
    ("kromhc", 4),
    ("kromhc", 8),
]


def lite_by_hand(z: torch.Tensor, n: int) -> torch.Tensor:
    """sum_k softmax(z)_k P_k with P_k[i, sigma_k(i)] = 1, one permutation at a time."""
    a = torch.softmax(z, dim=-1)
    out = torch.zeros(*z.shape[:-1], n, n, dtype=z.dtype)
    for k, sigma in enumerate(itertools.permutations(range(n))):
        out = out + a[..., k, None, None] * torch.eye(n, dtype=z.dtype)[list(sigma)]
    return out


def krom_by_hand(z: torch.Tensor, n: int) -> torch.Tensor:
    """U_0 ⊗ U_1 ⊗ ... per token with torch.kron."""
    out = torch.empty(*z.shape[:-1], n, n, dtype=z.dtype)
    for idx in itertools.product(*(range(s) for s in z.shape[:-1])):
        h = torch.ones(1, 1, dtype=z.dtype)
        for p in torch.sigmoid(z[idx]):
            h = torch.kron(h, torch.stack([torch.stack([p, 1 - p]), torch.stack([1 - p, p])]))
        out[idx] = h
    return out


def by_hand(z, family, n):
    return lite_by_hand(z, n) if family == "mhc_lite" else krom_by_hand(z, n)


@fast_first("family,n", FAMILIES)
def test_h_res_matches_the_construction_by_hand(family, n):
    torch.manual_seed(n)
    z = 2.0 * torch.randn(3, 5, FAMILY[family].res_count(n), dtype=torch.float64)
    h = FAMILY[family].res(z, n)
    assert h.shape == (3, 5, n, n) and h.dtype == torch.float64
    torch.testing.assert_close(h, by_hand(z, family, n), rtol=1e-12, atol=1e-14)


@fast_first("family,n", FAMILIES)
@fast_first("scale", [1.0, 10.0])
def test_rows_and_columns_are_exact_up_to_rounding(family, n, scale):
    """Both axes sum to 1: float64 to 1e-14, float32 to a few ulps, also with saturated (x10) logits."""
    torch.manual_seed(0)
    z = scale * 3.0 * torch.randn(64, FAMILY[family].res_count(n))
    for dtype, tol in ((torch.float64, 1e-14), (torch.float32, 1e-6)):
        h = FAMILY[family].res(z.to(dtype), n)
        rows, cols = R.sinkhorn_residuals(h)
        assert rows.max().item() < tol and cols.max().item() < tol, (dtype, rows.max(), cols.max())
        assert h.min().item() >= 0 and torch.isfinite(h).all()


def test_permutation_layout_identity_first_and_output_reads_sigma():
    """Coefficient k is the k-th permutation in lexicographic order; P_k[i, sigma(i)] = 1, so with all weight on k
    the output stream i is input stream sigma(i) (H^res left-multiplies the stream)."""
    n = 4
    perms = list(itertools.permutations(range(n)))
    assert perms[0] == (0, 1, 2, 3)
    k = perms.index((1, 2, 3, 0))
    z = torch.full((math.factorial(n),), -80.0, dtype=torch.float64)
    z[k] = 0.0
    h = R.birkhoff_res(z, n)
    x = torch.arange(n, dtype=torch.float64)[:, None] * torch.ones(1, 3, dtype=torch.float64)  # stream i holds i
    assert torch.allclose(h @ x, torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=torch.float64)[:, None].expand(4, 3))
    z0 = torch.full_like(z, -80.0)
    z0[0] = 0.0
    assert torch.allclose(R.birkhoff_res(z0, n), torch.eye(n, dtype=torch.float64))


def test_kronecker_layout_first_factor_is_the_most_significant_bit():
    """z_0 swapping (p_0 = 0) and z_1 keeping (p_1 = 1): swap ⊗ I exchanges streams 0 <-> 2 and 1 <-> 3."""
    h = R.kronecker_res(torch.tensor([-80.0, 80.0], dtype=torch.float64), 4)
    expected = torch.tensor([[0, 0, 1, 0], [0, 0, 0, 1], [1, 0, 0, 0], [0, 1, 0, 0]], dtype=torch.float64)
    assert torch.allclose(h, expected)
    p = torch.sigmoid(torch.tensor(1.3, dtype=torch.float64))
    h = R.kronecker_res(torch.tensor([1.3, 80.0, 80.0], dtype=torch.float64), 8)
    assert h[0, 0].item() == pytest.approx(p.item()) and h[0, 4].item() == pytest.approx(1 - p.item())


@fast_first("family,n", [("mhc_lite", 3), ("mhc_lite", 4), ("kromhc", 4), ("kromhc", 8)])
def test_h_res_gradcheck_float64(family, n):
    torch.manual_seed(1)
    z = torch.randn(2, FAMILY[family].res_count(n), dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: FAMILY[family].res(t, n), (z,))


def random_params(family: str, n: int, C: int, dtype=torch.float64, seed: int = 0, T: int = 3):
    """Non-symmetric x, phi, bias and alpha (the gates well away from 0.01, so that phi matters)."""
    g = torch.Generator().manual_seed(seed)
    cols = 2 * n + FAMILY[family].res_count(n)
    x = torch.randn(T, n, C, generator=g, dtype=dtype)
    phi = 0.3 * torch.randn(n * C, cols, generator=g, dtype=dtype)
    bias = torch.randn(cols, generator=g, dtype=dtype)
    alpha = torch.tensor([0.7, 1.1, 1.3], dtype=dtype)
    return x, phi, bias, alpha


@fast_first("family,n", [("mhc_lite", 4), ("kromhc", 4), ("kromhc", 8)])
def test_coefficients_match_the_equations(family, n):
    """h_pre = sigma(.) + pre_eps, h_post = post_mult sigma(.), H^res from alpha_res x phi_res / rms + b_res."""
    x, phi, bias, alpha = random_params(family, n, C=6)
    opts = MHCOptions(pre_eps=1e-3, post_mult=1.5)
    h_pre, h_post, h_res = R.exact_coefficients(x, phi, bias, alpha, FAMILY[family], opts)
    flat = x.flatten(-2)
    proj = flat @ phi / torch.sqrt(flat.square().mean(-1, keepdim=True) + opts.rms_eps)
    torch.testing.assert_close(h_pre, torch.sigmoid(alpha[0] * proj[:, :n] + bias[:n]) + 1e-3)
    torch.testing.assert_close(h_post, 1.5 * torch.sigmoid(alpha[1] * proj[:, n : 2 * n] + bias[n : 2 * n]))
    z = alpha[2] * proj[:, 2 * n :] + bias[2 * n :]
    torch.testing.assert_close(R.exact_res_logits(x, phi, bias, alpha, FAMILY[family], opts), z)
    torch.testing.assert_close(h_res, by_hand(z, family, n))


@fast_first("family,n", [("mhc_lite", 3), ("mhc_lite", 4), ("kromhc", 4), ("kromhc", 8)])
def test_coefficients_and_enter_gradcheck_float64(family, n):
    """Every gradient of the op the model runs: x, phi, bias, alpha through h_pre, h_post, h_res and u."""
    x, phi, bias, alpha = (t.requires_grad_() for t in random_params(family, n, C=2, T=2))

    def enter(*args):
        return R.exact_enter(*args, FAMILY[family])[1:]

    assert torch.autograd.gradcheck(enter, (x, phi, bias, alpha))


@fast_first("family", ["mhc_lite", "kromhc"])
def test_float32_path_matches_float64_reference(family):
    x, phi, bias, alpha = random_params(family, 4, C=32, dtype=torch.float64, seed=3)
    ref = R.exact_enter(x, phi, bias, alpha, FAMILY[family])[1:]
    got = R.exact_enter(x.float(), phi.float(), bias.float(), alpha.float(), FAMILY[family])[1:]
    for r, g in zip(ref, got):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-6)


def test_coefficients_stay_fp32_under_autocast():
    x, phi, bias, alpha = random_params("kromhc", 4, C=8, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = R.krom_enter(x.bfloat16(), phi, bias, alpha)[2:]
    assert all(o.dtype == torch.float32 for o in outs)


def test_bad_sizes_name_the_field_and_allowed_values():
    with pytest.raises(ValueError, match=r"mHC-lite takes n_streams in \[2, 3, 4, 5\], got 6"):
        FAMILY["mhc_lite"].res_count(6)
    with pytest.raises(ValueError, match=r"KromHC takes n_streams in \[2, 4, 8, 16\] \(powers of 2\), got 6"):
        FAMILY["kromhc"].res_count(6)
    x, phi, bias, alpha = random_params("kromhc", 4, C=2)
    with pytest.raises(ValueError, match=r"mHC-lite at n=4 needs phi and bias with 32 columns"):
        R.lite_enter(x, phi, bias, alpha)
