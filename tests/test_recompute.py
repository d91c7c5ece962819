"""Selective recompute of the mHC ops over blocks of L_r sublayers (docs/design.md §9, model/recompute.py)."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import CONF, fast_first

from mhc_lightning.model import GPT, GPTConfig, HyperConfig, hyper_connections, recompute
from mhc_lightning.model.recompute import live_activation_bytes, optimal_block, run_sublayers, saved_tensor_bytes

B, T = 2, 8


def model(mode="mhc", block=0, n_layers=2, d_model=32, **hyper) -> GPT:
    cfg = GPTConfig(
        n_layers=n_layers,
        d_model=d_model,
        n_heads=2,
        context=T,
        recompute_block=block,
        hyper=HyperConfig(residual_mode=mode, phi_init="normal", bias_init="hc_identity", **hyper),
    )
    return GPT(cfg)


def randomized(m: GPT, seed=0) -> GPT:
    """Every parameter moved off its init (HC's dynamic weights start at zero), so every gradient path is live."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return m


def tokens(seed=1) -> torch.Tensor:
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def loss_of(m: GPT, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(idx).flatten(0, 1).float(), idx.flatten())


def loss_and_grads(m: GPT, idx: torch.Tensor):
    m.zero_grad(set_to_none=True)
    loss = loss_of(m, idx)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in m.named_parameters()}


@fast_first("L,expected", [(12, 3), (24, 4), (48, 6), (60, 6)])
def test_optimal_block_matches_the_worked_table(L, expected):
    assert optimal_block(L, 4) == expected


def test_auto_block_and_residual():
    assert model(block="auto", n_layers=6).recompute_block == optimal_block(12, 4) == 3
    assert model(block="auto", n_streams=2).recompute_block == optimal_block(4, 2)
    assert model("residual", block=2).recompute_block == 0  # no mHC ops: nothing to recompute


@fast_first(
    "mode,backend",
    [
        ("mhc", "torch"),
        ("mhc", "triton"),
        ("hc", "torch"),
        ("hc", "triton"),
        ("identity", "torch"),
        ("identity", "triton"),
    ],
)
def test_recompute_gives_the_same_loss_and_gradients(mode, backend):
    # the Triton interpreter's time goes mostly into the Sinkhorn loops: fewer iterations, same code paths
    opts = dict(kernel_backend=backend, sinkhorn_iters=4 if backend == "triton" else 20)
    base = randomized(model(mode, **opts))
    idx = tokens()
    loss0, grads0 = loss_and_grads(base, idx)
    assert all(g is not None and g.abs().max() > 0 for g in grads0.values())
    for block in (1, 3, "auto"):  # L = 4: 3 leaves a short last block; auto is 2
        m = model(mode, block=block, **opts)
        assert m.recompute_block == (2 if block == "auto" else block)
        m.load_state_dict(base.state_dict())
        loss, grads = loss_and_grads(m, idx)
        torch.testing.assert_close(loss, loss0, rtol=1e-6, atol=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(
                g, grads0[name], rtol=1e-6, atol=1e-7, msg=lambda s, block=block, name=name: f"{block} {name}: {s}"
            )


def saved_bytes(m: GPT, idx: torch.Tensor) -> int:
    """What autograd keeps between forward and backward (plus the scalar loss)."""
    with live_activation_bytes(exclude=list(m.parameters()) + list(m.buffers())) as stats:
        loss = loss_of(m, idx)
    loss.backward()  # the graph really is usable
    return stats["bytes"]


def test_live_bytes_agree_with_saved_tensors_hooks_without_recompute():
    """The measure above equals what saved_tensors_hooks see (one count per storage) plus the 4-byte loss."""
    m, idx = randomized(model()), tokens()
    with saved_tensor_bytes(exclude=list(m.parameters()) + list(m.buffers())) as saved:
        loss = loss_of(m, idx)
    hooked = saved["bytes"]
    del loss
    assert saved_bytes(m, idx) == hooked + 4


@fast_first("backend,blocks", [("torch", (2, 3, 6)), ("triton", (6,))])  # the interpreter is slow
def test_recompute_drops_the_stream_inside_each_block(backend, blocks):
    n_layers, C, n = 3, 32, 4
    iters = 4 if backend == "triton" else 20
    base = randomized(model(n_layers=n_layers, d_model=C, kernel_backend=backend, sinkhorn_iters=iters))
    idx = tokens()
    plain = saved_bytes(base, idx)
    stream = n * C * 4 * idx.numel()  # one fp32 n-stream x_l
    L = 2 * n_layers
    for block in blocks:
        base.recompute_block = block
        kept = saved_bytes(base, idx)
        # at least the x_l of every sublayer that does not start a block is gone
        assert plain - kept >= (L - math.ceil(L / block)) * stream, (block, plain, kept)
    if backend == "torch":  # block 1 keeps every x_l, yet the reference's Sinkhorn intermediates are dropped
        base.recompute_block = 1
        assert saved_bytes(base, idx) < plain


def test_a_policy_that_saves_everything_saves_no_memory(monkeypatch):
    """The control for the test above: caching every op's output keeps at least what plain autograd keeps."""
    base = randomized(model(n_layers=3))
    idx = tokens()
    plain = saved_bytes(base, idx)
    monkeypatch.setattr(recompute, "saves_output", lambda op, args: True)
    # the reference Sinkhorn adds eps in place to a softmax output: let the cache hold it (memory only here)
    real = recompute.create_selective_checkpoint_contexts
    monkeypatch.setattr(
        recompute, "create_selective_checkpoint_contexts", lambda policy: real(policy, allow_cache_entry_mutation=True)
    )
    base.recompute_block = 3
    assert saved_bytes(base, idx) >= 0.95 * plain


def test_no_checkpoint_without_autograd_or_in_eval(monkeypatch):
    calls = []
    real = recompute.checkpoint
    monkeypatch.setattr(recompute, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    m, idx = model(block=3), tokens()
    with torch.no_grad():
        m(idx)
    m.eval()
    m(idx)
    assert calls == []
    m.train()
    loss_of(m, idx).backward()
    assert len(calls) == 2  # L = 4 in blocks of 3 and 1


def test_recording_is_kept_once(monkeypatch):
    """Diagnostics record in the forward; the replay in the backward must neither record again nor clear flags."""
    base = randomized(model())
    idx = tokens()
    with base.recording():
        loss_of(base, idx)
    expected = base.recorded()
    m = model(block=2)
    m.load_state_dict(base.state_dict())
    with m.recording():
        loss = loss_of(m, idx)
        firsts = [layer.last for layer in m.sublayers]
        loss.backward()  # replays both blocks while still recording
        assert all(layer.record for layer in m.sublayers)
        assert all(layer.last is first for layer, first in zip(m.sublayers, firsts))
    assert not any(layer.record for layer in m.sublayers)
    got = m.recorded()
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0)


@pytest.mark.slow
@fast_first("backend", ["torch", "triton"])
def test_recompute_under_torch_compile(backend):
    """AOT autograd with the selective-checkpoint tags (aot_eager: the same graphs inductor gets, no C++ build); with
    the fused kernels the boundary op is a custom op inside each checkpointed block, recomputed in the backward."""
    opts = dict(kernel_backend=backend, sinkhorn_iters=4)
    base = randomized(model(**opts))
    idx = tokens()
    loss0, grads0 = loss_and_grads(base, idx)
    m = model(block=2, **opts)
    m.load_state_dict(base.state_dict())
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    m.zero_grad(set_to_none=True)
    loss = F.cross_entropy(compiled(idx).flatten(0, 1).float(), idx.flatten())
    loss.backward()
    torch.testing.assert_close(loss.detach(), loss0, rtol=1e-6, atol=1e-6)
    for name, p in m.named_parameters():
        torch.testing.assert_close(p.grad, grads0[name], rtol=1e-5, atol=1e-6)


@fast_first("mode,backend", [("mhc", "torch"), ("identity", "torch"), ("mhc", "triton")])
def test_chain_equals_one_sublayer_at_a_time(mode, backend):
    """run_sublayers chains mHC sublayers through the boundary op; calling each sublayer on its own (its own
    coefficients, input and write-back) is the same function: same output, gradients and recorded coefficients."""
    m = randomized(model(mode, kernel_backend=backend, sinkhorn_iters=4, chain_sublayers=True))
    x = torch.randn(B, T, m.n, 32, requires_grad=True)
    results = []
    for run in (
        lambda x: run_sublayers(m.sublayers, x, 0),
        lambda x: recompute._run(m.sublayers, None, x),
        lambda x: [x := layer(x) for layer in m.sublayers][-1],
    ):
        m.zero_grad(set_to_none=True)
        with m.recording():
            out = run(x)
        (gx,) = torch.autograd.grad(out.square().sum(), x, retain_graph=True)
        out.square().sum().backward()
        results.append((out, gx, {k: p.grad for k, p in m.named_parameters()}, m.recorded()))
    # the reference boundary op is the composition of the per-sublayer ops: bitwise equal; the fused kernels sum
    # in another order
    tol = dict(rtol=0, atol=0) if backend == "torch" else dict(rtol=1e-4, atol=1e-5)
    (out0, gx0, grads0, rec0) = results[0]
    for out, gx, grads, rec in results[1:]:
        torch.testing.assert_close(out, out0, **tol)
        torch.testing.assert_close(gx, gx0, **tol)
        for name, g in grads.items():
            torch.testing.assert_close(g, grads0[name], **tol, msg=lambda s, name=name: f"{name}: {s}")
        logits = set() if mode == "identity" else {"logit_range"}  # identity-HC has no res logits
        assert rec.keys() == rec0.keys() == {"h_pre", "h_post", "h_res", "spread"} | logits
        for k in rec:
            torch.testing.assert_close(rec[k], rec0[k], **tol)


def test_chain_sublayers_auto_chains_where_the_boundary_op_is_fused_and_eager(monkeypatch):
    """chain_sublayers auto (the default): the chain with the fused backend in eager mode (the interpreter here, CUDA in
    training), one sublayer at a time with the reference ops, for HC, and while torch.compile traces; true / false
    decide alone. The default model really runs the chain there: every sublayer's `chain` is entered."""
    assert HyperConfig().chain_sublayers == "auto"
    x = torch.randn(B, T, 4, 32)
    decided = {}
    for mode, backend in (("mhc", "triton"), ("mhc", "torch"), ("identity", "triton"), ("hc", "triton")):
        for setting in ("auto", True, False):
            layers = list(model(mode, kernel_backend=backend, chain_sublayers=setting).sublayers)
            decided[mode, backend, setting] = recompute._chains(layers, x)
    assert decided == {
        ("mhc", "triton", "auto"): True,
        ("mhc", "torch", "auto"): False,
        ("identity", "triton", "auto"): True,
        ("hc", "triton", "auto"): False,
        **{
            (m, b, True): m != "hc"
            for m, b in (("mhc", "triton"), ("mhc", "torch"), ("identity", "triton"), ("hc", "triton"))
        },
        **{
            (m, b, False): False
            for m, b in (("mhc", "triton"), ("mhc", "torch"), ("identity", "triton"), ("hc", "triton"))
        },
    }
    fused = randomized(model("mhc", kernel_backend="triton"))
    entered = []
    chain = type(fused.sublayers[0]).chain
    monkeypatch.setattr(type(fused.sublayers[0]), "chain", lambda self, *a: entered.append(self) or chain(self, *a))
    run_sublayers(fused.sublayers, torch.randn(B, T, 4, 32), 0)
    assert entered == list(fused.sublayers)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # as while torch.compile traces the model
    assert not recompute._chains(list(fused.sublayers), x)
    from mhc_lightning.training.module import check_compile

    check_compile(GPTConfig(hyper=HyperConfig(residual_mode="mhc")), True)  # auto compiles (one sublayer at a time)
    with pytest.raises(ValueError, match="refused"):
        check_compile(GPTConfig(hyper=HyperConfig(residual_mode="mhc", chain_sublayers=True)), True)
    with pytest.raises(ValueError, match=r"chain_sublayers must be one of \[True, False, 'auto'\], got 'always'"):
        HyperConfig(chain_sublayers="always")


def test_run_sublayers_on_any_module_list():
    """The benchmark's entry point: any nn.ModuleList of sublayers, here a residual model's."""
    m = randomized(model("residual"))
    x = torch.randn(B, T, 32, requires_grad=True)
    ref = run_sublayers(m.sublayers, x, 0)
    (gx0,) = torch.autograd.grad(ref.square().sum(), x)
    out = run_sublayers(m.sublayers, x, 2)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(gx, gx0, rtol=1e-6, atol=1e-7)


def test_config_values_and_cli(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"recompute_block must be 'auto' or an int >= 0"):
        GPTConfig(recompute_block=-1)
    with pytest.raises(ValueError, match="recompute_block"):
        GPTConfig(recompute_block="always")
    from mhc_lightning.fit.cli import build_cli

    monkeypatch.chdir(tmp_path)
    base = ["-c", str(CONF / "base.yaml"), "-c", str(CONF / "model" / "mhc.yaml"), "--trainer.logger=false"]
    cli = build_cli(base + ["--model.arch.recompute_block=auto", "--model.arch.stream_dtype=bfloat16"], run=False)
    assert cli.model.arch.recompute_block == "auto" and cli.model.arch.stream_dtype == "bfloat16"
    assert cli.model.model.recompute_block == optimal_block(8, 4)
    assert build_cli(base + ["--model.arch.recompute_block=3"], run=False).model.model.recompute_block == 3


@fast_first("mode", ["mhc", "identity", "hc"])
def test_rebuilt_branch_input_same_step_less_memory(mode):
    """HyperConfig.rebuild_branch_input on the reference ops in fp32: the loss and every gradient bitwise those of the
    model that keeps u, and autograd keeps exactly one u per sublayer less (C fp32 values per token). The fused kernels
    under bf16-mixed: tests/test_kernels_model.py."""
    idx, L, C = tokens(), 4, 32
    base = randomized(model(mode))
    loss0, grads0 = loss_and_grads(base, idx)
    lean = model(mode, rebuild_branch_input=True)
    lean.load_state_dict(base.state_dict())
    loss, grads = loss_and_grads(lean, idx)
    assert torch.equal(loss, loss0)
    for name, g in grads.items():
        assert torch.equal(g, grads0[name]), name
    assert saved_bytes(base, idx) - saved_bytes(lean, idx) == L * C * 4 * idx.numel()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 stream: the reference keeps an fp32 copy of x, not x
        lean.cfg.stream_dtype = base.cfg.stream_dtype = "bfloat16"
        assert saved_bytes(lean, idx) == saved_bytes(base, idx)  # so holding x for a rebuild would cost more: off


@fast_first(
    "backend,device",
    [("torch", "cpu"), ("triton", "cpu")] + ([("triton", "cuda")] if torch.cuda.is_available() else []),
)
def test_activation_checkpointing_from_outside_is_honoured(backend, device):
    """Activation checkpointing applied from outside, as Lightning's FSDPStrategy(activation_checkpointing_policy=...)
    applies it (`apply_activation_checkpointing` wraps each sublayer): the step is bitwise the plain model's, and
    autograd keeps only what the checkpoints keep. Two ways it was defeated without a word: the fused backend's chain
    called the wrapped sublayers' `chain` through the wrapper (no checkpoint ran at all), and rebuild_branch_input's
    hooks, entered inside the checkpoint, took over from its own and kept every activation of the branch."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from mhc_lightning.model.hyper_connection import HyperConnection

    def same(a, b):  # bitwise on CPU; on CUDA up to the order of atomic sums (the message says by how much)
        if device == "cpu" or torch.equal(a, b):
            return torch.equal(a, b)
        diff = ((a - b).abs().max() / b.abs().max()).item()
        assert diff < 1e-5, f"relative difference {diff:.2e}"
        return True

    # the wrapped sublayers run one at a time; on CUDA the plain model does too (same kernels), on CPU it chains
    idx, x = tokens().to(device), torch.randn(B, T, 4, 32, device=device)
    base = randomized(model(kernel_backend=backend, chain_sublayers=device == "cpu" and "auto")).to(device)
    assert recompute._chains(list(base.sublayers), x) == (backend == "triton" and device == "cpu")
    plain_bytes = saved_bytes(base, idx)
    loss0, grads0 = loss_and_grads(base, idx)
    kept = {}
    for rebuild in (False, True):
        m = model(kernel_backend=backend, rebuild_branch_input=rebuild).to(device)
        m.load_state_dict(base.state_dict())
        apply_activation_checkpointing(m, check_fn=lambda mod: isinstance(mod, HyperConnection))
        assert type(m.sublayers[0]).__name__ == "CheckpointWrapper" and m.sublayers[0].chains  # attributes pass through
        assert not recompute._chains(list(m.sublayers), x)
        loss, grads = loss_and_grads(m, idx)
        assert same(loss, loss0)
        for name, g in grads.items():
            assert same(g, grads0[name.replace("._checkpoint_wrapped_module", "")]), name
        kept[rebuild] = saved_bytes(m, idx)
    # undone, the checkpoints kept all the plain model keeps, or (the option taking over) 2.6x what they keep
    assert kept[True] == kept[False] < plain_bytes / 2, (kept, plain_bytes)
    # flags and counts reach the wrapped sublayers themselves (writes through a wrapper stay on the wrapper)
    assert hyper_connections(m) == [w._checkpoint_wrapped_module for w in m.sublayers]
    for net in (base, m):
        with torch.no_grad(), net.recording():
            net(idx)
    rec, rec0 = m.recorded(), base.recorded()
    assert rec.keys() == rec0.keys() == {"h_pre", "h_post", "h_res", "spread", "logit_range"}
    for k in rec:
        assert same(rec[k], rec0[k]), k
    # forward hooks on a sublayer (the composable checkpoint's, FSDP2's) keep it out of the chain too
    hooked = model(kernel_backend=backend).to(device)
    handle = hooked.sublayers[1].register_forward_pre_hook(lambda mod, args: None)
    assert not recompute._chains(list(hooked.sublayers), x)
    handle.remove()
    assert recompute._chains(list(hooked.sublayers), x) == (backend == "triton")


@pytest.mark.slow
@fast_first("wrapper", ["FullyShardedDataParallel", "fully_shard"])
def test_external_checkpoint_under_fsdp_mixed_precision(wrapper, tmp_path):
    """Under FSDP with a mixed-precision param_dtype (Lightning's FSDPStrategy: bf16 under bf16-mixed) each branch
    computes in bf16 while its parameters, read from outside its forward, show fp32, or none during the backward.
    The sublayer asked its branch's parameters which dtype to hand u over in: fp32 in the forward, the stream's
    dtype in the checkpoint's recomputation, so on a GPU (whose rms_norm takes the fused kernel only when input and
    weight agree) the recomputation saved 21 tensors against the forward's 24 and torch's checkpoint stopped; under
    fully_shard it wrote u in fp32 for fully_shard to cast back. The branch now gets the dtype it computes in, the
    same in both passes, and the step is the unwrapped sharded model's."""
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from mhc_lightning.model.hyper_connection import HyperConnection
    from mhc_lightning.model.layers import Attention, SwiGLU

    base = randomized(model(kernel_backend="triton"))

    def sharded(checkpointed: bool):
        m = model(kernel_backend="triton")
        m.load_state_dict(base.state_dict())
        if wrapper == "FullyShardedDataParallel":
            mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
            m = FullyShardedDataParallel(
                m,
                auto_wrap_policy=ModuleWrapPolicy({Attention, SwiGLU}),
                mixed_precision=mp,
                use_orig_params=True,
                device_id=torch.device("cpu"),
            )
        else:
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            mesh = init_device_mesh("cpu", (1,))  # not the GPU's, where there is one: the model stays on the CPU
            for branch in [mod for mod in m.modules() if isinstance(mod, (Attention, SwiGLU))]:
                fully_shard(branch, mesh=mesh, mp_policy=policy)
            fully_shard(m, mesh=mesh, mp_policy=policy)
        if checkpointed:
            apply_activation_checkpointing(m, check_fn=lambda mod: isinstance(mod, HyperConnection))
        return m

    def step(m):
        """Loss, gradients, and the dtype each branch got its input in, forward then backward (the recomputation)."""
        seen = []
        for hc in hyper_connections(m):
            # first of the branch's hooks: what the sublayer hands over, before fully_shard casts a forward's inputs
            hc.branch.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype), prepend=True)
        with warnings.catch_warnings(record=True) as caught, torch.autocast("cpu", dtype=torch.bfloat16):
            warnings.simplefilter("always")
            loss = loss_of(m, tokens())
        forward = seen[:]
        loss.backward()
        assert not [w for w in caught if "Mismatch dtype" in str(w.message)]  # input and weight of the norms agree
        grads = {
            n.replace("_checkpoint_wrapped_module.", ""): getattr(p.grad, "full_tensor", p.grad.clone)()
            for n, p in m.named_parameters()
        }  # fully_shard's are DTensors: gathered while the group lives
        return loss.detach(), grads, forward, seen[len(forward) :]

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        loss0, grads0, forward0, _ = step(sharded(checkpointed=False))
        loss, grads, forward, recomputed = step(sharded(checkpointed=True))
    finally:
        dist.destroy_process_group()
    assert forward0 == forward == recomputed == [torch.bfloat16] * 4
    assert torch.equal(loss, loss0)
    assert grads.keys() == grads0.keys()
    for name, g in grads.items():
        assert torch.equal(g, grads0[name]), name


def test_rebuilt_branch_input_refused_with_recompute_or_compile():
    from mhc_lightning.training.module import check_compile

    with pytest.raises(ValueError, match="recompute_block=2 with hyper.rebuild_branch_input=true is refused"):
        model(block=2, rebuild_branch_input=True)
    assert model("residual", block=2, rebuild_branch_input=True).recompute_block == 0  # residual: both are no-ops
    with pytest.raises(ValueError, match="model.compile=true with model.arch.hyper.rebuild_branch_input=true"):
        check_compile(model(rebuild_branch_input=True).cfg, True)
    check_compile(model(rebuild_branch_input=True).cfg, False)
    with pytest.raises(ValueError, match=r"rebuild_branch_input must be one of \[True, False\], got 'yes'"):
        HyperConfig(rebuild_branch_input="yes")
