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
from dataclasses import asdict

from vllm.logger import init_logger

from rocketkv_vllm.config import (
    CONFIG_KEY,
    TEST_AIDS_KEY,
    RocketKVConfigError,
    RocketKVSettings,
    _normalized,
    settings_for,
    test_aids_for,
)
from rocketkv_vllm.fp8_kv import FP8_FORMATS
from rocketkv_vllm.host_tier.pool import check_host_tier_pool  # noqa: F401 (its home)
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
    if current_platform.is_cpu() and parallel.pipeline_parallel_size > 1:
        refusals += cpu_pipeline_refusals(vllm_config)
    if refusals:
        raise ValueError("ROCKETKV attention backend does not support: " + "; ".join(refusals))

    settings = settings_for(vllm_config)
    warn_test_switches(vllm_config, settings)
    if settings.keep_rule == "h2o" and cache_config.enable_prefix_caching:
        # H2O's scores sum the attention of every prompt query: a prefix hit
        # would skip the queries of its cached blocks (docs/keep-rules.md).
        raise ValueError(
            "rocketkv.keep_rule='h2o' is invalid with enable_prefix_caching=True: H2O "
            "scores every prompt query, which a prefix-cache hit skips; start the "
            "engine with enable_prefix_caching=False (--no-enable-prefix-caching) or "
            "use keep_rule 'snapkv' or 'streaming'"
        )

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


def cpu_pipeline_refusals(vllm_config) -> list[str]:
    """vLLM 0.32's CPU worker sets up a later pipeline rank's inputs only in
    its warm-up, which it skips in eager mode (and under VLLM_CPU_CI_ENV):
    the engine then dies at its first request, with every backend."""
    from vllm import envs
    from vllm.config import CompilationMode

    if vllm_config.compilation_config.mode == CompilationMode.NONE:
        why = "eager mode (--enforce-eager or compilation mode 0)"
    elif envs.VLLM_CPU_CI_ENV:
        why = "VLLM_CPU_CI_ENV=1"
    else:
        return []
    return [
        f"pipeline_parallel_size={vllm_config.parallel_config.pipeline_parallel_size} "
        f"with {why} on vLLM's CPU build (its CPU worker then skips the warm-up "
        "that prepares the later ranks' inputs and fails at the first request, "
        "with any backend); use torch.compile, e.g. -cc.mode=1 -cc.backend=eager"
    ]


def warn_test_switches(vllm_config, settings: RocketKVSettings) -> None:
    """Refuse bad test switches at startup, and say once when one is on:
    they change what an engine does for the sake of a test, never for its
    users (``additional_config["rocketkv_testing"]``, evicted blocks kept,
    interpreted Triton kernels)."""
    aids = test_aids_for(vllm_config)
    on = [f"{TEST_AIDS_KEY}.{name}" for name, value in asdict(aids).items() if value]
    if not settings.free_evicted_blocks:
        on.append("rocketkv.free_evicted_blocks=false (evicted blocks are kept: no memory saved)")
    if settings.kernel == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        on.append("rocketkv.kernel='triton' with TRITON_INTERPRET=1 (interpreted: very slow)")
    if on:
        logger.warning_once(
            "ROCKETKV: switches meant for tests or A/B checks are on: %s. Not for "
            "production; remove them from --additional-config.",
            "; ".join(on),
        )


def warn_ignored_settings(vllm_config) -> None:
    """Say once that ``additional_config`` holds ROCKETKV settings an engine
    without the ROCKETKV attention backend ignores (``--attention-backend
    ROCKETKV`` missing or another backend chosen)."""
    if is_rocketkv_engine(vllm_config):
        return
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict):
        return
    ignored = []
    ours = {_normalized(CONFIG_KEY), _normalized(TEST_AIDS_KEY)}
    for key, value in extra.items():
        if _normalized(str(key)) in ours:  # near misses (rocketKV) too
            names = sorted(map(str, value)) if isinstance(value, dict) else value
            ignored.append(f"{key}: {names!r}" if names else str(key))
    if not ignored:
        return
    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention, "backend", None)
    backend = "vLLM's default" if backend is None else getattr(backend, "name", str(backend))
    logger.warning_once(
        "ROCKETKV settings in additional_config are ignored (%s): the attention "
        "backend is %s, not ROCKETKV; add --attention-backend ROCKETKV to use them.",
        "; ".join(ignored),
        backend,
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
    skipped = list(getattr(cache_config, "kv_cache_dtype_skip_layers", None) or [])
    if skipped:
        # Skipped layers get a model-dtype cache next to fp8 ones: two page
        # sizes and KT formats in one engine, which ROCKETKV does not handle.
        return [
            f"kv_cache_dtype_skip_layers={skipped} with {name} (ROCKETKV runs one "
            "KV cache dtype for all its layers: drop kv_cache_dtype_skip_layers or "
            "use kv_cache_dtype=auto)"
        ]
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
    soft_cap = getattr(model_config.hf_text_config, "attn_logit_softcapping", None)
    if soft_cap:
        reasons.append(
            f"attention logit soft-capping (attn_logit_softcapping={soft_cap}, e.g. "
            "Gemma 2): Stage 1 and Stage 2 score uncapped logits"
        )
    return reasons


def check_kv_cache_spec(kv_cache_spec: dict, vllm_config) -> None:
    """A ROCKETKV engine's layers, as vLLM specced them: at least one is
    ROCKETKV's (sliding-window layers run in vLLM's native backend), and
    beside other kinds only with vLLM's hybrid KV cache manager, which
    keeps ROCKETKV's layers in a block table of their own."""
    from rocketkv_vllm.kv_cache import RocketKVAttentionSpec

    kinds = sorted({type(spec).__name__ for spec in kv_cache_spec.values()})
    if kv_cache_spec and RocketKVAttentionSpec.__name__ not in kinds:
        raise ValueError(
            "ROCKETKV attention backend compresses full-attention layers, and this "
            f"model has none (its KV cache layers: {', '.join(kinds)}); serve it "
            "with vLLM's own backend"
        )
    check_stage1_lead_layer(kv_cache_spec, vllm_config)
    if len(kinds) > 1 and vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        # vLLM would then allocate every layer as full attention in one block
        # table: Stage 1 could give back no block, nor cap a prefix hit.
        raise ValueError(
            "ROCKETKV attention backend does not support: vLLM's hybrid KV cache "
            "manager turned off (disable_hybrid_kv_cache_manager=True, from "
            "--disable-hybrid-kv-cache-manager or a KV connector without hybrid "
            f"support) on a model whose KV cache layers are of several kinds "
            f"({', '.join(kinds)}); leave the hybrid KV cache manager on"
        )


def check_stage1_lead_layer(kv_cache_spec: dict, vllm_config) -> None:
    """``rocketkv.stage1_lead_layer`` L: the compressed layers before L take the
    kept positions of the first compressed layer at or after L, which must
    run in the same forward (this worker's layers)."""
    from vllm.model_executor.models.utils import extract_layer_index

    from rocketkv_vllm.kv_cache import RocketKVAttentionSpec

    lead = settings_for(vllm_config).stage1_lead_layer
    if not lead:
        return
    compressed = sorted(
        extract_layer_index(name)
        for name, spec in kv_cache_spec.items()
        if isinstance(spec, RocketKVAttentionSpec)
    )
    if compressed and compressed[-1] < lead:
        stage = (
            " on this pipeline stage"
            if vllm_config.parallel_config.pipeline_parallel_size > 1
            else ""
        )
        raise RocketKVConfigError(
            f"rocketkv.stage1_lead_layer={lead} is invalid: allowed an integer in "
            f"[0, {compressed[-1]}] for this model (its compressed layers{stage}: "
            f"{compressed[0]}..{compressed[-1]}): the layers before it keep the "
            "positions a compressed layer at or after it chose"
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
    - malformed per-request input (``requests``): ``extra_args`` not a
      dict, an unknown ``rocketkv*`` key, a budget out of range.
    """
    from vllm.exceptions import VLLMValidationError
    from vllm.platforms import current_platform

    from rocketkv_vllm.requests import RocketKVRequestError, params_token_budget

    if resumable:
        raise VLLMValidationError(
            "ROCKETKV attention backend does not support streaming input "
            "sessions (a live request's prompt would grow after its KV "
            "cache was compressed)",
            parameter="prompt",
        )
    try:
        params_token_budget(params)
    except RocketKVRequestError as e:
        raise VLLMValidationError(str(e), parameter=e.field, value=e.value) from None
    if current_platform.is_cpu() and getattr(params, "seed", None) is not None:
        raise VLLMValidationError(
            "ROCKETKV on vLLM's CPU build does not accept a per-request seed: "
            "vLLM's CPU model runner cannot rewind a seeded request's "
            "generator after a chunked prefill step and would stop the "
            "engine; drop `seed` (greedy decoding needs none)",
            parameter="seed",
            value=params.seed,
        )


# Whether the rocketkv_metrics general plugin was loaded in this process
# (plugin.register_metrics): ROCKETKV engines then export rocketkv:*.
_metrics_wanted = False


def want_metrics() -> None:
    global _metrics_wanted
    _metrics_wanted = True


def metrics_wanted() -> bool:
    return _metrics_wanted
