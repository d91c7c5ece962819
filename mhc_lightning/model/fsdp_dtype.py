"""The dtype a module computes in when FSDP may have cast its parameters for the forward: the mHC sublayer hands its
branch the input in that dtype (model/hyper_connection.py). FSDP is looked up in sys.modules, never imported: a process
that has not imported it cannot have wrapped anything with it."""

from __future__ import annotations

import sys
from typing import Optional

import torch


def param_compute_dtype(module: torch.nn.Module) -> Optional[torch.dtype]:
    """The dtype `module` computes in: where FSDP wraps it with a mixed-precision `param_dtype` (Lightning's
    FSDPStrategy sets it to bf16 under bf16-mixed), that dtype; else its parameters' (None without floating ones).

    Its parameters hold the computing dtype only while FSDP has them gathered for its forward or backward. Read from
    outside (the mHC sublayer asks before running its branch) they show the stored dtype, or, during the backward, no
    parameters or the gathered ones: an activation checkpoint's recomputation then saw another dtype than the
    forward, and torch's checkpoint stopped on the mismatch (docs/distributed.md)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing can be wrapped by it
    if fsdp is not None:
        if isinstance(module, fsdp.FullyShardedDataParallel):
            if module.mixed_precision.param_dtype is not None:
                return module.mixed_precision.param_dtype
            if module.params:  # without mixed precision the flat parameters keep the original dtype in every state
                return module.params[0].dtype
        elif isinstance(module, getattr(fsdp, "FSDPModule", ())):  # fully_shard: the policy sits on its state
            policy = getattr(module._get_fsdp_state(), "_mp_policy", None)
            if getattr(policy, "param_dtype", None) is not None:
                return policy.param_dtype
    p = next(module.parameters(), None)
    return p.dtype if p is not None and p.is_floating_point() else None
