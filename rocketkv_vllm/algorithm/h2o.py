"""Stage 1 baseline: H2O (Zhang et al., "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models"): a prompt token's
score is the attention it received from every prompt query (causal softmax
rows, summed); each KV head keeps the most recent tokens plus the
highest-scoring of the rest.

The scores accumulate chunk by chunk, as chunked prefill delivers the prompt:
a chunk's queries see every key so far, so its contribution is final when
the chunk is done and no step ever needs all of the prompt's queries.
"""

from __future__ import annotations

import torch

from rocketkv_vllm.algorithm.sinks import softmax_with_sinks

DEFAULT_RECENT = 32  # rocketkv.window_size's default: SnapKV's observation window


def h2o_chunk_scores(
    q_chunk: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention each key so far gets from one prefill chunk's queries.

    q_chunk: [c, Hq, d], the queries of prompt positions T - c .. T - 1.
    keys:    [T, Hkv, d], every key so far, this chunk's included (RoPE
    applied). sinks: optional [Hq] fp32 sink logits (``algorithm.sinks``).
    Returns [Hkv, T] fp32: causal softmax(Q K^T * scale) per query head,
    summed over the chunk's queries and the GQA group.
    """
    c, num_q_heads, d = q_chunk.shape
    t, num_kv_heads, _ = keys.shape
    group = num_q_heads // num_kv_heads
    q = (q_chunk.float() * scale).view(c, num_kv_heads, group, d)
    q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * c, d)
    logits = torch.bmm(q, keys.float().permute(1, 2, 0)).view(num_kv_heads, group, c, t)
    # Query i of the chunk sits at T - c + i: only the chunk's own columns
    # can lie in its future.
    future = torch.ones(c, c, dtype=torch.bool, device=keys.device).triu_(1)
    logits[..., t - c :].masked_fill_(future, float("-inf"))
    sink = None
    if sinks is not None:  # one sink logit per query head, for each of its rows
        sink = sinks.float().view(num_kv_heads, group, 1).expand(-1, -1, c)
    probs = softmax_with_sinks(logits, sink)
    return probs.sum(dim=(1, 2))


def h2o_accumulate(
    scores: torch.Tensor,
    q_chunk: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Add one prefill chunk's contribution to a request's running scores.

    scores: [Hkv, >= T] fp32, zeros before the first chunk (allocate the
    prompt's length once); columns >= T are keys not seen yet and stay
    unchanged. Other arguments: ``h2o_chunk_scores``. Returns ``scores``,
    updated in place.
    """
    scores[:, : keys.shape[0]] += h2o_chunk_scores(q_chunk, keys, scale, sinks)
    return scores


def h2o_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """H2O scores of a whole prompt at once: [Hkv, N] fp32 from queries
    [N, Hq, d] and keys [N, Hkv, d] (the prompt as one chunk)."""
    return h2o_chunk_scores(queries, keys, scale, sinks)


def h2o_keep_positions(
    scores: torch.Tensor,
    prompt_budget: int,
    recent: int = DEFAULT_RECENT,
    protect_from: int | None = None,
) -> torch.Tensor:
    """Positions each KV head keeps, sorted: [Hkv, prompt_budget] int64, the
    contract of ``snapkv_keep_positions``.

    scores: [Hkv, N], ``h2o_scores`` or the accumulator after the last chunk.
    Positions >= min(N - recent, protect_from) are always kept (protect_from:
    the backend's partly filled last block); the rest of the budget goes to
    the highest scores before them. Ties: the earlier position wins (a stable
    sort), so the choice is the same on every device. A budget >= N keeps
    every position ([Hkv, N], the backend's identity path).
    """
    num_kv_heads, n = scores.shape
    if prompt_budget >= n:
        return torch.arange(n, device=scores.device).expand(num_kv_heads, -1)
    start = max(0, n - recent)
    if protect_from is not None:
        start = min(start, protect_from)
    num_select = prompt_budget - (n - start)
    assert num_select >= 0, "the recent window and protected tail exceed the budget"
    order = scores[:, :start].argsort(dim=-1, descending=True, stable=True)
    chosen = order[:, :num_select].sort(dim=-1).values
    protected = torch.arange(start, n, device=scores.device)
    return torch.cat([chosen, protected.expand(num_kv_heads, -1)], dim=-1)
