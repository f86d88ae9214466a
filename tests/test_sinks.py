"""Attention sinks (gpt-oss, ``algorithm.sinks``) in every implementation of
RocketKV's math below the backend: Stage 2's exact attention (``algorithm``,
the ``paged`` oracle, batched ``ops.pytorch``, the C++ kernel ``ops.cpu``, the
Triton kernels with one split and through the split-K merge), the dense
references, and Stage 1's window scores.

Each is checked against a dense derivation written here (``_attention_ref``,
``_window_ref``): per query head, the softmax over [its scaled logits, its
sink logit] in float64, the sink column dropped. Sinks differ per head of a
GQA group. "large" sinks take from a fifth to nearly all of a head's mass
(each test checks they move the result well past its tolerance), "negative"
ones (-1e4) take none: the result equals the sink-free one. Stage 2 runs
with every page selected, so the page choice (sink-free by design) cannot
hide an error; partial selections are checked against the oracle and, for
the Triton attention kernel, with explicit pages.

The Triton kernels run in Triton's interpreter without a GPU (conftest sets
TRITON_INTERPRET=1), on small shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from reference import paged  # noqa: E402

from rocketkv_eval.dense_decode import dense_decode  # noqa: E402
from rocketkv_vllm.algorithm import (  # noqa: E402
    snapkv_keep_positions,
    sparse_attention,
    window_attention_scores,
)
from rocketkv_vllm.algorithm.snapkv import keep_positions_from_scores  # noqa: E402
from rocketkv_vllm.kernels.rows import DecodeRows  # noqa: E402
from rocketkv_vllm.kernels.sparse_decode import sparse_decode  # noqa: E402
from rocketkv_vllm.kernels.window_scores import window_scores as triton_window_scores  # noqa: E402
from rocketkv_vllm.layout import kt_cache_view, kt_row_bytes, split_kv  # noqa: E402
from rocketkv_vllm.ops import cpu as cpu_ops  # noqa: E402
from rocketkv_vllm.ops import pytorch as torch_ops  # noqa: E402
from rocketkv_vllm.ops import triton as triton_ops  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
TRITON_DEVICE = torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")
F32, BF16 = torch.float32, torch.bfloat16
# PyTorch / C++ paths: fp32 math on the stored values (a bf16 result is
# rounded once); Triton: as tests/test_kernels.py (bf16 P rounded before P.V).
TOL = {F32: dict(atol=2e-5, rtol=2e-5), BF16: dict(atol=1e-2, rtol=1e-2)}
TRITON_TOL = {F32: dict(atol=1e-4, rtol=1e-4), BF16: dict(atol=2e-2, rtol=2e-2)}
HKV, G, D, BS, PS = 2, 3, 64, 32, 4  # GQA: 3 query heads per KV head
SCALE = D**-0.5
# Requests already compressed: (num_compact, tail_start, seq_len incl. the new token)
SPECS = [(37, 64, 90), (21, 32, 45)]
KINDS = ["large", "negative"]


def _sinks(kind: str, hq: int = HKV * G) -> torch.Tensor:
    if kind == "large":  # a different sink per head; logits here are ~N(0, 1)
        return torch.linspace(2.0, 8.0, hq)
    return torch.full((hq,), -1e4)


# --------------------------------------------------------------------------
# The dense derivations


def _attention_ref(q, keys, values, mask, scale, sinks):
    """q [Hq, d]; keys, values [T, Hkv, d]; mask [Hkv, T] bool. Per query
    head: softmax([logits of its KV head's kept keys, its sink]), the sink's
    column dropped, times the values. Returns [Hq, d] fp32 (float64 math)."""
    hq, d = q.shape
    group = hq // keys.shape[1]
    out = torch.zeros(hq, d, dtype=torch.float64)
    for h in range(hq):
        kv = h // group
        k = keys[mask[kv].cpu(), kv].double().cpu()
        v = values[mask[kv].cpu(), kv].double().cpu()
        logits = (k @ q[h].double().cpu()) * scale
        if sinks is not None:
            logits = torch.cat([logits, sinks[h : h + 1].double().cpu()])
        probs = logits.softmax(0)
        if sinks is not None:
            probs = probs[:-1]
        out[h] = probs @ v
    return out.float()


def _window_ref(q_win, keys, scale, sinks):
    """[Hkv, N - w]: each window query's causal softmax over the prompt keys
    and its head's sink, sink dropped, summed over the window and the group."""
    w, hq, _ = q_win.shape
    n, hkv, _ = keys.shape
    group = hq // hkv
    out = torch.zeros(hkv, n - w, dtype=torch.float64)
    for h in range(hq):
        for i in range(w):
            logits = (keys[: n - w + i + 1, h // group].double() @ q_win[i, h].double()) * scale
            if sinks is not None:
                logits = torch.cat([logits, sinks[h : h + 1].double()])
            out[h // group] += logits.softmax(0)[: n - w]
    return out.float()


def _check(got, want, want_plain, kind, tol):
    """got == want; "large" sinks must move the result well past the
    tolerance (else the case tests nothing), "negative" ones not at all."""
    got, want, want_plain = (t.float().cpu() for t in (got, want, want_plain))
    moved = float((want - want_plain).abs().max())
    if kind == "large":
        assert moved > 10 * tol["atol"], f"sinks barely change the result ({moved:.2e})"
    else:
        assert moved < 1e-6
    torch.testing.assert_close(got, want, **tol)


# --------------------------------------------------------------------------
# A paged cache (CPU_ATTN / FLASH_ATTN layouts, KT pages in each block's
# padding) holding compressed requests


class Paged:
    def __init__(self, dtype, layout, specs=SPECS, device="cpu", seed=0):
        gen = torch.Generator().manual_seed(seed)
        num_blocks = sum(-(-max(s[2], 1) // BS) for s in specs) + 2
        kt_bytes = HKV * (BS // PS) * kt_row_bytes(D, dtype, "auto")
        block_elems = HKV * BS * 2 * D + -(-kt_bytes // dtype.itemsize)
        storage = torch.full((num_blocks * block_elems,), float("nan"), dtype=dtype)
        self.kv = torch.as_strided(
            storage.to(device), (num_blocks, HKV, BS, 2 * D), (block_elems, BS * 2 * D, 2 * D, 1)
        )
        self.k, self.v = split_kv(self.kv, layout)
        self.kt = kt_cache_view(self.kv, PS)
        self.specs, self.layout = specs, layout
        free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        self.rows = []
        for nc, ts, seq in specs:
            row = torch.tensor([free.pop() for _ in range(-(-max(seq, 1) // BS))], device=device)
            self.rows.append(row)
            if seq <= 0:
                continue
            # finite data in [0, seq) (the oracle's masked einsum is not NaN
            # safe); the view is [0, nc) and [ts, seq)
            slots = torch.arange(seq, device=device)
            paged.write_kv(
                self.k,
                self.v,
                torch.randn(seq, HKV, D, generator=gen).to(dtype).to(device),
                torch.randn(seq, HKV, D, generator=gen).to(dtype).to(device),
                row[slots // BS] * BS + slots % BS,
            )
            torch_ops.write_kt_pages(self.k, self.kt, row, 0, nc, PS)
            torch_ops.write_kt_pages(self.k, self.kt, row, ts, seq - 1, PS)
        width = max(r.numel() for r in self.rows)
        self.table = torch.zeros(len(specs), width, dtype=torch.int32, device=device)
        for b, row in enumerate(self.rows):
            self.table[b, : row.numel()] = row
        col = lambda i: torch.tensor([s[i] for s in specs], dtype=torch.int32, device=device)  # noqa: E731
        self.nc, self.ts, self.seq = col(0), col(1), col(2)

    def num_pages(self, b):
        nc, ts, seq = self.specs[b]
        return -(-nc // PS) + -(-(seq - ts) // PS)

    def view_kv(self, b):
        """K, V [T, Hkv, d] of row b's view, in view order."""
        nc, ts, seq = self.specs[b]
        slots = torch.cat([torch.arange(nc), torch.arange(ts, seq)]).to(self.table.device)
        return paged.gather_kv(self.k, self.v, self.rows[b], slots)

    def view_ref(self, query, sinks):
        """Every row's attention over its whole view: [B, Hq, d]."""
        out = torch.zeros(query.shape, dtype=torch.float32)
        for b in range(len(self.specs)):
            if self.specs[b][2] > 0:
                keys, values = self.view_kv(b)
                mask = torch.ones(HKV, keys.shape[0], dtype=torch.bool)
                out[b] = _attention_ref(query[b], keys, values, mask, SCALE, sinks)
        return out


def _query(batch, dtype, seed=1, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, HKV * G, D, generator=gen).to(dtype).to(device)


# --------------------------------------------------------------------------
# Stage 2's exact attention and the dense references


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_algorithm_sparse_attention(dtype, kind):
    gen = torch.Generator().manual_seed(2)
    t = 50
    q = torch.randn(HKV * G, D, generator=gen).to(dtype)
    keys = torch.randn(t, HKV, D, generator=gen).to(dtype)
    values = torch.randn(t, HKV, D, generator=gen).to(dtype)
    mask = torch.rand(HKV, t, generator=gen) < 0.6
    sinks = _sinks(kind)
    got = sparse_attention(q, keys, values, mask, SCALE, sinks)
    want = _attention_ref(q, keys, values, mask, SCALE, sinks)
    plain = _attention_ref(q, keys, values, mask, SCALE, None)
    _check(got, want, plain, kind, TOL[F32])  # fp32 math on the same values
    if kind == "negative":
        torch.testing.assert_close(got, sparse_attention(q, keys, values, mask, SCALE), **TOL[F32])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_paged_dense_attention(dtype, kind):
    c = Paged(dtype, "head_rows", specs=[(0, 0, 70)])
    q = torch.randn(5, HKV * G, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    positions = torch.arange(65, 70)
    sinks = _sinks(kind)
    got = paged.dense_attention(q, positions, c.k, c.v, c.rows[0], 70, SCALE, chunk=2, sinks=sinks)
    assert got.dtype == dtype
    keys, values = paged.gather_kv(c.k, c.v, c.rows[0], torch.arange(70))
    for i, pos in enumerate(positions.tolist()):
        mask = (torch.arange(70) <= pos).expand(HKV, -1)
        want = _attention_ref(q[i], keys, values, mask, SCALE, sinks)
        plain = _attention_ref(q[i], keys, values, mask, SCALE, None)
        _check(got[i], want, plain, kind, TOL[dtype])


def _stage2(impl, c, query, sinks, num_select, force=False):
    """One decode step of every row with ``impl``; num_select [B] pages."""
    topr = torch.full_like(c.seq, D)  # all channels: no tie in the channel choice
    max_pages = max(c.num_pages(b) for b in range(len(c.specs)))
    max_select = int(num_select.max())
    if impl == "paged":
        return paged.hsa_decode_rows(
            query,
            c.k,
            c.v,
            c.kt,
            c.table,
            c.nc,
            c.ts,
            c.seq,
            num_select * PS,
            topr,
            PS,
            SCALE,
            force_current_page=force,
            sinks=sinks,
        )
    dev = c.table.device
    topk = (num_select * PS).to(dev)
    rows = DecodeRows(c.table, c.nc, c.ts, c.seq, topk, topr.to(dev), max_pages, max_select)
    if impl == "pytorch":
        view = torch_ops.view_pages(c.table, c.nc, c.ts, c.seq, PS, BS, max_pages)
        return torch_ops.hsa_decode(
            query, c.k, c.v, c.kt, rows, view, num_select, PS, SCALE, force, sinks=sinks
        )
    if impl == "cpu":
        return cpu_ops.hsa_decode(
            query, c.kv, c.kt, c.layout, rows, num_select, PS, SCALE, force, sinks=sinks
        )
    assert impl == "triton"
    return triton_ops.hsa_decode(
        query,
        c.k,
        c.v,
        c.kt,
        rows,
        PS,
        SCALE,
        force,
        sinks=None if sinks is None else sinks.to(dev),
    )


def _layout(impl, dtype):
    if impl == "cpu":  # CPU_ATTN's own layouts
        return "cpu_amx" if dtype == BF16 else "cpu_vec"
    return "token" if impl == "triton" else "head_rows"


def _skip_without_cpu_kernel(impl):
    if impl == "cpu" and (err := cpu_ops.build_error()) is not None:
        pytest.skip(f"C++ kernel not built here: {err}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("impl", ["paged", "pytorch", "cpu", "triton"])
def test_stage2_over_the_whole_view(impl, dtype, kind):
    """Every page selected: Stage 2 is dense attention over the view."""
    _skip_without_cpu_kernel(impl)
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    c = Paged(dtype, _layout(impl, dtype), device=device)
    query = _query(len(SPECS), dtype, device=device)
    sinks = _sinks(kind)
    num_select = torch.tensor([c.num_pages(b) for b in range(len(SPECS))], dtype=torch.int32)
    got = _stage2(impl, c, query, sinks, num_select)
    plain_got = _stage2(impl, c, query, None, num_select)
    assert got.dtype == dtype and got.shape == query.shape
    tol = TRITON_TOL[dtype] if impl == "triton" else TOL[dtype]
    _check(got, c.view_ref(query, sinks), c.view_ref(query, None), kind, tol)
    if kind == "negative":  # a sink of -1e4 is no sink
        torch.testing.assert_close(got.cpu(), plain_got.cpu(), **tol)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("impl", ["pytorch", "cpu", "triton"])
def test_stage2_partial_selection_matches_the_oracle(impl, dtype):
    """A few pages selected (and the current page forced): the same pages as
    the oracle's, the same sinks."""
    _skip_without_cpu_kernel(impl)
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    c = Paged(dtype, _layout(impl, dtype), device=device, seed=4)
    oracle = Paged(dtype, _layout(impl, dtype), seed=4)
    query = _query(len(SPECS), dtype, seed=5, device=device)
    sinks = _sinks("large")
    num_select = torch.tensor([3, 2], dtype=torch.int32)
    got = _stage2(impl, c, query, sinks, num_select, force=True)
    want = _stage2("paged", oracle, query.cpu(), sinks, num_select, force=True)
    plain = _stage2("paged", oracle, query.cpu(), None, num_select, force=True)
    _check(got, want, plain, "large", TRITON_TOL[dtype] if impl == "triton" else TOL[dtype])


# The split-K merge: num_splits 3 with 16-token tiles (4 pages of 4) gives
# three splits to a row using 9 or more pages; the row using one page leaves
# two splits empty. Row 2 is padding (seq_len 0).
SPLIT_SPECS = [(37, 64, 90), (21, 32, 45), (0, 0, 0), (13, 32, 40)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_sparse_decode_with_explicit_pages(splits, dtype, kind):
    c = Paged(dtype, "token", specs=SPLIT_SPECS, device=TRITON_DEVICE, seed=6)
    gen = torch.Generator().manual_seed(7)
    n_sel = 12
    topk = [100 * PS, 9 * PS, PS, PS]
    sel = torch.zeros(len(SPLIT_SPECS), HKV, n_sel, dtype=torch.int32)
    for b in range(len(SPLIT_SPECS)):
        if SPLIT_SPECS[b][2] > 0:
            for h in range(HKV):
                perm = torch.randperm(c.num_pages(b), generator=gen)[:n_sel]
                sel[b, h, : perm.numel()] = perm.int()
    query = _query(len(SPLIT_SPECS), dtype, seed=8, device=TRITON_DEVICE)
    sinks = _sinks(kind)

    def run(s):
        topk_t = torch.tensor(topk, dtype=torch.int32, device=TRITON_DEVICE)
        return sparse_decode(
            query,
            c.k,
            c.v,
            DecodeRows(c.table, c.nc, c.ts, c.seq, topk_t, topk_t, 0, n_sel),  # topr: unread
            sel.to(TRITON_DEVICE),
            PS,
            SCALE,
            num_splits=splits,
            tile_tokens=16,
            sinks=None if s is None else s.to(TRITON_DEVICE),
        )

    got, plain_got = run(sinks).cpu(), run(None).cpu()
    assert bool((got[2] == 0).all()), "a padding row was written"
    want = torch.zeros(got.shape)
    plain = torch.zeros(got.shape)
    for b, (_nc, _ts, seq) in enumerate(SPLIT_SPECS):
        if seq <= 0:
            continue
        n_use = min(max(topk[b] // PS, 1), c.num_pages(b), n_sel)
        nc, ts, _ = SPLIT_SPECS[b]  # view page of each view token
        page_of = torch.cat([torch.arange(nc) // PS, -(-nc // PS) + torch.arange(seq - ts) // PS])
        mask = torch.stack([torch.isin(page_of, sel[b, h, :n_use].long()) for h in range(HKV)])
        keys, values = c.view_kv(b)
        want[b] = _attention_ref(query[b], keys, values, mask, SCALE, sinks)
        plain[b] = _attention_ref(query[b], keys, values, mask, SCALE, None)
    _check(got, want, plain, kind, TRITON_TOL[dtype])
    if kind == "negative":
        torch.testing.assert_close(got, plain_got, **TRITON_TOL[dtype])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_dense_decode(splits, dtype, kind):
    specs = [(0, 0, 90), (0, 0, 0), (0, 0, 30)]
    c = Paged(dtype, "token", specs=specs, device=TRITON_DEVICE, seed=9)
    query = _query(len(specs), dtype, seed=10, device=TRITON_DEVICE)
    sinks = _sinks(kind)
    got = dense_decode(
        query,
        c.k,
        c.v,
        c.table,
        c.seq,
        SCALE,
        90,
        num_splits=splits,
        block_n=16,
        sinks=sinks.to(TRITON_DEVICE),
    ).cpu()
    assert bool((got[1] == 0).all())
    for b in (0, 2):
        keys, values = c.view_kv(b)
        mask = torch.ones(HKV, keys.shape[0], dtype=torch.bool)
        want = _attention_ref(query[b], keys, values, mask, SCALE, sinks)
        plain = _attention_ref(query[b], keys, values, mask, SCALE, None)
        _check(got[b], want, plain, kind, TRITON_TOL[dtype])


# --------------------------------------------------------------------------
# Stage 1: window scores


def _window_case(dtype, device="cpu", n=150, w=8):
    c = Paged(dtype, "token", specs=[(0, 0, n)], device=device, seed=11)
    q_win = torch.randn(w, HKV * G, D, generator=torch.Generator().manual_seed(12))
    keys, _ = paged.gather_kv(c.k, c.v, c.rows[0], torch.arange(n, device=device))
    return c, q_win.to(dtype).to(device), keys.cpu()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_window_scores_pytorch(dtype, kind):
    c, q_win, keys = _window_case(dtype)
    sinks = _sinks(kind)
    want, plain = _window_ref(q_win, keys, SCALE, sinks), _window_ref(q_win, keys, SCALE, None)
    _check(window_attention_scores(q_win, keys, SCALE, sinks), want, plain, kind, TOL[F32])
    got = torch_ops.window_scores(q_win, c.k, c.rows[0], keys.shape[0], SCALE, sinks)
    _check(got, want, plain, kind, TOL[F32])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_window_scores_triton(dtype, kind):
    """Three key chunks: the sink joins the merged log-sum-exp once."""
    c, q_win, keys = _window_case(dtype, TRITON_DEVICE)
    sinks = _sinks(kind)
    got = triton_window_scores(
        q_win, c.k, c.rows[0], keys.shape[0], SCALE, chunk=64, sinks=sinks.to(TRITON_DEVICE)
    )
    want, plain = (
        _window_ref(q_win.cpu(), keys, SCALE, sinks),
        _window_ref(q_win.cpu(), keys, SCALE, None),
    )
    _check(got, want, plain, kind, dict(atol=1e-5, rtol=1e-4))


def test_snapkv_keeps_by_the_sink_aware_scores():
    """Stage 1 end to end (reference and paged oracle) chooses from the
    window scores with sinks."""
    n, w, budget, kernel = 150, 8, 60, 7
    c, q_win, keys = _window_case(F32, n=n, w=w)
    sinks = _sinks("large")
    # (the scores themselves: test_window_scores_pytorch; here the same
    # fp32 scores on both sides, so ties among pooled scores break alike)
    scores = window_attention_scores(q_win, keys, SCALE, sinks)
    want = keep_positions_from_scores(scores, n, budget, kernel, n - w)
    plain = window_attention_scores(q_win, keys, SCALE)
    plain = keep_positions_from_scores(plain, n, budget, kernel, n - w)
    assert not torch.equal(want, plain), "the sinks change no kept position: a weak case"
    assert torch.equal(snapkv_keep_positions(q_win, keys, SCALE, budget, kernel, sinks=sinks), want)
    got = paged.snapkv_compress(
        c.k, c.v, c.kt, c.rows[0], q_win, n, budget, n, kernel, PS, SCALE, sinks=sinks
    )
    assert torch.equal(got, want)


# --------------------------------------------------------------------------
# No sinks: unchanged


def test_without_sinks_nothing_changes():
    """sinks=None is the sink-free code: the PyTorch paths give the pre-sink
    formulas bit for bit; the kernels add exactly nothing for a -inf sink, so
    None and -inf agree bit for bit (with one split and through the merge)."""
    gen = torch.Generator().manual_seed(13)
    q = torch.randn(HKV * G, D, generator=gen)
    keys, values = torch.randn(2, 40, HKV, D, generator=gen)
    mask = torch.rand(HKV, 40, generator=gen) < 0.7
    # algorithm.sparse_attention before sinks
    logits = torch.einsum("kgd,tkd->kgt", q.view(HKV, G, D), keys) * SCALE
    probs = logits.masked_fill(~mask[:, None, :], float("-inf")).softmax(dim=-1)
    old = torch.einsum("kgt,tkd->kgd", probs, values).reshape(HKV * G, D)
    assert torch.equal(sparse_attention(q, keys, values, mask, SCALE), old)
    # paged.dense_attention before sinks: SDPA
    c = Paged(F32, "head_rows", specs=[(0, 0, 40)])
    k, v = (t.transpose(0, 1).repeat_interleave(G, dim=0) for t in c.view_kv(0))
    every = torch.ones(1, 1, 40, dtype=torch.bool)
    old = torch.nn.functional.scaled_dot_product_attention(
        q[None].transpose(0, 1), k, v, attn_mask=every, scale=SCALE
    )
    got = paged.dense_attention(q[None], torch.tensor([39]), c.k, c.v, c.rows[0], 40, SCALE)
    assert torch.equal(got[0], old[:, 0])

    minus_inf = torch.full((HKV * G,), float("-inf"))
    if cpu_ops.build_error() is None:
        c = Paged(BF16, "cpu_amx")
        query = _query(len(SPECS), BF16)
        num_select = torch.tensor([3, 2], dtype=torch.int32)
        none = _stage2("cpu", c, query, None, num_select)
        assert torch.equal(_stage2("cpu", c, query, minus_inf, num_select), none)
    c = Paged(F32, "token", specs=SPLIT_SPECS, device=TRITON_DEVICE)
    query = _query(len(SPLIT_SPECS), F32, device=TRITON_DEVICE)
    sel = torch.arange(12, dtype=torch.int32).expand(len(SPLIT_SPECS), HKV, 12).contiguous()
    topk = c.seq * 0 + 12 * PS
    for splits in (1, 3):
        outs = [
            sparse_decode(
                query,
                c.k,
                c.v,
                DecodeRows(c.table, c.nc, c.ts, c.seq, topk, topk, 0, 12),  # topr: unread
                sel.to(TRITON_DEVICE),
                PS,
                SCALE,
                num_splits=splits,
                tile_tokens=16,
                sinks=s,
            ).cpu()
            for s in (None, minus_inf.to(TRITON_DEVICE))
        ]
        assert torch.equal(outs[0], outs[1]), f"{splits} splits"


# --------------------------------------------------------------------------
# The stages (``ops.*``'s Stage classes) hand the sinks to their ops


@pytest.mark.parametrize("impl", ["pytorch", "cpu", "triton"])
def test_the_backend_stage2_passes_the_sinks(impl):
    """``Stage2.decode(..., sinks=)`` of the engine's Stage 2 for each
    implementation gives what its ops give with those sinks."""
    from rocketkv_vllm.config import RocketKVSettings
    from rocketkv_vllm.ops.base import HsaRows
    from rocketkv_vllm.ops.cpu import CpuStage2
    from rocketkv_vllm.ops.pytorch import TorchStage2
    from rocketkv_vllm.ops.triton import TritonStage2

    _skip_without_cpu_kernel(impl)
    dtype = F32
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    c = Paged(dtype, _layout(impl, dtype), device=device, seed=5)
    query = _query(len(SPECS), dtype, device=device)
    sinks = _sinks("large").to(device)
    num_select = torch.tensor([3, 2], dtype=torch.int32)
    settings = RocketKVSettings(page_size=PS, block_size=BS, head_dim=D, force_current_page=False)
    cls = {"pytorch": TorchStage2, "cpu": CpuStage2, "triton": TritonStage2}[impl]
    stage2 = cls(settings, c.layout)
    rows = HsaRows(
        tokens=torch.arange(len(SPECS), device=device),
        decode_rows=DecodeRows(
            block_table=c.table,
            num_compact=c.nc,
            tail_start=c.ts,
            seq_lens=c.seq,
            topk=(num_select * PS).to(device),
            topr=torch.full_like(c.seq, D),
            max_pages=max(c.num_pages(b) for b in range(len(SPECS))),
            max_select=int(num_select.max()),
        ),
        num_select=num_select.to(device),
    )
    stage2.prepare(rows)
    got = stage2.decode(query, c.kv, rows, SCALE, sinks=sinks).cpu()
    plain = stage2.decode(query, c.kv, rows, SCALE).cpu()
    want = _stage2(impl, c, query, sinks.cpu(), num_select).cpu()
    assert torch.equal(got, want)
    assert (got - plain).abs().max() > 1e-2


@pytest.mark.parametrize("impl", ["pytorch", "triton"])
def test_the_backend_stage1_passes_the_sinks(impl):
    """``Stage1.compress(..., sinks=)`` keeps by the sink-aware scores."""
    from rocketkv_vllm.ops.pytorch import TorchStage1
    from rocketkv_vllm.ops.triton import TritonStage1

    n, w, budget, kernel = 150, 8, 60, 7
    device = TRITON_DEVICE if impl == "triton" else "cpu"
    c, q_win, keys = _window_case(F32, n=n, w=w, device=device)
    sinks = _sinks("large")
    scores = window_attention_scores(q_win.cpu(), keys.cpu(), SCALE, sinks)
    want = keep_positions_from_scores(scores, n, budget, kernel, n - w)
    stage1 = {"pytorch": TorchStage1, "triton": TritonStage1}[impl]()
    got = stage1.compress(
        c.k, c.v, c.kt, c.rows[0], q_win, n, budget, n, kernel, PS, SCALE, sinks=sinks.to(device)
    )
    assert torch.equal(got.cpu(), want)
