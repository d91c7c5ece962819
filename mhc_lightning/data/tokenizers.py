"""Tokenizers of `mhc prepare`: `bytes` (UTF-8 bytes, ids 0-255, end of document 256) and any Hugging Face
`tokenizers` tokenizer (a `tokenizer.json`), including a byte-level BPE trained on the corpus itself.

Every tokenizer has an end-of-document id, written after each document, and an identity (a sha256) that the
prepared data records and `mhc fit` checks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..errors import UserError

EOD_TEXT = "<|endoftext|>"
BYTES = "bytes"
# The identity of the byte tokenizer: a digest of its definition, so that it is checked like a tokenizer file
BYTES_SHA256 = hashlib.sha256(b"mhc_lightning bytes tokenizer: utf-8 bytes 0-255, end of document 256").hexdigest()


class ByteTokenizer:
    name = BYTES
    vocab_size = 257
    eod_id = 256
    sha256 = BYTES_SHA256

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer from its `tokenizer.json`; the end-of-document token is `eod`."""

    def __init__(self, path: Path, eod: str = EOD_TEXT):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
            raise UserError(f"tokenizer {path}: not a Hugging Face tokenizer.json ({err}).") from err
        self.name = path.name
        self.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        eod_id = self.tokenizer.token_to_id(eod)
        if eod_id is None:
            raise UserError(
                f"tokenizer {path} has no end-of-document token {eod!r}; pass --eod-token with one of its special "
                "tokens (e.g. '</s>')."
            )
        self.eod_id = eod_id

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]


def load_tokenizer(spec: str, eod: str = EOD_TEXT):
    """`bytes` or the path of a tokenizer.json."""
    if spec == BYTES:
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_file():
        raise UserError(f"--tokenizer {spec}: no such file; pass `bytes` or the path of a tokenizer.json.")
    return HFTokenizer(path, eod)


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path) -> Path:
    """Train a byte-level BPE of ``vocab_size`` ids (the 256 bytes, merges, and the end-of-document token) on
    ``texts``; write it to ``out`` (tokenizer.json). Offline, deterministic for the same texts in the same order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise UserError(
            f"--train-tokenizer {vocab_size}: the vocabulary needs more than the 256 bytes and the "
            "end-of-document token; pass a size of at least 258 (e.g. 4096)."
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    return out


def token_dtype(vocab_size: int, requested: str = "auto") -> str:
    """uint16 when every id fits, else uint32; a requested dtype the vocabulary does not fit is refused."""
    fits16 = vocab_size <= 2**16
    if requested == "auto":
        return "uint16" if fits16 else "uint32"
    if requested == "uint16" and not fits16:
        raise UserError(
            f"--dtype uint16 cannot hold a vocabulary of {vocab_size} ids (at most 65536); pass --dtype uint32 or auto."
        )
    return requested
