"""Stage 2: Hybrid Sparse Attention for one decode query."""

from __future__ import annotations

import torch

from rocketkv_vllm.algorithm.sinks import softmax_with_sinks


def hsa_page_probs(
    q: torch.Tensor,
    page_min: torch.Tensor,
    page_max: torch.Tensor,
    page_valid: torch.Tensor,
    topr: int,
    page_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group-averaged per-token page probabilities [Hkv, P] fp32.

    q: [Hq, d] one token's queries. page_min / page_max: [P, Hkv, d] per-page
    element-wise min / max keys (the KT cache). page_valid: [P] bool.
    page_tokens: optional [P] token count of each page (None: all equal).

    The reference (NVlabs/RocketKV) gives every token of a page the page's
    score and takes the softmax over tokens; per query head this is
    exp(s_p / tau) / sum_q n_q exp(s_q / tau), i.e. the page softmax with
    each page's term weighted by its token count n_q (a partly filled page
    counts less). The result is the probability of ONE token of page p,
    averaged over the GQA group (invalid pages: 0).
    """
    num_q_heads, d = q.shape
    num_pages_total, num_kv_heads, _ = page_min.shape
    group = num_q_heads // num_kv_heads
    qf = q.float().view(num_kv_heads, group, d)
    # Channel choice and sign are shared by the group.
    channels = qf.abs().sum(dim=1).topk(topr, dim=-1).indices  # [Hkv, r]
    positive = qf.sum(dim=1).gather(-1, channels) > 0  # [Hkv, r]
    idx = channels[:, None, :].expand(num_kv_heads, num_pages_total, topr)
    kmax = page_max.float().permute(1, 0, 2).gather(-1, idx)
    kmin = page_min.float().permute(1, 0, 2).gather(-1, idx)
    bound = torch.where(positive[:, None, :], kmax, kmin)  # [Hkv, P, r]
    q_r = qf.gather(-1, channels[:, None, :].expand(num_kv_heads, group, topr))
    scores = torch.einsum("kgr,kpr->kgp", q_r, bound)
    # SparQ temperature per query head.
    tau = torch.sqrt(d * q_r.abs().sum(-1) / qf.abs().sum(-1).clamp_min(1e-30))
    logits = scores / tau.clamp_min(1e-30)[..., None]
    logits = logits.masked_fill(~page_valid[None, None, :], float("-inf"))
    weight = page_valid.float()
    if page_tokens is not None:
        weight = weight * page_tokens.float()
    peak = logits.amax(dim=-1, keepdim=True)
    expd = torch.exp(logits - peak.masked_fill(peak == float("-inf"), 0.0))
    denom = (expd * weight[None, None, :]).sum(dim=-1, keepdim=True)
    return (expd / denom.clamp_min(1e-30)).mean(dim=1)  # [Hkv, P]


def hsa_select_pages(
    q: torch.Tensor,
    page_min: torch.Tensor,
    page_max: torch.Tensor,
    page_valid: torch.Tensor,
    topr: int,
    num_pages: int,
    force_pages: torch.Tensor | None = None,
    page_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pages each KV head attends to at this step: [Hkv, P] bool.

    The top-``num_pages`` valid pages by ``hsa_page_probs`` (all valid pages
    when there are no more of them). force_pages: optional [P] bool, pages
    selected IN ADDITION to the top ``num_pages`` of the other pages (the
    current page: it never takes one of the top-k slots).
    """
    probs = hsa_page_probs(q, page_min, page_max, page_valid, topr, page_tokens)
    num_kv_heads, num_pages_total = probs.shape
    forced = torch.zeros(num_pages_total, dtype=torch.bool, device=q.device)
    if force_pages is not None:
        forced = force_pages & page_valid
    candidates = page_valid & ~forced
    selected = forced[None, :].expand(num_kv_heads, -1).clone()
    if int(candidates.sum()) <= num_pages:
        selected |= candidates[None, :]
        return selected
    ranked = probs.masked_fill(~candidates[None, :], -1.0)
    top = ranked.topk(num_pages, dim=-1).indices
    selected.scatter_(1, top, True)
    return selected


def sparse_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    token_mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of q over the tokens each KV head selected.

    q: [Hq, d]; keys / values: [T, Hkv, d]; token_mask: [Hkv, T] bool (every
    head must keep at least one token); sinks: optional [Hq] fp32 sink logits
    (``algorithm.sinks``). Returns [Hq, d] fp32.
    """
    num_q_heads, d = q.shape
    num_kv_heads = keys.shape[1]
    group = num_q_heads // num_kv_heads
    qf = q.float().view(num_kv_heads, group, d)
    logits = torch.einsum("kgd,tkd->kgt", qf, keys.float()) * scale
    logits = logits.masked_fill(~token_mask[:, None, :], float("-inf"))
    sink = None if sinks is None else sinks.view(num_kv_heads, group)
    probs = softmax_with_sinks(logits, sink)
    out = torch.einsum("kgt,tkd->kgd", probs, values.float())
    return out.reshape(num_q_heads, d)
