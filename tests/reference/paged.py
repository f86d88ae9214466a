"""RocketKV per request on vLLM's paged KV cache, in plain PyTorch: the
reference and test oracle of every implementation (``ops``, ``kernels``);
lives under ``tests/``, out of the wheel.

Stage 1 (``snapkv_compress``) and Stage 2 (``hsa_decode``) for one request,
written for clarity with host syncs and per-request loops; ``hsa_decode_rows``
runs a batch row by row. The engine never calls this module: it runs
the Stage classes of ``ops`` (chosen by ``backend.stages``). Layout and views: ``layout``.
"""

from __future__ import annotations

import torch

from rocketkv_vllm.algorithm import hsa_select_pages, softmax_with_sinks, sparse_attention
from rocketkv_vllm.algorithm.snapkv import keep_positions_from_scores
from rocketkv_vllm.layout import kt_bounds, physical_slots
from rocketkv_vllm.ops.pytorch import compact_kept_tokens, window_scores, write_kt_pages
from rocketkv_vllm.plan import pages_selected


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new tokens' K/V at vLLM's flat slot ids (block * bs + offset)."""
    block_size = k_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    # [T, Hkv, d] -> cache[block, :, offset, :]
    k_cache[blocks, :, offsets] = key[valid].to(k_cache.dtype)
    v_cache[blocks, :, offsets] = value[valid].to(v_cache.dtype)


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_row: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [T, Hkv, d] of logical slots shared by all heads."""
    blocks, offsets = physical_slots(block_row, slots, k_cache.shape[2])
    return k_cache[blocks, :, offsets], v_cache[blocks, :, offsets]


def view_page_starts(
    num_compact: int, tail_start: int, seq_len: int, page_size: int, device
) -> torch.Tensor:
    """First logical slot of every page of a request's view."""
    compact = torch.arange(0, num_compact, page_size, device=device)
    tail = torch.arange(tail_start, seq_len, page_size, device=device)
    return torch.cat([compact, tail])


def dense_attention(
    query: torch.Tensor,
    q_positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_row: torch.Tensor,
    seq_len: int,
    scale: float,
    chunk: int = 512,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of queries [T, Hq, d] at q_positions over logical
    slots [0, seq_len); sinks: optional [Hq] fp32 sink logits
    (``algorithm.sinks``). Returns [T, Hq, d] in query.dtype."""
    num_q_heads = query.shape[1]
    keys, values = gather_kv(
        k_cache, v_cache, block_row, torch.arange(seq_len, device=query.device)
    )
    group = num_q_heads // keys.shape[1]
    k = keys.transpose(0, 1).repeat_interleave(group, dim=0).to(query.dtype)
    v = values.transpose(0, 1).repeat_interleave(group, dim=0).to(query.dtype)
    out = torch.empty_like(query)
    key_pos = torch.arange(seq_len, device=query.device)
    for start in range(0, query.shape[0], chunk):
        q = query[start : start + chunk].transpose(0, 1)  # [Hq, t, d]
        mask = key_pos[None, :] <= q_positions[start : start + chunk, None]
        if sinks is None:
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask[None], scale=scale
            )
        else:  # SDPA has no sinks: the same attention in fp32, by hand
            logits = torch.matmul(q.float(), k.float().transpose(1, 2)) * scale
            logits = logits.masked_fill(~mask[None], float("-inf"))
            probs = softmax_with_sinks(logits, sinks.view(-1, 1))
            o = torch.matmul(probs, v.float()).to(query.dtype)
        out[start : start + chunk] = o.transpose(0, 1)
    return out


def snapkv_compress(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kt_cache: torch.Tensor,
    block_row: torch.Tensor,
    q_window: torch.Tensor,
    num_prompt_tokens: int,
    prompt_budget: int,
    tail_start: int,
    kernel_size: int,
    page_size: int,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stage 1 on the paged cache of one request: choose, compact, build KT.

    sinks: optional [Hq] fp32 sink logits of the layer (the window scores'
    softmax, ``algorithm.sinks``).
    Returns the kept positions [Hkv, prompt_budget] (for tests and stats).
    With prompt_budget >= num_prompt_tokens every position is kept
    (tail_start is then num_compact: the view is the whole prompt) and only
    the KT pages are written. Ties among pooled scores may be broken
    differently by the kernels, so their kept sets can differ on plateaus
    (equal scores).
    """
    n = int(num_prompt_tokens)
    window = q_window.shape[0]
    if prompt_budget >= n:
        # Nothing to evict (rocketkv.evict=false): identity selection, no
        # scoring, no move; only the KT pages of the whole prompt.
        write_kt_pages(k_cache, kt_cache, block_row, 0, n, page_size)
        return torch.arange(n, device=k_cache.device).expand(k_cache.shape[1], n)
    scores = window_scores(q_window, k_cache, block_row, n, scale, sinks)
    kept = keep_positions_from_scores(
        scores, n, prompt_budget, kernel_size, protect_from=min(n - window, tail_start)
    )
    num_compact = prompt_budget - (n - tail_start)
    compact_kept_tokens(k_cache, v_cache, block_row, kept[:, :num_compact])
    write_kt_pages(k_cache, kt_cache, block_row, 0, num_compact, page_size)
    write_kt_pages(k_cache, kt_cache, block_row, tail_start, n, page_size)
    return kept


def hsa_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kt_cache: torch.Tensor,
    block_row: torch.Tensor,
    num_compact: int,
    tail_start: int,
    seq_len: int,
    topk: int,
    topr: int,
    page_size: int,
    scale: float,
    force_current_page: bool = False,
    sinks: torch.Tensor | None = None,
    selected: torch.Tensor | None = None,
    return_selected: bool = False,
):
    """Stage 2 for one token at position seq_len - 1 (its K/V already stored):
    update its KT page, choose pages, attend exactly. query [Hq, d] -> [Hq, d]
    (and, with return_selected, the chosen pages [Hkv, P] as a mask).

    selected: a mask [Hkv, P] chosen at an earlier step of the same view
    page (``rocketkv.reselect_every``): attend those pages, choose none.

    Page choice: the top max(topk // page_size, 1) pages by the token-count
    weighted page softmax (``algorithm.hsa_page_probs``); with
    force_current_page the newest token's page is selected on top of them.
    sinks: optional [Hq] fp32 sink logits, in the exact attention's softmax
    only (``algorithm.sinks``); the page choice does not see them."""
    d = k_cache.shape[-1]
    block_size = k_cache.shape[2]
    pos = seq_len - 1
    page_lo = pos - pos % page_size
    write_kt_pages(k_cache, kt_cache, block_row, page_lo, seq_len, page_size)

    starts = view_page_starts(num_compact, tail_start, seq_len, page_size, k_cache.device)
    blocks, offsets = physical_slots(block_row, starts, block_size)
    kt_min, kt_max = kt_bounds(kt_cache[blocks, :, offsets // page_size], d)  # [P, Hkv, d]
    page_valid = torch.ones(starts.shape[0], dtype=torch.bool, device=starts.device)
    region_end = torch.where(starts < tail_start, num_compact, seq_len)
    page_tokens = (region_end - starts).clamp(0, page_size)
    force = None
    if force_current_page:
        # An extra page: the top-k pages come from the others.
        force = starts == page_lo
    if selected is None:
        selected = hsa_select_pages(
            query,
            kt_min,
            kt_max,
            page_valid,
            topr,
            pages_selected(topk, page_size),
            force,
            page_tokens,
        )  # [Hkv, P]

    # Tokens of the view, page by page; slots past each region's end masked.
    slots = (starts[:, None] + torch.arange(page_size, device=starts.device)).flatten()
    in_view = slots < region_end.repeat_interleave(page_size)
    keys, values = gather_kv(k_cache, v_cache, block_row, slots.clamp_max(seq_len - 1))
    token_mask = selected.repeat_interleave(page_size, dim=1) & in_view[None, :]
    out = sparse_attention(query, keys, values, token_mask, scale, sinks).to(query.dtype)
    return (out, selected) if return_selected else out


def hsa_decode_rows(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kt_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_compact: torch.Tensor,
    tail_start: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: torch.Tensor,
    topr: torch.Tensor,
    page_size: int,
    scale: float,
    max_pages: int | None = None,
    max_select: int | None = None,
    force_current_page: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged.hsa_decode`` row by row (host syncs; the oracle).
    max_pages / max_select are accepted for signature parity and ignored."""
    out = torch.zeros_like(query)
    for b in range(query.shape[0]):
        seq = int(seq_lens[b])
        if seq <= 0:
            continue
        out[b] = hsa_decode(
            query[b],
            k_cache,
            v_cache,
            kt_cache,
            block_table[b],
            int(num_compact[b]),
            int(tail_start[b]),
            seq,
            int(topk[b]),
            int(topr[b]),
            page_size,
            scale,
            force_current_page,
            sinks,
        )
    return out
