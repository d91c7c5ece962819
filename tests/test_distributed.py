"""DDP on CPU (gloo, 2 processes) through the real `mhc` command and Lightning's subprocess launcher.

Each DDP run re-executes `mhc fit ...` once for rank 1 (Lightning's `ddp` launcher), exactly as on GPUs; nothing is
spawned from inside pytest. Probe callbacks below are loaded by the `mhc` processes from this file (PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import mlflow
import pytest
import torch
from helpers import CONF, REPO, fast_first, tiny_fit_args

MHC = Path(sys.executable).with_name("mhc")
TIMEOUT = 240


# ---- callbacks loaded inside the `mhc` processes -------------------------------------------------
class StepProbe(L.Callback):
    """Per rank: the global-batch loss of every step (mean of the ranks' losses), the local one, the first
    window of each batch, the diagnostics each rank holds, and final weight digests -> <dirpath>/probe-rank<r>.json.
    Rank 0 also saves the final weights (probe-weights.pt)."""

    def __init__(self, dirpath: str):
        self.dirpath = Path(dirpath)
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from mhc_lightning.training.distributed import mean_across_ranks

        loss = outputs["loss"].detach() if isinstance(outputs, dict) and outputs.get("loss") is not None else None
        local = float("nan") if loss is None else float(loss)
        skipped = loss is None or (hasattr(pl_module, "last_loss") and pl_module.last_loss is None)
        self.steps.append(
            {
                "step": trainer.global_step - 1,
                "local": local,
                "skipped": skipped,
                "global": float(mean_across_ranks(local)),
                "first": batch[0][:, :4].tolist(),
            }
        )

    def on_train_end(self, trainer, pl_module) -> None:
        from mhc_lightning.training.distributed import state_digests

        self.dirpath.mkdir(parents=True, exist_ok=True)
        r = trainer.global_rank
        record = {
            "rank": r,
            "world_size": trainer.world_size,
            "steps": self.steps,
            "diagnostics": getattr(pl_module, "last_diagnostics", None),
            "per_layer": pl_module.last_per_layer,
            **state_digests(trainer, pl_module),
        }
        (self.dirpath / f"probe-rank{r}.json").write_text(json.dumps(record))
        if r == 0:
            torch.save(
                {k: v.detach().cpu() for k, v in pl_module.model.state_dict().items()},
                self.dirpath / "probe-weights.pt",
            )


class CorruptBatchOnRanks(L.Callback):
    """Fault: at the given optimizer steps the targets of the batch on `ranks` become byte 0 (absent from the
    text), i.e. a loss spike on those ranks only — a bad data shard, the case a rollback must coordinate."""

    def __init__(self, steps: list[int], ranks: list[int]):
        self.steps, self.ranks = set(steps), set(ranks)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step in self.steps and trainer.global_rank in self.ranks:
            batch[1].zero_()


class CheckpointProbe(L.Callback):
    """On one GPU under FSDP: the loss of every step, how many sublayers an activation-checkpoint wrapper holds and
    how often each branch ran per training step (twice where a checkpoint recomputed it; validation not counted)
    -> <dirpath>/checkpoint-probe.json."""

    def __init__(self, dirpath: str):
        self.dirpath, self.losses, self.calls = Path(dirpath), [], 0

    def on_train_start(self, trainer, pl_module) -> None:
        from mhc_lightning.model import hyper_connections

        self.sublayers = hyper_connections(pl_module.model)
        for hc in self.sublayers:
            hc.branch.register_forward_hook(lambda *_: setattr(self, "calls", self.calls + torch.is_grad_enabled()))
        self.wrapped = sum(type(m).__name__ == "CheckpointWrapper" for m in pl_module.model.modules())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(
            float(outputs["loss"]) if isinstance(outputs, dict) and outputs.get("loss") is not None else float("nan")
        )

    def on_train_end(self, trainer, pl_module) -> None:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        record = {
            "losses": self.losses,
            "wrapped": self.wrapped,
            "sublayers": len(self.sublayers),
            "branch_calls_per_step": self.calls / len(self.losses),
        }
        (self.dirpath / "checkpoint-probe.json").write_text(json.dumps(record))


# ---- helpers -------------------------------------------------------------------------------------
def _callback_arg(cls: str, **init_args) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": cls, "init_args": init_args})


def _start(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
        MLFLOW_ENABLE_ASYNC_LOGGING="false",
    )
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.Popen([str(MHC), *args], cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, log: Path) -> str:
    try:
        rc = proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"`mhc fit` timed out; log tail:\n{log.read_text()[-4000:]}") from None
    out = log.read_text()
    assert rc == 0, f"`mhc fit` exited {rc}; log tail:\n{out[-4000:]}"
    return out


def _ddp_args() -> list[str]:
    return ["-c", str(CONF / "machine" / "ddp-cpu.yaml")]


def _probes(d: Path) -> list[dict]:
    return [json.loads((d / f"probe-rank{r}.json").read_text()) for r in range(2)]


def _run(client, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


# ---- tests ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ddp_matches_single_process_and_writes_one_mlflow_run(tiny_corpus, mlflow_uri, tmp_path):
    """Same global batch (1 x 8 vs 2 x 4, corpus order): same losses step by step, same validation loss,
    one MLflow run for the DDP fit, identical weights and diagnostics on both ranks."""
    from mhc_lightning.fit.cli import main

    steps = 4
    runs = {}
    for name, per_rank, extra in (("ddp", 4, _ddp_args()), ("single", 8, [])):
        args = tiny_fit_args(
            tiny_corpus, mlflow_uri, tmp_path / name, mode="mhc", steps=steps, experiment=name, run_name=name
        )
        args = [a for a in args if not a.startswith("--data.batch_size")]
        args += [
            f"--data.batch_size={per_rank}",
            "--data.shuffle=false",
            *extra,
            _callback_arg("test_distributed.StepProbe", dirpath=str(tmp_path / name / "probe")),
        ]
        if name == "single":  # in this process, while DDP's two processes start: one process's start-up less
            main(args)
        else:
            log = tmp_path / f"{name}.log"
            runs[name] = (_start(args, tmp_path, log), log)
    out = {name: _wait(proc, log) for name, (proc, log) in runs.items()}

    single = json.loads((tmp_path / "single" / "probe" / "probe-rank0.json").read_text())
    ddp = _probes(tmp_path / "ddp" / "probe")
    assert [p["world_size"] for p in ddp] == [2, 2]
    # the global batch is the same windows: rank r holds rows r, r+2, ... of the single-process batch
    for s_step, r0, r1 in zip(single["steps"], ddp[0]["steps"], ddp[1]["steps"]):
        assert s_step["first"][0::2] == r0["first"] and s_step["first"][1::2] == r1["first"]
    s_loss = torch.tensor([s["global"] for s in single["steps"]], dtype=torch.float64)
    d_loss = torch.tensor([s["global"] for s in ddp[0]["steps"]], dtype=torch.float64)
    assert len(s_loss) == len(d_loss) == steps
    torch.testing.assert_close(d_loss, s_loss, rtol=1e-4, atol=0)
    assert s_loss[-1] < s_loss[0]  # it trained
    # after 4 identical updates the weights agree with the single-process ones (float reduction order aside)
    w_single = torch.load(tmp_path / "single" / "probe" / "probe-weights.pt")
    w_ddp = torch.load(tmp_path / "ddp" / "probe" / "probe-weights.pt")
    for k in w_single:
        torch.testing.assert_close(w_ddp[k], w_single[k], rtol=1e-4, atol=1e-5)
    # every rank: bitwise equal weights and optimizer state; the same (reduced) mHC diagnostics
    assert ddp[0]["model"] == ddp[1]["model"] and ddp[0]["optimizer"] == ddp[1]["optimizer"]
    assert ddp[0]["per_layer"] and ddp[0]["per_layer"] == ddp[1]["per_layer"]
    if ddp[0]["diagnostics"] is not None:
        assert ddp[0]["diagnostics"] == ddp[1]["diagnostics"]

    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    ddp_runs, single_runs = _run(client, "ddp"), _run(client, "single")
    assert len(ddp_runs) == 1 and len(single_runs) == 1, "one MLflow run per fit, not one per rank"
    assert len(client.search_experiments()) == 3  # Default + single + ddp: rank 1 created nothing
    run = ddp_runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "ddp"
    assert out["ddp"].count(f"MLflow run {run.info.run_id}") == 1  # announced once, by rank 0
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(steps))  # once per step, not once per rank
    # train/loss is logged from rank 0: its share of the global batch
    torch.testing.assert_close(
        torch.tensor([m.value for m in sorted(history, key=lambda m: m.step)]),
        torch.tensor([s["local"] for s in ddp[0]["steps"]]),
        rtol=1e-6,
        atol=0,
    )
    m = run.data.metrics
    assert {"amax/composite_fwd_max", "sinkhorn/col_residual_max", "val/loss", "train/grad_norm"} <= m.keys()
    amax_steps = [
        sorted(m.step for m in client.get_metric_history(r.info.run_id, "amax/composite_fwd_max"))
        for r in (run, single_runs[0])
    ]
    assert amax_steps[0] and amax_steps[0] == amax_steps[1]  # diagnostics at the same steps as one process
    # validation metrics are reduced over ranks (torchmetrics): the 2 x 2 x 4 windows are the single run's 2 x 8
    torch.testing.assert_close(
        torch.tensor(m["val/loss"]), torch.tensor(single_runs[0].data.metrics["val/loss"]), rtol=1e-4, atol=0
    )
    arts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "config.yaml" in arts


def _stability_available() -> bool:
    try:
        from mhc_lightning.callbacks import GradientSnapshots, InstabilityDetector  # noqa: F401
    except ImportError:
        return False
    return True


def _rollback_fit(
    tiny_corpus, mlflow_uri, tmp_path: Path, name: str, fault_ranks: list[int], skip_batches: int = 0
) -> list[dict]:
    """60 steps of DDP with the stability callbacks, a loss spike injected at step 55 on `fault_ranks`; checks that
    the spike was rolled back and that every rank held the same state after every step (RankConsistencyCheck);
    returns each rank's probe record."""
    args = tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / name, mode="mhc", steps=60, experiment=name, run_name=name)
    args += [
        *_ddp_args(),
        "--trainer.val_check_interval=60",
        "--model.diagnostics_every=10",
        "--trainer.log_every_n_steps=10",
        # short windows: the tiny model's loss still falls fast (as in tests/test_callbacks_snapshots.py)
        _callback_arg("mhc_lightning.callbacks.InstabilityDetector", loss_window=20, loss_min_history=10),
        _callback_arg(
            "mhc_lightning.callbacks.GradientSnapshots", every_n_steps=10, skip_batches=skip_batches, cooldown_steps=3
        ),
        _callback_arg("test_distributed.CorruptBatchOnRanks", steps=[55], ranks=fault_ranks),
        _callback_arg(
            "mhc_lightning.callbacks.RankConsistencyCheck",
            every_n_steps=1,
            on_mismatch="warn",
            dirpath=str(tmp_path / name / "consistency"),
        ),
        _callback_arg("test_distributed.StepProbe", dirpath=str(tmp_path / name / "probe")),
    ]
    log = tmp_path / f"{name}.log"
    _wait(_start(args, tmp_path, log), log)
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    runs = _run(client, name)
    assert len(runs) == 1
    rollbacks = client.get_metric_history(runs[0].info.run_id, "stability/rollback_to_step")
    assert [m.value for m in rollbacks] == [50.0], "the spike at step 55 was rolled back to the step-50 snapshot"
    records = [json.loads((tmp_path / name / "consistency" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["checks"] for r in records] == [61, 61]  # after each of the 60 steps, and at the end
    assert [r["mismatch_steps"] for r in records] == [[], []], "ranks diverged after these steps"
    return _probes(tmp_path / name / "probe")


@pytest.mark.skipif(not _stability_available(), reason="stability callbacks (mhc_lightning.callbacks) not present")
@pytest.mark.slow
def test_rollback_under_ddp_fault_on_one_rank_keeps_ranks_equal_and_skips_the_same_batches(
    tiny_corpus, mlflow_uri, tmp_path
):
    """The hard case: only rank 0's batch is bad (a corrupt shard). Every rank must take the same decision (veto
    the update, restore the same snapshot, skip the same batch after it), or the weights diverge silently: checked
    after every step. (One run covers both: each DDP fit costs two processes' start-up in CI.)"""
    probes = _rollback_fit(tiny_corpus, mlflow_uri, tmp_path, "rollback-one", fault_ranks=[0], skip_batches=1)
    assert probes[0]["model"] == probes[1]["model"] and probes[0]["optimizer"] == probes[1]["optimizer"]
    assert [len(p["steps"]) for p in probes] == [60, 60]  # both ranks ran every step (no hang)
    skipped = [[s["step"] for s in p["steps"] if s["skipped"]] for p in probes]
    assert skipped[0] == skipped[1] == [56]  # the batch after the rollback, on every rank


# ---- presets -------------------------------------------------------------------------------------
@fast_first("env, nodes", [({}, 1), ({"SLURM_NNODES": "4"}, 4), ({"SLURM_NNODES": "4", "MHC_NUM_NODES": "2"}, 2)])
def test_multinode_preset_reads_the_node_count(env, nodes, monkeypatch, capsys):
    import yaml

    from mhc_lightning.fit.cli import main

    for k in ("SLURM_NNODES", "MHC_NUM_NODES"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "fit",
                "-c",
                str(CONF / "base.yaml"),
                "-c",
                str(CONF / "machine" / "ddp.yaml"),
                "-c",
                str(CONF / "machine" / "multinode.yaml"),
                "--print_config",
            ]
        )
    assert exit_.value.code in (0, None)
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert trainer["num_nodes"] == nodes and trainer["devices"] == "auto"
    assert trainer["strategy"]["class_path"].endswith("DDPStrategy")


def test_fsdp_preset_builds_its_wrap_policy():
    """FSDP needs GPUs in Lightning; on CPU check that the preset instantiates the intended strategy."""
    from typing import Union

    import yaml
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import FSDPStrategy, Strategy

    from mhc_lightning.model.layers import Attention, SwiGLU

    cfg = yaml.safe_load((CONF / "machine" / "fsdp.yaml").read_text())["trainer"]
    assert cfg["gradient_clip_val"] is None  # off in this preset, as in the runs made with it
    parser = ArgumentParser()
    parser.add_argument("--strategy", type=Union[str, Strategy])
    strategy = parser.instantiate(parser.parse_args(["--strategy", json.dumps(cfg["strategy"])])).strategy
    assert isinstance(strategy, FSDPStrategy)
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {Attention, SwiGLU}
    assert strategy.kwargs["use_orig_params"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Lightning's FSDPStrategy needs a GPU")
def test_fsdp_activation_checkpointing_policy_on_one_gpu(tiny_corpus, mlflow_uri, tmp_path):
    """FSDPStrategy(activation_checkpointing_policy={HyperConnection}) through `mhc fit` with the fused kernels: the
    sublayers are wrapped, every branch runs again in the backward (the checkpoint is not bypassed by the fused
    chain), and the losses are the unwrapped run's, with and without rebuild_branch_input (docs/distributed.md).
    bf16-mixed, as the preset: FSDP then computes each branch in bf16, the case where the recomputation once saved
    other tensors than the forward and torch's checkpoint stopped the fit."""
    policy = "--trainer.strategy.init_args.activation_checkpointing_policy=[mhc_lightning.model.HyperConnection]"
    variants = {
        "plain": [],
        "checkpointed": [policy],
        "checkpointed_rebuilt": [policy, "--model.arch.hyper.rebuild_branch_input=true"],
    }
    probes = {}
    for name, extra in variants.items():
        args = tiny_fit_args(
            tiny_corpus, mlflow_uri, tmp_path / name, mode="mhc", steps=4, experiment=name, run_name=name
        )
        args += [
            "-c",
            str(CONF / "machine" / "fsdp.yaml"),
            "--trainer.devices=1",
            "--data.shuffle=false",
            "--model.arch.hyper.kernel_backend=triton",
            *extra,
            _callback_arg("test_distributed.CheckpointProbe", dirpath=str(tmp_path / name)),
        ]
        log = tmp_path / f"{name}.log"
        _wait(_start(args, tmp_path, log), log)
        probes[name] = json.loads((tmp_path / name / "checkpoint-probe.json").read_text())
    plain = probes.pop("plain")
    assert plain["wrapped"] == 0 and plain["branch_calls_per_step"] == plain["sublayers"] == 4
    for name, p in probes.items():
        assert p["wrapped"] == 4 and p["branch_calls_per_step"] == 2 * p["sublayers"], (name, p)
        # the same kernels forward; the chain's backward and each sublayer's own may sum in another order (bf16)
        assert p["losses"][0] == pytest.approx(plain["losses"][0], rel=1e-6), (name, p["losses"], plain["losses"])
        assert p["losses"] == pytest.approx(plain["losses"], rel=1e-3), (name, p["losses"], plain["losses"])
