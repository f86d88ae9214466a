"""Stage 2 scoring (HSA): page logits of every view page, batched, and the
launch plan of the scoring + selection pair.

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
  token's probability (the selection kernel, ``page_select``, computes it
  from this kernel's logits and partials).

The view's pages and a row's selection size: ``rows``.

Two launches, both grid (B*Hkv, S) (S from B, Hkv, max_pages and the SM
count: ``plan_score``, Python ints, so CUDA-graph safe; each row's own P
pages are spread over the S splits in whole tiles of BLOCK_P, so the work
follows P, not max_pages, when a CUDA graph fixes max_pages at its largest),
sharing one scratch (``ScoreScratch``):

1. ``_score_kernel`` (here): (decode, ``update_kt``) the split holding the
   row's last page -- the newest token's -- first recomputes that page's KT
   row from its keys (``kt_update.refresh_kt_row``, what the separate KT
   update launch did), then every split scores its pages: one [G_pad, d] x
   [d, BLOCK_P] fp32 dot per tile, the tempered logits (log2 units) to a
   scratch [B, Hkv, G, max_pages], each split's partial max /
   token-weighted sum-of-exp per query head to [B*Hkv, S, G_pad].
2. ``page_select._select_kernel``: probabilities and the top-n_use pages.

Selection reuse (REUSE; off: not compiled in; ``rows.store_reuse``): a
reusing (row, head) still gets its KT page refreshed, then its scoring
programs return.
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
    uses_pdl,
)
from rocketkv_vllm.kernels._utils import num_sms as num_sms
from rocketkv_vllm.kernels.kt_fp8 import kt_row_width, load_kt_fp8_bounds
from rocketkv_vllm.kernels.kt_update import refresh_kt_row
from rocketkv_vllm.kernels.rows import (
    STAGE2_UNSPECIALIZED,
    DecodeRows,
    selection_size,
    split_range,
    store_reuse,
    view_pages,
)

_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E)
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


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
    nc, ts, seq, npc, num_pages = view_pages(nc_ptr, ts_ptr, seq_ptr, b, PS)
    # (a row with more pages than max_pages is a caller error: its pages
    # past max_pages are ignored rather than written out of bounds)
    row_pages = tl.minimum(num_pages, max_pages)
    chunk, lo, hi = split_range(row_pages, num_splits, split, BLOCK_P)
    row_bt = bt_ptr + b.to(tl.int64) * stride_bt
    if REUSE:  # decided before the refresh (after it: +30 registers on sm_90)
        n_use = selection_size(topk_ptr, b, num_pages, num_sel, extra, PS)
        _, _, reusing = store_reuse(
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
# The selection's radix search counts a row's pages in 21-bit fields
# (``page_select``): rows hold fewer than 2**21 pages.
FIELD_BITS = 21
MAX_SELECT_ROW = 1 << FIELD_BITS


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
    rows: DecodeRows,
    page_size: int,
    k_cache=None,
    selections: torch.Tensor | None = None,
    force_current_page: bool = False,
) -> None:
    """``_score_kernel`` over ``rows`` (``rows.flat()`` vectors); with
    ``k_cache`` (a [num_blocks, Hkv, bs, d] view or an ``fp8_kv.Fp8KV``)
    each row's newest KT page is refreshed first. With ``selections``
    (REUSE: the rows' sel_slot and reuse, force_current_page as
    ``launch_select``'s) rows reusing their stored selection
    (``launch_select``) score nothing."""
    batch, hq, d = query.shape
    _, hkv, pages_per_block, width = kt_cache.shape
    block_table = rows.block_table
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
    store_width = rows.store_width(selections, hkv)
    reuse_on = selections is not None
    topr = rows.topr
    if reuse_on:
        sel_slot, reuse, topk = rows.sel_slot, rows.reuse, rows.topk
    else:  # not read
        sel_slot = reuse = topk = selections = topr
    half = _half_type(kt_cache)
    pdl = uses_pdl(query.device)
    # 4 warps up to d 128: more programs resident per SM than with 8 (sm_90,
    # d 128: 3 against 2 with Triton 3.9, 2 against 1 with 3.6, no spill);
    # 8 past it, where 4 spill (compile_kernels.py's register counts)
    _score_kernel[plan.grid](
        query,
        kt_cache,
        block_table,
        rows.num_compact,
        rows.tail_start,
        rows.seq_lens,
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
