"""vLLM general plugin: makes ``--attention-backend ROCKETKV`` work.

Loaded by vLLM in every process (API server, engine core, workers) through
the ``vllm.general_plugins`` entry point; every step is idempotent.

1. The backend is registered as vLLM's ``CUSTOM`` backend, and ``ROCKETKV``
   is an alias of that member. Enum members pickle by value, and ``CUSTOM``
   exists in every process before any plugin loads, so a config unpickled in
   a spawned process (always on CPU, with Ray, after CUDA init) still
   resolves; a run-time-added member would not.
2. Every change ROCKETKV makes to vLLM is installed from one table
   (``vllm_patches``).
3. ROCKETKV's KV cache spec is registered with its block manager.
4. The host-tier connector (KV offloading on vLLM's CPU build) is registered
   with vLLM's connector factory.
"""

from __future__ import annotations

from rocketkv_vllm.engine import BACKEND_NAME, BACKEND_PATH, is_rocketkv

__all__ = ["BACKEND_NAME", "BACKEND_PATH", "is_rocketkv", "register"]


def _register_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != BACKEND_PATH:
        raise RuntimeError(
            f"ROCKETKV needs vLLM's CUSTOM attention backend slot, but it is taken "
            f"by {custom.get_path()}"
        )
    register_backend(custom, BACKEND_PATH)


def register() -> None:
    from rocketkv_vllm import vllm_patches
    from rocketkv_vllm.host_tier import register_connector
    from rocketkv_vllm.kv_cache import register_kv_cache_spec

    _register_backend()
    vllm_patches.install()
    register_kv_cache_spec()
    register_connector()
