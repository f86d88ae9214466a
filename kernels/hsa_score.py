"""Stage 2 scoring (HSA): page probabilities and top-n page choice, batched.

Per decode row b and KV head h with query heads q_1..q_G (G = Hq / Hkv):

* channels: the top-r (r = topr[b]) of a = sum_g |q_g|, found in the kernel
  by ranking (rank_i = #{j : a_j > a_i or (a_j == a_i and j < i)},
  chosen = rank < r: exact for any per-row r without a host-side topk);
  sign_i = sign(sum_g q_g,i);
* bound(page)_i = max_i if sign_i > 0 else min_i over the chosen channels,
  read from the KT page (fp8 KT, uint8 rows of ``algorithm.kt_fp8``:
  decoded to fp32 codes * scale); s_g(page) = q_g . bound;
* SparQ temperature tau_g = sqrt(d * sum_chosen |q_g| / sum_all |q_g|);
  (16-bit KT: q split in three 16-bit parts, three tensor-core dots with
  exact products, ~fp32 accuracy; fp8 KT: the same with bf16 parts, its
  decoded values being exact in bf16; fp32 KT: an IEEE fp32 dot);
  softmax over the row's view pages of s_g / tau_g per query head, each
  page's term in the denominator weighted by its token count n_p (the
  reference's softmax over tokens: a partly filled page counts less), so
  probs[p] = mean_g exp(s_gp / tau_g) / sum_q n_q exp(s_gq / tau_g) is one
  token's probability; with ``force_current_page`` the page of the newest
  token gets 2.0 and is selected as an extra page (n_use below counts it on
  top).

The view's pages (see ``layout``): j < npc = ceil(num_compact / ps) start at
j * ps, the others at tail_start + (j - npc) * ps; P = npc +
ceil((seq_len - tail_start) / ps).

Two launches, both grid (B*Hkv, S) (S from B, Hkv, max_pages and the SM
count: ``plan_score``, Python ints, so CUDA-graph safe; each row's own P
pages are spread over the S splits in whole tiles of BLOCK_P, so the work
follows P, not max_pages, when a CUDA graph fixes max_pages at its largest):

1. ``_score_kernel``: (decode, ``update_kt``) the split holding the row's
   last page -- the newest token's -- first recomputes that page's KT row
   from its keys (``kt_update.refresh_kt_row``, what the separate KT update
   launch did), then every split scores its pages: one [G_pad, d] x [d,
   BLOCK_P] fp32 dot per tile, the tempered logits (log2 units) to a
   scratch [B, Hkv, G, max_pages], each split's partial max /
   token-weighted sum-of-exp per query head to [B*Hkv, S, G_pad].
2. ``_select_kernel``: every split merges the S partials (a few hundred
   floats), turns its own pages' logits into probabilities (written out
   only on request: ``hsa_page_probs``, or when a split's pages exceed what
   it holds in registers) and picks its local top-n_use candidates; the
   last split of the row to finish (an atomic counter per row and head in
   the scratch, reset to 0 by that split, so CUDA-graph replays find it at
   0) merges the S candidate lists into the row's n_use pages. A two-level
   top-n: exact, because a page among the row's n_use best is among the
   n_use best of its own split under the same order (probability, then
   lowest page index). Each top-n is a radix search on the fp32 bit
   patterns (probabilities are >= 0, so their int32 patterns order like the
   values) for the n-th largest, 2 bits a pass (16 dependent block-wide
   counts, where a bisection takes 31), then a cumsum packs the winners in
   ascending page order, ties at the threshold by lowest index. So no pass
   runs a whole row in one program: the merge reads S x min(n_use, chunk)
   candidates.

n_use[b] = min(max(topk[b] // ps, 1) + f, P[b], n_sel) pages per row, f = 1
with force_current_page (else 0), n_sel = min(max_select + f, max_pages).

Selection reuse (REUSE, both kernels; off: not compiled in): a store int32
[S, Hkv, W] and per row a slot (-1: none) and a reuse flag. A (row, KV
head) reuses when the flag is set, slot >= 0, n_use <= W and its n_use
entries store[slot, h, :n_use] all lie in [0, P) (``_store_reuse``: both
kernels read the same entries, so they agree; a store that broke its
invariant is never read, that (row, head) selects anew instead, as
``ops.cpu`` and ``ops.pytorch`` do). A reusing (row, head) still gets its
KT page refreshed, then its scoring programs return; in the selection
launch its split 0 copies the entries into sel and the others do nothing
(no candidates, its counter untouched). Any other (row, head) with a slot
has its merged pages (ascending) written to its slot too, by the merging
program, where n_use <= W. Same two launches.

``select_pages`` (probabilities given, e.g. by a test) runs the selection
kernel alone on them (``FROM_PROBS``), or ``torch.topk`` on request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rocketkv_vllm.kernels._utils import (
    cache_strides,
    cdiv,
    check_kv_cache,
    dot_upcast,
    grid_dependency,
    group_pad,
    head_pad,
    kv_operand,
    mma,
    next_pow2,
    num_sms,
    row_vectors,
    uses_pdl,
)
from rocketkv_vllm.kernels.kt_fp8 import kt_row_width, load_kt_fp8_bounds
from rocketkv_vllm.kernels.kt_update import refresh_kt_row

_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E)
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# Store entries a reuse check reads at once (n_use is a few dozen to a few hundred).
_STORE_CHUNK = tl.constexpr(128)


@triton.jit
def _view_pages(nc_ptr, ts_ptr, seq_ptr, b, PS: tl.constexpr):
    """(num_compact, tail_start, seq_len, compact pages, total pages) of row b."""
    nc = tl.load(nc_ptr + b).to(tl.int32)
    ts = tl.load(ts_ptr + b).to(tl.int32)
    seq = tl.load(seq_ptr + b).to(tl.int32)
    npc = (nc + PS - 1) // PS
    npt = (tl.maximum(seq - ts, 0) + PS - 1) // PS
    num_pages = tl.where(seq > 0, npc + npt, 0)
    return nc, ts, seq, npc, num_pages


@triton.jit
def _split_range(row_pages, num_splits, split, BLOCK_P: tl.constexpr):
    """(chunk, lo, hi): split ``split``'s pages [lo, hi) of a row of
    row_pages pages, spread over num_splits splits in whole tiles of BLOCK_P
    (the scoring and the selection kernel split a row the same way)."""
    chunk = ((row_pages + num_splits - 1) // num_splits + BLOCK_P - 1) // BLOCK_P * BLOCK_P
    chunk = tl.maximum(chunk, BLOCK_P)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, row_pages)
    return chunk, lo, hi


@triton.jit
def _n_use(topk_ptr, b, num_pages, num_sel, extra, PS: tl.constexpr):
    """Pages row b selects: min(max(topk // ps, 1) + extra, P, n_sel)."""
    n_want = tl.maximum(tl.load(topk_ptr + b).to(tl.int32) // PS, 1) + extra
    return tl.minimum(tl.minimum(n_want, num_pages), num_sel)


@triton.jit
def _store_slot(slot_ptr, reuse_ptr, b):
    """(slot, reusing) of row b in the selection store: reusing = it attends
    the pages stored in its slot (reuse set and a slot given)."""
    slot = tl.load(slot_ptr + b)
    return slot, (tl.load(reuse_ptr + b) != 0) & (slot >= 0)


@triton.jit
def _store_row(store_ptr, slot, bh, num_kv_heads, store_width):
    """Slot ``slot``'s entries for the KV head of program row bh."""
    return store_ptr + (slot.to(tl.int64) * num_kv_heads + bh % num_kv_heads) * store_width


@triton.jit
def _store_reuse(
    store_ptr, slot_ptr, reuse_ptr, b, bh, num_kv_heads, store_width, n_use, num_pages
):
    """(slot, its entries for bh's KV head, reusing): reusing = row b's reuse
    flag and slot set and the n_use entries all pages of its view [0,
    num_pages) (else it selects anew: a bad entry is never read as a page).
    Both kernels decide with it per (row, KV head)."""
    slot, reusing = _store_slot(slot_ptr, reuse_ptr, b)
    store_row = _store_row(store_ptr, slot, bh, num_kv_heads, store_width)
    if reusing:  # (checked only then: unconditional, ptxas spilled in _select_kernel)
        fits = n_use <= store_width
        n = tl.where(fits, n_use, 0)
        bad = (~fits).to(tl.int32)
        for i0 in range(0, n, _STORE_CHUNK):
            i = i0 + tl.arange(0, _STORE_CHUNK)
            p = tl.load(store_row + i, mask=i < n, other=0)
            bad += tl.sum(((p < 0) | (p >= num_pages)).to(tl.int32), 0)
        reusing = bad == 0
    return slot, store_row, reusing


@triton.jit
def _copy_pages(src, dst, n, BLOCK: tl.constexpr):
    """dst[0:n] = src[0:n] (int32 page indices)."""
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        tl.store(dst + i, tl.load(src + i, mask=i < n), mask=i < n)


# The block table's row stride is vLLM's (its table width, per runner), so a
# warm-up cannot know whether it is a multiple of 16: not specialized (one
# multiply a row), so Stage 2 compiles the same whatever vLLM's width
# (``backend.warmup.warm_up_stage2``).
STAGE2_UNSPECIALIZED = ["stride_bt"]


@triton.jit(do_not_specialize=STAGE2_UNSPECIALIZED)
def _score_kernel(
    q_ptr,
    kt_ptr,
    bt_ptr,
    nc_ptr,
    ts_ptr,
    seq_ptr,
    topr_ptr,
    logit_ptr,
    pm_ptr,
    pl_ptr,
    k_ptr,
    topk_ptr,
    store_ptr,
    slot_ptr,
    reuse_ptr,
    num_kv_heads,
    max_pages,
    num_splits,
    num_sel,
    extra,
    store_width,
    k_scale,
    stride_qb,
    stride_qh,
    stride_bt,
    stride_tb,
    stride_th,
    stride_tp,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    PS: tl.constexpr,
    PS_PAD: tl.constexpr,
    BLOCK_P: tl.constexpr,
    RANK_CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    HALF: tl.constexpr,
    KT_FP8: tl.constexpr,
    FP8: tl.constexpr,
    UPDATE_KT: tl.constexpr,
    REUSE: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_dependency(PDL)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    nc, ts, seq, npc, num_pages = _view_pages(nc_ptr, ts_ptr, seq_ptr, b, PS)
    # (a row with more pages than max_pages is a caller error: its pages
    # past max_pages are ignored rather than written out of bounds)
    row_pages = tl.minimum(num_pages, max_pages)
    chunk, lo, hi = _split_range(row_pages, num_splits, split, BLOCK_P)
    row_bt = bt_ptr + b.to(tl.int64) * stride_bt
    if REUSE:  # decided before the refresh (after it: +30 registers on sm_90)
        n_use = _n_use(topk_ptr, b, num_pages, num_sel, extra, PS)
        _, _, reusing = _store_reuse(
            store_ptr, slot_ptr, reuse_ptr, b, bh, num_kv_heads, store_width, n_use, num_pages
        )
    if UPDATE_KT:
        # The newest token's page is the row's last: the split scoring it
        # refreshes its KT row first (no other program reads that row).
        if (seq > 0) & ((row_pages - 1) // chunk == split):
            refresh_kt_row(
                k_ptr,
                kt_ptr,
                row_bt,
                h,
                seq,
                stride_kb,
                stride_kh,
                stride_ks,
                stride_kd,
                stride_tb,
                stride_th,
                stride_tp,
                k_scale,
                D,
                D_PAD,
                BS,
                PS,
                PS_PAD,
                KT_FP8,
                FP8,
            )
            tl.debug_barrier()  # this program's loads below see the new row
    if REUSE:
        # a row attending its stored pages scores nothing (KT page refreshed
        # above; _select_kernel, deciding the same, reads no partial of it)
        if reusing:
            return

    g = tl.arange(0, G_PAD)
    g_ok = g < G
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    r = tl.load(topr_ptr + b).to(tl.int32)
    q_row = q_ptr + b.to(tl.int64) * stride_qb + (h * G) * stride_qh
    q = tl.load(
        q_row + g[:, None] * stride_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0
    ).to(tl.float32)
    absq = tl.abs(q)
    # a = sum_g |q_g| as G sequential element-wise adds, recomputed the same
    # way for each column chunk below, so equal channels compare equal.
    a = tl.zeros([D_PAD], tl.float32)
    for gi in tl.static_range(G):
        a += tl.abs(tl.load(q_row + gi * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32))
    # rank of channel i among the group's |q| sums (ties: lower index first),
    # RANK_CHUNK columns at a time to bound the [D_PAD, chunk] temporaries
    rank = tl.zeros([D_PAD], tl.int32)
    for j0 in tl.static_range(0, D_PAD, RANK_CHUNK):
        dj = j0 + tl.arange(0, RANK_CHUNK)
        a_j = tl.zeros([RANK_CHUNK], tl.float32)
        for gi in tl.static_range(G):
            a_j += tl.abs(
                tl.load(q_row + gi * stride_qh + dj, mask=dj < D, other=0.0).to(tl.float32)
            )
        beats = (a_j[None, :] > a[:, None]) | (
            (a_j[None, :] == a[:, None]) & (dj[None, :] < d[:, None])
        )
        beats = beats & (dj < D)[None, :]
        rank += tl.sum(beats.to(tl.int32), 1)
    chosen = (rank < r) & d_ok
    positive = tl.sum(q, 0) > 0
    take_max = chosen & positive
    take_min = chosen & (~positive)
    max_bits = tl.where(take_max, -1, 0).to(tl.int8)  # byte masks of the fp8 codes
    min_bits = tl.where(take_min, -1, 0).to(tl.int8)
    sel_abs = tl.sum(tl.where(chosen[None, :], absq, 0.0), 1)
    all_abs = tl.maximum(tl.sum(absq, 1), 1e-30)
    tau = tl.sqrt(D * sel_abs / all_abs)
    inv_tau = _LOG2E_C / tl.maximum(tau, 1e-30)  # logits in log2 units

    if SPLIT:
        # q = q1 + q2 + q3 in the 16-bit type HALF (the KT's; bf16 for fp8
        # KT) (24+ mantissa bits in all): with exact 16-bit KT operands the
        # scores keep fp32 accuracy while using tensor cores (an fp32 FMA
        # dot needs ~255 registers).
        q1 = q.to(HALF)
        rem = q - q1.to(tl.float32)
        q2 = rem.to(HALF)
        q3 = (rem - q2.to(tl.float32)).to(HALF)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    row_logits = logit_ptr + bh.to(tl.int64) * G * max_pages
    for p0 in range(lo, hi, BLOCK_P):
        j = p0 + tl.arange(0, BLOCK_P)
        ok = j < hi
        start = tl.where(j < npc, j * PS, ts + (j - npc) * PS)
        # tokens of each page inside the view (its softmax weight)
        count = tl.minimum(tl.maximum(tl.where(j < npc, nc, seq) - start, 0), PS)
        blk = tl.load(row_bt + start // BS, mask=ok, other=0).to(tl.int64)
        base = kt_ptr + blk * stride_tb + h * stride_th + ((start % BS) // PS) * stride_tp
        # Whole min|max rows (vectorised loads; a 32-byte sector holds 16
        # channels, so skipping unchosen halves would save little traffic),
        # then the chosen half of each chosen channel.
        kmask = ok[:, None] & d_ok[None, :]
        if KT_FP8:  # uint8 rows: the chosen codes * scale in fp32 (exact in bf16)
            bound = load_kt_fp8_bounds(base, d, kmask, ok, max_bits, min_bits, D)
        else:
            kmin = tl.load(base[:, None] + d[None, :], mask=kmask, other=0.0)
            kmax = tl.load(base[:, None] + D + d[None, :], mask=kmask, other=0.0)
            bound = tl.where(take_max[None, :], kmax, tl.where(take_min[None, :], kmin, 0.0))
        if SPLIT:  # 16-bit / fp8 KT values are exact operands: 3 tensor-core dots
            bt = tl.trans(bound.to(HALF))
            s = mma(q1, bt, UPCAST) + mma(q2, bt, UPCAST) + mma(q3, bt, UPCAST)
        else:  # fp32 KT: exact fp32 products (FMA)
            s = tl.dot(q, tl.trans(bound.to(tl.float32)), input_precision="ieee")
        s = s * inv_tau[:, None]
        valid = g_ok[:, None] & ok[None, :]
        s = tl.where(valid, s, float("-inf"))
        tl.store(row_logits + g[:, None] * max_pages + j[None, :], s, mask=valid)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(
            tl.exp2(s - m_safe[:, None]) * count.to(tl.float32)[None, :], 1
        )
        m_i = m_new
    part = (bh * num_splits + split) * G_PAD + g
    tl.store(pm_ptr + part, m_i)
    tl.store(pl_ptr + part, l_i)


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
FIELD_BITS = 21
MAX_SELECT_ROW = 1 << FIELD_BITS
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
    nc, ts, seq, npc, num_pages = _view_pages(nc_ptr, ts_ptr, seq_ptr, b, PS)
    row_pages = tl.minimum(num_pages, max_pages)
    if REUSE:
        # the slot's address now and no early return below: with either
        # changed, ptxas spilled a few bytes (sm_90, eager launch shapes)
        n_use = _n_use(topk_ptr, b, num_pages, num_sel, extra, PS)
        slot, store_row, reusing = _store_reuse(
            store_ptr, slot_ptr, reuse_ptr, b, bh, num_kv_heads, store_width, n_use, num_pages
        )
        if reusing & (split == 0):
            _copy_pages(store_row, sel_ptr + bh.to(tl.int64) * num_sel, n_use, CAND_PAD)
        choosing = not reusing
    else:
        choosing = True  # a constexpr: the branch below compiles as before
    if choosing:
        chunk, lo, hi = _split_range(row_pages, num_splits, split, BLOCK_P)
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
            n_use = _n_use(topk_ptr, b, num_pages, num_sel, extra, PS)
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
                    _copy_pages(srow, store_row, stored, CAND_PAD)


# ---------------------------------------------------------------------------
# Launch planning (Python ints only: the same for every replay of a graph)

# Pages a scoring tile (tl.dot's N; 16 keeps registers low for every head
# size and spreads a compressed view over more programs).
BLOCK_PAGES = 16
# Pages a selection program holds in registers; a split with more pages
# writes the rest of its probabilities out and reads them back per step.
SELECT_SUB_PAGES = 1024
# Candidates the merge holds in registers (more: read back per step), and
# the smaller block it uses when a row's candidates fit (a compressed view).
MERGE_BLOCK_MAX = 4096
MERGE_SMALL_BLOCK = 1024
# Programs per SM the scoring grid aims at.
PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class ScorePlan:
    """Launch shape of the scoring and selection kernels (both grid
    (B*Hkv, splits))."""

    batch: int
    num_kv_heads: int
    max_pages: int
    splits: int
    chunk_cap: int  # the most pages one split takes (rows <= max_pages)
    n_sel: int  # selected entries per (row, head): min(max_select + f, max_pages)
    cand: int  # candidate slots per split: min(n_sel, chunk_cap)
    sub: int
    merge_block: int
    block_p: int = BLOCK_PAGES

    @property
    def grid(self) -> tuple[int, int]:
        return (self.batch * self.num_kv_heads, self.splits)

    @property
    def long(self) -> bool:
        return self.chunk_cap > self.sub

    def busy_programs(self, row_pages: int) -> int:
        """Programs with pages to score for rows of row_pages pages each."""
        row_pages = min(int(row_pages), self.max_pages)
        if row_pages <= 0:
            return 0
        chunk = max(self.block_p, cdiv(cdiv(row_pages, self.splits), self.block_p) * self.block_p)
        return self.batch * self.num_kv_heads * cdiv(row_pages, chunk)


def plan_score(
    batch: int,
    num_kv_heads: int,
    max_pages: int,
    max_select: int,
    force_current_page: bool,
    sms: int,
    chunk: int | None = None,
) -> ScorePlan:
    """Splits: about PROGRAMS_PER_SM programs per SM over the B*Hkv rows
    (capped by max_pages' tiles), or max_pages / chunk when chunk is given."""
    max_pages = max(1, int(max_pages))
    if max_pages >= MAX_SELECT_ROW:  # the selection's 21-bit counts
        raise ValueError(f"max_pages {max_pages} >= {MAX_SELECT_ROW}: pages per row must be fewer")
    block_p = BLOCK_PAGES
    if chunk is None:
        splits = min(
            cdiv(PROGRAMS_PER_SM * sms, max(1, batch * num_kv_heads)), cdiv(max_pages, block_p)
        )
        chunk = cdiv(max_pages, max(1, splits))
    chunk = max(block_p, cdiv(chunk, block_p) * block_p)
    splits = cdiv(max_pages, chunk)
    chunk_cap = cdiv(cdiv(max_pages, splits), block_p) * block_p
    n_sel = max(1, min(int(max_select) + (1 if force_current_page else 0), max_pages))
    cand = min(n_sel, chunk_cap)
    return ScorePlan(
        batch=int(batch),
        num_kv_heads=int(num_kv_heads),
        max_pages=max_pages,
        splits=splits,
        chunk_cap=chunk_cap,
        n_sel=n_sel,
        cand=cand,
        sub=min(max(16, next_pow2(chunk_cap)), SELECT_SUB_PAGES),
        merge_block=min(max(16, next_pow2(splits * cand)), MERGE_BLOCK_MAX),
    )


@dataclass
class ScoreScratch:
    """Device buffers of one scoring + selection launch (views of a
    workspace, or allocated by ``alloc``). counters must hold 0."""

    logits: torch.Tensor  # fp32, >= B*Hq*max_pages
    part_m: torch.Tensor  # fp32, >= B*Hkv*splits*G_pad
    part_l: torch.Tensor
    probs: torch.Tensor | None  # fp32 [B, Hkv, max_pages] (a long plan, or probs out)
    cand_bits: torch.Tensor  # int32, >= B*Hkv*splits*cand
    cand_pages: torch.Tensor
    counters: torch.Tensor  # int32, >= B*Hkv, all 0
    sel: torch.Tensor  # int32 [B, Hkv, n_sel]

    @staticmethod
    def sizes(plan: ScorePlan, num_q_heads: int) -> dict[str, int]:
        """Elements of each buffer for ``plan``."""
        group = num_q_heads // plan.num_kv_heads
        rows = plan.batch * plan.num_kv_heads
        return dict(
            logits=plan.batch * num_q_heads * plan.max_pages,
            part=rows * plan.splits * group_pad(group),
            probs=rows * plan.max_pages if plan.long else 0,
            cand=rows * plan.splits * plan.cand,
            counters=rows,
            sel=rows * plan.n_sel,
        )

    @classmethod
    def alloc(cls, plan: ScorePlan, num_q_heads: int, device, probs=False, logits=True):
        n = cls.sizes(plan, num_q_heads)
        if not logits:
            n["logits"] = n["part"] = 0
        f32 = dict(device=device, dtype=torch.float32)
        i32 = dict(device=device, dtype=torch.int32)
        rows = plan.batch * plan.num_kv_heads
        return cls(
            logits=torch.empty(max(1, n["logits"]), **f32),
            part_m=torch.empty(max(1, n["part"]), **f32),
            part_l=torch.empty(max(1, n["part"]), **f32),
            probs=torch.empty(plan.batch, plan.num_kv_heads, plan.max_pages, **f32)
            if probs or plan.long
            else None,
            cand_bits=torch.empty(max(1, n["cand"]), **i32),
            cand_pages=torch.empty(max(1, n["cand"]), **i32),
            counters=torch.zeros(max(1, rows), **i32),
            sel=torch.empty(plan.batch, plan.num_kv_heads, plan.n_sel, **i32),
        )


def _half_type(kt_cache: torch.Tensor):
    """The 16-bit type of the split dot: the KT's own, bf16 for fp8 rows
    (their decoded values have <= 4 significant bits and fp32's exponent
    range); None: fp32 KT, one IEEE fp32 dot."""
    if kt_cache.dtype == torch.uint8:
        return torch.bfloat16
    return kt_cache.dtype if kt_cache.dtype in (torch.bfloat16, torch.float16) else None


def launch_score(
    plan: ScorePlan,
    scratch: ScoreScratch,
    query: torch.Tensor,
    kt_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_compact: torch.Tensor,
    tail_start: torch.Tensor,
    seq_lens: torch.Tensor,
    topr: torch.Tensor,
    page_size: int,
    k_cache=None,
    sel_slot: torch.Tensor | None = None,
    reuse: torch.Tensor | None = None,
    selections: torch.Tensor | None = None,
    topk: torch.Tensor | None = None,
    force_current_page: bool = False,
) -> None:
    """``_score_kernel``; with ``k_cache`` (a [num_blocks, Hkv, bs, d] view
    or an ``fp8_kv.Fp8KV``) each row's newest KT page is refreshed first.
    sel_slot, reuse, selections, topk (all or none: REUSE; force_current_page
    as ``launch_select``'s): rows reusing their stored selection
    (``launch_select``) score nothing."""
    batch, hq, d = query.shape
    _, hkv, pages_per_block, width = kt_cache.shape
    assert width == kt_row_width(kt_cache, d) and hq % hkv == 0
    assert kt_cache.stride(-1) == 1 and block_table.stride(-1) == 1
    assert query.stride(-1) == 1
    group = hq // hkv
    bs = pages_per_block * page_size
    update = k_cache is not None
    if update:
        k_cache, fp8, k_scale = kv_operand(k_cache)
        assert check_kv_cache(k_cache)[:2] == (hkv, bs)
        k_strides = cache_strides(k_cache)
    else:
        k_cache, fp8, k_scale, k_strides = kt_cache, 0, 1.0, (0, 0, 0, 0)
    reuse_on = reuse is not None
    assert reuse_on == (sel_slot is not None) == (selections is not None) == (topk is not None)
    if reuse_on:
        assert selections.dtype == torch.int32 and selections.is_contiguous()
        assert selections.dim() == 3 and selections.shape[1] == hkv
        store_width = selections.shape[2]
    else:  # not read
        sel_slot = reuse = topk = selections = topr
        store_width = 0
    half = _half_type(kt_cache)
    pdl = uses_pdl(query.device)
    # 4 warps up to d 128: more programs resident per SM than with 8 (sm_90,
    # d 128: 3 against 2 with Triton 3.9, 2 against 1 with 3.6, no spill);
    # 8 past it, where 4 spill (compile_kernels.py's register counts)
    _score_kernel[plan.grid](
        query,
        kt_cache,
        block_table,
        num_compact,
        tail_start,
        seq_lens,
        topr,
        scratch.logits,
        scratch.part_m,
        scratch.part_l,
        k_cache,
        topk,
        selections,
        sel_slot,
        reuse,
        hkv,
        plan.max_pages,
        plan.splits,
        plan.n_sel,
        1 if force_current_page else 0,
        store_width,
        k_scale,
        query.stride(0),
        query.stride(1),
        block_table.stride(0),
        kt_cache.stride(0),
        kt_cache.stride(1),
        kt_cache.stride(2),
        *k_strides,
        G=group,
        G_PAD=group_pad(group),
        D=d,
        D_PAD=head_pad(d),
        BS=bs,
        PS=page_size,
        PS_PAD=max(2, next_pow2(page_size)),
        BLOCK_P=plan.block_p,
        RANK_CHUNK=min(16, head_pad(d)),
        SPLIT=half is not None,
        UPCAST=half is not None and dot_upcast(half),
        HALF=_TL_DTYPE.get(half, tl.float32),
        KT_FP8=kt_cache.dtype == torch.uint8,
        FP8=fp8,
        UPDATE_KT=update,
        REUSE=reuse_on,
        PDL=pdl,
        launch_pdl=pdl,
        num_warps=4 if head_pad(d) <= 128 else 8,
    )


def launch_select(
    plan: ScorePlan,
    scratch: ScoreScratch,
    num_q_heads: int,
    num_compact: torch.Tensor,
    tail_start: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: torch.Tensor,
    page_size: int,
    force_current_page: bool,
    select: bool = True,
    write_probs: bool = False,
    from_probs: bool = False,
    selections: torch.Tensor | None = None,
    sel_slot: torch.Tensor | None = None,
    reuse: torch.Tensor | None = None,
) -> None:
    """``_select_kernel``: probabilities (written with write_probs) and / or
    the selection into scratch.sel (select). selections: the selection store
    int32 [S, Hkv, W] contiguous, with sel_slot, reuse [B] int32 (REUSE):
    rows with reuse set and a slot take their n_use pages from
    selections[slot, h, :n_use], others with a slot store theirs there (if
    n_use <= W); selection only (no probabilities)."""
    hkv = plan.num_kv_heads
    group = num_q_heads // hkv
    g2 = max(2, next_pow2(group))
    probs = scratch.probs
    assert probs is not None or not (plan.long or write_probs or from_probs)
    if probs is None:
        probs = scratch.logits  # unused
    else:
        assert probs.is_contiguous() and probs.numel() >= plan.batch * hkv * plan.max_pages
    reuse_on = selections is not None
    if reuse_on:
        assert sel_slot is not None and reuse is not None
        assert select and not (write_probs or from_probs)
        assert selections.dtype == torch.int32 and selections.is_contiguous()
        assert selections.dim() == 3 and selections.shape[1] == hkv
        store_width = selections.shape[2]
    else:  # not read
        selections = sel_slot = reuse = scratch.sel
        store_width = 0
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
        num_compact,
        tail_start,
        seq_lens,
        topk,
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
    num_compact, tail_start, seq_lens, topr = row_vectors(num_compact, tail_start, seq_lens, topr)
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
    launch_score(
        plan,
        scratch,
        query,
        kt_cache,
        block_table,
        num_compact,
        tail_start,
        seq_lens,
        topr,
        page_size,
    )
    launch_select(
        plan,
        scratch,
        hq,
        num_compact,
        tail_start,
        seq_lens,
        seq_lens,  # topk: unused without the selection
        page_size,
        force_current_page,
        select=False,
        write_probs=True,
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
    num_compact, tail_start, seq_lens, topk = row_vectors(num_compact, tail_start, seq_lens, topk)
    plan = plan_score(batch, hkv, max_pages, max_select, force_current_page, num_sms(probs.device))
    if batch == 0:
        return torch.empty(batch, hkv, plan.n_sel, device=probs.device, dtype=torch.int32)
    scratch = ScoreScratch.alloc(plan, hkv, probs.device, logits=False)
    scratch.probs = probs
    launch_select(
        plan,
        scratch,
        hkv,
        num_compact,
        tail_start,
        seq_lens,
        topk,
        page_size,
        force_current_page,
        from_probs=True,
    )
    return scratch.sel
