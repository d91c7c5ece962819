"""How `mhc fit` ends after Ctrl-C or SIGTERM: mark the MLflow run KILLED, print the command that resumes it, and exit
130 (SIGINT) or 143 (SIGTERM), the statuses a shell gives a process ended by those signals, so that a script or a
scheduler sees that the fit did not finish. The stop itself, at the end of a step with a checkpoint, is GracefulStop's
(callbacks/graceful_stop.py).

`finish` (called by the CLI when the fit ends by an exception) marks the runs KILLED, after Lightning marked them
FAILED, prints where the checkpoint is and the resume command, and returns the exit status.
"""

from __future__ import annotations

import signal
from typing import Optional

from ..callbacks.graceful_stop import STOP, say
from ..training.checkpoint_io import last_good
from .resume import resume_command


def finish(args: list[str]) -> Optional[int]:
    """After a fit that ended by an exception: if a signal stopped it, mark its MLflow runs KILLED, say what was saved
    and how to resume, and return the exit status (128 + signal number); None if no signal was involved."""
    if STOP.signum is None:
        return None
    for client, run_id in STOP.runs:
        try:
            client.set_terminated(run_id, "KILLED")  # a guarded client keeps it for later if the server is away
        except Exception as err:  # the status is cosmetic next to the exit status and the checkpoint
            say(f"could not mark MLflow run {run_id} KILLED ({type(err).__name__})")
    name = "Ctrl-C (SIGINT)" if STOP.signum == signal.SIGINT else signal.Signals(STOP.signum).name
    runs = ", ".join(run_id for _, run_id in STOP.runs)
    marked = f"; MLflow run {runs} marked KILLED" if runs else ""
    good = (STOP.checkpoint, STOP.step) if STOP.checkpoint else last_good(STOP.folder) if STOP.folder else None
    if STOP.checkpoint is not None:
        saved = f"checkpoint of step {STOP.step} saved as {STOP.checkpoint}"
    else:
        saved = f"the last checkpoint is {good[0]} (step {good[1]})" if good else "no checkpoint was written yet"
    where = f" at step {STOP.step}" if STOP.step is not None else ""
    then = f"Resume with: {resume_command(args)}" if good else "Run the same command to start again."
    say(f"stopped by {name}{where}; {saved}{marked}. {then}")
    for note in dict.fromkeys(getattr(client, "pending_note", str)() for client, _ in STOP.runs):
        if note:  # the store did not take the end of the run (loggers/spool.py): say where it waits
            say(note)
    status = 128 + STOP.signum
    STOP.reset()
    return status
