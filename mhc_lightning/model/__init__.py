"""The model as plain nn.Modules, free of Lightning. Each name is imported on first use, so that the mode registry
(modes.py) is read without torch."""

from __future__ import annotations

import importlib

# public name -> the module of this package that defines it
_EXPORTS = {
    "GPT": "gpt",
    "GPTConfig": "config",
    "HyperConfig": "config",
    "HyperConnection": "hyper_connection",
    "hyper_connections": "hyper_connection",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
