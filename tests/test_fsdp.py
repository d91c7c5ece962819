"""Sharded training on CPU: weight decay by parameter name (whatever shapes a sharding strategy leaves), and FSDP2
through Lightning's ModelParallelStrategy (2 gloo processes) with the global gradient norm and clipping of the
one-process fit. Lightning's FSDPStrategy (FSDP1) refuses a CPU accelerator: it is covered on GPUs."""

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


def old_rule(name: str, p: torch.Tensor) -> bool:
    """The shape rule the name rule replaces, right on whole (unsharded) parameters."""
    return p.ndim == 2 and (".branch." in name or name == "embed.weight")


@fast_first(
    "hyper, tied",
    [
        ({"residual_mode": "residual"}, True),
        ({"residual_mode": "hc"}, True),
        ({"residual_mode": "mhc"}, True),
        ({"residual_mode": "identity"}, True),
        ({"residual_mode": "mhc", "collapse": "head"}, False),
    ],
)
def test_decay_by_name_is_the_shape_rule_on_whole_parameters(hyper, tied):
    from mhc_lightning.model import GPT, GPTConfig, HyperConfig
    from mhc_lightning.training.sharding import decays

    model = GPT(GPTConfig(n_layers=2, d_model=32, n_heads=2, context=16, tied_head=tied, hyper=HyperConfig(**hyper)))
    named = list(model.named_parameters())
    assert [decays(n) for n, _ in named] == [old_rule(n, p) for n, p in named]
    assert any(decays(n) for n, _ in named) and not all(decays(n) for n, _ in named)
    # the names wrappers give the same parameters (FSDP1 with use_orig_params, activation checkpointing)
    assert decays("sublayers.0.branch._fsdp_wrapped_module.qkv.weight")
    assert not decays("sublayers._checkpoint_wrapped_module.0.branch._fsdp_wrapped_module.norm.weight")


def _fsdp1_rank(rank: int, pg_file: str, out: str) -> None:
    """One of 2 gloo ranks: FSDP1 (FULL_SHARD, use_orig_params, as Lightning's FSDPStrategy) over the tiny model, one
    backward of rank-specific data; writes the decay test on the optimizer's view of the shards and LitLM's global
    grad norms."""
    import torch.distributed as dist
    from helpers import tiny_module
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from mhc_lightning.model.layers import Attention, SwiGLU
    from mhc_lightning.training.sharding import clean_name

    dist.init_process_group("gloo", init_method=f"file://{pg_file}", rank=rank, world_size=2)
    try:
        module = tiny_module("mhc", diagnostics_every=0)
        module.model = FullyShardedDataParallel(
            module.model,
            auto_wrap_policy=ModuleWrapPolicy({Attention, SwiGLU}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
        module._shard_group = dist.group.WORLD
        x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(rank))
        module.lm_loss(module.model(x), x.roll(-1, 1)).backward()
        total, per_layer = module.grad_norms()
        decayed = [
            clean_name(n)
            for n, p in module.model.named_parameters()
            if any(p is q for q in module.param_groups()[0]["params"])
        ]
        flat = [clean_name(n) for n, p in module.model.named_parameters() if p.ndim != 2 and ".qkv." in n]
        Path(out).write_text(
            json.dumps(
                {"total": float(total), "per_layer": per_layer.tolist(), "decayed": decayed, "flat_matrices": flat}
            )
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp1_global_grad_norm_and_decay_over_two_ranks(tmp_path):
    """FSDP1 shards as flat 1-D pieces (the shape rule would lose the matrices' decay): the name rule keeps them,
    and the squared shard norms summed over the ranks give the norm of the whole averaged gradient, on every rank."""
    import torch.multiprocessing as mp
    from helpers import tiny_module

    procs = [
        mp.get_context("spawn").Process(
            target=_fsdp1_rank, args=(r, str(tmp_path / "pg"), str(tmp_path / f"rank{r}.json"))
        )
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    # the unsharded model, the same two batches: FSDP averages the ranks' gradients
    module = tiny_module("mhc", diagnostics_every=0)
    for r in (0, 1):
        x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(r))
        (module.lm_loss(module.model(x), x.roll(-1, 1)) / 2).backward()
    total, per_layer = module.grad_norms()
    for rank in ranks:
        assert rank["total"] == pytest.approx(float(total), rel=1e-5)
        torch.testing.assert_close(torch.tensor(rank["per_layer"]), per_layer, rtol=1e-5, atol=1e-7)
    assert ranks[0]["flat_matrices"], "FSDP1 kept the matrices' shapes: the case this guards is not exercised"
    decay_group = module.param_groups()[0]["params"]
    expected = [n for n, p in module.model.named_parameters() if any(p is q for q in decay_group)]
    assert ranks[0]["decayed"] == ranks[1]["decayed"] == expected


class ShardProbe(L.Callback):
    """Per rank: every step's loss and pre-clip global grad norm, the optimizer's groups by parameter name and the
    size of each parameter's local shard -> <dirpath>/rank<r>.json."""

    def __init__(self, dirpath: str):
        self.dirpath, self.steps = Path(dirpath), []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps.append({"loss": float(pl_module.last_loss), "norm": float(pl_module.grad_norms()[0])})

    def on_train_end(self, trainer, pl_module) -> None:
        from mhc_lightning.training.sharding import local_tensor

        names = {id(p): n for n, p in pl_module.model.named_parameters()}
        groups = [
            {"weight_decay": g["weight_decay"], "params": sorted(names[id(p)] for p in g["params"])}
            for g in trainer.optimizers[0].param_groups
        ]
        local = {n: local_tensor(p.data).numel() for n, p in pl_module.model.named_parameters()}
        self.dirpath.mkdir(parents=True, exist_ok=True)
        (self.dirpath / f"rank{trainer.global_rank}.json").write_text(
            json.dumps({"steps": self.steps, "groups": groups, "local": local, "world": trainer.world_size})
        )


@pytest.mark.slow
def test_fsdp2_matches_one_process_with_clipping(tiny_corpus, mlflow_uri, tmp_path):
    """The same global batch on one process and sharded over 2 (FSDP2, ModelParallelStrategy): the parameters are
    sharded, the decay groups are the one-process ones, the logged grad norm is the global one, and with clipping
    engaged every step (clip 0.05) the losses follow the one-process fit step by step."""
    steps, procs = 4, {}
    strategy = json.dumps(
        {
            "class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
            "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1, "save_distributed_checkpoint": False},
        }
    )
    from mhc_lightning.fit.cli import main

    for name, per_rank, extra in (
        ("fsdp2", 4, ["-c", str(CONF / "machine" / "ddp-cpu.yaml"), f"--trainer.strategy={strategy}"]),
        ("single", 8, []),
    ):
        args = tiny_fit_args(tiny_corpus, mlflow_uri, tmp_path / name, steps=steps, experiment=name, run_name=name)
        args = [a for a in args if not a.startswith("--data.batch_size")]
        probe = json.dumps({"class_path": "test_fsdp.ShardProbe", "init_args": {"dirpath": str(tmp_path / name)}})
        args += [
            f"--data.batch_size={per_rank}",
            "--data.shuffle=false",
            "--trainer.gradient_clip_val=0.05",
            "--model.diagnostics_every=0",  # no per-layer figures: seconds per validation, and nothing here reads them
            *extra,
            f"--trainer.callbacks+={probe}",
        ]
        if name == "single":  # in this process, while the two FSDP2 ranks start: one process's start-up less
            main(args)
            continue
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
        )
        log = (tmp_path / f"{name}.log").open("w")
        procs[name] = subprocess.Popen(
            [str(Path(sys.executable).with_name("mhc")), *args],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    for name, proc in procs.items():
        assert proc.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-4000:]

    single = json.loads((tmp_path / "single" / "rank0.json").read_text())
    ranks = [json.loads((tmp_path / "fsdp2" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    full = single["local"]
    assert all(ranks[0]["local"][n] < full[n] for n in full if full[n] > 1), "parameters not sharded"
    assert ranks[0]["groups"] == ranks[1]["groups"] == single["groups"]
    assert single["groups"][0]["weight_decay"] > 0 and "sublayers.0.branch.qkv.weight" in single["groups"][0]["params"]
    norms = torch.tensor([[s["norm"] for s in r["steps"]] for r in (single, *ranks)], dtype=torch.float64)
    torch.testing.assert_close(norms[1], norms[0], rtol=1e-4, atol=0)  # the global norm, not rank 0's shard
    assert torch.equal(norms[1], norms[2])  # every rank holds it
    assert (norms[0] > 0.05).all()  # clipping engaged at every step
    losses = torch.tensor([[s["loss"] for s in r["steps"]] for r in (single, *ranks)], dtype=torch.float64)
    torch.testing.assert_close((losses[1] + losses[2]) / 2, losses[0], rtol=1e-4, atol=0)

    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("fsdp2").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["trainer.strategy"] == "ModelParallelStrategy"
    logged = [
        m.value for m in sorted(client.get_metric_history(run.info.run_id, "train/grad_norm"), key=lambda m: m.step)
    ]
    torch.testing.assert_close(torch.tensor(logged, dtype=torch.float64), norms[1], rtol=1e-5, atol=0)


def test_tensor_parallel_mesh_is_refused_in_one_line():
    from mhc_lightning.errors import ConfigError
    from mhc_lightning.training.sharding import fully_shard_model

    class Mesh:
        def __getitem__(self, name):
            return type("Sub", (), {"size": lambda self: 2})()

    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2: LitLM shards with FSDP2 only .* allowed: 1"):
        fully_shard_model(torch.nn.Linear(2, 2), Mesh())
