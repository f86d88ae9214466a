"""Stage 1 scoring: observation-window attention mass of every prompt key.

For ONE request: the w window queries ``q_win [w, Hq, d]`` attend (causal,
fp32 softmax per query head) to the request's N prompt keys in the paged
cache; the probabilities are summed over the window queries and over the GQA
group of each KV head, and the window columns are dropped:
``scores [Hkv, N - w]`` fp32 (``algorithm.snapkv.window_attention_scores``).

Only keys are read, through ``k_cache`` [num_blocks, Hkv, bs, d] (block /
head / slot / channel strides arbitrary). Two passes, both over
key tiles gathered through ``block_row``:

1. ``_window_stats_kernel`` -- grid (Hkv, row blocks, key chunks): for its
   BLOCK_M score rows (row = window query i * G + group member g) the online
   max / sum-of-exp over its chunk of keys, written as partials. The host
   merges the partials (a few tiny torch ops) into one log-sum-exp per row.
2. ``_window_colsum_kernel`` -- grid (Hkv, key tiles of [0, N - w)): loads
   its key tile once, loops over all row blocks, and sums
   exp(logit - lse) down each column. Keys before N - w precede every window
   query, so pass 2 needs no causal mask and each column is owned by one
   program (deterministic, no atomics).

Attention sinks (``sinks`` [Hq], ``algorithm.sinks``) join each row's
log-sum-exp in the host merge between the passes (one more term of the
row's denominator); the kernels are the same with and without them.

The max-pool and the top-k stay in torch (``pool_scores``): they act on
[Hkv, N] fp32, a negligible amount of data next to the keys.
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
    head_pad,
    kv_operand,
    kv_values,
    mma,
)

_LOG2E = 1.4426950408889634

# Arguments that change from prompt to prompt (its length, its block-table
# row, where vLLM's query tensor keeps the window): not specialized, so one
# compile per engine serves every prompt and the engine's warm-up
# (``backend.warmup``) compiles it before the first request.
STAGE1_PER_PROMPT_STATS = ["q_ptr", "bt_ptr", "n_tokens", "num_chunks", "stride_qw", "stride_qh"]
STAGE1_PER_PROMPT_COLSUM = ["q_ptr", "bt_ptr", "num_cols", "stride_qw", "stride_qh", "stride_oh"]


@triton.jit
def _chunked_dot(
    q_rows,
    k_rows,
    row_ok,
    k_ok,
    stride_kd,
    k_scale,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    DK: tl.constexpr,
):
    """q . k^T [BLOCK_M, BLOCK_N] for fp32 queries: IEEE fp32 dots over DK
    channels at a time, each continuing the previous one's accumulator (the
    same sequential FMA sum as one dot over d; an FMA dot holds its whole
    reduction dim per thread, so a single one over d spills)."""
    s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for c0 in tl.static_range(0, D_PAD, DK):
        dc = c0 + tl.arange(0, DK)
        dc_ok = dc < D
        q = tl.load(q_rows + dc[None, :], mask=row_ok[:, None] & dc_ok[None, :], other=0.0)
        k = tl.load(k_rows + dc[None, :] * stride_kd, mask=k_ok[:, None] & dc_ok[None, :], other=0)
        k = kv_values(k, k_scale, FP8)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), s, input_precision="ieee")
    return s


@triton.jit(do_not_specialize=STAGE1_PER_PROMPT_STATS)
def _window_stats_kernel(
    q_ptr,
    k_ptr,
    bt_ptr,
    m_ptr,
    l_ptr,
    n_tokens,
    num_rows,
    num_rows_pad,
    num_chunks,
    scale_log2,
    k_scale,
    stride_qw,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    W: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    UPCAST: tl.constexpr,
    DK: tl.constexpr,
    FP8: tl.constexpr,
):
    h = tl.program_id(0)
    rb = tl.program_id(1)
    c = tl.program_id(2)
    rows = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    wi = rows // G
    gi = rows % G
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q_rows = q_ptr + wi[:, None] * stride_qw + (h * G + gi)[:, None] * stride_qh
    if DK == D_PAD:
        q = tl.load(q_rows + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = n_tokens - W + wi

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, n_tokens)
    for n0 in range(lo, hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        k_ok = keys < hi
        blk = tl.load(bt_ptr + keys // BS, mask=k_ok, other=0).to(tl.int64)
        k_rows = k_ptr + blk[:, None] * stride_kb + h * stride_kh + (keys % BS)[:, None] * stride_ks
        if DK == D_PAD:
            k = tl.load(
                k_rows + d[None, :] * stride_kd, mask=k_ok[:, None] & d_ok[None, :], other=0
            )
            k = kv_values(k, k_scale, FP8)
            s = mma(q, tl.trans(k.to(q.dtype)), UPCAST)
        else:
            s = _chunked_dot(
                q_rows,
                k_rows,
                row_ok,
                k_ok,
                stride_kd,
                k_scale,
                FP8,
                BLOCK_M,
                BLOCK_N,
                D,
                D_PAD,
                DK,
            )
        s = s * scale_log2
        valid = k_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    out = (h * num_chunks + c) * num_rows_pad + rows
    tl.store(m_ptr + out, m_i, mask=row_ok)
    tl.store(l_ptr + out, l_i, mask=row_ok)


@triton.jit(do_not_specialize=STAGE1_PER_PROMPT_COLSUM)
def _window_colsum_kernel(
    q_ptr,
    k_ptr,
    bt_ptr,
    lse_ptr,
    out_ptr,
    num_cols,
    num_rows,
    num_rows_pad,
    scale_log2,
    k_scale,
    stride_qw,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_oh,
    G: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DK: tl.constexpr,
    FP8: tl.constexpr,
):
    h = tl.program_id(0)
    keys = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = keys < num_cols
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    blk = tl.load(bt_ptr + keys // BS, mask=k_ok, other=0).to(tl.int64)
    k_rows = k_ptr + blk[:, None] * stride_kb + h * stride_kh + (keys % BS)[:, None] * stride_ks
    if DK == D_PAD:
        k = tl.load(k_rows + d[None, :] * stride_kd, mask=k_ok[:, None] & d_ok[None, :], other=0)
        k = kv_values(k, k_scale, FP8)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for r0 in range(0, num_rows, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_ok = rows < num_rows
        wi = rows // G
        gi = rows % G
        q_rows = q_ptr + wi[:, None] * stride_qw + (h * G + gi)[:, None] * stride_qh
        lse = tl.load(lse_ptr + h * num_rows_pad + rows, mask=row_ok, other=0.0)
        if DK == D_PAD:
            q = tl.load(q_rows + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            s = mma(q, tl.trans(k.to(q.dtype)), UPCAST)
        else:
            s = _chunked_dot(
                q_rows,
                k_rows,
                row_ok,
                k_ok,
                stride_kd,
                k_scale,
                FP8,
                BLOCK_M,
                BLOCK_N,
                D,
                D_PAD,
                DK,
            )
        s = s * scale_log2
        p = tl.exp2(s - lse[:, None])
        p = tl.where(row_ok[:, None] & k_ok[None, :], p, 0.0)
        acc += tl.sum(p, 0)
    tl.store(out_ptr + h * stride_oh + keys, acc, mask=k_ok)


def window_scores(
    q_win: torch.Tensor,
    k_cache: torch.Tensor,
    block_row: torch.Tensor,
    num_prompt_tokens: int,
    scale: float,
    chunk: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Window attention mass of the prompt keys: [Hkv, N - w] fp32.

    q_win: [w, Hq, d] (queries of prompt positions N-w .. N-1, RoPE applied),
    k_cache: [num_blocks, Hkv, bs, d] key view (all strides arbitrary; an
    fp8 cache's ``fp8_kv.Fp8KV`` view: keys dequantized into the query's
    dtype), block_row: the request's block table row
    (int32/int64), N = num_prompt_tokens >= w; sinks: optional [Hq] sink
    logits (fp32).
    """
    k_cache, fp8, k_scale = kv_operand(k_cache)
    hkv, bs, d = check_kv_cache(k_cache)
    w, hq, dq = q_win.shape
    assert dq == d and hq % hkv == 0
    n = int(num_prompt_tokens)
    assert n >= w
    group = hq // hkv
    if not fp8 and q_win.dtype != k_cache.dtype:
        q_win = q_win.float()  # the kernel casts keys to the query dtype
    if q_win.stride(-1) != 1:
        q_win = q_win.contiguous()
    block_row = block_row.contiguous()
    num_rows = w * group
    block_m = 32 if d > 64 else 64
    block_n = 64
    d_pad = head_pad(d)
    rows_pad = cdiv(num_rows, block_m) * block_m
    if chunk is None:
        chunk = 1024
    chunk = max(block_n, cdiv(chunk, block_n) * block_n)
    num_chunks = cdiv(n, chunk)
    scale_log2 = float(scale) * _LOG2E
    upcast = dot_upcast(q_win.dtype)
    # fp32 queries (an FMA dot): the channels DK at a time; 16-bit ones, one
    # tensor-core dot over d
    dk = d_pad if q_win.dtype in (torch.bfloat16, torch.float16) else min(d_pad, 16)
    dev = k_cache.device

    part_m = torch.empty(hkv, num_chunks, rows_pad, device=dev, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    # Rows past num_rows are never written and never read.
    _window_stats_kernel[(hkv, rows_pad // block_m, num_chunks)](
        q_win,
        k_cache,
        block_row,
        part_m,
        part_l,
        n,
        num_rows,
        rows_pad,
        num_chunks,
        scale_log2,
        k_scale,
        q_win.stride(0),
        q_win.stride(1),
        *cache_strides(k_cache),
        W=w,
        G=group,
        D=d,
        D_PAD=d_pad,
        BS=bs,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CHUNK=chunk,
        UPCAST=upcast,
        DK=dk,
        FP8=fp8,
        num_warps=4,
    )
    m = part_m.amax(dim=1)  # every row sees key 0, so m is finite
    lse = m + torch.log2((part_l * torch.exp2(part_m - m[:, None])).sum(dim=1))
    if sinks is not None:
        # row i * G + g is query head h * G + g's; rows past num_rows unused
        assert sinks.shape == (hq,), f"sinks must be [num_q_heads={hq}], got {tuple(sinks.shape)}"
        row_sinks = sinks.to(dev, torch.float32).view(hkv, 1, group).expand(hkv, w, group)
        rows = lse[:, :num_rows]
        rows.copy_(torch.logaddexp2(rows, row_sinks.reshape(hkv, num_rows) * _LOG2E))

    num_cols = n - w
    out = torch.empty(hkv, num_cols, device=dev, dtype=torch.float32)
    if num_cols > 0:
        _window_colsum_kernel[(hkv, cdiv(num_cols, block_n))](
            q_win,
            k_cache,
            block_row,
            lse.contiguous(),
            out,
            num_cols,
            num_rows,
            rows_pad,
            scale_log2,
            k_scale,
            q_win.stride(0),
            q_win.stride(1),
            *cache_strides(k_cache),
            out.stride(0),
            G=group,
            D=d,
            D_PAD=d_pad,
            BS=bs,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            UPCAST=upcast,
            DK=dk,
            FP8=fp8,
            num_warps=4,
        )
    return out


__all__ = ["window_scores"]
