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
3. An explicit ROCKETKV choice is validated with vLLM's own backend checks
   on every platform (errors name ROCKETKV) and honoured; on CPU, vLLM would
   otherwise always pick CPU_ATTN.
4. Requests ROCKETKV cannot serve (streaming-input sessions; a per-request
   seed on vLLM's CPU build; a bad per-request budget) get a validation
   error (``_validate_requests``).
5. ROCKETKV's KV cache spec is registered with its block manager.
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

    original_select = platform_cls.get_attn_backend_cls.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config,
                             num_heads=None):
        if is_rocketkv(selected_backend):
            return validated_backend_path(attn_selector_config)
        return original_select(cls, selected_backend, attn_selector_config,
                               num_heads)

    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    setattr(platform_cls, _PATCHED, True)


def validated_backend_path(attn_selector_config) -> str:
    """vLLM's own backend validation, on every platform, naming ROCKETKV
    (vLLM's CPU selection validates nothing, NVIDIA's would say CUSTOM)."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from rocketkv_vllm.backend import RocketKVBackend

    capability = current_platform.get_device_capability() or DeviceCapability(0, 0)
    reasons = RocketKVBackend.validate_configuration(
        device_capability=capability, **attn_selector_config._asdict())
    if reasons:
        raise ValueError(
            f"ROCKETKV attention backend is not valid for this configuration "
            f"({attn_selector_config}): {'; '.join(reasons)}")
    return BACKEND_PATH


def _validate_requests() -> None:
    """Requests ROCKETKV cannot serve get a validation error (HTTP 400) from
    vLLM's own input processor, and the engine keeps serving:

    - streaming-input sessions grow a live request's prompt; after
      compaction ROCKETKV would attend over blocks it gave back;
    - on vLLM's CPU build, a per-request seed: its model runner rewinds the
      request's torch generator after a partial prefill step, which CPU
      generators cannot do, and the engine dies (vLLM 0.32, every backend);
    - a per-request budget (``request_budget``) out of range.
    """
    from vllm.exceptions import VLLMValidationError
    from vllm.platforms import current_platform
    from vllm.v1.engine.input_processor import InputProcessor

    from rocketkv_vllm.config import RocketKVConfigError
    from rocketkv_vllm.request_budget import REQUEST_BUDGET_KEY, params_token_budget

    if getattr(InputProcessor, _PATCHED, False):
        return
    original = InputProcessor.process_inputs

    def process_inputs(self, *args, **kwargs):
        attention = getattr(self.vllm_config, "attention_config", None)
        if attention is None or not is_rocketkv(attention.backend):
            return original(self, *args, **kwargs)
        if kwargs.get("resumable"):
            raise VLLMValidationError(
                "ROCKETKV attention backend does not support streaming input "
                "sessions (a live request's prompt would grow after its KV "
                "cache was compressed)", parameter="prompt")
        params = kwargs.get("params", args[2] if len(args) > 2 else None)
        try:
            params_token_budget(params)
        except RocketKVConfigError as e:
            raise VLLMValidationError(
                str(e), parameter=f"vllm_xargs.{REQUEST_BUDGET_KEY}",
                value=params.extra_args[REQUEST_BUDGET_KEY]) from None
        if current_platform.is_cpu() and getattr(params, "seed", None) is not None:
            raise VLLMValidationError(
                "ROCKETKV on vLLM's CPU build does not accept a per-request seed: "
                "vLLM's CPU model runner cannot rewind a seeded request's "
                "generator after a chunked prefill step and would stop the "
                "engine; drop `seed` (greedy decoding needs none)",
                parameter="seed", value=params.seed)
        return original(self, *args, **kwargs)

    InputProcessor.process_inputs = process_inputs
    setattr(InputProcessor, _PATCHED, True)


def register() -> None:
    from vllm.platforms import current_platform

    from rocketkv_vllm.kv_cache import register_kv_cache_spec

    _register_backend()
    _wrap_platform(current_platform)
    _validate_requests()
    register_kv_cache_spec()
