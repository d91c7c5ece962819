"""`mhc prepare`: text, JSON Lines and parquet documents -> token shards for train and validation (litdata's
`optimize`, read back by its `StreamingDataset`), with the metadata `mhc fit` checks (shards.py).

    mhc prepare corpus/ --out data/tok --tokenizer bytes
    mhc prepare web.jsonl.zst --out data/web --train-tokenizer 8192 --workers 8

Steps: (1) read every document once, in parallel: check it (the text field, UTF-8, empty documents), assign it to a
split by a hash of its text, count its bytes, and digest the source files; nothing is written before this passes.
(2) Train the tokenizer if asked. (3) Tokenize each split into `<out>/<split>/` (chunks plus litdata's index.json),
an end-of-document token after each document. (4) Write `<out>/mhc_data.json` last: a folder with it is complete.

Same sources and arguments give byte-identical chunks. A second run with them does nothing; a run after an
interruption keeps the splits already written and continues the one that was cut off from its litdata checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import astuple
from functools import partial
from pathlib import Path

from ..errors import UserError
from ..files import sha256_file
from .shards import FORMAT, META  # and litdata's warning filters
from .sources import ERROR_POLICIES, SourceError, Unit, documents, source_files, units_of
from .tokenizers import BYTES, EOD_TEXT, load_tokenizer, token_dtype, train_bpe

REQUEST = ".prepare_request.json"  # the arguments of a preparation under way, to continue it
SPLITS = ("val", "train")


def in_val(text: str, val_fraction: float) -> bool:
    """A document's split, from its text alone: the same document is in the same split in any corpus and order
    (exact duplicates never straddle the splits)."""
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")
    return h < val_fraction * 2**64


def _scan_unit(unit: Unit, text_field: str, errors: str, skip_empty: bool, val_fraction: float) -> dict:
    counts = {s: {"documents": 0, "bytes": 0} for s in SPLITS}
    empty = 0
    for where, text in documents(unit, text_field, errors):
        if not text.strip():
            if not skip_empty:
                raise SourceError(f"{where}: empty document; remove it, or pass --skip-empty to leave such out.")
            empty += 1
            continue
        c = counts["val" if in_val(text, val_fraction) else "train"]
        c["documents"] += 1
        c["bytes"] += len(text.encode("utf-8"))
    return {"counts": counts, "empty": empty}


def _split_texts(unit: Unit, split: str, text_field: str, errors: str, val_fraction: float):
    for _, text in documents(unit, text_field, errors):
        if text.strip() and in_val(text, val_fraction) == (split == "val"):
            yield text


def tokenize_unit(item: list, *, split, tokenizer, text_field, errors, val_fraction, dtype):
    """litdata's `fn`: the tokens of ``unit``'s documents of ``split``, each followed by the end-of-document id."""
    import numpy as np

    unit = Unit(*item)  # litdata's checkpoints keep the inputs as JSON: a unit travels as a list
    tok = _worker_tokenizer(tokenizer)
    parts, batch = [], []
    eod = np.array([tok.eod_id], dtype=np.int64)

    def flush():
        for ids in tok.encode_batch(batch):
            parts.extend((ids, eod))
        batch.clear()

    for text in _split_texts(unit, split, text_field, errors, val_fraction):
        batch.append(text)
        if len(batch) == 256:
            flush()
    flush()
    return np.concatenate(parts).astype(dtype)  # litdata's numpy serializer keeps uint16 / uint32


_TOKENIZERS: dict = {}


def _worker_tokenizer(spec: str):
    if spec not in _TOKENIZERS:  # once per worker process
        _TOKENIZERS[spec] = load_tokenizer(spec)
    return _TOKENIZERS[spec]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mhc prepare",
        description="Tokenize text / JSON Lines / parquet documents into train and val token shards for "
        "`mhc fit --data.corpus=OUT` (docs/data.md).",
    )
    p.add_argument("sources", nargs="+", help="files or folders: .txt/.md, .jsonl[.gz|.zst], .parquet")
    p.add_argument("--out", required=True, help="the prepared dataset's folder (or continue one cut off)")
    p.add_argument("--tokenizer", default=BYTES, help="`bytes` (default) or the path of a tokenizer.json")
    p.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB",
        help="train a byte-level BPE of VOCAB ids on the train split first (offline), saved as OUT/tokenizer.json",
    )
    p.add_argument("--eod-token", default=EOD_TEXT, help="the tokenizer's end-of-document token (default %(default)s)")
    p.add_argument("--text-field", default="text", help="JSON Lines key / parquet column of the text")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out (by text hash)")
    p.add_argument(
        "--errors",
        choices=ERROR_POLICIES,
        default="strict",
        help="undecodable UTF-8: strict refuses the file (default), replace writes U+FFFD",
    )
    p.add_argument("--skip-empty", action="store_true", help="leave empty documents out instead of refusing")
    p.add_argument("--dtype", choices=("auto", "uint16", "uint32"), default="auto")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: every core)")
    p.add_argument("--chunk-mb", type=int, default=64, help="size of each shard file in MB")
    return p


def check_args(args) -> None:
    if not 0 < args.val_fraction < 1:
        raise UserError(f"--val-fraction must be in the open interval (0, 1), got {args.val_fraction}")
    if args.workers < 1 or args.chunk_mb < 1:
        raise UserError("--workers and --chunk-mb must be integers >= 1")
    if args.train_tokenizer is not None and args.tokenizer != BYTES:
        raise UserError("pass either --tokenizer FILE or --train-tokenizer VOCAB, not both")
    if args.tokenizer != BYTES:
        token_dtype(load_tokenizer(args.tokenizer, args.eod_token).vocab_size, args.dtype)


def _request(args, files: list[Path]) -> dict:
    """What decides the output: the sources (path, size, mtime) and every argument that changes a byte of it."""
    keys = (
        "tokenizer",
        "train_tokenizer",
        "eod_token",
        "text_field",
        "val_fraction",
        "errors",
        "skip_empty",
        "dtype",
        "workers",
        "chunk_mb",
    )
    sources = [{"path": str(f.resolve()), "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns} for f in files]
    return {"sources": sources, **{k: getattr(args, k) for k in keys}}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def scan(units: list[Unit], files: list[Path], args) -> dict:
    """Check and count every document, and digest every source file, with `args.workers` processes."""
    work = partial(
        _scan_unit,
        text_field=args.text_field,
        errors=args.errors,
        skip_empty=args.skip_empty,
        val_fraction=args.val_fraction,
    )
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        per_unit = list(pool.map(work, units, chunksize=max(1, len(units) // (8 * args.workers))))
        digests = list(pool.map(sha256_file, files))
    totals = {s: {"documents": 0, "bytes": 0} for s in SPLITS}
    for r in per_unit:
        for s in SPLITS:
            for k in ("documents", "bytes"):
                totals[s][k] += r["counts"][s][k]
    if totals["val"]["documents"] == 0 or totals["train"]["documents"] == 0:
        empty = "val" if totals["val"]["documents"] == 0 else "train"
        raise UserError(
            f"the {empty} split is empty: {sum(t['documents'] for t in totals.values())} documents with "
            f"--val-fraction {args.val_fraction}; pass another --val-fraction, or more documents."
        )
    return {
        "per_unit": per_unit,
        "splits": totals,
        "empty_documents": sum(r["empty"] for r in per_unit),
        "sources": [{"path": str(f), "bytes": f.stat().st_size, "sha256": d} for f, d in zip(files, digests)],
    }


def prepare(args) -> Path:
    check_args(args)
    out = Path(args.out).expanduser()
    files = source_files(args.sources)
    request = _request(args, files)
    meta = _read_json(out / META)
    if meta is not None:
        if meta.get("request") == request:
            print(f"mhc prepare: {out} already holds these sources prepared with these arguments; nothing to do.")
            return out
        raise UserError(
            f"{out} holds a dataset prepared from other sources or arguments; pass another --out, or remove the folder."
        )
    started = _read_json(out / REQUEST)
    if out.exists() and any(out.iterdir()) and started != request:
        raise UserError(
            f"--out {out} is not empty and holds no preparation of these sources and arguments; pass an "
            "empty or new folder."
        )
    t0 = time.time()
    units = [u for f in files for u in units_of(f)]
    print(f"mhc prepare: reading {len(files)} files ({len(units)} units) with {args.workers} processes ...", flush=True)
    scanned = scan(units, files, args)  # every input check: before anything is written
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / REQUEST, request)
    tokenizer_spec = _tokenizer(args, out, units)
    tok = load_tokenizer(tokenizer_spec, args.eod_token)
    dtype = token_dtype(tok.vocab_size, args.dtype)
    splits = {}
    for split in SPLITS:
        todo = [u for u, r in zip(units, scanned["per_unit"]) if r["counts"][split]["documents"]]
        splits[split] = {
            **scanned["splits"][split],
            **_write_split(
                out / split, todo, split, tokenizer_spec, dtype, args, scanned["splits"][split]["documents"]
            ),
        }
    meta = {
        "format": FORMAT,
        "tokenizer": {
            "name": tok.name,
            "sha256": tok.sha256,
            "vocab_size": tok.vocab_size,
            "eod_id": tok.eod_id,
            "file": None if tokenizer_spec == BYTES else "tokenizer.json",
        },
        "dtype": dtype,
        "val_fraction": args.val_fraction,
        "splits": splits,
        "empty_documents_skipped": scanned["empty_documents"],
        "sources": scanned["sources"],
        "command": ["mhc", "prepare", *getattr(args, "argv", [])],
        "request": request,
    }
    _write_json(out / META, meta)
    (out / REQUEST).unlink(missing_ok=True)
    t = splits["train"]
    print(
        f"mhc prepare: {out}: train {t['tokens']:,} tokens ({t['bytes'] / t['tokens']:.2f} bytes/token), val "
        f"{splits['val']['tokens']:,} tokens, vocab {tok.vocab_size} ({dtype}); {time.time() - t0:.0f} s. "
        f"Train on it: mhc fit -c conf/quickstart.yaml --data.corpus={out}"
    )
    return out


def _tokenizer(args, out: Path, units: list[Unit]) -> str:
    """The tokenizer spec the workers load: `bytes`, or OUT/tokenizer.json (trained here, or a copy of the given
    one, so that the dataset carries its tokenizer)."""
    if args.train_tokenizer is None and args.tokenizer == BYTES:
        return BYTES
    target = out / "tokenizer.json"
    if args.train_tokenizer is not None:
        if not target.exists():
            print(
                f"mhc prepare: training a byte-level BPE of {args.train_tokenizer} ids on the train split ...",
                flush=True,
            )
            texts = (
                t for u in units for t in _split_texts(u, "train", args.text_field, args.errors, args.val_fraction)
            )
            train_bpe(texts, args.train_tokenizer, target.with_name("tokenizer.json.tmp"))
            os.replace(target.with_name("tokenizer.json.tmp"), target)
    else:
        shutil.copyfile(Path(args.tokenizer).expanduser(), target)
    return str(target)


def _write_split(
    dest: Path, units: list[Unit], split: str, tokenizer_spec: str, dtype: str, args, documents: int
) -> dict:
    """Tokenize ``units`` into ``dest`` with litdata (skipped when a complete index is there already); its tokens and
    the sha256 of every chunk file."""
    if not (dest / "index.json").exists():
        from litdata import TokensLoader, optimize

        print(f"mhc prepare: tokenizing the {split} split ({len(units)} units) into {dest} ...", flush=True)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one worker per core already
        # litdata stages chunks in one folder per machine (/tmp/chunks) unless told otherwise: two preparations at
        # once would take each other's chunks
        work = dest.parent / ".litdata" / split
        os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = str(work / "chunks")
        os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = str(work / "data")
        fn = partial(
            tokenize_unit,
            split=split,
            tokenizer=tokenizer_spec,
            text_field=args.text_field,
            errors=args.errors,
            val_fraction=args.val_fraction,
            dtype=dtype,
        )
        optimize(
            fn=fn,
            inputs=[list(astuple(u)) for u in units],
            output_dir=str(dest.resolve()),
            chunk_bytes=args.chunk_mb * 10**6,
            item_loader=TokensLoader(),
            num_workers=min(args.workers, len(units)),
            reorder_files=False,
            use_checkpoint=True,
            start_method="spawn",  # not fork: the process may run threads (a tokenizer's, a test runner's)
        )
    shutil.rmtree(dest.parent / ".litdata", ignore_errors=True)
    index = json.loads((dest / "index.json").read_text())
    tokens = sum(c["dim"] for c in index["chunks"])
    if tokens < documents or not all((dest / c["filename"]).is_file() for c in index["chunks"]):
        shutil.rmtree(dest)  # never leave a split that looks finished
        raise RuntimeError(f"litdata wrote {tokens} tokens for {documents} documents of the {split} split into {dest}")
    chunks = {c["filename"]: sha256_file(dest / c["filename"]) for c in index["chunks"]}
    return {"tokens": tokens, "chunks": chunks}


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(argv)
    try:
        prepare(args)
    except KeyboardInterrupt:
        print(f"mhc prepare: interrupted; the same command continues it (--out {args.out}).", file=sys.stderr)
        return 130
    return 0
