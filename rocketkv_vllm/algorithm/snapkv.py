"""Stage 1: SnapKV-style selection of the prompt tokens each KV head keeps."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rocketkv_vllm.algorithm.sinks import softmax_with_sinks


def window_attention_scores(
    q_win: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention mass each prompt key gets from the observation window.

    q_win: [w, Hq, d], the queries of the last w prompt tokens.
    keys:  [N, Hkv, d], all prompt keys (RoPE applied), N >= w.
    sinks: optional [Hq] fp32 sink logits (``algorithm.sinks``): each query
    head's probabilities are the model's, the sink's share left out.
    Returns [Hkv, N - w] fp32: causal softmax(Q_win K^T * scale) per query
    head, summed over the window queries and the GQA group, window columns
    dropped.
    """
    w, num_q_heads, d = q_win.shape
    n, num_kv_heads, _ = keys.shape
    group = num_q_heads // num_kv_heads
    # [Hkv, G*w, d] @ [Hkv, d, N]: one contiguous bmm, the scale on the
    # (small) queries.
    q = (q_win.float() * scale).view(w, num_kv_heads, group, d)
    q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * w, d)
    logits = torch.bmm(q, keys.float().permute(1, 2, 0))
    # Only the window's own columns can lie in a query's future.
    window = logits.view(num_kv_heads, group, w, n)[..., n - w :]
    future = torch.ones(w, w, dtype=torch.bool, device=keys.device).triu_(1)
    window.masked_fill_(future, float("-inf"))
    sink = None
    if sinks is not None:  # row (g, i) of a KV head is query head g's
        sink = sinks.float().view(num_kv_heads, group, 1).expand(-1, -1, w)
        sink = sink.reshape(num_kv_heads, group * w)
    probs = softmax_with_sinks(logits, sink)
    return probs.sum(dim=1)[:, : n - w]


def pool_scores(scores: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """1-D max-pool along the sequence, stride 1, same length out."""
    return F.max_pool1d(scores[:, None, :], kernel_size, stride=1, padding=kernel_size // 2)[
        :, 0, :
    ]


def snapkv_keep_positions(
    q_win: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    prompt_budget: int,
    kernel_size: int,
    protect_from: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Positions each KV head keeps, sorted: [Hkv, prompt_budget] int64.

    Positions >= protect_from are always kept (default N - w: the window, as
    in the reference; the backend also protects the partly filled last block,
    which is kept in place). The rest of the budget goes to the highest pooled
    scores among positions < protect_from.
    """
    n = keys.shape[0]
    if protect_from is None:
        protect_from = n - q_win.shape[0]
    scores = window_attention_scores(q_win, keys, scale, sinks)
    return keep_positions_from_scores(scores, n, prompt_budget, kernel_size, protect_from)


def keep_positions_from_scores(
    scores: torch.Tensor,
    num_prompt_tokens: int,
    prompt_budget: int,
    kernel_size: int,
    protect_from: int,
) -> torch.Tensor:
    """Selection from window scores [Hkv, N - w] (see snapkv_keep_positions)."""
    n = num_prompt_tokens
    assert 0 <= protect_from <= scores.shape[1] and n > prompt_budget
    num_select = prompt_budget - (n - protect_from)
    assert num_select >= 0
    pooled = pool_scores(scores, kernel_size)
    chosen = pooled[:, :protect_from].topk(num_select, dim=-1).indices
    chosen = chosen.sort(dim=-1).values
    protected = torch.arange(protect_from, n, device=scores.device)
    return torch.cat([chosen, protected.expand(scores.shape[0], -1)], dim=-1)
