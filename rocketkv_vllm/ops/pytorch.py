"""RocketKV's steps in PyTorch on the paged cache: Stage 1's three steps
for one prompt and Stage 2 for a whole batch of decode tokens.

Stage 2 (``hsa_decode``) is the same math as ``tests/reference/paged.hsa_decode`` (its
oracle), for every compressed decode row of a step at once: no per-request
Python loop, no host sync, a fixed number of tensor ops per layer. This is
the path where Triton has no backend and the C++ kernel is not built (vLLM's
CPU build); the NVIDIA path runs the Triton kernels (``ops.triton``). A
row's view pages (compact pages first, then tail pages, see ``layout``) are
listed once per step by ``view_pages`` and shared by all layers.

Stage 1's steps (``window_scores``, ``compact_kept_tokens``,
``write_kt_pages``) have the same signatures as ``ops.triton``'s; the flow
that calls them is ``ops.base.Stage1.compress``. ``TorchStage1`` and
``TorchStage2`` are the stages the impl calls (``ops.base``'s interfaces).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rocketkv_vllm.algorithm import softmax_with_sinks, window_attention_scores
from rocketkv_vllm.cache_view import KVView, read_blocks_into, stored
from rocketkv_vllm.kernels.rows import DecodeRows
from rocketkv_vllm.layout import kt_bounds, kt_rows_of, physical_slots, split_kv
from rocketkv_vllm.ops.base import HsaRows, Stage1, Stage2

# ---- Stage 1 steps (one prompt)


def prompt_keys(k_cache: KVView, block_row: torch.Tensor, n: int) -> torch.Tensor:
    """Keys [n, Hkv, d] (fp32) of logical slots [0, n), read block by block
    (one copy, not per-token indexing: the AMX layout's tiles) into memory
    laid out [Hkv, d, n], the operand of the window scores' matmul."""
    _, num_heads, block_size, d = k_cache.shape
    blocks = block_row[: -(-n // block_size)].long()
    out = torch.empty(
        num_heads, d, len(blocks) * block_size, dtype=torch.float32, device=block_row.device
    )
    whole = out.view(num_heads, d, len(blocks), block_size).permute(2, 0, 3, 1)
    read_blocks_into(k_cache, blocks, whole)
    return out[:, :, :n].permute(2, 0, 1)


def window_scores(
    q_window, k_cache: KVView, block_row, n: int, scale: float, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """``algorithm.window_attention_scores`` of the request's prompt keys
    (sinks: optional [Hq] fp32 sink logits)."""
    return window_attention_scores(q_window, prompt_keys(k_cache, block_row, n), scale, sinks)


def compact_kept_tokens(
    k_cache: KVView,
    v_cache: KVView,
    block_row: torch.Tensor,
    kept: torch.Tensor,
) -> None:
    """Move head h's token at logical slot kept[h, j] to slot j, per head.

    kept: [Hkv, C] sorted ascending, so kept[h, j] >= j: gathering everything
    before writing makes the overlapping move safe.
    """
    num_heads, count = kept.shape
    if count == 0:
        return
    block_size = k_cache.shape[2]
    heads = torch.arange(num_heads, device=kept.device)[:, None].expand(-1, count)
    src_blocks, src_offsets = physical_slots(block_row, kept, block_size)
    dst = torch.arange(count, device=kept.device)[None, :].expand(num_heads, -1)
    dst_blocks, dst_offsets = physical_slots(block_row, dst, block_size)
    for cache in (k_cache, v_cache):
        store = stored(cache)  # fp8 (``fp8_kv``): the codes move, not values
        moved = store[src_blocks, heads, src_offsets].clone()
        store[dst_blocks, heads, dst_offsets] = moved


def write_kt_pages(
    k_cache: KVView,
    kt_cache: torch.Tensor,
    block_row: torch.Tensor,
    lo: int,
    hi: int,
    page_size: int,
) -> None:
    """Recompute the KT pages covering logical slots [lo, hi) (lo page aligned)
    from the keys in [lo, hi) only."""
    if hi <= lo:
        return
    assert lo % page_size == 0
    d = k_cache.shape[-1]
    block_size = k_cache.shape[2]
    num_pages = -(-(hi - lo) // page_size)
    slots = torch.arange(lo, lo + num_pages * page_size, device=k_cache.device)
    blocks, offsets = physical_slots(block_row, slots.clamp_max(hi - 1), block_size)
    keys = k_cache[blocks, :, offsets]
    keys = keys.float().view(num_pages, page_size, -1, d)  # [P, ps, Hkv, d]
    valid = (slots < hi).view(num_pages, page_size, 1, 1)
    kmin = keys.masked_fill(~valid, float("inf")).amin(dim=1)
    kmax = keys.masked_fill(~valid, float("-inf")).amax(dim=1)
    starts = slots[::page_size]
    blocks, offsets = physical_slots(block_row, starts, block_size)
    pages = offsets // page_size
    kt_cache[blocks, :, pages] = kt_rows_of(kt_cache, kmin, kmax)


# ---- Stage 2 (a batch of decode rows)


@dataclass
class ViewPages:
    """Every page of every row's view, padded to the batch's longest view.

    block, page: [B, P] physical block id and page index inside it;
    tokens: [B, P] tokens of the page that belong to the view (0 = padding);
    current: [B] index of the page holding the row's newest token.
    """

    block: torch.Tensor
    page: torch.Tensor
    tokens: torch.Tensor
    current: torch.Tensor


def view_pages(
    block_table: torch.Tensor,
    num_compact: torch.Tensor,
    tail_start: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    block_size: int,
    max_pages: int,
) -> ViewPages:
    """Pages of each row's view; max_pages (a Python int) >= every row's
    ceil(num_compact / ps) + ceil((seq_len - tail_start) / ps)."""
    device = block_table.device
    nc, ts, sl = (t.long()[:, None] for t in (num_compact, tail_start, seq_lens))
    compact_pages = (nc + page_size - 1) // page_size
    j = torch.arange(max_pages, device=device)[None, :]
    in_compact = j < compact_pages
    start = torch.where(in_compact, j * page_size, ts + (j - compact_pages) * page_size)
    end = torch.where(in_compact, nc, sl)
    tokens = (end - start).clamp(0, page_size)
    start = start.clamp(0, block_table.shape[1] * block_size - 1)
    block = block_table.long().gather(1, start // block_size)
    page = (start % block_size) // page_size
    last = sl - 1
    current = compact_pages[:, 0] + (last[:, 0] - ts[:, 0]) // page_size
    return ViewPages(block, page, tokens, current)


def update_kt(
    k_cache: KVView,
    kt_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
) -> None:
    """Fold each row's newest key (slot seq_len - 1, already stored) into its
    page's min/max; a token that opens a page starts it afresh."""
    d = k_cache.shape[-1]
    block_size = k_cache.shape[2]
    pos = seq_lens.long() - 1
    block = block_table.long().gather(1, (pos // block_size)[:, None])[:, 0]
    offset = pos % block_size
    page = offset // page_size
    key = k_cache[block, :, offset].float()  # [B, Hkv, d]
    old_min, old_max = kt_bounds(kt_cache[block, :, page], d)
    fresh = (pos % page_size == 0)[:, None, None]
    kmin = torch.where(fresh, key, torch.minimum(old_min.float(), key))
    kmax = torch.where(fresh, key, torch.maximum(old_max.float(), key))
    kt_cache[block, :, page] = kt_rows_of(kt_cache, kmin, kmax)


def select_pages(
    query: torch.Tensor,
    kt_cache: torch.Tensor,
    pages: ViewPages,
    topr: torch.Tensor,
    num_select: torch.Tensor,
    max_select: int,
    force_current_page: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top pages per row and KV head: (indices into the view [B, Hkv, n],
    valid [B, Hkv, n]), n = min(max_select + f, P) with f = 1 when
    force_current_page (the current page is an extra page, never one of
    the num_select), else 0; row b uses its first num_select[b] + f (the
    SparQ-tempered, group-averaged, token-count weighted page softmax of
    ``algorithm.hsa_page_probs``)."""
    batch, num_q_heads, d = query.shape
    num_kv_heads = kt_cache.shape[1]
    group = num_q_heads // num_kv_heads
    q = query.float().view(batch, num_kv_heads, group, d)
    # Channels: each row's top-r of the group's summed |q|, as a 0/1 mask.
    order = q.abs().sum(2).argsort(dim=-1, descending=True)  # [B, Hkv, d]
    ranks = torch.arange(d, device=q.device).expand(batch, num_kv_heads, d)
    chosen = torch.zeros_like(order, dtype=torch.bool).scatter_(
        -1, order, ranks < topr.long()[:, None, None]
    )
    positive = (q.sum(2) > 0)[:, :, None, :]  # [B, Hkv, 1, d]
    q_r = q * chosen[:, :, None, :]
    # Upper bound per channel: q * max where the group's sign is positive,
    # q * min elsewhere; one product with the page's [min | max] row.
    q_bound = torch.cat([q_r * ~positive, q_r * positive], dim=-1)  # [B, Hkv, G, 2d]
    heads = torch.arange(num_kv_heads, device=q.device)[None, :, None]
    kt = kt_cache[pages.block[:, None, :], heads, pages.page[:, None, :]]
    if kt.dtype == torch.uint8:  # fp8 rows: decoded [min | max]
        kt = torch.cat(kt_bounds(kt, d), dim=-1)
    kt = kt.float()  # [B, Hkv, P, 2d]
    scores = torch.matmul(q_bound, kt.transpose(-1, -2))  # [B, Hkv, G, P]
    tau = torch.sqrt(d * q_r.abs().sum(-1) / q.abs().sum(-1).clamp_min(1e-30))
    logits = scores / tau.clamp_min(1e-30)[..., None]
    valid_page = pages.tokens > 0  # [B, P]
    logits = logits.masked_fill(~valid_page[:, None, None, :], float("-inf"))
    # Softmax over tokens (the reference's): each page's term weighted by
    # its token count; the result is one token's probability.
    peak = logits.amax(dim=-1, keepdim=True)
    expd = torch.exp(logits - peak.masked_fill(peak == float("-inf"), 0.0))
    denom = torch.matmul(expd, pages.tokens.float()[:, None, :, None])  # [B, Hkv, G, 1]
    probs = (expd / denom.clamp_min(1e-30)).mean(dim=2)  # [B, Hkv, P]
    extra = 1 if force_current_page else 0
    if force_current_page:
        probs = probs.scatter(2, pages.current[:, None, None].expand(batch, num_kv_heads, 1), 2.0)
    # Padding pages sort last (below every real page's probability >= 0).
    probs = probs.masked_fill(~valid_page[:, None, :], -1.0)
    n = min(max_select + extra, probs.shape[-1])
    top = probs.topk(n, dim=-1).indices  # [B, Hkv, n]
    rank_ok = torch.arange(n, device=q.device) < num_select.long()[:, None, None] + extra
    valid = rank_ok & valid_page[:, None, :].expand_as(probs).gather(2, top)
    return top, valid


def reuse_selections(
    top: torch.Tensor,
    valid: torch.Tensor,
    pages: ViewPages,
    seq_lens: torch.Tensor,
    selections: torch.Tensor,
    sel_slot: torch.Tensor,
    reuse: torch.Tensor,
    num_select: torch.Tensor,
    force_current_page: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``select_pages``' (top, valid) with reusing (row, KV head)s' pages
    read from the store [S, Hkv, W] and the other slotted ones' written to
    it (the valid entries, -1 past them). A (row, head) reuses when its
    row's flag and slot are set and its n_use = min(num_select + f, P)
    stored entries are all pages of its view [0, P); else it keeps its
    fresh choice and writes it (``Stage2.decode``'s contract).

    Without a host sync: every (row, head) writes, those not writing to
    their own index -1, the store's last slot, which the caller keeps
    unassigned (``backend.reuse``). The page choice still runs for reuse
    rows (this path is the oracle, not the fast one)."""
    batch, num_kv_heads, n = top.shape
    width = selections.shape[-1]
    slot = sel_slot.long()
    chosen = torch.where(valid, top, -1)[..., :width]
    if width > n:
        chosen = torch.cat([chosen, chosen.new_full((batch, num_kv_heads, width - n), -1)], -1)
    stored = selections[slot].long()  # [B, Hkv, W]
    if width < n:
        stored = torch.cat([stored, stored.new_full((batch, num_kv_heads, n - width), -1)], -1)
    stored = stored[..., :n]
    num_pages = (pages.tokens > 0).sum(-1)[:, None, None]
    n_use = torch.minimum(num_select.long()[:, None, None] + int(force_current_page), num_pages)
    in_use = torch.arange(n, device=top.device) < n_use  # [B, 1, n]
    in_view = (stored >= 0) & (stored < num_pages)
    fits = n_use[..., 0] <= width  # (entries past W read as -1 above)
    reused = ((reuse != 0) & (slot >= 0))[:, None] & fits & (in_view | ~in_use).all(-1)
    writes = (slot >= 0)[:, None] & ~reused & (seq_lens > 0)[:, None]  # [B, Hkv]
    heads = torch.arange(num_kv_heads, device=top.device)
    selections[torch.where(writes, slot[:, None], -1), heads] = chosen.to(selections.dtype)
    reused = reused[..., None]
    top = torch.where(reused & in_use, stored, torch.where(reused, 0, top))
    valid = torch.where(reused, in_use, valid)
    return top, valid


def sparse_attention(
    query: torch.Tensor,
    k_cache: KVView,
    v_cache: KVView,
    pages: ViewPages,
    top: torch.Tensor,
    valid: torch.Tensor,
    page_size: int,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of each row's queries over its selected pages' tokens
    (sinks: optional [Hq] fp32 sink logits, ``algorithm.sinks``).
    Returns [B, Hq, d] in fp32."""
    batch, num_q_heads, d = query.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    n = top.shape[-1]
    block = pages.block[:, None, :].expand(-1, num_kv_heads, -1).gather(2, top)
    first = pages.page[:, None, :].expand(-1, num_kv_heads, -1).gather(2, top)
    count = pages.tokens[:, None, :].expand(-1, num_kv_heads, -1).gather(2, top)
    j = torch.arange(page_size, device=query.device)
    slot = first[..., None] * page_size + j  # [B, Hkv, n, ps]
    heads = torch.arange(num_kv_heads, device=query.device)[None, :, None, None]
    blocks = block[..., None].expand_as(slot)
    keys = k_cache[blocks, heads, slot].reshape(batch, num_kv_heads, n * page_size, d)
    values = v_cache[blocks, heads, slot].reshape(batch, num_kv_heads, n * page_size, d)
    ok = (valid[..., None] & (j < count[..., None])).reshape(batch, num_kv_heads, -1)
    q = query.float().view(batch, num_kv_heads, group, d)
    logits = torch.einsum("bkgd,bktd->bkgt", q, keys.float()) * scale
    logits = logits.masked_fill(~ok[:, :, None, :], float("-inf"))
    # Slots outside the view may hold anything (NaN too): zero them, as 0 * NaN
    # would poison the sum.
    values = values.float().masked_fill(~ok[..., None], 0.0)
    sink = None if sinks is None else sinks.view(1, num_kv_heads, group)
    out = torch.einsum("bkgt,bktd->bkgd", softmax_with_sinks(logits, sink), values)
    return out.reshape(batch, num_q_heads, d)


def hsa_decode(
    query: torch.Tensor,
    k_cache: KVView,
    v_cache: KVView,
    kt_cache: torch.Tensor,
    rows: DecodeRows,
    pages: ViewPages,
    num_select: torch.Tensor,
    page_size: int,
    scale: float,
    force_current_page: bool,
    sinks: torch.Tensor | None = None,
    selections: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stage 2 for one decode token per row: KT update, page choice, sparse
    attention. query [B, Hq, d] -> [B, Hq, d] in query.dtype. rows: the
    decode rows (``DecodeRows``; their block_table, seq_lens, topr,
    max_select, and sel_slot, reuse with a store), pages their
    ``view_pages``, num_select [B] (``HsaRows``'). sinks: optional [Hq]
    fp32 sink logits, in the sparse attention's softmax only (the page
    choice ranks the keys' own mass). selections: the selection store,
    read with the rows' slots and reuse flags (``ops.base.Stage2.decode``;
    ``reuse_selections``; None: they are not read)."""
    sel_slot, reuse = rows.store_columns(selections)
    update_kt(k_cache, kt_cache, rows.block_table, rows.seq_lens, page_size)
    top, valid = select_pages(
        query, kt_cache, pages, rows.topr, num_select, rows.max_select, force_current_page
    )
    if selections is not None:
        top, valid = reuse_selections(
            top,
            valid,
            pages,
            rows.seq_lens,
            selections,
            sel_slot,
            reuse,
            num_select,
            force_current_page,
        )
    out = sparse_attention(query, k_cache, v_cache, pages, top, valid, page_size, scale, sinks)
    return out.to(query.dtype)


# ---- the stages (``ops.base``'s interfaces)


class TorchStage1(Stage1):
    name = "PyTorch path"
    window_scores = staticmethod(window_scores)
    compact_kept_tokens = staticmethod(compact_kept_tokens)
    write_kt_pages = staticmethod(write_kt_pages)


class TorchStage2(Stage2):
    name = "batched PyTorch path"

    def prepare(self, rows: HsaRows) -> None:
        s = self.settings
        r = rows.decode_rows
        rows.prepared = view_pages(
            r.block_table,
            r.num_compact,
            r.tail_start,
            r.seq_lens,
            s.page_size,
            s.block_size,
            r.max_pages,
        )

    def decode(
        self,
        query,
        kv_cache,
        rows: HsaRows,
        scale,
        out=None,
        sinks=None,
        quant=None,
        selections=None,
    ):
        assert out is None, "the FULL-graph layout runs the Triton kernels only"
        s = self.settings
        k_cache, v_cache = split_kv(kv_cache, self.kv_layout, quant)
        return hsa_decode(
            query,
            k_cache,
            v_cache,
            self._kt(kv_cache),
            rows.decode_rows,
            rows.prepared,
            rows.num_select,
            s.page_size,
            scale,
            s.force_current_page,
            sinks=sinks,
            selections=selections,
        )
