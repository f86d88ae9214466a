"""The budget split, in one place: ``kernel_budget`` turns an engine's knobs
and a prompt length into the numbers the kernels run with (page size,
prompt budget, top-k, top-r), by SPEC §1's "budget split from one number"
(``split_token_budget``) rounded for the kernels.

A leaf (no project import): the config takes an engine's page size from it
(``resolve_settings``), the plan a request's numbers (``plan_request``), the
CUDA-graph shapes the engine's selection (``backend.graphs``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# Tokens per KT page when neither the user nor a token budget sets one.
DEFAULT_PAGE_SIZE = 4
# Fewest tokens Stage 2 selects under a token budget (the whole budget when
# it is smaller): at B = 128 half of B (64 tokens, 16 pages of 4) found 10 of
# 32 needles on SmolLM2 at 6k where 128 tokens found 15, dense's 15
# (docs/results.md, issue 40).
MIN_TOPK_TOKENS = 128
# The most view pages a request may have: Stage 2's Triton selection counts a
# row's pages in 21-bit fields (``kernels.hsa_score.MAX_SELECT_ROW``);
# ``config.resolve_settings`` refuses a page size that allows more.
MAX_VIEW_PAGES = (1 << 21) - 1


def max_view_pages(max_model_len: int, page_size: int) -> int:
    """An upper bound on any request's view pages: both regions together
    hold at most ``max_model_len`` tokens, and each may end in a partial
    page."""
    return -(-max_model_len // page_size) + 1


@dataclass(frozen=True)
class BudgetSplit:
    """SPEC §1's split as the reference computes it, before kernel rounding."""

    prompt_budget: int
    topk: int
    page_size: int
    topr: int


@dataclass(frozen=True)
class KernelBudget:
    """The numbers the kernels run with for one prompt."""

    page_size: int  # tokens per KT page (one per engine)
    prompt_budget: int  # tokens each KV head keeps of a compressed prompt
    topk: int  # tokens Stage 2 selects per step (whole pages under a token budget)
    topr: int  # query channels that score the pages

    @property
    def pages_selected(self) -> int:
        return pages_selected(self.topk, self.page_size)


class BudgetKnobs(Protocol):
    """What ``kernel_budget`` reads of a ``RocketKVConfig`` or ``RocketKVSettings``."""

    @property
    def token_budget(self) -> int | None: ...
    @property
    def prompt_budget(self) -> int: ...
    @property
    def topk(self) -> int: ...
    @property
    def topr(self) -> int: ...
    @property
    def page_size(self) -> int | None: ...
    @property
    def window_size(self) -> int: ...
    @property
    def max_new_tokens(self) -> int: ...


def kernel_budget(
    knobs: BudgetKnobs, num_prompt_tokens: int, *, head_dim: int, block_size: int
) -> KernelBudget:
    """The page size, prompt budget, top-k and top-r for a prompt of
    ``num_prompt_tokens`` tokens.

    With ``knobs.token_budget`` B, SPEC §1's split rounded for the kernels:

    - page size: ``knobs.page_size``; when None, the split's rounded up to a
      power of two, at most one block. KT pages sit inside the KV blocks, so
      an engine has one: ``resolve_settings`` asks for its longest prompt;
    - prompt budget: the split's, at least ``prompt_budget_floor``;
    - top-k: half of B, at least ``MIN_TOPK_TOKENS`` (at most B), in whole
      pages (``budget_pages_selected``);
    - top-r: the whole head (``head_dim``), not the split's channel cut
      (``split_token_budget``): on Gemma 3 270M (head dim 256) at B = 256 the
      cut (176 of 256 channels) found 15 of 32 needles where every channel
      found 32 of 32, at the same prompt budget and top-k (docs/results.md,
      2026-12-05); TensorRT-LLM's RocketKV also defaults to the head dim. The
      chosen channels are scattered, so the Triton kernels' loads touch
      most of a KT row either way; the counted cost is ~d / cut more KT.

    Without one, the explicit knobs as given (top-r resolved: the whole head
    when none, ``resolve_settings``), page size ``DEFAULT_PAGE_SIZE`` (at most
    one block) when none.

    Top-k does not depend on the prompt length, nor does the page size once
    the knobs hold one (an engine's settings always do).
    """
    page_size = knobs.page_size
    if knobs.token_budget is None:
        if page_size is None:
            page_size = min(DEFAULT_PAGE_SIZE, block_size)
        return KernelBudget(page_size, knobs.prompt_budget, knobs.topk, knobs.topr)
    budget, max_new = knobs.token_budget, knobs.max_new_tokens
    cap, ratio = _compression(budget, num_prompt_tokens, max_new)
    if page_size is None:
        page_size = min(block_size, pow2_at_least(_page_size(ratio)))
    return KernelBudget(
        page_size=page_size,
        prompt_budget=max(cap - max_new, prompt_budget_floor(knobs.window_size, block_size)),
        topk=budget_pages_selected(budget, page_size) * page_size,
        topr=head_dim,
    )


def split_token_budget(
    token_budget: int, num_prompt_tokens: int, max_new_tokens: int, head_dim: int
) -> BudgetSplit:
    """SPEC §1 "budget split from one number", before any kernel rounding:
    the reference's numbers (``kernel_budget`` rounds them, keeps every
    channel instead of this top-r, and selects at least ``MIN_TOPK_TOKENS``)."""
    cap, ratio = _compression(token_budget, num_prompt_tokens, max_new_tokens)
    page_size = _page_size(ratio)
    return BudgetSplit(
        cap - max_new_tokens, token_budget // 2, page_size, _topr(head_dim, page_size, ratio, 1)
    )


def spec_topr(
    token_budget: int, num_prompt_tokens: int, max_new_tokens: int, head_dim: int, page_size: int
) -> int:
    """SPEC §1's top-r for pages of ``page_size``, in 16-channel lanes within
    [16, head_dim]: what ``kernel_budget`` ran with before it kept every
    channel (issue 40); for comparisons (``rocketkv_eval.accuracy``)."""
    _, ratio = _compression(token_budget, num_prompt_tokens, max_new_tokens)
    return _topr(head_dim, page_size, ratio, 16)


def prompt_budget_floor(window_size: int, block_size: int) -> int:
    """The fewest tokens a compressed prompt keeps: the observation window
    and the partly filled tail block always stay, so the budget must cover
    both for the eviction to be well defined."""
    return window_size + block_size


def budget_pages_selected(token_budget: int, page_size: int) -> int:
    """Pages Stage 2 selects per step for a request planned with this token
    budget: top-k is half the budget but at least ``MIN_TOPK_TOKENS`` (the
    whole budget when it is smaller), in whole pages."""
    topk = max(token_budget // 2, min(token_budget, MIN_TOPK_TOKENS))
    return pages_selected(topk, page_size)


def pages_selected(topk, page_size: int):
    """Pages Stage 2 selects per step for a top-k of ``topk`` tokens (a
    forced current page comes on top): ints or numpy arrays."""
    if isinstance(topk, np.ndarray):
        return np.maximum(topk // page_size, 1)
    return max(int(topk) // page_size, 1)


def pow2_at_least(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1.0, x))))


def _compression(token_budget: int, num_prompt_tokens: int, max_new_tokens: int):
    """SPEC §1: ``cap``, the tokens of prompt and generation kept after
    prefill, and the ratio by which Stage 2 still compresses them."""
    total = num_prompt_tokens + max_new_tokens
    c = max(1.0, total / token_budget)
    alpha = min(0.2 + 0.06 * math.log2(c), 0.8)
    cap = max(int(total / c**alpha), min(2 * max_new_tokens, total))
    return cap, max(1.0, cap / token_budget)


def _page_size(ratio: float) -> int:
    page_size = math.ceil(math.sqrt(ratio))
    return 1 if page_size > ratio else page_size


def _topr(head_dim: int, page_size: int, ratio: float, lanes: int) -> int:
    """SPEC's channels that keep Stage 2 at ``ratio`` with pages of
    ``page_size``, in whole ``lanes``, within [lanes, head_dim]."""
    topr = round(head_dim * page_size / ratio / lanes) * lanes
    return min(max(topr, lanes), head_dim)
