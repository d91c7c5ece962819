"""LitLM's training step (mhc_lightning/module.py): what it leaves on the device."""
from __future__ import annotations

import math
import sys

import lightning as L
import pytest
import torch

from test_callbacks_common import tiny_fit

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


@pytest.mark.parametrize("mode", ["residual", "mhc"])
def test_training_steps_read_nothing_back_to_the_host(tiny_corpus, monkeypatch, mode):
    """With no stability callback and no diagnostics due, a step queues its kernels and returns: a read-back
    (the pre-clip grad norm's .item() did it before) makes the host wait for the GPU every step, so the next step's
    launches no longer overlap this step's kernels."""
    from test_callbacks_common import tiny_module

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
    trainer, module = tiny_fit(tiny_corpus, [counter], steps=4, module=tiny_module(mode, diagnostics_every=0),
                               gradient_clip_val=1.0)
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
            seen["norm"] = math.sqrt(sum(float(p.grad.double().square().sum()) for p in pl_module.parameters()
                                         if p.grad is not None))

    _, module = tiny_fit(tiny_corpus, [Probe()], steps=2, gradient_clip_val=1e-3)
    assert seen["norm"] > 1e-3  # clipping engaged, and the module kept the norm from before it
    assert module.last_grad_norm == pytest.approx(seen["norm"], rel=1e-5)


def test_progress_bar_reads_the_loss_back_every_log_interval(tiny_corpus, monkeypatch):
    """With a progress bar, the loss it shows is read back to the host at the first step and then every
    log_every_n_steps steps, and shown as a host number in between; train/loss itself is no progress-bar value
    (Lightning would read it back after every step)."""
    from test_callbacks_common import tiny_module

    import mhc_lightning.module as module_file

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


@pytest.mark.parametrize("mode,graphed", [("default", False), ("reduce-overhead", True), ("max-autotune", True),
                                          ("max-autotune-no-cudagraphs", False)])
def test_compile_mode_reaches_torch_compile_and_graphed_modes_mark_each_call(monkeypatch, mode, graphed):
    """model.compile_mode goes to torch.compile; with CUDA graphs each model call first starts a new graph step (the
    previous replay's outputs may then be overwritten), without them nothing is marked."""
    from mhc_lightning import module as module_mod
    from mhc_lightning.model.config import GPTConfig

    seen, marks = {}, []
    monkeypatch.setattr(module_mod, "compile_model",
                        lambda model, **kw: seen.update(kw) or (lambda idx: model(idx)))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    lit = module_mod.LitLM(arch=GPTConfig(n_layers=1, d_model=32, n_heads=2, context=16), compile=True,
                           compile_mode=mode)
    assert seen == {"mode": mode} and lit.hparams.compile_mode == mode
    idx = torch.randint(0, 256, (2, 16))
    lit(idx)
    lit(idx)
    assert len(marks) == (2 if graphed else 0)
