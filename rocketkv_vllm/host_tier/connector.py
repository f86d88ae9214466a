"""The host-tier connector: vLLM's SimpleCPUOffloadConnector, with a
synchronous copy worker on vLLM's CPU build."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector,
)


class HostTierConnector(SimpleCPUOffloadConnector):
    """Everything but the worker is vLLM's: eager stores of hashed blocks
    after each forward, host hits after the local prefix hit, an LRU host
    pool, its metrics. On CUDA/XPU the worker is vLLM's too."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        from vllm.platforms import current_platform

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
