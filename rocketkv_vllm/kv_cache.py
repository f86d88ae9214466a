"""ROCKETKV's KV cache spec and block manager (scheduler side).

The spec pads every block with room for its KT pages, so vLLM counts them in
its memory budget and frees them with the block. The manager gives back the
blocks a compressed request no longer reads, using the same per-request plan
the backend uses (``plan.plan_request``, with the request's own budget if it
set one: ``requests``), as soon as the request's prompt is fully processed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields, replace

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

from rocketkv_vllm.config import RocketKVSettings
from rocketkv_vllm.paged import kt_row_bytes
from rocketkv_vllm.plan import PlanCache, RequestPlan
from rocketkv_vllm.requests import planned_budget


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
            "ROCKETKV keeps KT pages inside each block; splitting blocks is not supported")


def make_rocketkv_spec(spec: AttentionSpec, settings: RocketKVSettings) -> AttentionSpec:
    if not isinstance(spec, FullAttentionSpec) or type(spec) is not FullAttentionSpec:
        raise NotImplementedError(
            f"ROCKETKV supports full-attention layers only, got {type(spec).__name__}")
    if spec.block_size != settings.block_size:
        settings = replace(settings, block_size=spec.block_size)
    base = {f.name: getattr(spec, f.name) for f in fields(spec) if f.init}
    out = RocketKVAttentionSpec(**base, rocketkv=settings)
    padded = out.unpadded_page_size_bytes + out.kt_bytes_per_block
    return replace(out, page_size_padded=padded)


class RocketKVManager(FullAttentionManager):
    """Full attention, minus the middle blocks of compressed prompts.

    One per engine's scheduler; it also keeps the scheduler-side ROCKETKV
    state: the requests it has seen (``track``), by id, weakly.
    """

    def __init__(self, kv_cache_spec: RocketKVAttentionSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        assert kv_cache_spec.rocketkv is not None
        self.settings = kv_cache_spec.rocketkv
        self.plans = PlanCache(self.settings)
        self._requests: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def track(self, request) -> None:
        """Remember a request the scheduler is about to allocate blocks for
        (``vllm_patches``: the prefix-cache lookup of every new or resumed
        request), so the calls that name only its id can plan it."""
        self._requests[request.request_id] = request

    def plan_of(self, request_id: str, num_prompt_tokens: int) -> RequestPlan:
        request = self._requests.get(request_id)
        budget = None if request is None else planned_budget(request.sampling_params)
        return self.plans(num_prompt_tokens, budget)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        # Only once the step that compacted the prompt has finished: the
        # backend reads every prompt block until then.
        if (
            not self.settings.free_evicted_blocks
            or num_prompt_tokens is None
            or processed_computed_tokens < num_prompt_tokens
        ):
            return
        start, end = self.plan_of(request_id, num_prompt_tokens).freed_block_range(
            self.block_size)
        if start < end:
            self._remove_blocks_in_range(request_id, start, end)


def rocketkv_manager(kv_cache_manager) -> RocketKVManager | None:
    """The ROCKETKV manager of a vLLM ``KVCacheManager``, or None (another
    backend's engine)."""
    coordinator = getattr(kv_cache_manager, "coordinator", None)
    for manager in getattr(coordinator, "single_type_managers", ()):
        if isinstance(manager, RocketKVManager):
            return manager
    return None


def register_kv_cache_spec() -> None:
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    # The registry fills itself lazily with vLLM's own specs only while it is
    # empty, so fill it first or ours would be the only one.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(
        RocketKVAttentionSpec, RocketKVManager, uniform_type_base_spec=FullAttentionSpec)
