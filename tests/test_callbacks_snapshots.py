"""GradientSnapshots: rollback after a loss spike, validation of snapshots, rollback cap, exact resume."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from helpers import CorruptBatchAt, StepRecorder, fast_first, make_text, params_finite, tiny_fit
from lightning.pytorch.callbacks import ModelCheckpoint

from mhc_lightning.callbacks import GradientSnapshots, InstabilityDetector, RollbackError, SinkhornScheduler, channel_of
from mhc_lightning.callbacks.divergence import TrainingDiverged


def _detector(**kw) -> InstabilityDetector:
    # A short window: the tiny model's loss is still falling fast, which widens a long window's MAD.
    return InstabilityDetector(loss_window=30, loss_min_history=10, **kw)


def _kinds(module) -> list[tuple[int, str, float]]:
    return [(e.step, e.kind, e.value) for e in channel_of(module).events]


class WeightsAt(L.Callback):
    """Copies of the weights at the start of the given steps."""

    def __init__(self, *steps: int):
        self.steps, self.weights = set(steps), {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            self.weights[trainer.global_step] = {k: v.clone() for k, v in pl_module.model.state_dict().items()}


class Watch(L.Callback):
    """lr_scale and Sinkhorn iterations as seen by each step."""

    def __init__(self):
        self.lr_scale, self.iters = {}, {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lr_scale[trainer.global_step] = pl_module.lr_scale
        self.iters[trainer.global_step] = [l.sinkhorn_iters for l in pl_module.model.sublayers]


def test_loss_spike_rolls_back_skips_window_and_cools_down(tiny_corpus):
    rec, weights, watch = StepRecorder(), WeightsAt(40, 46), Watch()
    snaps = GradientSnapshots(every_n_steps=10, skip_batches=2, cooldown_steps=5, cooldown_sinkhorn_iters=30)
    sched = SinkhornScheduler(every=5, max_iters=40)
    trainer, module = tiny_fit(
        tiny_corpus, [CorruptBatchAt(45), _detector(), snaps, sched, rec, weights, watch], steps=60
    )
    kinds = _kinds(module)
    assert [(s, k) for s, k, _ in kinds] == [(45, "loss_spike"), (45, "rollback")]
    assert kinds[1][2] == 40.0  # restored the newest snapshot, taken before step 40
    rollback = channel_of(module).events[1]
    assert "data window epoch 0 batch 40 -> epoch 0 batch 45 (steps 40..45) not replayed" in rollback.detail
    assert "probe grad norm" in rollback.detail and "next 2 batches skipped" in rollback.detail
    # the weights after the rollback are exactly those of the snapshot
    assert all(torch.equal(weights.weights[40][k], weights.weights[46][k]) for k in weights.weights[40])
    # the two following batches were skipped, then training went on with new data
    assert rec.loss[46] is None and rec.loss[47] is None and rec.loss[48] is not None
    assert rec.first_tokens[48] != rec.first_tokens[40]
    # cool-down: half LR and >= 30 Sinkhorn iterations for 5 steps, then back to normal
    assert [watch.lr_scale.get(s) for s in (44, 48, 50, 51)] == [1.0, 0.5, 0.5, 1.0]
    assert min(watch.iters[48]) >= 30 and max(watch.iters[48]) <= 40
    assert trainer.global_step == 60 and params_finite(module) and math.isfinite(rec.final_loss())
    assert rec.final_loss() < 3.5


def test_corrupted_snapshot_on_disk_is_refused_and_previous_used(tiny_corpus, tmp_path):
    snap_dir = tmp_path / "snaps"

    class CorruptNewestFile(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 33:
                f = snap_dir / "snapshot-step00000030.pt"
                data = bytearray(f.read_bytes())
                data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)  # silent corruption: same size
                f.write_bytes(bytes(data))

    snaps = GradientSnapshots(every_n_steps=10, keep=0, dirpath=str(snap_dir), keep_on_disk=3, cooldown_steps=0)
    rec = StepRecorder()
    trainer, module = tiny_fit(
        tiny_corpus, [CorruptBatchAt(35), _detector(), snaps, CorruptNewestFile(), rec], steps=45
    )
    kinds = _kinds(module)
    assert [(s, k) for s, k, _ in kinds] == [(35, "loss_spike"), (35, "rollback_rejected"), (35, "rollback")]
    assert kinds[1][2] == 30.0 and "checksum mismatch" in channel_of(module).events[1].detail
    assert kinds[2][2] == 20.0 and "from disk" in channel_of(module).events[2].detail
    assert sorted(p.name for p in snap_dir.glob("*.pt")) == [f"snapshot-step000000{s}.pt" for s in (20, 30, 40)]
    assert trainer.global_step == 45 and params_finite(module) and math.isfinite(rec.final_loss())


def test_in_memory_snapshot_validation_and_gradient_check(tiny_corpus):
    """Newest snapshot has tampered weights (checksum), the next one a wrong probe norm (gradient check)."""

    class Tamper(L.Callback):
        def __init__(self, snaps):
            self.snaps = snaps

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 33:
                s10, s20, s30 = list(self.snaps.ring)
                next(iter(s30.state["model"].values())).add_(1.0)  # bit rot in memory
                s20.probe_grad_norm *= 1.5  # state that no longer reproduces its recorded gradient

    snaps = GradientSnapshots(every_n_steps=10, keep=3, cooldown_steps=0)
    _, module = tiny_fit(tiny_corpus, [CorruptBatchAt(35), _detector(), snaps, Tamper(snaps)], steps=40)
    events = channel_of(module).events
    assert [(e.kind, e.value) for e in events[1:]] == [
        ("rollback_rejected", 30.0),
        ("rollback_rejected", 20.0),
        ("rollback", 10.0),
    ]
    assert "in-memory checksum mismatch" in events[1].detail
    assert "gradient consistency check failed" in events[2].detail
    assert params_finite(module)


def test_snapshot_writes_into_the_evicted_snapshots_buffers(tiny_corpus):
    """A full ring lends its oldest snapshot's tensors to the next one (no new GB per snapshot); contents exact."""
    snaps, weights = GradientSnapshots(every_n_steps=5, keep=2), WeightsAt(0, 5, 10, 15)

    class Newest(L.Callback):
        def __init__(self):
            self.ptrs, self.model = {}, {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            newest = snaps.ring[-1]
            self.ptrs[newest.step] = [t.data_ptr() for t in newest.state["model"].values()]
            self.model[newest.step] = {k: v.clone() for k, v in newest.state["model"].items()}
            self.ring = [s.step for s in snaps.ring]

    newest = Newest()
    tiny_fit(tiny_corpus, [snaps, weights, newest], steps=17)
    assert sorted(newest.ptrs) == [0, 5, 10, 15]
    assert newest.ptrs[10] == newest.ptrs[0] and newest.ptrs[15] == newest.ptrs[5] != newest.ptrs[0]
    for step in (0, 5, 10, 15):
        assert all(torch.equal(newest.model[step][k], weights.weights[step][k].cpu()) for k in newest.model[step])
    assert newest.ring == [10, 15]


def test_rollback_cap_stops_with_clear_error(tiny_corpus):
    snaps = GradientSnapshots(every_n_steps=10, max_rollbacks=1, rollback_window=100, cooldown_steps=0)
    with pytest.raises(
        RollbackError,
        match=r"1 rollback\(s\) already happened within the last 100 steps "
        r"\(max_rollbacks=1, at steps \[35\]\)",
    ) as stopped:
        tiny_fit(tiny_corpus, [CorruptBatchAt(35, 38), _detector(), snaps], steps=45)
    assert isinstance(stopped.value, TrainingDiverged) and stopped.value.step == 38  # `mhc fit` ends it as diverged


@pytest.mark.slow
def test_resume_mid_epoch_equals_uninterrupted(tmp_path, monkeypatch):
    """In-process: a checkpoint in epoch 1 resumed with a fresh Trainer ends bitwise equal to the straight run, with the
    stability callbacks' state restored and no Lightning "dataloader is not resumable" warning.

    The corpus is small (22 batches per epoch), so the run crosses an epoch and the checkpoint is mid-epoch. The
    datamodule's train loader is stateful (Lightning saves its position); with a plain DataLoader in its place the
    resumed epoch restarts from the permutation's beginning and the runs differ.
    """
    import warnings

    from torch.utils.data import DataLoader

    from mhc_lightning.data import ByteTextDataModule

    corpus = tmp_path / "small.txt"
    corpus.write_text(make_text(3_000, seed=3))

    def run(tag: str, ckpt_path=None):
        ckpt = ModelCheckpoint(dirpath=tmp_path / tag, every_n_train_steps=25, save_top_k=-1)
        cbs = [InstabilityDetector(), GradientSnapshots(every_n_steps=10), SinkhornScheduler(every=5), ckpt]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer, module = tiny_fit(corpus, cbs, steps=30, enable_checkpointing=True, ckpt_path=ckpt_path)
        assert trainer.num_training_batches == 22  # so step 25 is in epoch 1 (the checkpoint name says so)
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)  # pass them on (pytest.warns below)
        return module.model.state_dict(), trainer, [w for w in caught if "not resumable" in str(w.message)]

    straight, _, _ = run("a")
    resumed, trainer, not_resumable = run("b", ckpt_path=str(tmp_path / "a" / "epoch=1-step=25.ckpt"))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight) and not not_resumable
    sched = next(cb for cb in trainer.callbacks if isinstance(cb, SinkhornScheduler))
    assert [l.sinkhorn_iters for l in trainer.lightning_module.model.sublayers] == sched.iters

    plain_loader = ByteTextDataModule._loader
    monkeypatch.setattr(
        ByteTextDataModule,
        "_loader",
        lambda self, dataset, loader=DataLoader, **kw: plain_loader(self, dataset, DataLoader, **kw),
    )
    with pytest.warns(UserWarning, match="not resumable"):
        run("c")
        plain, _, _ = run("d", ckpt_path=str(tmp_path / "c" / "epoch=1-step=25.ckpt"))
    assert not all(torch.equal(straight[k], plain[k]) for k in straight)


@fast_first(
    "kwargs, match",
    [
        ({"keep": 0}, r"GradientSnapshots.keep is 0 and GradientSnapshots.dirpath is null"),
        ({"device": "gpu"}, r"GradientSnapshots.device must be one of \['cpu', 'same'\]"),
        ({"cooldown_lr_factor": 2.0}, r"GradientSnapshots.cooldown_lr_factor must be a number > 0 and <= 1"),
        ({"every_n_steps": 0}, r"GradientSnapshots.every_n_steps must be an integer >= 1"),
    ],
)
def test_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradientSnapshots(**kwargs)
