"""The native CPU Stage 2 (``cpu_ops``, kernels/cpu_hsa_decode.cpp) against the
batched PyTorch path (``batched``, itself checked against the per-request
oracle), on CPU_ATTN's cache layouts, over decode steps crossing pages; at
the head sizes CPU_ATTN serves besides 64 and 128 also against the
per-request oracle itself (``paged.hsa_decode``)."""

import pytest
import torch
from reference import paged

from rocketkv_vllm.layout import kt_cache_view, kt_row_bytes, split_kv
from rocketkv_vllm.ops import cpu as cpu_ops
from rocketkv_vllm.ops import pytorch as torch_ops

NUM_BLOCKS = 120


def test_the_extension_builds_here():
    # The engine would fall back to the slower PyTorch path (with a warning);
    # the install (g++) is meant to give every CPU machine the kernel.
    assert cpu_ops.build_error() is None


def _cache(hkv, d, bs, ps, dtype, kt_dtype="auto"):
    pages = bs // ps
    kt_bytes = hkv * pages * kt_row_bytes(d, dtype, kt_dtype)
    block_elems = hkv * bs * 2 * d + -(-kt_bytes // dtype.itemsize)
    storage = torch.full((NUM_BLOCKS * block_elems,), float("nan"), dtype=dtype)
    return storage, block_elems


def _views(storage, block_elems, hkv, d, bs, ps, layout, kt_dtype="auto"):
    kv = torch.as_strided(
        storage, (NUM_BLOCKS, hkv, bs, 2 * d), (block_elems, bs * 2 * d, 2 * d, 1)
    )
    k, v = split_kv(kv, layout)
    return kv, k, v, kt_cache_view(kv, ps, kt_dtype)


def _query(batch, hkv, g, d, dtype, gen):
    """Random queries whose channel magnitudes, summed over each group, have
    no ties: with low-precision queries, ties in the top-r channel choice
    would be broken differently by torch and C++ (both valid)."""
    if dtype == torch.float32:
        return torch.randn(batch, hkv * g, d, generator=gen)
    levels = torch.linspace(0.5, 2.0, d)
    if levels.to(dtype).unique().numel() < d:  # bf16 past d = 128: d consecutive bf16 values
        levels = (torch.arange(d, dtype=torch.int16) + 0x3F00).view(torch.bfloat16).float()
    order = torch.argsort(torch.rand(batch, hkv, 1, d, generator=gen), dim=-1)
    signs = torch.randint(0, 2, (batch, hkv, g, d), generator=gen) * 2 - 1
    return (levels[order] * signs).view(batch, hkv * g, d).to(dtype)


@pytest.mark.parametrize("layout", ["head_rows", "cpu_vec", "cpu_amx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "hkv,g,d,bs,ps,force",
    [
        (3, 3, 64, 32, 4, True),
        (2, 4, 128, 32, 2, False),
        (1, 1, 64, 64, 1, True),
        (2, 2, 64, 32, 8, False),
        (3, 3, 64, 32, 16, False),
    ],
)
def test_native_stage2_matches_batched_torch(layout, dtype, hkv, g, d, bs, ps, force):
    _check_against_batched(layout, dtype, hkv, g, d, bs, ps, force, "auto")


@pytest.mark.parametrize("layout", ["head_rows", "cpu_vec", "cpu_amx"])
@pytest.mark.parametrize(
    "hkv,g,d,bs,ps,force",
    [
        (3, 3, 64, 32, 4, True),
        (2, 4, 128, 32, 2, False),
    ],
)
def test_native_stage2_with_fp8_kt_matches_batched_torch(layout, hkv, g, d, bs, ps, force):
    # KT bytes must agree exactly: both fold the new key into decoded rows
    # and encode outward (algorithm.kt_fp8).
    _check_against_batched(layout, torch.bfloat16, hkv, g, d, bs, ps, force, "fp8_e4m3")


# vLLM CPU_ATTN's head sizes (CPUAttentionBackend.get_supported_head_sizes)
# other than 64 and 128, each on the layouts its kernels write there: K
# transposed per head block ("cpu_vec", the vec and vec16 kernels: every
# size, vec16 for those not divisible by 32) and AMX tiles ("cpu_amx", bf16,
# sizes divisible by 32); "head_rows" for a few.
_HEAD_SIZE_CASES = [
    # layout, dtype, hkv, g, d, kt_dtype
    ("cpu_vec", torch.bfloat16, 2, 3, 32, "auto"),
    ("cpu_amx", torch.bfloat16, 2, 2, 32, "fp8_e4m3"),
    ("cpu_vec", torch.float32, 2, 2, 80, "auto"),
    ("cpu_vec", torch.bfloat16, 1, 4, 80, "fp8_e4m3"),
    ("cpu_amx", torch.bfloat16, 2, 2, 96, "auto"),
    ("cpu_vec", torch.float16, 1, 2, 96, "auto"),
    ("cpu_vec", torch.bfloat16, 1, 3, 112, "auto"),
    ("head_rows", torch.float32, 1, 2, 112, "fp8_e4m3"),
    ("cpu_amx", torch.bfloat16, 1, 2, 160, "auto"),
    ("cpu_vec", torch.float32, 1, 2, 192, "auto"),
    ("cpu_amx", torch.bfloat16, 1, 2, 224, "fp8_e4m3"),
    ("cpu_amx", torch.bfloat16, 1, 3, 256, "auto"),
    ("cpu_vec", torch.bfloat16, 1, 2, 256, "fp8_e4m3"),
    ("head_rows", torch.float16, 1, 2, 256, "auto"),
    ("cpu_amx", torch.bfloat16, 1, 2, 512, "auto"),
    ("cpu_vec", torch.float32, 1, 1, 512, "auto"),
]


@pytest.mark.parametrize("layout,dtype,hkv,g,d,kt_dtype", _HEAD_SIZE_CASES)
def test_native_stage2_head_sizes_match_oracle(layout, dtype, hkv, g, d, kt_dtype):
    _check_against_batched(layout, dtype, hkv, g, d, 32, 4, d % 64 == 32, kt_dtype, oracle=True)


def test_amx_layout_needs_head_size_multiple_of_32():
    # CPU_ATTN writes head size 80 in the vec16 layout, never in AMX tiles
    storage, block_elems = _cache(1, 80, 32, 4, torch.bfloat16)
    kv, _, _, kt = _views(storage, block_elems, 1, 80, 32, 4, "head_rows")
    ones = torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="AMX layout needs head_size"):
        cpu_ops.hsa_decode(
            torch.zeros(1, 1, 80, dtype=torch.bfloat16),
            kv,
            kt,
            "cpu_amx",
            torch.ones(1, 1, dtype=torch.int32),
            ones * 0,
            ones * 0,
            ones,
            ones,
            ones,
            4,
            0.1,
            False,
        )


def _check_against_batched(layout, dtype, hkv, g, d, bs, ps, force, kt_dtype, oracle=False):
    storage, block_elems = _cache(hkv, d, bs, ps, dtype, kt_dtype)
    kv, k, v, kt = _views(storage, block_elems, hkv, d, bs, ps, layout, kt_dtype)
    gen = torch.Generator().manual_seed(d + bs + ps)
    # Three compressed requests of different lengths, budgets, top-k, top-r.
    specs = [(700, 160, 8, 16), (530, 96, 3, d), (401, 200, 1, 7)]
    rows, plans = [], []
    free = torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1
    for i, (n, budget, pages_k, topr) in enumerate(specs):
        row = free[i * 38 : (i + 1) * 38]
        slots = torch.arange(n + 2 * ps + 1)
        paged.write_kv(
            k,
            v,
            torch.randn(len(slots), hkv, d, generator=gen).to(dtype),
            torch.randn(len(slots), hkv, d, generator=gen).to(dtype),
            row[slots // bs] * bs + slots % bs,
        )
        tail = n // bs * bs
        q_win = torch.randn(16, hkv * g, d, generator=gen)
        paged.snapkv_compress(k, v, kt, row, q_win, n, budget, tail, 7, ps, d**-0.5)
        rows.append(row)
        plans.append((n, budget - (n - tail), tail, pages_k, topr))
    table = torch.stack(rows).int()
    other = storage.clone()
    kv2, k2, v2, kt2 = _views(other, block_elems, hkv, d, bs, ps, layout, kt_dtype)
    if oracle:  # a third copy for the per-request oracle (it updates KT pages too)
        third = storage.clone()
        _, k3, v3, kt3 = _views(third, block_elems, hkv, d, bs, ps, layout, kt_dtype)
    col = lambda i: torch.tensor([p[i] for p in plans], dtype=torch.int32)  # noqa: E731
    num_compact, tail_start, num_select, topr = col(1), col(2), col(3), col(4)
    seq = col(0)
    for _ in range(2 * ps + 1):  # crosses page boundaries
        seq = seq + 1
        query = _query(len(plans), hkv, g, d, dtype, gen)
        max_pages = int(((num_compact + ps - 1) // ps + (seq - tail_start + ps - 1) // ps).max())
        view = torch_ops.view_pages(table, num_compact, tail_start, seq, ps, bs, max_pages)
        want = torch_ops.hsa_decode(
            query,
            k,
            v,
            kt,
            table,
            seq,
            view,
            topr,
            num_select,
            int(num_select.max()),
            ps,
            d**-0.5,
            force,
        )
        got = cpu_ops.hsa_decode(
            query,
            kv2,
            kt2,
            layout,
            table,
            num_compact,
            tail_start,
            seq,
            topr,
            num_select,
            ps,
            d**-0.5,
            force,
        )
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        torch.testing.assert_close(kt2, kt, rtol=0, atol=0, equal_nan=True)
        if oracle:
            for b in range(len(plans)):
                ref = paged.hsa_decode(
                    query[b],
                    k3,
                    v3,
                    kt3,
                    table[b],
                    int(num_compact[b]),
                    int(tail_start[b]),
                    int(seq[b]),
                    int(num_select[b]) * ps,
                    int(topr[b]),
                    ps,
                    d**-0.5,
                    force,
                )
                torch.testing.assert_close(
                    got[b], ref, rtol=tol, atol=tol, msg=f"row {b} differs from the oracle"
                )
            torch.testing.assert_close(kt2, kt3, rtol=0, atol=0, equal_nan=True)
