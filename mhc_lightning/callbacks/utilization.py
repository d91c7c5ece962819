"""Utilization: model FLOPs utilisation (`train/mfu`) and the GPU's peak allocated memory (`train/peak_memory_gib`)
among the training metrics, at Lightning's logging cadence (`log_every_n_steps`).

Neither waits for the GPU: the tokens/s is the host-side number the module logs (`train/tokens_per_sec`), the
memory is the caching allocator's counter (`torch.cuda.max_memory_allocated`, no device sync).

    MFU = model FLOPs per token x tokens/s (this rank) / peak FLOP/s of one device

- model FLOPs per token: 6 N + 12 L C T (the PaLM paper's appendix B count, as nanoGPT's and litgpt's estimates):
  N the parameters that multiply a token (the tied embedding counts once, as the head; an untied embedding is a
  lookup), L blocks of width C, T the context; the mHC coefficient projections are in N, Sinkhorn's elementwise
  work is not. Counted on a meta-device copy of the model, so sharded parameters do not change it.
- peak FLOP/s: `peak_flops` if set (e.g. `--utilization.peak_flops=9.89e14`), else Lightning's table of known
  GPUs for the trainer's precision (`lightning.fabric.utilities.throughput.get_available_flops`). On a CPU, or a GPU
  the table does not know, MFU is not logged (one line says so); the peak memory is logged on CUDA only.
"""

from __future__ import annotations

from typing import Optional

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

GIB = 2**30
PRECISION_DTYPES = {
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
    "bf16": torch.bfloat16,
    "16-mixed": torch.float16,
    "16-true": torch.float16,
    "16": torch.float16,
    "64-true": torch.float64,
    "64": torch.float64,
}


def model_flops_per_token(arch) -> float:
    """6 N + 12 L C T for a GPT built from `arch` (a GPTConfig), training (forward and backward)."""
    from ..model import GPT

    with torch.device("meta"):
        model = GPT(arch)
    n = sum(p.numel() for p in model.parameters())  # a tied head's weight is listed once
    if not arch.tied_head:
        n -= model.embed.weight.numel()  # a lookup, no multiply
    return 6.0 * n + 12.0 * arch.n_layers * arch.d_model * arch.context


def peak_device_flops(device: torch.device, precision) -> Optional[float]:
    if device.type != "cuda":
        return None
    from lightning.fabric.utilities.throughput import get_available_flops

    flops = get_available_flops(device, PRECISION_DTYPES.get(str(precision), torch.float32))
    return float(flops) if flops else None


class Utilization(Callback):
    def __init__(self, peak_flops: Optional[float] = None):
        """peak_flops: one device's peak FLOP/s for the trainer's precision; None: from Lightning's GPU table."""
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"utilization.peak_flops must be > 0 (FLOP/s of one device) or null, got {peak_flops}")
        self.peak_flops = peak_flops
        self.flops_per_token: Optional[float] = None
        self._peak: Optional[float] = None
        self._cuda: Optional[torch.device] = None

    def on_fit_start(self, trainer, pl_module) -> None:
        device = trainer.strategy.root_device
        self._cuda = device if device.type == "cuda" else None
        self._peak = self.peak_flops or peak_device_flops(device, trainer.precision)
        arch = getattr(pl_module, "arch", None)
        self.flops_per_token = model_flops_per_token(arch) if arch is not None else None
        if self._peak is None:
            rank_zero_info(
                f"train/mfu not logged: no peak FLOP/s known for {device.type} "
                f"{torch.cuda.get_device_name(device) if self._cuda else ''}".rstrip()
                + " (set --utilization.peak_flops)"
            )

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # the module's own cadence for host reads (its progress-bar loss): the steps the loggers write anyway
        if (trainer.global_step - 1) % max(1, trainer.log_every_n_steps) != 0:
            return
        metrics = {}
        if self._cuda is not None:
            metrics["train/peak_memory_gib"] = torch.cuda.max_memory_allocated(self._cuda) / GIB
        tokens_per_sec = trainer.callback_metrics.get("train/tokens_per_sec")  # a host tensor
        if self._peak and self.flops_per_token and tokens_per_sec is not None:
            metrics["train/mfu"] = self.flops_per_token * float(tokens_per_sec) / self._peak
        for name, value in metrics.items():
            pl_module.log(name, torch.tensor(value, dtype=torch.float32), on_step=True, on_epoch=False)
