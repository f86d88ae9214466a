"""A host-memory tier for the KV cache (vLLM's KV offloading) on vLLM's CPU build.

vLLM's offloading workers copy with CUDA streams and run only on CUDA/XPU.
On the CPU build the KV cache already lives in host memory, so the second
tier is a plain buffer and a transfer is a synchronous block copy
(``cpu_worker.HostCopyWorker``). ``connector.HostTierConnector`` is vLLM's
``SimpleCPUOffloadConnector`` (eager stores, prefix-cache hashes, LRU host
pool) with that worker on CPU; ``--kv-offloading-size`` selects it there.
What it stores for ROCKETKV is decided in ``store_rules`` (pure functions,
applied by ``scheduler``); ``pool`` checks the host pool's size at startup.
``kv_connector_extra_config: {"copy_mode": "async"}`` swaps in a worker whose
copies complete steps after their issue, as vLLM's CUDA worker's do
(``async_cpu_worker``); the ordering rules that then matter are in
``ordering`` (pure) and docs/design.md, "Host tier under asynchronous copies".
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


def select_host_tier_connector(vllm_config) -> None:
    """``--kv-offloading-size`` with the native backend names one of vLLM's
    offloading connectors, whose workers run only on CUDA/XPU; on vLLM's CPU
    build the same flags get the host-tier connector (every backend: dense
    engines too)."""
    from vllm.platforms import current_platform

    cache = vllm_config.cache_config
    transfer = vllm_config.kv_transfer_config
    if (
        cache.kv_offloading_size is not None
        and cache.kv_offloading_backend == "native"
        and transfer is not None
        and transfer.kv_connector in ("OffloadingConnector", "SimpleCPUOffloadConnector")
        and current_platform.is_cpu()
    ):
        transfer.kv_connector = CONNECTOR_NAME


def has_host_tier(vllm_config) -> bool:
    """Whether the engine runs the host-tier connector (after
    ``select_host_tier_connector``)."""
    transfer = vllm_config.kv_transfer_config
    return transfer is not None and transfer.kv_connector == CONNECTOR_NAME


def rocketkv_refusals(vllm_config) -> list[str]:
    """What a ROCKETKV engine cannot run of the KV offloading / connector
    settings, each named ([] when the host tier can serve it)."""
    from vllm.platforms import current_platform

    cache, transfer = vllm_config.cache_config, vllm_config.kv_transfer_config
    wants_flag = cache.kv_offloading_size is not None
    if not wants_flag and transfer is None:
        return []
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
    if not current_platform.is_cpu():
        reasons.append(
            "KV cache offloading outside vLLM's CPU build for now (on NVIDIA a store "
            "of a compaction target could overlap the next step's compaction)"
        )
    return reasons
