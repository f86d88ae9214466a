"""ROCKETKV's KV cache spec and block manager (scheduler side).

The spec pads every block with room for its KT pages, so vLLM counts them in
its memory budget and frees them with the block. The manager gives back the
blocks a compressed request no longer reads, using the same per-request plan
the backend uses (``plan.plan_request``, with the request's own budget if it
set one: ``requests``), as soon as the request's prompt is fully processed.

With vLLM's prefix caching, a block in the cache always holds exactly what
dense prefill of its token prefix writes. For a compressed request:

- it compacts into its first blocks (the *targets*, ``compact_blocks``)
  only when they are its own: a target it found in the cache is replaced,
  when the request is admitted, by a private copy (vLLM's copy-on-write);
- its targets, its tail block and its generated tokens (computed against
  the compressed view) are never hashed; its other prompt blocks are, and
  keep their hashes when given back, so they stay reusable until evicted;
- in the step its prompt ends, before compaction, its targets' dense
  content is copied into fresh blocks that take their place in the cache
  (``take_pending_cow_copies``); so that targets are written by an earlier
  step, its prompt's last chunk never holds a target (``chunk_tokens``);
- its prefix hit never covers its last ``window_size`` prompt tokens, whose
  queries Stage 1 needs (``capped_hit``).

A later turn of a chat, or another question on the same document, then
computes only its new tokens (and the window), and its Stage 1 scores the
whole history, cached tokens included: RocketKV-MT's re-selection.

What the manager did with the cache (``PrefixCacheAccount``: tokens
recomputed for the window, copies, the host tier's stores and loads) goes to
the API server's ``rocketkv:*`` counters inside vLLM's own SchedulerStats
(``attach_account`` / ``take_account``), keyed by the engine index vLLM
gives each engine core (its data-parallel index), never through a file: a
shared folder could stop an engine (another user's folder), be abused by
other local users (links, FIFOs, planted JSON) and mixed up DP engines.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields, replace

from vllm.logger import init_logger
from vllm.v1.core.kv_cache_utils import resolve_block_hashes
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

from rocketkv_vllm.config import RocketKVSettings
from rocketkv_vllm.layout import kt_row_bytes
from rocketkv_vllm.plan import PlanCache, RequestPlan
from rocketkv_vllm.requests import planned_budget

logger = init_logger(f"vllm.{__name__}")


@dataclass(frozen=True, kw_only=True)
class RocketKVAttentionSpec(FullAttentionSpec):
    rocketkv: RocketKVSettings | None = None

    @property
    def kt_bytes_per_block(self) -> int:
        assert self.rocketkv is not None
        pages = self.block_size // self.rocketkv.page_size
        row = kt_row_bytes(self.head_size, self.dtype, self.rocketkv.kt_dtype)
        return self.num_kv_heads * pages * row

    @classmethod
    def merge(cls, specs: list[RocketKVAttentionSpec]) -> RocketKVAttentionSpec:
        settings = {spec.rocketkv for spec in specs}
        assert len(settings) == 1, "all ROCKETKV layers must share one setting"
        merged = super().merge(specs)
        return replace(merged, rocketkv=settings.pop())

    def copy_with_new_block_size(self, block_size: int) -> RocketKVAttentionSpec:
        if block_size == self.block_size:
            return self
        raise NotImplementedError(
            "ROCKETKV keeps KT pages inside each block; splitting blocks is not supported"
        )


def make_rocketkv_spec(spec: AttentionSpec, settings: RocketKVSettings) -> AttentionSpec:
    if not isinstance(spec, FullAttentionSpec) or type(spec) is not FullAttentionSpec:
        raise NotImplementedError(
            f"ROCKETKV supports full-attention layers only, got {type(spec).__name__}"
        )
    if spec.block_size != settings.block_size:
        settings = replace(settings, block_size=spec.block_size)
    base = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
    out = RocketKVAttentionSpec(**base, rocketkv=settings)
    padded = out.unpadded_page_size_bytes + out.kt_bytes_per_block
    return replace(out, page_size_padded=padded)


@dataclass
class PrefixCacheAccount:
    """What ROCKETKV did with vLLM's prefix cache in one scheduler. It rides
    to the API server's metrics inside vLLM's own scheduler stats
    (``attach_account``, ``take_account``); tests and benchmarks read it in
    process."""

    tokens_recomputed: int = 0  # prompt tokens the cache held, recomputed (window)
    private_copies: int = 0  # hit blocks copied to compact into (admission)
    blocks_preserved: int = 0  # compaction targets copied into the cache (Stage 1 step)
    blocks_not_preserved: int = 0  # ... not: no free block, or written in that step
    # The host tier (``host_tier.scheduler``), when the engine has one:
    host_tokens_recomputed: int = 0  # prompt tokens the host held, recomputed (window)
    host_blocks_stored: int = 0  # blocks copied to the host, targets included
    host_bytes_stored: int = 0
    host_target_blocks_stored: int = 0  # compaction targets stored before Stage 1
    host_target_blocks_dropped: int = 0  # ... not stored: the host pool was full
    host_blocks_loaded: int = 0  # host hits copied into device blocks
    host_bytes_loaded: int = 0


# The account travels in SchedulerStats.num_kv_fetch_reqs_by_stage, a
# ``dict[str, int]`` that vLLM builds afresh for every stats object and
# sends from the engine core to the API server with the rest (msgspec,
# typed). SchedulerStats has no free slot, and an attribute of our own would
# not survive the serialization. The entries are what each field gained
# since the scheduler's previous stats (fields that did not move are left
# out), under this prefix. ROCKETKV's stat logger, the first of the
# frontend's (``metrics.add_stat_logger``), adds them to its counters and
# takes them out before any other logger (vLLM's, a user's) sees the dict:
# vLLM's LoggingStatLogger would print a "KV fetch" line for them. Gains,
# not running totals: vLLM sends each stats object to one API server only,
# and with several (``vllm serve -dp N`` starts N) an engine's stats reach
# them in turn, so only gains add up to the engine's account across the
# servers' counters.
ACCOUNT_KEY_PREFIX = "rocketkv:"
ACCOUNT_FIELDS = tuple(f.name for f in fields(PrefixCacheAccount))

_warned: set[str] = set()


def _warn_once(what: str, error: str) -> None:
    if what in _warned:
        return
    _warned.add(what)
    logger.warning(
        "ROCKETKV: %s (%s); the rocketkv:* prefix-cache counters may be "
        "incomplete. Logged once; serving continues.",
        what,
        error,
    )


def attach_account(outputs, kv_cache_manager) -> None:
    """Add to the SchedulerStats among a step's outputs (``Scheduler.
    update_from_output``, ``vllm_patches``: the stats that go to the
    frontend, not those vLLM's crash dump makes) what the account gained
    since the stats before. Never raises: an error is logged once and the
    stats go out without the account (its gains ride in later stats)."""
    try:
        manager = rocketkv_manager(kv_cache_manager)
        if manager is None:
            return
        carriers = (o for o in outputs.values() if o.scheduler_stats is not None)
        stats = next((o.scheduler_stats for o in carriers), None)
        if stats is None:
            return
        account, sent = manager.prefix_account, manager.account_sent
        entries = {}
        for name in ACCOUNT_FIELDS:
            value, before = getattr(account, name), getattr(sent, name)
            if type(value) is not int or value < before:
                raise TypeError(f"account field {name} = {value!r} (sent {before})")
            if value > before:
                entries[ACCOUNT_KEY_PREFIX + name] = value - before
        if entries:  # a new dict: never the scheduler's own
            stats.num_kv_fetch_reqs_by_stage = {**stats.num_kv_fetch_reqs_by_stage, **entries}
            manager.account_sent = replace(account)
    except Exception as e:  # noqa: BLE001 - metrics must never stop the scheduler
        _warn_once("could not attach the prefix-cache account to the scheduler stats", repr(e))


def take_account(stats) -> dict[str, int]:
    """Take the account out of a SchedulerStats (ROCKETKV's stat logger, the
    first of the frontend's): the fields it carries and what each gained. Entries that are not
    a known field with a non-negative int are dropped, logged once. Never
    raises."""
    try:
        carried = getattr(stats, "num_kv_fetch_reqs_by_stage", None)
        if not isinstance(carried, dict):
            return {}
        keys = [k for k in carried if isinstance(k, str) and k.startswith(ACCOUNT_KEY_PREFIX)]
        account = {}
        for key in keys:
            value = carried.pop(key)
            name = key[len(ACCOUNT_KEY_PREFIX) :]
            if name in ACCOUNT_FIELDS and type(value) is int and value >= 0:
                account[name] = value
            else:
                _warn_once("ignored a malformed prefix-cache account entry", f"{key}={value!r}")
        return account
    except Exception as e:  # noqa: BLE001 - metrics must never stop the output handler
        _warn_once("could not read the prefix-cache account from the scheduler stats", repr(e))
        return {}


class RocketKVManager(FullAttentionManager):
    """Full attention, minus the middle blocks of compressed prompts, with
    vLLM's prefix cache kept exact (module docstring).

    One per engine's scheduler; it also keeps the scheduler-side ROCKETKV
    state: the requests it has seen (``track``), by id, weakly, and its
    prefix-cache account.
    """

    def __init__(self, kv_cache_spec: RocketKVAttentionSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        assert kv_cache_spec.rocketkv is not None
        self.settings = kv_cache_spec.rocketkv
        self.plans = PlanCache(self.settings)
        self._requests: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # Requests whose prompt ends in the step being scheduled, with their
        # tokens computed before it: their targets are copied into the cache
        # when the step's copies are taken (take_pending_cow_copies).
        self._to_preserve: dict[str, tuple[object, int]] = {}
        # Blocks hashed while scheduling this step: their K/V are written by
        # its forward, after the step's block copies have run.
        self._hashed_this_step: set[int] = set()
        # Each prompt chunk being scheduled: (tokens computed before, end).
        self._chunk_ends: dict[str, tuple[int, int]] = {}
        self.prefix_account = PrefixCacheAccount()
        # What the scheduler's stats have carried of it (attach_account).
        self.account_sent = PrefixCacheAccount()
        # Hit tokens the cap left unused, per request, from its latest lookup:
        # counted once the request is admitted with that hit (a request that
        # waits is looked up again every step).
        self._unused_hit: dict[str, int] = {}
        # Decode-side requests of disaggregated prefill and decode whose
        # prompt the prefill engine compressed (``pd``): their kept blocks
        # arrive by the KV connector, compacted, so they hold no blocks for
        # the evicted range, take no prefix hit and are never hashed.
        self._remote: set[str] = set()

    # -- requests -------------------------------------------------------------

    def track(self, request) -> None:
        """Remember a request the scheduler is about to allocate blocks for
        (``vllm_patches``: the prefix-cache lookup of every new or resumed
        request), so the calls that name only its id can plan it."""
        self._requests[request.request_id] = request
        kv = request.kv_transfer_params
        if kv and kv.get("do_remote_prefill") and request.num_computed_tokens == 0:
            # (vLLM clears the flag once it queued the pull: a preempted
            # request is recomputed here as any compressed one.)
            from rocketkv_vllm.pd import decode_state

            if decode_state(kv) is not None:
                self._remote.add(request.request_id)

    def remote_plan(self, request_id: str) -> RequestPlan | None:
        """The plan of a decode-side request the prefill engine compressed
        (its kept blocks pulled by the KV connector), else None."""
        if request_id not in self._remote:
            return None
        request = self._requests.get(request_id)
        if request is None:
            return None
        plan = self.plan_of_request(request)
        return plan if plan.compress else None

    def plan_of(self, request_id: str, num_prompt_tokens: int) -> RequestPlan:
        request = self._requests.get(request_id)
        budget = None if request is None else planned_budget(request.sampling_params)
        return self.plans(num_prompt_tokens, budget)

    def plan_of_request(self, request) -> RequestPlan:
        return self.plans(request.num_prompt_tokens, planned_budget(request.sampling_params))

    # -- freeing ----------------------------------------------------------------

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        # Only once the step that compacted the prompt has finished: the
        # backend reads every prompt block until then.
        if (
            not self.settings.free_evicted_blocks
            or num_prompt_tokens is None
            or processed_computed_tokens < num_prompt_tokens
        ):
            return
        start, end = self.plan_of(request_id, num_prompt_tokens).freed_block_range(self.block_size)
        if start < end:
            self._remove_blocks_in_range(request_id, start, end)

    # -- prefix caching ---------------------------------------------------------

    def capped_hit(self, request, num_hit_tokens: int, hit_blocks, record: bool = True) -> int:
        """``num_hit_tokens`` within a compressed request's window cap
        (``RequestPlan.window_hit_cap``); what the cap costs is counted
        (``record``) as device-cache tokens recomputed when the request is
        admitted with this lookup's hit (``add_local_computed_blocks``). A
        compaction target the request would copy (at admission) from a block
        that this very step writes is not taken from the cache: the copy
        runs before the step's forward."""
        if record:
            self._unused_hit.pop(request.request_id, None)  # an earlier lookup's
        plan = self.plan_of_request(request)
        if not plan.compress:
            return num_hit_tokens
        if request.request_id in self._remote:
            return 0  # its first blocks arrive compacted: no dense hit fits them
        bs = self.block_size
        cap = plan.window_hit_cap(self.settings.window_size, bs)
        targets = plan.compact_blocks(bs)
        for j, block in enumerate(hit_blocks[:targets]):
            if block.block_id in self._hashed_this_step:
                return min(num_hit_tokens, j * bs)
        if record and num_hit_tokens > cap:
            self._unused_hit[request.request_id] = num_hit_tokens - cap
        return min(num_hit_tokens, cap)

    def new_step_starts(self) -> None:
        self._hashed_this_step.clear()
        super().new_step_starts()

    def chunk_tokens(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """A compressed prompt's last chunk never holds a compaction target:
        the targets' dense K/V must be written in an earlier step so the
        Stage 1 step can copy them into the cache before compacting."""
        if not self.enable_caching or num_new_tokens <= 0:
            return num_new_tokens
        plan = self.plan_of_request(request)
        stop = plan.compact_blocks(self.block_size) * self.block_size
        end = num_computed_tokens + num_new_tokens
        if num_computed_tokens < stop < end and end >= plan.num_prompt_tokens:
            end = stop
        # cache_blocks is told the step's end rounded down to the hybrid
        # coordinator's alignment; it reads the exact end here.
        self._chunk_ends[request.request_id] = (num_computed_tokens, end)
        return end - num_computed_tokens

    def _private_copies(self, request_id: str, num_hit_blocks: int) -> int:
        """Hit blocks a new request compacts into, so gets its own copies of."""
        request = self._requests.get(request_id)
        if request is None or not num_hit_blocks:
            return 0
        return min(self.plan_of_request(request).compact_blocks(self.block_size), num_hit_blocks)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        needed = super().get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap,
            prefill_end,
        )
        if request_id not in self.num_cached_block:
            needed += self._private_copies(request_id, len(new_computed_blocks))
            plan = self.remote_plan(request_id)
            if plan is not None:
                # No blocks for the evicted range (allocate_external_computed_blocks).
                start, end = plan.freed_block_range(self.block_size)
                needed -= max(0, min(end, -(-num_tokens // self.block_size)) - start)
        return needed

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        plan = self.remote_plan(request_id)
        if plan is None:
            return super().allocate_external_computed_blocks(
                request_id,
                num_local_computed_tokens,
                num_external_computed_tokens,
                record_for_zeroing,
            )
        # A compressed prompt pulled from the prefill engine: blocks for the
        # kept ones only (the compaction targets and the tail block), the
        # null block in the evicted range, as if Stage 1 had freed it here.
        bs = self.block_size
        blocks = self.req_to_blocks[request_id]
        total = num_local_computed_tokens + num_external_computed_tokens
        start, end = plan.freed_block_range(bs)
        todo = [j for j in range(len(blocks), -(-total // bs)) if not start <= j < end]
        fresh = iter(self.block_pool.get_new_blocks(len(todo)))
        for j in range(len(blocks), -(-total // bs)):
            blocks.append(self._null_block if start <= j < end else next(fresh))
        if self._record_new_block_ids and record_for_zeroing:
            self.new_block_ids.extend(blocks[j].block_id for j in todo)

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        super().add_local_computed_blocks(
            request_id, new_computed_blocks, num_local_computed_tokens, num_external_computed_tokens
        )
        self.prefix_account.tokens_recomputed += self._unused_hit.pop(request_id, 0)
        blocks = self.req_to_blocks[request_id]
        for j in range(self._private_copies(request_id, len(new_computed_blocks))):
            copy = self.block_pool.get_new_blocks(1)[0]
            # vLLM's copy-on-write: the copy replaces the hit in the block
            # table, the worker copies before the step's forward.
            self._apply_cow(request_id, j, blocks[j], copy)
            if self._record_new_block_ids:
                self.new_block_ids.append(copy.block_id)
            self.prefix_account.private_copies += 1

    def free(self, request_id: str) -> None:
        self._unused_hit.pop(request_id, None)  # finished or aborted while waiting
        self._remote.discard(request_id)
        super().free(request_id)

    def cache_blocks(
        self, request, num_tokens: int, retention_interval: int | None = None, *, replay_boundaries
    ) -> None:
        plan = self.plan_of_request(request)
        rid = request.request_id
        if plan.compress and rid in self._remote:
            return  # compacted K/V and the null block: nothing dense to hash
        if not plan.compress:
            before = self.num_cached_block.get(rid, 0)
            super().cache_blocks(
                request, num_tokens, retention_interval, replay_boundaries=replay_boundaries
            )
            blocks = self.req_to_blocks[rid][before : self.num_cached_block.get(rid, 0)]
            self._hashed_this_step.update(b.block_id for b in blocks)
            return
        # Dense content only: never the targets (compacted into), the tail
        # block and generated tokens (computed against the compressed view).
        bs = self.block_size
        targets = plan.compact_blocks(bs)
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = min(num_tokens // bs, plan.tail_start // bs)
        if num_full > num_cached:
            mask = [j >= targets for j in range(num_cached, num_full)]
            if any(mask):
                blocks = self.req_to_blocks[rid]
                self.block_pool.cache_full_blocks(
                    request=request,
                    blocks=blocks,
                    num_cached_blocks=num_cached,
                    num_full_blocks=num_full,
                    block_size=bs,
                    kv_cache_group_id=self.kv_cache_group_id,
                    block_mask=mask,
                )
                self._hashed_this_step.update(
                    b.block_id for b, m in zip(blocks[num_cached:num_full], mask) if m
                )
            self.num_cached_block[rid] = num_full
        start, end = self._chunk_ends.pop(rid, (None, num_tokens))
        if start != request.num_computed_tokens:
            end = num_tokens
        if targets and request.num_computed_tokens < plan.num_prompt_tokens <= max(end, num_tokens):
            self._to_preserve[rid] = (request, request.num_computed_tokens)

    def dense_prefix_tokens(self, request) -> int:
        """How many leading tokens of ``request`` have dense K/V in every
        layer: all of an uncompressed request's; a compressed prompt's full
        blocks (its tail block and generated tokens are computed through the
        compressed full-attention layers, so their K/V differ from dense in
        every layer above, a hybrid model's sliding-window layers too). The
        other KV cache groups hash no further (``vllm_patches``)."""
        plan = self.plan_of_request(request)
        if plan.compress and request.request_id in self._remote:
            return 0
        return plan.tail_start if plan.compress else request.num_tokens

    def take_pending_cow_copies(self):
        """At the end of scheduling a step: for each request whose prompt
        ends in it, copy its compaction targets (dense, written by earlier
        steps) into fresh blocks that take their place in the prefix cache,
        before the step's forward compacts the targets. The copies stay
        retained until the step has run, then count as free."""
        for request, computed in self._to_preserve.values():
            self._preserve_targets(request, computed)
        self._to_preserve.clear()
        return super().take_pending_cow_copies()

    def _preserve_targets(self, request, computed_before: int) -> None:
        bs, gid = self.block_size, self.kv_cache_group_id
        targets = self.plan_of_request(request).compact_blocks(bs)
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        todo, late = [], 0
        # The request's hashes are computed at the scheduler's hash block size.
        hashes = resolve_block_hashes(request.block_hashes, self.block_pool.hash_block_size, bs)
        for j in range(min(targets, len(hashes))):
            if self.block_pool.get_cached_block(hashes[j], [gid]) is not None:
                continue  # in the cache already (the request's copy came from it)
            if (j + 1) * bs > computed_before or blocks[j].is_null:
                late += 1  # written in this very step: no dense copy to take
            else:
                todo.append(j)
        account = self.prefix_account
        # Best effort: never at the price of this or the next step's blocks.
        reserve = max(1, self.block_pool.num_gpu_blocks // 100)
        if todo and self.block_pool.get_num_free_blocks() < len(todo) + reserve:
            late, todo = late + len(todo), []
        account.blocks_not_preserved += late
        if not todo:
            return
        fresh = self.block_pool.get_new_blocks(len(todo))
        placed = [self._null_block] * targets
        for j, block in zip(todo, fresh):
            blocks[j].ref_cnt += 1  # retained until the copy has run
            self._pending_cow_copies.append((blocks[j], block))
            placed[j] = block
        self.block_pool.cache_full_blocks(
            request=request,
            blocks=placed,
            num_cached_blocks=0,
            num_full_blocks=targets,
            block_size=bs,
            kv_cache_group_id=gid,
        )
        account.blocks_preserved += len(todo)

    def pop_blocks_for_free(self, request_id: str):
        self._to_preserve.pop(request_id, None)
        self._chunk_ends.pop(request_id, None)
        self._remote.discard(request_id)
        return super().pop_blocks_for_free(request_id)


def rocketkv_manager(kv_cache_manager) -> RocketKVManager | None:
    """The ROCKETKV manager of a vLLM ``KVCacheManager``, or None (another
    backend's engine)."""
    coordinator = getattr(kv_cache_manager, "coordinator", None)
    for manager in getattr(coordinator, "single_type_managers", ()):
        if isinstance(manager, RocketKVManager):
            return manager
    return None


def blocks_never_computed(kv_cache_manager, request) -> set[int]:
    """The blocks of ``request``, in every KV cache group, that hold a prefix
    hash for tokens it has not computed. Priority scheduling may preempt a
    request in the very step that allocated its next chunk (after a request
    of higher priority ran short of blocks): vLLM hashed the chunk's full
    blocks when it allocated them, and the step's forward will not write
    them. Left in the prefix cache, a later hit (the request resumed, a
    parallel sample of it) would read K/V never written."""
    computed = request.num_computed_tokens
    coordinator = kv_cache_manager.coordinator
    stale = set()
    for manager, blocks in zip(
        coordinator.single_type_managers, coordinator.get_blocks(request.request_id)
    ):
        for j, block in enumerate(blocks):
            if (j + 1) * manager.block_size > computed and block.block_hash is not None:
                stale.add(block.block_id)
    return stale


def register_kv_cache_spec() -> None:
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    # The registry fills itself lazily with vLLM's own specs only while it is
    # empty, so fill it first or ours would be the only one.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(
        RocketKVAttentionSpec, RocketKVManager, uniform_type_base_spec=FullAttentionSpec
    )
