"""The paged RocketKV operations the backend calls: one seam, two paths.

The PyTorch path (``rocketkv_vllm.paged``) runs everywhere and is the oracle;
the Triton kernels (``rocketkv_vllm.kernels``) implement the same functions on
NVIDIA GPUs.
"""

from rocketkv_vllm.paged import (  # noqa: F401
    dense_attention,
    hsa_decode,
    kt_cache_view,
    snapkv_compress,
    write_kv,
)
