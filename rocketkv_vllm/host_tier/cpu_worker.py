"""Worker half of the host tier on vLLM's CPU build: synchronous block copies."""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler
from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker


def block_regions(
    kv_cache_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Every distinct byte region of the KV cache as a ``[num_blocks, block_bytes]``
    int8 view, one row per block id: copying row ``b`` of every region moves
    block ``b`` of every layer (and whatever a backend keeps in its padding,
    e.g. ROCKETKV's KT pages).

    A ``KVCacheTensor`` places ``layers[l]``'s page of block ``b`` at
    ``offset + l * layer_stride + b * block_stride``: layer-outermost tensors
    give one region per layer, block-outermost ones one region whose row is
    the packed block of all their layers."""
    num_blocks = kv_cache_config.num_blocks
    regions: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for tensor in kv_cache_config.kv_cache_tensors:
        name = next((n for n in tensor.layers if n in kv_caches), None)
        if name is None:
            continue
        raw = torch.empty(0, dtype=torch.int8, device=kv_caches[name].device).set_(
            kv_caches[name].untyped_storage()
        )
        span = num_blocks * tensor.block_stride
        if tensor.layer_stride >= span:  # layer-outermost
            starts = [tensor.offset + i * tensor.layer_stride for i in range(len(tensor.layers))]
            names = list(tensor.layers)
        else:
            starts, names = [0], [tensor.layers[0]]
        for start, layer in zip(starts, names):
            assert raw.numel() >= start + span, (
                f"KV cache {layer!r}: storage of {raw.numel()} bytes, region ends at {start + span}"
            )
            region = raw[start : start + span].view(num_blocks, tensor.block_stride)
            if region.data_ptr() not in seen:  # groups overlay the same bytes
                seen.add(region.data_ptr())
                regions[layer] = region
    return regions


def copy_blocks(
    src: dict[str, torch.Tensor],
    dst: dict[str, torch.Tensor],
    src_ids: list[int],
    dst_ids: list[int],
) -> None:
    index_src = torch.tensor(src_ids, dtype=torch.long)
    index_dst = torch.tensor(dst_ids, dtype=torch.long)
    for name, region in src.items():
        dst[name].index_copy_(0, index_dst, region.index_select(0, index_src))


class HostCopyWorker(SimpleCPUOffloadWorker):
    """vLLM's offloading worker with its CUDA transfer engine replaced by
    synchronous copies between the KV cache and a host buffer of the same
    block layout. A copy has finished when the call returns, so each step's
    load and store events are complete in the step that issued them, and a
    preemption has nothing in flight to wait for."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.kv_cache_config is not None
        if self.disk_mode:
            raise ValueError(
                "kv_offload_backend='disk' is not supported on vLLM's CPU build (use 'cpu')"
            )
        regions = block_regions(self.kv_cache_config, kv_caches)
        # The scheduler half sizes the host pool from the config alone: use its
        # count so both halves agree on every host block id.
        self.num_cpu_blocks = SimpleCPUOffloadScheduler._derive_cpu_config(
            self.kv_cache_config, self.cpu_capacity_bytes
        ).num_blocks
        self.gpu_kv_caches = regions
        self.cpu_kv_caches = {
            name: torch.zeros((self.num_cpu_blocks, region.shape[1]), dtype=torch.int8)
            for name, region in regions.items()
        }
        self.device = next(iter(kv_caches.values())).device

    def start_load_kv(self) -> None:
        meta = self._connector_metadata
        if meta is not None and meta.load_cpu_blocks:
            assert self.cpu_kv_caches is not None and self.gpu_kv_caches is not None
            copy_blocks(
                self.cpu_kv_caches, self.gpu_kv_caches, meta.load_cpu_blocks, meta.load_gpu_blocks
            )
            self._load_hwm = max(self._load_hwm, meta.load_event)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if meta is not None and meta.store_gpu_blocks:
            assert self.cpu_kv_caches is not None and self.gpu_kv_caches is not None
            copy_blocks(
                self.gpu_kv_caches, self.cpu_kv_caches, meta.store_gpu_blocks, meta.store_cpu_blocks
            )
            self._store_hwm = max(self._store_hwm, meta.store_event)
