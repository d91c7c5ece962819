"""mhc_lightning: train, stress and compare mHC / HC / residual transformers.

The Python API (docs/api.md): the model (GPT and its configs), the LightningModule and data, the callbacks, the MLflow
logger and the reports, importable from the package itself:

    from mhc_lightning import GPTConfig, HyperConfig, LitLM, ByteTextDataModule, compare

Each name is imported on first use (module `__getattr__`), so that `import mhc_lightning` stays cheap: the `mhc`
command imports the package before it knows whether it needs torch or Lightning at all.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    # the model: plain nn.Modules and their configs
    "GPT": "mhc_lightning.model",
    "GPTConfig": "mhc_lightning.model",
    "HyperConfig": "mhc_lightning.model",
    "HyperConnection": "mhc_lightning.model",
    # trained weights outside the platform (`mhc export`)
    "load_pretrained": "mhc_lightning.fit.pretrained",
    "save_pretrained": "mhc_lightning.fit.pretrained",
    # training
    "LitLM": "mhc_lightning.training.module",
    "OptimConfig": "mhc_lightning.training.module",
    "ByteTextDataModule": "mhc_lightning.data",
    # callbacks `mhc fit` installs
    "FinalValidation": "mhc_lightning.callbacks.final_validation",
    "PerLayerArtifacts": "mhc_lightning.callbacks.per_layer_artifacts",
    "RunProvenance": "mhc_lightning.callbacks.run_provenance",
    "SystemMetrics": "mhc_lightning.callbacks.system_metrics",
    "Utilization": "mhc_lightning.callbacks.utilization",
    # the stability toolkit
    "InstabilityDetector": "mhc_lightning.callbacks",
    "GradientSnapshots": "mhc_lightning.callbacks",
    "SinkhornScheduler": "mhc_lightning.callbacks",
    "RankConsistencyCheck": "mhc_lightning.callbacks",
    # MLflow
    "ResilientMLFlowLogger": "mhc_lightning.loggers",
    # reports
    "compare": "mhc_lightning.reports.compare",
    "report": "mhc_lightning.reports.grouped",
    # the `mhc fit|validate|test` CLI, for building runs from config files in Python
    "build_cli": "mhc_lightning.fit.cli",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
