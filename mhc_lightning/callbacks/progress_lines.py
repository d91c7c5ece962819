"""ProgressLines: with the progress bar off (sweeps, grids, `trainer.enable_progress_bar: false`) a fit printed nothing
between its start and its end; this prints one line at each validation instead, rank 0 only:

    [mhc fit] step 200/600  train/loss 2.4137  val/loss 2.4462  val/bpb 3.5291  61 s

Inside a sweep trial the line names its trial (`[mhc fit, trial 3]`), which the sweep passes in TRIAL_ENV. With the
bar on it prints nothing (the bar shows the same), and gives a resumed fit's bar its total and ETA: Lightning skips
`on_train_epoch_start` when it resumes mid-epoch, and that hook is where its bar learns the number of batches.
`mhc` installs it by default (fit/cli.py's build_cli).
"""

from __future__ import annotations

import os
import time

from lightning.pytorch.callbacks import Callback, TQDMProgressBar

SHOWN = ("train/loss", "val/loss", "val/bpb")
TRIAL_ENV = "MHC_SWEEP_TRIAL"  # the number of the sweep trial this fit is


def label() -> str:
    trial = os.environ.get(TRIAL_ENV)
    return f"[mhc fit, trial {trial}]" if trial else "[mhc fit]"


class ProgressLines(Callback):
    def __init__(self) -> None:
        self._t0 = time.monotonic()

    def on_fit_start(self, trainer, pl_module) -> None:
        self._t0 = time.monotonic()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        bar = trainer.progress_bar_callback
        if not isinstance(bar, TQDMProgressBar) or bar.train_progress_bar is None:
            return
        tqdm = bar.train_progress_bar
        if tqdm.total is not None or tqdm.disable or trainer.num_training_batches == float("inf"):
            return  # a bar that has its total, or a loader without a length
        # resumed at batch `batch_idx` of the epoch: the bar counts from there (its rate and ETA from the batches
        # run since), to this epoch's end or to the step budget, as Lightning's own total at an epoch's start
        tqdm.reset(total=min(trainer.num_training_batches, batch_idx + bar.total_train_batches))
        tqdm.initial = tqdm.n = tqdm.last_print_n = batch_idx
        tqdm.set_description(f"Epoch {trainer.current_epoch}")

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
        print(f"{label()} {'  '.join(parts)}  {time.monotonic() - self._t0:.0f} s", flush=True)
