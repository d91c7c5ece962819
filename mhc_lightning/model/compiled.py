"""torch.compile for the model without a new trace per Sinkhorn iteration count.

The SinkhornScheduler changes each HyperConnection's `sinkhorn_iters`, a plain int attribute. Dynamo specialises
ints on modules by default, so every new count traced the model again (and past its cache limit, ran it eagerly).
With `allow_unspec_int_on_nn_module` an int that changes becomes symbolic on the next trace, and the fused kernels
take the count as a runtime argument: one extra trace in all. The reference ops unroll Sinkhorn in Python, so
with `kernel_backend: torch` each count is still its own graph.
"""

from collections.abc import Callable

import torch
import torch.nn as nn


def compile_model(model: nn.Module, **compile_kwargs) -> Callable:
    compiled = torch.compile(model, **compile_kwargs)
    if not hasattr(torch._dynamo.config, "allow_unspec_int_on_nn_module"):
        return compiled

    def forward(*args, **kwargs):
        # read by dynamo when it traces (first call, recompiles): scoped to this model's calls
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            return compiled(*args, **kwargs)

    return forward
