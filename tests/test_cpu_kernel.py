"""The native CPU Stage 2 (``cpu_ops``, kernels/cpu_hsa_decode.cpp) against the
batched PyTorch path (``batched``, itself checked against the per-request
oracle), on CPU_ATTN's cache layouts, over decode steps crossing pages; at
the head sizes CPU_ATTN serves besides 64 and 128 also against the
per-request oracle itself (``paged.hsa_decode``)."""

import pytest
import torch
from reference import paged

from rocketkv_vllm.kernels.rows import DecodeRows
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


def _native_rows(table, num_compact, tail_start, seq, topr, **slots) -> DecodeRows:
    """Rows for the native call (it reads no topk nor bounds: placeholders)."""
    return DecodeRows(table, num_compact, tail_start, seq, topr, topr, 0, 0, **slots)


def _split_store(store: dict):
    """A test's store arguments: (selections, the rows' slot columns)."""
    return store.get("selections"), {k: store[k] for k in ("sel_slot", "reuse") if k in store}


def _one_token_decode(d: int, dtype: torch.dtype, layout: str):
    """Stage 2 for one row of one token, on a cache stored as head rows."""
    storage, block_elems = _cache(1, d, 32, 4, dtype)
    kv, _, _, kt = _views(storage, block_elems, 1, d, 32, 4, "head_rows")
    ones = torch.ones(1, dtype=torch.int32)
    query = torch.zeros(1, 1, d, dtype=dtype)
    block_table = torch.ones(1, 1, dtype=torch.int32)
    rows = _native_rows(block_table, ones * 0, ones * 0, ones, ones)
    return cpu_ops.hsa_decode(query, kv, kt, layout, rows, ones, 4, 0.1, False)


def test_amx_layout_needs_head_size_multiple_of_32():
    # CPU_ATTN writes head size 80 in the vec16 layout, never in AMX tiles
    with pytest.raises(RuntimeError, match="AMX layout needs head_size"):
        _one_token_decode(80, torch.bfloat16, "cpu_amx")


def test_float64_is_refused_by_name():
    # the kernel is built for the dtypes vLLM serves in, not float64
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16, got Double"):
        _one_token_decode(64, torch.float64, "head_rows")


def _compressed_requests(k, v, kt, hkv, g, d, bs, ps, dtype, gen):
    """Three compressed requests of different lengths, budgets, top-k, top-r,
    with the K/V of their next 2 * ps + 1 tokens already stored. Returns the
    block table and the int32 columns (prompt lengths, num_compact,
    tail_start, num_select, topr)."""
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
    columns = (torch.tensor([p[i] for p in plans], dtype=torch.int32) for i in range(5))
    return torch.stack(rows).int(), *columns


def _check_against_batched(layout, dtype, hkv, g, d, bs, ps, force, kt_dtype, oracle=False):
    storage, block_elems = _cache(hkv, d, bs, ps, dtype, kt_dtype)
    kv, k, v, kt = _views(storage, block_elems, hkv, d, bs, ps, layout, kt_dtype)
    gen = torch.Generator().manual_seed(d + bs + ps)
    table, seq, num_compact, tail_start, num_select, topr = _compressed_requests(
        k, v, kt, hkv, g, d, bs, ps, dtype, gen
    )
    other = storage.clone()
    kv2, k2, v2, kt2 = _views(other, block_elems, hkv, d, bs, ps, layout, kt_dtype)
    if oracle:  # a third copy for the per-request oracle (it updates KT pages too)
        third = storage.clone()
        _, k3, v3, kt3 = _views(third, block_elems, hkv, d, bs, ps, layout, kt_dtype)
    for _ in range(2 * ps + 1):  # crosses page boundaries
        seq = seq + 1
        query = _query(len(seq), hkv, g, d, dtype, gen)
        max_pages = int(((num_compact + ps - 1) // ps + (seq - tail_start + ps - 1) // ps).max())
        view = torch_ops.view_pages(table, num_compact, tail_start, seq, ps, bs, max_pages)
        rows = DecodeRows(
            table, num_compact, tail_start, seq, topr, topr, max_pages, int(num_select.max())
        )  # (topk: not read by either path)
        want = torch_ops.hsa_decode(query, k, v, kt, rows, view, num_select, ps, d**-0.5, force)
        got = cpu_ops.hsa_decode(query, kv2, kt2, layout, rows, num_select, ps, d**-0.5, force)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        torch.testing.assert_close(kt2, kt, rtol=0, atol=0, equal_nan=True)
        if oracle:
            for b in range(len(seq)):
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


# ---- the selection store (``Stage2.decode``'s selections, ``DecodeRows.reuse``)

_EMPTY = -7  # never a page index: marks store entries no call wrote


class _Setup:
    """The three compressed requests in two copies of one cache: ``kv``/``kt``
    for the native calls under test, ``k_ref``/``v_ref``/``kt_ref`` for the
    PyTorch path (it updates its own KT pages)."""

    hkv, g, d, bs, ps = 3, 3, 64, 32, 4

    def __init__(self, layout, force, seed=11):
        self.layout, self.force = layout, force
        hkv, g, d, bs, ps = self.hkv, self.g, self.d, self.bs, self.ps
        storage, block_elems = _cache(hkv, d, bs, ps, torch.float32)
        self.kv, k, v, self.kt = _views(storage, block_elems, hkv, d, bs, ps, layout)
        # fp32 random data: no ties among page probabilities
        self.gen = torch.Generator().manual_seed(seed)
        (self.table, self.prompt, self.num_compact, self.tail_start, self.num_select, self.topr) = (
            _compressed_requests(k, v, self.kt, hkv, g, d, bs, ps, torch.float32, self.gen)
        )
        self.storage, self.block_elems = storage, block_elems
        _, self.k_ref, self.v_ref, self.kt_ref = self.copy()

    def copy(self):
        return _views(
            self.storage.clone(), self.block_elems, self.hkv, self.d, self.bs, self.ps, self.layout
        )

    def query(self):
        return _query(len(self.prompt), self.hkv, self.g, self.d, torch.float32, self.gen)

    def num_pages(self, seq):
        ps = self.ps
        return (self.num_compact + ps - 1) // ps + (seq - self.tail_start + ps - 1) // ps

    def selection_size(self, seq):
        """Each row's n: num_select (at least one) + the forced page, at most the view."""
        n = self.num_select.clamp_min(1) + int(self.force)
        return torch.minimum(n, self.num_pages(seq))

    def native(self, query, seq, kv=None, kt=None, **store):
        selections, slots = _split_store(store)
        return cpu_ops.hsa_decode(
            query,
            self.kv if kv is None else kv,
            self.kt if kt is None else kt,
            self.layout,
            _native_rows(self.table, self.num_compact, self.tail_start, seq, self.topr, **slots),
            self.num_select,
            self.ps,
            self.d**-0.5,
            self.force,
            selections=selections,
        )

    def torch_step(self, query, seq):
        """The PyTorch path's KT update and choice: (view pages, top, valid)."""
        view = torch_ops.view_pages(
            self.table,
            self.num_compact,
            self.tail_start,
            seq,
            self.ps,
            self.bs,
            int(self.num_pages(seq).max()),
        )
        torch_ops.update_kt(self.k_ref, self.kt_ref, self.table, seq, self.ps)
        top, valid = torch_ops.select_pages(
            query,
            self.kt_ref,
            view,
            self.topr,
            self.num_select,
            int(self.num_select.max()),
            self.force,
        )
        return view, top, valid

    def attend(self, query, view, top, valid):
        return torch_ops.sparse_attention(
            query, self.k_ref, self.v_ref, view, top, valid, self.ps, self.d**-0.5
        )


@pytest.mark.parametrize(
    "layout,force",
    [("head_rows", True), ("head_rows", False), ("cpu_vec", True), ("cpu_amx", False)],
)
def test_native_stage2_reuses_stored_selection(layout, force):
    t = _Setup(layout, force)
    _, _, _, kt_plain = plain = t.copy()  # today's calls, without a store
    batch, tol = len(t.prompt), dict(rtol=1e-5, atol=1e-5)
    sel_slot = torch.tensor([2, 0, 3], dtype=torch.int32)  # slot 1 stays unused
    store = torch.full((4, t.hkv, 11), _EMPTY, dtype=torch.int32)

    # Step 1: every row chooses and writes its choice to its slot.
    seq1 = t.prompt + 1
    n1 = t.selection_size(seq1)
    q1 = t.query()
    reuse = torch.zeros(batch, dtype=torch.int32)
    out1 = t.native(q1, seq1, selections=store, sel_slot=sel_slot, reuse=reuse)
    view1, top1, valid1 = t.torch_step(q1, seq1)
    torch.testing.assert_close(out1, t.native(q1, seq1, plain[0], kt_plain), rtol=0, atol=0)
    torch.testing.assert_close(out1, t.attend(q1, view1, top1, valid1), **tol)
    for b in range(batch):
        entries = store[sel_slot[b]]
        for h in range(t.hkv):
            chosen = set(top1[b, h][valid1[b, h]].tolist())
            assert set(entries[h, : n1[b]].tolist()) == chosen, f"row {b}, KV head {h}"
        assert (entries[:, n1[b] :] == _EMPTY).all()  # only the n entries are written
    assert (store[1] == _EMPTY).all()
    stored1 = store.clone()

    # Step 2: one more token, in the same page; rows 0 and 2 attend step 1's
    # pages, row 1 chooses afresh (and rewrites its slot).
    seq2 = seq1 + 1
    assert ((seq2 - 1) % t.ps != 0).all(), "the new token must not open a page"
    n2 = t.selection_size(seq2)
    assert torch.equal(n2, n1)
    q2 = t.query()
    reuse = torch.tensor([1, 0, 1], dtype=torch.int32)
    out2 = t.native(q2, seq2, selections=store, sel_slot=sel_slot, reuse=reuse)
    view2, top2, valid2 = t.torch_step(q2, seq2)
    # Reusing rows' KT pages are updated too.
    torch.testing.assert_close(t.kt, t.kt_ref, rtol=0, atol=0, equal_nan=True)
    width = int(n1.max())
    stored_top = stored1[sel_slot, :, :width].long().clamp_min(0)
    stored_valid = (torch.arange(width) < n1[:, None, None]).expand_as(stored_top)
    want_reused = t.attend(q2, view2, stored_top, stored_valid)
    want_plain = t.native(q2, seq2, plain[0], kt_plain)
    for b in range(batch):
        if reuse[b]:
            torch.testing.assert_close(out2[b], want_reused[b], **tol)
            assert torch.equal(store[sel_slot[b]], stored1[sel_slot[b]])
        else:
            torch.testing.assert_close(out2[b], want_plain[b], rtol=0, atol=0)
            for h in range(t.hkv):
                chosen = set(top2[b, h][valid2[b, h]].tolist())
                assert set(store[sel_slot[b], h, : n2[b]].tolist()) == chosen
    # The test means something only where step 2 would have chosen otherwise.
    assert any(
        set(stored1[sel_slot[b], h, : n1[b]].tolist()) != set(top2[b, h][valid2[b, h]].tolist())
        for b in range(batch)
        if reuse[b]
        for h in range(t.hkv)
    )


def test_native_stage2_idle_store_changes_nothing():
    t = _Setup("cpu_vec", True)
    _, _, _, kt_plain = plain = t.copy()
    store = torch.randint(-5, 5, (2, t.hkv, 11), generator=t.gen, dtype=torch.int32)
    before = store.clone()
    batch = len(t.prompt)
    for seq in (t.prompt + 1, t.prompt + 2):
        q = t.query()
        got = t.native(
            q,
            seq,
            selections=store,
            sel_slot=torch.full((batch,), -1, dtype=torch.int32),
            reuse=torch.zeros(batch, dtype=torch.int32),
        )
        torch.testing.assert_close(got, t.native(q, seq, plain[0], kt_plain), rtol=0, atol=0)
    torch.testing.assert_close(t.kt, kt_plain, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(store, before)


def test_native_stage2_padding_rows_leave_the_store_alone():
    # Rows 1 and 3 are padding (seq_len 0): one would write slot 0, the other
    # reuse slot 1, whose entries are no pages at all.
    t = _Setup("head_rows", False)
    _, _, _, kt_plain = plain = t.copy()
    seq = t.prompt + 1
    q = t.query()
    store = torch.full((2, t.hkv, 11), _EMPTY, dtype=torch.int32)
    real = torch.tensor([0, 2, 4])
    padded = torch.zeros(5, dtype=torch.int32)
    padded[real] = seq
    spread = lambda col: torch.zeros(5, dtype=col.dtype).index_copy(0, real, col)  # noqa: E731
    rows = _native_rows(
        torch.zeros(5, t.table.shape[1], dtype=t.table.dtype).index_copy(0, real, t.table),
        spread(t.num_compact),
        spread(t.tail_start),
        padded,
        spread(t.topr),
        sel_slot=torch.tensor([-1, 0, -1, 1, -1], dtype=torch.int32),
        reuse=torch.tensor([0, 0, 0, 1, 0], dtype=torch.int32),
    )
    got = cpu_ops.hsa_decode(
        torch.zeros(5, *q.shape[1:]).index_copy(0, real, q),
        t.kv,
        t.kt,
        t.layout,
        rows,
        spread(t.num_select),
        t.ps,
        t.d**-0.5,
        t.force,
        selections=store,
    )
    torch.testing.assert_close(got[real], t.native(q, seq, plain[0], kt_plain), rtol=0, atol=0)
    assert (store == _EMPTY).all()


def test_cpu_stage2_passes_the_store():
    """``CpuStage2.decode(..., selections=)`` hands the rows' slots and reuse
    flags to the kernel: the same outputs and store as the direct call."""
    from rocketkv_vllm.config import RocketKVSettings
    from rocketkv_vllm.ops.base import HsaRows

    t = _Setup("cpu_vec", True)
    settings = RocketKVSettings(
        page_size=t.ps, block_size=t.bs, head_dim=t.d, force_current_page=t.force
    )
    stage2 = cpu_ops.CpuStage2(settings, t.layout)
    kv_direct, _, _, kt_direct = t.copy()
    batch = len(t.prompt)
    store = torch.full((batch, t.hkv, 11), _EMPTY, dtype=torch.int32)
    direct = store.clone()

    def rows(seq, reuse, sel_slot):
        return HsaRows(
            tokens=torch.arange(batch),
            decode_rows=DecodeRows(
                block_table=t.table,
                num_compact=t.num_compact,
                tail_start=t.tail_start,
                seq_lens=seq,
                topk=t.num_select * t.ps,
                topr=t.topr,
                max_pages=int(t.num_pages(seq).max()),
                max_select=int(t.num_select.max()),
                sel_slot=sel_slot,
                reuse=torch.full((batch,), reuse, dtype=torch.int32),
            ),
            num_select=t.num_select,
        )

    slots = torch.arange(batch, dtype=torch.int32)
    for step, reuse in ((1, 0), (2, 1)):
        seq = t.prompt + step
        q = t.query()
        r = rows(seq, reuse, slots)
        got = stage2.decode(q, t.kv, r, t.d**-0.5, selections=store)
        slotted = dict(sel_slot=r.decode_rows.sel_slot, reuse=r.decode_rows.reuse)
        want = t.native(q, seq, kv_direct, kt_direct, selections=direct, **slotted)
        assert torch.equal(got, want) and torch.equal(store, direct)
    assert not torch.equal(got, stage2.decode(q, t.kv, r, t.d**-0.5))  # step 2 reused
    with pytest.raises(ValueError, match="sel_slot and reuse"):
        stage2.decode(q, t.kv, rows(seq, 0, None), t.d**-0.5, selections=store)


def _store_decode(t, impl, cache, query, seq, **store):
    """One decode step of ``impl`` ("native": the C++ kernel, "torch": the
    PyTorch path) on ``cache`` (a ``_Setup.copy()``)."""
    kv, k, v, kt = cache
    if impl == "native":
        return t.native(query, seq, kv, kt, **store)
    view = torch_ops.view_pages(
        t.table, t.num_compact, t.tail_start, seq, t.ps, t.bs, int(t.num_pages(seq).max())
    )
    selections, slots = _split_store(store)
    rows = DecodeRows(
        t.table, t.num_compact, t.tail_start, seq, t.topr, t.topr, 0, int(t.num_select.max()),
        **slots,
    )  # fmt: skip
    args = (rows, view, t.num_select, t.ps, t.d**-0.5, t.force)
    return torch_ops.hsa_decode(query, k, v, kt, *args, selections=selections)


@pytest.mark.parametrize(
    "impl,layout,force", [("native", "cpu_vec", True), ("torch", "head_rows", False)]
)
def test_stage2_store_entries_outside_the_view_reselect(impl, layout, force):
    """The store's invariant, checked where read: a (row, KV head) whose n
    stored entries are not all pages of its view (>= P, negative) does not
    reuse but chooses and stores anew -- output and store entries those of
    the same step without reuse, no raise -- while the other (row, head)s
    reuse their valid entries (attention over the stored pages, which
    differ from a reselect's somewhere)."""
    t = _Setup(layout, force, seed=5)
    batch, g = len(t.prompt), t.g
    reused, fresh = t.copy(), t.copy()  # the same caches, two runs
    slots = torch.tensor([2, 0, 1], dtype=torch.int32)
    no_reuse = torch.zeros(batch, dtype=torch.int32)
    store = torch.full((4, t.hkv, 11), _EMPTY, dtype=torch.int32)
    seq1, seq2 = t.prompt + 1, t.prompt + 2
    q1, q2 = t.query(), t.query()
    stores = [store.clone(), store.clone()]
    for cache, step1 in zip((reused, fresh), stores):  # step 1: every row chooses, stores
        _store_decode(t, impl, cache, q1, seq1, selections=step1, sel_slot=slots, reuse=no_reuse)
    stored1 = stores[0]
    assert torch.equal(stored1, stores[1]) and not (stored1 == _EMPTY).all()
    n, pages = t.selection_size(seq2), t.num_pages(seq2)
    assert torch.equal(n, t.selection_size(seq1)), "the token must not open a page"
    bad = stored1.clone()
    corrupt = {(0, 0): (0, pages[0]), (0, 2): (n[0] - 1, pages[0] + 5), (1, 1): (0, -1)}
    for (b, h), (i, page) in corrupt.items():
        bad[slots[b], h, i] = page
    # step 2: every row flagged to reuse
    got = _store_decode(
        t, impl, reused, q2, seq2, selections=bad, sel_slot=slots, reuse=no_reuse + 1
    )
    want_store = stored1.clone()
    want = _store_decode(
        t, impl, fresh, q2, seq2, selections=want_store, sel_slot=slots, reuse=no_reuse
    )
    _, k, v, _ = reused
    view = torch_ops.view_pages(
        t.table, t.num_compact, t.tail_start, seq2, t.ps, t.bs, int(pages.max())
    )
    width = int(n.max())
    top = stored1[slots, :, :width].long().clamp_min(0)
    valid = (torch.arange(width) < n[:, None, None]).expand_as(top)
    over_stored = torch_ops.sparse_attention(q2, k, v, view, top, valid, t.ps, t.d**-0.5)
    changed = 0
    for b in range(batch):
        for h in range(t.hkv):
            heads, entry = slice(h * g, (h + 1) * g), (slots[b], h)
            if (b, h) in corrupt:  # chose afresh, as without reuse
                assert torch.equal(got[b, heads], want[b, heads]), (b, h)
                assert torch.equal(bad[entry], want_store[entry]), (b, h)
            else:  # reused
                torch.testing.assert_close(
                    got[b, heads], over_stored[b, heads], rtol=1e-5, atol=1e-5
                )
                assert torch.equal(bad[entry], stored1[entry]), (b, h)
                mine = set(stored1[entry][: n[b]].tolist())
                changed += mine != set(want_store[entry][: n[b]].tolist())
    assert changed, "step 2 would choose step 1's pages anyway: reuse untested"


def _one_row_call(**store):
    """A one-row call on an empty cache: view of 2 pages, n = 1 (no forced page)."""
    storage, block_elems = _cache(1, 32, 32, 4, torch.float32)
    kv, _, _, kt = _views(storage, block_elems, 1, 32, 32, 4, "head_rows")
    ones = torch.ones(1, dtype=torch.int32)
    selections, slots = _split_store(store)
    table = torch.ones(1, 1, dtype=torch.int32)
    rows = _native_rows(table, ones * 0, ones * 0, ones * 5, ones, **slots)
    return cpu_ops.hsa_decode(
        torch.zeros(1, 1, 32), kv, kt, "head_rows", rows, ones, 4, 0.1, False, selections=selections
    )


def test_selection_store_needs_the_rows_slots():
    store = torch.zeros(1, 1, 4, dtype=torch.int32)
    slot = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="sel_slot and reuse"):
        _one_row_call(selections=store, sel_slot=slot)
    # without a store the rows' slots are not read: a plain call
    got = _one_row_call(sel_slot=slot, reuse=slot + 1)
    torch.testing.assert_close(got, _one_row_call(), rtol=0, atol=0, equal_nan=True)


_I32 = torch.int32


@pytest.mark.parametrize(
    "store,slot,reuse,message",
    [
        (torch.zeros(1, 1, 4, dtype=torch.int64), 0, 0, "contiguous int32 CPU tensor"),
        (torch.zeros(1, 1, 8, dtype=_I32)[..., ::2], 0, 0, "contiguous int32 CPU tensor"),
        (torch.zeros(1, 2, 4, dtype=_I32), 0, 0, r"must be \[S, 1, W\]"),
        (torch.zeros(1, 1, 4, dtype=_I32), 1, 0, "outside"),
    ],
)
def test_selection_store_is_checked(store, slot, reuse, message):
    with pytest.raises(RuntimeError, match=message):
        _one_row_call(
            selections=store,
            sel_slot=torch.tensor([slot], dtype=_I32),
            reuse=torch.tensor([reuse], dtype=_I32),
        )


@pytest.mark.parametrize(
    "store,slot",
    [
        (torch.zeros(1, 1, 4, dtype=_I32), -1),  # reuse without a slot
        (torch.zeros(1, 1, 0, dtype=_I32), 0),  # n = 1 page, more than the store holds
        (torch.full((1, 1, 4), 2, dtype=_I32), 0),  # page 2 of a view of 2 pages
    ],
)
def test_selection_store_that_cannot_serve_reselects(store, slot):
    """Per-request data, not a caller bug: no raise, the row chooses anew."""
    got = _one_row_call(
        selections=store, sel_slot=torch.tensor([slot], dtype=_I32), reuse=torch.ones(1, dtype=_I32)
    )
    torch.testing.assert_close(got, _one_row_call(), rtol=0, atol=0, equal_nan=True)
    if slot >= 0 and store.shape[-1]:
        assert store[0, 0, 0] in (0, 1)  # its choice stored


def test_selection_rows_are_checked():
    with pytest.raises(RuntimeError, match="sel_slot and reuse must be contiguous int32"):
        _one_row_call(
            selections=torch.zeros(1, 1, 4, dtype=_I32),
            sel_slot=torch.tensor([0], dtype=torch.int64),
            reuse=torch.tensor([0], dtype=_I32),
        )
