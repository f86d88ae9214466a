"""Patches of vLLM's scheduler, KV cache manager and coordinator: ROCKETKV's
block manager sees each request, a compressed prompt's prefix hit and
chunking follow its rules, hybrid models' other groups hash its dense prefix
only, and the prefix-cache account travels with the scheduler stats
(``kv_cache``)."""

from __future__ import annotations

from rocketkv_vllm.vllm_patches.check import Patch


def _get_computed_blocks(original):
    def get_computed_blocks(self, request):
        from rocketkv_vllm.kv_cache import rocketkv_manager

        manager = rocketkv_manager(self)
        if manager is None:
            return original(self, request)
        manager.track(request)
        blocks, num_hit, boundary = original(self, request)
        hits = blocks.blocks[manager.kv_cache_group_id] if blocks.blocks else ()
        capped = manager.capped_hit(request, num_hit, hits)
        if capped >= num_hit:
            return blocks, num_hit, boundary
        # vLLM's own lookup up to the cap: the hit every KV cache group accepts
        # (a sliding-window group needs its window's blocks before the hit).
        computed, num_hit, num_uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, capped
        )
        boundary = num_hit + num_uncached if num_uncached else 0
        return self.create_kv_cache_blocks(computed), num_hit, boundary

    return get_computed_blocks


def _reserve_prefill_lookahead(original):
    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        from rocketkv_vllm.kv_cache import rocketkv_manager

        num_new_tokens = original(self, request, num_computed_tokens, num_new_tokens)
        manager = rocketkv_manager(self.kv_cache_manager)
        if manager is None:
            return num_new_tokens
        return manager.chunk_tokens(request, num_computed_tokens, num_new_tokens)

    return _reserve_prefill_lookahead


def _coordinator_cache_blocks(original):
    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        from rocketkv_vllm.kv_cache import RocketKVManager

        managers = self.single_type_managers
        rocketkv = next((m for m in managers if isinstance(m, RocketKVManager)), None)
        if rocketkv is None or len(managers) == 1:
            return original(self, request, num_computed_tokens)
        dense = rocketkv.dense_prefix_tokens(request)
        if num_computed_tokens <= dense:
            return original(self, request, num_computed_tokens)
        # vLLM's own loop twice: the other groups (a hybrid model's sliding
        # windows) hash only the dense prefix, ROCKETKV's group keeps its rules.
        others = [m for m in managers if m is not rocketkv and m.enable_caching]
        if rocketkv.enable_caching:
            for m in others:
                m.enable_caching = False
            try:
                original(self, request, num_computed_tokens)
            finally:
                for m in others:
                    m.enable_caching = True
        rocketkv_caching, rocketkv.enable_caching = rocketkv.enable_caching, False
        try:
            original(self, request, dense)
        finally:
            rocketkv.enable_caching = rocketkv_caching

    return cache_blocks


def _preempt_request(original):
    def _preempt_request(self, request, timestamp, drop_stale_output=False):
        from rocketkv_vllm.kv_cache import blocks_never_computed, rocketkv_manager

        if rocketkv_manager(self.kv_cache_manager) is not None:
            stale = blocks_never_computed(self.kv_cache_manager, request)
            # Out of the prefix cache before the free puts them back in the pool.
            self.kv_cache_manager.block_pool.evict_blocks(stale)
        return original(self, request, timestamp, drop_stale_output)

    return _preempt_request


def _update_from_output(original):
    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = original(self, scheduler_output, model_runner_output)
        from rocketkv_vllm.kv_cache import attach_account

        # Here, not in make_stats: these stats go to the frontend, while
        # vLLM's crash dump also calls make_stats and would take the gains.
        attach_account(outputs, self.kv_cache_manager)  # never raises
        if self.connector is not None:
            from rocketkv_vllm.pd import emit_first_tokens

            emit_first_tokens(self, outputs)  # P/D: the prefill engine's first token
        return outputs

    return update_from_output


PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.v1.core.kv_cache_manager",
        "KVCacheManager",
        "get_computed_blocks",
        ("self", "request"),
        _get_computed_blocks,
        "let ROCKETKV's block manager see each request it will allocate for, and "
        "keep a compressed prompt's window out of its prefix hit (kv_cache)",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
        "_reserve_prefill_lookahead",
        ("self", "request", "num_computed_tokens", "num_new_tokens"),
        _reserve_prefill_lookahead,
        "end a compressed prompt's chunk before its last one holds a compaction "
        "target, so the target reaches the prefix cache (kv_cache)",
    ),
    Patch(
        "vllm.v1.core.kv_cache_coordinator",
        "KVCacheCoordinator",
        "cache_blocks",
        ("self", "request", "num_computed_tokens"),
        _coordinator_cache_blocks,
        "a hybrid model's other KV cache groups hash a compressed request's "
        "dense prefix only: its tail and generated tokens came through the "
        "compressed layers (kv_cache.RocketKVManager.dense_prefix_tokens)",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
        "_preempt_request",
        ("self", "request", "timestamp", "drop_stale_output"),
        _preempt_request,
        "a request preempted in the step that allocated its chunk (priority "
        "scheduling) takes the hashes of that chunk's blocks out of the prefix "
        "cache: their K/V are never written (kv_cache.blocks_never_computed)",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
        "update_from_output",
        ("self", "scheduler_output", "model_runner_output"),
        _update_from_output,
        "carry the scheduler's prefix-cache account inside the scheduler stats "
        "of its step's outputs to the frontend's rocketkv:* metrics (kv_cache, "
        "metrics); P/D: a pulled compressed prompt's first output starts with the "
        "prefill engine's token (pd.emit_first_tokens)",
    ),
)
