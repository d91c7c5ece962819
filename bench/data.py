"""Token shards (`mhc prepare`, docs/data.md): memory per training process against corpus size, loader throughput,
and `mhc prepare`'s tokenizing rate per core.

Three measurements, each in fresh processes:
    memory      prepared corpora of --sizes GiB of generated uint16 tokens (no text to tokenize); a process builds
                the datamodule as `mhc fit` does and reads --batches batches of random windows; its private anonymous
                memory (/proc/PID/smaps_rollup "Anonymous", the loader's worker processes added) before and after
    loader      tokens/s of that train loader at --seq-len / --batch-size, with 0 and 2 workers
    prepare     `mhc prepare` with a byte-level BPE of --vocab ids on --text-mb MB of English (the built-in corpus,
                repeated) in JSON Lines, with 1 and 2 workers: MB of text per second in the tokenizing step, per
                worker; and the tokenizer library's own encode rate on one core, its bound

    python -m bench data --sizes 1,8 --out docs/benchmarks/data.json
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

from bench import harness

CHUNK_TOKENS = 2**25  # one generated item: 32 Mi tokens (64 MiB of uint16)


def _random_tokens(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n, dtype=np.uint16)


def _generated_item(index: int, n: int = CHUNK_TOKENS) -> np.ndarray:
    return _random_tokens(index, n)


def make_corpus(root: Path, gib: float, workers: int) -> Path:
    """A prepared dataset of ``gib`` GiB of random tokens in the train split (and a small val split), with the
    metadata `mhc fit` reads; its shard digests are real."""
    from litdata import TokensLoader, optimize

    from mhc_lightning.data.prepare import FORMAT, META
    from mhc_lightning.files import sha256_file

    splits = {}
    total = int(gib * 2**30 / 2)
    for split, items in (("train", max(1, round(total / CHUNK_TOKENS))), ("val", 1)):
        dest = root / split
        item = partial(_generated_item, n=min(CHUNK_TOKENS, total))
        optimize(fn=item, inputs=list(range(items)), output_dir=str(dest), chunk_bytes="256MB",
                 item_loader=TokensLoader(), num_workers=workers, reorder_files=False, start_method="fork")  # fmt: skip
        index = json.loads((dest / "index.json").read_text())
        tokens = sum(c["dim"] for c in index["chunks"])
        chunks = {c["filename"]: sha256_file(dest / c["filename"]) for c in index["chunks"]}
        splits[split] = {"tokens": tokens, "bytes": 4 * tokens, "documents": items, "chunks": chunks}
    meta = {"format": FORMAT, "dtype": "uint16", "splits": splits,
            "tokenizer": {"name": "generated", "sha256": "0" * 64, "vocab_size": 50_000, "eod_id": 0}}  # fmt: skip
    (root / META).write_text(json.dumps(meta))
    return root


def _anonymous_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1])
    return 0


def _process_tree_anonymous_mib() -> tuple[float, float]:
    import psutil

    me = psutil.Process()
    children = [c.pid for c in me.children(recursive=True)]
    return _anonymous_kib(me.pid) / 1024, sum(_anonymous_kib(p) for p in children) / 1024


def read_corpus(corpus: str, seq_len: int, batch_size: int, workers: int, batches: int) -> dict:
    """In a fresh process: the train loader of `mhc fit` over ``corpus``; memory and tokens/s."""
    import torch

    from mhc_lightning.data import ByteTextDataModule

    torch.set_num_threads(1)
    base = _process_tree_anonymous_mib()[0]
    dm = ByteTextDataModule(corpus=corpus, seq_len=seq_len, batch_size=batch_size, num_workers=workers, seed=1)
    dm.setup("fit")
    it = iter(dm.train_dataloader())
    for _ in range(20):  # warm: workers started, first chunks mapped
        next(it)
    t0, n = time.perf_counter(), 0
    for _ in range(batches):
        x, _ = next(it)
        n += x.numel()
    seconds = time.perf_counter() - t0
    main_mib, workers_mib = _process_tree_anonymous_mib()
    return {"tokens_per_s": n / seconds, "anon_mib_start": base, "anon_mib": main_mib, "workers_anon_mib": workers_mib}


def _in_child(corpus: str, seq_len: int, batch_size: int, workers: int, batches: int) -> dict:
    code = (
        "import json, sys; from bench.data import read_corpus; "
        f"print(json.dumps(read_corpus({corpus!r}, {seq_len}, {batch_size}, {workers}, {batches})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1])  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def text_jsonl(path: Path, mb: float) -> int:
    """About ``mb`` MB of real English (the built-in corpus's works, in 2 kB documents, repeated with a numbered first
    line so that every document is new) as JSON Lines; its UTF-8 bytes."""
    from mhc_lightning.data.corpus import fetch_shakespeare, read_shakespeare_works

    works = [text for _, text in read_shakespeare_works(fetch_shakespeare())]
    pieces = [w[i : i + 2000] for w in works for i in range(0, len(w), 2000)]
    docs, size = [], 0
    while size < mb * 1e6:
        text = f"{len(docs)}\n{pieces[len(docs) % len(pieces)]}"
        docs.append(json.dumps({"text": text}) + "\n")
        size += len(text.encode())
    path.write_text("".join(docs))
    return size


def prepare_rate(root: Path, text_mb: float, workers: int, vocab: int) -> dict:
    """`mhc prepare` phases timed in this process: the scan, BPE training (once), and tokenizing."""
    from mhc_lightning.data import prepare as p

    root.mkdir(parents=True, exist_ok=True)
    src = root / "src.jsonl"
    text_bytes = text_jsonl(src, text_mb) if not src.exists() else int(json.loads((root / "size").read_text()))
    (root / "size").write_text(str(text_bytes))
    tok = root / "tokenizer.json"
    if not tok.exists():
        from mhc_lightning.data.tokenizers import train_bpe

        train_bpe((json.loads(line)["text"] for line in src.open()), vocab, tok)
    out = root / f"out{workers}"
    shutil.rmtree(out, ignore_errors=True)
    args = p.build_parser().parse_args([str(src), "--out", str(out), "--tokenizer", str(tok),
                                        "--workers", str(workers), "--val-fraction", "0.01"])  # fmt: skip
    files = p.source_files(args.sources)
    units = [u for f in files for u in p.units_of(f)]
    t0 = time.perf_counter()
    p.scan(units, files, args)
    t_scan = time.perf_counter() - t0
    t0 = time.perf_counter()
    p.prepare(args)
    t_all = time.perf_counter() - t0
    tokenize = t_all - t_scan  # prepare() scans again: the rest is tokenizing, writing and digesting
    encode = _encode_rate(src, tok)
    return {"workers": workers, "text_mb": text_bytes / 1e6, "units": len(units), "scan_s": t_scan,
            "encode_only_mb_per_s": encode,
            "tokenize_s": tokenize, "mb_per_s": text_bytes / 1e6 / tokenize,
            "mb_per_s_per_worker": text_bytes / 1e6 / tokenize / workers}  # fmt: skip


def _encode_rate(src: Path, tokenizer: Path, docs: int = 4000) -> float:
    """MB/s of the tokenizer's own batch encode on one thread (TOKENIZERS_PARALLELISM=false), nothing else."""
    from tokenizers import Tokenizer

    texts = [json.loads(line)["text"] for _, line in zip(range(docs), src.open())]
    tok = Tokenizer.from_file(str(tokenizer))
    t0 = time.perf_counter()
    tok.encode_batch_fast(texts, add_special_tokens=False)
    return sum(len(t.encode()) for t in texts) / 1e6 / (time.perf_counter() - t0)


def main(argv=None) -> int:
    ap = harness.parser("data", __doc__)
    ap.add_argument("--sizes", default="1,8", help="GiB of prepared tokens, comma-separated")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--text-mb", type=float, default=100)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--workdir", help="where the corpora go (default: a temporary folder, removed after)")
    ap.add_argument("--skip", default="", help="comma-separated: memory, prepare")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-data-"))
    report = harness.Report("data", args, argv or sys.argv[2:], "cpu")
    rows = report.rows
    try:
        if "memory" not in args.skip:
            for gib in (float(s) for s in args.sizes.split(",")):
                corpus = work / f"tokens-{gib:g}gib"
                if not (corpus / "mhc_data.json").exists():
                    make_corpus(corpus, gib, workers=min(2, mp.cpu_count()))
                for workers in (0, 2):
                    r = _in_child(str(corpus), args.seq_len, args.batch_size, workers, args.batches)
                    report.add({"measure": "loader", "corpus_gib": gib, "workers": workers, **r})
        if "prepare" not in args.skip:
            for workers in (1, 2):
                report.add({"measure": "prepare", **prepare_rate(work / "text", args.text_mb, workers, args.vocab)})
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    loader = [r for r in rows if r["measure"] == "loader"]
    if loader:
        harness.print_table(loader, [("corpus_gib", "corpus GiB", "g"), ("workers", "workers", "d"),
                                     ("tokens_per_s", "tokens/s", ".3g"), ("anon_mib", "anon MiB", ".0f"),
                                     ("workers_anon_mib", "workers' anon MiB", ".0f")])  # fmt: skip
    prep = [r for r in rows if r["measure"] == "prepare"]
    if prep:
        columns = [("workers", "workers", "d"), ("text_mb", "text MB", ".1f"), ("scan_s", "scan s", ".1f"),
                   ("tokenize_s", "tokenize s", ".1f"), ("mb_per_s", "MB/s", ".2f"),
                   ("mb_per_s_per_worker", "MB/s per worker", ".2f"),
                   ("encode_only_mb_per_s", "encode alone MB/s (1 core)", ".2f")]  # fmt: skip
        harness.print_table(prep, columns)
    print(f"wrote {report.save()}")
    return 0
