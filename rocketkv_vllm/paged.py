"""RocketKV steps on vLLM's paged KV cache, in PyTorch (reference path).

Layout (one attention layer, LBHNC, what vLLM hands the backend):
  kv_cache [num_blocks, Hkv, block_size, 2*d], shared with vLLM's own
      attention backend, which decides where K and V sit inside a block
      (``split_kv``). Everything below works on the two views
      k_cache / v_cache [num_blocks, Hkv, block_size, d] with any strides.
  kt_cache [num_blocks, Hkv, block_size // page_size, 2*d]: per page of
      page_size slots, element-wise min key in [..., :d], max key in [..., d:].
      It lives in the padding vLLM allocates after each block (see
      ``kt_cache_view``), so it is counted and freed with the block; the KT
      page table of a sequence is therefore its block table. With
      kt_dtype "fp8_e4m3" it is uint8 [..., 2*d + 16] instead: rows of
      ``algorithm.kt_fp8`` (outward-rounded fp8 codes and a scale); every
      implementation tells the two apart by the tensor's dtype.

A request's logical slot s lives at block ``block_row[s // bs]``, offset
``s % bs``. After compression the slots a request attends to are its
*view*: [0, num_compact) (kept tokens, compacted per head) and
[tail_start, seq_len) (last prompt block kept in place, then generated
tokens). Pages of the view start at 0 and at tail_start, page_size apart.

The Triton kernels in ``rocketkv_vllm.kernels`` implement the same functions
on the same layout; these are their oracle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rocketkv_vllm.algorithm import (
    hsa_select_pages,
    kt_fp8,
    sparse_attention,
    window_attention_scores,
)
from rocketkv_vllm.algorithm.snapkv import keep_positions_from_scores
from rocketkv_vllm.plan import pages_selected


def kt_row_bytes(head_dim: int, dtype: torch.dtype, kt_dtype: str) -> int:
    """Bytes of one KT row (one page, one KV head)."""
    if kt_dtype == "fp8_e4m3":
        return kt_fp8.row_bytes(head_dim)
    assert kt_dtype == "auto", kt_dtype
    return 2 * head_dim * dtype.itemsize


def kt_cache_view(kv_cache: torch.Tensor, page_size: int, kt_dtype: str = "auto") -> torch.Tensor:
    """The KT pages stored in the per-block padding behind ``kv_cache``:
    [num_blocks, Hkv, pages, 2d] in the cache dtype, or uint8
    [num_blocks, Hkv, pages, 2d + 16] fp8 rows (``algorithm.kt_fp8``)."""
    num_blocks, num_heads, block_size, width = kv_cache.shape
    pages = block_size // page_size
    size = kv_cache.element_size()
    kv_bytes = num_heads * block_size * width * size
    row = kt_row_bytes(width // 2, kv_cache.dtype, kt_dtype)
    assert kv_cache.stride(0) * size >= kv_bytes + num_heads * pages * row, (
        "KV block has no room for the KT cache: was the ROCKETKV spec used?"
    )
    rows = torch.as_strided(
        kv_cache.view(torch.uint8),  # its last dim is contiguous
        size=(num_blocks, num_heads, pages, row),
        stride=(kv_cache.stride(0) * size, pages * row, row, 1),
        storage_offset=kv_cache.storage_offset() * size + kv_bytes,
    )
    return rows if kt_dtype == "fp8_e4m3" else rows.view(kv_cache.dtype)


def kt_bounds(kt_rows: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) keys [..., d] of KT rows gathered from a ``kt_cache_view``
    (fp32 for fp8 rows, the cache dtype otherwise)."""
    if kt_rows.dtype == torch.uint8:
        return kt_fp8.decode_rows(kt_rows, head_dim)
    return kt_rows[..., :head_dim], kt_rows[..., head_dim:]


def kt_rows_of(kt_cache: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """KT rows in ``kt_cache``'s format for min and max keys [..., d]."""
    if kt_cache.dtype == torch.uint8:
        return kt_fp8.encode_rows(kmin, kmax)
    return torch.cat([kmin, kmax], dim=-1).to(kt_cache.dtype)


KV_LAYOUTS = ("token", "head_rows", "cpu_vec", "cpu_amx")


def split_kv(kv_cache: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views [num_blocks, Hkv, block_size, d] of a layer's cache.

    "token": K|V on the last dim of every token (vLLM's FLASH_ATTN and
    TRITON_ATTN); "head_rows": each head's block is [2 * block_size, d], K
    rows first, then V rows; "cpu_vec": the same halves, but K stored
    transposed, [d, block_size] (what vLLM's CPU_ATTN writes with its vec
    and vec16 kernels; the K view's last dim then has stride block_size);
    "cpu_amx": CPU_ATTN's AMX tiles (``packed_kv.PackedKV`` accessors, not
    tensors: the PyTorch path only).
    """
    num_blocks, num_heads, block_size, width = kv_cache.shape
    d = width // 2
    if layout == "token":
        return kv_cache[..., :d], kv_cache[..., d:]
    if layout == "head_rows":
        rows = kv_cache.view(num_blocks, num_heads, 2 * block_size, d)
        return rows[:, :, :block_size], rows[:, :, block_size:]
    if layout == "cpu_vec":
        block_stride, head_stride = kv_cache.stride(0), kv_cache.stride(1)
        shape = (num_blocks, num_heads, block_size, d)
        offset = kv_cache.storage_offset()
        k = kv_cache.as_strided(shape, (block_stride, head_stride, 1, block_size), offset)
        v = kv_cache.as_strided(shape, (block_stride, head_stride, d, 1), offset + block_size * d)
        return k, v
    if layout == "cpu_amx":
        # Tile-packed (CPU_ATTN's AMX kernels): per-token accessors, PyTorch only.
        from rocketkv_vllm.packed_kv import split_amx

        return split_amx(kv_cache)
    raise ValueError(f"unknown KV layout {layout!r}: allowed {KV_LAYOUTS}")


def physical_slots(block_row: torch.Tensor, slots: torch.Tensor, block_size: int):
    """(block ids, offsets) of logical slots of one request."""
    return block_row[slots // block_size].long(), slots % block_size


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


def prompt_keys(k_cache, block_row: torch.Tensor, n: int) -> torch.Tensor:
    """Keys [n, Hkv, d] (fp32) of logical slots [0, n), read block by block
    (one copy, not per-token indexing: the AMX layout's tiles) into memory
    laid out [Hkv, d, n], the operand of the window scores' matmul."""
    _, num_heads, block_size, d = k_cache.shape
    blocks = block_row[: -(-n // block_size)].long()
    out = torch.empty(
        num_heads, d, len(blocks) * block_size, dtype=torch.float32, device=block_row.device
    )
    whole = out.view(num_heads, d, len(blocks), block_size).permute(2, 0, 3, 1)
    if hasattr(k_cache, "read_blocks_into"):
        k_cache.read_blocks_into(blocks, whole)
    else:
        whole.copy_(k_cache[blocks])
    return out[:, :, :n].permute(2, 0, 1)


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_row: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [T, Hkv, d] of logical slots shared by all heads."""
    blocks, offsets = physical_slots(block_row, slots, k_cache.shape[2])
    return k_cache[blocks, :, offsets], v_cache[blocks, :, offsets]


def compact_kept_tokens(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
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
        moved = cache[src_blocks, heads, src_offsets].clone()
        cache[dst_blocks, heads, dst_offsets] = moved


def write_kt_pages(
    k_cache: torch.Tensor,
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
) -> torch.Tensor:
    """Causal attention of queries [T, Hq, d] at q_positions over logical
    slots [0, seq_len). Returns [T, Hq, d] in query.dtype."""
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
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[None], scale=scale
        )
        out[start : start + chunk] = o.transpose(0, 1)
    return out


@dataclass(frozen=True)
class Stage1Ops:
    """The three steps of Stage 1 on the paged cache (PyTorch here, Triton in
    ``triton_ops``): window scores of every prompt key [Hkv, n - w] fp32,
    the per-head compaction, the KT page builds."""

    window_scores: Callable  # (q_window, k_cache, block_row, n, scale)
    compact_kept_tokens: Callable  # (k_cache, v_cache, block_row, kept)
    write_kt_pages: Callable  # (k_cache, kt_cache, block_row, lo, hi, page_size)


def window_scores(q_window, k_cache, block_row, n: int, scale: float) -> torch.Tensor:
    """``algorithm.window_attention_scores`` of the request's prompt keys."""
    return window_attention_scores(q_window, prompt_keys(k_cache, block_row, n), scale)


STAGE1_OPS = Stage1Ops(window_scores, compact_kept_tokens, write_kt_pages)


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
    ops: Stage1Ops = STAGE1_OPS,
) -> torch.Tensor:
    """Stage 1 on the paged cache of one request: choose, compact, build KT.

    Returns the kept positions [Hkv, prompt_budget] (for tests and stats).
    With prompt_budget >= num_prompt_tokens every position is kept
    (tail_start is then num_compact: the view is the whole prompt) and only
    the KT pages are written. Ties among pooled scores may be broken
    differently by other ``ops`` (kernels), so kept sets can differ on
    plateaus (equal scores).
    """
    n = int(num_prompt_tokens)
    window = q_window.shape[0]
    if prompt_budget >= n:
        # Nothing to evict (rocketkv.evict=false): identity selection, no
        # scoring, no move; only the KT pages of the whole prompt.
        ops.write_kt_pages(k_cache, kt_cache, block_row, 0, n, page_size)
        return torch.arange(n, device=k_cache.device).expand(k_cache.shape[1], n)
    scores = ops.window_scores(q_window, k_cache, block_row, n, scale)
    kept = keep_positions_from_scores(
        scores, n, prompt_budget, kernel_size, protect_from=min(n - window, tail_start)
    )
    num_compact = prompt_budget - (n - tail_start)
    ops.compact_kept_tokens(k_cache, v_cache, block_row, kept[:, :num_compact])
    ops.write_kt_pages(k_cache, kt_cache, block_row, 0, num_compact, page_size)
    ops.write_kt_pages(k_cache, kt_cache, block_row, tail_start, n, page_size)
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
) -> torch.Tensor:
    """Stage 2 for one token at position seq_len - 1 (its K/V already stored):
    update its KT page, choose pages, attend exactly. query [Hq, d] -> [Hq, d].

    Page choice: the top max(topk // page_size, 1) pages by the token-count
    weighted page softmax (``algorithm.hsa_page_probs``); with
    force_current_page the newest token's page is selected on top of them."""
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
    return sparse_attention(query, keys, values, token_mask, scale).to(query.dtype)
