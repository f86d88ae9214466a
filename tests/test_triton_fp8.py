"""The Triton kernels on an fp8 KV cache: vLLM's uint8 codes, read through
``fp8_kv.Fp8KV`` views (``split_kv`` with the layer's quant). Without a GPU
they run in Triton's interpreter; with one (TRITON_INTERPRET unset), compiled
on CUDA tensors.

Oracles:
* the same kernels on a *twin* cache in the query's dtype that holds the
  values the codes decode to (code x scale, then the query's dtype, as the
  kernels round them): equal outputs, bit for bit. The fp8 path differs from
  the float path only in its loads, and the float path is checked against
  the reference in test_kernels.py;
* RocketKV's PyTorch steps on the same fp8 views (``ops.pytorch``, what CPU
  engines run) and the per-request reference (``paged``) on the fp32 twin:
  the same kept tokens, their codes moved bit for bit, the same fp8 KT rows,
  Stage 2 outputs to 1e-4.
Two of the five cases carry attention sinks (gpt-oss), in both stages and
both oracles.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from reference import paged  # noqa: E402

from rocketkv_vllm.fp8_kv import FP8_FORMATS, KVQuant  # noqa: E402
from rocketkv_vllm.kernels.sparse_decode import sparse_decode  # noqa: E402
from rocketkv_vllm.layout import _split, kt_cache_view, kt_row_bytes, split_kv  # noqa: E402
from rocketkv_vllm.ops import pytorch as torch_ops  # noqa: E402
from rocketkv_vllm.ops import triton as triton_ops  # noqa: E402
from rocketkv_vllm.ops.pytorch import TorchStage1  # noqa: E402
from rocketkv_vllm.ops.triton import TritonStage1  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32, BF16 = torch.float32, torch.bfloat16
K_SCALE, V_SCALE = 0.05, 0.03
HKV, G, D, BS, PS = 2, 3, 64, 16, 4
CASES = [  # (kv_cache_dtype, layout, query dtype, sinks): spread over the cases
    ("fp8_e4m3", "token", F32, False),
    ("fp8_e5m2", "cpu_vec", F32, True),
    ("fp8", "head_rows", F32, False),
    ("fp8_e4m3", "cpu_vec", BF16, True),
    ("fp8_e5m2", "token", BF16, False),
]


def _sinks(with_sinks: bool):
    """gpt-oss style sink logits [Hq] fp32, or None."""
    if not with_sinks:
        return None
    return torch.randn(HKV * G, generator=torch.Generator().manual_seed(9)).to(DEVICE)


def padded_cache(num_blocks: int, dtype: torch.dtype, kt_dtype: str) -> torch.Tensor:
    """[num_blocks, Hkv, bs, 2d] with each block's KT rows behind its K/V, as
    the ROCKETKV spec allocates it."""
    kt_bytes = HKV * (BS // PS) * kt_row_bytes(D, dtype, kt_dtype)
    block = HKV * BS * 2 * D + -(-kt_bytes // dtype.itemsize)
    storage = torch.zeros(num_blocks * block, dtype=dtype, device=DEVICE)
    return storage.as_strided((num_blocks, HKV, BS, 2 * D), (block, BS * 2 * D, 2 * D, 1))


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(out_ptr + i, x.to(out_ptr.dtype.element_ty), mask=i < n)


def rounded_as_in_kernels(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values in ``dtype`` as a Triton cast rounds them (to nearest on a
    GPU; Triton 3.9's interpreter truncates to bf16)."""
    x = values.contiguous()
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    return out


def copy_cache(cache: torch.Tensor) -> torch.Tensor:
    """A copy of a padded cache, padding included."""
    storage = cache.as_strided((cache.stride(0) * cache.shape[0],), (1,)).clone()
    return storage.as_strided(cache.shape, cache.stride())


class Pair:
    """An fp8 cache of random codes and its twin in ``dtype`` (same layout,
    fp8 KT rows as well) holding the decoded values."""

    def __init__(self, num_blocks, cache_dtype, layout, dtype, seed):
        self.quant = KVQuant(FP8_FORMATS[cache_dtype], K_SCALE, V_SCALE)
        self.layout = layout
        self.codes = padded_cache(num_blocks, torch.uint8, "auto")
        gen = torch.Generator().manual_seed(seed)
        for view, scale in zip(_split(self.codes, layout), (K_SCALE, V_SCALE)):
            values = torch.randn(view.shape, generator=gen).to(DEVICE) / scale
            limit = torch.finfo(self.quant.fp8_dtype).max
            view.copy_(values.clamp(-limit, limit).to(self.quant.fp8_dtype).view(torch.uint8))
        self.twin = padded_cache(num_blocks, dtype, "fp8_e4m3")
        self.sync_twin()

    def sync_twin(self):
        for fp8_view, twin_view in zip(self.fp8_views(), split_kv(self.twin, self.layout)):
            twin_view.copy_(rounded_as_in_kernels(fp8_view[:], twin_view.dtype))

    def fp8_views(self):
        return split_kv(self.codes, self.layout, self.quant)

    @property
    def kt(self):
        return kt_cache_view(self.codes, PS)

    @property
    def twin_kt(self):
        return kt_cache_view(self.twin, PS, "fp8_e4m3")


def _row(num_blocks, count, seed):
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    return perm[:count].to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("cache_dtype,layout,dtype,with_sinks", CASES)
def test_stage1_on_fp8_codes(cache_dtype, layout, dtype, with_sinks):
    """Window scores, compaction and KT pages: the fp8 path equals the same
    kernels on the decoded twin; with fp32 queries also the PyTorch path on
    the same codes (kept tokens, codes moved bit for bit, fp8 KT rows bit
    for bit)."""
    n, budget, window, tail_start = 150, 64, 16, 144
    pair = Pair(14, cache_dtype, layout, dtype, seed=1)
    row = _row(14, 10, seed=2)
    gen = torch.Generator().manual_seed(3)
    q_window = torch.randn(window, HKV * G, D, generator=gen).to(DEVICE, dtype)
    args = (row, q_window, n, budget, tail_start, 5, PS, D**-0.5)
    torch_codes = copy_cache(pair.codes)

    k8, v8 = pair.fp8_views()
    sinks = _sinks(with_sinks)
    kept = TritonStage1().compress(k8, v8, pair.kt, *args, sinks=sinks)
    tk, tv = split_kv(pair.twin, layout)
    kept_twin = TritonStage1().compress(tk, tv, pair.twin_kt, *args, sinks=sinks)
    assert torch.equal(kept, kept_twin)
    assert not torch.equal(pair.codes, torch_codes), "nothing moved"
    # the compacted codes decode to what the twin moved
    for fp8_view, twin_view in zip(pair.fp8_views(), (tk, tv)):
        moved = rounded_as_in_kernels(fp8_view[row.long()], dtype)
        assert torch.equal(moved, twin_view[row.long()])
    if dtype == F32:  # KT rows from the same fp32 keys
        assert torch.equal(pair.kt[row.long()], pair.twin_kt[row.long()])

        k8t, v8t = split_kv(torch_codes, layout, pair.quant)
        kt_torch = kt_cache_view(torch_codes, PS)
        kept_torch = TorchStage1().compress(k8t, v8t, kt_torch, *args, sinks=sinks)
        assert torch.equal(kept.cpu(), kept_torch.cpu())
        assert torch.equal(pair.codes, torch_codes)  # K/V codes and KT rows, every byte


def _decode_rows(pair, specs, seed):
    """Rows over the pair's random cache (every slot holds data): the views'
    KT pages built once on the fp8 codes and copied to the twin, so both
    select from the same KT rows."""
    free = _row(30, 29, seed).tolist()  # disjoint rows: the KT updates write
    rows = []
    for _, _, seq in specs:
        count = -(-(seq + 1) // BS) if seq else 0
        rows.append(torch.tensor(free[:count], dtype=torch.int32, device=DEVICE) if seq else None)
        free = free[count:]
    k8, _ = pair.fp8_views()
    for r, (nc, ts, seq) in zip(rows, specs):
        if seq:
            torch_ops.write_kt_pages(k8, pair.kt, r, 0, nc, PS)
            torch_ops.write_kt_pages(k8, pair.kt, r, ts, seq + 1, PS)
    pair.twin_kt.copy_(pair.kt)
    width = max(r.numel() for r in rows if r is not None)
    table = torch.zeros(len(specs), width, dtype=torch.int32, device=DEVICE)
    for b, r in enumerate(rows):
        if r is not None:
            table[b, : r.numel()] = r
    return table


@pytest.mark.parametrize("cache_dtype,layout,dtype,with_sinks", CASES)
def test_stage2_on_fp8_codes(cache_dtype, layout, dtype, with_sinks):
    """HSA decode of a batch (KT update, page choice, sparse attention): the
    fp8 path equals the same kernels on the decoded twin bit for bit; with
    fp32 queries it also equals the per-request reference on the twin
    (1e-4) and its KT update writes the reference's fp8 rows."""
    specs = [(37, 96, 150), (64, 64, 70), (0, 0, 0), (13, 32, 33)]
    pair = Pair(30, cache_dtype, layout, dtype, seed=4)
    table = _decode_rows(pair, specs, seed=5)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(len(specs), HKV * G, D, generator=gen).to(DEVICE, dtype)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    seqs = [seq + 1 if seq else 0 for _, _, seq in specs]
    args = (
        table,
        ints([s[0] for s in specs]),
        ints([s[1] for s in specs]),
        ints(seqs),
        ints([4 * PS, 2 * PS, PS, 3 * PS]),
        ints([D, 16, 16, 7]),
        PS,
        D**-0.5,
    )
    # bf16: the twin's keys are rounded, so its KT update would differ
    update_kt = dtype == F32
    k8, v8 = pair.fp8_views()
    sinks = _sinks(with_sinks)
    rows = (triton_ops.DecodeRows(*args[:6], 64, 4), *args[6:])
    out = triton_ops.hsa_decode_checked(
        q, k8, v8, pair.kt, *rows, True, update_kt=update_kt, sinks=sinks
    )
    tk, tv = split_kv(pair.twin, layout)
    ref_kt = pair.twin_kt.clone()
    out_twin = triton_ops.hsa_decode_checked(
        q, tk, tv, pair.twin_kt, *rows, True, update_kt=update_kt, sinks=sinks
    )
    assert out.dtype == dtype and bool(out.isfinite().all())
    assert torch.equal(out, out_twin)
    if dtype == F32:
        assert torch.equal(pair.kt, pair.twin_kt)
        ref = paged.hsa_decode_rows(q, tk, tv, ref_kt, *args, force_current_page=True, sinks=sinks)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(pair.kt, ref_kt)  # the reference's KT update, bit for bit


def test_kernels_refuse_raw_fp8_codes():
    """uint8 codes passed without their quant are refused, not read as numbers."""
    pair = Pair(4, "fp8", "token", F32, seed=7)
    codes_k, codes_v = _split(pair.codes, "token")
    q = torch.zeros(1, HKV * G, D, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="Fp8KV"):
        sparse_decode(
            q,
            codes_k,
            codes_v,
            triton_ops.DecodeRows(one[:, None], one, one, one * 2, one, one, 1, 1),
            one.view(1, 1, 1).expand(1, HKV, 1).contiguous(),
            PS,
            1.0,
        )
