"""The Triton kernels address a KV cache larger than 2^31 elements.

An H200's KV cache for one layer passes 2^31 elements with a small model
(e.g. Gemma 3 270M: ~120 GB over 18 layers), so a block's offset (block id x
block stride) must be computed in 64 bits: in 32 the address wraps and a
kernel reads or writes another block. Caches in the other kernel tests are a
few MB, where both agree. Here a row's blocks sit past 2^31 elements of a
~4.4 GB cache (virtual memory: only the blocks written are ever touched),
and Stage 1 (scores, compaction, KT pages) and the decode (three launches,
KT refresh) must give the bytes they give on the same rows in a small cache.
Interpreted on CPU (the interpreter computes offsets in the kernel's own
integer widths, so a 32-bit product wraps there too: the wrapped address is
usually unmapped and the process dies with a segmentation fault, else the
bytes differ); on CUDA the same, in the GPU check's kernel step. Skipped
where the ~4.4 GB of address space cannot be reserved.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import test_decode_launches as tdl  # noqa: E402
import test_kernels as tk  # noqa: E402

from rocketkv_vllm.ops import triton as triton_ops  # noqa: E402
from rocketkv_vllm.ops.triton import TritonStage1  # noqa: E402

HKV, G, D, BS, PS, DTYPE = 2, 2, 64, 16, 4, tk.BF16


def _large_twin(small: tk.Cache, table: torch.Tensor):
    """(cache, table, block map): every block ``table`` names in ``small``
    copied into a cache of more than 2^31 elements, to blocks at its top
    (past 2^31 elements), and the table pointing there."""
    num_blocks = (1 << 31) // small.block_elems + 64
    try:
        storage = torch.empty(num_blocks * small.block_elems, dtype=small.dtype, device=tk.DEVICE)
    except RuntimeError as exc:  # not enough address space
        pytest.skip(f"cannot reserve a {num_blocks * small.block_elems * 2 >> 30} GiB cache: {exc}")
    large = object.__new__(tk.Cache)
    large.__dict__.update(small.__dict__)
    large.storage = storage
    large._views()
    used = sorted(set(table.flatten().tolist()))
    top = {b: num_blocks - len(used) + i for i, b in enumerate(used)}
    assert min(top.values()) * small.block_elems >= 1 << 31
    n = small.block_elems
    for b, t in top.items():
        storage[t * n : (t + 1) * n] = small.storage[b * n : (b + 1) * n]
    big_table = torch.tensor(
        [[top[b] for b in r] for r in table.tolist()], dtype=table.dtype, device=table.device
    )
    return large, big_table, top


def _blocks(cache: tk.Cache, ids) -> torch.Tensor:
    n = cache.block_elems
    return torch.cat([cache.storage[i * n : (i + 1) * n] for i in ids])


def test_stage1_past_2_31_elements():
    n, budget = 330, 100
    gen = torch.Generator().manual_seed(n)
    small = tk.Cache(n // BS + 4, HKV, D, BS, PS, DTYPE, "token")
    row = small.new_row(-(-n // BS))
    small.fill(row, 0, n, gen)
    q = torch.randn(16, HKV * G, D, generator=gen).to(DTYPE)
    large, big_row, top = _large_twin(small, row[None, :])
    big_row = big_row[0]
    args = (q, n, budget, n // BS * BS, 7, PS, D**-0.5)
    want = TritonStage1().compress(small.k, small.v, small.kt, row, *args)
    got = TritonStage1().compress(large.k, large.v, large.kt, big_row, *args)
    assert torch.equal(got, want)
    ids = row.tolist()
    assert torch.equal(
        _blocks(large, [top[b] for b in ids]).view(torch.int16),
        _blocks(small, ids).view(torch.int16),
    ), "compacted K/V or KT pages differ"


def test_decode_past_2_31_elements():
    small, q, args, max_pages, max_select = tdl._batch(HKV, G, D, BS, PS, DTYPE, seed=7)
    table = args[0]
    large, big_table, top = _large_twin(small, table)
    rows, *rest = tdl._decode_args(args, max_pages, max_select)
    big_rows = dataclasses.replace(rows, block_table=big_table)
    with tdl.sms(16):
        want = triton_ops.hsa_decode(q, small.k, small.v, small.kt, rows, *rest, True)
        got = triton_ops.hsa_decode(q, large.k, large.v, large.kt, big_rows, *rest, True)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    ids = sorted(top)
    assert torch.equal(  # the KT refresh of each row's newest page
        _blocks(large, [top[b] for b in ids]).view(torch.int16),
        _blocks(small, ids).view(torch.int16),
    )
