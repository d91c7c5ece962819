"""`mhc grid --launcher slurm`: each grid point one SLURM job (a job array, through submitit's AutoExecutor), each job
one `mhc fit` of that point, one MLflow run per point as with the local launcher.

Requeue (time limit or preemption) resumes the same MLflow run from the point's own checkpoints:
- every point trains in its own `trainer.default_root_dir` (<runs dir>/<point name>), so no job ever sees another
  job's checkpoints, Lightning's `hpc_ckpt_*.ckpt` included;
- submitit owns the requeue: its signal (USR2, `signal_delay_s` before the time limit, or at preemption) reaches the
  job, GridPoint.checkpoint hands submitit the same point with `resume=True`, and the requeued job runs
  `mhc fit ... --ckpt_path last`: the same MLflow run from its last checkpoint (fit/resume.py);
- Lightning's own SLURM requeue is off in the fit (`SLURMEnvironment(auto_requeue=False)`): it would requeue the job
  without submitit's checkpoint, and the requeued fit would open a new MLflow run. The fit ignores USR1 and USR2
  (the job acts on them), and is stopped by the job once submitit has requeued it.

Several GPUs per job (`--gpus-per-node N`): the job is one SLURM task, and its fit runs on the job's N GPUs
(`trainer.devices=N`) with Lightning starting the other N - 1 processes itself (LightningEnvironment): under SLURM's
own environment Lightning would expect one task per GPU, and SLURM gave the job one.

`--launcher submitit-local` runs the same jobs on this machine through submitit's LocalExecutor (a cluster grid tried
on one machine; the tests). Cheap to import: submitit, MLflow and Lightning are imported where they are used.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path
from typing import Optional

from ..errors import UserError
from ..fit.child_processes import Child, mhc_command

# Lightning's SLURM environment without its auto-requeue: submitit requeues (see above)
SLURM_PLUGIN = (
    '--trainer.plugins={"class_path": "lightning.pytorch.plugins.environments.SLURMEnvironment", '
    '"init_args": {"auto_requeue": false}}'
)
# A job with several GPUs: one task, whose fit starts its own DDP processes (see above)
SPAWNING_PLUGIN = '--trainer.plugins={"class_path": "lightning.pytorch.plugins.environments.LightningEnvironment"}'
CLUSTERS = {"slurm": "slurm", "submitit-local": "local"}  # --launcher -> submitit's executor


def tag_runs(client, experiment_id: str, name: str, tags: dict) -> None:
    """Tag a finished run by name. Tags go on afterwards: passed through the CLI, jsonargparse turns
    numeric strings into ints, which the MLflow REST client rejects."""
    from ..loggers.filters import equals

    for run in client.search_runs([experiment_id], filter_string=equals("attributes.run_name", name)):
        if run.info.run_name != name:  # LIKE for a name with both quotes: keep the exact match
            continue
        for k, v in tags.items():
            client.set_tag(run.info.run_id, k, str(v))


def has_checkpoint(root: Path) -> bool:
    """A last.ckpt of any run under a point's default_root_dir (<root>/<experiment id>/<run id>/checkpoints)."""
    return any(root.glob("*/*/checkpoints/last.ckpt"))


class GridPoint:
    """One grid point as a submitit job: `mhc fit` in a child process, its run tagged when it ends. Picklable (the
    job runs it on the cluster); submitit calls `checkpoint` when the job is about to be requeued."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        tags: dict,
        root: str,
        log: str,
        tracking_uri: str,
        experiment_id: str,
        resume: bool = False,
        gpus: Optional[int] = None,
    ):
        self.name, self.argv, self.tags, self.root, self.log = name, list(argv), dict(tags), root, log
        self.tracking_uri, self.experiment_id, self.resume, self.gpus = tracking_uri, experiment_id, resume, gpus
        self._child: Optional[Child] = None

    def command(self) -> list[str]:
        argv = [*self.argv, f"--trainer.default_root_dir={self.root}"]
        if self.gpus and self.gpus > 1:
            argv += [f"--trainer.devices={self.gpus}", SPAWNING_PLUGIN]  # every GPU of the job, one task
        elif os.environ.get("SLURM_JOB_ID"):
            argv.append(SLURM_PLUGIN)
        if self.resume and has_checkpoint(Path(self.root)):
            argv += ["--ckpt_path", "last"]  # the same MLflow run, from its last checkpoint
        return [*mhc_command(), *argv]

    def __call__(self) -> int:
        env = dict(os.environ, MLFLOW_TRACKING_URI=self.tracking_uri)
        # The fit inherits ignored USR1 / USR2 (a handler would be reset at exec): the signals are the job's.
        saved = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGUSR1, signal.SIGUSR2)}
        try:
            self._child = Child(self.command(), Path(self.log), env, self.name, append_log=self.resume)
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
        code = self._child.wait()  # submitit's requeue exits this process from here: Child.wait stops the fit
        self._child.stop(linger=30.0)  # other ranks of the fit, if any
        from mlflow import MlflowClient

        tag_runs(MlflowClient(self.tracking_uri), self.experiment_id, self.name, self.tags)
        return code

    def checkpoint(self, *args, **kwargs):
        """submitit, before it requeues the job: run this point again, resuming its run."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(
            GridPoint(
                self.name,
                self.argv,
                self.tags,
                self.root,
                self.log,
                self.tracking_uri,
                self.experiment_id,
                resume=True,
                gpus=self.gpus,
            )
        )

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_child": None}


def executor_for(launcher: str, folder: Path, parameters: dict):
    """submitit's AutoExecutor for `launcher` with generic and slurm_* parameters; a UserError where it cannot run."""
    try:
        import submitit
    except ImportError:
        raise UserError(f"--launcher {launcher} needs submitit: pip install submitit") from None
    if launcher == "slurm" and shutil.which("sbatch") is None:
        raise UserError(
            "--launcher slurm needs SLURM's sbatch on PATH: run `mhc grid` on the cluster's login node "
            "(--launcher submitit-local runs the same jobs here)"
        )
    executor = submitit.AutoExecutor(folder=folder, cluster=CLUSTERS[launcher])
    try:
        executor.update_parameters(**parameters)
    except (ValueError, TypeError) as err:
        raise UserError(f"--slurm: {err}") from None
    return executor


def submit(points: list[GridPoint], executor, wait: bool, on_done) -> list:
    """Submit the points as one job array; with `wait`, call on_done(name, exit code) as each job ends."""
    from submitit.helpers import as_completed

    with executor.batch():
        jobs = [executor.submit(p) for p in points]
    names = {job.job_id: p.name for job, p in zip(jobs, points)}
    for job, p in zip(jobs, points):
        print(f"submitted {p.name}: job {job.job_id} (log {p.log})", flush=True)
    if not wait:
        return jobs
    t0 = time.time()
    for job in as_completed(jobs, poll_frequency=2):
        try:
            code = job.result()
        except Exception as err:  # the job itself failed (not the fit): submitit's error names it
            print(f"[{time.time() - t0:7.1f}s] {names[job.job_id]}: job failed: {str(err).splitlines()[0]}")
            code = 1
        on_done(names[job.job_id], code)
    return jobs
