"""Training data: the byte corpus (corpus.py), prepared token shards (prepare.py writes them, shards.py reads
them) and the LightningDataModule that serves both (datamodule.py).

The names below load on first use, so that `mhc prepare` starts without importing Lightning.
"""

import importlib

_LAZY = {"ByteTextDataModule": ".datamodule", "CorpusError": ".corpus", "load_corpus": ".corpus"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
