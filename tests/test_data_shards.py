"""Prepared token shards read for `mhc fit`: the datamodule's checks (digests, tokenizer, lengths), a resumed fit that
sees the uninterrupted batches, every window once across two gloo ranks, the same windows from a local S3-compatible
server, and README's three commands end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import make_text
from lightning.pytorch.callbacks import ModelCheckpoint

from mhc_lightning.data import ByteTextDataModule
from mhc_lightning.data.prepare import META
from mhc_lightning.data.shards import windows
from mhc_lightning.errors import UserError


@pytest.fixture
def shards(prepared_shards) -> Path:
    return prepared_shards[0]  # conftest.py: shared by the test run; read-only


def test_the_datamodule_takes_vocabulary_and_units_from_the_metadata(shards):
    meta = json.loads((shards / META).read_text())
    dm = ByteTextDataModule(corpus=str(shards), seq_len=32, batch_size=4, seed=1)
    dm.check_corpus()
    dm.setup("fit")
    val = meta["splits"]["val"]
    assert dm.vocab_size == 257 and dm.bytes_per_token == pytest.approx(val["bytes"] / val["tokens"])
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    assert len(dm.train_sha256) == 64 and dm.train_sha256 != dm.val_sha256
    with pytest.raises(UserError, match=r"data.tokenizer is 'other.json', but .* was prepared with tokenizer bytes"):
        ByteTextDataModule(corpus=str(shards), tokenizer="other.json")
    ByteTextDataModule(corpus=str(shards), tokenizer="bytes")  # the name or the sha256 are both accepted
    with pytest.raises(UserError, match=r"the val split .* has \d+ tokens, but data.seq_len=100000"):
        ByteTextDataModule(corpus=str(shards), seq_len=100_000, batch_size=1).check_corpus()


def test_a_shard_changed_after_prepare_is_refused_naming_both_digests(shards, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    chunk = next((copy / "train").glob("chunk-*.bin"))
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"shard train/{chunk.name} has sha256 [0-9a-f]{{64}}, its metadata says"):
        ByteTextDataModule(corpus=str(copy)).check_corpus()


def _module(seed: int = 0):
    from mhc_lightning.model import GPTConfig, HyperConfig
    from mhc_lightning.training.module import LitLM, OptimConfig

    L.seed_everything(seed, verbose=False)
    arch = GPTConfig(vocab_size=257, n_layers=1, d_model=32, n_heads=2, context=32, hyper=HyperConfig())
    return LitLM(arch=arch, optim=OptimConfig(lr=3e-3, warmup_steps=2), diagnostics_every=0)


class Batches(L.Callback):
    def __init__(self):
        self.seen = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen[trainer.global_step] = batch[0].clone()


def _fit(shards: Path, dirpath: Path, steps: int, ckpt_path=None):
    rec = Batches()
    dm = ByteTextDataModule(corpus=str(shards), seq_len=32, batch_size=8, seed=5)
    trainer = L.Trainer(
        max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=2,
        val_check_interval=10, num_sanity_val_steps=0, accelerator="cpu", devices=1,
        callbacks=[rec, ModelCheckpoint(dirpath=dirpath, every_n_train_steps=7, save_top_k=-1)],
    )  # fmt: skip
    module = _module()
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return rec.seen, module, trainer


@pytest.mark.slow
def test_a_fit_resumed_mid_epoch_sees_the_batches_of_an_uninterrupted_one(shards, tmp_path):
    straight, module, trainer = _fit(shards, tmp_path / "a", steps=40)
    assert trainer.num_training_batches > 40  # the checkpoint at step 14 is mid-epoch
    resumed, module_b, _ = _fit(
        shards, tmp_path / "b", steps=40, ckpt_path=str(next((tmp_path / "a").glob("*step=14*")))
    )
    assert sorted(resumed) == list(range(14, 40))
    assert all(torch.equal(straight[s], resumed[s]) for s in resumed)
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), module_b.state_dict().values()))
    m, bpt = trainer.callback_metrics, trainer.datamodule.bytes_per_token
    assert bpt < 1 and float(m["val/bpb"]) == pytest.approx(float(m["val/loss"]) / 0.6931472 / bpt)  # EOD: no bytes


def _rank_windows(rank: int, world: int, shards: str, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    seen = [w.tobytes().hex() for w in windows(shards, "train", 32, True, 3)]
    Path(out, f"rank{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_see_every_window_exactly_once(shards, tmp_path):
    """One epoch of the train split over two gloo processes, as DDP reads it."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_windows, args=(2, str(shards), port, str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    every = [w.tobytes().hex() for w in windows(str(shards), "train", 32, False, 3)]
    assert len(set(every)) == len(every)  # windows are told apart by their tokens
    # equal shares (DDP steps together), none twice; only the remainder below the world size is left out
    assert len(ranks[0]) == len(ranks[1]) and not set(ranks[0]) & set(ranks[1])
    assert set(ranks[0] + ranks[1]) <= set(every) and len(every) - 2 * len(ranks[0]) < 2


@pytest.mark.slow
def test_shards_stream_from_a_local_s3_compatible_server(shards, tmp_path, monkeypatch):
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="corpora")
        for f in shards.rglob("*"):
            if f.is_file():
                s3.upload_file(str(f), "corpora", f"tok/{f.relative_to(shards)}")
        dm = ByteTextDataModule(corpus="s3://corpora/tok", seq_len=32, batch_size=4, cache_dir=str(tmp_path / "c"))
        dm.check_corpus()
        assert dm.vocab_size == 257
        remote = [w.tobytes() for w in windows("s3://corpora/tok", "val", 32, False, 0, str(tmp_path / "c"))]
        assert remote == [w.tobytes() for w in windows(str(shards), "val", 32, False, 0)]
        assert list((tmp_path / "c" / "streams").rglob("chunk-*.bin"))  # read through the local cache
        with pytest.raises(UserError, match=r"cannot download s3://corpora/nothing/mhc_data.json"):
            ByteTextDataModule(corpus="s3://corpora/nothing", cache_dir=str(tmp_path / "c"))
    finally:
        server.stop()


@pytest.mark.slow
def test_readme_three_commands_train_on_tokens(tmp_path, mlflow_uri):
    """`mhc prepare` with a BPE trained on the corpus, then `mhc fit` of the quickstart on its tokens: the run logs
    nats per token and bits per byte, and its tags name the tokenizer."""
    import mlflow

    src = tmp_path / "texts"
    src.mkdir()
    for i in range(12):
        (src / f"doc{i:02}.txt").write_text(make_text(6_000, seed=i))
    mhc = [sys.executable, "-m", "mhc_lightning.commands"]
    prep = subprocess.run(
        [*mhc, "prepare", str(src), "--out", str(tmp_path / "tok"), "--train-tokenizer", "512",
         "--val-fraction", "0.25", "--workers", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert prep.returncode == 0, prep.stderr[-2000:]
    fit = subprocess.run(
        [*mhc, "fit", "-c", "conf/quickstart.yaml", f"--data.corpus={tmp_path / 'tok'}", "--trainer.max_steps=6",
         "--trainer.val_check_interval=6", "--trainer.limit_val_batches=2", "--data.batch_size=4",
         "--model.diagnostics_every=0", "--trainer.enable_progress_bar=false",
         f"--trainer.default_root_dir={tmp_path / 'runs'}"],
        capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1],
        env={**os.environ, "MLFLOW_TRACKING_URI": mlflow_uri},
    )  # fmt: skip
    assert fit.returncode == 0, fit.stderr[-3000:]
    client = mlflow.MlflowClient(mlflow_uri)
    (run,) = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    meta = json.loads((tmp_path / "tok" / META).read_text())
    assert run.data.tags["mhc.data.tokenizer"] == "tokenizer.json"
    assert run.data.tags["mhc.data.tokenizer_sha256"] == meta["tokenizer"]["sha256"]
    bpt = meta["splits"]["val"]["bytes"] / meta["splits"]["val"]["tokens"]
    assert run.data.metrics["val/bpb"] == pytest.approx(run.data.metrics["val/loss"] / 0.693147 / bpt, rel=1e-4)
    assert run.data.params["model.arch.vocab_size"] == str(meta["tokenizer"]["vocab_size"])
