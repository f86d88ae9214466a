"""Storage formats the kernels and the rest of the package agree on.

Torch only, no Triton: the package imports these from here (``fp8_kv``,
``algorithm.kt_fp8``, ``layout``, ``ops.cpu``), so each is defined once and
the kernels import nothing outside ``rocketkv_vllm.kernels``.

* ``FORMAT_CODES``: the number a kernel takes for the format of an fp8 KV
  cache's codes (the Triton kernels' FP8 constexpr, the C++ Stage 2's
  kv_format; 0 there: a cache in a float dtype).
* fp8 KT rows (kt_dtype "fp8_e4m3", and every KT row of an fp8 KV cache):
  ``fp8_kt_row_bytes(d)`` = 2d e4m3 codes (min, then max) and
  ``FP8_KT_SCALE_BYTES`` (the fp32 scale, zero padding to keep rows 16-byte
  aligned). The codec itself: ``algorithm.kt_fp8`` (PyTorch, the oracle)
  and ``kt_fp8`` (Triton).
"""

from __future__ import annotations

import torch

FORMAT_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}

FP8_KT_SCALE_BYTES = 16  # fp32 scale + padding to keep rows 16-byte aligned


def fp8_kt_row_bytes(head_dim: int) -> int:
    """Bytes of one fp8 KT row (one page, one KV head) for head size d."""
    return 2 * head_dim + FP8_KT_SCALE_BYTES
