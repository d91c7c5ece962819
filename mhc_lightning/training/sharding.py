"""What LitLM needs to train under a sharding strategy: which parameters decay (by name, whatever the shapes),
FSDP2 on every rank (Lightning's ModelParallelStrategy), and the process group over which shard norms add up.

- Weight decay is decided by parameter name: FSDP1 (Lightning's FSDPStrategy, `use_orig_params`) hands the optimizer
  flat 1-D shards, so a shape test (`p.ndim == 2`) put the matrices in the no-decay group there.
- Lightning's ModelParallelStrategy calls `LitLM.configure_model`, which shards each attention / MLP branch and then
  the whole model with `fully_shard` (FSDP2) over the strategy's data-parallel mesh. LitLM has no tensor
  parallelism: a tensor-parallel size above 1 (the strategy's default is every GPU of the node, each of which would
  then get the same batches) is refused; set data_parallel_size to the number of processes (conf/machine/fsdp2.yaml).
- Gradients under FULL_SHARD / SHARD_GRAD_OP (FSDP1) and FSDP2 are disjoint shards: the squares of the local shards'
  norms, summed over the world, give the global norm; under HYBRID_SHARD a shard repeats across replicas, which
  that sum would count twice, so it is refused.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..errors import ConfigError
from ..model.layers import Attention, SwiGLU

# names wrappers put into parameter names: FSDP1 (use_orig_params), activation checkpointing, torch.compile
WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def decays(name: str) -> bool:
    """Weight decay for the embedding and the branches' matrices; never for norms, biases, HC / mHC coefficients or
    the collapse head. By name (see the module docstring)."""
    name = clean_name(name)
    if name == "embed.weight":
        return True
    return ".branch." in name and name.endswith(".weight") and ".norm." not in name


def shard_group(strategy) -> Optional[object]:
    """The process group over which this strategy's gradients are disjoint shards (their squared norms add up to the
    global one); None where every rank holds whole gradients (one device, DDP, FSDP's NO_SHARD)."""
    name = type(strategy).__name__
    if not dist.is_available() or not dist.is_initialized():
        return None
    if name == "ModelParallelStrategy":
        return strategy.device_mesh["data_parallel"].get_group()  # what configure_model shards over
    if name == "FSDPStrategy":
        sharding = str(getattr(strategy, "sharding_strategy", "")).rpartition(".")[2]
        if sharding == "NO_SHARD":
            return None
        if sharding not in ("FULL_SHARD", "SHARD_GRAD_OP"):
            raise ConfigError(
                f"trainer.strategy.init_args.sharding_strategy={sharding}: the global gradient norm "
                "(logged, clipped) is summed over disjoint shards; allowed: FULL_SHARD, SHARD_GRAD_OP, "
                "NO_SHARD"
            )
        return dist.group.WORLD
    return None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """An FSDP2 gradient (a DTensor) as the shard this rank holds; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def fully_shard_model(model: torch.nn.Module, device_mesh) -> None:
    """FSDP2 over the data-parallel mesh of Lightning's ModelParallelStrategy: each branch (Attention, SwiGLU) its own
    unit, the rest (embedding, HC / mHC coefficients, final norm, head) in the root unit, gathered once per step."""
    from torch.distributed.fsdp import fully_shard

    tp = device_mesh["tensor_parallel"].size()
    if tp > 1:
        raise ConfigError(
            f"trainer.strategy.init_args.tensor_parallel_size={tp}: LitLM shards with FSDP2 only (no "
            "tensor parallelism); allowed: 1, with data_parallel_size = the number of processes "
            "(conf/machine/fsdp2.yaml)"
        )
    mesh = device_mesh["data_parallel"]
    for module in [m for m in model.modules() if isinstance(m, (Attention, SwiGLU))]:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
