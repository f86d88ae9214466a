"""Stage 2 attention: exact decode attention over the selected pages, batched.

Every query head of decode row b attends (scale given, fp32 softmax) to the
tokens of the pages its KV head selected: ``sel [B, Hkv, n_sel]`` holds page
indices of the row's view (as ``page_select.select_pages`` returns them; order
does not matter); row b uses its first n_use[b] = min(max(topk[b] // ps, 1) +
extra_pages, P[b], n_sel) entries (extra_pages = 1 for a forced current
page on top of the top-k pages). Tokens of a page past the end of its region (num_compact
for compact pages, seq_len for tail pages) are masked, so nothing outside
the view is ever read. K and V are read through two views ``k_cache``,
``v_cache`` [num_blocks, Hkv, bs, d], each with its own block / head / slot
/ channel strides, so any K/V placement inside a (padded) block works,
K stored transposed per head block (CPU_ATTN) included.

Flash-decoding structure, one launch: ``_sparse_decode_kernel`` grid
(B*Hkv, S): split s takes a run of about n_use / S selected-page entries of
the row (whole pages, so at batch 1 a few pages a program fill the GPU), in
tiles of PAGES_PER_TILE pages (BLOCK_N = PAGES_PER_TILE * ps tokens). K/V of
a tile are loaded once per KV head and all G queries use them: one [G_pad, d]
x [d, BLOCK_N] dot for the logits and one [G_pad, BLOCK_N] x [BLOCK_N, d] dot
for P.V (fp32 accumulation, online softmax in log2 units). With S == 1 the
result goes straight to ``out``; else each split stores a normalised partial
and its log-sum-exp per query head, and the row's last split to finish (an
atomic counter per (row, KV head) in the scratch, which that split resets to
0, so a CUDA-graph replay finds it at 0) merges the S partials into ``out``:
no separate merge launch.

Attention sinks (``sinks`` [Hq] fp32, ``algorithm.sinks``; SINKS constexpr):
the sink adds exp(s_h - m) to a query head's softmax denominator and nothing
to its numerator. It is added exactly once per query head: when the result
is final, i.e. in ``_store_result`` with one split, else in the merge (the
partials and their log-sum-exps stay the keys' own).

The splits are sized from Python ints (B, Hkv, n_sel, the SM count), never
from tensor contents, so the launch is CUDA-graph capturable.
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
    kv_values,
    mma,
    next_pow2,
    num_sms,
    uses_pdl,
)
from rocketkv_vllm.kernels.rows import (
    STAGE2_UNSPECIALIZED,
    DecodeRows,
    selection_size,
    view_pages,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(q, k, v, ok, m_i, l_i, acc, scale_log2, UPCAST: tl.constexpr):
    """One online-softmax step of G_pad queries over a K/V tile ([N, D_PAD];
    tokens with ok == False are ignored). Dequantized fp8 tiles (fp32) go
    into the dots in the query's dtype, as in TRITON_ATTN; other tiles
    already have it."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    s = mma(q, tl.trans(k), UPCAST) * scale_log2
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(q.dtype), v, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _sink_term(sink_ptr, hq, ok, m):
    """exp2(sink - m) per query head hq (m: a running max in log2 units;
    -inf: no key seen). The sink logit is in natural units, unscaled."""
    sink = tl.load(sink_ptr + hq, mask=ok, other=float("-inf")) * 1.4426950408889634
    return tl.exp2(sink - tl.where(m == float("-inf"), 0.0, m))


@triton.jit
def _store_result(
    acc,
    m_i,
    l_i,
    o_ptr,
    lse_ptr,
    out_ptr,
    sink_ptr,
    b,
    h,
    bh,
    split,
    num_splits,
    seq,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    DIRECT: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Normalised output: to ``out`` (one split) or as a partial + lse."""
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    mask = (g < G)[:, None] & (d < D)[None, :]
    if DIRECT and SINKS:  # the final result: the sink's term, once
        l_i = l_i + _sink_term(sink_ptr, h * G + g, g < G, m_i)
    has = l_i > 0
    res = acc / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:
        # padding rows (seq_len <= 0) keep what ``out`` holds
        dst = out_ptr + b.to(tl.int64) * stride_ob + (h * G + g)[:, None] * stride_oh + d[None, :]
        row_ok = (g * 0 + seq) > 0
        tl.store(dst, res.to(out_ptr.dtype.element_ty), mask=mask & row_ok[:, None])
    else:
        idx = (bh.to(tl.int64) * num_splits + split) * G + g
        tl.store(o_ptr + idx[:, None] * D + d[None, :], res, mask=mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + idx, lse, mask=g < G)


@triton.jit
def _load_q(
    q_ptr,
    b,
    h,
    stride_qb,
    stride_qh,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
):
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    return tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :],
        mask=(g < G)[:, None] & (d < D)[None, :],
        other=0.0,
    )


@triton.jit
def _load_kv(
    k_ptr,
    v_ptr,
    blk,
    h,
    off,
    ok,
    d,
    d_ok,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    k_scale,
    v_scale,
    FP8: tl.constexpr,
):
    """K and V tiles [N, D_PAD] of head h at (block blk, offset off) per
    token, each through its own strides, as numbers (fp8 codes dequantized:
    ``kv_values``); tokens with ok == False read 0. A channel stride of 1
    is specialized by Triton (unit-stride loads)."""
    mask = ok[:, None] & d_ok[None, :]
    k_row = k_ptr + blk * stride_kb + h * stride_kh + off * stride_ks
    v_row = v_ptr + blk * stride_vb + h * stride_vh + off * stride_vs
    k = tl.load(k_row[:, None] + d[None, :] * stride_kd, mask=mask, other=0)
    v = tl.load(v_row[:, None] + d[None, :] * stride_vd, mask=mask, other=0)
    return kv_values(k, k_scale, FP8), kv_values(v, v_scale, FP8)


@triton.jit
def _merge_partials(
    o_ptr,
    lse_ptr,
    out_ptr,
    sink_ptr,
    b,
    h,
    bh,
    num_splits,
    seq,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    G2: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    SC: tl.constexpr,
    SINKS: tl.constexpr,
):
    """The S partials of (row b, KV head h) -> ``out`` (online over SC
    splits at a time; the sink's term once, at the end). Loads bypass L1:
    other programs wrote the partials during this launch."""
    g = tl.arange(0, G2)
    g_ok = g < G
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    m = tl.full([G2], float("-inf"), tl.float32)
    total = tl.zeros([G2], tl.float32)
    acc = tl.zeros([G2, D_PAD], tl.float32)
    for s0 in range(0, num_splits, SC):
        s = s0 + tl.arange(0, SC)
        ok = (s < num_splits)[:, None] & g_ok[None, :]
        idx = (bh.to(tl.int64) * num_splits + s)[:, None] * G + g[None, :]
        lse = tl.load(lse_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(
            o_ptr + idx[:, :, None] * D + d[None, None, :],
            mask=ok[:, :, None] & d_ok[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe[None, :])
        total = total * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        m = m_new
    if SINKS:  # the partials hold none: the sink's term, once
        total += _sink_term(sink_ptr, h * G + g, g_ok, m)
    res = acc / tl.where(total > 0, total, 1.0)[:, None]
    dst = out_ptr + b.to(tl.int64) * stride_ob + (h * G + g)[:, None] * stride_oh + d[None, :]
    # padding rows (seq_len <= 0) keep what ``out`` holds
    row_ok = g_ok & ((g * 0 + seq) > 0)
    tl.store(dst, res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# vLLM's block-table width: not specialized (``rows.STAGE2_UNSPECIALIZED``).
@triton.jit(do_not_specialize=STAGE2_UNSPECIALIZED)
def _sparse_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    sel_ptr,
    nc_ptr,
    ts_ptr,
    seq_ptr,
    topk_ptr,
    o_ptr,
    lse_ptr,
    count_ptr,
    out_ptr,
    sink_ptr,
    num_kv_heads,
    num_sel,
    num_splits,
    extra,
    scale_log2,
    k_scale,
    v_scale,
    stride_qb,
    stride_qh,
    stride_bt,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    G2: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    PS: tl.constexpr,
    PAGES_PER_TILE: tl.constexpr,
    SC: tl.constexpr,
    UPCAST: tl.constexpr,
    DIRECT: tl.constexpr,
    SINKS: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_dependency(PDL)
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    nc, ts, seq, npc, num_pages = view_pages(nc_ptr, ts_ptr, seq_ptr, b, PS)
    n_use = selection_size(topk_ptr, b, num_pages, num_sel, extra, PS)

    q = _load_q(q_ptr, b, h, stride_qb, stride_qh, G, G_PAD, D, D_PAD)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    t = tl.arange(0, PAGES_PER_TILE * PS)
    tp = t // PS
    to = t % PS
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    sel_row = sel_ptr + bh.to(tl.int64) * num_sel
    row_bt = bt_ptr + b.to(tl.int64) * stride_bt
    # The row's own entries spread over the splits, whole pages each (the
    # grid is fixed by n_sel; under a CUDA graph n_sel is the largest any
    # row may use).
    per_split = (n_use + num_splits - 1) // num_splits
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_use)
    for e0 in range(lo, hi, PAGES_PER_TILE):
        e = e0 + tp
        e_ok = e < hi
        j = tl.load(sel_row + e, mask=e_ok, other=0).to(tl.int32)
        in_compact = j < npc
        start = tl.where(in_compact, j * PS, ts + (j - npc) * PS)
        end = tl.where(in_compact, nc, seq)
        slot = start + to
        ok = e_ok & (slot < end)
        blk = tl.load(row_bt + start // BS, mask=ok, other=0).to(tl.int64)
        k, v = _load_kv(
            k_ptr,
            v_ptr,
            blk,
            h,
            slot % BS,
            ok,
            d,
            d_ok,
            stride_kb,
            stride_kh,
            stride_ks,
            stride_kd,
            stride_vb,
            stride_vh,
            stride_vs,
            stride_vd,
            k_scale,
            v_scale,
            FP8,
        )
        m_i, l_i, acc = _attend_tile(q, k, v, ok, m_i, l_i, acc, scale_log2, UPCAST)
    _store_result(
        acc,
        m_i,
        l_i,
        o_ptr,
        lse_ptr,
        out_ptr,
        sink_ptr,
        b,
        h,
        bh,
        split,
        num_splits,
        seq,
        stride_ob,
        stride_oh,
        G,
        G_PAD,
        D,
        D_PAD,
        DIRECT,
        SINKS,
    )
    if not DIRECT:
        # The last split of (row, head) to get here merges: every thread's
        # partial is stored (barrier), then a release / acquire counter.
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel")
        if done == num_splits - 1:
            tl.atomic_xchg(count_ptr + bh, 0, sem="relaxed")  # for the next launch / replay
            _merge_partials(
                o_ptr,
                lse_ptr,
                out_ptr,
                sink_ptr,
                b,
                h,
                bh,
                num_splits,
                seq,
                stride_ob,
                stride_oh,
                G,
                G2,
                D,
                D_PAD,
                SC,
                SINKS,
            )


# Launch settings from compile_kernels.py's register counts (Triton 3.6 and
# 3.9, sm_80 / sm_90): 16-bit caches pipeline their K/V loads 3 deep (no
# spills; 2 stages spilled a few bytes at d 64 on sm_90); fp32 caches use
# 16-token tiles, unpipelined: an fp32 dot runs on FMAs and holds its whole
# reduction dim per thread (64-token tiles spilled up to 9 KB a thread).
FP32_TILE_TOKENS = 16
MAX_TILE_TOKENS = 64
# Programs per SM the grid aims at, and the fewest tokens a split takes (a
# program's fixed cost -- query, partial, counter -- against its tokens).
PROGRAMS_PER_SM = 4
MIN_SPLIT_TOKENS = 8


def launch_options(dtype: torch.dtype) -> dict:
    return dict(num_warps=4, num_stages=1 if dtype == torch.float32 else 3)


@dataclass(frozen=True)
class AttentionPlan:
    """Launch shape of ``_sparse_decode_kernel``: grid (B*Hkv, splits)."""

    batch: int
    num_kv_heads: int
    n_sel: int
    splits: int
    pages_per_tile: int

    @property
    def grid(self) -> tuple[int, int]:
        return (self.batch * self.num_kv_heads, self.splits)

    def busy_programs(self, n_use: int) -> int:
        """Programs with pages to attend for rows using n_use entries each."""
        n_use = min(int(n_use), self.n_sel)
        if n_use <= 0:
            return 0
        return self.batch * self.num_kv_heads * cdiv(n_use, cdiv(n_use, self.splits))


def plan_attention(
    batch: int,
    num_kv_heads: int,
    n_sel: int,
    page_size: int,
    dtype: torch.dtype,
    sms: int,
    num_splits: int | None = None,
    tile_tokens: int | None = None,
) -> AttentionPlan:
    """Splits: about PROGRAMS_PER_SM programs per SM over the B*Hkv rows,
    each split at least MIN_SPLIT_TOKENS tokens (and one page) of a full
    selection; tiles: the tokens a split takes, 16 to 64 (fp32: 16)."""
    n_sel = max(1, int(n_sel))
    if num_splits is None:
        num_splits = min(
            cdiv(PROGRAMS_PER_SM * sms, max(1, batch * num_kv_heads)),
            cdiv(n_sel * page_size, MIN_SPLIT_TOKENS),
        )
    splits = max(1, min(int(num_splits), n_sel))
    per_split = cdiv(n_sel, splits)
    splits = cdiv(n_sel, per_split)  # a full selection leaves no split empty
    top = FP32_TILE_TOKENS if dtype == torch.float32 else MAX_TILE_TOKENS
    if tile_tokens is None:
        tile_tokens = max(16, next_pow2(per_split * page_size))
    tile_tokens = min(int(tile_tokens), top)
    return AttentionPlan(
        batch=int(batch),
        num_kv_heads=int(num_kv_heads),
        n_sel=n_sel,
        splits=splits,
        pages_per_tile=max(1, tile_tokens // page_size),
    )


@dataclass
class AttentionScratch:
    """Split partials and the per-(row, head) counters (all 0) of one launch."""

    o_part: torch.Tensor  # fp32, >= B*Hkv*splits*G*d
    lse_part: torch.Tensor  # fp32, >= B*Hkv*splits*G
    counters: torch.Tensor  # int32, >= B*Hkv

    @staticmethod
    def sizes(plan: AttentionPlan, num_q_heads: int, head_dim: int) -> dict[str, int]:
        if plan.splits == 1:
            return dict(o_part=0, lse_part=0, counters=0)
        parts = plan.batch * num_q_heads * plan.splits
        return dict(
            o_part=parts * head_dim,
            lse_part=parts,
            counters=plan.batch * plan.num_kv_heads,
        )

    @classmethod
    def alloc(cls, plan: AttentionPlan, num_q_heads: int, head_dim: int, device):
        n = cls.sizes(plan, num_q_heads, head_dim)
        return cls(
            o_part=torch.empty(max(1, n["o_part"]), device=device, dtype=torch.float32),
            lse_part=torch.empty(max(1, n["lse_part"]), device=device, dtype=torch.float32),
            counters=torch.zeros(max(1, n["counters"]), device=device, dtype=torch.int32),
        )


def compute_dtype(query_dtype: torch.dtype, k_cache: torch.Tensor, fp8) -> torch.dtype:
    """What the attention dots run in: the cache's dtype, or with an fp8
    cache (codes) the query's."""
    return query_dtype if fp8 else k_cache.dtype


def _prepare(query, k_cache, v_cache, out, sinks=None, fp8=0):
    hkv, bs, d = check_kv_cache(k_cache, v_cache)
    batch, hq, dq = query.shape
    assert dq == d and hq % hkv == 0
    if sinks is not None:
        assert sinks.shape == (hq,), f"sinks must be [num_q_heads={hq}], got {tuple(sinks.shape)}"
        sinks = sinks.float().contiguous()  # no copy for the usual fp32 vector
    query = query.to(compute_dtype(query.dtype, k_cache, fp8))
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:  # zeros: padding rows (seq_len <= 0) are never written
        out = torch.zeros(batch, hq, d, device=query.device, dtype=query.dtype)
    assert out.shape == (batch, hq, d) and out.stride(-1) == 1
    return query, out, sinks, hkv, bs, d, hq // hkv


def sparse_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: DecodeRows,
    sel: torch.Tensor,
    page_size: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tile_tokens: int | None = None,
    extra_pages: int = 0,
    sinks: torch.Tensor | None = None,
    scratch: AttentionScratch | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Exact attention of query [B, Hq, d] over each KV head's selected pages.

    sel [B, Hkv, n_sel] integer page indices of the row's view (row b uses
    its first min(max(topk[b] // page_size, 1) + extra_pages, P[b], n_sel));
    rows: the decode rows (their block table and view columns; topr, the
    bounds and the store columns are not read).
    k_cache, v_cache: [num_blocks, Hkv, bs, d] views (all strides arbitrary),
    or ``fp8_kv.Fp8KV`` views of an fp8 cache (dequantized on load; the
    query's dtype computes).
    Returns ``out`` [B, Hq, d] (allocated in the compute dtype if not given).
    num_splits, tile_tokens: override ``plan_attention``'s (tile at most
    FP32_TILE_TOKENS for fp32); plan: the launch shape, decided by the
    caller; scratch: the partials and counters (all 0) to use (else
    allocated). sinks: optional [Hq] sink logits (fp32; ``algorithm.sinks``).
    """
    k_cache, fp8, k_scale = kv_operand(k_cache)
    v_cache, v_fp8, v_scale = kv_operand(v_cache)
    assert v_fp8 == fp8, "K and V of one cache share its format"
    query, out, sinks, hkv, bs, d, group = _prepare(query, k_cache, v_cache, out, sinks, fp8)
    dtype = query.dtype  # what the dots run in: the cache's, or the query's (fp8)
    batch = query.shape[0]
    block_table = rows.block_table
    assert sel.shape[:2] == (batch, hkv) and sel.stride(-1) == 1
    assert block_table.stride(-1) == 1 and bs % page_size == 0
    if batch == 0:
        return out
    if not sel.is_contiguous():
        sel = sel.contiguous()
    num_sel = sel.shape[2]
    rows = rows.flat()
    if plan is None:
        plan = plan_attention(
            batch, hkv, num_sel, page_size, dtype, num_sms(query.device), num_splits, tile_tokens
        )
    assert plan.grid[0] == batch * hkv and plan.n_sel == max(1, num_sel)
    direct = plan.splits == 1
    if scratch is None:
        scratch = AttentionScratch.alloc(plan, group * hkv, d, query.device)
    g2 = max(2, next_pow2(group))
    pdl = uses_pdl(query.device)
    _sparse_decode_kernel[plan.grid](
        query,
        k_cache,
        v_cache,
        block_table,
        sel,
        rows.num_compact,
        rows.tail_start,
        rows.seq_lens,
        rows.topk,
        scratch.o_part,
        scratch.lse_part,
        scratch.counters,
        out,
        out if sinks is None else sinks,  # unused without sinks
        hkv,
        num_sel,
        plan.splits,
        int(extra_pages),
        float(scale) * _LOG2E,
        k_scale,
        v_scale,
        query.stride(0),
        query.stride(1),
        block_table.stride(0),
        *cache_strides(k_cache),
        *cache_strides(v_cache),
        out.stride(0),
        out.stride(1),
        G=group,
        G_PAD=group_pad(group),
        G2=g2,
        D=d,
        D_PAD=head_pad(d),
        BS=bs,
        PS=page_size,
        PAGES_PER_TILE=plan.pages_per_tile,
        SC=max(1, min(next_pow2(plan.splits), 4096 // (g2 * head_pad(d)))),
        UPCAST=dot_upcast(dtype),
        DIRECT=direct,
        SINKS=sinks is not None,
        FP8=fp8,
        PDL=pdl,
        launch_pdl=pdl,
        **launch_options(dtype),
    )
    return out
