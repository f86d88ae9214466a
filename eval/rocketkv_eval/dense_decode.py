"""Dense paged decode attention: the baseline RocketKV is compared against
(``bench_kernels``' ``dense_own``, the eval, the tests); not shipped with the
kernels (``rocketkv_vllm.kernels``), whose decode path never runs it.

Each query head of decode row b attends to every slot [0, seq_lens[b]) of
its sequence on the paged cache. The flash-decoding structure of
``kernels.sparse_decode`` (its tile step and loaders): grid (B*Hkv, S),
split s covers a fixed run of BLOCK_N-token tiles of the context, K/V of a
tile loaded once and shared by the G queries of the KV head (two
tensor-core dots per tile), then ``_merge_splits_kernel`` (grid B*Hq) when
S > 1. The splits are sized from the Python int ``max_seq_len`` (an engine
constant, e.g. max_model_len), so the launch is CUDA-graph capturable.

K and V are read through two [num_blocks, Hkv, bs, d] views with their own
block / head / slot / channel strides (any layout that shares the cache
with vLLM's attention backends: per-token K|V, per-head K rows then V rows,
K transposed per head block, padded blocks); this kernel keeps the dense
baseline on exactly the cache access path of the sparse one. Attention
sinks as in ``sparse_decode`` (added once: one split, or the merge).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocketkv_vllm.kernels._utils import (
    cache_strides,
    cdiv,
    dot_upcast,
    group_pad,
    head_pad,
    kv_operand,
    next_pow2,
    num_sms,
    row_vectors,
)
from rocketkv_vllm.kernels.sparse_decode import (
    FP32_TILE_TOKENS,
    _attend_tile,
    _load_kv,
    _load_q,
    _prepare,
    _sink_term,
    _store_result,
    launch_options,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _dense_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    seq_ptr,
    o_ptr,
    lse_ptr,
    out_ptr,
    sink_ptr,
    num_kv_heads,
    num_splits,
    tiles_per_split,
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
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DIRECT: tl.constexpr,
    SINKS: tl.constexpr,
    FP8: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    seq = tl.load(seq_ptr + b).to(tl.int32)
    q = _load_q(q_ptr, b, h, stride_qb, stride_qh, G, G_PAD, D, D_PAD)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    row_bt = bt_ptr + b.to(tl.int64) * stride_bt
    lo = split * (tiles_per_split * BLOCK_N)
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, seq)
    for n0 in range(lo, hi, BLOCK_N):
        slot = n0 + tl.arange(0, BLOCK_N)
        ok = slot < hi
        blk = tl.load(row_bt + slot // BS, mask=ok, other=0).to(tl.int64)
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


def dense_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of query [B, Hq, d] over slots [0, seq_lens[b]) of
    each row (max_seq_len: a Python int >= every seq_lens[b]); k_cache,
    v_cache: [num_blocks, Hkv, bs, d] views (all strides arbitrary; fp8
    caches as ``fp8_kv.Fp8KV`` views, see ``sparse_decode``); block_n:
    tokens a tile (at most FP32_TILE_TOKENS for fp32); sinks:
    optional [Hq] sink logits (fp32; ``algorithm.sinks``)."""
    k_cache, fp8, k_scale = kv_operand(k_cache)
    v_cache, v_fp8, v_scale = kv_operand(v_cache)
    assert v_fp8 == fp8, "K and V of one cache share its format"
    query, out, sinks, hkv, bs, d, group = _prepare(query, k_cache, v_cache, out, sinks, fp8)
    dtype = query.dtype
    if dtype == torch.float32:  # see sparse_decode.launch_options
        block_n = min(block_n, FP32_TILE_TOKENS)
    batch = query.shape[0]
    assert block_table.stride(-1) == 1
    if batch == 0:
        return out
    (seq_lens,) = row_vectors(seq_lens)
    splits, tiles_per_split = plan_splits(
        cdiv(max_seq_len, block_n), batch * hkv, query.device, num_splits
    )
    direct = splits == 1
    if direct:
        o_part = lse_part = out  # unused
    else:
        o_part = torch.empty(
            batch * hkv * splits * group, d, device=query.device, dtype=torch.float32
        )
        lse_part = torch.empty(
            batch * hkv * splits * group, device=query.device, dtype=torch.float32
        )
    _dense_decode_kernel[(batch * hkv, splits)](
        query,
        k_cache,
        v_cache,
        block_table,
        seq_lens,
        o_part,
        lse_part,
        out,
        out if sinks is None else sinks,  # unused without sinks
        hkv,
        splits,
        tiles_per_split,
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
        D=d,
        D_PAD=head_pad(d),
        BS=bs,
        BLOCK_N=block_n,
        UPCAST=dot_upcast(dtype),
        DIRECT=direct,
        SINKS=sinks is not None,
        FP8=fp8,
        **launch_options(dtype),
    )
    if not direct:
        merge_splits(o_part, lse_part, out, seq_lens, splits, group, d, sinks)
    return out
