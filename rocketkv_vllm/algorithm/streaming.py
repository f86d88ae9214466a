"""Stage 1 baseline: StreamingLLM (Xiao et al., "Efficient Streaming Language
Models with Attention Sinks"): keep the first few prompt tokens (the attention
sinks) and the most recent ones, the same positions for every KV head. No
scores: the choice depends only on the prompt length and the budget."""

from __future__ import annotations

import torch

NUM_SINKS = 4  # the paper's default


def streaming_keep_positions(
    num_prompt_tokens: int,
    num_kv_heads: int,
    prompt_budget: int,
    num_sinks: int = NUM_SINKS,
    protect_from: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Positions each KV head keeps, sorted: [Hkv, prompt_budget] int64, the
    contract of ``snapkv_keep_positions``.

    The first ``num_sinks`` positions and the last ``prompt_budget -
    num_sinks``. Positions >= protect_from (default: none beyond those) are
    always kept: a protected tail longer than the recent share takes its
    room from the sinks. A budget <= num_sinks keeps sinks only (the first
    ``prompt_budget``); a budget >= the prompt keeps every position
    ([Hkv, N], the backend's identity path).
    """
    n = num_prompt_tokens
    if prompt_budget >= n:
        kept = torch.arange(n, device=device)
    else:
        num_protected = n - (n if protect_from is None else protect_from)
        assert 0 <= num_protected <= prompt_budget
        num_sinks_kept = max(0, min(num_sinks, prompt_budget - num_protected))
        num_recent = prompt_budget - num_sinks_kept
        sinks = torch.arange(num_sinks_kept, device=device)
        recent = torch.arange(n - num_recent, n, device=device)
        kept = torch.cat([sinks, recent])  # disjoint: sinks + recent = budget < n
    return kept.expand(num_kv_heads, -1)
