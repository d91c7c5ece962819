"""How `mhc fit` ends after Ctrl-C, SIGTERM or SLURM's requeue signal: mark the MLflow run KILLED, print the command
that resumes it (or requeue the SLURM job, which then continues the run: resume.resolve_requeued), and exit 130
(SIGINT), 143 (SIGTERM) or 138 (SIGUSR1), the statuses a shell gives a process ended by those signals, so that a
script or a scheduler sees that the fit did not finish. The stop itself, at the end of a step with a checkpoint, is
GracefulStop's (callbacks/graceful_stop.py).

`finish` (called by the CLI when the fit ends by an exception) marks the runs KILLED, after Lightning marked them
FAILED, prints where the checkpoint is and the resume command, and returns the exit status.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

from ..callbacks.graceful_stop import STOP, say
from ..training.checkpoint_io import last_good
from .resume import resume_command


def requeue_job(runs: str) -> Optional[str]:
    """`scontrol requeue` this SLURM job; what to say, or None when it could not be requeued (said why)."""
    import subprocess

    job = os.environ.get("SLURM_JOB_ID", "")
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        say(f"could not requeue SLURM job {job} ({type(err).__name__}: {err})")
        return None
    if done.returncode != 0:
        say(f"could not requeue SLURM job {job}: {(done.stderr or done.stdout).strip()[-300:]}")
        return None
    return f"SLURM job {job} requeued: started again, it continues MLflow run {runs} from its last checkpoint."


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
    if STOP.requeue and STOP.runs:  # rank 0, last: SLURM ends the job as it requeues it
        then = requeue_job(runs) or then
    say(f"stopped by {name}{where}; {saved}{marked}. {then}")
    for note in dict.fromkeys(getattr(client, "pending_note", str)() for client, _ in STOP.runs):
        if note:  # the store did not take the end of the run (loggers/spool.py): say where it waits
            say(note)
    status = 128 + STOP.signum
    STOP.reset()
    return status
