"""LitLM's training step (mhc_lightning/training/module.py): what it leaves on the device."""

from __future__ import annotations

import math
import sys

import lightning as L
import pytest
import torch
from helpers import fast_first, tiny_fit

SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__")


class CountHostReads(L.Callback):
    """Counts tensor-to-host reads (item, tolist, float(), int(), bool()) from the start of the second batch to the
    end of training (the first step left out: lazy setup), Lightning's own work between steps included (it reads
    every progress-bar value back after each step). Not counted: the optimizer's step counters, which torch keeps on
    the CPU beside CUDA parameters (no sync there; on this CPU-only test every tensor is a CPU tensor)."""

    def __init__(self, monkeypatch):
        self.on = False
        self.calls: list[str] = []
        for name in SYNCS:
            orig = getattr(torch.Tensor, name)

            def wrapped(t, *a, _orig=orig, _name=name, **k):
                if self.on and "torch/optim/" not in sys._getframe(1).f_code.co_filename.replace("\\", "/"):
                    self.calls.append(_name)
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapped)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.on = self.on or trainer.global_step >= 1

    def on_train_end(self, trainer, pl_module) -> None:
        self.on = False


@fast_first("mode", ["residual", "mhc"])
def test_training_steps_read_nothing_back_to_the_host(tiny_corpus, monkeypatch, mode):
    """With no stability callback and no diagnostics due, a step queues its kernels and returns: a read-back
    (the pre-clip grad norm's .item() did it before) makes the host wait for the GPU every step, so the next step's
    launches no longer overlap this step's kernels."""
    from helpers import tiny_module

    counter = CountHostReads(monkeypatch)
    # Lightning makes a plain number passed to self.log into a tensor on the module's device: a blocking copy to
    # the GPU every step. Everything the step logs must already be a tensor (host numbers as CPU tensors).
    numbers: list[str] = []
    log = L.LightningModule.log

    def checked_log(self, name, value, *a, **k):
        if not isinstance(value, torch.Tensor):
            numbers.append(name)
        return log(self, name, value, *a, **k)

    monkeypatch.setattr(L.LightningModule, "log", checked_log)
    trainer, module = tiny_fit(
        tiny_corpus, [counter], steps=4, module=tiny_module(mode, diagnostics_every=0), gradient_clip_val=1.0
    )
    assert trainer.global_step == 4
    assert counter.calls == []
    assert numbers == []
    # the norm is still there for a reader (SinkhornSchedule), as the pre-clip global norm of this step's gradients
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    assert grads and isinstance(module.last_grad_norm, float) and math.isfinite(module.last_grad_norm)


def test_last_grad_norm_is_the_pre_clip_norm(tiny_corpus):
    seen = {}

    class Probe(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            seen["norm"] = math.sqrt(
                sum(float(p.grad.double().square().sum()) for p in pl_module.parameters() if p.grad is not None)
            )

    _, module = tiny_fit(tiny_corpus, [Probe()], steps=2, gradient_clip_val=1e-3)
    assert seen["norm"] > 1e-3  # clipping engaged, and the module kept the norm from before it
    assert module.last_grad_norm == pytest.approx(seen["norm"], rel=1e-5)


def test_progress_bar_reads_the_loss_back_every_log_interval(tiny_corpus, monkeypatch):
    """With a progress bar, the loss it shows is read back to the host at the first step and then every
    log_every_n_steps steps, and shown as a host number in between; train/loss itself is no progress-bar value
    (Lightning would read it back after every step)."""
    from helpers import tiny_module

    import mhc_lightning.training.module as module_file

    reads: list[int] = []
    scalar = module_file.host_scalar
    module = tiny_module("mhc", diagnostics_every=0)

    def counted(value):
        if isinstance(value, torch.Tensor):
            reads.append(module.global_step)
        return scalar(value)

    monkeypatch.setattr(module_file, "host_scalar", counted)
    trainer, module = tiny_fit(tiny_corpus, [], steps=7, module=module, enable_progress_bar=True, log_every_n_steps=3)
    assert reads == [1, 4, 7]  # global_step after the step: steps 1, 4 and 7
    bar = trainer.progress_bar_metrics
    assert "train/loss" not in bar
    assert bar["loss"] == pytest.approx(float(module.last_loss))


@fast_first(
    "mode,graphed",
    [("default", False), ("reduce-overhead", True), ("max-autotune", True), ("max-autotune-no-cudagraphs", False)],
)
def test_compile_mode_reaches_torch_compile_and_graphed_modes_mark_each_call(monkeypatch, mode, graphed):
    """model.compile_mode goes to torch.compile; with CUDA graphs each model call first starts a new graph step (the
    previous replay's outputs may then be overwritten), without them nothing is marked."""
    from mhc_lightning.model.config import GPTConfig
    from mhc_lightning.training import module as module_mod

    seen, marks = {}, []
    monkeypatch.setattr(module_mod, "compile_model", lambda model, **kw: seen.update(kw) or (lambda idx: model(idx)))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    lit = module_mod.LitLM(
        arch=GPTConfig(n_layers=1, d_model=32, n_heads=2, context=16), compile=True, compile_mode=mode
    )
    assert seen == {"mode": mode} and lit.hparams.compile_mode == mode
    idx = torch.randint(0, 256, (2, 16))
    lit(idx)
    lit(idx)
    assert len(marks) == (2 if graphed else 0)


class GradsAround(L.Callback):
    """The gradients of the last step as clipping found them (on_before_optimizer_step runs just before it)."""

    def __init__(self):
        self.before: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.before = [p.grad.detach().clone() for p in pl_module.parameters() if p.grad is not None]


def _clipped_grads(module, steps_seen: list) -> None:
    """Record the gradients right after each call of the module's configure_gradient_clipping."""
    clip = module.configure_gradient_clipping

    def recorded(optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        clip(optimizer, gradient_clip_val, gradient_clip_algorithm)
        steps_seen.append([p.grad.detach().clone() for p in module.parameters() if p.grad is not None])

    module.configure_gradient_clipping = recorded  # Lightning looks the hook up on the instance


@fast_first("clip", [1e-3, 1e6])
def test_norm_clipping_reuses_the_logged_norm_and_matches_clip_grad_norm(tiny_corpus, monkeypatch, clip):
    """Norm clipping scales the gradients by clip / (norm + 1e-6) where that is below 1, with the pre-clip norm the
    step already computed for its log: one pass over the gradients (torch's clip_grad_norm_, which would compute the
    norm again, is never called), the same gradients as clip_grad_norm_ gives (float64 reference); a clip above the
    norm leaves them bit for bit."""
    from helpers import tiny_module

    def refused(*a, **k):
        raise AssertionError("clip_grad_norm_ was called")

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", refused)
    monkeypatch.setattr(torch.nn.utils.clip_grad, "clip_grad_norm_", refused)
    module, probe, after = tiny_module("mhc", diagnostics_every=0), GradsAround(), []
    _clipped_grads(module, after)
    tiny_fit(tiny_corpus, [probe], steps=2, module=module, gradient_clip_val=clip)
    assert len(after) == 2 and len(after[-1]) == len(probe.before) > 0
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in probe.before))
    coef = min(1.0, clip / (norm + 1e-6))
    assert (coef < 1.0) == (clip < 1.0)  # clipping engaged exactly in the small-clip case
    for g0, g1 in zip(probe.before, after[-1]):
        if coef == 1.0:
            assert torch.equal(g0, g1)
        else:
            torch.testing.assert_close(g1.double(), g0.double() * coef, rtol=1e-5, atol=1e-12)


@fast_first("fused,precision", [(True, "bf16-mixed"), (True, "32-true"), (None, "32-true"), (False, "32-true")])
def test_optimizer_implementation_follows_model_optim_fused(tiny_corpus, fused, precision):
    """model.optim.fused: true runs torch's fused AdamW (and keeps norm clipping under bf16-mixed, which Lightning's
    mixed-precision plugin refuses for an optimizer that could unscale in its step), false torch's default, null
    (auto) fused on CUDA and the default on a CPU; the clipped step trains either way."""
    from helpers import ACCELERATOR

    from mhc_lightning.model import GPTConfig
    from mhc_lightning.training.module import LitLM, OptimConfig

    L.seed_everything(0, verbose=False)
    module = LitLM(
        arch=GPTConfig(n_layers=1, d_model=32, n_heads=2, context=32),
        optim=OptimConfig(lr=3e-3, warmup_steps=1, fused=fused),
        diagnostics_every=0,
    )
    before = [p.detach().clone() for p in module.parameters()]
    trainer, module = tiny_fit(tiny_corpus, [], steps=2, module=module, gradient_clip_val=1e-3, precision=precision)
    opt = trainer.optimizers[0]
    want = fused if fused is not None else ACCELERATOR == "gpu"
    assert bool(opt.defaults.get("fused")) == want and not (want and opt.defaults.get("foreach"))
    assert trainer.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_grad_norm_max_and_spikes_cover_every_step(tiny_corpus):
    """train/grad_norm_max is the max over every step after warmup, not over the logged ones (every 5th here)."""
    from lightning.pytorch.loggers.logger import Logger

    class Collect(Logger):
        name, version = "collect", "0"
        metrics: list = []

        def log_metrics(self, metrics, step=None):
            self.metrics.append((step, dict(metrics)))

        def log_hyperparams(self, *args, **kwargs):
            pass

    class Norms(L.Callback):
        seen: dict = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.seen[trainer.global_step - 1] = pl_module.last_grad_norm  # the step just taken

    logger, norms = Collect(), Norms()
    tiny_fit(
        tiny_corpus, [norms], steps=12, logger=logger, log_every_n_steps=5, limit_val_batches=1, val_check_interval=6
    )
    summaries = [(step, m) for step, m in logger.metrics if "train/grad_norm_max" in m]
    assert [step for step, _ in summaries] == [6, 12]  # after each validation
    after_warmup = [v for step, v in norms.seen.items() if step >= 5]  # tiny_module: warmup_steps=5
    assert summaries[-1][1]["train/grad_norm_max"] == pytest.approx(max(after_warmup), rel=1e-6)
    assert summaries[-1][1]["train/grad_spikes"] == sum(
        v > 4 * torch.tensor(after_warmup).median().item() for v in after_warmup
    )
