"""Scheduler half of the host tier with ROCKETKV's prefix-cache rules.

vLLM's eager host tier stores every *hashed* block of a running request's
block table after the forward that computed it, and loads a host hit into
the request's new blocks. ROCKETKV hashes only dense prompt blocks and
never writes a hashed block again, so what vLLM stores is already dense
K/V of its token prefix. Three rules are added; what each decides is a pure
function in ``store_rules`` (the home of "what the host tier stores"), applied
here to vLLM's pools and requests:

- a host hit stops where the local one must: a compressed prompt's last
  ``window_size`` tokens are computed (Stage 1 needs their queries;
  ``host_hit_limit``);
- compaction targets, which the device never hashes, are stored under their
  dense hashes from the step whose forward completes them, never from the
  Stage 1 step (``target_stores``). Copies on vLLM's CPU build finish inside
  the step. So a compressed conversation's host chain starts at block 0, and
  a later turn can be served from the host after the device has evicted
  everything;
- the blocks a compressed prompt gives back after its Stage 1 step are
  stored from that step (after its forward), not one step later as vLLM
  would: by then another request may have reused one, a hole in the chain
  (``handoff_stores``).

What does not fit the host pool's free blocks is not stored (``fit_host_pool``).

Where copies complete steps after they are issued (vLLM's CUDA worker, the
``async`` copy mode on CPU), a step whose Stage 1 writes into a block with a
store still pending names that store in its metadata
(``RocketKVHostMetadata.wait_store_event``, ``ordering.stores_to_wait``), and
the worker finishes it before the forward.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id, resolve_block_hashes
from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler, TransferMeta
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

from rocketkv_vllm.host_tier.ordering import stage1_write_blocks, stores_to_wait
from rocketkv_vllm.host_tier.store_rules import (
    fit_host_pool,
    handoff_stores,
    host_hit_limit,
    stage1_step,
    target_stores,
)
from rocketkv_vllm.kv_cache import RocketKVManager


@dataclass
class RocketKVHostMetadata(SimpleCPUOffloadMetadata):
    """vLLM's step metadata plus the store the worker must finish before the
    step's forward (-1: none): the latest pending store of a block this
    step's Stage 1 writes (stores complete in event order)."""

    wait_store_event: int = -1


class RocketKVHostScheduler(SimpleCPUOffloadScheduler):
    """vLLM's ``SimpleCPUOffloadScheduler`` plus the three rules above; inert
    (vLLM's behaviour) without a ROCKETKV block manager."""

    rocketkv: RocketKVManager | None = None

    @classmethod
    def adopt(cls, manager: SimpleCPUOffloadScheduler) -> RocketKVHostScheduler:
        """Turn the scheduler vLLM's connector built into this class (its
        constructor derives the host pool; building it twice would not)."""
        manager.__class__ = cls
        manager._target_hashes = {}  # device block id -> the hash it is stored under
        config = manager.cpu_kv_cache_config
        # Every KVCacheTensor spans the whole allocation: its size / blocks is
        # what one block id holds in all layers (what a transfer copies).
        manager.block_bytes = config.kv_cache_tensors[0].size // config.num_blocks
        # Host hits within the window cap (get_num_new_matched_tokens).
        manager._hit_limit = None
        manager._unused_host_hit = {}  # request id -> host tokens the cap left
        coordinator = manager.cpu_coordinator
        manager._find_longest_cache_hit = coordinator.find_longest_cache_hit
        coordinator.find_longest_cache_hit = manager._find_hit_within_limit
        return manager

    def bind_rocketkv(self, rocketkv: RocketKVManager | None) -> None:
        self.rocketkv = rocketkv

    # -- hits ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        self._unused_host_hit.pop(request.request_id, None)  # an earlier lookup's
        found, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not found or self.rocketkv is None:
            return found, is_async
        # The device hit's cap, applied to local + host.
        capped = self.rocketkv.capped_hit(request, num_computed_tokens + found, [], record=False)
        allowed = host_hit_limit(num_computed_tokens, capped)
        if found <= allowed:
            return found, is_async
        if allowed == 0:
            self._free_pending_cpu_hit(self._pending_cpu_hits.pop(request.request_id))
            found_capped, is_async = 0, False
        else:
            # Looked up again within the cap rather than cut: a sliding-window
            # group's hit holds only the blocks its window needs before the
            # hit's end, so a shorter hit has other blocks (vLLM's coordinator
            # finds the longest one every group accepts).
            self._hit_limit = allowed
            try:
                found_capped, is_async = super().get_num_new_matched_tokens(
                    request, num_computed_tokens
                )
            finally:
                self._hit_limit = None
        # Counted when the request is admitted with this hit (it may wait
        # and be looked up again).
        self._unused_host_hit[request.request_id] = found - found_capped
        return found_capped, is_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        unused = self._unused_host_hit.pop(request.request_id, 0)
        if self.rocketkv is not None:
            self.rocketkv.prefix_account.host_tokens_recomputed += unused

    def request_finished(self, request, block_ids):  # all_groups calls it too
        self._unused_host_hit.pop(request.request_id, None)  # aborted while waiting
        return super().request_finished(request, block_ids)

    def _find_hit_within_limit(self, block_hashes, max_length: int, *args, **kwargs):
        if self._hit_limit is not None:
            max_length = min(max_length, self._hit_limit)
        return self._find_longest_cache_hit(block_hashes, max_length, *args, **kwargs)

    # -- stores -------------------------------------------------------------

    def build_connector_meta(self, scheduler_output):
        wait = -1
        if self.rocketkv is not None:
            wait = self._stage1_store_wait(scheduler_output)
            self._queue_compressed_prompt_stores(scheduler_output)
        meta = super().build_connector_meta(scheduler_output)
        values = {f.name: getattr(meta, f.name) for f in fields(meta)}
        return RocketKVHostMetadata(**values, wait_store_event=wait)

    def _stage1_store_wait(self, scheduler_output) -> int:
        """The store this step's forward waits for (``ordering``): the latest
        pending one (issued by an earlier step, its completion not yet
        reported) of a block that a prompt ending in this step has Stage 1
        write into: its targets, compacted; KT pages. -1: none."""
        pending = {
            event: transfer.gpu_block_ids
            for table in (self._store_event_to_blocks, self._abandoned_store_event_to_blocks)
            for event, transfer in table.items()
        }
        if not pending:
            return -1
        mgr = self.rocketkv
        written: list[int] = []
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = mgr._requests.get(req_id)
            if request is None or not stage1_step(
                request.num_computed_tokens, num_new, request.num_prompt_tokens
            ):
                continue
            blocks = mgr.req_to_blocks.get(req_id, [])
            for j in stage1_write_blocks(mgr.plan_of_request(request), mgr.block_size):
                if j < len(blocks) and not blocks[j].is_null:
                    written.append(blocks[j].block_id)
        return stores_to_wait(written, pending)

    def _queue_compressed_prompt_stores(self, scheduler_output) -> None:
        """Stores of compressed prompts' blocks that vLLM's own (one step
        later) would miss (``store_rules``): the compaction targets, from the
        step whose forward completes them, and in the Stage 1 step the blocks
        given back after it. Both copies run after this step's forward."""
        mgr = self.rocketkv
        bs, gid = mgr.block_size, mgr.kv_cache_group_id
        gpu_pool, host_pool = self._gpu_block_pool, self.cpu_block_pool
        queued = set(self._target_hashes.values())
        in_flight = self._in_flight_store_gpu_blocks
        on_host = host_pool.cached_block_hash_to_block.get_one_block  # by hash with group
        gpu_ids: list[int] = []  # targets first, then given-back blocks
        given_back: list[int] = []

        def room() -> int:  # host blocks free and not yet taken by this step
            return host_pool.get_num_free_blocks() - len(gpu_ids) - len(given_back)

        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            state = self._reqs_to_store.get(req_id)
            if state is None or state.finished:
                continue
            request = state.request
            plan = mgr.plan_of_request(request)
            if not plan.compress:
                continue
            before = request.num_computed_tokens  # not yet advanced for this step
            n = request.num_prompt_tokens
            blocks = mgr.req_to_blocks.get(req_id, [])
            targets = target_stores(before, num_new, n, plan.compact_blocks(bs) * bs, bs)
            if targets:
                hashes = resolve_block_hashes(
                    request.block_hashes, mgr.block_pool.hash_block_size, bs
                )
                keys = [
                    make_block_hash_with_group_id(hashes[j], gid)
                    for j in targets[: min(len(hashes), len(blocks))]
                ]
                wanted = [
                    not blocks[j].is_null and key not in queued and not on_host(key)
                    for j, key in enumerate(keys)
                ]
                taken, cut = fit_host_pool(wanted, room())
                for j in taken:
                    queued.add(keys[j])
                    gpu_ids.append(blocks[j].block_id)
                    self._target_hashes[blocks[j].block_id] = keys[j]
                if cut is not None:  # host full: the chain is cut here
                    mgr.prefix_account.host_target_blocks_dropped += len(targets) - cut
            freed = handoff_stores(before, num_new, n, plan.freed_block_range(bs))
            if freed:
                candidates = blocks[freed.start : freed.stop]
                wanted = [
                    not (
                        block.is_null
                        or block.block_hash is None
                        or block.block_id in in_flight
                        or block.block_id in given_back
                        or on_host(block.block_hash)
                    )
                    for block in candidates
                ]
                taken, _ = fit_host_pool(wanted, room())
                given_back += [candidates[i].block_id for i in taken]
        if not gpu_ids and not given_back:
            return
        cpu_ids = [b.block_id for b in host_pool.get_new_blocks(len(gpu_ids) + len(given_back))]
        gpu_ids += given_back
        gpu_pool.touch([gpu_pool.blocks[b] for b in gpu_ids])  # kept until copied
        in_flight.update(given_back)  # vLLM's own store skips them
        meta = [{} for _ in gpu_ids] if self.enable_kv_cache_events else None
        self._pending_finished_stores.append(TransferMeta(gpu_ids, cpu_ids, meta))

    def _process_store_completion(self, gpu_block_ids, cpu_block_ids, block_meta=None) -> None:
        keep = [i for i, g in enumerate(gpu_block_ids) if g not in self._target_hashes]
        if self.rocketkv is not None:
            account = self.rocketkv.prefix_account
            account.host_blocks_stored += len(gpu_block_ids)
            account.host_bytes_stored += len(gpu_block_ids) * self.block_bytes
            account.host_target_blocks_stored += len(gpu_block_ids) - len(keep)
        for i, gpu_id in enumerate(gpu_block_ids):
            key = self._target_hashes.pop(gpu_id, None)
            if key is None:
                continue
            host_block = self.cpu_block_pool.blocks[cpu_block_ids[i]]
            self.cpu_block_pool._insert_block_hash(key, host_block, num_tokens=None)
            self.cpu_block_pool.free_blocks([host_block])
            self._gpu_block_pool.free_blocks([self._gpu_block_pool.blocks[gpu_id]])
        super()._process_store_completion(
            [gpu_block_ids[i] for i in keep],
            [cpu_block_ids[i] for i in keep],
            None if block_meta is None else [block_meta[i] for i in keep],
        )

    def update_connector_output(self, connector_output) -> None:
        before = self._interval_load_blocks_completed  # vLLM's count of finished loads
        super().update_connector_output(connector_output)
        loaded = self._interval_load_blocks_completed - before
        if loaded > 0 and self.rocketkv is not None:
            self.rocketkv.prefix_account.host_blocks_loaded += loaded
            self.rocketkv.prefix_account.host_bytes_loaded += loaded * self.block_bytes

    def _release_transfer_refs(self, transfer: TransferMeta) -> None:
        for gpu_id in transfer.gpu_block_ids:
            self._target_hashes.pop(gpu_id, None)
        super()._release_transfer_refs(transfer)
