"""Run params under the names `mhc fit` takes them (`model.arch.hyper.residual_mode`, `data.corpus`,
`trainer.max_steps`, `seed_everything`), so that a run's params read as the command that would rerun it and
`mhc report --group-by` takes the same spelling. No Lightning: reports read stores with it.

Lightning hands a logger the module's and the datamodule's hyperparameters merged into one dict (`arch`, `optim`, ...,
`corpus`, `seq_len`, ...): MODEL_KEYS and DATA_KEYS say which is which (tests/test_provenance.py checks them against
LitLM's and ByteTextDataModule's signatures). Internals (`_instantiator`, `_class_path`) are left out. Stores written
before used Lightning's `/`-joined names (`arch/hyper/residual_mode`, `trainer/max_steps`, `corpus`): `cli_name` maps
those too, so old and new stores read alike.
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Mapping
from typing import Any

MODEL_KEYS = ("arch", "optim", "diagnostics_every", "compile", "compile_mode")
DATA_KEYS = (
    "corpus",
    "seq_len",
    "batch_size",
    "val_works",
    "val_fraction",
    "num_workers",
    "seed",
    "cache_dir",
    "shuffle",
    "allow_binary",
    "pin_memory",
    "tokenizer",
)
SECTIONS = ("model", "data", "trainer")
TOP_LEVEL = ("seed_everything",)


def cli_name(key: str) -> str:
    """The `mhc fit` spelling of a param name, old (`arch/n_layers`, `data/seed`, `corpus`) or new (unchanged)."""
    parts = key.replace("/", ".").split(".")
    if parts[0] in SECTIONS or key in TOP_LEVEL:
        return ".".join(parts)
    if parts[0] in MODEL_KEYS:
        return ".".join(["model", *parts])
    if parts[0] in DATA_KEYS:
        return ".".join(["data", *parts])
    return ".".join(parts)


def _flat(params, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (vars(params) if isinstance(params, Namespace) else params).items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, (Mapping, Namespace)):
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out


def internal(key: str) -> bool:
    """LightningCLI's bookkeeping (`_instantiator`, `_class_path`), not a setting."""
    return any(part.startswith("_") for part in key.replace("/", ".").split("."))


def cli_params(params) -> dict[str, Any]:
    """Nested or flat hyperparameters as {CLI name: value}, internals left out."""
    return {cli_name(k): v for k, v in _flat(params).items() if not internal(k)}
