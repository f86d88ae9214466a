"""Batched PyTorch Stage 2 (``ops.pytorch``) against the per-request oracle
(``paged.hsa_decode``), on both KV layouts vLLM's backends use."""

import pytest
import torch
from reference import paged

from rocketkv_vllm.kernels.rows import DecodeRows
from rocketkv_vllm.layout import kt_cache_view, kt_row_bytes, split_kv
from rocketkv_vllm.ops import pytorch as torch_ops
from rocketkv_vllm.plan import RequestPlan

NUM_BLOCKS = 210


def _cache(hkv, d, bs, ps, layout, storage=None, kt_dtype="auto"):
    """Padded cache (KT pages in each block's padding) and its views."""
    pages = bs // ps
    kt_bytes = hkv * pages * kt_row_bytes(d, torch.float32, kt_dtype)
    block_elems = hkv * bs * 2 * d + -(-kt_bytes // 4)
    if storage is None:
        storage = torch.full((NUM_BLOCKS * block_elems,), float("nan"))
    kv = torch.as_strided(
        storage, (NUM_BLOCKS, hkv, bs, 2 * d), (block_elems, bs * 2 * d, 2 * d, 1)
    )
    k, v = split_kv(kv, layout)
    return storage, k, v, kt_cache_view(kv, ps, kt_dtype)


def _compressed_request(k, v, kt, row, n, budget, bs, ps, g, seed):
    """Prefill n tokens, run Stage 1 with the oracle; return the plan."""
    gen = torch.Generator().manual_seed(seed)
    hkv, d = k.shape[1], k.shape[3]
    slots = torch.arange(n)
    paged.write_kv(
        k,
        v,
        torch.randn(n, hkv, d, generator=gen),
        torch.randn(n, hkv, d, generator=gen),
        row[slots // bs] * bs + slots % bs,
    )
    tail_start = n // bs * bs
    q_win = torch.randn(16, hkv * g, d, generator=gen)
    paged.snapkv_compress(k, v, kt, row, q_win, n, budget, tail_start, 7, ps, d**-0.5)
    return RequestPlan(n, True, budget, 0, 0, budget - (n - tail_start), tail_start)


@pytest.mark.parametrize("layout", ["token", "head_rows"])
@pytest.mark.parametrize(
    "hkv,g,d,bs,ps,force,kt_dtype",
    [
        (3, 3, 64, 32, 4, True, "auto"),
        (2, 4, 128, 16, 2, False, "auto"),
        (1, 1, 64, 32, 8, True, "auto"),
        (2, 3, 64, 16, 1, False, "auto"),  # page size 1 (the "oracle" method's)
        # fp8 KT: the incremental update (decode, fold, encode) must give the
        # oracle's from-scratch rows bit for bit (algorithm.kt_fp8).
        (3, 3, 64, 32, 4, True, "fp8_e4m3"),
        (2, 4, 128, 16, 8, False, "fp8_e4m3"),
    ],
)
def test_batched_decode_matches_oracle(layout, hkv, g, d, bs, ps, force, kt_dtype):
    storage, k, v, kt = _cache(hkv, d, bs, ps, layout, kt_dtype=kt_dtype)
    gen = torch.Generator().manual_seed(d + bs)
    # Different lengths, budgets, top-k and top-r; 512 fills its last block
    # exactly; budget == n is rocketkv.evict=false (identity, all kept).
    specs = [(700, 160, 8 * ps, 16), (512, 96, 3 * ps, d), (401, 200, 1, 7), (300, 300, 4 * ps, 16)]
    rows, plans = [], []
    free = torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1
    for i, (n, budget, topk, topr) in enumerate(specs):
        row = free[i * 50 : (i + 1) * 50]
        plan = _compressed_request(k, v, kt, row, n, budget, bs, ps, g, seed=i)
        rows.append(row)
        plans.append((plan, topk, topr))
    block_table = torch.stack(rows).int()
    _, ok, ov, oracle_kt = _cache(hkv, d, bs, ps, layout, storage.clone(), kt_dtype)
    seq = torch.tensor([p.num_prompt_tokens for p, _, _ in plans])
    for _step in range(2 * ps + 1):  # crosses page boundaries
        seq = seq + 1
        new_k = torch.randn(len(specs), hkv, d, generator=gen)
        new_v = torch.randn(len(specs), hkv, d, generator=gen)
        pos = seq - 1
        slot = block_table.long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        paged.write_kv(k, v, new_k, new_v, slot)
        paged.write_kv(ok, ov, new_k, new_v, slot)
        q = torch.randn(len(specs), hkv * g, d, generator=gen)
        num_select = torch.tensor([max(t // ps, 1) for _, t, _ in plans])
        nc = torch.tensor([p.num_compact for p, _, _ in plans])
        ts = torch.tensor([p.tail_start for p, _, _ in plans])
        max_pages = int(((nc + ps - 1) // ps + (seq - ts + ps - 1) // ps).max()) + 3
        pages = torch_ops.view_pages(block_table, nc, ts, seq, ps, bs, max_pages)
        topr = torch.tensor([r for _, _, r in plans])
        dr = DecodeRows(
            block_table, nc, ts, seq, num_select * ps, topr, max_pages, int(num_select.max())
        )
        got = torch_ops.hsa_decode(q, k, v, kt, dr, pages, num_select, ps, d**-0.5, force)
        for b, (plan, topk, topr) in enumerate(plans):
            ref = paged.hsa_decode(
                q[b],
                ok,
                ov,
                oracle_kt,
                block_table[b],
                plan.num_compact,
                plan.tail_start,
                int(seq[b]),
                topk,
                topr,
                ps,
                d**-0.5,
                force,
            )
            torch.testing.assert_close(got[b], ref, rtol=1e-5, atol=1e-5)
        # Same KT pages as the oracle's recomputation.
        torch.testing.assert_close(
            kt[block_table.long()], oracle_kt[block_table.long()], rtol=0, atol=0, equal_nan=True
        )
