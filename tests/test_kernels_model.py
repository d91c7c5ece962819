"""The fused kernels inside the GPT: one training step on the fused ops against the reference ops (and against float64
under bf16-mixed), each branch's input in its own dtype, and the branch input rebuilt in the backward."""

import pytest
import torch
from helpers import fast_first
from kernel_checks import CUDA, DEV, ITERS, check, poisoned_outputs

from mhc_lightning.kernels import fused
from mhc_lightning.kernels.fused.ops import stream_post_res

pytestmark = pytest.mark.usefixtures(poisoned_outputs.__name__)


@fast_first("mode", ["mhc", "identity", "hc", "residual"])
def test_model_training_step_kernels_equal_reference(mode):
    """One training step of the GPT with the fused kernels equals the same step on the reference ops (the residual
    GPT's fused op: RoPE)."""
    import torch.nn.functional as F

    from mhc_lightning.model import GPT, GPTConfig, HyperConfig

    def step(backend):
        torch.manual_seed(0)
        cfg = GPTConfig(
            n_layers=1,
            d_model=24,
            n_heads=2,
            context=16,
            hyper=HyperConfig(
                residual_mode=mode,
                sinkhorn_iters=ITERS,
                phi_init="normal",
                bias_init="hc_identity",
                kernel_backend=backend,
            ),
        )
        model = GPT(cfg).to(DEV)
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, 256, (2, 17), generator=g).to(DEV)
        loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        return loss, {k: p.grad for k, p in model.named_parameters() if p.grad is not None}

    loss_k, grads_k = step("triton")
    loss_r, grads_r = step("torch")
    torch.testing.assert_close(loss_k, loss_r, rtol=1e-4, atol=1e-5)
    assert grads_k.keys() == grads_r.keys()
    for name in grads_r:
        check(grads_k[name], grads_r[name].double(), 2e-3, name)


@fast_first("mode,chain", [("mhc", "auto"), ("mhc", False), ("hc", "auto")])
def test_model_hands_each_branch_its_input_without_a_cast(mode, chain, monkeypatch):
    """Under bf16 autocast with a bf16 stream (the trainer's), every mHC / HC branch gets u in its parameters' fp32 from
    the op itself (`mhc_enter` one sublayer at a time, the boundary op in the chain, `hc_enter`): no cast node between
    them. The step equals the one with torch's cast each way (`fused._u_written` None: u in the stream's dtype, cast
    after the op): bitwise on the GPU; under the interpreter, which truncates the backward's fp32 -> bf16 rounding of
    du where torch rounds to nearest even, the loss bitwise and the gradients to 1 % (all together)."""
    import torch.nn.functional as F

    from mhc_lightning.model import GPT, GPTConfig, HyperConfig

    written = fused._u_written

    def step(inside):
        torch.manual_seed(0)
        cfg = GPTConfig(
            n_layers=2,
            d_model=32,
            n_heads=2,
            context=16,
            stream_dtype="bfloat16",
            hyper=HyperConfig(
                residual_mode=mode,
                sinkhorn_iters=ITERS,
                phi_init="normal",
                kernel_backend="triton",
                chain_sublayers=chain,
            ),
        )
        model = GPT(cfg).to(DEV)
        seen = []

        def producer(t):  # the node that made the branch's input, past reshapes
            fn = t.grad_fn
            while type(fn).__name__ in ("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"):
                fn = fn.next_functions[0][0]
            return type(fn).__name__

        for layer in model.sublayers:
            layer.branch.register_forward_pre_hook(lambda m, a: seen.append((a[0].dtype, producer(a[0]))))
        idx = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1)).to(DEV)
        monkeypatch.setattr(fused, "_u_written", written if inside else lambda x, u_dtype: None)
        with torch.autocast(DEV, dtype=torch.bfloat16):
            logits = model(idx[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
        return seen, loss, {k: p.grad for k, p in model.named_parameters()}

    seen, loss, grads = step(True)
    seen_cast, loss_cast, grads_cast = step(False)
    ours = ("eagerBackward", "HCEnterFoldedBackward")  # the fused ops' autograd nodes
    assert len(seen) == 4 and all(d == torch.float32 and fn.endswith(ours) for d, fn in seen), seen
    assert all(d == torch.float32 and fn == "ToCopyBackward0" for d, fn in seen_cast), seen_cast
    assert torch.equal(loss, loss_cast)
    assert grads.keys() == grads_cast.keys()
    if CUDA:
        for name, g in grads_cast.items():
            assert torch.equal(grads[name], g), name
    else:  # all gradients together: single sums over tokens (alpha's) can nearly cancel
        a, b = (torch.cat([gs[k].double().flatten() for k in sorted(gs)]) for gs in (grads, grads_cast))
        assert ((a - b).norm() / b.norm()).item() < 1e-2


@fast_first(
    "mode,chain,via",
    [
        ("mhc", True, "write-back"),
        ("mhc", False, "write-back"),
        ("hc", "auto", "write-back"),
        ("identity", True, "write-back"),
        ("mhc", True, "rebuild_u"),
    ],
)
def test_model_rebuilds_the_branch_input_bitwise_and_keeps_less(mode, chain, via, monkeypatch):
    """HyperConfig.rebuild_branch_input under the trainer's bf16-mixed: the step (loss, every gradient) is bitwise the
    one that keeps u, and what autograd keeps between forward and backward is smaller by exactly one fp32 u per
    sublayer (C * 4 bytes per token): the branch's norm held u and nothing else did. u comes from the write-back's
    backward (`request_u`: no `rebuild_u` call, every request served), or without requests from `rebuild_u`."""
    import torch.nn.functional as F

    from mhc_lightning.model import GPT, GPTConfig, HyperConfig
    from mhc_lightning.model.recompute import live_activation_bytes

    rebuilt, real_rebuild = [], fused.rebuild_u
    monkeypatch.setattr(fused, "rebuild_u", lambda *a: rebuilt.append(1) or real_rebuild(*a))
    if via == "rebuild_u":
        monkeypatch.setattr(fused, "request_u", lambda *a: None)

    def step(rebuild):
        torch.manual_seed(0)
        cfg = GPTConfig(
            n_layers=2,
            d_model=32,
            n_heads=2,
            context=16,
            stream_dtype="bfloat16",
            hyper=HyperConfig(
                residual_mode=mode,
                sinkhorn_iters=ITERS,
                phi_init="normal",
                kernel_backend="triton",
                chain_sublayers=chain,
                rebuild_branch_input=rebuild,
            ),
        )
        model = GPT(cfg).to(DEV)
        idx = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1)).to(DEV)
        with torch.autocast(DEV, dtype=torch.bfloat16):
            with live_activation_bytes(exclude=list(model.parameters()) + list(model.buffers())) as kept:
                logits = model(idx[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
        return loss, {k: p.grad for k, p in model.named_parameters()}, kept["bytes"]

    loss, grads, kept = step(True)
    assert len(rebuilt) == (4 if via == "rebuild_u" else 0) and len(stream_post_res._REQUESTS) == 0, (
        rebuilt,
        dict(stream_post_res._REQUESTS),
    )
    loss_kept, grads_kept, kept_u = step(False)
    assert torch.equal(loss, loss_kept)
    for name, g in grads_kept.items():
        assert torch.equal(grads[name], g), name
    assert kept_u - kept == 4 * 32 * 4 * 16 * 2, (kept_u, kept)  # sublayers * C * fp32 * tokens


@fast_first("mode", ["mhc", "identity", "hc", "residual"])
def test_model_step_under_bf16_autocast_matches_float64(mode):
    """A training step as the trainer runs it under bf16-mixed (autocast, bf16 stream) on the fused kernels, against
    the same step in float64 on the reference ops: the loss, and all gradients together (single parameters with a
    near-zero gradient are bf16 noise on both backends: 0.4-0.6 % for the whole vector, either backend)."""
    import torch.nn.functional as F

    from mhc_lightning.model import GPT, GPTConfig, HyperConfig

    def step(backend, dtype):
        torch.manual_seed(0)
        cfg = GPTConfig(
            n_layers=1,
            d_model=32,
            n_heads=2,
            context=16,
            stream_dtype="bfloat16" if dtype == torch.bfloat16 else "auto",
            hyper=HyperConfig(
                residual_mode=mode,
                sinkhorn_iters=ITERS,
                phi_init="normal",
                bias_init="hc_identity",
                kernel_backend=backend,
            ),
        )
        model = GPT(cfg).to(DEV)
        model = model.double() if dtype == torch.float64 else model
        idx = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1)).to(DEV)
        with torch.autocast(DEV, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.double().flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        grads = {k: p.grad.double() for k, p in model.named_parameters() if p.grad is not None}
        return loss, torch.cat([grads[k].flatten() for k in sorted(grads)])

    loss, grads = step("triton", torch.bfloat16)
    loss64, grads64 = step("torch", torch.float64)
    assert abs(loss.item() - loss64.item()) / loss64.item() < 1e-3
    assert grads.shape == grads64.shape and torch.isfinite(grads).all()
    assert ((grads - grads64).norm() / grads64.norm()).item() < 2e-2
