"""Fused Triton kernels (issue 3). Until they land, the fused names point at the reference ops."""
from ..reference import mhc_coefficients, stream_post_res, stream_pre  # noqa: F401
