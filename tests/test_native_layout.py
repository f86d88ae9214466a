"""ROCKETKV reads and writes the KV cache that vLLM's own CPU kernels use.

The layout probe must pick views through which (1) what CPU_ATTN's cache
write stores reads back exactly, and (2) CPU_ATTN's attention kernel over
the cache equals our dense attention over the same views (so the kernel
reads what our compaction writes). vLLM CPU build only.
"""

import pytest
import torch
from conftest import cpu_attn_decode
from reference import paged

from rocketkv_vllm.kernels.rows import DecodeRows  # noqa: E402
from rocketkv_vllm.layout import kt_cache_view, split_kv  # noqa: E402
from rocketkv_vllm.ops import pytorch as torch_ops

ops = pytest.importorskip("vllm._custom_ops")
from rocketkv_vllm.backend.native import cpu_kv_layout  # noqa: E402

AMX = torch.cpu._is_amx_tile_supported()


@pytest.mark.parametrize(
    "dtype,isa,bs,expected",
    [
        (torch.float32, "vec", 32, "cpu_vec"),
        (torch.bfloat16, "vec", 32, "cpu_vec"),
        (torch.float32, "vec16", 16, "cpu_vec"),
        (torch.bfloat16, "vec16", 16, "cpu_vec"),
        pytest.param(
            torch.bfloat16,
            "amx",
            32,
            "cpu_amx",
            marks=pytest.mark.skipif(not AMX, reason="no AMX on this CPU"),
        ),
        pytest.param(
            torch.bfloat16,
            "amx",
            64,
            "cpu_amx",
            marks=pytest.mark.skipif(not AMX, reason="no AMX on this CPU"),
        ),
    ],
)
def test_native_kernel_reads_what_our_views_hold(dtype, isa, bs, expected):
    hkv, g, d, num_blocks, n = 3, 3, 64, 12, 150
    layout = cpu_kv_layout(isa, dtype, d, bs)
    assert layout == expected
    # Padded blocks, as the ROCKETKV KV spec allocates them.
    block_elems = hkv * bs * 2 * d + 1000
    storage = torch.zeros(num_blocks * block_elems, dtype=dtype)
    kv = storage.as_strided((num_blocks, hkv, bs, 2 * d), (block_elems, bs * 2 * d, 2 * d, 1))
    k_cache, v_cache = split_kv(kv, layout)
    gen = torch.Generator().manual_seed(1)
    row = torch.randperm(num_blocks, generator=gen)[: -(-n // bs)]
    # We write the cache (as compaction does); the native kernel reads it.
    # (Unwritten slots are zero: the kernel reads and masks whole blocks.)
    keys = torch.randn(n, hkv, d, generator=gen).to(dtype)
    values = torch.randn(n, hkv, d, generator=gen).to(dtype)
    slots = row[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    paged.write_kv(k_cache, v_cache, keys, values, slots)
    q = torch.randn(1, hkv * g, d, generator=gen).to(dtype)
    out = cpu_attn_decode(q, kv, row, n, isa)
    ref = paged.dense_attention(q, torch.tensor([n - 1]), k_cache, v_cache, row, n, d**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_pytorch_path_on_the_amx_layout_matches_the_token_layout():
    """Stage 1 and batched Stage 2 only address the cache per token, so on
    AMX-packed views (``packed_kv``) they give exactly what they give on the
    plain token layout holding the same values."""

    hkv, g, d, bs, ps, num_blocks, n = 3, 3, 64, 32, 4, 40, 1000
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(n + 1, hkv, d, generator=gen).to(torch.bfloat16)
    values = torch.randn(n + 1, hkv, d, generator=gen).to(torch.bfloat16)
    q_win = torch.randn(32, hkv * g, d, generator=gen)
    query = torch.randn(1, hkv * g, d, generator=gen).to(torch.bfloat16)
    row = torch.randperm(num_blocks, generator=gen)[: -(-(n + 1) // bs)]
    slots = row[torch.arange(n + 1) // bs] * bs + torch.arange(n + 1) % bs
    pages = bs // ps
    block_elems = hkv * bs * 2 * d + hkv * pages * 2 * d
    outs = []
    for layout in ("token", "cpu_amx"):
        storage = torch.zeros(num_blocks * block_elems, dtype=torch.bfloat16)
        kv = storage.as_strided((num_blocks, hkv, bs, 2 * d), (block_elems, bs * 2 * d, 2 * d, 1))
        k, v = split_kv(kv, layout)
        kt = kt_cache_view(kv, ps)
        paged.write_kv(k, v, keys, values, slots)
        tail = n // bs * bs
        paged.snapkv_compress(k, v, kt, row, q_win, n, 300, tail, 7, ps, d**-0.5)
        nc = torch.tensor([300 - (n - tail)])
        ts, seq = torch.tensor([tail]), torch.tensor([n + 1])
        max_pages = int(-(-nc // ps) + -(-(seq - ts) // ps))
        view = torch_ops.view_pages(row[None].int(), nc, ts, seq, ps, bs, max_pages)
        topr = torch.tensor([32])
        dr = DecodeRows(row[None].int(), nc, ts, seq, topr * 0 + 8 * ps, topr, max_pages, 8)
        out = torch_ops.hsa_decode(query, k, v, kt, dr, view, torch.tensor([8]), ps, d**-0.5, True)
        # Read back every kept token through the views.
        kept_k, kept_v = paged.gather_kv(k, v, row, torch.arange(int(nc)))
        outs.append((out, kept_k, kept_v))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["token", "head_rows", "cpu_vec", "cpu_amx"])
def test_whole_block_reads_match_per_token_reads(layout):
    """``torch_ops.prompt_keys`` (Stage 1's block-by-block read) and the AMX
    accessor's ``read_blocks_into`` give what per-token indexing gives."""
    hkv, bs, d, n = 3, 32, 64, 150
    kv = torch.randn(9, hkv, bs, 2 * d).to(torch.bfloat16)
    k, v = split_kv(kv, layout)
    row = torch.tensor([7, 2, 5, 0, 8], dtype=torch.int32)
    slots = torch.arange(n)
    blocks, offsets = row[slots // bs].long(), slots % bs
    assert torch.equal(torch_ops.prompt_keys(k, row, n), k[blocks, :, offsets].float())
    if layout == "cpu_amx":
        for cache in (k, v):
            out = torch.empty(3, hkv, bs, d, dtype=torch.float64)
            cache.read_blocks_into(row[:3].long(), out)
            want = torch.stack(
                [
                    cache[row[i].long().expand(bs), :, torch.arange(bs)].transpose(0, 1)
                    for i in range(3)
                ]
            )
            assert torch.equal(out, want.double())
