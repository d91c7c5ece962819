"""Language-modelling data: fixed-length windows over the train / val splits of a byte corpus (the built-in one or
your text), or of token shards prepared by `mhc prepare` (shards.py)."""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from ..errors import ConfigError
from .corpus import N_SHAKESPEARE_WORKS, SHAKESPEARE, CorpusError, fetch_shakespeare, load_corpus, split_sizes
from .resumable_sampler import ResumableRandomSampler
from .shards import bytes_per_token, check_shards, collate_windows, data_digest, is_prepared, load_metadata, windows

# torchdata 0.11 calls a deprecated torch function in every StatefulDataLoader: harmless noise
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

# The data seed when neither data.seed nor seed_everything gives one (seeding switched off).
FALLBACK_DATA_SEED = 1234


def resolve_data_seed(seed: Optional[int]) -> tuple[int, str]:
    """(seed, where it came from): data.seed when set, else the seed that `seed_everything` (LightningCLI's
    `seed_everything`, or a call from Python) put in PL_GLOBAL_SEED, so that a seed spread covers the data order."""
    if seed is not None:
        return seed, "data.seed"
    env = os.environ.get("PL_GLOBAL_SEED")
    if env is not None:
        return int(env), "seed_everything"
    return FALLBACK_DATA_SEED, "fallback"


class ByteWindows(Dataset):
    """Windows of ``seq_len + 1`` bytes at stride ``seq_len`` starting at ``offset``: item i is (x, y) with y = x
    shifted by one."""

    def __init__(self, data: torch.Tensor, seq_len: int, offset: int = 0):
        self.data, self.seq_len, self.offset = data, seq_len, offset
        self.n = max(0, (len(data) - offset - 1) // seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        start = self.offset + i * self.seq_len
        window = self.data[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


class ByteTextDataModule(L.LightningDataModule):
    """Tokens of ``corpus`` as (x, y) int64 batches of shape (batch_size, seq_len). ``corpus``: "shakespeare" or a
    local text file / folder (bytes, vocabulary 256), or token shards from `mhc prepare` (a folder with mhc_data.json
    or an object-store URI such as s3://bucket/prefix; vocabulary and tokenizer from its metadata).

    batch_size is per process: under DDP / FSDP the global batch is world_size x batch_size.
    seed: the train windows' start offset and shuffle order; null (default) follows `seed_everything`, so runs that
    differ in seed also differ in the data they see (resolve_data_seed); set it to hold the data fixed across seeds.
    shuffle: shuffle the train windows (seeded); false = corpus order (reproducible comparisons across device counts).
    allow_binary: train on files that do not look like text (refused by default: usually a wrong path).
    pin_memory: batches in page-locked host memory; null (default) pins when the trainer runs on a CUDA device.
    Lightning moves each batch with non_blocking=True, but a copy from pageable memory still makes the host wait for
    every kernel already queued.
    tokenizer: for prepared shards, the sha256 (or name) of the tokenizer they must have been prepared with; null
    accepts any. The model's vocabulary always follows the data.
    """

    def __init__(
        self,
        corpus: str = "shakespeare",
        seq_len: int = 128,
        batch_size: int = 16,
        cache_dir: Optional[str] = None,
        val_works: int = 4,
        val_fraction: float = 0.05,
        num_workers: int = 0,
        seed: Optional[int] = None,
        shuffle: bool = True,
        allow_binary: bool = False,
        pin_memory: Optional[bool] = None,
        tokenizer: Optional[str] = None,
    ):
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("val_works", val_works)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"data.{name} must be an integer >= 1, got {value!r}")
        if corpus == SHAKESPEARE["name"] and val_works >= N_SHAKESPEARE_WORKS:
            raise ConfigError(
                f"data.val_works must be between 1 and {N_SHAKESPEARE_WORKS - 1} (the Shakespeare "
                f"corpus has {N_SHAKESPEARE_WORKS} works), got {val_works}"
            )
        if not 0 < val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in the open interval (0, 1), got {val_fraction!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ConfigError(f"data.num_workers must be an integer >= 0, got {num_workers!r}")
        for name, value in (("shuffle", shuffle), ("allow_binary", allow_binary)):
            if not isinstance(value, bool):
                raise ConfigError(f"data.{name} must be true or false, got {value!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ConfigError(f"data.seed must be an integer >= 0 or null (follow seed_everything), got {seed!r}")
        if pin_memory is not None and not isinstance(pin_memory, bool):
            raise ConfigError(f"data.pin_memory must be true, false or null (pin on CUDA), got {pin_memory!r}")
        seed, self.seed_source = resolve_data_seed(seed)
        self.save_hyperparameters()
        # LightningCLI hands save_hyperparameters its parsed config (seed: null), not this frame: record the seed
        # used, in the hyperparameters and in the initial copy that the loggers log.
        self.save_hyperparameters({**self.hparams, "seed": seed})
        # the CLI links vocab_size to the model at instantiation
        self.meta = load_metadata(corpus, cache_dir) if is_prepared(corpus) else None
        self.vocab_size = self.meta["tokenizer"]["vocab_size"] if self.meta else 256
        # bits per byte = nats per token / ln 2 / bytes per token (the validation split's ratio)
        self.bytes_per_token = bytes_per_token(self.meta) if self.meta else 1.0
        self.tokenizer_name = self.meta["tokenizer"]["name"] if self.meta else "bytes (raw)"
        if (
            self.meta
            and tokenizer is not None
            and tokenizer not in (self.tokenizer_name, self.meta["tokenizer"]["sha256"])
        ):
            t = self.meta["tokenizer"]
            raise ConfigError(
                f"data.tokenizer is {tokenizer!r}, but {corpus} was prepared with tokenizer {t['name']} (sha256 "
                f"{t['sha256']}, vocabulary {t['vocab_size']}); prepare the data with that tokenizer, or set "
                "data.tokenizer to null."
            )
        self.train_bytes: Optional[int] = None
        self.val_bytes: Optional[int] = None
        self.train_dataset: Optional[ByteWindows] = None
        self.val_dataset: Optional[ByteWindows] = None
        self.train_sha256: Optional[str] = None  # digests of the bytes trained and validated on (run provenance)
        self.val_sha256: Optional[str] = None

    def prepare_data(self) -> None:
        # Runs on one process per node: only the download belongs here, not state.
        if self.hparams.corpus == SHAKESPEARE["name"]:
            fetch_shakespeare(self.hparams.cache_dir)

    def check_corpus(self) -> None:
        """Raise CorpusError if the corpus is missing, empty, not text, or too short for one train batch and one
        val window. Reads file sizes and samples only: `mhc` calls it before a run or folder exists."""
        hp = self.hparams
        if self.meta:
            check_shards(hp.corpus, self.meta)
            splits = self.meta["splits"]
            return self._check_lengths(splits["train"]["tokens"], splits["val"]["tokens"])
        self._check_lengths(*split_sizes(hp.corpus, hp.cache_dir, hp.val_works, hp.val_fraction, hp.allow_binary))

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_dataset is not None:
            return
        hp = self.hparams
        if self.meta:
            splits = self.meta["splits"]
            self.train_bytes, self.val_bytes = splits["train"]["bytes"], splits["val"]["bytes"]
            self.train_sha256, self.val_sha256 = data_digest(self.meta, "train"), data_digest(self.meta, "val")
            self.train_dataset = windows(hp.corpus, "train", hp.seq_len, hp.shuffle, hp.seed, hp.cache_dir)
            self.val_dataset = windows(hp.corpus, "val", hp.seq_len, False, hp.seed, hp.cache_dir)
            return
        train, val = load_corpus(hp.corpus, hp.cache_dir, hp.val_works, hp.val_fraction, hp.allow_binary)
        self.train_bytes, self.val_bytes = len(train), len(val)
        self.train_sha256, self.val_sha256 = hashlib.sha256(train).hexdigest(), hashlib.sha256(val).hexdigest()
        self._check_lengths(len(train), len(val))
        # A seeded start offset so train windows do not share boundaries with the val layout (offset 0).
        # It is capped by the slack beyond the last full batch, so it never costs the one batch we require.
        offset = int(torch.randint(hp.seq_len, (1,), generator=torch.Generator().manual_seed(hp.seed)))
        offset = min(offset, len(train) - 1 - hp.batch_size * hp.seq_len)
        self.train_dataset = ByteWindows(_as_tensor(train), hp.seq_len, offset)
        self.val_dataset = ByteWindows(_as_tensor(val), hp.seq_len)

    def _check_lengths(self, train_tokens: int, val_tokens: int) -> None:
        hp = self.hparams
        unit = "tokens" if self.meta else "bytes"
        per_window = hp.seq_len + 1 if self.meta else hp.seq_len  # shards: windows do not share their last token
        for split, n_tokens, needed in (
            ("train", train_tokens, hp.batch_size * per_window + 1),
            ("val", val_tokens, hp.seq_len + 1),
        ):
            if n_tokens < needed:
                raise CorpusError(
                    f"the {split} split of corpus {hp.corpus!r} has {n_tokens} {unit}, but data.seq_len={hp.seq_len} "
                    f"and data.batch_size={hp.batch_size} need at least {needed} {unit} for one "
                    f"{'batch' if split == 'train' else 'window'}; use a smaller seq_len/batch_size or a larger corpus."
                )

    def train_dataloader(self) -> DataLoader:
        # A seeded generator makes the shuffle order a function of `seed` alone.
        hp = self.hparams
        if self.meta:  # litdata splits the shards between ranks and keeps its own position
            return self._streaming_loader(self.train_dataset, drop_last=True)
        dist_kwargs = self._distributed_sampler_kwargs()
        if dist_kwargs:
            # Lightning would inject a DistributedSampler that always shuffles the train split, with the
            # seed_everything seed; ours keeps `shuffle` and `seed` meaning the same on any number of processes.
            # shuffle=False: single-process batch i is windows [B*i, B*i+B); with W ranks of B/W each, rank r gets
            # windows r, r+W, ...: the same global batch, so runs compare step by step across device counts.
            sampler = DistributedSampler(self.train_dataset, shuffle=hp.shuffle, seed=hp.seed, **dist_kwargs)
            return self._loader(self.train_dataset, StatefulDataLoader, sampler=sampler, drop_last=True)
        # Stateful: Lightning saves its position (shuffle state, batches done) in every checkpoint, so a run resumed
        # mid-epoch continues on exactly the batches an uninterrupted run would see (resumable_sampler.py).
        generator = torch.Generator().manual_seed(hp.seed)
        order = ResumableRandomSampler(self.train_dataset, generator) if hp.shuffle else None
        return self._loader(self.train_dataset, StatefulDataLoader, sampler=order, drop_last=True, generator=generator)

    def _distributed_sampler_kwargs(self) -> Optional[dict]:
        """num_replicas / rank of the data-parallel group when the trainer runs more than one, else None."""
        trainer = self.trainer
        kwargs = getattr(trainer, "distributed_sampler_kwargs", None) if trainer is not None else None
        if not kwargs or kwargs.get("num_replicas", 1) <= 1:
            return None
        return {"num_replicas": kwargs["num_replicas"], "rank": kwargs["rank"]}

    def val_dataloader(self) -> DataLoader:
        if self.meta:
            return self._streaming_loader(self.val_dataset, drop_last=False)
        return self._loader(self.val_dataset, shuffle=False, drop_last=False)

    def test_dataloader(self) -> DataLoader:
        # The corpus has two splits; `mhc test` reports on the held-out one.
        return self.val_dataloader()

    def _loader(self, dataset: Optional[ByteWindows], loader: type = DataLoader, **kwargs) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before asking ByteTextDataModule for a dataloader")
        nw = self.hparams.num_workers
        return loader(
            dataset,
            batch_size=self.hparams.batch_size,
            num_workers=nw,
            persistent_workers=nw > 0,
            pin_memory=self.pins_memory(),
            **kwargs,
        )

    def _streaming_loader(self, dataset, drop_last: bool) -> DataLoader:
        from litdata import StreamingDataLoader

        return self._loader(dataset, StreamingDataLoader, collate_fn=collate_windows, drop_last=drop_last)

    def pins_memory(self) -> bool:
        """data.pin_memory, null resolved by the attached trainer's device (no trainer: no pinning)."""
        if self.hparams.pin_memory is not None:
            return self.hparams.pin_memory
        trainer = self.trainer
        return trainer is not None and trainer.strategy.root_device.type == "cuda"


def _as_tensor(data: bytes) -> torch.Tensor:
    # bytearray gives a writable buffer, which torch.frombuffer needs to avoid a warning.
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
