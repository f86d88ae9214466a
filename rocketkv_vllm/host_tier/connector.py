"""The host-tier connector: vLLM's SimpleCPUOffloadConnector with
ROCKETKV's prefix-cache rules on the scheduler side (``scheduler``) and, on
vLLM's CPU build, a synchronous copy worker (``cpu_worker``) or, with
``kv_connector_extra_config: {"copy_mode": "async"}``, one whose copies
complete steps later as on CUDA (``async_cpu_worker``); on NVIDIA vLLM's CUDA
worker with ROCKETKV's store wait (``cuda_worker``)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector,
)


class HostTierConnector(SimpleCPUOffloadConnector):
    """vLLM's eager host tier (stores of hashed blocks after each forward,
    host hits after the local prefix hit, an LRU host pool, its metrics);
    for ROCKETKV engines, hits capped before a compressed prompt's window
    and compaction targets stored under their dense hashes. On CUDA the
    worker is vLLM's, its compute stream waiting for the stores the step
    names (``cuda_worker``); on XPU vLLM's."""

    def __init__(self, vllm_config, role, kv_cache_config):
        from vllm.platforms import current_platform

        from rocketkv_vllm.host_tier.ordering import copy_settings

        transfer = vllm_config.kv_transfer_config
        extra = (transfer.kv_connector_extra_config if transfer is not None else None) or {}
        settings = copy_settings(extra, vllm_config.model_config.seed)
        if "copy_mode" in extra and not current_platform.is_cpu():
            raise ValueError(
                "kv_connector_extra_config.copy_mode is for vLLM's CPU build only "
                "(on CUDA/XPU vLLM's worker copies on its own streams); allowed there: "
                "leave it out"
            )
        super().__init__(vllm_config, role, kv_cache_config)

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

            args = (vllm_config, kv_cache_config, worker.cpu_capacity_bytes)
            kwargs = dict(
                kv_offload_backend="disk" if worker.disk_mode else "cpu",
                disk_path=worker.disk_path,
            )
            if settings.mode == "async":
                from rocketkv_vllm.host_tier.async_cpu_worker import AsyncHostCopyWorker

                self.worker_handler = AsyncHostCopyWorker(*args, settings=settings, **kwargs)
            else:
                self.worker_handler = HostCopyWorker(*args, **kwargs)
        elif role == KVConnectorRole.WORKER and worker is not None and current_platform.is_cuda():
            from rocketkv_vllm.host_tier.cuda_worker import HostTierCudaWorker

            HostTierCudaWorker.adopt(worker)  # not yet run on a device (docs/gpu-check.md)

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler_manager is not None:
            from rocketkv_vllm.kv_cache import rocketkv_manager

            self.scheduler_manager.bind_rocketkv(rocketkv_manager(kv_cache_manager))
