"""A host-memory tier for the KV cache (vLLM's KV offloading), on vLLM's CPU
build and on NVIDIA.

``connector.HostTierConnector`` is vLLM's ``SimpleCPUOffloadConnector``
(eager stores, prefix-cache hashes, LRU host pool) with ROCKETKV's rules on
its scheduler half (what it stores: ``store_rules``, pure functions applied
by ``scheduler``; ``pool`` checks the host pool's size at startup) and, on its
worker half, a worker per platform. vLLM's offloading workers copy with CUDA
streams: on the CPU build, where the KV cache already lives in host memory,
the second tier is a plain buffer and a transfer a synchronous block copy
(``cpu_worker.HostCopyWorker``), or, with ``kv_connector_extra_config:
{"copy_mode": "async"}``, a copy that completes steps after its issue as on
CUDA (``async_cpu_worker``); on NVIDIA it is vLLM's CUDA worker, its compute
stream waiting for the stores a Stage 1 step names (``cuda_worker``).
``--kv-offloading-size`` selects the connector on CPU (every engine) and for
ROCKETKV engines on NVIDIA (``select_host_tier_connector``). The ordering
rules that asynchronous copies need are in ``ordering`` (pure) and
docs/design.md, "Host tier under asynchronous copies".
"""

from __future__ import annotations

CONNECTOR_NAME = "RocketKVHostTierConnector"


def register_connector() -> None:
    """Make ``kv_connector: RocketKVHostTierConnector`` resolve (every process;
    vLLM imports the module only when an engine uses it)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "rocketkv_vllm.host_tier.connector", "HostTierConnector"
        )


def select_host_tier_connector(vllm_config, rocketkv: bool) -> None:
    """``--kv-offloading-size`` with the native backend names one of vLLM's
    offloading connectors (``OffloadingConnector``, or
    ``SimpleCPUOffloadConnector`` under ``VLLM_USE_SIMPLE_KV_OFFLOAD=1``),
    whose workers run only on CUDA/XPU and which know nothing of ROCKETKV's
    compaction. The same flags get the host-tier connector on vLLM's CPU build
    (every backend: dense engines too) and for ROCKETKV engines on NVIDIA
    (dense engines there keep vLLM's choice). ``rocketkv``: whether the
    engine's attention backend is ROCKETKV (``engine.is_rocketkv_engine``)."""
    from vllm.platforms import current_platform

    cache = vllm_config.cache_config
    transfer = vllm_config.kv_transfer_config
    if (
        cache.kv_offloading_size is not None
        and cache.kv_offloading_backend == "native"
        and transfer is not None
        and transfer.kv_connector in ("OffloadingConnector", "SimpleCPUOffloadConnector")
        and (current_platform.is_cpu() or (current_platform.is_cuda() and rocketkv))
    ):
        transfer.kv_connector = CONNECTOR_NAME


def has_host_tier(vllm_config) -> bool:
    """Whether the engine runs the host-tier connector (after
    ``select_host_tier_connector``)."""
    transfer = vllm_config.kv_transfer_config
    return transfer is not None and transfer.kv_connector == CONNECTOR_NAME


def rocketkv_refusals(vllm_config) -> list[str]:
    """What a ROCKETKV engine cannot run of the KV offloading / connector
    settings, each named ([] when the host tier or, for disaggregated
    prefill and decode, NIXL pull mode can serve it: ``rocketkv_vllm.pd``)."""
    from vllm.platforms import current_platform

    cache, transfer = vllm_config.cache_config, vllm_config.kv_transfer_config
    wants_flag = cache.kv_offloading_size is not None
    if not wants_flag and transfer is None:
        return []
    from rocketkv_vllm.pd import NIXL_PULL_CONNECTORS, NIXL_PUSH_CONNECTORS, nixl_refusals

    if not wants_flag and transfer.kv_connector in NIXL_PULL_CONNECTORS + NIXL_PUSH_CONNECTORS:
        # Disaggregated prefill and decode (``rocketkv_vllm.pd``): dense
        # requests through it, compressed ones refused per request.
        return nixl_refusals(vllm_config)
    if not wants_flag and transfer.kv_connector != CONNECTOR_NAME:
        return [
            f"KV connector {transfer.kv_connector} (a transferred cache would miss "
            f"ROCKETKV's compaction rules; the host tier is kv_offloading_size or "
            f"kv_connector {CONNECTOR_NAME})"
        ]
    reasons = []
    if wants_flag and cache.kv_offloading_backend != "native":
        reasons.append(f"kv_offloading_backend={cache.kv_offloading_backend} (use native)")
    extra = {} if transfer is None else (transfer.kv_connector_extra_config or {})
    if extra.get("lazy_offload"):
        reasons.append("lazy_offload=true in the host tier (eager stores only)")
    if extra.get("kv_offload_backend", "cpu") != "cpu":
        reasons.append(f"kv_offload_backend={extra['kv_offload_backend']} (use cpu)")
    if not cache.enable_prefix_caching:
        reasons.append(
            "KV cache offloading without prefix caching (the host tier is a prefix cache)"
        )
    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        reasons.append(
            f"KV cache offloading on {current_platform.device_name!r} (the host tier "
            f"runs on vLLM's CPU build and on NVIDIA only)"
        )
    return reasons
