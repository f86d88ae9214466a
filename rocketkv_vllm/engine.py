"""How a ROCKETKV engine is configured, and what it accepts.

``configure_engine`` runs right after the platform's own
``check_and_update_config`` while vLLM builds its ``VllmConfig``
(``vllm_patches``), so every problem surfaces at startup with the name of
the offending field; ``validate_request`` refuses, per request, what
ROCKETKV cannot serve. (An engine's settings are read from its
``VllmConfig`` by ``config.settings_for``.)
"""

from __future__ import annotations

import os

from vllm.logger import init_logger

from rocketkv_vllm.config import RocketKVConfigError, RocketKVSettings, settings_for, test_aids_for
from rocketkv_vllm.fp8_kv import FP8_FORMATS
from rocketkv_vllm.plan import plan_request

# Under the "vllm" logger so records show with vLLM's own formatting.
logger = init_logger(f"vllm.{__name__}")

BACKEND_NAME = "ROCKETKV"
BACKEND_PATH = "rocketkv_vllm.backend.RocketKVBackend"

# 16 suits FLASH_ATTN / TRITON_ATTN; on CPU 32 lets CPU_ATTN use its AMX
# kernels for bf16 (and vec, not vec16, elsewhere).
DEFAULT_BLOCK_SIZE = 16
DEFAULT_CPU_BLOCK_SIZE = 32


def is_rocketkv(selected_backend) -> bool:
    """Whether a backend choice (an AttentionBackendEnum member) is ROCKETKV."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    custom = AttentionBackendEnum.CUSTOM
    return selected_backend == custom and custom.get_path() == BACKEND_PATH


def is_rocketkv_engine(vllm_config) -> bool:
    attention = getattr(vllm_config, "attention_config", None)
    return attention is not None and is_rocketkv(attention.backend)


def kept_tokens_for_prompt(vllm_config, num_prompt_tokens: int) -> int:
    """KV tokens each KV head keeps for a prompt of this length."""
    return plan_request(settings_for(vllm_config), num_prompt_tokens).kept_tokens()


_logged_settings: set[RocketKVSettings] = set()


def configure_engine(vllm_config) -> None:
    """Validate and adapt a VllmConfig whose attention backend is ROCKETKV."""
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    if model_config is None:
        return
    from vllm.platforms import current_platform

    if not cache_config.user_specified_block_size:
        cache_config.block_size = (
            DEFAULT_CPU_BLOCK_SIZE if current_platform.is_cpu() else DEFAULT_BLOCK_SIZE
        )

    refusals = []
    if vllm_config.speculative_config is not None:
        refusals.append(
            "speculative decoding (drafts would be verified "
            "against a KV cache that eviction already changed)"
        )
    from rocketkv_vllm.host_tier import rocketkv_refusals

    refusals += rocketkv_refusals(vllm_config)
    refusals += unsupported_model_reasons(model_config)
    refusals += cache_dtype_refusals(cache_config, model_config)
    parallel = vllm_config.parallel_config
    if getattr(parallel, "decode_context_parallel_size", 1) > 1:
        refusals.append("decode context parallelism")
    if refusals:
        raise ValueError("ROCKETKV attention backend does not support: " + "; ".join(refusals))

    settings = settings_for(vllm_config)
    test_aids_for(vllm_config)  # refuse bad test switches at startup too

    if cache_config.prefix_cache_retention_interval == 0:
        # vLLM's default keeps a sliding-window group's blocks only at each
        # prompt's end and at shared-prefix junctions; a compressed prompt's
        # hit stops before its observation window, where the sliding layers
        # then have nothing: retain their checkpoints densely (a positive
        # interval set by the user is kept: hits fall back to a checkpoint).
        cache_config.prefix_cache_retention_interval = None

    if (
        settings.kernel == "triton"
        and not current_platform.is_cuda()
        and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        raise ValueError(
            "rocketkv.kernel='triton' is invalid here: allowed on NVIDIA GPUs (or "
            "with TRITON_INTERPRET=1 for testing); use 'auto' or 'torch'"
        )

    tp = parallel.tensor_parallel_size
    kv_heads = model_config.get_total_num_kv_heads()
    if tp > kv_heads:
        # vLLM then replicates KV heads: each replica scores tokens and pages
        # with only its own rank's query heads, not the whole GQA group.
        logger.warning_once(
            "ROCKETKV: tensor_parallel_size=%d > %d KV heads: each replicated KV "
            "head selects tokens for its own rank's query heads only, so outputs "
            "can differ from tensor_parallel_size <= %d.",
            tp,
            kv_heads,
            kv_heads,
        )

    if settings not in _logged_settings:
        _logged_settings.add(settings)
        example = plan_request(settings, model_config.max_model_len // 2)
        logger.info(
            "ROCKETKV settings: %s; e.g. a %d-token prompt keeps %d tokens per KV "
            "head (top-k %d, top-r %d).",
            settings.as_dict(),
            example.num_prompt_tokens,
            example.kept_tokens(),
            example.topk,
            example.topr,
        )


def cache_dtype_refusals(cache_config, model_config) -> list[str]:
    """Why ROCKETKV cannot use this kv_cache_dtype here, if it cannot: fp8
    caches (per-tensor scales) are read where the dense backend ROCKETKV runs
    with stores them: vLLM's TRITON_ATTN on NVIDIA GPUs of compute
    capability 8.9 or newer, CPU_ATTN on CPUs with AVX-512 or AMX (blocks
    of a multiple of 32 tokens, head sizes divisible by 32)."""
    import torch
    from vllm.platforms import current_platform

    dtype = cache_config.cache_dtype
    model_dtype = str(model_config.dtype).removeprefix("torch.")
    if dtype in ("auto", None, model_dtype):  # "bfloat16" for a bf16 model is auto
        return []
    name = f"kv_cache_dtype={dtype}"
    if dtype not in FP8_FORMATS:
        return [f"{name} (allowed: auto, {model_dtype}, {', '.join(FP8_FORMATS)})"]
    if current_platform.is_cuda():
        if not current_platform.has_device_capability(89):
            return [
                f"{name} on {current_platform.get_device_name()} (vLLM's TRITON_ATTN, "
                "which ROCKETKV runs dense attention with on an fp8 cache, needs compute "
                "capability 8.9 or newer for fp8; use auto)"
            ]
        return []
    if not current_platform.is_cpu():
        return [f"{name} on {current_platform.device_name} (supported on NVIDIA GPUs and CPUs)"]
    reasons = []
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        reasons.append(f"{name} on this CPU (vLLM's CPU_ATTN stores fp8 with AVX-512 or AMX)")
    if cache_config.block_size % 32:
        reasons.append(
            f"{name} with block_size={cache_config.block_size} (vLLM's CPU_ATTN "
            "stores fp8 in blocks of a multiple of 32 tokens)"
        )
    if model_config.get_head_size() % 32:
        reasons.append(
            f"{name} with head size {model_config.get_head_size()} (vLLM's CPU_ATTN "
            "stores fp8 for head sizes divisible by 32)"
        )
    return reasons


def unsupported_model_reasons(model_config) -> list[str]:
    """What in a model's attention ROCKETKV cannot compress, each named.

    Hybrid sliding-window models are served: their sliding-window layers run
    in vLLM's native backend (``vllm_patches``: backend selection), ROCKETKV
    compresses the full-attention layers only (a model with none is refused
    when its KV cache spec is built: ``check_kv_cache_spec``)."""
    reasons = []
    if model_config.rswa_window is not None:
        reasons.append("models with reference sliding-window attention (R-SWA)")
    if getattr(model_config, "attention_chunk_size", None):
        reasons.append(
            "chunked local attention (attention_chunk_size, e.g. Llama 4): its "
            "local layers would need their own block manager beside ROCKETKV's"
        )
    if model_config.is_hybrid:
        reasons.append(
            "hybrid models with Mamba / linear-attention layers (a capped prefix "
            "hit would cut their recurrent state)"
        )
    if model_config.use_mla:
        reasons.append("MLA models")
    return reasons


def check_kv_cache_spec(kv_cache_spec: dict) -> None:
    """A ROCKETKV engine's layers, as vLLM specced them: at least one is
    ROCKETKV's (sliding-window layers run in vLLM's native backend)."""
    from rocketkv_vllm.kv_cache import RocketKVAttentionSpec

    if kv_cache_spec and not any(
        isinstance(spec, RocketKVAttentionSpec) for spec in kv_cache_spec.values()
    ):
        kinds = sorted({type(spec).__name__ for spec in kv_cache_spec.values()})
        raise ValueError(
            "ROCKETKV attention backend compresses full-attention layers, and this "
            f"model has none (its KV cache layers: {', '.join(kinds)}); serve it "
            "with vLLM's own backend"
        )


def validated_backend_path(attn_selector_config) -> str:
    """vLLM's own backend validation, on every platform, naming ROCKETKV
    (vLLM's CPU selection validates nothing, NVIDIA's would say CUSTOM)."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from rocketkv_vllm.backend import RocketKVBackend

    capability = current_platform.get_device_capability() or DeviceCapability(0, 0)
    reasons = RocketKVBackend.validate_configuration(
        device_capability=capability, **attn_selector_config._asdict()
    )
    if reasons:
        raise ValueError(
            f"ROCKETKV attention backend is not valid for this configuration "
            f"({attn_selector_config}): {'; '.join(reasons)}"
        )
    return BACKEND_PATH


def validate_request(vllm_config, params, resumable: bool) -> None:
    """Refuse, with vLLM's validation error (HTTP 400 at the server), what a
    ROCKETKV engine cannot serve; the engine keeps serving:

    - streaming-input sessions grow a live request's prompt; after
      compaction ROCKETKV would attend over blocks it gave back;
    - on vLLM's CPU build, a per-request seed: its model runner rewinds the
      request's torch generator after a partial prefill step, which CPU
      generators cannot do, and the engine dies (vLLM 0.32, every backend);
    - a per-request budget (``requests``) out of range.
    """
    from vllm.exceptions import VLLMValidationError
    from vllm.platforms import current_platform

    from rocketkv_vllm.requests import REQUEST_BUDGET_KEY, params_token_budget

    if resumable:
        raise VLLMValidationError(
            "ROCKETKV attention backend does not support streaming input "
            "sessions (a live request's prompt would grow after its KV "
            "cache was compressed)",
            parameter="prompt",
        )
    try:
        params_token_budget(params)
    except RocketKVConfigError as e:
        raise VLLMValidationError(
            str(e),
            parameter=f"vllm_xargs.{REQUEST_BUDGET_KEY}",
            value=params.extra_args[REQUEST_BUDGET_KEY],
        ) from None
    if current_platform.is_cpu() and getattr(params, "seed", None) is not None:
        raise VLLMValidationError(
            "ROCKETKV on vLLM's CPU build does not accept a per-request seed: "
            "vLLM's CPU model runner cannot rewind a seeded request's "
            "generator after a chunked prefill step and would stop the "
            "engine; drop `seed` (greedy decoding needs none)",
            parameter="seed",
            value=params.seed,
        )
