"""Stage 1 write-back: in-place compaction of kept tokens and KT page builds.

K and V come as two views ``k_cache``, ``v_cache`` [num_blocks, Hkv, bs, d]
(block / head / slot / channel strides arbitrary and passed per tensor), so
the same kernels serve a per-token K|V layout, a per-head K-rows-then-V-rows
layout, K transposed per head block (CPU_ATTN) and padded blocks; nothing
outside the two views' elements is read or written.

``compact_kept_tokens`` -- per KV head h, move the K and V rows of logical
slot kept[h, j] to slot j (j < C), through the request's block table, in
place.

Why the in-place move is safe. ``kept[h]`` is strictly increasing with
kept[h, j] >= j. Each program owns one KV head and one slice of the d
columns of both K and V (no other program touches those bytes; K and V
rows never overlap) and walks j upward in tiles of BLOCK_J rows:
  * tile t reads sources kept[h, j] >= j >= j0(t) and writes destinations
    j < j0(t+1); all earlier tiles wrote only slots < j0(t), so no source of
    tile t (or of any later tile) was overwritten before it is read -- this
    also holds if the compiler prefetches a later tile's loads early;
  * inside one tile a destination may be another row's source (e.g. kept =
    [5, 6, ...] with tile rows 5, 6 moving down): every load (K and V) of
    the tile is issued before a CTA barrier (``tl.debug_barrier``,
    bar.sync, which orders the CTA's global memory accesses) and every
    store after it.
  * rows with kept[h, j] == j are neither read nor written.
Under the interpreter a tile's load completes before its store anyway.

``write_kt_pages`` -- the KT min/max pages covering logical slots [lo, hi)
(lo page aligned) from the keys in [lo, hi) only (slots >= hi of the last
page are ignored), exactly like ``ops.pytorch.write_kt_pages`` (a uint8 KT cache
gets the fp8 rows of ``algorithm.kt_fp8``, bit for bit). A page never
straddles a KV block because page_size divides block_size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocketkv_vllm.kernels._utils import (
    cache_strides,
    cdiv,
    check_kv_cache,
    head_pad,
    kv_operand,
    kv_values,
    next_pow2,
)
from rocketkv_vllm.kernels.kt_fp8 import kt_row_width, store_kt_fp8_rows

# Arguments that change from prompt to prompt (its block-table row, kept
# positions, page range): not specialized, so one compile per engine serves
# every prompt (see ``window_scores.STAGE1_PER_PROMPT_STATS``).
STAGE1_PER_PROMPT_COMPACT = ["bt_ptr", "kept_ptr", "num_kept", "stride_kept"]
STAGE1_PER_PROMPT_KT_PAGES = ["bt_ptr", "lo", "hi", "num_pages"]


@triton.jit(do_not_specialize=STAGE1_PER_PROMPT_COMPACT)
def _compact_kernel(
    k_ptr,
    v_ptr,
    bt_ptr,
    kept_ptr,
    num_kept,
    stride_kept,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    BS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    h = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < D
    for j0 in range(0, num_kept, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        src = tl.load(kept_ptr + h * stride_kept + j, mask=j < num_kept, other=0)
        src = src.to(tl.int64)
        move = (j < num_kept) & (src != j)
        src_blk = tl.load(bt_ptr + src // BS, mask=move, other=0).to(tl.int64)
        dst_blk = tl.load(bt_ptr + j // BS, mask=move, other=0).to(tl.int64)
        mask = move[:, None] & c_ok[None, :]
        src_off = (src % BS)[:, None]
        dst_off = (j % BS)[:, None]
        k_rows = tl.load(
            k_ptr
            + src_blk[:, None] * stride_kb
            + h * stride_kh
            + src_off * stride_ks
            + cols[None, :] * stride_kd,
            mask=mask,
            other=0,
        )
        v_rows = tl.load(
            v_ptr
            + src_blk[:, None] * stride_vb
            + h * stride_vh
            + src_off * stride_vs
            + cols[None, :] * stride_vd,
            mask=mask,
            other=0,
        )
        tl.debug_barrier()  # all of this tile's reads before any of its writes
        tl.store(
            k_ptr
            + dst_blk[:, None] * stride_kb
            + h * stride_kh
            + dst_off * stride_ks
            + cols[None, :] * stride_kd,
            k_rows,
            mask=mask,
        )
        tl.store(
            v_ptr
            + dst_blk[:, None] * stride_vb
            + h * stride_vh
            + dst_off * stride_vs
            + cols[None, :] * stride_vd,
            v_rows,
            mask=mask,
        )


@triton.jit(do_not_specialize=STAGE1_PER_PROMPT_KT_PAGES)
def _kt_pages_kernel(
    k_ptr,
    kt_ptr,
    bt_ptr,
    lo,
    hi,
    num_pages,
    k_scale,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_tb,
    stride_th,
    stride_tp,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    KT_FP8: tl.constexpr,
    FP8: tl.constexpr,
):
    h = tl.program_id(0)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < num_pages
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    start = lo + p * PS
    blk = tl.load(bt_ptr + start // BS, mask=p_ok, other=0).to(tl.int64)
    off = start % BS
    base = k_ptr + blk[:, None] * stride_kb + h * stride_kh + d[None, :] * stride_kd
    kmin = tl.full([BLOCK_P, D_PAD], float("inf"), tl.float32)
    kmax = tl.full([BLOCK_P, D_PAD], float("-inf"), tl.float32)
    for i in tl.static_range(PS):
        ok = (p_ok & (start + i < hi))[:, None] & d_ok[None, :]
        k = tl.load(base + (off + i)[:, None] * stride_ks, mask=ok, other=0)
        k = kv_values(k, k_scale, FP8).to(tl.float32)
        kmin = tl.where(ok, tl.minimum(kmin, k), kmin)
        kmax = tl.where(ok, tl.maximum(kmax, k), kmax)
    row = kt_ptr + blk * stride_tb + h * stride_th + (off // PS) * stride_tp
    if KT_FP8:  # uint8 rows (algorithm.kt_fp8): codes + scale
        store_kt_fp8_rows(row, kmin, kmax, p_ok, d, d_ok, D)
    else:
        out = row[:, None] + d[None, :]
        mask = p_ok[:, None] & d_ok[None, :]
        tl.store(out, kmin.to(kt_ptr.dtype.element_ty), mask=mask)
        tl.store(out + D, kmax.to(kt_ptr.dtype.element_ty), mask=mask)


def compact_kept_tokens(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_row: torch.Tensor,
    kept: torch.Tensor,
) -> None:
    """Move head h's K and V at logical slot kept[h, j] to slot j, in place.

    k_cache, v_cache: [num_blocks, Hkv, bs, d] views (all strides
    arbitrary; an fp8 cache's ``fp8_kv.Fp8KV`` views: their codes move);
    kept: [Hkv, C] integer, each row strictly increasing (so kept[h, j] >= j).
    """
    k_cache, v_cache = kv_operand(k_cache)[0], kv_operand(v_cache)[0]
    hkv, bs, d = check_kv_cache(k_cache, v_cache)
    assert kept.dim() == 2 and kept.shape[0] == hkv
    count = kept.shape[1]
    if count == 0:
        return
    kept = kept.contiguous()
    block_row = block_row.contiguous()
    block_c = min(64, next_pow2(d))  # a K tile and a V tile per program
    block_j = 32
    _compact_kernel[(hkv, cdiv(d, block_c))](
        k_cache,
        v_cache,
        block_row,
        kept,
        count,
        kept.stride(0),
        *cache_strides(k_cache),
        *cache_strides(v_cache),
        BS=bs,
        D=d,
        BLOCK_J=block_j,
        BLOCK_C=block_c,
        num_warps=4,
        num_stages=1,
    )


def write_kt_pages(
    k_cache: torch.Tensor,
    kt_cache: torch.Tensor,
    block_row: torch.Tensor,
    lo: int,
    hi: int,
    page_size: int,
) -> None:
    """Recompute the KT pages covering logical slots [lo, hi) from the keys
    in [lo, hi) only (lo page aligned); same semantics as
    ``ops.pytorch.write_kt_pages``. k_cache: [num_blocks, Hkv, bs, d] view
    (an fp8 cache's ``fp8_kv.Fp8KV``: pages of the dequantized keys)."""
    lo, hi = int(lo), int(hi)
    if hi <= lo:
        return
    assert lo % page_size == 0
    k_cache, fp8, k_scale = kv_operand(k_cache)
    hkv, bs, d = check_kv_cache(k_cache)
    assert bs % page_size == 0 and kt_cache.stride(-1) == 1
    assert kt_cache.shape[2] == bs // page_size
    assert kt_cache.shape[3] == kt_row_width(kt_cache, d)
    num_pages = cdiv(hi - lo, page_size)
    block_p = 16
    _kt_pages_kernel[(hkv, cdiv(num_pages, block_p))](
        k_cache,
        kt_cache,
        block_row.contiguous(),
        lo,
        hi,
        num_pages,
        k_scale,
        *cache_strides(k_cache),
        kt_cache.stride(0),
        kt_cache.stride(1),
        kt_cache.stride(2),
        D=d,
        D_PAD=head_pad(d),
        BS=bs,
        PS=page_size,
        BLOCK_P=block_p,
        KT_FP8=kt_cache.dtype == torch.uint8,
        FP8=fp8,
        num_warps=4,
    )
