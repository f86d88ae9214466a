"""What RocketKV does with one request, and the page geometry of its view.

A request's plan is a pure function of the engine's settings, its prompt
length and the budget it may set (``requests``), so every process that acts
on a request (scheduler: blocks freed, prefix caching; workers: Stage 1 /
Stage 2; API server: metrics) derives the same plan without being told.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rocketkv_vllm.budget import kernel_budget, pages_selected
from rocketkv_vllm.config import RocketKVSettings


def cdiv(a, b):
    """Ceiling division of ints or numpy arrays."""
    return -(-a // b)


def view_pages(num_compact, tail_start, seq_len, page_size: int):
    """Pages of a request's view (compacted tokens, then the tail from
    ``tail_start``), each region starting a fresh page: ints or arrays."""
    return cdiv(num_compact, page_size) + cdiv(seq_len - tail_start, page_size)


@dataclass(frozen=True)
class RequestPlan:
    """What RocketKV does with one request, derived from its prompt length.

    After compression the request's KV per head is: slots [0, num_compact)
    hold the kept tokens before ``tail_start`` in original order, and the
    block holding the prompt's last tokens stays in place from ``tail_start``
    (block aligned), followed by generated tokens at their logical slots.
    """

    num_prompt_tokens: int
    compress: bool
    prompt_budget: int
    topk: int
    topr: int
    num_compact: int
    tail_start: int

    def freed_block_range(self, block_size: int) -> tuple[int, int]:
        """Logical block indices [start, end) a compressed request gives back."""
        if not self.compress:
            return (0, 0)
        return (cdiv(self.num_compact, block_size), self.tail_start // block_size)

    def compact_blocks(self, block_size: int) -> int:
        """Logical blocks [0, k) Stage 1 compacts the kept tokens into: k is
        0 when it moves no K/V (not compressed, or ``evict`` off)."""
        if not self.compress or self.num_compact >= self.tail_start:
            return 0
        return cdiv(self.num_compact, block_size)

    def window_hit_cap(self, window_size: int, block_size: int) -> int:
        """The longest prefix-cache hit (tokens) that still computes the
        prompt's last ``window_size`` tokens, whose queries Stage 1 needs."""
        return max(self.num_prompt_tokens - window_size, 0) // block_size * block_size

    def pages_selected(self, page_size: int) -> int:
        return pages_selected(self.topk, page_size)

    def kept_tokens(self) -> int:
        """KV tokens each KV head keeps of the prompt."""
        return self.prompt_budget if self.compress else self.num_prompt_tokens


def plan_request(
    settings: RocketKVSettings, num_prompt_tokens: int, token_budget: int | None = None
) -> RequestPlan:
    """The plan for a prompt of this length; ``token_budget`` is the
    request's own (``requests``): None keeps the engine's settings, 0 serves
    the request uncompressed, else the split of that budget at the engine's
    page size. The numbers are ``budget.kernel_budget``'s."""
    n = num_prompt_tokens
    tail_start = (n // settings.block_size) * settings.block_size
    if token_budget == 0:
        return RequestPlan(n, False, n, settings.topk, settings.topr, 0, tail_start)
    if token_budget is not None:
        settings = replace(settings, token_budget=token_budget)
    budget = kernel_budget(settings, n, head_dim=settings.head_dim, block_size=settings.block_size)
    prompt_budget, topk, topr = budget.prompt_budget, budget.topk, budget.topr
    if not settings.evict:
        # Stage 2 only: keep all n tokens (identity compaction, nothing
        # freed: num_compact == tail_start); sparse decode pays off only
        # when the prompt exceeds the per-step selection. (The backend still
        # collects the window queries of a compressed prompt, so it must
        # also be longer than the window, as with eviction.)
        compress = n > max(topk, settings.window_size)
        return RequestPlan(n, compress, n, topk, topr, tail_start if compress else 0, tail_start)
    compress = n > prompt_budget
    num_compact = prompt_budget - (n - tail_start) if compress else 0
    return RequestPlan(n, compress, prompt_budget, topk, topr, num_compact, tail_start)


class PlanCache:
    """``plan_request`` for one engine's settings, memoised by (prompt length,
    request budget). Plans are looked up for every row of every step (builder)
    and every scheduled request (block manager); hashing the settings for each
    lookup would cost more than the plan itself."""

    MAX_ENTRIES = 1 << 16

    def __init__(self, settings: RocketKVSettings) -> None:
        self.settings = settings
        self._plans: dict[tuple[int, int | None], RequestPlan] = {}

    def __call__(self, num_prompt_tokens: int, token_budget: int | None = None) -> RequestPlan:
        key = (num_prompt_tokens, token_budget)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= self.MAX_ENTRIES:
                self._plans.clear()
            plan = self._plans[key] = plan_request(self.settings, *key)
        return plan
