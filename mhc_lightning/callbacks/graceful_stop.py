"""GracefulStop: Ctrl-C and SIGTERM during `mhc fit` stop at the end of the current step with a checkpoint to resume
from (docs/stability.md, "Stopping"). What it saw and saved is kept in STOP for `fit/interrupts.py`'s `finish`.

- SIGTERM (a scheduler's preemption, `kill`): Lightning's own handler flags it and its loops raise SIGTERMException
  at the end of the step under way (after its logging and any validation due, the point where a checkpoint resumes
  exactly; a signal during a validation is passed on once it is complete, since Lightning would stop inside it and
  its metrics are not in a checkpoint); `GracefulStop.on_exception` then writes last.ckpt through the ModelCheckpoint.
- SIGINT (Ctrl-C): the first one becomes the same stop (through Lightning's SIGTERM handler, which also tells DDP's
  other processes); a second signal of either kind stops at once (KeyboardInterrupt), keeping the last periodic
  checkpoint.
- SLURM's requeue signal (`requeue_signal`, set by the CLI under SLURM: SIGUSR1): the same stop, and `finish` then
  requeues the job (docs/distributed.md).
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..loggers.credentials import mask
from ..loggers.mlflow_runs import mlflow_loggers
from ..training.checkpoint_io import CheckpointWriteError


@dataclass
class _Stop:
    """What the process was asked to do and what it saved; one fit per process."""

    signum: Optional[int] = None
    step: Optional[int] = None
    checkpoint: Optional[Path] = None
    folder: Optional[Path] = None
    runs: list[tuple[Any, str]] = field(default_factory=list)  # (MLflow client, run id)
    requeue: bool = False  # stopped by the SLURM requeue signal: the job is to be requeued (rank 0 asks)

    def reset(self) -> None:
        self.__init__()


STOP = _Stop()


def say(text: str) -> None:
    print(f"mhc fit: {mask(text)}", file=sys.stderr, flush=True)  # the resume command repeats the URIs given


def _last_checkpoint_callback(trainer) -> Optional[ModelCheckpoint]:
    return next((cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.dirpath), None)


def _last_name(cb: ModelCheckpoint) -> str:
    """The run's last.ckpt, spelt as ModelCheckpoint spells it (it compares the strings before versioning a name)."""
    return cb.format_checkpoint_name({}, cb.CHECKPOINT_NAME_LAST)


def keep_last_name(trainer) -> None:
    """A fit resumed from its own last checkpoint writes the next one as last.ckpt: its checkpoint may name no last
    file (written by an interrupt before the first periodic save) or a versioned one, and ModelCheckpoint would then
    write last-v1.ckpt and leave last.ckpt behind at the resumed step."""
    cb, resumed = _last_checkpoint_callback(trainer), trainer.ckpt_path
    if cb is None or not cb.save_last or not resumed or "://" in str(resumed):
        return
    resumed = Path(resumed)
    if resumed.parent.resolve() == Path(cb.dirpath).resolve() and resumed.name.startswith(cb.CHECKPOINT_NAME_LAST):
        cb.last_model_path = _last_name(cb)


class GracefulStop(Callback):
    """Installed by the CLI in every Trainer: see the module docstring."""

    def __init__(self):
        self.requeue_signal: Optional[int] = None  # set by the CLI under SLURM (resume.requeue_wanted)
        self._previous: dict[int, Any] = {}
        self._trainer = None
        self._after_validation = False  # a signal came during a validation: stop once it is complete

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            STOP.reset()  # an earlier fit of this process (sweep trials, tests) does not count

    def on_train_start(self, trainer, pl_module) -> None:
        # After Lightning installed its SIGTERM handler (kept, and called): until here Python's and Lightning's own
        # handling applies, which on_exception also understands.
        self._trainer, self._after_validation = trainer, False
        keep_last_name(trainer)
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM, *([self.requeue_signal] if self.requeue_signal else [])):
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        self._trainer = None

    def _on_signal(self, signum: int, frame) -> None:
        if STOP.signum is not None:  # asked again: stop now, without a checkpoint
            raise KeyboardInterrupt
        STOP.signum, STOP.requeue = signum, signum == self.requeue_signal
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        then = "; then the SLURM job is requeued and continues this run" if STOP.requeue else ""
        say(f"{name}: stopping after this step with a checkpoint{then} ({name} again to stop at once)")
        if self._trainer is not None and self._trainer.validating:
            self._after_validation = True  # Lightning would stop mid-validation, whose metrics are not checkpointed
        else:
            self._stop_loops(frame)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._after_validation:
            self._after_validation = False
            self._stop_loops(None)

    def _stop_loops(self, frame) -> None:
        lightning = self._previous.get(signal.SIGTERM)
        if callable(lightning):  # its loops stop at the end of the step; under DDP it tells the other processes
            lightning(signal.SIGTERM, frame)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        try:
            self._stop_with_checkpoint(trainer, exception)
        finally:
            self._restore_handlers()  # no on_train_end after an exception

    def _stop_with_checkpoint(self, trainer, exception: BaseException) -> None:
        if trainer.state.fn != "fit":
            return
        if STOP.signum is None and isinstance(exception, (KeyboardInterrupt, SIGTERMException)):
            STOP.signum = signal.SIGINT if isinstance(exception, KeyboardInterrupt) else signal.SIGTERM
        if STOP.signum is None:
            return
        STOP.step = trainer.global_step
        if trainer.is_global_zero:  # runs that exist already (reading lg.run_id would create one)
            STOP.runs = [(lg.experiment, lg.run_id) for lg in mlflow_loggers(trainer) if getattr(lg, "_run_id", None)]
        cb = _last_checkpoint_callback(trainer)
        if cb is None:
            return
        STOP.folder = Path(cb.dirpath)
        if isinstance(exception, SIGTERMException) and cb.save_last and not trainer.sanity_checking:
            # Set before the save, as ModelCheckpoint does: the checkpoint's callback state names this file as the
            # run's last one, so the resumed fit overwrites it instead of writing last-v1.ckpt beside it.
            previous, cb.last_model_path = cb.last_model_path, _last_name(cb)
            try:
                trainer.save_checkpoint(cb.last_model_path)  # the loops stopped at a step boundary: resumes exactly
            except CheckpointWriteError as err:  # the run must still end, and say what is safe
                cb.last_model_path = previous
                say(str(err))
                return
            STOP.checkpoint = Path(cb.last_model_path)
