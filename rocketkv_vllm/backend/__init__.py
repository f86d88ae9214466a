"""The ROCKETKV attention backend (``rocketkv_vllm.backend.RocketKVBackend``).

As vLLM's own backends, one backend is a class with its capabilities
(here), its metadata and builder (``metadata``), and its impl (``impl``).
Everything dense runs in vLLM's own backend for the platform (``native``);
ROCKETKV adds Stage 1 and Stage 2 (``ops``, chosen in ``stages``), and lays decode steps out
for FULL CUDA graphs on NVIDIA (``graphs``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, MultipleOf
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

# Head sizes ROCKETKV takes: those of the dense backend it runs beside, at
# which every Stage 1 and Stage 2 implementation is tested (the Triton
# kernels pad the head dim to a power of two; tests/test_kernels.py,
# tests/test_cpu_kernel.py, tests/test_head_sizes.py).
CPU_HEAD_SIZES = [32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512]  # CPU_ATTN's
GPU_HEAD_SIZES = [32, 64, 80, 96, 128, 160, 192, 256]  # FLASH_ATTN's


class RocketKVBackend(AttentionBackend):
    # vLLM's own selection machinery knows this backend as CUSTOM (plugin).
    # The native backend writes the KV cache in do_kv_cache_update.
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float16,
        torch.bfloat16,
        torch.float32,
    ]
    # fp8 on AVX-512/AMX CPUs and NVIDIA 8.9+, float16 / bfloat16 when they are the model's dtype
    # (``engine.cache_dtype_refusals``, ``fp8_kv``).
    supported_kv_cache_dtypes: ClassVar[list] = [
        "auto",
        "float16",
        "bfloat16",
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
    ]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls():
        from rocketkv_vllm.backend.impl import RocketKVImpl

        return RocketKVImpl

    @staticmethod
    def get_builder_cls():
        from rocketkv_vllm.backend.metadata import RocketKVMetadataBuilder

        return RocketKVMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        # CPU_ATTN's vec16 kernels take 16-token blocks, vec and AMX 32.
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        from vllm.platforms import current_platform

        return list(CPU_HEAD_SIZES if current_platform.is_cpu() else GPU_HEAD_SIZES)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # KT pages sit in each block's padding behind a head-major interior.
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_sink(cls) -> bool:
        # gpt-oss's learned sinks: in the dense backend, Stage 1's window
        # scores and Stage 2's exact attention (``algorithm.sinks``).
        return True

    @classmethod
    def supports_kv_connector(cls) -> bool:
        # The host tier only (``host_tier.rocketkv_refusals`` refuses any
        # other connector at startup, naming it).
        return True

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """ROCKETKV's spec for the engine being built: KT pages in every
        block's padding (``kv_cache``). vLLM calls this from the model
        runner's ``get_kv_cache_spec``, which ``vllm_patches`` runs with the
        engine's config current."""
        from vllm.config import get_current_vllm_config_or_none

        from rocketkv_vllm.config import settings_for
        from rocketkv_vllm.kv_cache import RocketKVAttentionSpec, make_rocketkv_spec

        if isinstance(spec, RocketKVAttentionSpec):
            return spec
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is None:
            raise RuntimeError(
                "ROCKETKV builds its KV cache spec from the engine's config, but "
                "vLLM called customize_spec with no current config"
            )
        return make_rocketkv_spec(spec, settings_for(vllm_config))
