"""Stage 2 decode as it was before issue 38 (commit 36d6902): six launches
per layer -- KT update (grid B x Hkv), page logits, page probabilities, page
selection (one program per row and KV head), sparse attention, split merge
-- plus per-step scratch allocations. Kept only so that ``bench_kernels``
can time the old and the new decode side by side in one run (method
``rocketkv_legacy``); nothing else imports it. The kernels are the old ones
verbatim (the attention's tile step and loaders are still
``kernels.sparse_decode``'s; the split merge is the dense baseline's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocketkv_eval.dense_decode import merge_splits, plan_splits
from rocketkv_vllm.kernels._utils import (
    cache_strides,
    cdiv,
    dot_upcast,
    group_pad,
    head_pad,
    kv_operand,
    mma,
    next_pow2,
    num_sms,
    row_vectors,
)
from rocketkv_vllm.kernels.hsa_score import _view_pages
from rocketkv_vllm.kernels.kt_fp8 import kt_row_width, load_kt_fp8_bounds
from rocketkv_vllm.kernels.kt_update import kt_update
from rocketkv_vllm.kernels.sparse_decode import (
    FP32_TILE_TOKENS,
    _attend_tile,
    _load_kv,
    _load_q,
    _prepare,
    _store_result,
    launch_options,
)

_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E)
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _page_logits_kernel(
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
    num_kv_heads,
    max_pages,
    num_splits,
    stride_qb,
    stride_qh,
    stride_bt,
    stride_tb,
    stride_th,
    stride_tp,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BS: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    RANK_CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
    UPCAST: tl.constexpr,
    HALF: tl.constexpr,
    KT_FP8: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    nc, ts, seq, npc, num_pages = _view_pages(nc_ptr, ts_ptr, seq_ptr, b, PS)
    r = tl.load(topr_ptr + b).to(tl.int32)

    g = tl.arange(0, G_PAD)
    g_ok = g < G
    d = tl.arange(0, D_PAD)
    d_ok = d < D
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
    # The row's own pages spread over the splits, whole tiles each (the
    # split count is fixed at launch; under a CUDA graph max_pages is the
    # largest view, far above most rows').
    # (a row with more pages than max_pages is a caller error: its pages
    # past max_pages are ignored rather than written out of bounds)
    row_pages = tl.minimum(num_pages, max_pages)
    chunk = ((row_pages + num_splits - 1) // num_splits + BLOCK_P - 1) // BLOCK_P * BLOCK_P
    lo = split * chunk
    hi = tl.minimum(lo + chunk, row_pages)
    row_logits = logit_ptr + bh.to(tl.int64) * G * max_pages
    for p0 in range(lo, hi, BLOCK_P):
        j = p0 + tl.arange(0, BLOCK_P)
        ok = j < hi
        start = tl.where(j < npc, j * PS, ts + (j - npc) * PS)
        # tokens of each page inside the view (its softmax weight)
        count = tl.minimum(tl.maximum(tl.where(j < npc, nc, seq) - start, 0), PS)
        blk = tl.load(bt_ptr + b * stride_bt + start // BS, mask=ok, other=0).to(tl.int64)
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


@triton.jit
def _page_probs_kernel(
    logit_ptr,
    pm_ptr,
    pl_ptr,
    probs_ptr,
    nc_ptr,
    ts_ptr,
    seq_ptr,
    num_kv_heads,
    max_pages,
    num_splits,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    PS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHUNK: tl.constexpr,
    S_PAD: tl.constexpr,
    FORCE: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // num_kv_heads
    nc, ts, seq, npc, num_pages = _view_pages(nc_ptr, ts_ptr, seq_ptr, b, PS)
    g = tl.arange(0, G_PAD)
    g_ok = g < G
    sp = tl.arange(0, S_PAD)
    active = sp < num_splits  # an empty split left (-inf, 0)
    part = (bh * num_splits + sp)[:, None] * G_PAD + g[None, :]
    pmask = active[:, None] & g_ok[None, :]
    pm = tl.load(pm_ptr + part, mask=pmask, other=float("-inf"))
    pl = tl.load(pl_ptr + part, mask=pmask, other=0.0)
    m = tl.max(pm, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(pl * tl.exp2(pm - m_safe[None, :]), 0)
    inv_l = tl.where(l > 0, 1.0 / tl.where(l > 0, l, 1.0), 0.0) / G
    cur = npc + (seq - 1 - ts) // PS  # page of the newest token (in the tail)

    row_logits = logit_ptr + bh.to(tl.int64) * G * max_pages
    lo = split * CHUNK
    # Only the row's own pages: the work (and the bytes written) follow the
    # row, not max_pages (a FULL CUDA graph's, fixed by max_model_len).
    hi = tl.minimum(lo + CHUNK, num_pages)
    for p0 in range(lo, hi, BLOCK_P):
        j = p0 + tl.arange(0, BLOCK_P)
        valid = j < hi
        lg = tl.load(
            row_logits + g[:, None] * max_pages + j[None, :],
            mask=g_ok[:, None] & valid[None, :],
            other=float("-inf"),
        )
        pr = tl.sum(tl.exp2(lg - m_safe[:, None]) * inv_l[:, None], 0)
        if FORCE:
            pr = tl.where((j == cur) & (seq - 1 >= ts), 2.0, pr)
        tl.store(probs_ptr + bh.to(tl.int64) * max_pages + j, pr, mask=valid)


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
    max_pages] fp32 (2.0 on the forced current page). Only each row's own
    pages are written: the entries past its page count are left as they are
    (``select_pages`` reads a row's pages only). ``out``: where to write."""
    batch, hq, d = query.shape
    _, hkv, pages_per_block, width = kt_cache.shape
    assert width == kt_row_width(kt_cache, d) and hq % hkv == 0
    assert kt_cache.stride(-1) == 1
    assert block_table.stride(-1) == 1
    if query.stride(-1) != 1:
        query = query.contiguous()
    num_compact, tail_start, seq_lens, topr = row_vectors(num_compact, tail_start, seq_lens, topr)
    bs = pages_per_block * page_size
    group = hq // hkv
    max_pages = int(max_pages)
    # Page tile and warps from compile_kernels.py's register counts (Triton
    # 3.6 and 3.9, sm_80 / sm_90): 32 pages a tile (16 for fp8 rows past d
    # 128), 8 warps past d 64; no 16-bit configuration spills.
    fp8 = kt_cache.dtype == torch.uint8
    block_p = 16 if fp8 and head_pad(d) > 128 else 32
    logit_warps = 4 if head_pad(d) <= 64 else 8
    if chunk is None:
        # about 4 programs per SM, however large max_pages is (a FULL CUDA
        # graph's): the kernel spreads each row's own pages over the splits
        splits = min(cdiv(4 * num_sms(query.device), max(1, batch * hkv)), cdiv(max_pages, block_p))
        chunk = cdiv(max_pages, splits)
    chunk = max(block_p, cdiv(chunk, block_p) * block_p)
    num_splits = cdiv(max_pages, chunk)
    g_pad = group_pad(group)
    # the 16-bit type of the split dot: the KT's own, bf16 for fp8 rows (their
    # decoded values have <= 4 significant bits and fp32's exponent range);
    # None: fp32 KT, one IEEE fp32 dot
    half = (
        torch.bfloat16
        if fp8
        else (kt_cache.dtype if kt_cache.dtype in (torch.bfloat16, torch.float16) else None)
    )
    dev = query.device
    logits = torch.empty(batch, hkv, group, max_pages, device=dev, dtype=torch.float32)
    part_m = torch.empty(batch * hkv, num_splits, g_pad, device=dev, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    probs = (
        out
        if out is not None
        else torch.empty(batch, hkv, max_pages, device=dev, dtype=torch.float32)
    )
    assert probs.shape == (batch, hkv, max_pages) and probs.is_contiguous()
    if batch == 0:
        return probs
    grid = (batch * hkv, num_splits)
    _page_logits_kernel[grid](
        query,
        kt_cache,
        block_table,
        num_compact,
        tail_start,
        seq_lens,
        topr,
        logits,
        part_m,
        part_l,
        hkv,
        max_pages,
        num_splits,
        query.stride(0),
        query.stride(1),
        block_table.stride(0),
        kt_cache.stride(0),
        kt_cache.stride(1),
        kt_cache.stride(2),
        G=group,
        G_PAD=g_pad,
        D=d,
        D_PAD=head_pad(d),
        BS=bs,
        PS=page_size,
        BLOCK_P=block_p,
        RANK_CHUNK=min(16, head_pad(d)),
        SPLIT=half is not None,
        UPCAST=half is not None and dot_upcast(half),
        HALF=_TL_DTYPE.get(half, tl.float32),
        KT_FP8=fp8,
        num_warps=logit_warps,
    )
    _page_probs_kernel[grid](
        logits,
        part_m,
        part_l,
        probs,
        num_compact,
        tail_start,
        seq_lens,
        hkv,
        max_pages,
        num_splits,
        G=group,
        G_PAD=g_pad,
        PS=page_size,
        BLOCK_P=block_p,
        CHUNK=chunk,
        S_PAD=next_pow2(num_splits),
        FORCE=bool(force_current_page),
        num_warps=4,
    )
    return probs


@triton.jit
def _load_bits(row_ptr, j, row_pages):
    """fp32 bit patterns of the row's probabilities at pages j; pages past
    the row read -1.0 (a negative pattern): never at a threshold >= 0."""
    return tl.load(row_ptr + j, mask=j < row_pages, other=-1.0).to(tl.int32, bitcast=True)


@triton.jit
def _count_chunks(row_ptr, row_pages, thr, STRICT: tl.constexpr, BLOCK: tl.constexpr):
    """How many of the row's pages from BLOCK on have bit pattern > thr
    (STRICT) or >= thr."""
    cnt = thr * 0
    for p0 in range(BLOCK, row_pages, BLOCK):
        bits = _load_bits(row_ptr, p0 + tl.arange(0, BLOCK), row_pages)
        if STRICT:
            hit = bits > thr
        else:
            hit = bits >= thr
        cnt += tl.sum(hit.to(tl.int32), 0)
    return cnt


@triton.jit
def _take_chunk(bits, j, thr, room, base, eq_seen, sel_row):
    """Store the chunk's winners at sel_row[base + ...]; returns the new
    (base, eq_seen)."""
    greater = bits > thr
    equal = bits == thr
    eq_rank = eq_seen + tl.cumsum(equal.to(tl.int32), 0) - 1
    take = greater | (equal & (eq_rank < room))
    pos = base + tl.cumsum(take.to(tl.int32), 0) - 1
    tl.store(sel_row + pos, j, mask=take)
    return base + tl.sum(take.to(tl.int32), 0), eq_seen + tl.sum(equal.to(tl.int32), 0)


@triton.jit
def _select_pages_kernel(
    probs_ptr,
    sel_ptr,
    nc_ptr,
    ts_ptr,
    seq_ptr,
    topk_ptr,
    num_kv_heads,
    max_pages,
    num_sel,
    extra,
    PS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row (b, h): write the indices of its n_use highest probabilities
    (ascending page order) to sel[b, h, :n_use]; the rest is left as is.

    Threshold search instead of a sort: probabilities are >= 0 floats, so
    their int32 bit patterns order like the values; 31 bisection steps find
    the largest pattern T with count(bits >= T) >= n_use, then everything
    above T and the lowest-index ties at T are taken (exactly n_use). The
    row's first BLOCK pages stay in registers; longer rows are read again
    in chunks of BLOCK each step, so the work follows the row's own page
    count whatever max_pages is."""
    bh = tl.program_id(0)
    b = bh // num_kv_heads
    nc, ts, seq, npc, num_pages = _view_pages(nc_ptr, ts_ptr, seq_ptr, b, PS)
    n_want = tl.maximum(tl.load(topk_ptr + b).to(tl.int32) // PS, 1) + extra
    n_use = tl.minimum(tl.minimum(n_want, num_pages), num_sel)
    row = probs_ptr + bh.to(tl.int64) * max_pages
    row_pages = tl.minimum(num_pages, max_pages)
    j = tl.arange(0, BLOCK)
    bits = _load_bits(row, j, row_pages)
    thr = n_use * 0  # int32 scalar
    for k in tl.static_range(31):
        cand = thr | (1 << (30 - k))
        cnt = tl.sum((bits >= cand).to(tl.int32), 0) + _count_chunks(
            row, row_pages, cand, False, BLOCK
        )
        thr = tl.where(cnt >= n_use, cand, thr)
    room = (
        n_use
        - tl.sum((bits > thr).to(tl.int32), 0)
        - _count_chunks(row, row_pages, thr, True, BLOCK)
    )
    sel_row = sel_ptr + bh.to(tl.int64) * num_sel
    base, eq_seen = _take_chunk(bits, j, thr, room, thr * 0, thr * 0, sel_row)
    for p0 in range(BLOCK, row_pages, BLOCK):
        jc = p0 + tl.arange(0, BLOCK)
        base, eq_seen = _take_chunk(
            _load_bits(row, jc, row_pages), jc, thr, room, base, eq_seen, sel_row
        )


# Pages of a row the select kernel keeps in registers (longer rows: chunks).
SELECT_BLOCK_PAGES = 4096


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
    probability or -1); "triton": the threshold-select kernel (needs the
    per-row tensors; pages in ascending order); "auto": triton when the row
    tensors are given.
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
    assert probs.is_contiguous()
    batch, hkv, _ = probs.shape
    num_compact, tail_start, seq_lens, topk = row_vectors(num_compact, tail_start, seq_lens, topk)
    sel = torch.empty(batch, hkv, k, device=probs.device, dtype=torch.int32)
    if batch == 0:
        return sel
    block = min(max(16, next_pow2(max_pages)), SELECT_BLOCK_PAGES)
    _select_pages_kernel[(batch * hkv,)](
        probs,
        sel,
        num_compact,
        tail_start,
        seq_lens,
        topk,
        hkv,
        max_pages,
        k,
        extra,
        PS=page_size,
        BLOCK=block,
        num_warps=4 if block <= 2048 else 8,
    )
    return sel

    return select_pages(
        probs,
        max_select,
        num_compact,
        tail_start,
        seq_lens,
        topk,
        page_size,
        impl,
        force_current_page,
    )


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


def hsa_decode(
    query,
    k_cache,
    v_cache,
    kt_cache,
    block_table,
    num_compact,
    tail_start,
    seq_lens,
    topk,
    topr,
    page_size,
    scale,
    max_pages,
    max_select,
    force_current_page=False,
    out=None,
    update_kt=True,
    select_impl="auto",
    sinks=None,
):
    """The six-launch Stage 2 of commit 36d6902 (same signature as then)."""
    if update_kt:
        kt_update(k_cache, kt_cache, block_table, seq_lens, page_size)
    probs = hsa_page_probs(
        query,
        kt_cache,
        block_table,
        num_compact,
        tail_start,
        seq_lens,
        topr,
        page_size,
        max_pages,
        force_current_page,
    )
    sel = select_pages(
        probs,
        max_select,
        num_compact,
        tail_start,
        seq_lens,
        topk,
        page_size,
        select_impl,
        force_current_page,
    )
    return sparse_decode(
        query,
        k_cache,
        v_cache,
        block_table,
        sel,
        num_compact,
        tail_start,
        seq_lens,
        topk,
        page_size,
        scale,
        out=out,
        extra_pages=1 if force_current_page else 0,
        sinks=sinks,
    )
