"""Reading the token shards of `mhc prepare` (a local folder, or an object-store URI such as s3://bucket/prefix):
their metadata and its checks, and litdata's StreamingDataset of (seq_len + 1)-token windows over a split.

Local shards are memory-mapped: a process holds only the windows in flight, whatever the corpus's size. Remote ones
are downloaded chunk by chunk into a local cache as they are read (litdata). Under DDP / FSDP the dataset gives each
rank its own part of every epoch; its position is saved in checkpoints (StreamingDataLoader.state_dict), so a resumed
fit sees the batches an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Optional

from ..errors import UserError
from ..files import sha256_file

META = "mhc_data.json"  # the metadata `mhc prepare` writes last: a folder with it is a complete dataset
FORMAT = 1  # its layout's version
REMOTE_PREFIXES = ("s3://", "gs://", "azure://", "hf://", "local:")
# litdata's own advice to upgrade (it asks PyPI once per process; below 0.2.45 always): pyproject.toml says why not.
# Lightning's caution about an IterableDataset with __len__ under several workers: litdata gives each worker its own
# part of the shards, so the length is exact.
warnings.filterwarnings("ignore", message="A newer version of litdata is available")
warnings.filterwarnings("ignore", message="Your `IterableDataset` has `__len__` defined")


def is_remote(corpus: str) -> bool:
    return str(corpus).startswith(REMOTE_PREFIXES)


def is_prepared(corpus: str) -> bool:
    """A folder written by `mhc prepare`, or an object-store URI (which only prepared shards can be)."""
    return is_remote(corpus) or (Path(str(corpus)).expanduser() / META).is_file()


def stream_cache_dir(cache_dir: Optional[str]) -> Path:
    from .corpus import default_cache_dir

    return (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / "streams"


def _join(corpus: str, *parts: str) -> str:
    return "/".join([str(corpus).rstrip("/"), *parts])


def load_metadata(corpus: str, cache_dir: Optional[str] = None) -> dict:
    """The dataset's mhc_data.json (downloaded first for a remote dataset); a UserError if it is missing or of an
    unknown format."""
    if is_remote(corpus):
        local = stream_cache_dir(cache_dir) / hashlib.sha256(str(corpus).encode()).hexdigest()[:16] / META
        _download(_join(corpus, META), local)
    else:
        local = Path(str(corpus)).expanduser() / META
    try:
        meta = json.loads(local.read_text())
    except (OSError, ValueError) as err:
        raise UserError(
            f"data.corpus {corpus}: cannot read {META} ({err}); prepare the data with `mhc prepare`."
        ) from err
    if meta.get("format") != FORMAT:
        raise UserError(
            f"data.corpus {corpus}: {META} has format {meta.get('format')!r}, this version reads "
            f"{FORMAT}; prepare the data again with this version's `mhc prepare`."
        )
    return meta


def _download(remote: str, local: Path) -> None:
    from litdata.streaming.downloader import get_downloader

    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = local.with_name(local.name + f".{os.getpid()}.tmp")
    try:
        get_downloader(remote.rsplit("/", 1)[0], str(local.parent), []).download_file(remote, str(tmp))
        os.replace(tmp, local)
    except Exception as err:  # each object store raises its own types
        raise UserError(
            f"data.corpus: cannot download {remote} ({type(err).__name__}: {err}); check the URI and "
            "the store's credentials (AWS_* variables for s3://)."
        ) from err


def check_shards(corpus: str, meta: dict, splits=("train", "val")) -> None:
    """Refuse a local shard whose size or sha256 differs from the metadata, naming the file and both digests.
    A remote dataset's chunks are checked by litdata as they arrive (sizes); their digests are not read here."""
    if is_remote(corpus):
        return
    root = Path(str(corpus)).expanduser()
    for split in splits:
        for name, expected in meta["splits"][split]["chunks"].items():
            path = root / split / name
            if not path.is_file():
                raise UserError(f"data.corpus {corpus}: shard {split}/{name} is missing; prepare the data again.")
            actual = sha256_file(path)
            if actual != expected:
                raise UserError(
                    f"data.corpus {corpus}: shard {split}/{name} has sha256 {actual}, its metadata says {expected}: "
                    "the file changed after `mhc prepare`; prepare the data again."
                )


def data_digest(meta: dict, split: str) -> str:
    """One digest of a split's shards (from the metadata's digests): the data a run trained or validated on."""
    chunks = meta["splits"][split]["chunks"]
    return hashlib.sha256("".join(f"{k}:{chunks[k]}\n" for k in sorted(chunks)).encode()).hexdigest()


def bytes_per_token(meta: dict, split: str = "val") -> float:
    s = meta["splits"][split]
    return s["bytes"] / s["tokens"]


def windows(corpus: str, split: str, seq_len: int, shuffle: bool, seed: int, cache_dir: Optional[str] = None):
    """litdata's StreamingDataset of non-overlapping (seq_len + 1)-token windows of ``split``."""
    from litdata import StreamingDataset, TokensLoader

    source = _join(corpus, split) if is_remote(corpus) else str((Path(str(corpus)).expanduser() / split).resolve())
    kwargs = {"cache_dir": str(stream_cache_dir(cache_dir) / split)} if is_remote(corpus) else {}
    return StreamingDataset(
        source,
        item_loader=TokensLoader(block_size=seq_len + 1),
        shuffle=shuffle,
        seed=seed,
        drop_last=shuffle,  # train: every rank the same number of batches; val: every window
        **kwargs,
    )


def collate_windows(items: list) -> tuple:
    """(x, y) int64 batches from a list of (seq_len + 1)-token windows (numpy uint16 / uint32 views of the memory-
    mapped shards); a module-level function so that
    DataLoader worker processes can take it."""
    import numpy as np
    import torch

    batch = torch.from_numpy(np.stack(items).astype(np.int64))
    return batch[:, :-1], batch[:, 1:]
