"""The branch's input u, dropped after the forward and rebuilt from the stream in the backward
(HyperConfig.rebuild_branch_input, docs/design.md §9).

A multi-stream sublayer hands its branch u = sum_j h_pre_j x_j. The branch's pre-norm saves u for its backward (C per
token in the branch's dtype: fp32 under bf16-mixed), while the op that made u keeps the stream x_l and h_pre for its
own backward anyway. Under `saved_tensors_hooks` autograd keeps a recipe in u's place instead, and the first unpack in
the backward runs it (HyperConnection.run_branch gives the recipe): the u the fused write-back's backward wrote on
request (`request_u`: it ran first and read x_l anyway), or u made again by the forward's kernel (`rebuild_u`). Either
way the backward sees the same bits.
"""

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

import torch


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
