"""Stage 2's decode rows as the kernels read them: the geometry of a row's
view, its selection size and its selection-store slot, shared by the
scoring (``hsa_score``), selection (``page_select``) and attention
(``sparse_decode``) kernels.

A decode row b is a sequence with one new token; its per-row columns are
[B] device integer vectors (``num_compact``, ``tail_start``, ``seq_lens``,
``topk``, ...). The view's pages (see ``layout``): j < npc =
ceil(num_compact / ps) start at j * ps, the others at tail_start + (j - npc)
* ps; P = npc + ceil((seq_len - tail_start) / ps) (0 for a padding row,
seq_len <= 0). A row selects n_use = min(max(topk // ps, 1) + f, P, n_sel)
pages, f = 1 with force_current_page (the forced page on top), else 0.

Selection reuse (the kernels' REUSE): a store int32 [S, Hkv, W] and per row
a slot (-1: none) and a reuse flag. A (row, KV head) reuses when the flag is
set, slot >= 0, n_use <= W and its n_use entries store[slot, h, :n_use] all
lie in [0, P) (``store_reuse``: the kernels read the same entries, so they
agree; a store that broke its invariant is never read, that (row, head)
selects anew instead, as ``ops.cpu`` and ``ops.pytorch`` do).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Store entries a reuse check reads at once (n_use is a few dozen to a few hundred).
STORE_CHUNK = tl.constexpr(128)


@triton.jit
def view_pages(nc_ptr, ts_ptr, seq_ptr, b, PS: tl.constexpr):
    """(num_compact, tail_start, seq_len, compact pages, total pages) of row b."""
    nc = tl.load(nc_ptr + b).to(tl.int32)
    ts = tl.load(ts_ptr + b).to(tl.int32)
    seq = tl.load(seq_ptr + b).to(tl.int32)
    npc = (nc + PS - 1) // PS
    npt = (tl.maximum(seq - ts, 0) + PS - 1) // PS
    num_pages = tl.where(seq > 0, npc + npt, 0)
    return nc, ts, seq, npc, num_pages


@triton.jit
def split_range(row_pages, num_splits, split, BLOCK_P: tl.constexpr):
    """(chunk, lo, hi): split ``split``'s pages [lo, hi) of a row of
    row_pages pages, spread over num_splits splits in whole tiles of BLOCK_P
    (the scoring and the selection kernel split a row the same way)."""
    chunk = ((row_pages + num_splits - 1) // num_splits + BLOCK_P - 1) // BLOCK_P * BLOCK_P
    chunk = tl.maximum(chunk, BLOCK_P)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, row_pages)
    return chunk, lo, hi


@triton.jit
def selection_size(topk_ptr, b, num_pages, num_sel, extra, PS: tl.constexpr):
    """n_use, the pages row b selects: min(max(topk // ps, 1) + extra, P,
    n_sel)."""
    n_want = tl.maximum(tl.load(topk_ptr + b).to(tl.int32) // PS, 1) + extra
    return tl.minimum(tl.minimum(n_want, num_pages), num_sel)


@triton.jit
def store_slot(slot_ptr, reuse_ptr, b):
    """(slot, reusing) of row b in the selection store: reusing = it attends
    the pages stored in its slot (reuse set and a slot given)."""
    slot = tl.load(slot_ptr + b)
    return slot, (tl.load(reuse_ptr + b) != 0) & (slot >= 0)


@triton.jit
def store_entries(store_ptr, slot, bh, num_kv_heads, store_width):
    """Slot ``slot``'s entries for the KV head of program row bh."""
    return store_ptr + (slot.to(tl.int64) * num_kv_heads + bh % num_kv_heads) * store_width


@triton.jit
def store_reuse(store_ptr, slot_ptr, reuse_ptr, b, bh, num_kv_heads, store_width, n_use, num_pages):
    """(slot, its entries for bh's KV head, reusing): reusing = row b's reuse
    flag and slot set and the n_use entries all pages of its view [0,
    num_pages) (else it selects anew: a bad entry is never read as a page).
    The scoring and the selection kernel decide with it per (row, KV head),
    so they agree."""
    slot, reusing = store_slot(slot_ptr, reuse_ptr, b)
    store_row = store_entries(store_ptr, slot, bh, num_kv_heads, store_width)
    if reusing:  # (checked only then: unconditional, ptxas spilled in _select_kernel)
        fits = n_use <= store_width
        n = tl.where(fits, n_use, 0)
        bad = (~fits).to(tl.int32)
        for i0 in range(0, n, STORE_CHUNK):
            i = i0 + tl.arange(0, STORE_CHUNK)
            p = tl.load(store_row + i, mask=i < n, other=0)
            bad += tl.sum(((p < 0) | (p >= num_pages)).to(tl.int32), 0)
        reusing = bad == 0
    return slot, store_row, reusing


@triton.jit
def copy_pages(src, dst, n, BLOCK: tl.constexpr):
    """dst[0:n] = src[0:n] (int32 page indices)."""
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)


# The block table's row stride is vLLM's (its table width, per runner), so a
# warm-up cannot know whether it is a multiple of 16: not specialized (one
# multiply a row), so Stage 2 compiles the same whatever vLLM's width
# (``backend.warmup.warm_up_stage2``).
STAGE2_UNSPECIALIZED = ["stride_bt"]
