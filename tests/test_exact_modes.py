"""residual_mode mhc_lite and kromhc in the model (docs/design.md §15): their init, their config checks, the sublayer
against the float64 reference (forward and every gradient), the reference ops as their only path, and training that
moves H_res off I while rows and columns stay exact."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import fast_first, quick_model, recorded, text_batches, train

from mhc_lightning.kernels import reference as R
from mhc_lightning.model import GPT, GPTConfig, HyperConfig, HyperConnection
from mhc_lightning.model import gpt as gpt_module
from mhc_lightning.model import hyper_connection as hc_module
from mhc_lightning.model.exact_init import krom_logit, lite_gap, mhc_diagonal
from mhc_lightning.model.modes import spec

EXACT = ["mhc_lite", "kromhc"]
MHC_DIAG_GAP6 = math.exp(6) / (math.exp(6) + 3)  # Sinkhorn(6 I) at n = 4: 0.992619


@fast_first("mode", EXACT)
def test_init_is_a_prenorm_residual_with_mhc_s_diagonal(mode):
    """t = 0, phi = 0: sublayer k reads stream k mod 4 (0.953 / 0.047), writes every stream (H_post = 1), and H_res
    has mHC's diagonal at res_gap 6 (0.992619); mHC-lite's H_res is the very matrix mHC starts from."""
    m = quick_model(mode)
    rec = recorded(m, text_batches(1)[0][:1, :-1])
    torch.testing.assert_close(rec["h_res"].diagonal(dim1=-2, dim2=-1), torch.full((6, 64, 4), MHC_DIAG_GAP6))
    assert [layer.bias[:4].argmax().item() for layer in m.sublayers] == [k % 4 for k in range(6)]
    assert rec["h_pre"].amax(-1).min().item() == pytest.approx(torch.sigmoid(torch.tensor(3.0)).item() + 1e-6)
    torch.testing.assert_close(rec["h_post"], torch.ones_like(rec["h_post"]))
    mhc = recorded(quick_model("mhc"), text_batches(1)[0][:1, :-1])["h_res"]
    if mode == "mhc_lite":
        torch.testing.assert_close(rec["h_res"], mhc, atol=2e-4, rtol=0)  # mHC's own Sinkhorn adds eps 1e-6 guards
    else:  # nearest neighbours (one index bit apart) p (1 - p), the far stream (1 - p)^2
        p = math.sqrt(MHC_DIAG_GAP6)
        assert rec["h_res"][0, 0, 0].tolist() == pytest.approx([p * p, p * (1 - p), p * (1 - p), (1 - p) ** 2])


@fast_first("n", [2, 3, 4, 5])
@fast_first("gap", [0.0, 1.0, 6.0, 10.0])
def test_lite_gap_gives_mhc_s_diagonal(n, gap):
    z = torch.zeros(math.factorial(n), dtype=torch.float64)
    z[0] = lite_gap(n, gap)
    h = R.birkhoff_res(z, n)
    assert h.diagonal().tolist() == pytest.approx([mhc_diagonal(n, gap)] * n, rel=1e-12)
    off = h[~torch.eye(n, dtype=torch.bool)]
    assert off.tolist() == pytest.approx([off[0].item()] * (n * n - n), rel=1e-12)  # d I + o (J - I), as mHC


@fast_first("n", [2, 4, 8, 16])
@fast_first("gap", [0.0, 1.0, 6.0, 10.0])
def test_krom_logit_gives_mhc_s_diagonal(n, gap):
    K = n.bit_length() - 1
    h = R.kronecker_res(torch.full((K,), krom_logit(n, gap), dtype=torch.float64), n)
    assert h.diagonal().tolist() == pytest.approx([mhc_diagonal(n, gap)] * n, rel=1e-12)


@fast_first("mode,cols", [("mhc_lite", 2 * 4 + 24), ("kromhc", 2 * 4 + 2)])
def test_parameter_layout(mode, cols):
    layer = quick_model(mode).sublayers[0]
    assert layer.phi.shape == (4 * 128, cols) and layer.bias.shape == (cols,) and layer.alpha.shape == (3,)


@fast_first("scheme", ["zeros", "near_identity"])
@fast_first("mode", EXACT)
def test_identical_stream_configs_are_refused(mode, scheme):
    with pytest.raises(ValueError, match=r"keeps all 4 streams identical.*allow_identical_streams"):
        HyperConfig(residual_mode=mode, bias_init=scheme)
    HyperConfig(residual_mode=mode, bias_init=scheme, phi_init="normal")


@fast_first("mode", EXACT)
def test_symmetric_init_keeps_the_streams_identical_bit_for_bit(mode):
    """zeros: H_res = J/n (the average of all permutations; each Kronecker factor J/2) and the streams never part."""
    m = quick_model(mode, bias_init="zeros", allow_identical_streams=True)
    rec = recorded(m, train(m, steps=10))
    assert rec["spread"].abs().max().item() == 0.0
    torch.testing.assert_close(rec["h_res"], torch.full_like(rec["h_res"], 0.25), atol=1e-6, rtol=0)


def test_bad_stream_counts_and_backends_are_refused_in_one_line():
    with pytest.raises(
        ValueError,
        match=r"^n_streams for residual_mode=mhc_lite must be one of \[2, 3, 4, 5\], "
        r"got 6$",
    ):
        HyperConfig(residual_mode="mhc_lite", n_streams=6)
    with pytest.raises(
        ValueError,
        match=r"^n_streams for residual_mode=kromhc must be one of \[2, 4, 8, 16\], "
        r"got 3$",
    ):
        HyperConfig(residual_mode="kromhc", n_streams=3)
    with pytest.raises(
        ValueError,
        match=r"kernel_backend=triton has no kernels for residual_mode=kromhc.*"
        r"one of \['auto', 'torch'\]",
    ):
        HyperConfig(residual_mode="kromhc", kernel_backend="triton")
    assert HyperConfig(residual_mode="mhc_lite", kernel_backend="auto").ops_backend == "torch"
    assert HyperConfig(residual_mode="mhc", kernel_backend="auto").ops_backend == "auto"


class Poisoned:
    """Stands in for get_ops' answer: any op taken from it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"op {name} requested through get_ops")


@fast_first("mode", EXACT)
def test_exact_modes_never_ask_get_ops_for_their_ops(mode, monkeypatch):
    """kernel_backend auto picks the fused ops on CUDA; the exact families must not reach them: every op they run,
    the stream's expand and collapse included, is the reference's, whatever get_ops would answer."""

    def only_reference(backend, device):
        return R if backend == "torch" else Poisoned()

    monkeypatch.setattr(gpt_module, "get_ops", only_reference)
    monkeypatch.setattr(hc_module, "get_ops", only_reference)
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layers=1, d_model=32, n_heads=2, context=16, hyper=HyperConfig(residual_mode=mode)))
    m(text_batches(1, B=2, T=16)[0][:, :-1]).sum().backward()
    with pytest.raises(AssertionError, match="requested through get_ops"):  # the poison works: mHC asks for it
        GPT(GPTConfig(n_layers=1, d_model=32, n_heads=2, context=16))(text_batches(1, B=2, T=16)[0][:, :-1])


def float64_sublayer(mode: str, n: int = 4, C: int = 6, seed: int = 0) -> HyperConnection:
    """One sublayer with a linear branch and random (non-symmetric, gates well above 0.01) coefficients."""
    torch.manual_seed(seed)
    layer = HyperConnection(nn.Linear(C, C), C, 1, HyperConfig(residual_mode=mode, n_streams=n)).double()
    with torch.no_grad():
        layer.phi.normal_(std=0.3)
        layer.bias.normal_()
        layer.alpha.copy_(torch.tensor([0.7, 1.1, 1.3]))
    return layer


@fast_first("mode,n", [("mhc_lite", 4), ("mhc_lite", 3), ("kromhc", 4), ("kromhc", 8)])
def test_sublayer_matches_the_float64_reference_forward_and_gradients(mode, n):
    """x_next = H_res x + h_post^T F(h_pre x) with the reference's coefficients, written out here; the same output
    and the same gradients for x, phi, bias, alpha and the branch's weights."""
    layer = float64_sublayer(mode, n)
    x = torch.randn(2, 3, n, 6, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    _, _, h_pre, h_post, h_res = getattr(R, spec(mode).enter)(x, layer.phi, layer.bias, layer.alpha)
    f = layer.branch((h_pre.unsqueeze(-1) * x).sum(-2))
    expected = h_res @ x + h_post.unsqueeze(-1) * f.unsqueeze(-2)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    params = [x, layer.phi, layer.bias, layer.alpha, layer.branch.weight, layer.branch.bias]
    for got, want in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(expected, params, g)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@fast_first("mode", EXACT)
def test_sublayer_gradcheck_float64(mode):
    layer = float64_sublayer(mode, C=2)
    names = ["phi", "bias", "alpha"]
    x = torch.randn(2, 4, 2, dtype=torch.float64, requires_grad=True)

    def run(x, *values):
        return torch.func.functional_call(layer, dict(zip(names, values)), (x,))

    assert torch.autograd.gradcheck(run, (x, *(getattr(layer, k).detach().clone().requires_grad_() for k in names)))


@pytest.mark.slow
@fast_first("mode", EXACT)
def test_training_moves_h_res_off_identity_and_parts_the_streams(mode):
    """Gain exactly 1 must not mean a frozen H_res: after 60 AdamW steps H_res has left its t = 0 value, the streams
    have parted and every row and column still sums to 1 (fp32 rounding)."""
    m = quick_model(mode)
    probe = text_batches(1)[0][:, :-1]
    before = recorded(m, probe)
    assert before["spread"].abs().max().item() < 1e-6
    after = recorded(m, train(m))
    moved = (after["h_res"] - before["h_res"]).abs().amax().item()
    assert moved > 1e-3, moved
    assert after["spread"][-1].mean().item() > 1e-2
    rows, cols = R.sinkhorn_residuals(after["h_res"])
    assert rows.max().item() < 1e-6 and cols.max().item() < 1e-6


@fast_first("mode", EXACT)
def test_recompute_and_rebuilt_branch_input_give_the_same_gradients(mode):
    """The selective recompute and the branch input's rebuild run the exact families through their forward."""
    idx = text_batches(1, B=2, T=16)[0]
    grads = []
    for extra in ({}, {"recompute_block": 2}, {"rebuild": True}):
        torch.manual_seed(0)
        cfg = GPTConfig(
            n_layers=2,
            d_model=32,
            n_heads=2,
            context=16,
            recompute_block=extra.get("recompute_block", 0),
            hyper=HyperConfig(residual_mode=mode, phi_init="normal", rebuild_branch_input=extra.get("rebuild", False)),
        )
        m = GPT(cfg)
        F.cross_entropy(m(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
        grads.append([p.grad.clone() for p in m.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@fast_first("mode", EXACT)
def test_compiled_model_matches_eager_in_one_graph(mode):
    """The fast path: the reference ops under torch.compile (aot_eager: graph capture and autograd, no C++ build),
    one graph without breaks, the same loss and gradients as eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from mhc_lightning.model.gpt import compile_model

    torch.manual_seed(0)
    m = GPT(
        GPTConfig(
            n_layers=1, d_model=32, n_heads=2, context=16, hyper=HyperConfig(residual_mode=mode, phi_init="normal")
        )
    )
    idx = text_batches(1, B=2, T=16)[0][:, :-1]
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    loss = compile_model(m, backend=counter)(idx).logsumexp(-1).mean()
    loss.backward()
    compiled_grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    eager = m(idx).logsumexp(-1).mean()
    eager.backward()
    assert loss.item() == pytest.approx(eager.item(), rel=1e-6)
    for a, p in zip(compiled_grads, m.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-7)
    assert counter.frame_count == 1
