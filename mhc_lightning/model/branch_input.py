"""What a multi-stream sublayer reads of its inputs besides the coefficients: the streams' spread (recorded for the
diagnostics), the dtype its branch computes in (the branch's input u is handed over in it), and u dropped after the
forward and rebuilt from the stream in the backward (HyperConfig.rebuild_branch_input, docs/design.md §9).

A multi-stream sublayer hands its branch u = sum_j h_pre_j x_j. The branch's pre-norm saves u for its backward (C per
token in the branch's dtype: fp32 under bf16-mixed), while the op that made u keeps the stream x_l and h_pre for its
own backward anyway. Under `saved_tensors_hooks` autograd keeps a recipe in u's place instead, and the first unpack in
the backward runs it (HyperConnection.run_branch gives the recipe): the u the fused write-back's backward wrote on
request (`request_u`: it ran first and read x_l anyway), or u made again by the forward's kernel (`rebuild_u`). Either
way the backward sees the same bits.
"""

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

import torch


def stream_spread(x: torch.Tensor) -> torch.Tensor:
    """Relative spread of the streams, max_i ||x_i - mean_j x_j|| / ||mean_j x_j||: [..., n, C] -> [...]; recorded by
    each mHC / HC sublayer for the diagnostics (training/diagnostics.py) and the detector's degenerate-streams check.

    Exactly 0 while the streams are bitwise identical (the symmetric trap of docs/design.md §6).
    """
    x = x.double()
    mean = x.mean(dim=-2, keepdim=True)
    return (x - mean).norm(dim=-1).amax(dim=-1) / mean.squeeze(-2).norm(dim=-1).clamp_min(1e-30)


def param_compute_dtype(module: torch.nn.Module) -> Optional[torch.dtype]:
    """The dtype `module` computes in: where FSDP wraps it with a mixed-precision `param_dtype` (Lightning's
    FSDPStrategy sets it to bf16 under bf16-mixed), that dtype; else its parameters' (None without floating ones).
    The mHC sublayer hands its branch the input in that dtype (model/hyper_connection.py).

    Its parameters hold the computing dtype only while FSDP has them gathered for its forward or backward. Read from
    outside (the mHC sublayer asks before running its branch) they show the stored dtype, or, during the backward, no
    parameters or the gathered ones: an activation checkpoint's recomputation then saw another dtype than the
    forward, and torch's checkpoint stopped on the mismatch (docs/distributed.md). FSDP is looked up in sys.modules,
    never imported: a process that has not imported it cannot have wrapped anything with it."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
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


class _Rebuilt:
    """What autograd keeps in u's place. The first unpack rebuilds u; every other op that saved u (the CPU's composite
    rms_norm saves it twice) gets the same tensor, which goes when the last of them has run its backward."""

    __slots__ = ("make", "u")

    def __init__(self, make: Callable[[], torch.Tensor]):
        self.make: Callable[[], torch.Tensor] = make
        self.u: Optional[torch.Tensor] = None

    def __call__(self) -> torch.Tensor:
        if self.u is None:
            with torch.no_grad():
                self.u = self.make()
        return self.u


def others_keep_saved_tensors() -> bool:
    """Saved-tensor hooks are active already: an outer non-reentrant checkpoint (FSDP's or Lightning's activation
    checkpointing, `torch.utils.checkpoint` around a block) or `save_on_cpu`. They decide how the branch's tensors are
    kept, u among them, and hooks entered inside them would take that over for the whole branch: its activations
    would stay in memory instead of being dropped or offloaded (docs/design.md §9). The branch then runs as it is."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


@contextmanager
def rebuilt_in_backward(u: torch.Tensor, make: Callable[[], torch.Tensor]) -> Iterator[None]:
    """Inside this block, an op that saves u itself keeps `make` instead (make() must return u's values, shape and
    dtype; it must not hold u). Other saved tensors, views of u among them, are kept as they are.

    Not inside other saved-tensor hooks (`others_keep_saved_tensors`): theirs would be bypassed (GPTConfig refuses
    recompute_block with it; HyperConnection.run_branch steps aside under anyone else's).
    """
    token = _Rebuilt(make)
    # a weak reference: every saved tensor keeps these hooks, so a closure over u itself would keep u alive
    ref = weakref.ref(u)

    def pack(t: torch.Tensor):
        return token if t is ref() else t

    def unpack(packed):
        return packed() if isinstance(packed, _Rebuilt) else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
