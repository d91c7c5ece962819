"""Everything MLflow that more than one layer needs, once: the store (reachability, races, experiments, the UI
command), the spool of writes kept while the server is down, the Lightning logger every shipped config uses, and the
glue between Lightning and the runs `mhc` makes.

- store.py: is the store there and ready, which experiment, how to open it in the UI (no Lightning);
- spool.py: writes kept while the tracking server is down, replayed later (no Lightning);
- tags.py: the tag and checkpoint names `mhc` writes and reads back (no Lightning);
- credentials.py: a password in the tracking URI moved to MLflow's credential variables, masked wherever shown;
- filters.py: search filters on names with quotes (no Lightning);
- resilient.py: ResilientMLFlowLogger, the logger of every shipped config:

    trainer.logger.class_path: mhc_lightning.loggers.ResilientMLFlowLogger

- mlflow_runs.py: a trainer's MLflow loggers, naming and tagging the runs before they exist, the closing announcement;
- save_config.py: MLflowSaveConfig, the resolved config as the run's config.yaml (the CLI's save_config_callback).

Reports and sweeps keep their own MLflow client calls where those are the report's or the sweep's logic.
`ResilientMLFlowLogger` is exported lazily so that launchers (`mhc sweep`, `mhc grid`) can use the store and spool
helpers without importing Lightning.
"""


def __getattr__(name: str):
    if name == "ResilientMLFlowLogger":
        from .resilient import ResilientMLFlowLogger

        return ResilientMLFlowLogger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ResilientMLFlowLogger"]
