"""SPEC §1 "budget split from one number": a token budget split into the
prompt budget, top-k, page size and top-r, before any kernel rounding.

A leaf (no project import): the config resolves an engine's page size with
it, the plan a request's budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BudgetSplit:
    prompt_budget: int
    topk: int
    page_size: int
    topr: int


def split_token_budget(
    token_budget: int, num_prompt_tokens: int, max_new_tokens: int, head_dim: int
) -> BudgetSplit:
    """SPEC §1 "budget split from one number", before any kernel rounding."""
    total = num_prompt_tokens + max_new_tokens
    c = max(1.0, total / token_budget)
    alpha = min(0.2 + 0.06 * math.log2(c), 0.8)
    cap = max(int(total / c**alpha), min(2 * max_new_tokens, total))
    c2 = max(1.0, cap / token_budget)
    page_size = math.ceil(math.sqrt(c2))
    if page_size > c2:
        page_size = 1
    topr = min(max(round(head_dim * page_size / c2), 1), head_dim)
    return BudgetSplit(cap - max_new_tokens, token_budget // 2, page_size, topr)
