"""Byte-level text data: corpus loading and the LightningDataModule."""

from .corpus import CorpusError, load_corpus
from .datamodule import ByteTextDataModule

__all__ = ["ByteTextDataModule", "CorpusError", "load_corpus"]
