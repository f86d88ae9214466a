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

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rocketkv_vllm.kernels._utils import row_vectors


@dataclass
class DecodeRows:
    """A decode step's rows as the launchers take them, whole: one bundle
    from the builder (``ops.base.HsaRows``) to every Stage 2 implementation
    and launcher, so a new per-row column is one field here (and its
    producer and readers), not a parameter threaded through each signature.
    The jit kernels still take the columns flat (unpacked at the launch).

    Columns: [B] integer device vectors (int32 from the builder), B the rows.
    max_pages >= every row's view page count, max_select >= every row's
    max(topk // ps, 1) (Python ints: they size grids and buffers).
    sel_slot, reuse: each row's selection-store slot (-1: none) and reuse
    flag (nonzero: attend the stored pages); read only with a store."""

    block_table: torch.Tensor  # [B, max_blocks] int32, last dim contiguous
    num_compact: torch.Tensor
    tail_start: torch.Tensor
    seq_lens: torch.Tensor  # including the row's token; <= 0: padding
    topk: torch.Tensor
    topr: torch.Tensor
    max_pages: int
    max_select: int
    sel_slot: torch.Tensor | None = None
    reuse: torch.Tensor | None = None

    def slice(self, a: int, b: int) -> DecodeRows:
        """Rows [a, b), same bounds."""

        def part(t):
            return None if t is None else t[a:b]

        return DecodeRows(
            **{f.name: part(getattr(self, f.name)) for f in _COLUMNS},
            max_pages=self.max_pages,
            max_select=self.max_select,
        )

    def flat(self) -> DecodeRows:
        """Every [B] column as a contiguous 1-D vector (kernels read element
        b at ptr + b): no copy for the builder's int32 vectors."""
        given = {n: t for n in _VECTORS if (t := getattr(self, n)) is not None}
        if all(t.dim() == 1 and t.stride(0) == 1 for t in given.values()):
            return self  # the usual case: nothing new per launch
        return dataclasses.replace(self, **dict(zip(given, row_vectors(*given.values()))))

    def store_columns(self, selections: torch.Tensor | None):
        """(sel_slot, reuse) read with a selection store; (None, None)
        without one (the rows' slots then mean nothing)."""
        if selections is None:
            return None, None
        if self.sel_slot is None or self.reuse is None:
            raise ValueError("a selection store needs the rows' sel_slot and reuse")
        return self.sel_slot, self.reuse

    def store_width(self, selections: torch.Tensor | None, num_kv_heads: int) -> int:
        """W of a selection store [S, Hkv, W] the kernels read with these
        rows (0: none), checked: int32, contiguous, the slots given."""
        self.store_columns(selections)
        if selections is None:
            return 0
        if (
            selections.dtype != torch.int32
            or not selections.is_contiguous()
            or selections.dim() != 3
            or selections.shape[1] != num_kv_heads
        ):
            raise ValueError(
                f"selections must be a contiguous int32 [S, Hkv={num_kv_heads}, W], got "
                f"{selections.dtype} {tuple(selections.shape)}"
            )
        return selections.shape[2]


_COLUMNS = [f for f in dataclasses.fields(DecodeRows) if f.name not in ("max_pages", "max_select")]
_VECTORS = [f.name for f in _COLUMNS if f.name != "block_table"]

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
