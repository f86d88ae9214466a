"""How a ROCKETKV engine is configured: checks and adjustments at startup.

``configure_engine`` runs right after the platform's own
``check_and_update_config`` while vLLM builds its ``VllmConfig`` (see plugin),
so every problem surfaces at startup with the name of the offending field.
"""

from __future__ import annotations

import os

from vllm.logger import init_logger

from rocketkv_vllm.config import (
    CONFIG_KEY,
    RocketKVSettings,
    kept_tokens_per_head,
    parse_config,
    plan_request,
    resolve_settings,
)

# Under the "vllm" logger so records show with vLLM's own formatting.
logger = init_logger(f"vllm.{__name__}")

# vLLM fills CommonAttentionMetadata.rswa_prefix_lens with every request's
# prompt length only when the model has an R-SWA window; ROCKETKV needs those
# lengths and sets this marker window (no ROCKETKV layer applies R-SWA).
RSWA_MARKER_WINDOW = 1 << 30

# 16 suits FLASH_ATTN / TRITON_ATTN; on CPU 32 lets CPU_ATTN use its AMX
# kernels for bf16 (and vec, not vec16, elsewhere).
DEFAULT_BLOCK_SIZE = 16
DEFAULT_CPU_BLOCK_SIZE = 32


_logged_settings: set[RocketKVSettings] = set()
# The settings this process resolved last. vLLM asks the backend for its KV
# cache spec without a current config, after the layers (which resolve the
# settings) were built.
_process_settings: RocketKVSettings | None = None


def _raw_config(vllm_config) -> dict:
    extra = vllm_config.additional_config or {}
    raw = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
    if raw is not None and not isinstance(raw, dict):
        raise ValueError(
            f"additional_config.{CONFIG_KEY} must be a JSON object, got {raw!r}"
        )
    return raw or {}


def settings_from_vllm_config(vllm_config) -> RocketKVSettings:
    global _process_settings
    model_config = vllm_config.model_config
    _process_settings = resolve_settings(
        parse_config(_raw_config(vllm_config)),
        block_size=vllm_config.cache_config.block_size,
        head_dim=model_config.get_head_size(),
        max_model_len=model_config.max_model_len,
    )
    return _process_settings


def process_settings() -> RocketKVSettings:
    if _process_settings is None:
        raise RuntimeError("ROCKETKV settings were not resolved in this process")
    return _process_settings


def kept_tokens_for_prompt(vllm_config, num_prompt_tokens: int) -> int:
    """KV tokens each KV head keeps for a prompt of this length."""
    return kept_tokens_per_head(settings_from_vllm_config(vllm_config),
                                num_prompt_tokens)


def uses_triton(settings: RocketKVSettings) -> bool:
    """Triton kernels on NVIDIA GPUs (or anywhere when forced), else PyTorch."""
    if settings.kernel != "auto":
        return settings.kernel == "triton"
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def configure_engine(vllm_config) -> None:
    """Validate and adapt a VllmConfig whose attention backend is ROCKETKV."""
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    if model_config is None:
        return
    from vllm.platforms import current_platform

    if not cache_config.user_specified_block_size:
        cache_config.block_size = (DEFAULT_CPU_BLOCK_SIZE if current_platform.is_cpu()
                                   else DEFAULT_BLOCK_SIZE)

    refusals = []
    if vllm_config.speculative_config is not None:
        refusals.append("speculative decoding (drafts would be verified "
                        "against a KV cache that eviction already changed)")
    if getattr(cache_config, "kv_offloading_size", None) is not None:
        refusals.append("KV cache offloading (kv_offloading_size: offloaded "
                        "blocks would miss ROCKETKV's compaction and KT pages)")
    elif vllm_config.kv_transfer_config is not None:
        refusals.append("KV connectors / disaggregated prefill (a transferred "
                        "cache would miss ROCKETKV's compaction and KT pages)")
    if model_config.rswa_window not in (None, RSWA_MARKER_WINDOW):
        refusals.append("models with reference sliding-window attention")
    if getattr(model_config.hf_text_config, "sliding_window", None):
        refusals.append("sliding-window models")
    if model_config.use_mla:
        refusals.append("MLA models")
    if cache_config.cache_dtype not in ("auto", None):
        refusals.append(f"kv_cache_dtype={cache_config.cache_dtype} (use auto)")
    parallel = vllm_config.parallel_config
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        refusals.append("decode context parallelism")
    if refusals:
        raise ValueError("ROCKETKV attention backend does not support: "
                         + "; ".join(refusals))

    settings = settings_from_vllm_config(vllm_config)

    if (settings.kernel == "triton" and not current_platform.is_cuda()
            and os.environ.get("TRITON_INTERPRET") != "1"):
        raise ValueError(
            "rocketkv.kernel='triton' is invalid here: allowed on NVIDIA GPUs (or "
            "with TRITON_INTERPRET=1 for testing); use 'auto' or 'torch'"
        )

    if cache_config.enable_prefix_caching:
        logger.warning(
            "ROCKETKV: prefix caching disabled (compaction rewrites prompt blocks "
            "in place, so they cannot be shared between requests)."
        )
        cache_config.enable_prefix_caching = False

    model_config.model_arch_config.rswa_window = RSWA_MARKER_WINDOW

    tp = parallel.tensor_parallel_size
    kv_heads = model_config.get_total_num_kv_heads()
    if tp > kv_heads:
        # vLLM then replicates KV heads: each replica scores tokens and pages
        # with only its own rank's query heads, not the whole GQA group.
        logger.warning_once(
            "ROCKETKV: tensor_parallel_size=%d > %d KV heads: each replicated KV "
            "head selects tokens for its own rank's query heads only, so outputs "
            "can differ from tensor_parallel_size <= %d.", tp, kv_heads, kv_heads)

    if settings not in _logged_settings:
        _logged_settings.add(settings)
        example = plan_request(settings, model_config.max_model_len // 2)
        logger.info(
            "ROCKETKV settings: %s; e.g. a %d-token prompt keeps %d tokens per KV "
            "head (top-k %d, top-r %d).",
            settings.as_dict(), example.num_prompt_tokens,
            example.prompt_budget if example.compress else example.num_prompt_tokens,
            example.topk, example.topr,
        )
