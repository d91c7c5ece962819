"""`mhc prepare`: documents from text, JSON Lines (plain, gzip, zstd) and parquet into token shards; the metadata,
determinism, idempotency, continuing a cut-off preparation, and one line for each bad input before anything is
written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import fast_first, make_text, write_documents

from mhc_lightning.commands import main
from mhc_lightning.data.prepare import META, in_val
from mhc_lightning.data.shards import windows
from mhc_lightning.data.tokenizers import token_dtype


def prepare(*args, capsys=None) -> tuple[int, str]:
    """`mhc prepare ARGS` in-process: (exit status, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["prepare", *map(str, args)])
    return exit_info.value.code, capsys.readouterr().err if capsys else ""


@pytest.fixture
def prepared(prepared_shards) -> tuple[Path, list[str]]:
    return prepared_shards  # conftest.py: shared by the test run; read-only


def test_shards_hold_every_document_once_with_end_of_document_tokens(prepared):
    out, docs = prepared
    meta = json.loads((out / META).read_text())
    assert meta["tokenizer"]["vocab_size"] == 257 and meta["tokenizer"]["eod_id"] == 256 and meta["dtype"] == "uint16"
    for split, want in (
        ("val", [d for d in docs if in_val(d, 0.2)]),
        ("train", [d for d in docs if not in_val(d, 0.2)]),
    ):
        s = meta["splits"][split]
        assert s["documents"] == len(want) > 0
        assert s["bytes"] == sum(len(d.encode()) for d in want)
        assert s["tokens"] == s["bytes"] + len(want)  # one end-of-document token each
        tokens = np.concatenate([w for w in windows(str(out), split, s["tokens"] - 1, False, 0)])
        texts = bytes(tokens[tokens != 256].astype(np.uint8)).decode()
        assert texts == "".join(want)
    assert [Path(s["path"]).name for s in meta["sources"]] == ["a.jsonl", "b.jsonl.gz", "c.txt"]
    assert meta["command"][:2] == ["mhc", "prepare"] and meta["request"]["val_fraction"] == 0.2


@pytest.mark.slow
def test_same_inputs_give_identical_shards_and_a_second_run_does_nothing(prepared, tmp_path, capsys):
    out, _ = prepared
    src = out.parent / "src"
    meta = json.loads((out / META).read_text())
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    code, _ = prepare(src, "--out", out, "--val-fraction", "0.2", "--workers", "1")
    assert code == 0 and "nothing to do" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == mtimes
    again = tmp_path / "again"
    assert prepare(src, "--out", again, "--val-fraction", "0.2", "--workers", "1")[0] == 0
    for split in ("train", "val"):
        assert json.loads((again / META).read_text())["splits"][split]["chunks"] == meta["splits"][split]["chunks"]
        for name in meta["splits"][split]["chunks"]:
            assert (again / split / name).read_bytes() == (out / split / name).read_bytes()


@pytest.mark.slow
def test_a_cut_off_preparation_keeps_the_finished_split_and_completes(prepared, tmp_path):
    out, _ = prepared
    src = out.parent / "src"
    cut = tmp_path / "cut"
    assert prepare(src, "--out", cut, "--val-fraction", "0.2", "--workers", "1")[0] == 0
    # as a preparation stopped while tokenizing the train split: val complete, no train index, no metadata yet
    (cut / META).unlink()
    (cut / "train" / "index.json").unlink()
    (cut / ".prepare_request.json").write_text(json.dumps(json.loads((out / META).read_text())["request"]))
    val_mtimes = {p: p.stat().st_mtime_ns for p in (cut / "val").iterdir()}
    for p in (cut / "train").iterdir():
        p.unlink()
    assert prepare(src, "--out", cut, "--val-fraction", "0.2", "--workers", "1")[0] == 0
    assert {p: p.stat().st_mtime_ns for p in (cut / "val").iterdir()} == val_mtimes
    assert json.loads((cut / META).read_text())["splits"] == json.loads((out / META).read_text())["splits"]


def _jsonl(path: Path, lines: list[bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@fast_first(
    "lines, extra, match",
    [
        ([b'{"body": "x"}'], [], r"line 1: no text field 'text' \(it has: body\); pass --text-field"),
        ([b'{"text": "ok"}', b'{"text": "caf\xe9"}'], [], r"line 2: not valid UTF-8 at byte .*--errors replace"),
        ([b'{"text": "ok"}', b'{"text": "  "}'], [], r"line 2: empty document; .*--skip-empty"),
        ([b'{"text": 3}'], [], r"field 'text' holds int, not text"),
        ([b"not json"], [], r"line 1: not JSON"),
        ([b'{"text": "ok"}'], ["--val-fraction", "1.5"], r"--val-fraction must be in the open interval \(0, 1\)"),
        ([b'{"text": "ok"}'], ["--tokenizer", "missing.json"], r"--tokenizer missing.json: no such file"),
    ],
)
def test_bad_input_is_one_line_before_anything_is_written(tmp_path, capsys, lines, extra, match):
    src = _jsonl(tmp_path / "src" / "docs.jsonl", lines)
    code, err = prepare(src, "--out", tmp_path / "out", "--workers", "1", *extra, capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("mhc prepare: error: ")
    assert re.search(match, err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_policies_and_sources_that_are_not_documents(tmp_path, capsys):
    src = _jsonl(tmp_path / "src" / "docs.jsonl", [b'{"text": "caf\xe9 ' + b"x" * 400 + b'"}'] * 3 + [b'{"text": ""}'])
    code, err = prepare(
        src,
        "--out",
        tmp_path / "out",
        "--workers",
        "1",
        "--errors",
        "replace",
        "--skip-empty",
        "--val-fraction",
        "0.5",
        capsys=capsys,
    )
    # three identical documents share one split: the other one is empty
    assert code == 2 and "split is empty" in err
    (tmp_path / "src" / "notes.bin").write_bytes(b"\0\1")
    code, err = prepare(tmp_path / "src" / "notes.bin", "--out", tmp_path / "o2", capsys=capsys)
    assert code == 2 and "unknown file type" in err
    code, err = prepare(tmp_path / "nowhere", "--out", tmp_path / "o3", capsys=capsys)
    assert code == 2 and "does not exist" in err


@pytest.mark.slow
def test_parquet_and_zstd_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    docs = [make_text(300, seed=i) for i in range(40)]
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.table({"content": docs[:20]}), src / "a.parquet", row_group_size=7)
    (src / "b.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress("".join(json.dumps({"content": d}) + "\n" for d in docs[20:]).encode())
    )
    assert (
        prepare(src, "--out", tmp_path / "out", "--text-field", "content", "--val-fraction", "0.2", "--workers", "2")[0]
        == 0
    )
    meta = json.loads((tmp_path / "out" / META).read_text())
    assert sum(s["documents"] for s in meta["splits"].values()) == 40
    assert sum(s["bytes"] for s in meta["splits"].values()) == sum(len(d.encode()) for d in docs)


@pytest.mark.slow
def test_a_trained_bpe_is_carried_with_the_data_and_encodes_every_byte(tmp_path):
    from tokenizers import Tokenizer

    docs = write_documents(tmp_path / "src", n=30)
    out = tmp_path / "out"
    assert (
        prepare(tmp_path / "src", "--out", out, "--train-tokenizer", "400", "--val-fraction", "0.2", "--workers", "1")[
            0
        ]
        == 0
    )
    meta = json.loads((out / META).read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert meta["tokenizer"]["vocab_size"] == tok.get_vocab_size() <= 400
    assert meta["tokenizer"]["eod_id"] == tok.token_to_id("<|endoftext|>")
    train = meta["splits"]["train"]
    assert train["bytes"] / train["tokens"] > 1.2  # merges: fewer tokens than bytes
    want = "".join(d for d in docs if not in_val(d, 0.2))
    tokens = np.concatenate([w for w in windows(str(out), "train", train["tokens"] - 1, False, 0)])
    assert "".join(tok.decode(list(map(int, tokens)), skip_special_tokens=True)) == want


def test_token_dtype_fits_the_vocabulary():
    assert token_dtype(257) == "uint16" and token_dtype(65536) == "uint16" and token_dtype(65537) == "uint32"
    with pytest.raises(Exception, match=r"--dtype uint16 cannot hold a vocabulary of 100000 ids"):
        token_dtype(100_000, "uint16")
