"""vLLM general plugin: makes ``--attention-backend ROCKETKV`` work.

Loaded by vLLM in every process (API server, engine core, workers) through
the ``vllm.general_plugins`` entry point; every step is idempotent.

1. The backend is registered as vLLM's ``CUSTOM`` backend and ``ROCKETKV`` is
   an alias of that member. Enum members pickle by value, and ``CUSTOM``
   exists in every process before any plugin loads, so a config unpickled in
   a spawned process (always on CPU, with Ray, after CUDA init) still
   resolves; a run-time-added member would not.
2. The platform's ``check_and_update_config`` is wrapped so ROCKETKV engines
   are validated and adjusted at startup (``engine_config.configure_engine``).
3. On vLLM's CPU platform, which otherwise always picks CPU_ATTN, an explicit
   ROCKETKV choice is honoured (the only change to CPU backend selection).
4. ROCKETKV's KV cache spec is registered with its block manager.
"""

from __future__ import annotations

BACKEND_NAME = "ROCKETKV"
BACKEND_PATH = "rocketkv_vllm.backend.RocketKVBackend"

_PATCHED = "_rocketkv_patched"


def is_rocketkv(selected_backend) -> bool:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    custom = AttentionBackendEnum.CUSTOM
    return selected_backend == custom and custom.get_path() == BACKEND_PATH


def _register_backend() -> None:
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        register_backend,
    )

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != BACKEND_PATH:
        raise RuntimeError(
            f"ROCKETKV needs vLLM's CUSTOM attention backend slot, but it is taken "
            f"by {custom.get_path()}"
        )
    register_backend(custom, BACKEND_PATH)
    # Parsing goes through AttentionBackendEnum[name]; the alias maps to CUSTOM.
    AttentionBackendEnum._member_map_[BACKEND_NAME] = custom


def _wrap_platform(platform) -> None:
    platform_cls = type(platform)
    if getattr(platform_cls, _PATCHED, False):
        return
    original_check = platform_cls.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        original_check(cls, vllm_config)
        attention_config = getattr(vllm_config, "attention_config", None)
        if attention_config is not None and is_rocketkv(attention_config.backend):
            from rocketkv_vllm.engine_config import configure_engine

            configure_engine(vllm_config)

    platform_cls.check_and_update_config = classmethod(check_and_update_config)

    if platform.is_cpu():
        original_select = platform_cls.get_attn_backend_cls.__func__

        def get_attn_backend_cls(cls, selected_backend, attn_selector_config,
                                 num_heads=None):
            if is_rocketkv(selected_backend):
                return BACKEND_PATH
            return original_select(cls, selected_backend, attn_selector_config,
                                   num_heads)

        platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    setattr(platform_cls, _PATCHED, True)


def register() -> None:
    from vllm.platforms import current_platform

    from rocketkv_vllm.kv_cache import register_kv_cache_spec

    _register_backend()
    _wrap_platform(current_platform)
    register_kv_cache_spec()
