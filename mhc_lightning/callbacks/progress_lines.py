"""ProgressLines: with the progress bar off (sweeps, grids, `trainer.enable_progress_bar: false`) a fit printed nothing
between its start and its end; this prints one line at each validation instead, rank 0 only:

    [mhc fit] step 200/600  train/loss 2.4137  val/loss 2.4462  val/bpb 3.5291  61 s

With the bar on it prints nothing (the bar shows the same). `mhc` installs it by default (cli.build_cli).
"""

from __future__ import annotations

import time

from lightning.pytorch.callbacks import Callback

SHOWN = ("train/loss", "val/loss", "val/bpb")


class ProgressLines(Callback):
    def __init__(self) -> None:
        self._t0 = time.monotonic()

    def on_fit_start(self, trainer, pl_module) -> None:
        self._t0 = time.monotonic()

    def on_validation_end(self, trainer, pl_module) -> None:
        if (
            trainer.progress_bar_callback is not None
            or trainer.sanity_checking
            or not trainer.is_global_zero
            or trainer.state.fn != "fit"
        ):
            return
        total = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
        metrics = trainer.callback_metrics
        parts = [f"step {trainer.global_step}{total}"] + [f"{k} {float(metrics[k]):.4f}" for k in SHOWN if k in metrics]
        print(f"[mhc fit] {'  '.join(parts)}  {time.monotonic() - self._t0:.0f} s", flush=True)
