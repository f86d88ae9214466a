"""Stage 2 attention: exact decode attention over the selected pages, batched.

Every query head of decode row b attends (scale given, fp32 softmax) to the
tokens of the pages its KV head selected: ``sel [B, Hkv, n_sel]`` holds page
indices of the row's view (as ``hsa_score.select_pages`` returns them; order
does not matter); row b uses its first n_use[b] = min(max(topk[b] // ps, 1) +
extra_pages, P[b], n_sel) entries (extra_pages = 1 for a forced current
page on top of the top-k pages). Tokens of a page past the end of its region (num_compact
for compact pages, seq_len for tail pages) are masked, so nothing outside
the view is ever read. K and V are read through two views ``k_cache``,
``v_cache`` [num_blocks, Hkv, bs, d], each with its own block / head / slot
/ channel strides, so any K/V placement inside a (padded) block works,
K stored transposed per head block (CPU_ATTN) included.

Flash-decoding structure:
* ``_sparse_decode_kernel`` grid (B*Hkv, S): split s takes a fixed run of
  selected-page entries, in tiles of PAGES_PER_TILE pages (BLOCK_N =
  PAGES_PER_TILE * ps tokens). K/V of a tile are loaded once per KV head and
  all G queries use them: one [G_pad, d] x [d, BLOCK_N] dot for the logits and
  one [G_pad, BLOCK_N] x [BLOCK_N, d] dot for P.V (fp32 accumulation, online
  softmax in log2 units). Output: a normalised partial and its log-sum-exp
  per query head; with S == 1 the result goes straight to ``out``.
* ``_merge_splits_kernel`` grid (B*Hq): merges the S partials.

Attention sinks (``sinks`` [Hq] fp32, ``algorithm.sinks``; SINKS constexpr):
the sink adds exp(s_h - m) to a query head's softmax denominator and nothing
to its numerator. It is added exactly once per query head: when the result
is final, i.e. in ``_store_result`` with one split, else in the merge (the
partials and their log-sum-exps stay the keys' own).

The splits are sized from Python ints (B, Hkv, n_sel, the SM count), never
from tensor contents, so the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocketkv_vllm.kernels._utils import (
    cache_strides,
    cdiv,
    check_kv_cache,
    dot_upcast,
    group_pad,
    head_pad,
    kv_operand,
    kv_values,
    mma,
    next_pow2,
    num_sms,
    row_vectors,
)
from rocketkv_vllm.kernels.hsa_score import _view_pages

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
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    PS: tl.constexpr,
    PAGES_PER_TILE: tl.constexpr,
    UPCAST: tl.constexpr,
    DIRECT: tl.constexpr,
    SINKS: tl.constexpr,
    FP8: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    nc, ts, seq, npc, num_pages = _view_pages(nc_ptr, ts_ptr, seq_ptr, b, PS)
    n_want = tl.maximum(tl.load(topk_ptr + b).to(tl.int32) // PS, 1) + extra
    n_use = tl.minimum(tl.minimum(n_want, num_pages), num_sel)

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
    # The row's own entries spread over the splits (the grid is fixed by
    # n_sel; under a CUDA graph n_sel is the largest any row may use).
    tiles_per_split = (
        (n_use + PAGES_PER_TILE - 1) // PAGES_PER_TILE + num_splits - 1
    ) // num_splits
    lo = split * (tiles_per_split * PAGES_PER_TILE)
    hi = tl.minimum(lo + tiles_per_split * PAGES_PER_TILE, n_use)
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


@triton.jit
def _merge_splits_kernel(
    o_ptr,
    lse_ptr,
    out_ptr,
    seq_ptr,
    sink_ptr,
    num_q_heads,
    num_splits,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    SINKS: tl.constexpr,
):
    pid = tl.program_id(0)  # = b * Hq + hq = (b * Hkv + h) * G + g
    b = pid // num_q_heads
    seq = tl.load(seq_ptr + b)  # padding rows (<= 0): ``out`` keeps what it holds
    hq = pid % num_q_heads
    bh = pid // G
    g = pid % G
    s = tl.arange(0, S_PAD)
    s_ok = s < num_splits
    idx = (bh.to(tl.int64) * num_splits + s) * G + g
    lse = tl.load(lse_ptr + idx, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    total = tl.sum(w, 0)
    if SINKS:  # the partials hold none: the sink's term, once
        total += _sink_term(sink_ptr, hq, hq < num_q_heads, m)
    d = tl.arange(0, D_PAD)
    o = tl.load(
        o_ptr + idx[:, None] * D + d[None, :], mask=s_ok[:, None] & (d < D)[None, :], other=0.0
    )
    res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + b.to(tl.int64) * stride_ob + hq * stride_oh + d,
        res.to(out_ptr.dtype.element_ty),
        mask=(d < D) & ((d * 0 + seq) > 0),
    )


# Launch settings from compile_kernels.py's register counts (Triton 3.6 and
# 3.9, sm_80 / sm_90): 16-bit caches pipeline their K/V loads 3 deep (no
# spills; 2 stages spilled a few bytes at d 64 on sm_90); fp32 caches use
# 16-token tiles, unpipelined: an fp32 dot runs on FMAs and holds its whole
# reduction dim per thread (64-token tiles spilled up to 9 KB a thread).
FP32_TILE_TOKENS = 16


def launch_options(dtype: torch.dtype) -> dict:
    return dict(num_warps=4, num_stages=1 if dtype == torch.float32 else 3)


def plan_splits(
    num_tiles: int, num_programs: int, device: torch.device, num_splits: int | None = None
) -> tuple[int, int]:
    """(splits, tiles per split) for num_tiles tiles of work per program row:
    enough programs to fill the GPU (about 4 per SM), never an empty split."""
    num_tiles = max(1, int(num_tiles))
    if num_splits is None:
        num_splits = cdiv(4 * num_sms(device), max(1, num_programs))
    num_splits = max(1, min(int(num_splits), num_tiles))
    tiles_per_split = cdiv(num_tiles, num_splits)
    return cdiv(num_tiles, tiles_per_split), tiles_per_split


def merge_splits(o_part, lse_part, out, seq_lens, num_splits, group, d, sinks=None):
    batch, hq, _ = out.shape
    _merge_splits_kernel[(batch * hq,)](
        o_part,
        lse_part,
        out,
        seq_lens,
        out if sinks is None else sinks,  # unused without sinks
        hq,
        num_splits,
        out.stride(0),
        out.stride(1),
        G=group,
        D=d,
        D_PAD=head_pad(d),
        S_PAD=max(2, next_pow2(num_splits)),
        SINKS=sinks is not None,
        num_warps=4,
    )


def _prepare(query, k_cache, v_cache, out, sinks=None, fp8=0):
    hkv, bs, d = check_kv_cache(k_cache, v_cache)
    batch, hq, dq = query.shape
    assert dq == d and hq % hkv == 0
    if sinks is not None:
        assert sinks.shape == (hq,), f"sinks must be [num_q_heads={hq}], got {tuple(sinks.shape)}"
        sinks = sinks.float().contiguous()  # no copy for the usual fp32 vector
    if not fp8 and query.dtype != k_cache.dtype:  # fp8: the query's dtype computes
        query = query.to(k_cache.dtype)
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
    block_table: torch.Tensor,
    sel: torch.Tensor,
    num_compact: torch.Tensor,
    tail_start: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: torch.Tensor,
    page_size: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    tile_tokens: int = 64,
    extra_pages: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of query [B, Hq, d] over each KV head's selected pages.

    sel [B, Hkv, n_sel] integer page indices of the row's view (row b uses
    its first min(max(topk[b] // page_size, 1) + extra_pages, P[b], n_sel));
    per-row
    scalars are device integer tensors [B]; block_table [B, max_blocks].
    k_cache, v_cache: [num_blocks, Hkv, bs, d] views (all strides arbitrary),
    or ``fp8_kv.Fp8KV`` views of an fp8 cache (dequantized on load; the
    query's dtype computes).
    Returns ``out`` [B, Hq, d] (allocated in the compute dtype if not given).
    tile_tokens: tokens a tile (at most FP32_TILE_TOKENS for fp32).
    sinks: optional [Hq] sink logits (fp32; ``algorithm.sinks``).
    """
    k_cache, fp8, k_scale = kv_operand(k_cache)
    v_cache, v_fp8, v_scale = kv_operand(v_cache)
    assert v_fp8 == fp8, "K and V of one cache share its format"
    query, out, sinks, hkv, bs, d, group = _prepare(query, k_cache, v_cache, out, sinks, fp8)
    dtype = query.dtype  # what the dots run in: the cache's, or the query's (fp8)
    if dtype == torch.float32:
        tile_tokens = min(tile_tokens, FP32_TILE_TOKENS)
    batch = query.shape[0]
    assert sel.shape[:2] == (batch, hkv) and sel.stride(-1) == 1
    assert block_table.stride(-1) == 1 and bs % page_size == 0
    if batch == 0:
        return out
    sel = sel.contiguous()
    num_sel = sel.shape[2]
    num_compact, tail_start, seq_lens, topk = row_vectors(num_compact, tail_start, seq_lens, topk)
    pages_per_tile = max(1, tile_tokens // page_size)
    splits, _ = plan_splits(cdiv(num_sel, pages_per_tile), batch * hkv, query.device, num_splits)
    direct = splits == 1
    g_pad = group_pad(group)
    if direct:
        o_part = lse_part = out  # unused
    else:
        o_part = torch.empty(
            batch * hkv * splits * group, d, device=query.device, dtype=torch.float32
        )
        lse_part = torch.empty(
            batch * hkv * splits * group, device=query.device, dtype=torch.float32
        )
    _sparse_decode_kernel[(batch * hkv, splits)](
        query,
        k_cache,
        v_cache,
        block_table,
        sel,
        num_compact,
        tail_start,
        seq_lens,
        topk,
        o_part,
        lse_part,
        out,
        out if sinks is None else sinks,  # unused without sinks
        hkv,
        num_sel,
        splits,
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
        G_PAD=g_pad,
        D=d,
        D_PAD=head_pad(d),
        BS=bs,
        PS=page_size,
        PAGES_PER_TILE=pages_per_tile,
        UPCAST=dot_upcast(dtype),
        DIRECT=direct,
        SINKS=sinks is not None,
        FP8=fp8,
        **launch_options(dtype),
    )
    if not direct:
        merge_splits(o_part, lse_part, out, seq_lens, splits, group, d, sinks)
    return out
