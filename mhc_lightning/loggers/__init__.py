"""MLflow logging that survives the tracking server: the store (reachability, races, experiments), the spool of
writes kept while the server is down, and the Lightning logger every shipped config uses.

    trainer.logger.class_path: mhc_lightning.loggers.ResilientMLFlowLogger

`ResilientMLFlowLogger` is exported lazily so that launchers (`mhc sweep`, `mhc grid`) can use the store and spool
helpers without importing Lightning.
"""


def __getattr__(name: str):
    if name == "ResilientMLFlowLogger":
        from .resilient import ResilientMLFlowLogger

        return ResilientMLFlowLogger
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ResilientMLFlowLogger"]
