"""Triton kernels (``rocketkv_vllm.kernels`` / ``triton_ops``) against the
PyTorch reference (``tests/reference/paged`` / ``algorithm``).

Without a GPU the kernels run on CPU tensors in Triton's interpreter
(TRITON_INTERPRET=1, set below before triton is imported); with a GPU (and
TRITON_INTERPRET unset) the same tests run compiled on CUDA tensors.
Shapes are small: the interpreter is slow and CI has 2 cores.

The caches are padded blocks (KT pages, then NaN guard elements that must
stay untouched) in several K/V layouts (see ``Cache``); each test case uses
one layout, so the layouts are spread over the cases rather than multiplied.

Runs under pytest, or as ``python tests/test_kernels.py`` where pytest is
not installed (a minimal runner below walks the same parameter lists).

Tolerances (outputs vs the fp32 reference computed from the same stored
values): fp32 atol = rtol = 1e-4; bf16 2e-2 and fp16 5e-3 (outputs are
rounded to the 16-bit type and P is rounded to it before the P.V dot, as
on the GPU). Scores / probabilities / KT pages are computed in fp32 from the
same stored values on both sides: 1e-4 relative, KT and moved K/V exact.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import time
from unittest import mock

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402,F401  (after TRITON_INTERPRET is decided)

try:
    import pytest
except ImportError:  # plain `python tests/test_kernels.py` on a bare GPU host
    pytest = None

from reference import paged  # noqa: E402

from rocketkv_eval.dense_decode import dense_decode  # noqa: E402
from rocketkv_vllm.algorithm import (  # noqa: E402
    pool_scores,
    sparse_attention,
    window_attention_scores,
)
from rocketkv_vllm.kernels import hsa_score as hsa_score_module  # noqa: E402
from rocketkv_vllm.kernels import sparse_decode as sparse_decode_module  # noqa: E402
from rocketkv_vllm.kernels.compact import compact_kept_tokens, write_kt_pages  # noqa: E402
from rocketkv_vllm.kernels.kt_update import kt_update, write_kv_and_kt  # noqa: E402
from rocketkv_vllm.kernels.page_select import hsa_page_probs, select_pages  # noqa: E402
from rocketkv_vllm.kernels.rows import DecodeRows  # noqa: E402
from rocketkv_vllm.kernels.sparse_decode import sparse_decode  # noqa: E402
from rocketkv_vllm.kernels.window_scores import window_scores  # noqa: E402
from rocketkv_vllm.layout import kt_bounds, kt_cache_view, kt_row_bytes, physical_slots, split_kv  # noqa: E402
from rocketkv_vllm.ops import pytorch as torch_ops  # noqa: E402
from rocketkv_vllm.ops import triton as triton_ops
from rocketkv_vllm.ops.triton import TritonStage1  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
AUTO, FP8 = "auto", "fp8_e4m3"  # KT cache formats (fp8: uint8 rows, algorithm.kt_fp8)
TOL = {
    F32: dict(atol=1e-4, rtol=1e-4),
    BF16: dict(atol=2e-2, rtol=2e-2),
    F16: dict(atol=5e-3, rtol=5e-3),
}


class Skip(Exception):
    pass


_IN_PYTEST = "pytest" in sys.modules and "--no-pytest" not in sys.argv


def skip(reason: str):
    if _IN_PYTEST:
        pytest.skip(reason)
    raise Skip(reason)


def parametrize(names: str, cases: list):
    """pytest.mark.parametrize that also records the cases for the runner."""

    def deco(fn):
        fn._cases = (names, cases)
        return pytest.mark.parametrize(names, cases)(fn) if pytest else fn

    return deco


# --------------------------------------------------------------------------
# Paged cache shared with vLLM's attention backend: one [num_blocks, Hkv, bs,
# 2d] kv_cache per layer whose K/V placement depends on the layout, handed to
# the kernels as two views k_cache / v_cache [num_blocks, Hkv, bs, d]:
#   "token"     K|V on the last dim of each token (FLASH_ATTN, TRITON_ATTN);
#   "head_rows" each head's block is [2 * bs, d], K rows then V rows;
#   "cpu_vec"   the same halves, K stored transposed [d, bs] (CPU_ATTN's vec
#               kernels): the K view's channel (last) dim has stride bs;
#   "split"     (test only, for strides the ones above lack) all of a block's
#               K first, head-major [Hkv, bs, d], then all its V, slot-major
#               [bs, Hkv, d]: K and V strides differ.
# Each block is padded: its KT pages (2d values per page and head in the
# cache dtype, or fp8 rows of 2d + 16 bytes with kt_dtype FP8), then GUARD
# elements nothing may read or write. Everything starts NaN; block 0 is
# never handed out, so a zero-padded block table points at NaNs.

LAYOUTS = ("token", "head_rows", "cpu_vec", "split")


class Cache:
    GUARD = 40  # extra NaN elements at the end of every block

    def __init__(
        self, num_blocks, hkv, d, bs, ps, dtype, layout="token", device=DEVICE, kt_dtype=AUTO
    ):
        assert layout in LAYOUTS
        width = 2 * d
        kt_bytes = hkv * (bs // ps) * kt_row_bytes(d, dtype, kt_dtype)
        self.data_elems = hkv * bs * width + -(-kt_bytes // dtype.itemsize)
        self.block_elems = self.data_elems + self.GUARD
        self.storage = torch.full(
            (num_blocks * self.block_elems,), float("nan"), dtype=dtype, device=device
        )
        self.hkv, self.d, self.bs, self.ps, self.dtype = hkv, d, bs, ps, dtype
        self.layout, self.kt_dtype = layout, kt_dtype
        self._views()
        self.free = list(torch.randperm(num_blocks - 1).add(1).tolist())

    def _views(self):
        hkv, bs, width = self.hkv, self.bs, 2 * self.d
        num_blocks = self.storage.numel() // self.block_elems
        self.kv = torch.as_strided(
            self.storage, (num_blocks, hkv, bs, width), (self.block_elems, bs * width, width, 1)
        )
        if self.layout == "split":
            d = self.d
            shape = (num_blocks, hkv, bs, d)
            self.k = torch.as_strided(self.storage, shape, (self.block_elems, bs * d, d, 1))
            self.v = torch.as_strided(
                self.storage, shape, (self.block_elems, d, hkv * d, 1), hkv * bs * d
            )
        else:
            self.k, self.v = split_kv(self.kv, self.layout)
        if self.layout == "cpu_vec":  # K's last dim really is strided
            assert self.k.stride(-1) == bs and self.v.stride(-1) == 1
        assert self.k.stride(0) > self.k[0].numel() * 2  # padded blocks
        self.kt = kt_cache_view(self.kv, self.ps, self.kt_dtype)

    def clone(self) -> Cache:
        other = object.__new__(Cache)
        other.__dict__.update(self.__dict__)
        other.storage = self.storage.clone()
        other._views()
        return other

    def check_guard(self):
        """The padding past each block's KV and KT data is untouched."""
        guard = self.storage.view(-1, self.block_elems)[:, self.data_elems :]
        assert bool(guard.isnan().all()), "a kernel wrote into the block padding"

    def new_row(self, num_blocks: int) -> torch.Tensor:
        taken, self.free = self.free[:num_blocks], self.free[num_blocks:]
        assert len(taken) == num_blocks, "test cache too small"
        return torch.tensor(taken, dtype=torch.int32, device=self.kv.device)

    def fill(self, row, lo, hi, gen):
        """Random K/V at logical slots [lo, hi) of a request."""
        n = hi - lo
        k = torch.randn(n, self.hkv, self.d, generator=gen).to(self.dtype)
        v = torch.randn(n, self.hkv, self.d, generator=gen).to(self.dtype)
        slots = torch.arange(lo, hi, device=row.device)
        flat = row[slots // self.bs].long() * self.bs + slots % self.bs
        paged.write_kv(self.k, self.v, k.to(row.device), v.to(row.device), flat)

    def poison(self, row, slots):
        """NaN into logical slots (all heads) of a request."""
        if len(slots) == 0:
            return
        slots = torch.as_tensor(slots, device=row.device)
        blocks, offsets = physical_slots(row, slots, self.bs)
        self.k[blocks, :, offsets] = float("nan")
        self.v[blocks, :, offsets] = float("nan")

    def poison_pages(self, row, starts):
        if len(starts) == 0:
            return
        starts = torch.as_tensor(starts, device=row.device)
        blocks, offsets = physical_slots(row, starts, self.bs)
        # fp8 rows: 0xff is a NaN code, and a NaN scale
        self.kt[blocks, :, offsets // self.ps, :] = (
            0xFF if self.kt.dtype == torch.uint8 else float("nan")
        )


def _table(rows, width=None):
    width = width or max(r.numel() for r in rows)
    bt = torch.zeros(len(rows), width, dtype=torch.int32, device=DEVICE)
    for i, r in enumerate(rows):
        bt[i, : r.numel()] = r
    return bt


def _ints(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _close(a, b, dtype, msg=""):
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), **TOL[dtype], msg=msg)


def _same_storage(a: Cache, b: Cache):
    a.check_guard()
    if a.kt.dtype == torch.uint8:  # fp8 KT rows: bit for bit
        assert torch.equal(a.kt, b.kt), "fp8 KT rows differ"
    assert torch.equal(a.storage.isnan(), b.storage.isnan())
    torch.testing.assert_close(a.storage.cpu(), b.storage.cpu(), atol=0, rtol=0, equal_nan=True)


# --------------------------------------------------------------------------
# Stage 1 kernels


@parametrize(
    "n,hkv,g,d,bs,w,dtype,chunk,layout",
    [
        (300, 3, 3, 64, 16, 16, F32, 128, "token"),
        (200, 2, 4, 128, 32, 16, BF16, None, "head_rows"),
        (150, 1, 8, 64, 16, 8, F32, 64, "cpu_vec"),
        (180, 2, 1, 64, 32, 32, BF16, None, "split"),
        # other FLASH_ATTN head sizes (padded to a power of two, masked past d)
        (120, 2, 2, 32, 16, 16, F16, 64, "token"),
        (100, 1, 3, 96, 16, 8, BF16, None, "cpu_vec"),
        (90, 1, 2, 256, 16, 8, F32, 64, "split"),
    ],
)
def test_window_scores(n, hkv, g, d, bs, w, dtype, chunk, layout):
    gen = torch.Generator().manual_seed(n)
    c = Cache(n // bs + 4, hkv, d, bs, 4, dtype, layout)
    row = c.new_row(-(-n // bs))
    c.fill(row, 0, n, gen)
    q = torch.randn(w, hkv * g, d, generator=gen).to(dtype).to(DEVICE)
    got = window_scores(q, c.k, row, n, d**-0.5, chunk=chunk)
    keys, _ = paged.gather_kv(c.k, c.v, row, torch.arange(n, device=DEVICE))
    ref = window_attention_scores(q, keys, d**-0.5)
    assert got.shape == (hkv, n - w) and got.dtype == torch.float32
    assert bool(got.isfinite().all())
    # Both sides compute in fp32 from the same stored values.
    torch.testing.assert_close(got.cpu(), ref.cpu(), atol=1e-5, rtol=1e-4)


def _kept_patterns(hkv, count, n, gen):
    """[Hkv, count] sorted kept positions with heavy source/destination overlap."""
    rows = []
    for h in range(hkv):
        kind = h % 3
        if kind == 0:  # identity prefix, then shifted runs
            pos = torch.cat([torch.arange(10), torch.arange(12, 12 + count - 10)])
        elif kind == 1:  # every row moves by one slot (maximal in-tile overlap)
            pos = torch.arange(1, count + 1)
        else:  # random
            pos = torch.randperm(n, generator=gen)[:count].sort().values
        rows.append(pos)
    return torch.stack(rows).to(DEVICE)


@parametrize(
    "hkv,d,bs,dtype,count,layout",
    [
        (3, 64, 16, F32, 70, "cpu_vec"),
        (4, 128, 32, BF16, 45, "token"),
        (2, 80, 16, F16, 33, "split"),
        (2, 32, 16, BF16, 40, "head_rows"),
        (1, 256, 16, F32, 21, "cpu_vec"),
        (2, 96, 32, BF16, 50, "token"),
    ],
)
def test_compact_in_place_with_overlap(hkv, d, bs, dtype, count, layout):
    n = 160
    gen = torch.Generator().manual_seed(count)
    c = Cache(n // bs + 3, hkv, d, bs, 4, dtype, layout)
    row = c.new_row(-(-n // bs))
    c.fill(row, 0, n, gen)
    kept = _kept_patterns(hkv, count, n, gen)
    assert bool((kept >= torch.arange(count, device=DEVICE)).all())
    ref = c.clone()
    compact_kept_tokens(c.k, c.v, row, kept)
    torch_ops.compact_kept_tokens(ref.k, ref.v, row, kept)
    _same_storage(c, ref)


@parametrize(
    "hkv,d,bs,ps,dtype,ranges,layout,kt_dtype",
    [
        (3, 64, 16, 4, F32, [(0, 37), (96, 150)], "split", AUTO),
        (2, 128, 32, 8, BF16, [(0, 64), (64, 131)], "cpu_vec", AUTO),
        (1, 64, 16, 1, F32, [(5, 20)], "token", AUTO),
        (2, 80, 16, 2, F16, [(0, 37), (96, 150)], "split", FP8),
        (1, 64, 32, 8, F32, [(0, 64), (64, 131)], "cpu_vec", FP8),
        (2, 32, 16, 4, BF16, [(0, 37), (96, 150)], "token", FP8),
        (1, 96, 16, 16, F16, [(0, 64), (64, 131)], "head_rows", AUTO),
        (1, 256, 16, 4, F32, [(8, 45)], "split", FP8),
    ],
)
def test_write_kt_pages(hkv, d, bs, ps, dtype, ranges, layout, kt_dtype):
    n = 160
    gen = torch.Generator().manual_seed(ps)
    c = Cache(n // bs + 3, hkv, d, bs, ps, dtype, layout, kt_dtype=kt_dtype)
    row = c.new_row(-(-n // bs))
    c.fill(row, 0, n, gen)
    if kt_dtype == FP8 and dtype == F32:
        # keys over many binades: fp8 row scales above and below 1
        gains = torch.exp2(torch.randint(-20, 21, (1, hkv, 1, d), generator=gen))
        c.k.mul_(gains.to(DEVICE))
    ref = c.clone()
    for lo, hi in ranges:
        write_kt_pages(c.k, c.kt, row, lo, hi, ps)
        torch_ops.write_kt_pages(ref.k, ref.kt, row, lo, hi, ps)
    _same_storage(c, ref)


def _pooled_ref_topk_ok(pooled, chosen, protect_from, tol):
    """The chosen set holds top scores: min(chosen) >= max(not chosen) - tol."""
    for h in range(pooled.shape[0]):
        mask = torch.zeros(protect_from, dtype=torch.bool)
        mask[chosen[h]] = True
        lo_in = pooled[h, :protect_from][mask].min()
        hi_out = pooled[h, :protect_from][~mask].max() if (~mask).any() else -1.0
        assert lo_in >= hi_out - tol, (h, float(lo_in), float(hi_out))


@parametrize(
    "n,hkv,g,d,bs,ps,dtype,budget,layout,kt_dtype",
    [
        (330, 3, 3, 64, 16, 4, F32, 100, "cpu_vec", AUTO),
        (260, 2, 4, 128, 32, 8, BF16, 120, "token", AUTO),
        (256, 2, 3, 64, 16, 2, F32, 90, "head_rows", AUTO),  # fills its last block exactly
        (200, 2, 2, 64, 16, 4, BF16, 80, "split", FP8),
        # other FLASH_ATTN head sizes
        (150, 2, 2, 32, 16, 4, BF16, 70, "token", FP8),
        (140, 1, 3, 80, 16, 2, F16, 60, "cpu_vec", AUTO),
        (130, 2, 2, 96, 16, 8, F32, 50, "head_rows", AUTO),
        (120, 1, 2, 256, 16, 4, BF16, 60, "split", FP8),
    ],
)
def test_snapkv_compress(n, hkv, g, d, bs, ps, dtype, budget, layout, kt_dtype):
    gen = torch.Generator().manual_seed(n)
    c = Cache(n // bs + 4, hkv, d, bs, ps, dtype, layout, kt_dtype=kt_dtype)
    row = c.new_row(-(-n // bs))
    c.fill(row, 0, n, gen)
    w, kernel, scale = 16, 7, d**-0.5
    q = torch.randn(w, hkv * g, d, generator=gen).to(dtype).to(DEVICE)
    tail_start = n // bs * bs
    protect_from = min(n - w, tail_start)
    keys, _ = paged.gather_kv(c.k, c.v, row, torch.arange(n, device=DEVICE))
    pooled = pool_scores(window_attention_scores(q, keys, scale), kernel).cpu()

    before = c.clone()
    kept = TritonStage1().compress(c.k, c.v, c.kt, row, q, n, budget, tail_start, kernel, ps, scale)
    assert kept.shape == (hkv, budget)
    num_select = budget - (n - protect_from)
    chosen = kept[:, :num_select].cpu()
    assert bool((chosen[:, 1:] > chosen[:, :-1]).all())
    assert torch.equal(kept[:, num_select:].cpu(), torch.arange(protect_from, n).expand(hkv, -1))
    # Pooled scores have plateaus: ties may be broken differently.
    _pooled_ref_topk_ok(pooled, chosen, protect_from, tol=1e-5 + 1e-4 * float(pooled.max()))
    # The cache holds exactly what the reference moves for these positions.
    num_compact = budget - (n - tail_start)
    torch_ops.compact_kept_tokens(before.k, before.v, row, kept[:, :num_compact])
    torch_ops.write_kt_pages(before.k, before.kt, row, 0, num_compact, ps)
    torch_ops.write_kt_pages(before.k, before.kt, row, tail_start, n, ps)
    _same_storage(c, before)


@parametrize(
    "rule,n,ps,dtype,layout,kt_dtype",
    [
        ("streaming", 200, 4, F32, "cpu_vec", AUTO),
        ("streaming", 170, 2, BF16, "split", FP8),
        ("h2o", 200, 4, F32, "token", AUTO),
        ("h2o", 150, 8, BF16, "head_rows", FP8),
    ],
)
def test_baseline_keep_rules_compress(rule, n, ps, dtype, layout, kt_dtype):
    """keep_rule streaming / h2o (docs/keep-rules.md) on the Triton Stage 1:
    the algorithm's positions, moved and paged as the PyTorch steps do. H2O's
    scores come from the engine's store (``backend.h2o``) fed in two chunks."""
    from types import SimpleNamespace

    from rocketkv_vllm.algorithm import h2o_keep_positions, h2o_scores, streaming_keep_positions
    from rocketkv_vllm.backend.h2o import H2OScores

    hkv, g, d, bs, w, budget = 2, 3, 64, 16, 16, 70
    gen = torch.Generator().manual_seed(n)
    c = Cache(n // bs + 4, hkv, d, bs, ps, dtype, layout, kt_dtype=kt_dtype)
    row = c.new_row(-(-n // bs))
    c.fill(row, 0, n, gen)
    scale = d**-0.5
    tail_start = n // bs * bs
    protect_from = min(n - w, tail_start)
    scores = None
    if rule == "streaming":
        want = streaming_keep_positions(n, hkv, budget, protect_from=protect_from)
    else:
        queries = torch.randn(n, hkv * g, d, generator=gen).to(dtype).to(DEVICE)
        store = H2OScores()
        plan = SimpleNamespace(num_prompt_tokens=n)
        half = n // 2
        store.add(
            "l",
            SimpleNamespace(q_start=0, q_end=half, context_len=0, block_row=row, plan=plan, key=1),
            queries,
            c.k,
            scale,
        )
        scores, whole = store.take(
            "l",
            SimpleNamespace(
                q_start=0, q_end=n - half, context_len=half, block_row=row, plan=plan, key=1
            ),
            queries[half:],
            c.k,
            scale,
        )
        assert whole
        keys, _ = paged.gather_kv(c.k, c.v, row, torch.arange(n, device=DEVICE))
        ref_scores = h2o_scores(queries, keys.float(), scale)
        torch.testing.assert_close(scores, ref_scores, rtol=1e-4, atol=1e-4)
        want = h2o_keep_positions(scores.cpu(), budget, w, tail_start)
    before = c.clone()
    kept = TritonStage1().compress(
        c.k,
        c.v,
        c.kt,
        row,
        None,
        n,
        budget,
        tail_start,
        7,
        ps,
        scale,
        keep_rule=rule,
        h2o_scores=scores,
        window_size=w,
    )
    assert torch.equal(kept.cpu(), want)
    num_compact = budget - (n - tail_start)
    torch_ops.compact_kept_tokens(before.k, before.v, row, kept[:, :num_compact])
    torch_ops.write_kt_pages(before.k, before.kt, row, 0, num_compact, ps)
    torch_ops.write_kt_pages(before.k, before.kt, row, tail_start, n, ps)
    _same_storage(c, before)


@parametrize(
    "n,ps,layout,kt_dtype",
    [(200, 4, "cpu_vec", AUTO), (192, 2, "token", AUTO), (136, 8, "head_rows", FP8)],
)
def test_snapkv_compress_without_eviction(n, ps, layout, kt_dtype):
    """prompt_budget == n (rocketkv.evict=false): everything kept, nothing
    moved, KT pages written over the whole prompt."""
    hkv, g, d, bs = 2, 3, 64, 16
    gen = torch.Generator().manual_seed(n)
    c = Cache(n // bs + 3, hkv, d, bs, ps, F32, layout, kt_dtype=kt_dtype)
    row = c.new_row(-(-n // bs))
    c.fill(row, 0, n, gen)
    q = torch.randn(16, hkv * g, d, generator=gen).to(DEVICE)
    ref = c.clone()
    kept = TritonStage1().compress(c.k, c.v, c.kt, row, q, n, n, n // bs * bs, 7, ps, d**-0.5)
    assert torch.equal(kept.cpu(), torch.arange(n).expand(hkv, n))
    torch_ops.write_kt_pages(ref.k, ref.kt, row, 0, n, ps)
    _same_storage(c, ref)


# --------------------------------------------------------------------------
# Decode kernels


def _decode_batch(hkv, d, bs, ps, dtype, specs, seed, poison=True, layout="token", kt_dtype=AUTO):
    """Requests already compressed: spec = (num_compact, tail_start, seq_len)
    (seq_len 0: a padding row). View slots get random K/V and KT pages;
    everything outside the views is NaN (KT pages outside too)."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-(s[2] + 1) // bs) for s in specs)  # room for one new token
    c = Cache(need + 2, hkv, d, bs, ps, dtype, layout, kt_dtype=kt_dtype)
    rows = []
    for nc, ts, seq in specs:
        row = c.new_row(-(-(seq + 1) // bs))
        rows.append(row)
        if seq <= 0:
            continue
        c.fill(row, 0, nc, gen)
        c.fill(row, ts, seq, gen)
        torch_ops.write_kt_pages(c.k, c.kt, row, 0, nc, ps)
        torch_ops.write_kt_pages(c.k, c.kt, row, ts, seq, ps)
        if not poison:
            c.fill(row, nc, ts, gen)  # stale but finite data outside the view
    return c, rows


def _ref_probs(q, kt_min, kt_max, topr, tokens):
    """Group-averaged SparQ page probabilities [Hkv, P] (the math of
    ``algorithm.hsa_page_probs``, with the kernel's channel tie-breaking):
    each page's softmax term weighted by its token count ``tokens`` [P].
    Computed on the CPU in fp32 whatever device the inputs are on: the
    oracle must not depend on the device (on CUDA it once multiplied a CUDA
    tensor by a CPU one and raised before anything was compared)."""
    q, kt_min, kt_max, tokens = (t.cpu() for t in (q, kt_min, kt_max, tokens))
    hq, d = q.shape
    num_pages, hkv, _ = kt_min.shape
    g = hq // hkv
    qf = q.float().view(hkv, g, d)
    # ties broken towards the lower channel, like the kernel (torch.topk's
    # choice among equal values is unspecified)
    order = qf.abs().sum(1).sort(dim=-1, descending=True, stable=True).indices
    channels = order[:, :topr]
    positive = qf.sum(1).gather(-1, channels) > 0
    idx = channels[:, None, :].expand(hkv, num_pages, topr)
    kmax = kt_max.float().permute(1, 0, 2).gather(-1, idx)
    kmin = kt_min.float().permute(1, 0, 2).gather(-1, idx)
    bound = torch.where(positive[:, None, :], kmax, kmin)
    q_r = qf.gather(-1, channels[:, None, :].expand(hkv, g, topr))
    scores = torch.einsum("kgr,kpr->kgp", q_r, bound)
    tau = torch.sqrt(d * q_r.abs().sum(-1) / qf.abs().sum(-1).clamp_min(1e-30))
    logits = scores / tau.clamp_min(1e-30)[..., None]
    expd = torch.exp(logits - logits.amax(-1, keepdim=True))
    denom = (expd * tokens.float()).sum(-1, keepdim=True)
    return (expd / denom).mean(1)


def _queries_without_channel_ties(batch, hkv, g, d, dtype, topr, gen):
    """Random decode queries whose top-r channel choice is unambiguous (no
    tie across the r-th largest group sum of |q|), so that the reference's
    torch.topk and the kernel's rank must choose the same channels."""
    while True:
        q = torch.randn(batch, hkv * g, d, generator=gen).to(dtype)
        sums = q.float().view(batch, hkv, g, d).abs().sum(2).sort(-1, descending=True).values
        if all(
            r >= d or bool((sums[b, :, r - 1] > sums[b, :, r]).all()) for b, r in enumerate(topr)
        ):
            return q.to(DEVICE)


def _view_rows(c, row, nc, ts, seq):
    """Stored KT rows [P, Hkv, width] of a view's pages, and the page starts."""
    starts = paged.view_page_starts(nc, ts, seq, c.ps, DEVICE)
    blocks, offsets = physical_slots(row, starts, c.bs)
    return c.kt[blocks, :, offsets // c.ps], starts


def _view_kt(c, row, nc, ts, seq):
    """(min, max, starts) of a view's KT pages (fp8 rows decoded to fp32)."""
    rows, starts = _view_rows(c, row, nc, ts, seq)
    return *kt_bounds(rows, c.d), starts


def _page_tokens(starts, nc, ts, seq, ps):
    """Tokens of each view page inside the view (its softmax weight)."""
    end = torch.where(starts < ts, nc, seq)
    return (end - starts).clamp(0, ps)


@parametrize(
    "hkv,g,d,bs,ps,dtype,force,impl,layout,kt_dtype",
    [
        (3, 3, 64, 16, 4, F32, False, "triton", "token", AUTO),
        (2, 4, 128, 32, 8, BF16, True, "torch", "head_rows", AUTO),
        (1, 8, 64, 16, 8, F32, True, "triton", "token", AUTO),
        (2, 1, 64, 32, 4, F32, False, "torch", "cpu_vec", AUTO),
        (2, 3, 64, 16, 2, F32, True, "triton", "head_rows", AUTO),
        (3, 3, 64, 16, 2, BF16, False, "torch", "split", AUTO),
        (2, 4, 64, 16, 4, BF16, True, "triton", "token", FP8),
        (2, 3, 80, 16, 2, F32, False, "triton", "cpu_vec", FP8),
        (2, 2, 32, 16, 4, F16, True, "triton", "split", AUTO),
        (1, 4, 96, 16, 4, BF16, False, "triton", "token", FP8),
        (1, 2, 256, 16, 8, F32, True, "triton", "head_rows", AUTO),
    ],
)
def test_hsa_page_probs_and_selection(hkv, g, d, bs, ps, dtype, force, impl, layout, kt_dtype):
    specs = [(37, 96, 150), (64, 64, 70), (0, 0, 0), (13, 32, 33)]
    topr = [d, 16, 16, 5]
    topk = [8 * ps, 3 * ps, 4 * ps, 100 * ps]
    c, rows = _decode_batch(
        hkv, d, bs, ps, dtype, specs, seed=hkv * g, layout=layout, kt_dtype=kt_dtype
    )
    max_pages = 48
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(len(specs), hkv * g, d, generator=gen).to(dtype).to(DEVICE)
    nc, ts, seq = (_ints([s[i] for s in specs]) for i in range(3))
    # Entries past a row's pages are never written: they keep the sentinel.
    sentinel = torch.full((len(specs), hkv, max_pages), 7.0, device=DEVICE)
    probs = hsa_page_probs(
        q,
        c.kt,
        _table(rows),
        nc,
        ts,
        seq,
        _ints(topr),
        ps,
        max_pages,
        force,
        chunk=16 if g != 4 else None,
        out=sentinel,
    )
    max_select = max(max(k // ps, 1) for k in topk)
    sel = select_pages(probs, max_select, nc, ts, seq, _ints(topk), ps, impl, force).cpu()
    probs = probs.cpu()
    for b, (n_c, t_s, s_l) in enumerate(specs):
        if s_l <= 0:
            _untouched(probs[b], 7.0, f"padding row {b}")
            continue
        kmin, kmax, starts = _view_kt(c, rows[b], n_c, t_s, s_l)
        num_pages = starts.numel()
        ref = _ref_probs(q[b], kmin, kmax, topr[b], _page_tokens(starts, n_c, t_s, s_l, ps)).cpu()
        got = probs[b, :, :num_pages].clone()
        _untouched(probs[b, :, num_pages:], 7.0, f"row {b}: entries past its {num_pages} pages")
        cur = num_pages - 1  # the newest token's page is the view's last
        if force:
            assert bool((got[:, cur] == 2.0).all()), f"row {b}: forced page {cur} = {got[:, cur]}"
            got[:, cur] = ref[:, cur]
        torch.testing.assert_close(
            got, ref, atol=1e-6, rtol=1e-4, msg=lambda m, b=b: f"row {b} page probabilities: {m}"
        )
        # the forced current page comes on top of the top-k pages
        n_use = min(max(topk[b] // ps, 1) + int(force), num_pages)
        assert sel.shape[-1] >= n_use
        for h in range(hkv):
            _check_selection(sel[b, h, :n_use], ref[h], num_pages, cur if force else None)


def _untouched(x, sentinel, what):
    """x still holds the sentinel everywhere (nothing was written there)."""
    bad = (x != sentinel).nonzero()
    assert bad.numel() == 0, (
        f"{what}: {bad.shape[0]} entries written, first at {bad[0].tolist()} = "
        f"{x[tuple(bad[0])].item()}"
    )


def _check_selection(chosen, ref_probs, num_pages, forced=None, tol=1e-6):
    """Distinct valid pages holding the highest reference probabilities
    (up to tol: near-ties may go either way), the forced page included."""
    chosen, ref_probs = chosen.cpu(), ref_probs.cpu()
    n_use = chosen.numel()
    assert chosen.unique().numel() == n_use, f"repeated pages in {chosen.tolist()}"
    assert int(chosen.min()) >= 0 and int(chosen.max()) < num_pages, (
        f"pages {chosen.tolist()} outside [0, {num_pages})"
    )
    mask = torch.zeros(num_pages, dtype=torch.bool)
    mask[chosen.long()] = True
    if forced is not None:
        assert bool(mask[forced]), f"forced page {forced} not in {chosen.tolist()}"
        mask[forced] = False
    rest = ~mask
    if forced is not None:
        rest[forced] = False
    if mask.any() and rest.any():
        low, high = ref_probs[mask].min(), ref_probs[rest].max()
        assert float(low) >= float(high) - tol, (
            f"chose page {int(torch.where(mask, ref_probs, 2.0).argmin())} (p {float(low):.9g}) "
            f"over page {int(torch.where(rest, ref_probs, -1.0).argmax())} (p {float(high):.9g}); "
            f"chosen {chosen.tolist()}"
        )


@parametrize("impl", ["triton", "torch"])
def test_select_pages_with_ties(impl):
    """Plateaus of equal probabilities: exactly n_use distinct top pages."""
    gen = torch.Generator().manual_seed(0)
    ps, hkv = 4, 3
    # the last two: ~12k and ~20k pages (3 and 5 chunks of the select kernel;
    # torch.topk took rows past 16,384 pages before it read rows in chunks)
    specs = [
        (40, 64, 100),
        (0, 0, 0),
        (8, 16, 17),
        (400, 512, 600),
        (4000, 4096, 48000),
        (4000, 4096, 80000),
    ]
    num_pages = [paged.view_page_starts(*s, ps, "cpu").numel() if s[2] else 0 for s in specs]
    max_pages = max(num_pages) + 3
    probs = torch.full((len(specs), hkv, max_pages), -1.0)
    for b, n in enumerate(num_pages):
        levels = torch.tensor([0.0, 1e-3, 0.25, 0.5, 2.0])
        probs[b, :, :n] = levels[torch.randint(0, 5, (hkv, n), generator=gen)]
    topk = [12 * ps, ps, 7 * ps, 64 * ps, 50 * ps, 60 * ps]
    args = [_ints([s[i] for s in specs]) for i in range(3)]
    sel = select_pages(probs.to(DEVICE), 64, *args, _ints(topk), ps, impl).cpu()
    for b, n in enumerate(num_pages):
        n_use = min(max(topk[b] // ps, 1), n, 64)
        for h in range(hkv):
            if n_use:
                _check_selection(sel[b, h, :n_use], probs[b, h, :n], n, tol=0.0)


def test_select_pages_across_chunks():
    """A ~20k-page row (5 chunks of the select kernel) whose winners and
    threshold ties are spread over all chunks: exactly the 40 pages above
    the threshold and the 15 lowest-index pages at it."""
    gen = torch.Generator().manual_seed(1)
    ps, spec = 4, (4000, 4096, 80000)
    n = paged.view_page_starts(*spec, ps, "cpu").numel()
    probs = torch.full((1, 1, n), 1e-3)
    picks = torch.randperm(n, generator=gen)[:70]
    high, ties = picks[:40], picks[40:].sort().values
    probs[0, 0, high] = 0.5
    probs[0, 0, ties] = 0.25
    assert int(high.max()) > 4 * 4096 and int(ties.max()) > 3 * 4096
    args = [_ints([v]) for v in spec]
    sel = select_pages(probs.to(DEVICE), 55, *args, _ints([55 * ps]), ps, "triton").cpu()
    want = set(high.tolist()) | set(ties[:15].tolist())
    assert set(sel[0, 0, :55].tolist()) == want
    assert sel[0, 0, :55].tolist() == sorted(want)  # ascending page order


@parametrize("spread", [1, 40, 5000, 1 << 22])
def test_select_pages_threshold_in_the_low_bits(spread):
    """Probabilities whose fp32 patterns differ only below bit log2(spread)
    (many exact repeats at spread 1 and 40): the selection kernel's
    threshold search must settle its last bits too. Exactly the reference
    top-n (value, then lowest page), in ascending page order, for rows of
    one chunk and of several (the counts then read the rest back)."""
    gen = torch.Generator().manual_seed(spread)
    ps = 4
    base = int(torch.tensor(0.01).view(torch.int32))
    # three rows x 2 heads; then one row x 1 head selecting 600 pages, whose
    # 8 splits leave 4,800 candidates: more than the merge holds at once
    for hkv, specs, topk, max_select in [
        (2, [(40, 64, 300), (0, 0, 3000), (4000, 4096, 30000)], [9, 33, 61], 64),
        (1, [(4000, 4096, 90000)], [600], 600),
    ]:
        num_pages = [paged.view_page_starts(*s, ps, "cpu").numel() for s in specs]
        probs = torch.full((len(specs), hkv, max(num_pages)), -1.0)
        for b, n in enumerate(num_pages):
            bits = base + torch.randint(0, spread, (hkv, n), generator=gen, dtype=torch.int32)
            probs[b, :, :n] = bits.view(torch.float32)
        args = [_ints([s[i] for s in specs]) for i in range(3)]
        topk_tokens = _ints([t * ps for t in topk])
        sel = select_pages(probs.to(DEVICE), max_select, *args, topk_tokens, ps, "triton").cpu()
        for b, n in enumerate(num_pages):
            n_use = min(topk[b], n)
            for h in range(hkv):
                # stable sort: equal values keep ascending page order
                want = torch.sort(-probs[b, h, :n], stable=True).indices[:n_use].sort().values
                assert sel[b, h, :n_use].tolist() == want.tolist(), (
                    f"row {b} head {h}: {sel[b, h, :n_use].tolist()} != {want.tolist()}"
                )


def test_selection_row_limit_matches_the_config_check():
    """The selection kernel counts a row's pages in 21-bit fields: the page
    bound the config enforces (``budget.MAX_VIEW_PAGES``) is what it takes,
    and its plan refuses more."""
    from rocketkv_vllm.budget import MAX_VIEW_PAGES
    from rocketkv_vllm.kernels.hsa_score import MAX_SELECT_ROW, plan_score

    assert MAX_VIEW_PAGES == MAX_SELECT_ROW - 1
    plan_score(1, 8, MAX_VIEW_PAGES, 64, True, 132)
    with pytest.raises(ValueError, match="max_pages"):
        plan_score(1, 8, MAX_VIEW_PAGES + 1, 64, True, 132)


def _sparse_ref(q, c, row, nc, ts, seq, pages, scale):
    """Attention over the tokens of the given view pages, per KV head."""
    starts = paged.view_page_starts(nc, ts, seq, c.ps, DEVICE)
    slots = (starts[:, None] + torch.arange(c.ps, device=DEVICE)).flatten()
    end = torch.where(starts < ts, nc, seq).repeat_interleave(c.ps)
    in_view = slots < end
    keys, values = paged.gather_kv(c.k, c.v, row, torch.where(in_view, slots, 0))
    mask = torch.zeros(c.hkv, starts.numel(), dtype=torch.bool, device=DEVICE)
    for h in range(c.hkv):
        mask[h, pages[h]] = True
    token_mask = mask.repeat_interleave(c.ps, dim=1) & in_view[None, :]
    keys = torch.where(token_mask.T[..., None], keys, 0)
    values = torch.where(token_mask.T[..., None], values, 0)
    return sparse_attention(q, keys, values, token_mask, scale)


@parametrize(
    "hkv,g,d,bs,ps,dtype,splits,layout",
    [
        (3, 3, 64, 16, 4, F32, 1, "head_rows"),
        (2, 4, 128, 32, 8, BF16, 3, "token"),
        (1, 8, 64, 16, 8, F32, None, "cpu_vec"),
        (4, 1, 64, 32, 4, BF16, 2, "split"),
        (2, 3, 80, 16, 16, F16, 2, "token"),
        (2, 3, 64, 16, 2, F32, 2, "head_rows"),
        (2, 2, 32, 16, 4, BF16, None, "cpu_vec"),
        (1, 4, 96, 16, 8, F32, 2, "split"),
        (1, 3, 256, 16, 4, BF16, 1, "token"),
    ],
)
def test_sparse_decode(hkv, g, d, bs, ps, dtype, splits, layout):
    specs = [(37, 96, 150), (64, 64, 70), (0, 0, 0), (13, 32, 33)]
    topk = [6 * ps, 2 * ps, ps, 100 * ps]
    c, rows = _decode_batch(hkv, d, bs, ps, dtype, specs, seed=g, layout=layout)
    gen = torch.Generator().manual_seed(3)
    n_sel = 6
    sel = torch.zeros(len(specs), hkv, n_sel, dtype=torch.int64)
    for b, (nc, ts, seq) in enumerate(specs):
        num_pages = paged.view_page_starts(nc, ts, seq, ps, "cpu").numel()
        for h in range(hkv):
            perm = torch.randperm(max(num_pages, 1), generator=gen)[:n_sel]
            sel[b, h, : perm.numel()] = perm
    q = torch.randn(len(specs), hkv * g, d, generator=gen).to(dtype).to(DEVICE)
    scale = d**-0.5
    nc, ts, seq = (_ints([s[i] for s in specs]) for i in range(3))
    for extra in (0, 1):  # 1: a forced page on top of the top-k entries
        # (topr and max_pages: not read by the attention)
        dr = DecodeRows(_table(rows), nc, ts, seq, _ints(topk), _ints(topk), 0, n_sel)
        out = sparse_decode(
            q,
            c.k,
            c.v,
            dr,
            sel.to(DEVICE),
            ps,
            scale,
            num_splits=splits,
            extra_pages=extra,
        )
        assert out.dtype == dtype and bool(out.isfinite().all())
        for b, (n_c, t_s, s_l) in enumerate(specs):
            if s_l <= 0:
                assert bool((out[b] == 0).all())
                continue
            num_pages = paged.view_page_starts(n_c, t_s, s_l, ps, "cpu").numel()
            n_use = min(max(topk[b] // ps, 1) + extra, num_pages, n_sel)
            ref = _sparse_ref(q[b], c, rows[b], n_c, t_s, s_l, sel[b, :, :n_use], scale)
            _close(out[b], ref, dtype, msg=f"row {b} extra {extra}")


@parametrize(
    "hkv,g,d,bs,dtype,splits,layout",
    [
        (3, 3, 64, 16, F32, 4, "token"),
        (2, 4, 128, 32, BF16, None, "head_rows"),
        (1, 8, 64, 16, BF16, 1, "cpu_vec"),
        (2, 3, 64, 16, F16, 2, "split"),
        (2, 2, 32, 16, BF16, 2, "token"),
        (1, 3, 80, 16, F32, None, "head_rows"),
        (2, 2, 96, 16, F16, 1, "cpu_vec"),
        (1, 4, 256, 16, BF16, 3, "split"),
    ],
)
def test_dense_decode(hkv, g, d, bs, dtype, splits, layout):
    seqs = [150, 1, 0, 77]
    gen = torch.Generator().manual_seed(g)
    c = Cache(sum(-(-max(s, 1) // bs) for s in seqs) + 2, hkv, d, bs, 4, dtype, layout)
    rows = []
    for s in seqs:
        rows.append(c.new_row(-(-max(s, 1) // bs)))
        c.fill(rows[-1], 0, s, gen)
    q = torch.randn(len(seqs), hkv * g, d, generator=gen).to(dtype).to(DEVICE)
    out = dense_decode(
        q, c.k, c.v, _table(rows), _ints(seqs), d**-0.5, max(seqs), num_splits=splits
    )
    assert out.dtype == dtype and bool(out.isfinite().all())
    for b, s in enumerate(seqs):
        if s == 0:
            assert bool((out[b] == 0).all())
            continue
        ref = paged.dense_attention(
            q[b : b + 1], torch.tensor([s - 1], device=DEVICE), c.k, c.v, rows[b], s, d**-0.5
        )
        _close(out[b], ref[0], dtype, msg=f"row {b}")


@parametrize(
    "hkv,d,bs,ps,dtype,fused,layout,kt_dtype",
    [
        (3, 64, 16, 4, F32, False, "head_rows", AUTO),
        (2, 128, 32, 8, BF16, True, "cpu_vec", AUTO),
        (2, 64, 16, 1, F32, True, "token", AUTO),
        (2, 64, 16, 4, F16, True, "split", AUTO),
        (2, 64, 16, 4, BF16, False, "token", FP8),
        (2, 80, 32, 8, F32, True, "head_rows", FP8),
        (2, 32, 16, 4, BF16, True, "cpu_vec", AUTO),
        (1, 96, 16, 16, F16, False, "split", FP8),
        (1, 256, 16, 4, F32, True, "token", AUTO),
    ],
)
def test_kt_update(hkv, d, bs, ps, dtype, fused, layout, kt_dtype):
    specs = [(37, 96, 150), (64, 64, 65), (0, 0, 0), (13, 32, 40)]
    c, rows = _decode_batch(hkv, d, bs, ps, dtype, specs, seed=ps, layout=layout, kt_dtype=kt_dtype)
    gen = torch.Generator().manual_seed(11)
    seqs = _ints([s[2] + (1 if s[2] else 0) for s in specs])  # one new token each
    key = torch.randn(len(specs), hkv, d, generator=gen).to(dtype).to(DEVICE)
    value = torch.randn(len(specs), hkv, d, generator=gen).to(dtype).to(DEVICE)
    ref = c.clone()
    for b, (_nc, _ts, seq) in enumerate(specs):
        if seq == 0:
            continue
        flat = (rows[b][seq // bs].long() * bs + seq % bs).view(1)
        paged.write_kv(ref.k, ref.v, key[b : b + 1], value[b : b + 1], flat)
        if not fused:
            paged.write_kv(c.k, c.v, key[b : b + 1], value[b : b + 1], flat)
        lo = seq - seq % ps
        torch_ops.write_kt_pages(ref.k, ref.kt, rows[b], lo, seq + 1, ps)
    if fused:
        write_kv_and_kt(c.k, c.v, c.kt, _table(rows), seqs, ps, key, value)
    else:
        kt_update(c.k, c.kt, _table(rows), seqs, ps)
    _same_storage(c, ref)


@parametrize(
    "hkv,g,d,bs,ps,dtype,force,impl,layout,kt_dtype",
    [
        (3, 3, 64, 16, 4, F32, False, "auto", "head_rows", AUTO),
        (2, 4, 128, 32, 8, BF16, True, "auto", "token", AUTO),
        (1, 8, 64, 16, 4, BF16, False, "torch", "cpu_vec", AUTO),
        (2, 3, 64, 16, 1, F32, True, "auto", "split", AUTO),
        (2, 2, 128, 16, 16, F32, False, "auto", "head_rows", AUTO),
        (2, 3, 64, 16, 2, F32, True, "auto", "token", AUTO),
        (3, 3, 64, 32, 2, BF16, False, "torch", "head_rows", AUTO),
        (2, 4, 64, 16, 4, BF16, True, "auto", "token", FP8),
        (2, 3, 64, 16, 2, F32, False, "auto", "split", FP8),
        # other FLASH_ATTN head sizes (Stage 2 end to end against the oracle)
        (2, 2, 32, 16, 4, BF16, True, "auto", "token", FP8),
        (1, 3, 80, 16, 4, F16, False, "auto", "cpu_vec", AUTO),
        (2, 2, 96, 16, 16, F32, True, "auto", "head_rows", AUTO),
        (1, 2, 160, 16, 4, BF16, False, "auto", "split", AUTO),
        (1, 2, 192, 16, 8, F16, True, "auto", "token", FP8),
        (1, 4, 256, 16, 4, BF16, True, "auto", "head_rows", FP8),
    ],
)
def test_hsa_decode_batch_matches_reference_and_stays_in_view(
    hkv, g, d, bs, ps, dtype, force, impl, layout, kt_dtype
):
    """End to end: KT update + scoring + selection + sparse attention. The
    kernel's cache has NaN everywhere outside the views; the reference runs
    on a copy with finite stale data there (its masked einsum is not NaN
    safe). Outputs must be finite and equal."""
    # (40, 128, 128): the prompt filled its last block, the new token opens
    # the tail block
    specs = [(37, 96, 150), (64, 64, 70), (0, 0, 0), (13, 32, 33), (40, 128, 140), (40, 128, 128)]
    c, rows = _decode_batch(
        hkv, d, bs, ps, dtype, specs, seed=g + ps, layout=layout, kt_dtype=kt_dtype
    )
    clean = c.clone()
    gen = torch.Generator().manual_seed(5)
    for b, (nc, ts, seq) in enumerate(specs):
        if seq:
            clean.fill(rows[b], nc, ts, gen)
            # KT pages outside the view: NaN in the kernel's cache
            first_free = -(-nc // ps) * ps
            c.poison_pages(rows[b], list(range(first_free, ts, ps)))
    # a new token per row (stored before the call, as the backend does)
    seqs = [s[2] + 1 if s[2] else 0 for s in specs]
    for b, (_nc, _ts, seq) in enumerate(specs):
        if seq:
            state = gen.get_state()
            c.fill(rows[b], seq, seq + 1, gen)
            gen.set_state(state)
            clean.fill(rows[b], seq, seq + 1, gen)
    topk = [4 * ps, 2 * ps, ps, 100 * ps, 3 * ps, 2 * ps]
    topr = [d, 16, 16, 7, d // 2, 16]
    q = _queries_without_channel_ties(len(specs), hkv, g, d, dtype, topr, gen)
    args = (
        _table(rows),
        *(_ints([s[i] for s in specs]) for i in (0, 1)),
        _ints(seqs),
        _ints(topk),
        _ints(topr),
        ps,
        d**-0.5,
    )
    max_pages = (
        max(
            paged.view_page_starts(nc, ts, sq, ps, "cpu").numel()
            for (nc, ts, _), sq in zip(specs, seqs)
        )
        + 3
    )
    max_select = max(max(k // ps, 1) for k in topk)
    dr = DecodeRows(*args[:6], max_pages, max_select)
    out = triton_ops.hsa_decode_checked(q, c.k, c.v, c.kt, dr, *args[6:], force, select_impl=impl)
    ref = paged.hsa_decode_rows(q, clean.k, clean.v, clean.kt, *args, force_current_page=force)
    assert bool(out.isfinite().all())
    c.check_guard()
    assert bool((out[2] == 0).all())
    _close(out, ref, dtype)
    # the KT update touched the same pages as the reference's (bit for bit)
    for b, (nc, ts, seq) in enumerate(specs):
        if seq:
            got, _ = _view_rows(c, rows[b], nc, ts, seqs[b])
            want, _ = _view_rows(clean, rows[b], nc, ts, seqs[b])
            assert torch.equal(got, want)


@parametrize(
    "hkv,g,d,bs,ps,dtype,force,layout,kt_dtype,sms",
    [
        (2, 4, 64, 16, 4, BF16, True, "token", AUTO, 2),
        (2, 3, 64, 16, 2, F32, False, "split", FP8, 64),
    ],
)
def test_hsa_decode_batch_at_cuda_graph_shapes(
    hkv, g, d, bs, ps, dtype, force, layout, kt_dtype, sms
):
    """The launch a FULL CUDA graph of the backend captures: max_pages and
    max_select far above every row's (fixed for any replay), rows that are
    not compressed marked seq_len 0, output written in place. Those rows
    keep what ``out`` held; the others match the reference (the kernels
    spread each row's own pages over the splits)."""
    specs = [(37, 96, 150), (0, 0, 0), (13, 32, 33), (40, 128, 140), (0, 0, 0)]
    c, rows = _decode_batch(
        hkv, d, bs, ps, dtype, specs, seed=3, poison=False, layout=layout, kt_dtype=kt_dtype
    )
    seqs = [s[2] + 1 if s[2] else 0 for s in specs]
    gen = torch.Generator().manual_seed(9)
    for b, (_nc, _ts, seq) in enumerate(specs):
        if seq:
            c.fill(rows[b], seq, seq + 1, gen)
    topk = [4 * ps, ps, 100 * ps, 3 * ps, ps]
    topr = [d, 16, 7, d // 2, 16]
    q = _queries_without_channel_ties(len(specs), hkv, g, d, dtype, topr, gen)
    args = (
        _table(rows),
        *(_ints([s[i] for s in specs]) for i in (0, 1)),
        _ints(seqs),
        _ints(topk),
        _ints(topr),
        ps,
        d**-0.5,
    )
    ref = paged.hsa_decode_rows(q, c.k, c.v, c.kt, *args, force_current_page=force)
    graph_pages = 40 * 64 // ps  # the backend's max_model_len / page_size + 2
    out = torch.full_like(q, 7.0)
    # sms 64: many splits (scoring and attention), most with nothing to do
    with (
        mock.patch.object(hsa_score_module, "num_sms", lambda device: sms),
        mock.patch.object(sparse_decode_module, "num_sms", lambda device: sms),
    ):
        dr = DecodeRows(*args[:6], graph_pages, graph_pages)
        triton_ops.hsa_decode_checked(
            q, c.k, c.v, c.kt, dr, *args[6:], force, out=out, update_kt=False
        )
    for b, seq in enumerate(seqs):
        if seq:
            _close(out[b], ref[b], dtype, f"row {b}")
        else:
            assert bool((out[b] == 7.0).all()), f"padding row {b} was written"


def test_hsa_decode_batch_cuda_graph():
    """Decode path captured in a CUDA graph and replayed (no host syncs)."""
    if DEVICE.type != "cuda":
        skip("needs CUDA")
    hkv, g, d, bs, ps, dtype = 2, 4, 128, 16, 4, BF16
    specs = [(37, 96, 150), (64, 64, 70), (13, 32, 33)]
    c, rows = _decode_batch(hkv, d, bs, ps, dtype, specs, seed=1)
    q = torch.randn(len(specs), hkv * g, d, device=DEVICE, dtype=dtype)
    dr = DecodeRows(
        _table(rows),
        _ints([s[0] for s in specs]),
        _ints([s[1] for s in specs]),
        _ints([s[2] for s in specs]),
        _ints([16] * 3),
        _ints([32] * 3),
        max_pages=40,
        max_select=8,
    )
    args = (dr, ps, d**-0.5)
    eager = triton_ops.hsa_decode(q, c.k, c.v, c.kt, *args)
    out = torch.empty_like(eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside capture
        triton_ops.hsa_decode(q, c.k, c.v, c.kt, *args, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_ops.hsa_decode(q, c.k, c.v, c.kt, *args, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, atol=0, rtol=0)


def test_hsa_decode_with_pdl_changes_no_byte():
    """Programmatic dependent launch (on by default from compute capability
    9.0) against the same decode with it off (ROCKETKV_PDL=0): eager, and
    replayed in a CUDA graph whose first node, an elementwise kernel (PDL
    relaxes kernel-to-kernel edges; a memcpy node would not test it),
    rewrites the queries the scoring kernel reads at once (a kernel started
    early must wait for it), with other queries before each replay."""
    from rocketkv_vllm.kernels._utils import uses_pdl

    if DEVICE.type != "cuda" or not uses_pdl(DEVICE):
        skip("needs an NVIDIA GPU of compute capability 9.0 or later")
    hkv, g, d, bs, ps, dtype = 2, 4, 128, 16, 4, BF16
    specs = [(37, 96, 150), (64, 64, 70), (13, 32, 33), (40, 128, 140)]
    c, rows = _decode_batch(hkv, d, bs, ps, dtype, specs, seed=5)
    dr = DecodeRows(
        _table(rows),
        *(_ints([s[i] for s in specs]) for i in range(3)),
        _ints([16] * len(specs)),
        _ints([d] * len(specs)),
        max_pages=32768 // ps + 1,
        max_select=8,
    )
    args = (dr, ps, d**-0.5, True)
    queries = [torch.randn(len(specs), hkv * g, d, device=DEVICE, dtype=dtype) for _ in range(4)]
    with mock.patch.dict(os.environ, {"ROCKETKV_PDL": "0"}):
        want = [triton_ops.hsa_decode(q, c.k, c.v, c.kt, *args) for q in queries]
    for q, w in zip(queries, want):
        torch.testing.assert_close(
            triton_ops.hsa_decode(q, c.k, c.v, c.kt, *args), w, atol=0, rtol=0
        )
    q_in, q_buf = queries[0].clone(), torch.empty_like(queries[0])
    out = torch.empty_like(q_buf)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside capture
        torch.mul(q_in, 1, out=q_buf)
        triton_ops.hsa_decode(q_buf, c.k, c.v, c.kt, *args, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(q_in, 1, out=q_buf)  # a kernel, exact (x 1 keeps every bit)
        triton_ops.hsa_decode(q_buf, c.k, c.v, c.kt, *args, out=out)
    for replay in range(40):
        i = replay % len(queries)
        q_in.copy_(queries[i])
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want[i], atol=0, rtol=0, msg=f"replay {replay}")


def test_hsa_decode_batch_cuda_graph_replays_new_rows():
    """The backend's FULL decode graph (decode_graphs): captured with every
    row inactive (seq_len 0) at launch shapes for a long max_model_len,
    then replayed after the per-row columns are rewritten in place, twice,
    with different rows active: active rows match the reference (KT update
    included), inactive rows keep what ``out`` held."""
    if DEVICE.type != "cuda":
        skip("needs CUDA")
    hkv, g, d, bs, ps, dtype = 2, 4, 128, 16, 4, BF16
    specs = [(37, 96, 150), (64, 64, 70), (13, 32, 33), (40, 128, 140)]
    c, rows = _decode_batch(hkv, d, bs, ps, dtype, specs, seed=2, poison=False)
    gen = torch.Generator().manual_seed(4)
    for b, (_nc, _ts, seq) in enumerate(specs):
        c.fill(rows[b], seq, seq + 1, gen)  # each row's new token
    q = torch.randn(len(specs), hkv * g, d, device=DEVICE, dtype=dtype)
    table = _table(rows)
    cols = {name: _ints([0] * len(specs)) for name in ("nc", "ts", "seq", "topk", "topr")}
    graph_pages, graph_select = 32768 // ps + 1, 64  # max_model_len 32k

    def call(out):
        dr = DecodeRows(
            table,
            cols["nc"],
            cols["ts"],
            cols["seq"],
            cols["topk"],
            cols["topr"],
            graph_pages,
            graph_select,
        )
        return triton_ops.hsa_decode(q, c.k, c.v, c.kt, dr, ps, d**-0.5, True, out=out)

    out = torch.zeros_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside capture
        call(out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out)
    for active in ([0, 2], [1, 3]):
        values = {"nc": [], "ts": [], "seq": [], "topk": [], "topr": []}
        for b, (nc, ts, seq) in enumerate(specs):
            on = b in active
            values["nc"].append(nc if on else 0)
            values["ts"].append(ts if on else 0)
            values["seq"].append(seq + 1 if on else 0)
            values["topk"].append(8 * ps if on else 0)
            values["topr"].append(32 if on else 0)
        for name, v in values.items():
            cols[name].copy_(_ints(v))
        clean = c.clone()
        ref = paged.hsa_decode_rows(
            q,
            clean.k,
            clean.v,
            clean.kt,
            table,
            cols["nc"],
            cols["ts"],
            cols["seq"],
            cols["topk"],
            cols["topr"],
            ps,
            d**-0.5,
            force_current_page=True,
        )
        out.fill_(7.0)
        graph.replay()
        torch.cuda.synchronize()
        for b in range(len(specs)):
            if b in active:
                _close(out[b], ref[b], dtype, f"row {b}")
            else:
                assert bool((out[b] == 7.0).all()), f"inactive row {b} was written"


# --------------------------------------------------------------------------
# Selection reuse across decode steps (hsa_decode's selection store)

# Per row: (num_compact, tail_start, seq_len before step 1) -- steps 1 and 2
# each add a token, both on the same view page --, its store slot (-1:
# none), topk in pages, and whether it reuses its stored pages at step 2.
# The store is 3 + f entries wide, max_select 4 (n_sel 4 + f).
REUSE_ROWS = [
    ((37, 96, 150), 2, 3, 1),  # a long view: reuses at step 2
    ((64, 64, 70), 0, 2, 0),  # chooses and stores again at step 2
    ((0, 0, 0), 1, 1, 1),  # padding, slot and reuse set: the store untouched
    ((13, 32, 40), 3, 4, 0),  # n_use 4 + f over the width: never stored
    ((40, 128, 140), -1, 1, 1),  # no slot: reuse means nothing
    ((20, 48, 60), 4, 3, 1),
]
REUSE_WIDTH, REUSE_MAX_SELECT = 3, 4


def _kt_after_token(c, rows, seqs):
    """A copy of the cache with each row's newest KT page (token seq - 1)
    rebuilt by the reference's ``write_kt_pages``."""
    ref = c.clone()
    for b, seq in enumerate(seqs):
        if seq:
            lo = (seq - 1) // c.ps * c.ps  # tail pages start at the ps-aligned tail_start
            torch_ops.write_kt_pages(ref.k, ref.kt, rows[b], lo, seq, c.ps)
    return ref


@parametrize(
    "hkv,g,d,bs,ps,dtype,force,layout,kt_dtype,sms",
    [
        (2, 2, 64, 16, 4, F32, False, "token", AUTO, None),
        (2, 3, 64, 16, 2, BF16, True, "head_rows", FP8, 64),
    ],
)
def test_hsa_decode_selection_reuse(hkv, g, d, bs, ps, dtype, force, layout, kt_dtype, sms):
    """Two decode steps with a selection store. Step 1 (no row reuses): the
    output and caches are the call's without a store, and each slotted row's
    stored pages are the PyTorch path's choice (as sets; random data, no
    ties). Step 2 (one more token on the same page): a reusing row attends
    exactly step 1's stored pages of the grown view and still gets its KT
    page updated; the other rows are as without a store. Padding rows, rows
    without a slot and rows choosing more pages than the store holds leave
    it untouched; every merge counter is back at 0 after each call. A store
    with no slot set changes nothing."""
    specs = [r[0] for r in REUSE_ROWS]
    f = int(force)
    c, rows = _decode_batch(hkv, d, bs, ps, dtype, specs, seed=ps, layout=layout, kt_dtype=kt_dtype)
    table = _table(rows)
    gen = torch.Generator().manual_seed(13)
    seqs1 = [s + 1 if s else 0 for _, _, s in specs]
    seqs2 = [s + 2 if s else 0 for _, _, s in specs]
    for _, ts, seq in specs:
        if seq:  # step 2's token: same view page, room in the row's blocks
            assert (seq - ts) // ps == (seq + 1 - ts) // ps and (seq + 1) % bs
    slots = _ints([r[1] for r in REUSE_ROWS])
    topk = [r[2] * ps for r in REUSE_ROWS]
    topr = [d, 16, 16, 7, d // 2, 16]
    nc_t, ts_t = (_ints([s[i] for s in specs]) for i in (0, 1))
    max_pages = max(paged.view_page_starts(*s, ps, "cpu").numel() for s in specs) + 3
    scale = d**-0.5
    num_pages = [
        paged.view_page_starts(nc, ts, sq, ps, "cpu").numel()
        for (nc, ts, _), sq in zip(specs, seqs1)
    ]
    n_use = [min(max(k // ps, 1) + f, n, REUSE_MAX_SELECT + f) for k, n in zip(topk, num_pages)]
    width = REUSE_WIDTH + f
    sms = sms or sparse_decode_module.num_sms(DEVICE)
    ws = triton_ops.DecodeWorkspace(
        DEVICE, len(specs), hkv * g, hkv, d, max_pages, REUSE_MAX_SELECT, force, sms=sms
    )
    plan = triton_ops.plan_decode(
        len(specs), hkv * g, hkv, d, max_pages, REUSE_MAX_SELECT, ps, force, dtype, sms
    )
    assert ws.fits(plan)  # the calls use its counters

    def step(cache, q, seqs, selections=None, **slots):
        dr = DecodeRows(
            table, nc_t, ts_t, _ints(seqs), _ints(topk), _ints(topr), max_pages, REUSE_MAX_SELECT,
            **slots,
        )  # fmt: skip
        with (
            mock.patch.object(hsa_score_module, "num_sms", lambda device: sms),
            mock.patch.object(sparse_decode_module, "num_sms", lambda device: sms),
        ):
            out = triton_ops.hsa_decode(
                q,
                cache.k,
                cache.v,
                cache.kt,
                dr,
                ps,
                scale,
                force,
                workspace=ws,
                selections=selections,
            )
        assert bool((ws.counters == 0).all()), "a merge counter was left set"
        return out

    def torch_choice(b, q, kt, seqs):
        """Row b's pages as the PyTorch path (``ops.pytorch.select_pages``)
        chooses them, a set per KV head."""
        nc, ts, _ = specs[b]
        pages = torch_ops.view_pages(
            table[b : b + 1], *(_ints([v]) for v in (nc, ts, seqs[b])), ps, bs, max_pages
        )
        top, valid = torch_ops.select_pages(
            q[b : b + 1],
            kt,
            pages,
            _ints(topr[b : b + 1]),
            _ints([topk[b] // ps]),
            REUSE_MAX_SELECT,
            force,
        )
        return [set(top[0, h][valid[0, h]].tolist()) for h in range(hkv)]

    def new_tokens(seqs):
        for b, seq in enumerate(seqs):
            if seq:
                c.fill(rows[b], seq - 1, seq, gen)

    # Step 1: every slotted row chooses and stores.
    new_tokens(seqs1)
    q1 = _queries_without_channel_ties(len(specs), hkv, g, d, dtype, topr, gen)
    ref1 = _kt_after_token(c, rows, seqs1)
    plain, unslotted = c.clone(), c.clone()
    want1 = step(plain, q1, seqs1)
    store = torch.full((5, hkv, width), -7, dtype=torch.int32, device=DEVICE)
    no_reuse = _ints([0] * len(specs))
    out1 = step(c, q1, seqs1, selections=store, sel_slot=slots, reuse=no_reuse)
    assert torch.equal(out1, want1)
    _same_storage(c, ref1)
    _same_storage(plain, ref1)
    idle = torch.full_like(store, -7)
    out_idle = step(
        unslotted, q1, seqs1, selections=idle, sel_slot=_ints([-1] * len(specs)), reuse=no_reuse
    )
    assert torch.equal(out_idle, want1) and bool((idle == -7).all())
    _same_storage(unslotted, ref1)
    stored1 = store.clone()
    for b, (_, slot, _, _) in enumerate(REUSE_ROWS):
        if slot < 0:
            continue
        if seqs1[b] == 0 or n_use[b] > width:
            _untouched(stored1[slot], -7, f"slot {slot} of row {b}")
            continue
        want = torch_choice(b, q1, ref1.kt, seqs1)
        for h in range(hkv):
            got = stored1[slot, h, : n_use[b]].tolist()
            assert set(got) == want[h] and len(want[h]) == n_use[b], (b, h, got, want[h])
        _untouched(stored1[slot, :, n_use[b] :], -7, f"slot {slot} past row {b}'s n_use")
    _untouched(stored1[1], -7, "the padding row's slot")  # (slot 1)

    # Step 2: one more token on the same page; the flagged rows reuse.
    new_tokens(seqs2)
    q2 = _queries_without_channel_ties(len(specs), hkv, g, d, dtype, topr, gen)
    ref2 = _kt_after_token(c, rows, seqs2)
    plain = c.clone()
    want2 = step(plain, q2, seqs2)
    reuse = [r[3] for r in REUSE_ROWS]
    out2 = step(c, q2, seqs2, selections=store, sel_slot=slots, reuse=_ints(reuse))
    _same_storage(c, ref2)  # the reusing rows' KT pages were updated too
    changed = 0  # (row, head)s whose step-2 choice differs from the stored one
    for b, ((nc, ts, _), slot, _, _) in enumerate(REUSE_ROWS):
        if seqs2[b] == 0:
            assert bool((out2[b] == 0).all())
        elif reuse[b] and slot >= 0:
            pages = stored1[slot, :, : n_use[b]].long()
            ref = _sparse_ref(q2[b], c, rows[b], nc, ts, seqs2[b], pages, scale)
            _close(out2[b], ref, dtype, msg=f"reusing row {b}")
            choice = torch_choice(b, q2, ref2.kt, seqs2)
            changed += sum(set(pages[h].tolist()) != choice[h] for h in range(hkv))
        else:
            assert torch.equal(out2[b], want2[b]), f"row {b}"
    assert changed, "step 2 would choose step 1's pages anyway: reuse untested"
    # row 1 stored its new choice; the reusing rows' slots are as they were
    want = torch_choice(1, q2, ref2.kt, seqs2)
    for h in range(hkv):
        assert set(store[0, h, : n_use[1]].tolist()) == want[h]
    assert torch.equal(store[1:], stored1[1:])
    assert torch.equal(store[0, :, n_use[1] :], stored1[0, :, n_use[1] :])


def test_hsa_decode_store_entries_outside_the_view_reselect():
    """The store's invariant, checked where read (both kernels decide alike
    per (row, KV head)): one whose n_use stored entries are not all pages of
    its view (>= P, negative) or that selects more pages than the store
    holds does not reuse but scores, selects and stores anew -- output and
    store those of the same step without reuse, no raise -- while the other
    (row, head)s reuse their valid entries (attention over the stored pages,
    which differ from a reselect's somewhere). The workspace is NaN before
    the call, so a row the scoring skipped cannot borrow another call's
    logits."""
    hkv, g, d, bs, ps, dtype, force, sms = 2, 2, 64, 16, 4, F32, True, 64
    specs = [(37, 96, 150), (20, 48, 60), (40, 128, 140), (13, 32, 40)]
    topk = [3 * ps, 3 * ps, 2 * ps, 4 * ps]  # row 3: n_use 4 + f > the store's 3 + f
    topr = [d, 16, d // 2, 7]
    max_select, width = 4, 3 + int(force)
    c, rows = _decode_batch(hkv, d, bs, ps, dtype, specs, seed=3)
    table, batch = _table(rows), len(specs)
    gen = torch.Generator().manual_seed(17)
    nc_t, ts_t = (_ints([s[i] for s in specs]) for i in (0, 1))
    max_pages = max(paged.view_page_starts(*s, ps, "cpu").numel() for s in specs) + 3
    slots, scale = _ints([2, 0, 3, 1]), d**-0.5
    ws = triton_ops.DecodeWorkspace(
        DEVICE, batch, hkv * g, hkv, d, max_pages, max_select, force, sms=sms
    )

    def step(cache, q, seqs, store, reuse):
        dr = DecodeRows(
            table, nc_t, ts_t, _ints(seqs), _ints(topk), _ints(topr), max_pages, max_select,
            sel_slot=slots, reuse=_ints([reuse] * batch),
        )  # fmt: skip
        with (
            mock.patch.object(hsa_score_module, "num_sms", lambda device: sms),
            mock.patch.object(sparse_decode_module, "num_sms", lambda device: sms),
        ):
            out = triton_ops.hsa_decode(
                q, cache.k, cache.v, cache.kt, dr, ps, scale, force, workspace=ws, selections=store
            )
        assert bool((ws.counters == 0).all()), "a merge counter was left set"
        return out

    seqs1 = [s + 1 for _, _, s in specs]
    seqs2 = [s + 2 for _, _, s in specs]
    for (_, ts, seq), row in zip(specs, rows):
        assert (seq - ts) // ps == (seq + 1 - ts) // ps  # step 2's token: same page
        c.fill(row, seq, seq + 2, gen)
    q1 = _queries_without_channel_ties(batch, hkv, g, d, dtype, topr, gen)
    q2 = _queries_without_channel_ties(batch, hkv, g, d, dtype, topr, gen)
    stored1 = torch.full((4, hkv, width), -7, dtype=torch.int32, device=DEVICE)
    step(c, q1, seqs1, stored1, 0)
    num_pages = [
        paged.view_page_starts(nc, ts, sq, ps, "cpu").numel()
        for (nc, ts, _), sq in zip(specs, seqs2)
    ]
    n_use = [min(k // ps + 1, p, max_select + 1) for k, p in zip(topk, num_pages)]
    corrupt = {(0, 0): (0, num_pages[0]), (0, 1): (n_use[0] - 1, -1), (1, 1): (1, num_pages[1] + 9)}
    bad = stored1.clone()
    for (b, h), (i, page) in corrupt.items():
        bad[slots[b], h, i] = page
    bad[slots[3]] = torch.arange(width)  # view pages, but fewer than row 3's n_use
    unread = bad.clone()
    fresh, want_store = c.clone(), stored1.clone()
    ws.f32.fill_(float("nan"))
    ws.i32.fill_(-1)
    got = step(c, q2, seqs2, bad, 1)
    want = step(fresh, q2, seqs2, want_store, 0)
    _same_storage(c, fresh)  # the KT pages updated alike
    changed = 0
    for b, (nc, ts, _) in enumerate(specs):
        entries = stored1[slots[b], :, : n_use[b]].long()
        over_stored = None
        if n_use[b] <= width:
            ok = [entries[h] if (b, h) not in corrupt else entries[h, :0] for h in range(hkv)]
            over_stored = _sparse_ref(q2[b], c, rows[b], nc, ts, seqs2[b], ok, scale)
        for h in range(hkv):
            heads, entry = slice(h * g, (h + 1) * g), (slots[b], h)
            if (b, h) in corrupt or over_stored is None:  # as without reuse
                assert torch.equal(got[b, heads], want[b, heads]), (b, h)
                stores = over_stored is not None  # n_use <= width
                assert torch.equal(bad[entry], (want_store if stores else unread)[entry]), (b, h)
            else:
                _close(got[b, heads], over_stored[heads], dtype, msg=f"reusing {(b, h)}")
                assert torch.equal(bad[entry], stored1[entry]), (b, h)
                changed += not torch.equal(stored1[entry], want_store[entry])
    assert changed, "step 2 would choose step 1's pages anyway: reuse untested"


def test_hsa_decode_selection_store_refusals():
    """A store needs the rows' slot and reuse columns and int32 entries:
    refused before any launch. The checking aids (probs_out, select_impl,
    update_kt) are ``hsa_decode_checked``'s only, which takes no store."""
    c = Cache(4, 2, 64, 16, 4, F32)
    q = torch.zeros(1, 4, 64, device=DEVICE)
    store = torch.zeros(1, 2, 4, dtype=torch.int32, device=DEVICE)
    one = _ints([0])
    rows = DecodeRows(_table([c.new_row(1)]), one, one, one, one, one, 8, 2)
    cases = [
        (rows, store, "sel_slot and reuse"),
        (dataclasses.replace(rows, sel_slot=one), store, "sel_slot and reuse"),
        (dataclasses.replace(rows, sel_slot=one, reuse=one), store.long(), "int32"),
    ]
    for dr, selections, words in cases:
        try:
            triton_ops.hsa_decode(q, c.k, c.v, c.kt, dr, 4, 1.0, selections=selections)
        except ValueError as exc:
            assert words in str(exc), (words, exc)
        else:
            raise AssertionError(f"accepted: {words}")
    plain = inspect.signature(triton_ops.hsa_decode).parameters
    checked = inspect.signature(triton_ops.hsa_decode_checked).parameters
    assert not {"select_impl", "probs_out", "update_kt"} & set(plain)
    assert "selections" not in checked


def test_triton_stage2_passes_the_selection_store():
    """``TritonStage2.decode`` hands the store to ``hsa_decode`` with the
    rows (their slot / reuse columns sliced with them in eager chunks), and
    no store without one."""
    from types import SimpleNamespace

    from rocketkv_vllm.ops.base import HsaRows

    c = Cache(4, 2, 64, 16, 4, F32)
    ints = _ints([0, 1, 2])
    table = _table([c.new_row(1) for _ in range(3)])
    rows = HsaRows(
        tokens=ints,
        decode_rows=DecodeRows(
            table, ints, ints, ints, ints, ints, 4, 2, _ints([5, -1, 6]), _ints([1, 0, 1])
        ),
        num_select=ints,
    )
    settings = SimpleNamespace(page_size=4, force_current_page=True, kt_dtype=AUTO)
    stage2 = triton_ops.TritonStage2(settings, "token")
    store = torch.zeros(8, 2, 3, dtype=torch.int32, device=DEVICE)
    q = torch.zeros(3, 4, 64, device=DEVICE)
    calls = []

    def fake(query, k, v, kt, rows, *args, **kwargs):
        calls.append(dict(kwargs, sel_slot=rows.sel_slot, reuse=rows.reuse))
        return torch.zeros_like(query)

    with (
        mock.patch.object(triton_ops, "hsa_decode", fake),
        mock.patch.object(triton_ops.TritonStage2, "eager_chunk", staticmethod(lambda *a: 2)),
    ):
        stage2.decode(q, c.kv, rows, 1.0, selections=store)
        assert [kw["selections"] is store for kw in calls] == [True, True]
        assert [kw["sel_slot"].tolist() for kw in calls] == [[5, -1], [6]]
        assert [kw["reuse"].tolist() for kw in calls] == [[1, 0], [1]]
        calls.clear()
        stage2.decode(q, c.kv, rows, 1.0, out=torch.zeros_like(q), selections=store)
        assert calls[0]["sel_slot"].tolist() == [5, -1, 6]
        calls.clear()
        stage2.decode(q, c.kv, rows, 1.0)
        assert [kw["selections"] for kw in calls] == [None, None]


# --------------------------------------------------------------------------
# Minimal runner for hosts without pytest.


def _main() -> int:
    if pytest is not None and "--no-pytest" not in sys.argv:
        return pytest.main([__file__, "-q", "-rs"] + [a for a in sys.argv[1:]])
    failed = passed = skipped = 0
    start = time.time()
    for name, fn in list(globals().items()):
        if not name.startswith("test_") or not callable(fn):
            continue
        names, cases = getattr(fn, "_cases", ("", [()]))
        keys = [k.strip() for k in names.split(",")] if names else []
        for case in cases:
            if len(keys) == 1:  # pytest: one name -> each case is the value
                case = (case,)
            kwargs = dict(zip(keys, case))
            label = f"{name}[{'-'.join(map(str, case))}]"
            try:
                fn(**kwargs)
            except Skip as exc:
                skipped += 1
                print(f"SKIP {label}: {exc}")
            except Exception as exc:  # noqa: BLE001
                failed += 1
                print(f"FAIL {label}: {type(exc).__name__}: {exc}")
            else:
                passed += 1
                print(f"ok   {label}")
    print(
        f"{passed} passed, {failed} failed, {skipped} skipped "
        f"in {time.time() - start:.1f}s (device {DEVICE})"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_main())
