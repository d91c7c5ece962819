"""The fused ops, one module per op (docs/kernels.md, "Where things are"): its Triton kernels, its custom-op
registration, fake impl and autograd glue; the public wrappers are kernels/fused/__init__.py's functions of the same
names."""

from . import (  # noqa: F401  (the public wrappers reach each op as ops.<op>)
    expand_streams,
    hc_coefficients,
    hc_enter,
    mhc_boundary,
    mhc_coefficients,
    mhc_enter,
    mhc_pre,
    rms_proj,
    rope_qkv,
    stream_post_res,
    stream_pre,
    sum_streams,
)
