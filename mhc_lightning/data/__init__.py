"""Byte-level text data: corpus loading and the LightningDataModule."""

from .corpus import CorpusError, load_corpus

__all__ = ["ByteTextDataModule", "CorpusError", "load_corpus"]


def __getattr__(name: str):
    # The data module (torch, Lightning) on first use: `mhc` checks a corpus (corpus.py) before importing them.
    if name == "ByteTextDataModule":
        from .datamodule import ByteTextDataModule

        return ByteTextDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
