"""Optuna sweeps of `mhc fit`, tracked in MLflow. One job per file:

- spec.py: sweep files -> SweepSpec (validation); trial_args.py: a trial's values -> `mhc fit` arguments;
- factories.py: storages, samplers, pruners (the launcher, its workers and link.py build them alike);
- trial_args_check.py: the sweep's arguments through the `mhc fit` parser, before any trial;
- settings.py: the resolved sweep (spec, storage, tracking URI) and the study's counts;
- supervisor.py: the launcher (checks, worker processes, supervision, summary; status, --dry-run);
  worker.py: one worker's loop; liveness.py: which workers are alive, failing the trials of dead ones;
- objective.py: one trial (in this process, or a child `mhc fit`); recorder.py, pruning.py, link.py: its callbacks;
- study_runs.py: the study's MLflow parent and child runs; cli.py: `mhc sweep` (the only argparse).

Processes are started by mhc_lightning/fit/child_processes.py; MLflow outages are handled by mhc_lightning/loggers/.
"""
