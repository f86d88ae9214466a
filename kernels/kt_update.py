"""Decode-time KT update, batched over decode rows.

Stage 2's decode (``ops.triton.hsa_decode``) does not launch this: the
scoring kernel (``hsa_score._score_kernel``) refreshes the newest page
itself through ``refresh_kt_row``. ``kt_update`` stays for callers that
refresh KT pages alone (tests, benchmarks); ``write_kv_and_kt`` for a fused
K/V store.

Each decode row b has its new token at logical slot pos = seq_lens[b] - 1.
The KT page holding pos is recomputed from the keys of slots
[page_start, pos] (page_start = pos - pos % page_size), exactly like
``ops.pytorch.write_kt_pages(k_cache, kt, row, page_start, seq_len, page_size)``
in ``tests/reference/paged.hsa_decode``. Grid (B, Hkv): one program loads page_size x d keys
and writes 2d min/max values (a uint8 KT cache: the page's fp8 row of
``algorithm.kt_fp8``, encoded from the recomputed min/max). Rows with
seq_lens[b] <= 0 (CUDA-graph padding) do nothing.

K is read (and K/V written) through the views ``k_cache`` / ``v_cache``
[num_blocks, Hkv, bs, d] with their own strides (channel dim included).

``write_kv_and_kt`` fuses the store of the new token's K/V into the same
program: it writes K/V at pos and folds the new key (from registers) into
the min/max of the page's older slots [page_start, pos), so there is no
read-after-write through memory. Whether fusion pays: it saves one launch
and re-reading one key row per (row, head) -- a few hundred bytes per head
against the megabytes a decode step reads -- so on a GPU the gain is the
launch (~2-4 us eager, ~1 us inside a CUDA graph) and nothing else. It also
needs the decode rows' new K/V separated from the prefill rows', so the
backend may just as well keep vLLM-style ``write_kv`` for every token and
call ``kt_update``; both are provided.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocketkv_vllm.kernels._utils import (
    cache_strides,
    check_kv_cache,
    head_pad,
    kv_operand,
    kv_values,
    next_pow2,
    row_vectors,
)
from rocketkv_vllm.kernels.kt_fp8 import kt_row_width, store_kt_fp8_rows


@triton.jit
def refresh_kt_row(
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
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    PS: tl.constexpr,
    PS_PAD: tl.constexpr,
    KT_FP8: tl.constexpr,
    FP8: tl.constexpr,
):
    """Recompute head h's KT row of the page holding slot seq - 1 from the
    keys of slots [page_start, seq) (row_bt: the row's block table; seq >=
    1): what ``kt_update`` does per (row, head), shared with the fused
    scoring kernel (``hsa_score._score_kernel``)."""
    pos = seq.to(tl.int64) - 1
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    page_lo = pos - pos % PS
    blk = tl.load(row_bt + page_lo // BS).to(tl.int64)
    off = page_lo % BS
    i = tl.arange(0, PS_PAD)
    ok = (i < PS) & ((page_lo + i) <= pos)
    mask = ok[:, None] & d_ok[None, :]
    base = k_ptr + blk * stride_kb + h * stride_kh
    k = tl.load(base + (off + i)[:, None] * stride_ks + d[None, :] * stride_kd, mask=mask, other=0)
    k = kv_values(k, k_scale, FP8).to(tl.float32)
    kmin = tl.min(tl.where(mask, k, float("inf")), 0)
    kmax = tl.max(tl.where(mask, k, float("-inf")), 0)
    _store_kt_row(
        kt_ptr + blk * stride_tb + h * stride_th + (off // PS) * stride_tp,
        kmin,
        kmax,
        d,
        d_ok,
        D,
        KT_FP8,
    )


@triton.jit
def _store_kt_row(row, kmin, kmax, d, d_ok, D: tl.constexpr, KT_FP8: tl.constexpr):
    if KT_FP8:  # uint8 rows: codes + scale, as one row of a [1, D_PAD] page tile
        store_kt_fp8_rows(
            row + tl.zeros([1], tl.int32),
            kmin[None, :],
            kmax[None, :],
            tl.full([1], 1, tl.int1),
            d,
            d_ok,
            D,
        )
    else:
        tl.store(row + d, kmin.to(row.dtype.element_ty), mask=d_ok)
        tl.store(row + D + d, kmax.to(row.dtype.element_ty), mask=d_ok)


@triton.jit
def _kt_update_kernel(
    k_ptr,
    v_ptr,
    kt_ptr,
    bt_ptr,
    seq_ptr,
    knew_ptr,
    vnew_ptr,
    stride_bt,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_tb,
    stride_th,
    stride_tp,
    stride_nb,
    stride_nh,
    k_scale,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    PS: tl.constexpr,
    PS_PAD: tl.constexpr,
    WRITE_KV: tl.constexpr,
    KT_FP8: tl.constexpr,
    FP8: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(seq_ptr + b).to(tl.int64)
    pos = seq - 1
    if pos >= 0:
        if WRITE_KV:
            d = tl.arange(0, D_PAD)
            d_ok = d < D
            page_lo = pos - pos % PS
            blk = tl.load(bt_ptr + b * stride_bt + page_lo // BS).to(tl.int64)
            off = page_lo % BS
            base = k_ptr + blk * stride_kb + h * stride_kh
            i = tl.arange(0, PS_PAD)
            kn = tl.load(knew_ptr + b * stride_nb + h * stride_nh + d, mask=d_ok, other=0.0)
            vn = tl.load(vnew_ptr + b * stride_nb + h * stride_nh + d, mask=d_ok, other=0.0)
            tl.store(
                base + (pos % BS) * stride_ks + d * stride_kd,
                kn.to(k_ptr.dtype.element_ty),
                mask=d_ok,
            )
            v_dst = v_ptr + blk * stride_vb + h * stride_vh + (pos % BS) * stride_vs + d * stride_vd
            tl.store(v_dst, vn.to(v_ptr.dtype.element_ty), mask=d_ok)
            ok = (i < PS) & ((page_lo + i) < pos)  # the new slot: from registers
            mask = ok[:, None] & d_ok[None, :]
            k = tl.load(
                base + (off + i)[:, None] * stride_ks + d[None, :] * stride_kd, mask=mask, other=0
            )
            k = kv_values(k, k_scale, FP8).to(tl.float32)
            knf = kn.to(k_ptr.dtype.element_ty).to(tl.float32)
            kmin = tl.minimum(tl.min(tl.where(mask, k, float("inf")), 0), knf)
            kmax = tl.maximum(tl.max(tl.where(mask, k, float("-inf")), 0), knf)
            row = kt_ptr + blk * stride_tb + h * stride_th + (off // PS) * stride_tp
            _store_kt_row(row, kmin, kmax, d, d_ok, D, KT_FP8)
        else:
            refresh_kt_row(
                k_ptr,
                kt_ptr,
                bt_ptr + b * stride_bt,
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


def _launch(k_cache, v_cache, kt_cache, block_table, seq_lens, page_size, key, value):
    k_cache, fp8, k_scale = kv_operand(k_cache)
    if v_cache is not None:
        v_cache, _, _ = kv_operand(v_cache)
    assert not (fp8 and key is not None), "write_kv_and_kt stores model-dtype caches only"
    hkv, bs, d = check_kv_cache(k_cache, v_cache)
    assert bs % page_size == 0 and kt_cache.stride(-1) == 1
    assert kt_cache.shape[2] == bs // page_size
    assert kt_cache.shape[3] == kt_row_width(kt_cache, d)
    assert block_table.stride(-1) == 1
    (seq_lens,) = row_vectors(seq_lens)
    batch = seq_lens.shape[0]
    if batch == 0:
        return
    write = key is not None
    if write:
        assert key.shape == (batch, hkv, d) and value.shape == key.shape
        assert key.stride() == value.stride() and key.stride(-1) == 1
        stride_nb, stride_nh = key.stride(0), key.stride(1)
    else:
        v_cache = key = value = k_cache  # unused pointers
        stride_nb = stride_nh = 0
    _kt_update_kernel[(batch, hkv)](
        k_cache,
        v_cache,
        kt_cache,
        block_table,
        seq_lens,
        key,
        value,
        block_table.stride(0),
        *cache_strides(k_cache),
        *cache_strides(v_cache),
        kt_cache.stride(0),
        kt_cache.stride(1),
        kt_cache.stride(2),
        stride_nb,
        stride_nh,
        k_scale,
        D=d,
        D_PAD=head_pad(d),
        BS=bs,
        PS=page_size,
        PS_PAD=max(2, next_pow2(page_size)),
        WRITE_KV=write,
        KT_FP8=kt_cache.dtype == torch.uint8,
        FP8=fp8,
        num_warps=1 if page_size * d <= 1024 else 2,
    )


def kt_update(
    k_cache: torch.Tensor,
    kt_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
) -> None:
    """Refresh the KT page of each row's newest token (its key already
    stored in ``k_cache`` [num_blocks, Hkv, bs, d] at slot seq_lens[b] - 1;
    an fp8 cache's ``fp8_kv.Fp8KV`` view: pages of the dequantized keys).
    block_table [B, max_blocks] int32, seq_lens [B] integer, both on the
    cache's device."""
    _launch(k_cache, None, kt_cache, block_table, seq_lens, page_size, None, None)


def write_kv_and_kt(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kt_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Store each row's new token K/V ([B, Hkv, d]) at slot seq_lens[b] - 1
    of ``k_cache`` / ``v_cache`` and refresh its KT page, in one launch."""
    _launch(k_cache, v_cache, kt_cache, block_table, seq_lens, page_size, key, value)
