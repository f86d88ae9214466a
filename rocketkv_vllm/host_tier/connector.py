"""The host-tier connector: vLLM's SimpleCPUOffloadConnector with
ROCKETKV's prefix-cache rules on the scheduler side (``scheduler``) and a
synchronous copy worker on vLLM's CPU build (``cpu_worker``)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector,
)


class HostTierConnector(SimpleCPUOffloadConnector):
    """vLLM's eager host tier (stores of hashed blocks after each forward,
    host hits after the local prefix hit, an LRU host pool, its metrics);
    for ROCKETKV engines, hits capped before a compressed prompt's window
    and compaction targets stored under their dense hashes. On CUDA/XPU
    the worker is vLLM's."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        from vllm.platforms import current_platform

        if self.scheduler_manager is not None:
            from rocketkv_vllm.host_tier.pool import check_host_tier_pool
            from rocketkv_vllm.host_tier.scheduler import RocketKVHostScheduler

            # vLLM serves a pool of only its null block silently: refused.
            check_host_tier_pool(
                vllm_config, kv_cache_config, self.scheduler_manager.num_cpu_blocks
            )
            RocketKVHostScheduler.adopt(self.scheduler_manager)
        worker = self.worker_handler
        if role == KVConnectorRole.WORKER and worker is not None and current_platform.is_cpu():
            from rocketkv_vllm.host_tier.cpu_worker import HostCopyWorker

            self.worker_handler = HostCopyWorker(
                vllm_config,
                kv_cache_config,
                worker.cpu_capacity_bytes,
                kv_offload_backend="disk" if worker.disk_mode else "cpu",
                disk_path=worker.disk_path,
            )

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler_manager is not None:
            from rocketkv_vllm.kv_cache import rocketkv_manager

            self.scheduler_manager.bind_rocketkv(rocketkv_manager(kv_cache_manager))
