"""Shared pieces of the stability-callback tests: a tiny in-process fit and fault injectors."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Optional

import lightning as L
import torch


@contextlib.contextmanager
def one_thread():
    """Tiny models run fastest on one thread, and the result does not depend on the machine's core count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def tiny_module(
    mode: str = "mhc",
    lr: float = 3e-3,
    n_layers: int = 2,
    d_model: int = 32,
    diagnostics_every: int = 5,
    seed: int = 0,
    **hyper,
):
    from mhc_lightning.model import GPTConfig, HyperConfig
    from mhc_lightning.module import LitLM, OptimConfig

    L.seed_everything(seed, verbose=False)
    arch = GPTConfig(
        n_layers=n_layers, d_model=d_model, n_heads=2, context=32, hyper=HyperConfig(residual_mode=mode, **hyper)
    )
    return LitLM(arch=arch, optim=OptimConfig(lr=lr, warmup_steps=5), diagnostics_every=diagnostics_every)


# MHC_TEST_ACCELERATOR=gpu runs the in-process callback tests on CUDA (GPU machine): device-placement bugs
# (CPU step counters beside CUDA weights, pinned copies) only show there.
ACCELERATOR = os.environ.get("MHC_TEST_ACCELERATOR", "cpu")


def tiny_fit(
    corpus: Path,
    callbacks: list,
    steps: int,
    module=None,
    logger=False,
    ckpt_path=None,
    seed: int = 0,
    data_seed: Optional[int] = 1234,
    **trainer_kwargs,
):
    """Fit a tiny model in-process for `steps` optimizer steps; returns (trainer, module). data_seed: the data
    order, held fixed by default so that the callback tests' trajectories do not move with `seed` (None: follow it)."""
    from mhc_lightning.data import ByteTextDataModule

    module = module if module is not None else tiny_module(seed=seed)
    L.seed_everything(seed, verbose=False)
    dm = ByteTextDataModule(corpus=str(corpus), seq_len=32, batch_size=4, seed=data_seed)
    kw = dict(
        max_steps=steps,
        accelerator=ACCELERATOR,
        devices=1,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    kw.update(trainer_kwargs)
    trainer = L.Trainer(callbacks=callbacks, **kw)
    with one_thread():
        trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer, module


def params_finite(module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


class NaNGradAt(L.Callback):
    """Fault: after backward at optimizer step k, one parameter's gradient becomes NaN."""

    def __init__(self, step: int):
        self.step = step

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step == self.step:
            next(pl_module.parameters()).grad.fill_(float("nan"))


class CorruptBatchAt(L.Callback):
    """Fault: the targets of the batch at step k become byte 0 (absent from the text): a loss spike."""

    def __init__(self, *steps: int):
        self.steps = set(steps)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            batch[1].zero_()


class StepRecorder(L.Callback):
    """Per-step loss (None when the batch was skipped) and the batch's first token, for assertions."""

    def __init__(self):
        self.loss: dict[int, Optional[float]] = {}
        self.first_tokens: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.first_tokens[trainer.global_step] = batch[0][:, 0].tolist()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = pl_module.last_loss
        self.loss[trainer.global_step - 1] = None if loss is None else float(loss)

    def final_loss(self) -> float:
        return next(v for _, v in sorted(self.loss.items(), reverse=True) if v is not None and math.isfinite(v))
