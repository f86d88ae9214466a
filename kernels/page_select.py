"""Stage 2 selection: page probabilities and each row's top-n_use pages,
batched (the second launch of the scoring + selection pair, ``hsa_score``).

``_select_kernel``, grid (B*Hkv, S) as ``_score_kernel``'s (``plan_score``):
every split merges the S partials of the scoring (a few hundred floats),
turns its own pages' logits into probabilities (written out only on
request: ``hsa_page_probs``, or when a split's pages exceed what it holds
in registers; with ``force_current_page`` the page of the newest token gets
2.0 and is selected as an extra page, n_use counts it on top) and picks its
local top-n_use candidates; the last split of the row to finish (an atomic
counter per row and head in the scratch, reset to 0 by that split, so
CUDA-graph replays find it at 0) merges the S candidate lists into the
row's n_use pages. A two-level top-n: exact, because a page among the row's
n_use best is among the n_use best of its own split under the same order
(probability, then lowest page index). Each top-n is a radix search on the
fp32 bit patterns (probabilities are >= 0, so their int32 patterns order
like the values) for the n-th largest, 2 bits a pass (16 dependent
block-wide counts, where a bisection takes 31), then a cumsum packs the
winners in ascending page order, ties at the threshold by lowest index. So
no pass runs a whole row in one program: the merge reads S x min(n_use,
chunk) candidates.

n_use[b] = min(max(topk[b] // ps, 1) + f, P[b], n_sel) pages per row, f = 1
with force_current_page (else 0), n_sel = min(max_select + f, max_pages)
(``rows.selection_size``).

Selection reuse (REUSE; off: not compiled in; ``rows.store_reuse``): a
reusing (row, head)'s split 0 copies its stored entries into sel and the
others do nothing (no candidates, its counter untouched). Any other (row,
head) with a slot has its merged pages (ascending) written to its slot
too, by the merging program, where n_use <= W.

``hsa_page_probs`` runs both launches with the selection off (the
probabilities written); ``select_pages`` (probabilities given, e.g. by a
test) runs the selection kernel alone on them (``FROM_PROBS``), or
``torch.topk`` on request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocketkv_vllm.kernels._utils import (
    grid_dependency,
    group_pad,
    next_pow2,
    num_sms,
    uses_pdl,
)
from rocketkv_vllm.kernels.hsa_score import (
    FIELD_BITS,
    MAX_SELECT_ROW,
    MERGE_SMALL_BLOCK,
    ScorePlan,
    ScoreScratch,
    launch_score,
    plan_score,
)
from rocketkv_vllm.kernels.rows import (
    DecodeRows,
    copy_pages,
    selection_size,
    split_range,
    store_reuse,
    view_pages,
)

# ---------------------------------------------------------------------------
# Selection helpers: top-n of int32 bit patterns (>= 0 for candidates, -1 for
# nothing), the first BLOCK held in registers, the rest read in chunks.


@triton.jit
def _bits_at(row_ptr, idx, n, FLOAT: tl.constexpr):
    """Bit patterns of row elements idx (fp32 values or int32 patterns);
    -1 at idx >= n."""
    if FLOAT:
        v = tl.load(row_ptr + idx, mask=idx < n, other=-1.0).to(tl.int32, bitcast=True)
    else:  # candidates other programs wrote in this launch: past L1
        v = tl.load(row_ptr + idx, mask=idx < n, other=-1, cache_modifier=".cg")
    return v


@triton.jit
def _count_rest_above(row_ptr, n, thr, FLOAT: tl.constexpr, BLOCK: tl.constexpr):
    """How many of elements [BLOCK, n) have pattern > thr."""
    cnt = thr * 0
    for p0 in range(BLOCK, n, BLOCK):
        bits = _bits_at(row_ptr, p0 + tl.arange(0, BLOCK), n, FLOAT)
        cnt += tl.sum((bits > thr).to(tl.int32), 0)
    return cnt


# The threshold search decides 2 bits a pass: the counts of a pass's three
# candidate digits ride in one int64 (21-bit fields), so a pass is one
# block-wide reduction -- a barrier on the selection's critical path -- and 31
# bits take 16 passes where a bisection takes 31. (16 digits a pass as a
# [BLOCK, 16] compare held too much in registers: 250+ and spills for a
# 4096-candidate merge.) Rows hold fewer than 2**21 pages (``plan_score``).
_RADIX_PASSES = tl.constexpr(16)
_FIELD = tl.constexpr(FIELD_BITS)
_FIELD_MASK = tl.constexpr(MAX_SELECT_ROW - 1)


@triton.jit
def _digit_flags(bits, c1, c2, c3):
    """Per element, bits >= c1, >= c2, >= c3 as 1s in three 21-bit fields."""
    return (
        (bits >= c1).to(tl.int64)
        | ((bits >= c2).to(tl.int64) << _FIELD)
        | ((bits >= c3).to(tl.int64) << (2 * _FIELD))
    )


@triton.jit
def _count_at_least(
    bits0, row_ptr, n, c1, c2, c3, FLOAT: tl.constexpr, BLOCK: tl.constexpr, REST: tl.constexpr
):
    """How many of the n elements (bits0: elements [0, BLOCK), with REST
    the rest at row_ptr) have pattern >= c1, c2, c3, packed in one int64 (21
    bits each, c1's lowest)."""
    packed = _digit_flags(bits0, c1, c2, c3)
    if REST:
        for p0 in range(BLOCK, n, BLOCK):
            bits = _bits_at(row_ptr, p0 + tl.arange(0, BLOCK), n, FLOAT)
            packed += _digit_flags(bits, c1, c2, c3)
    return tl.sum(packed, 0)


@triton.jit
def _threshold(
    bits0, row_ptr, n, want, FLOAT: tl.constexpr, BLOCK: tl.constexpr, REST: tl.constexpr
):
    """(thr, room) for the top ``want`` of n elements (bits0: elements [0,
    BLOCK), with REST (n may exceed BLOCK) the rest at row_ptr): thr is the
    largest pattern with count(>= thr) >= want (0 if none), room how many
    elements equal to thr are taken after all those above it. From the top,
    2 bits a pass: counts fall as the digit grows, so the digit kept (the
    largest leaving ``want`` elements) is how many of the three candidates
    do; the first pass decides bit 30 alone (bit 31, the sign, is 0 for
    every candidate)."""
    thr = want * 0  # int32 scalar
    for k in range(_RADIX_PASSES):
        step = 1 << (30 - 2 * k)
        c1 = thr + step
        c2 = tl.where(k > 0, c1 + step, c1)
        c3 = tl.where(k > 0, c2 + step, c1)
        packed = _count_at_least(bits0, row_ptr, n, c1, c2, c3, FLOAT, BLOCK, REST)
        digit = ((packed & _FIELD_MASK) >= want).to(tl.int32)
        digit += (((packed >> _FIELD) & _FIELD_MASK) >= want).to(tl.int32)
        digit += ((packed >> (2 * _FIELD)) >= want).to(tl.int32)
        thr = thr + tl.minimum(digit, tl.where(k > 0, 3, 1)) * step
    above = tl.sum((bits0 > thr).to(tl.int32), 0)
    if REST:
        above += _count_rest_above(row_ptr, n, thr, FLOAT, BLOCK)
    return thr, want - above


@triton.jit
def _pack(bits, payload, thr, room, base, eq_seen, out_ptr, bits_out_ptr, STORE_BITS: tl.constexpr):
    """Store the winners' payload (and, STORE_BITS, their patterns) at
    out_ptr[base + ...] in order: every element above thr, the first
    ``room`` (lowest index) equal to it. Returns the new (base, eq_seen)."""
    greater = bits > thr
    equal = bits == thr
    # one scan for both running counts (BLOCK < 2**16): above thr in the
    # low half, equal to it in the high half
    counts = tl.cumsum(greater.to(tl.int32) | (equal.to(tl.int32) << 16), 0)
    n_eq = eq_seen + (counts >> 16)  # equal ones up to here, this one included
    take = greater | (equal & (n_eq <= room))
    # winners before this one: the greater ones, then the ties taken so far
    pos = base + (counts & 0xFFFF) + tl.minimum(n_eq, room) - tl.minimum(eq_seen, room) - 1
    tl.store(out_ptr + pos, payload, mask=take)
    if STORE_BITS:
        tl.store(bits_out_ptr + pos, bits, mask=take)
    return base + tl.sum(take.to(tl.int32), 0), eq_seen + tl.sum(equal.to(tl.int32), 0)


@triton.jit
def _merge_candidates(
    cbits_row, cpage_row, n, want, sel_row, BLOCK: tl.constexpr, REST: tl.constexpr
):
    """The top ``want`` of n candidates (patterns cbits_row, pages
    cpage_row) -> their pages at sel_row[0:want], candidate order (REST: n
    may exceed BLOCK)."""
    idx = tl.arange(0, BLOCK)
    bits0 = _bits_at(cbits_row, idx, n, False)
    thr, room = _threshold(bits0, cbits_row, n, want, False, BLOCK, REST)
    pages = tl.load(cpage_row + idx, mask=idx < n, other=0, cache_modifier=".cg")
    base, eq_seen = _pack(bits0, pages, thr, room, thr * 0, thr * 0, sel_row, sel_row, False)
    if REST:
        for p0 in range(BLOCK, n, BLOCK):
            i = p0 + idx
            base, eq_seen = _pack(
                _bits_at(cbits_row, i, n, False),
                tl.load(cpage_row + i, mask=i < n, other=0, cache_modifier=".cg"),
                thr,
                room,
                base,
                eq_seen,
                sel_row,
                sel_row,
                False,
            )


@triton.jit
def _row_stats(
    pm_ptr,
    pl_ptr,
    bh,
    num_splits,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    G2: tl.constexpr,
    SCH: tl.constexpr,
):
    """The row's softmax max (log2 units; 0 where none) and 1 / (G * sum)
    per query head, merged from the S splits' partials, SCH at a time."""
    g = tl.arange(0, G2)
    g_ok = g < G
    m = tl.full([G2], float("-inf"), tl.float32)
    l = tl.zeros([G2], tl.float32)
    for s0 in range(0, num_splits, SCH):
        sp = s0 + tl.arange(0, SCH)
        part = (bh * num_splits + sp)[:, None] * G_PAD + g[None, :]
        pmask = (sp < num_splits)[:, None] & g_ok[None, :]
        pm = tl.load(pm_ptr + part, mask=pmask, other=float("-inf"))
        pl = tl.load(pl_ptr + part, mask=pmask, other=0.0)
        m_new = tl.maximum(m, tl.max(pm, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp2(m - m_safe) + tl.sum(pl * tl.exp2(pm - m_safe[None, :]), 0)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    inv_l = tl.where(l > 0, 1.0 / tl.where(l > 0, l, 1.0), 0.0) / G
    return m_safe, inv_l


@triton.jit
def _probs_at(
    row_logits,
    j,
    hi,
    m_safe,
    inv_l,
    cur,
    cur_ok,
    max_pages,
    G: tl.constexpr,
    G2: tl.constexpr,
    FORCE: tl.constexpr,
):
    """Probabilities of pages j (< hi) from their logits (2.0 on the forced
    current page)."""
    g = tl.arange(0, G2)
    valid = j < hi
    lg = tl.load(
        row_logits + g[:, None] * max_pages + j[None, :],
        mask=(g < G)[:, None] & valid[None, :],
        other=float("-inf"),
    )
    pr = tl.sum(tl.exp2(lg - m_safe[:, None]) * inv_l[:, None], 0)
    if FORCE:
        pr = tl.where((j == cur) & cur_ok, 2.0, pr)
    return pr


@triton.jit
def _select_kernel(
    logit_ptr,
    pm_ptr,
    pl_ptr,
    probs_ptr,
    cbits_ptr,
    cpage_ptr,
    count_ptr,
    sel_ptr,
    nc_ptr,
    ts_ptr,
    seq_ptr,
    topk_ptr,
    store_ptr,
    slot_ptr,
    reuse_ptr,
    num_kv_heads,
    max_pages,
    num_splits,
    num_sel,
    extra,
    cand,
    store_width,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    G2: tl.constexpr,
    SCH: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SUB: tl.constexpr,
    LONG: tl.constexpr,
    CAND_PAD: tl.constexpr,
    MERGE_BLOCK: tl.constexpr,
    MERGE_SMALL: tl.constexpr,
    MERGE_REST: tl.constexpr,
    FORCE: tl.constexpr,
    FROM_PROBS: tl.constexpr,
    WRITE_PROBS: tl.constexpr,
    SELECT: tl.constexpr,
    REUSE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Split (bh, split): its pages' probabilities (from the logits, or
    read: FROM_PROBS), its local top-n_use as candidates; the row's last
    split to finish merges the candidates into sel[bh, :n_use] (ascending
    page order). LONG: a split may hold more than SUB pages (the rest of
    its probabilities go through ``probs`` and are read back); MERGE_REST:
    a row may have more than MERGE_BLOCK candidates (read back per step). REUSE: the
    selection store [S, Hkv, store_width]: a reusing row's split 0 copies
    its slot's n_use pages into sel, its other splits do nothing (no
    candidates, no counter); another row with a slot (one whose stored
    pages fail ``_store_reuse``'s check included) gets its merged pages
    stored there."""
    grid_dependency(PDL)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // num_kv_heads
    nc, ts, seq, npc, num_pages = view_pages(nc_ptr, ts_ptr, seq_ptr, b, PS)
    row_pages = tl.minimum(num_pages, max_pages)
    if REUSE:
        # the slot's address now and no early return below: with either
        # changed, ptxas spilled a few bytes (sm_90, eager launch shapes)
        n_use = selection_size(topk_ptr, b, num_pages, num_sel, extra, PS)
        slot, store_row, reusing = store_reuse(
            store_ptr, slot_ptr, reuse_ptr, b, bh, num_kv_heads, store_width, n_use, num_pages
        )
        if reusing & (split == 0):
            copy_pages(store_row, sel_ptr + bh.to(tl.int64) * num_sel, n_use, CAND_PAD)
        choosing = not reusing
    else:
        choosing = True  # a constexpr: the branch below compiles as before
    if choosing:
        chunk, lo, hi = split_range(row_pages, num_splits, split, BLOCK_P)
        prow = probs_ptr + bh.to(tl.int64) * max_pages
        j0 = lo + tl.arange(0, SUB)
        if FROM_PROBS:
            bits0 = _bits_at(prow, j0, hi, True)
        else:
            m_safe, inv_l = _row_stats(pm_ptr, pl_ptr, bh, num_splits, G, G_PAD, G2, SCH)
            cur = npc + (seq - 1 - ts) // PS  # page of the newest token (in the tail)
            cur_ok = seq - 1 >= ts
            row_logits = logit_ptr + bh.to(tl.int64) * G * max_pages
            pr = _probs_at(row_logits, j0, hi, m_safe, inv_l, cur, cur_ok, max_pages, G, G2, FORCE)
            if WRITE_PROBS:  # only the row's own pages are written
                tl.store(prow + j0, pr, mask=j0 < hi)
            bits0 = tl.where(j0 < hi, pr.to(tl.int32, bitcast=True), -1)
            if LONG:
                for p0 in range(lo + SUB, hi, SUB):
                    jj = p0 + tl.arange(0, SUB)
                    pr = _probs_at(
                        row_logits, jj, hi, m_safe, inv_l, cur, cur_ok, max_pages, G, G2, FORCE
                    )
                    tl.store(prow + jj, pr, mask=jj < hi)
                tl.debug_barrier()  # read back below by this program
        if SELECT:
            n_use = selection_size(topk_ptr, b, num_pages, num_sel, extra, PS)
            size = tl.maximum(hi - lo, 0)
            n_loc = tl.minimum(n_use, size)
            if size > n_loc:
                thr, room = _threshold(bits0, prow + lo, size, n_loc, True, SUB, LONG or FROM_PROBS)
            else:  # every page of the split is a candidate
                thr = n_loc * 0
                room = size
            # candidate slots of a split: min(cand, chunk), so that the row's
            # candidates are dense for the merge whatever max_pages is
            stride = tl.minimum(cand, chunk)
            crow = bh.to(tl.int64) * num_splits * cand + split * stride
            base, eq_seen = _pack(
                bits0, j0, thr, room, thr * 0, thr * 0, cpage_ptr + crow, cbits_ptr + crow, True
            )
            if LONG or FROM_PROBS:
                for p0 in range(lo + SUB, hi, SUB):
                    jj = p0 + tl.arange(0, SUB)
                    base, eq_seen = _pack(
                        _bits_at(prow, jj, hi, True),
                        jj,
                        thr,
                        room,
                        base,
                        eq_seen,
                        cpage_ptr + crow,
                        cbits_ptr + crow,
                        True,
                    )
            k = tl.arange(0, CAND_PAD)
            tl.store(
                cbits_ptr + crow + k,
                tl.full([CAND_PAD], -1, tl.int32),
                mask=(k >= n_loc) & (k < stride),
            )
            # The row's last split to get here merges (all splits' candidates
            # are written: barrier, then a release / acquire counter).
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel")
            if done == num_splits - 1:
                tl.atomic_xchg(count_ptr + bh, 0, sem="relaxed")  # for the next launch / replay
                total = (row_pages + chunk - 1) // chunk * stride
                mrow = bh.to(tl.int64) * num_splits * cand
                srow = sel_ptr + bh.to(tl.int64) * num_sel
                cbits_row = cbits_ptr + mrow
                cpage_row = cpage_ptr + mrow
                if MERGE_BLOCK > MERGE_SMALL:
                    if total <= MERGE_SMALL:  # the usual compressed view
                        _merge_candidates(
                            cbits_row, cpage_row, total, n_use, srow, MERGE_SMALL, False
                        )
                    else:
                        _merge_candidates(
                            cbits_row, cpage_row, total, n_use, srow, MERGE_BLOCK, MERGE_REST
                        )
                else:
                    _merge_candidates(
                        cbits_row, cpage_row, total, n_use, srow, MERGE_BLOCK, MERGE_REST
                    )
                if REUSE:  # kept for the row's later steps (sel: other threads' stores)
                    tl.debug_barrier()
                    stored = tl.where((slot >= 0) & (n_use <= store_width), n_use, 0)
                    copy_pages(srow, store_row, stored, CAND_PAD)


def launch_select(
    plan: ScorePlan,
    scratch: ScoreScratch,
    num_q_heads: int,
    rows: DecodeRows,
    page_size: int,
    force_current_page: bool,
    select: bool = True,
    write_probs: bool = False,
    from_probs: bool = False,
    selections: torch.Tensor | None = None,
) -> None:
    """``_select_kernel`` over ``rows`` (``rows.flat()`` vectors; their
    block_table and topr are not read): probabilities (written with
    write_probs) and / or the selection into scratch.sel (select).
    selections: the selection store int32 [S, Hkv, W] contiguous, with the
    rows' sel_slot, reuse (REUSE): rows with reuse set and a slot take their
    n_use pages from selections[slot, h, :n_use], others with a slot store
    theirs there (if n_use <= W); selection only (no probabilities)."""
    hkv = plan.num_kv_heads
    group = num_q_heads // hkv
    g2 = max(2, next_pow2(group))
    probs = scratch.probs
    assert probs is not None or not (plan.long or write_probs or from_probs)
    if probs is None:
        probs = scratch.logits  # unused
    else:
        assert probs.is_contiguous() and probs.numel() >= plan.batch * hkv * plan.max_pages
    store_width = rows.store_width(selections, hkv)
    reuse_on = selections is not None
    if reuse_on:
        assert select and not (write_probs or from_probs)
        sel_slot, reuse = rows.sel_slot, rows.reuse
    else:  # not read
        selections = sel_slot = reuse = scratch.sel
    pdl = uses_pdl(scratch.logits.device)
    _select_kernel[plan.grid](
        scratch.logits,
        scratch.part_m,
        scratch.part_l,
        probs,
        scratch.cand_bits,
        scratch.cand_pages,
        scratch.counters,
        scratch.sel,
        rows.num_compact,
        rows.tail_start,
        rows.seq_lens,
        rows.topk,
        selections,
        sel_slot,
        reuse,
        hkv,
        plan.max_pages,
        plan.splits,
        plan.n_sel,
        1 if force_current_page else 0,
        plan.cand,
        store_width,
        G=group,
        G_PAD=group_pad(group),
        G2=g2,
        SCH=max(1, min(next_pow2(plan.splits), 2048 // g2)),
        PS=page_size,
        BLOCK_P=plan.block_p,
        SUB=plan.sub,
        LONG=plan.long,
        CAND_PAD=max(2, next_pow2(plan.cand)),
        MERGE_BLOCK=plan.merge_block,
        MERGE_SMALL=min(plan.merge_block, MERGE_SMALL_BLOCK),
        MERGE_REST=plan.splits * plan.cand > plan.merge_block,
        FORCE=bool(force_current_page) and not from_probs,
        FROM_PROBS=from_probs,
        WRITE_PROBS=write_probs,
        SELECT=select,
        REUSE=reuse_on,
        PDL=pdl,
        launch_pdl=pdl,
        # 8 warps: shorter per-thread runs in the scans and radix counts (and
        # with 4, ptxas-blackwell spilled a few bytes of one sm_100 variant)
        num_warps=8,
    )


def hsa_page_probs(
    query: torch.Tensor,
    kt_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_compact: torch.Tensor,
    tail_start: torch.Tensor,
    seq_lens: torch.Tensor,
    topr: torch.Tensor,
    page_size: int,
    max_pages: int,
    force_current_page: bool = False,
    chunk: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group-averaged, token-count weighted page probabilities [B, Hkv,
    max_pages] fp32 (2.0 on the forced current page): the two kernels of
    Stage 2's scoring, the selection step off. Only each row's own pages
    are written: the entries past its page count are left as they are.
    ``out``: where to write; chunk: pages a split (default: ``plan_score``)."""
    batch, hq, d = query.shape
    hkv = kt_cache.shape[1]
    if query.stride(-1) != 1:
        query = query.contiguous()
    plan = plan_score(batch, hkv, max_pages, 1, False, num_sms(query.device), chunk)
    probs = (
        out
        if out is not None
        else torch.empty(batch, hkv, plan.max_pages, device=query.device, dtype=torch.float32)
    )
    assert probs.shape == (batch, hkv, plan.max_pages) and probs.is_contiguous()
    if batch == 0:
        return probs
    scratch = ScoreScratch.alloc(plan, hq, query.device)
    scratch.probs = probs
    # topk: unused without the selection
    rows = DecodeRows(
        block_table, num_compact, tail_start, seq_lens, seq_lens, topr, max_pages, 1
    ).flat()
    launch_score(plan, scratch, query, kt_cache, rows, page_size)
    launch_select(
        plan, scratch, hq, rows, page_size, force_current_page, select=False, write_probs=True
    )
    return probs


def select_pages(
    probs: torch.Tensor,
    max_select: int,
    num_compact: torch.Tensor | None = None,
    tail_start: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    topk: torch.Tensor | None = None,
    page_size: int | None = None,
    impl: str = "auto",
    force_current_page: bool = False,
) -> torch.Tensor:
    """Selected page indices [B, Hkv, n_sel] (n_sel = min(max_select + f,
    max_pages), f = 1 with force_current_page, else 0: the forced page, which
    ``hsa_page_probs`` gave 2.0, comes on top of the top-k pages); row b's
    pages are its first n_use[b] = min(max(topk[b] // page_size, 1) + f,
    P[b], n_sel) entries, the rest is unspecified. max_select >= every
    row's max(topk // page_size, 1).

    impl "torch": torch.topk(sorted=True) (best first) over the row's pages
    (with the row tensors; without them every entry must be a valid
    probability or -1); "triton": the selection kernel on these
    probabilities (needs the per-row tensors; pages in ascending order);
    "auto": triton when the row tensors are given.
    """
    max_pages = probs.shape[-1]
    extra = 1 if force_current_page else 0
    k = max(1, min(int(max_select) + extra, max_pages))
    have_rows = topk is not None
    if impl == "auto":
        impl = "triton" if have_rows else "torch"
    if impl == "torch":
        if have_rows:  # entries past a row's pages were never written
            npc = (num_compact.long() + page_size - 1) // page_size
            npt = ((seq_lens.long() - tail_start.long()).clamp_min(0) + page_size - 1) // page_size
            pages = torch.where(seq_lens > 0, npc + npt, 0)
            past = torch.arange(max_pages, device=probs.device) >= pages[:, None, None]
            probs = probs.masked_fill(past, -1.0)
        return torch.topk(probs, k, dim=-1, sorted=True).indices
    assert impl == "triton" and have_rows and page_size is not None
    assert probs.is_contiguous() and probs.dtype == torch.float32
    batch, hkv, _ = probs.shape
    plan = plan_score(batch, hkv, max_pages, max_select, force_current_page, num_sms(probs.device))
    if batch == 0:
        return torch.empty(batch, hkv, plan.n_sel, device=probs.device, dtype=torch.int32)
    scratch = ScoreScratch.alloc(plan, hkv, probs.device, logits=False)
    scratch.probs = probs
    # block_table and topr: not read by the selection (an empty table, topk)
    table = torch.empty(batch, 0, dtype=torch.int32, device=probs.device)
    rows = DecodeRows(table, num_compact, tail_start, seq_lens, topk, topk, max_pages, max_select)
    launch_select(plan, scratch, hkv, rows.flat(), page_size, force_current_page, from_probs=True)
    return scratch.sel
