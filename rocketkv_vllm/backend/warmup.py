"""Stage 1's kernels compiled at engine start, not on the first long prompt.

Stage 1 runs only at the end of a long prompt's prefill, which vLLM's own
warm-up (dummy batches, CUDA graph capture) never reaches: without this, the
Triton kernels of Stage 1 compiled during the first compressed request of
every engine (vLLM's JIT monitor warned of a latency spike on the H200).

What a Triton kernel is compiled for: its constexprs, the dtypes of its
arguments and the specialization of the others (an integer equal to 1 or a
multiple of 16, a pointer 16-byte aligned). Stage 1's kernels take everything
that changes from prompt to prompt unspecialized (their
``STAGE1_PER_PROMPT_*`` lists), so what is left is fixed by the layer: one
dummy compaction per distinct layer shape compiles every variant the engine
can launch. ``tests/test_warmup.py`` checks that claim key by key.

The dummy prompt lives in vLLM's null block (block 0, never handed to a
request): its K/V and KT page there are scratch that nothing reads.
"""

from __future__ import annotations

import time

import torch
from vllm.logger import init_logger

from rocketkv_vllm.config import RocketKVSettings
from rocketkv_vllm.layout import kt_cache_view, split_kv

logger = init_logger(f"vllm.{__name__}")

NULL_BLOCK = 0


def dummy_prompt(settings: RocketKVSettings) -> tuple[int, int, int]:
    """(num_prompt_tokens, prompt_budget, tail_start) of a prompt that
    evicts: past the window, ending in a partial block, keeping one block of
    chosen tokens besides the protected ones."""
    bs = settings.block_size
    n = settings.window_size + 4 * bs + max(bs // 2, 1)
    tail_start = n // bs * bs
    protect_from = min(n - settings.window_size, tail_start)
    return n, (n - protect_from) + bs, tail_start


def warm_up_stage1(
    stage1,
    kv_cache: torch.Tensor,
    *,
    kv_layout: str,
    quant,
    settings: RocketKVSettings,
    num_q_heads: int,
    query_dtype: torch.dtype,
    scale: float,
    sinks: torch.Tensor | None,
) -> None:
    """One Stage 1 compaction (``stage1.compress``, every Stage 1 kernel) of
    a dummy prompt in the null block of this layer's cache, with the
    arguments ``RocketKVImpl._stage1`` derives from the same cache."""
    n, prompt_budget, tail_start = dummy_prompt(settings)
    k_cache, v_cache = split_kv(kv_cache, kv_layout, quant)
    kt_cache = kt_cache_view(kv_cache, settings.page_size, settings.kt_dtype)
    block_row = torch.full(
        (-(-n // settings.block_size),), NULL_BLOCK, dtype=torch.int32, device=kv_cache.device
    )
    head_size = k_cache.shape[-1]
    q_window = torch.zeros(
        settings.window_size, num_q_heads, head_size, dtype=query_dtype, device=kv_cache.device
    )
    stage1.compress(
        k_cache,
        v_cache,
        kt_cache,
        block_row,
        q_window,
        n,
        prompt_budget,
        tail_start,
        settings.kernel_size,
        settings.page_size,
        scale,
        sinks=sinks,
    )


def warm_up_worker(vllm_config) -> int:
    """Warm Stage 1 up on every distinct ROCKETKV layer shape of this worker
    (after its KV cache is bound, before vLLM's warm-up and graph capture).
    Returns the number of compactions run."""
    from rocketkv_vllm.backend.impl import RocketKVImpl
    from rocketkv_vllm.fp8_kv import kv_quant_for

    t0 = time.perf_counter()
    seen, runs = set(), 0
    for layer in vllm_config.compilation_config.static_forward_context.values():
        impl = getattr(layer, "impl", None)
        kv_cache = getattr(layer, "kv_cache", None)
        if not isinstance(impl, RocketKVImpl) or not isinstance(kv_cache, torch.Tensor):
            continue
        if kv_cache.numel() == 0:
            continue
        quant = kv_quant_for(impl.kv_cache_dtype, layer)
        sinks = impl._sinks()
        key = (
            type(impl.stage1),
            impl.kv_layout,
            impl.num_heads,
            kv_cache.dtype,
            tuple(kv_cache.shape[1:]),
            kv_cache.stride(),
            None if quant is None else quant.fp8_dtype,
            sinks is not None,
            impl.settings,
        )
        if key in seen:
            continue
        seen.add(key)
        warm_up_stage1(
            impl.stage1,
            kv_cache,
            kv_layout=impl.kv_layout,
            quant=quant,
            settings=impl.settings,
            num_q_heads=impl.num_heads,
            query_dtype=vllm_config.model_config.dtype,
            scale=impl.scale,
            sinks=sinks,
        )
        runs += 1
    if runs:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the compile time belongs to the warm-up
        logger.info(
            "ROCKETKV: Stage 1 warmed up on %d layer shape(s) in %.2f s.",
            runs,
            time.perf_counter() - t0,
        )
    return runs
