"""K and V of an fp8 KV cache (``kv_cache_dtype`` fp8, fp8_e4m3, fp8_e5m2),
dequantized on read the way vLLM's dense backend reads them.

vLLM keeps an fp8 cache as ``torch.uint8`` with the same shape and the same
placement of K and V as a cache in the model dtype (CPU_ATTN's vec and AMX
layouts alike, one byte per element: ``backend.native.cpu_kv_layout``
checks it), each byte the fp8 code of ``value / scale`` with the layer's
per-tensor k or v scale. ``Fp8KV`` wraps one such view of codes (a strided
uint8 tensor, or a ``packed_kv.PackedKV`` over uint8) and reads it as fp32
``code * scale``: the PyTorch path addresses it as it addresses a cache
(a ``cache_view.CacheView``: ``cache[blocks, heads, slots]``,
``read_blocks_into``), and the Triton kernels take its codes, format and
scale (``kernel_operand``). It has no writes:
compaction moves the codes themselves (``codes``), so kept tokens stay
bit for bit what the dense backend stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rocketkv_vllm.cache_view import CacheView, KVView, read_blocks
from rocketkv_vllm.kernels.formats import FORMAT_CODES

# vLLM's fp8 cache dtypes and the fp8 format of their codes ("fp8" is e4m3).
FP8_FORMATS = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

# A large finite code of each format (448 and 57344): the test aid that
# poisons evicted blocks writes it (vLLM's kernels read, and mask, unwritten
# slots, so NaN would leak into dense outputs).
LARGE_CODE = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B}


@dataclass(frozen=True)
class KVQuant:
    """How one layer's cache is quantized: the fp8 format, the k/v scales."""

    fp8_dtype: torch.dtype
    k_scale: float
    v_scale: float


def kv_quant_for(kv_cache_dtype: str, layer) -> KVQuant | None:
    """The layer's quantization (its float k/v scales), or None for a cache in
    the model dtype."""
    fp8_dtype = FP8_FORMATS.get(kv_cache_dtype)
    if fp8_dtype is None:
        return None
    return KVQuant(fp8_dtype, float(layer._k_scale_float), float(layer._v_scale_float))


class Fp8KV(CacheView):
    """K or V codes [num_blocks, Hkv, bs, d] read as fp32 values."""

    def __init__(self, codes: KVView, fp8_dtype: torch.dtype, scale: float) -> None:
        assert codes.dtype == torch.uint8, codes.dtype
        self.codes = codes
        self.fp8_dtype = fp8_dtype
        self.scale = scale
        self.shape = codes.shape
        self.device = codes.device
        self.dtype = torch.float32

    def _values(self, codes: torch.Tensor) -> torch.Tensor:
        values = codes.view(self.fp8_dtype).float()
        return values if self.scale == 1.0 else values * self.scale

    def __getitem__(self, index) -> torch.Tensor:
        return self._values(self.codes[index])

    def read_blocks_into(self, blocks: torch.Tensor, out: torch.Tensor) -> None:
        """Whole blocks into ``out`` [len(blocks), Hkv, bs, d] (any strides)."""
        out.copy_(self._values(read_blocks(self.codes, blocks)))

    def stored(self) -> KVView:
        """The codes: compaction moves them, bit for bit."""
        return self.codes

    def kernel_operand(self) -> tuple[torch.Tensor, int, float]:
        """The uint8 codes, their format's ``FORMAT_CODES`` and the scale."""
        if not isinstance(self.codes, torch.Tensor):
            return super().kernel_operand()  # fp8 codes in AMX tiles
        return self.codes, FORMAT_CODES[self.fp8_dtype], float(self.scale)


def dequantized(k_cache: KVView, v_cache: KVView, quant: KVQuant) -> tuple[Fp8KV, Fp8KV]:
    return Fp8KV(k_cache, quant.fp8_dtype, quant.k_scale), Fp8KV(
        v_cache, quant.fp8_dtype, quant.v_scale
    )
