"""The GPT with residual / HC / mHC / identity-HC / mHC-lite / KromHC sublayers: shapes, causality, init identities,
training."""

import pytest
import torch
import torch.nn.functional as F
from helpers import fast_first, make_text

from mhc_lightning.kernels import reference
from mhc_lightning.kernels.reference import gain_report
from mhc_lightning.model import GPT, GPTConfig, HyperConfig, exact_init
from mhc_lightning.model.modes import MODES as SPECS
from mhc_lightning.model.modes import RESIDUAL_MODES

MODES = list(RESIDUAL_MODES)


def tiny(mode="mhc", n_layers=2, d_model=32, **hyper) -> GPTConfig:
    return GPTConfig(
        n_layers=n_layers, d_model=d_model, n_heads=2, context=32, hyper=HyperConfig(residual_mode=mode, **hyper)
    )


def text_batch(B=4, T=32, seed=0) -> torch.Tensor:
    data = torch.tensor(list(make_text(B * (T + 1) + 10, seed=seed).encode()), dtype=torch.long)
    return data[: B * (T + 1)].view(B, T + 1)


def copy_shared_weights(dst: GPT, src: GPT) -> None:
    """Copy every parameter the two models share by name and shape (embedding, branches, final norm)."""
    src_params = dict(src.named_parameters())
    with torch.no_grad():
        for name, p in dst.named_parameters():
            if name in src_params and src_params[name].shape == p.shape:
                p.copy_(src_params[name])


def final_hidden(m: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The collapsed stream entering the final norm."""
    seen = {}
    handle = m.norm.register_forward_hook(lambda mod, inp, out: seen.setdefault("x", inp[0]))
    with torch.no_grad():
        m(idx)
    handle.remove()
    return seen["x"]


@fast_first("mode", MODES)
def test_shapes(mode):
    m = GPT(tiny(mode))
    idx = text_batch()[:, :-1]
    assert m(idx).shape == (4, 32, 256)
    assert m(idx[:, :7]).shape == (4, 7, 256)
    with pytest.raises(ValueError, match="context"):
        m(torch.zeros(1, 33, dtype=torch.long))


@fast_first("mode", MODES)
def test_causality(mode):
    torch.manual_seed(0)
    m = GPT(tiny(mode, phi_init="normal", bias_init="hc_identity"))
    idx = text_batch(B=1)[:, :-1]
    t = 17
    idx2 = idx.clone()
    idx2[0, t + 1 :] = (idx2[0, t + 1 :] + 11) % 256
    with torch.no_grad():
        a, b = m(idx), m(idx2)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6)
    assert (a[:, t + 1 :] - b[:, t + 1 :]).abs().max() > 1e-3


def test_hc_at_init_equals_a_prenorm_residual_model():
    """HC §2.3: with W = 0, B = 1, A_m = e_{k mod n}, A_r = I every stream carries the residual stream."""
    torch.manual_seed(0)
    res, hc = GPT(tiny("residual")), GPT(tiny("hc"))
    copy_shared_weights(hc, res)
    idx = text_batch()[:, :-1]
    # the sum collapse of 4 identical streams is 4x the residual stream, exactly
    torch.testing.assert_close(final_hidden(hc, idx), 4 * final_hidden(res, idx), rtol=1e-5, atol=1e-6)


def test_mhc_with_one_stream_equals_residual():
    """n = 1: H_res = 1 (up to eps), H_post = 2 sigma(0) = 1, H_pre = 1/2 is absorbed by the branch pre-norm."""
    torch.manual_seed(0)
    cfg_res, cfg_mhc = tiny("residual"), tiny("mhc", n_streams=1)
    cfg_res.norm_eps = cfg_mhc.norm_eps = 1e-12  # so that RMSNorm(x / 2) == RMSNorm(x) to rounding
    res, mhc = GPT(cfg_res), GPT(cfg_mhc)
    copy_shared_weights(mhc, res)
    idx = text_batch()[:, :-1]
    with torch.no_grad():
        torch.testing.assert_close(mhc(idx), res(idx), rtol=1e-4, atol=1e-4)


def test_streams_persist_across_blocks():
    """With A_r = c I and silent branches, the collapsed stream is n c^L h: expanded once, never re-expanded."""
    c, cfg = 1.1, tiny("hc", n_layers=3)
    m = GPT(cfg)
    with torch.no_grad():
        for layer in m.sublayers:
            layer.ar_static.mul_(c)
            layer.branch.out.weight.zero_()
    idx = text_batch()[:, :-1]
    torch.testing.assert_close(final_hidden(m, idx), 4 * c**cfg.n_sublayers * m.embed(idx).detach())


def test_composite_gain_depends_on_hc_depth():
    def composite(n_layers):
        m = GPT(tiny("hc", n_layers=n_layers))
        with torch.no_grad():
            for layer in m.sublayers:
                layer.ar_static.mul_(1.1)
        with m.recording(), torch.no_grad():
            m(text_batch()[:, :-1])
        return gain_report(m.recorded()["h_res"])["composite_fwd_max"][0].item()

    assert composite(1) == pytest.approx(1.1**2)
    assert composite(3) == pytest.approx(1.1**6)


def test_recorded_mhc_coefficients():
    m = GPT(tiny("mhc", bias_init="hc_identity"))
    with m.recording(), torch.no_grad():
        m(text_batch()[:, :-1])
    rec = m.recorded()
    assert rec["h_res"].shape == (4, 32, 4, 4) and rec["h_pre"].shape == (4, 32, 4)
    assert torch.allclose(rec["h_res"].sum(-1), torch.ones(()), atol=1e-5)
    assert all(layer.last is not None and not layer.record for layer in m.sublayers)
    ident = GPT(tiny("identity"))
    with ident.recording(), torch.no_grad():
        ident(text_batch()[:, :-1])
    assert torch.equal(ident.recorded()["h_res"][0, 0], torch.eye(4))
    assert GPT(tiny("residual")).recorded() == {}
    assert "logit_range" not in ident.recorded()


@fast_first("chain", [False, True])
def test_recorded_logit_range_is_the_res_logits_range(chain):
    """At init (phi = 0) the res logits are the bias, res_gap * I: every token's range is res_gap, in either wiring.
    With phi moved off zero the range is what the reference computes from the sublayer's input stream."""
    m = GPT(tiny("mhc", n_layers=2, chain_sublayers=chain, res_gap=5.0))
    idx = text_batch()[:, :-1]
    with m.recording(), torch.no_grad():
        m(idx)
    assert m.recorded()["logit_range"].shape == (4, 32)
    assert torch.allclose(m.recorded()["logit_range"], torch.full((4, 32), 5.0))
    first = m.sublayers[0]
    torch.manual_seed(0)
    with torch.no_grad():
        first.phi.normal_(std=0.5)
    inputs = {}
    handle = first.register_forward_pre_hook(lambda mod, args: inputs.setdefault("x", args[0]))
    with m.recording(), torch.no_grad():
        m(idx)
    handle.remove()
    if "x" in inputs:  # one sublayer at a time: the hook saw sublayer 0's input stream
        z = reference.mhc_res_logits(inputs["x"][:1], first.phi, first.bias, first.alpha, first.options())
        expected = (z.amax(dim=(-2, -1)) - z.amin(dim=(-2, -1)))[0]
        assert torch.allclose(m.recorded()["logit_range"][0], expected, atol=1e-5)
    assert not torch.allclose(m.recorded()["logit_range"][0], torch.full((32,), 5.0))


@fast_first("mode", MODES)
def test_each_mode_trains(mode):
    torch.manual_seed(0)
    m = GPT(tiny(mode))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    batch = text_batch(B=8)
    x, y = batch[:, :-1], batch[:, 1:]
    losses = []
    for _ in range(25):
        loss = F.cross_entropy(m(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_every_mode_spec_names_ops_inits_and_streams_that_exist():
    """The registry's references resolve, for a new entry too: its enter / exit ops on the reference (and the fused
    kernels when it claims them), its res init, the n it allows; and its modes are residual_mode's Literal's."""
    from mhc_lightning.kernels import fused

    assert tuple(SPECS) == RESIDUAL_MODES
    for spec in SPECS.values():
        ops = [spec.enter, spec.exit] if spec.multi_stream else []
        assert all(hasattr(reference, op) and (not spec.fused or hasattr(fused, op)) for op in ops), spec.name
        assert (spec.res_init is not None) == spec.exact and (not spec.exact or hasattr(exact_init, spec.res_init))
        assert spec.allowed_streams() is None or all(isinstance(n, int) for n in spec.allowed_streams())
        assert not spec.chains or (spec.fused and spec.parameters == "phi")
        assert set(spec.warns) <= set(spec.ignores)


def test_config_errors_name_field_and_allowed_values():
    with pytest.raises(
        ValueError,
        match=r"residual_mode must be one of "
        r"\['residual', 'hc', 'mhc', 'identity', 'mhc_lite', 'kromhc'\]",
    ):
        HyperConfig(residual_mode="dense")
    with pytest.raises(ValueError, match="n_streams must be >= 1"):
        HyperConfig(n_streams=0)
    with pytest.raises(ValueError, match="sinkhorn_iters must be >= 1"):
        HyperConfig(sinkhorn_iters=0)
    with pytest.raises(ValueError, match="d_model must be divisible by n_heads"):
        GPTConfig(d_model=30, n_heads=4)


# ---- residual stream dtype (GPTConfig.stream_dtype) ----------------------------------------------------------
def stream_dtype_seen(m: GPT, idx: torch.Tensor) -> torch.dtype:
    """The dtype of the stream that leaves the last sublayer (chained sublayers call no module hooks)."""
    seen = []
    collapse = m.collapse
    m.collapse = lambda x, dtype=None: seen.append(x.dtype) or collapse(x, dtype)
    try:
        loss = F.cross_entropy(m(idx).flatten(0, 1).float(), idx.flatten())
    finally:
        del m.collapse
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    return seen[0], loss.detach()


@fast_first("mode", MODES)
def test_stream_dtype_follows_autocast(mode):
    torch.manual_seed(0)
    base = GPT(tiny(mode, phi_init="normal", bias_init="hc_identity"))
    idx = text_batch(B=2)[:, :-1]
    losses = {}
    for name, expected in (("auto", torch.bfloat16), ("float32", torch.float32)):
        cfg = tiny(mode, phi_init="normal", bias_init="hc_identity")
        cfg.stream_dtype = name
        m = GPT(cfg)
        m.load_state_dict(base.state_dict())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            dtype, losses[name] = stream_dtype_seen(m, idx)
            assert m(idx).dtype == torch.bfloat16  # the head still runs under autocast
        assert dtype == expected
    assert losses["auto"].item() == pytest.approx(losses["float32"].item(), rel=2e-2)
    assert stream_dtype_seen(base, idx)[0] == torch.float32  # auto without autocast: the embedding's dtype
    with torch.autocast("cpu", dtype=torch.float16):  # 16-mixed: fp32 stream, unless float16 is asked for
        assert stream_dtype_seen(base, idx)[0] == torch.float32


@fast_first("mode", ["residual", "mhc"])
def test_explicit_stream_dtype_without_autocast(mode):
    """A bf16 stream with fp32 weights and no autocast: the branches still get their weights' dtype."""
    torch.manual_seed(0)
    cfg = tiny(mode, phi_init="normal")
    cfg.stream_dtype = "bfloat16"
    m = GPT(cfg)
    idx = text_batch(B=2)[:, :-1]
    dtype, loss = stream_dtype_seen(m, idx)
    assert dtype == torch.bfloat16 and m(idx).dtype == torch.float32


def test_stream_dtype_config_error():
    with pytest.raises(ValueError, match=r"stream_dtype must be one of \['auto', 'float32', 'bfloat16', 'float16'\]"):
        GPTConfig(stream_dtype="fp8")


@pytest.mark.slow
def test_compiled_model_traces_once_more_when_the_sinkhorn_count_changes():
    """The scheduler's per-layer counts are ints on modules: compile_model makes a changing one symbolic (fused
    kernels take it at run time) instead of tracing the model again for every new count."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from mhc_lightning.model.gpt import compile_model

    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layers=1,
        d_model=32,
        n_heads=2,
        context=16,
        hyper=HyperConfig(residual_mode="mhc", kernel_backend="triton", sinkhorn_iters=4, phi_init="normal"),
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors on a CUDA machine take the reference ops
    m = GPT(cfg).to(device)
    counter = CompileCounterWithBackend("aot_eager")  # graph capture + autograd; no C++ build on CPU
    torch._dynamo.reset()
    forward = compile_model(m, backend=counter)
    idx = text_batch(B=2, T=16)[:, :-1].to(device)
    for iters in (4, 5, 2):  # a first count, a second (traced once more, symbolic), a third (no trace)
        for layer in m.sublayers:
            layer.sinkhorn_iters = iters
        loss = forward(idx).float().logsumexp(-1).mean()
        loss.backward()
        eager = m(idx).float().logsumexp(-1).mean()  # the same count, uncompiled
        assert loss.item() == pytest.approx(eager.item(), rel=1e-5)
    assert counter.frame_count == 2  # the first trace, then one with the count symbolic
