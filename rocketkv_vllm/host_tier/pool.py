"""The host tier's pool size, checked once vLLM has sized it.

For the host-tier connector's scheduler side (``connector``): vLLM serves a
pool that holds only its null block silently, storing nothing.
"""

from __future__ import annotations

import math

from vllm.logger import init_logger

# The engine's logger: a host tier's startup warnings stand with the
# engine's other startup warnings (``engine``; tests/test_startup_warnings.py
# reads them there).
logger = init_logger("vllm.rocketkv_vllm.engine")


def check_host_tier_pool(vllm_config, kv_cache_config, num_host_blocks: int) -> None:
    """Refuse a host tier (``kv_offloading_size``) whose pool holds one block,
    vLLM's null block, so that nothing is ever stored (vLLM runs it
    silently); warn when it holds fewer blocks than one prompt of
    ``max_model_len`` tokens needs. For the host-tier connector's scheduler
    side, once vLLM has sized the pool (``num_cpu_blocks``: at least 1, the
    pool bytes per rank over the bytes one block id holds in all layers)."""
    cache = vllm_config.cache_config
    world = vllm_config.parallel_config.world_size
    block_bytes = kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
    if cache.kv_offloading_size is not None:
        size = f"kv_offloading_size={cache.kv_offloading_size:g}"
    else:
        size = "kv_connector_extra_config.cpu_bytes_to_use"

    def minimum(blocks: int) -> str:  # the size holding this many blocks per rank
        if cache.kv_offloading_size is None:
            return f"cpu_bytes_to_use={blocks * block_bytes * world}"
        gib = math.ceil(blocks * block_bytes * world / (1 << 30) * 1e4) / 1e4
        return f"kv_offloading_size={gib:g} (GiB)"

    if num_host_blocks < 2:
        raise ValueError(
            f"{size} is too small for the host tier: its pool holds {num_host_blocks} "
            f"block of {block_bytes} bytes per rank, vLLM's null block, so nothing "
            f"would be stored; allowed: at least {minimum(2)}, two blocks, or no host tier"
        )
    usable = num_host_blocks - 1
    request_blocks = math.ceil(vllm_config.model_config.max_model_len / cache.block_size)
    if usable < request_blocks:
        logger.warning_once(
            "Host tier: %s holds %d blocks of %d tokens (%d tokens), fewer than one "
            "prompt of max_model_len=%d tokens needs (%s holds one).",
            size,
            usable,
            cache.block_size,
            usable * cache.block_size,
            vllm_config.model_config.max_model_len,
            minimum(request_blocks + 1),
        )
