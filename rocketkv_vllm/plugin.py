"""vLLM general plugins: ``rocketkv`` makes ``--attention-backend ROCKETKV``
work (``register``), ``rocketkv_metrics`` turns on its metrics
(``register_metrics``); ``VLLM_PLUGINS`` picks either by name.

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

``register`` never raises (vLLM loads it in every process, engines with
other backends too): a step that fails is recorded (``vllm_patches.
record_failure``), logged, and every ROCKETKV engine then refuses to start
naming it (``vllm_patches.require``). Where ROCKETKV cannot be the ``CUSTOM``
backend, or the patch that refuses ROCKETKV engines at startup is missing,
the name ``ROCKETKV`` is not added, so vLLM refuses it as an unknown backend.
"""

from __future__ import annotations

from vllm.logger import init_logger

from rocketkv_vllm.engine import BACKEND_NAME, BACKEND_PATH, is_rocketkv

logger = init_logger(f"vllm.{__name__}")

__all__ = [
    "BACKEND_NAME",
    "BACKEND_PATH",
    "is_rocketkv",
    "register",
    "register_metrics",
]


def _register_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != BACKEND_PATH:
        raise RuntimeError(
            f"ROCKETKV needs vLLM's CUSTOM attention backend slot, but it is taken "
            f"by {custom.get_path()}"
        )
    register_backend(custom, BACKEND_PATH)


def _alias_backend_name() -> None:
    from rocketkv_vllm import vllm_patches

    startup_check = next(p for p in vllm_patches.PATCHES if p.name == "check_and_update_config")
    if not vllm_patches.installed(startup_check):
        raise RuntimeError(
            f"{startup_check.target} is not wrapped, so ROCKETKV engines could not be "
            "checked at startup; the name ROCKETKV is not added"
        )
    vllm_patches.alias_backend_name()


def _install_patches() -> None:
    from rocketkv_vllm import vllm_patches

    vllm_patches.install()


def _register_kv_cache_spec() -> None:
    from rocketkv_vllm.kv_cache import register_kv_cache_spec

    register_kv_cache_spec()


def _register_connector() -> None:
    from rocketkv_vllm.host_tier import register_connector

    register_connector()


# (step, what it does), in order; the alias needs the first two.
_STEPS = (
    (_register_backend, "register ROCKETKV as vLLM's CUSTOM attention backend"),
    (_install_patches, "install the vllm_patches table"),
    (_alias_backend_name, "add the name ROCKETKV to vLLM's backend enum"),
    (_register_kv_cache_spec, "register ROCKETKV's KV cache spec"),
    (_register_connector, "register the host-tier connector"),
)


def register_metrics() -> None:
    """vLLM general plugin ``rocketkv_metrics``: ROCKETKV engines export the
    ``rocketkv:*`` metrics (``metrics``). Leaving it out of ``VLLM_PLUGINS``
    (``VLLM_PLUGINS=rocketkv``) serves ROCKETKV without them. A general
    plugin, not a ``vllm.stat_logger_plugins`` one: vLLM adds those to every
    ``AsyncLLM`` and turns its stats on, whatever the backend."""
    from rocketkv_vllm.engine import want_metrics

    want_metrics()


def register() -> None:
    """Every step, each once per process (idempotent); never raises."""
    from rocketkv_vllm import vllm_patches

    failed = False
    for step, what in _STEPS:
        if failed and step is _alias_backend_name:
            continue  # the backend or the patches are missing: no ROCKETKV name
        try:
            step()
        except Exception as e:  # noqa: BLE001 -- recorded, refused at startup
            failed = failed or step in (_register_backend, _install_patches)
            name = f"rocketkv_vllm.plugin.register ({what})"
            vllm_patches.record_failure(name, f"{type(e).__name__}: {e}")
            logger.error("ROCKETKV is unavailable: %s failed: %s: %s", what, type(e).__name__, e)
