"""vLLM's own attention backend that ROCKETKV runs dense attention with, and
where that backend keeps K and V inside a block.

CPU: CPU_ATTN, whose K/V placement depends on the ISA its kernels use (found
by letting vLLM's own cache write store known values: ``cpu_kv_layout``).
NVIDIA: FLASH_ATTN where it supports the model (with attention sinks: FA3
only) and the cache is in the model dtype, else TRITON_ATTN, which reads
every fp8 format from compute capability 8.9 on (FLASH_ATTN: FA3 on Hopper
only, not e5m2): one dense backend for every fp8 cache ROCKETKV accepts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from vllm.logger import init_logger

from rocketkv_vllm.fp8_kv import FP8_FORMATS, KVQuant
from rocketkv_vllm.layout import split_kv

# Under the "vllm" logger so records show with vLLM's own formatting.
logger = init_logger(f"vllm.{__name__}")


@dataclass(frozen=True)
class NativeChoice:
    backend: type  # a vLLM AttentionBackend
    kv_layout: str  # where K and V sit in a block (split_kv)


def cpu_kv_layout(
    isa: str, dtype: torch.dtype, head_size: int, block_size: int, cache_dtype: str = "auto"
) -> str:
    """Where CPU_ATTN's kernels for this ISA put K and V in a block, found by
    letting vLLM's own cache write store known values (into each head's
    [2 * block_size, d] halves, as CPU_ATTN's forward passes them) and
    reading them back through our views (dequantized for an fp8 cache:
    values that fp8 holds exactly, scales 0.5 and 2)."""
    from vllm import _custom_ops as ops

    heads, blocks = 2, 2
    quant = None
    if cache_dtype in FP8_FORMATS:
        quant = KVQuant(FP8_FORMATS[cache_dtype], k_scale=0.5, v_scale=2.0)
    candidates = ("cpu_amx",) if isa == "amx" else ("cpu_vec", "head_rows")
    for layout in candidates:
        kv_cache = torch.zeros(
            blocks,
            heads,
            block_size,
            2 * head_size,
            dtype=dtype if quant is None else torch.uint8,
        )
        rows = kv_cache.view(blocks, heads, 2 * block_size, head_size)
        gen = torch.Generator().manual_seed(0)
        key = torch.randn(3, heads, head_size, generator=gen).to(dtype)
        value = torch.randn(3, heads, head_size, generator=gen).to(dtype)
        if quant is not None:  # representable after the scale: no rounding
            key = key.to(quant.fp8_dtype).to(dtype) * quant.k_scale
            value = value.to(quant.fp8_dtype).to(dtype) * quant.v_scale
        slots = torch.tensor([1, block_size + 2, 2 * block_size - 1])
        ops.cpu_attn_reshape_and_cache(
            key,
            value,
            rows[:, :, :block_size],
            rows[:, :, block_size:],
            slots,
            isa,
            k_scale=1.0 if quant is None else quant.k_scale,
            v_scale=1.0 if quant is None else quant.v_scale,
            kv_cache_dtype=cache_dtype,
        )
        k_cache, v_cache = split_kv(kv_cache, layout, quant)
        blk, off = slots // block_size, slots % block_size
        read_k, read_v = k_cache[blk, :, off].to(dtype), v_cache[blk, :, off].to(dtype)
        if torch.equal(read_k, key) and torch.equal(read_v, value):
            return layout
    raise NotImplementedError(
        f"ROCKETKV cannot read vLLM CPU_ATTN's KV cache layout for the '{isa}' "
        f"kernels (dtype {dtype}, kv_cache_dtype {cache_dtype}, block size "
        f"{block_size}); supported on CPU: the vec, vec16 and amx kernels"
    )


@functools.cache
def native_backend(
    head_size: int,
    dtype: torch.dtype,
    block_size: int,
    has_sink: bool = False,
    cache_dtype: str = "auto",
) -> NativeChoice:
    """vLLM's own attention backend that ROCKETKV runs dense attention with
    (for layers with attention sinks when ``has_sink``; ``cache_dtype``:
    the engine's kv_cache_dtype)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import (
            CPUAttentionBackend,
            _get_attn_isa,
        )

        isa = _get_attn_isa(dtype, block_size, head_size, cache_dtype)
        layout = cpu_kv_layout(isa, dtype, head_size, block_size, cache_dtype)
        choice = NativeChoice(CPUAttentionBackend, layout)
    else:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        capability = current_platform.get_device_capability()
        if (
            FlashAttentionBackend.supports_head_size(head_size)
            and FlashAttentionBackend.supports_dtype(dtype)
            and capability is not None
            and FlashAttentionBackend.supports_compute_capability(capability)
            and (FlashAttentionBackend.supports_sink() or not has_sink)
            and cache_dtype not in FP8_FORMATS
        ):
            choice = NativeChoice(FlashAttentionBackend, "token")
        else:
            from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

            choice = NativeChoice(TritonAttentionBackend, "token")
    logger.info_once(
        "ROCKETKV: dense attention runs in vLLM's %s backend (KV layout %s).",
        choice.backend.get_name(),
        choice.kv_layout,
    )
    return choice


class NativeQuery:
    """The query vLLM's attention layer would hand a native impl.

    With an fp8 e4m3 cache, vLLM's layer quantizes the query (``QuantFP8``,
    static, the layer's q scale: per tensor, or per KV head when the
    checkpoint has one scale per KV head) for a backend whose impl takes an
    fp8 query (``supports_quant_query_input``: TRITON_ATTN and FLASH_ATTN on
    NVIDIA). ROCKETKV's impl does not declare it, so Stage 1 and Stage 2 get
    the model's query, and the native call gets this quantized copy: the
    dense work is what vLLM's own backend does. Otherwise the query itself."""

    def __init__(
        self, native_impl, kv_cache_dtype: str, num_heads: int, num_kv_heads: int, head_size: int
    ) -> None:
        self.quant = None
        if getattr(native_impl, "supports_quant_query_input", False) and kv_cache_dtype in (
            "fp8",
            "fp8_e4m3",
        ):
            from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
            from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

            self.num_kv_heads = num_kv_heads
            self.quant = {
                False: QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR),
                True: QuantFP8(
                    static=True, group_shape=GroupShape(-1, head_size * num_heads // num_kv_heads)
                ),
            }

    def __call__(self, layer, query: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return query
        q_scale = getattr(layer, "q_scale", None)
        per_head = q_scale is not None and q_scale.numel() == self.num_kv_heads
        quantized, _ = self.quant[per_head](query.reshape(query.shape[0], -1), layer._q_scale)
        return quantized.view(query.shape)


def native_for_config(vllm_config, has_sink: bool = False) -> NativeChoice:
    model_config = vllm_config.model_config
    return native_backend(
        model_config.get_head_size(),
        model_config.dtype,
        vllm_config.cache_config.block_size,
        has_sink,
        vllm_config.cache_config.cache_dtype,
    )


def native_for_layers(vllm_config, layer_names: list[str]) -> NativeChoice:
    """The one native backend of a KV cache group's ROCKETKV layers (the
    builder's): each layer's impl chose by whether it has sinks."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
    choices = {
        native_for_config(vllm_config, getattr(layer.impl, "sinks", None) is not None)
        for layer in layers.values()
    }
    if len(choices) > 1:
        raise NotImplementedError(
            "ROCKETKV: this model's full-attention layers mix layers with and "
            "without attention sinks, which need different dense backends here ("
            + ", ".join(sorted(c.backend.get_name() for c in choices))
            + "); use a GPU where FLASH_ATTN supports sinks (FA3, Hopper)"
        )
    return choices.pop() if choices else native_for_config(vllm_config)
