"""Patches that run while vLLM builds an engine: its config (the host-tier
connector on vLLM's CPU build), the platform's config check (ROCKETKV's
startup checks) and backend selection, and the name ``ROCKETKV`` in vLLM's
backend enum."""

from __future__ import annotations

from rocketkv_vllm.vllm_patches.check import Patch, require


def _check_and_update_config(original):
    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        from rocketkv_vllm.engine import (
            configure_engine,
            is_rocketkv_engine,
            warn_ignored_settings,
        )

        if is_rocketkv_engine(vllm_config):
            require()
            configure_engine(vllm_config)
        warn_ignored_settings(vllm_config)  # rocketkv settings on another backend

    return check_and_update_config


def _get_attn_backend_cls(original):
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        from rocketkv_vllm.engine import is_rocketkv, validated_backend_path

        if is_rocketkv(selected_backend):
            require()  # also here: the check_and_update_config wrapper may be missing
            if attn_selector_config.has_sliding_window:
                # Sliding-window layers of a hybrid model: vLLM's own choice.
                return original(cls, None, attn_selector_config, num_heads)
            return validated_backend_path(attn_selector_config)
        return original(cls, selected_backend, attn_selector_config, num_heads)

    return get_attn_backend_cls


def _post_init_kv_transfer_config(original):
    def _post_init_kv_transfer_config(self) -> None:
        original(self)
        from rocketkv_vllm.engine import is_rocketkv_engine
        from rocketkv_vllm.host_tier import select_host_tier_connector

        select_host_tier_connector(self, is_rocketkv_engine(self))

    return _post_init_kv_transfer_config


def alias_backend_name() -> None:
    """``AttentionBackendEnum["ROCKETKV"]`` -> its ``CUSTOM`` member, where
    vLLM registers ROCKETKV (``plugin``): vLLM parses ``--attention-backend``
    through the enum's name lookup."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rocketkv_vllm.engine import BACKEND_NAME

    AttentionBackendEnum._member_map_[BACKEND_NAME] = AttentionBackendEnum.CUSTOM


PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.config.vllm",
        "VllmConfig",
        "_post_init_kv_transfer_config",
        ("self",),
        _post_init_kv_transfer_config,
        "--kv-offloading-size on vLLM's CPU build gets the host-tier connector "
        "(vLLM's offloading workers run only on CUDA/XPU)",
    ),
    Patch(
        "vllm.platforms",
        "<platform>",
        "check_and_update_config",
        ("cls", "vllm_config"),
        _check_and_update_config,
        "validate and adjust ROCKETKV engines at startup (engine.configure_engine)",
        classmethod=True,
    ),
    Patch(
        "vllm.platforms",
        "<platform>",
        "get_attn_backend_cls",
        ("cls", "selected_backend", "attn_selector_config", "num_heads"),
        _get_attn_backend_cls,
        "honour an explicit ROCKETKV choice on every platform (CPU would always "
        "pick CPU_ATTN), after vLLM's own backend checks naming ROCKETKV; a hybrid "
        "model's sliding-window layers get vLLM's own choice",
        classmethod=True,
    ),
)
