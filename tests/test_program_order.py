"""Every Triton launch gives the same bytes whatever order its programs run in.

Triton's interpreter runs a launch's programs one after the other in grid
order (x, then y, then z, ascending), so the split with the highest index is
always the last to arrive at a merge counter and every program sees the
writes of the programs before it. On a GPU any program may run first or
last, or beside any other. Code that leaned on the interpreter's order (a
merge done by "the last split" instead of the last to arrive, a program
reading what a lower-numbered program of the same launch wrote) passes the
other kernel tests here and is wrong on CUDA. These tests run the launches
with their programs reversed and shuffled along each grid dimension and
require the bytes of the ascending run: outputs, KT pages, compacted K/V,
the selection store, and merge counters back at 0.

Interpreter only: on CUDA the hardware picks the order.
"""

from __future__ import annotations

import builtins
import contextlib
import os
import random
import sys
from unittest import mock

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("program order is the interpreter's to change", allow_module_level=True)
os.environ.setdefault("TRITON_INTERPRET", "1")

import test_decode_launches as tdl  # noqa: E402  (decode batches, the SM mock-up)
import test_kernels as tk  # noqa: E402  (caches, rows, storage comparison)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from rocketkv_vllm.kernels import hsa_score  # noqa: E402
from rocketkv_vllm.ops import triton as triton_ops  # noqa: E402
from rocketkv_vllm.ops.triton import TritonStage1  # noqa: E402

ORDERS = ("reversed", "shuffled")


@contextlib.contextmanager
def program_order(order: str, seed: int = 0):
    """Interpreted launches run their programs in ``order`` ("ascending",
    "reversed" or "shuffled") along each grid dimension. The interpreter's
    grid loop iterates ``range(grid[i])``; only calls made from that loop
    get the reordered indices. Yields the list of grid dimensions
    reordered, so a caller can tell the patch took effect."""
    grid_loop = interpreter.GridExecutor.__call__.__code__
    gen = random.Random(seed)
    reordered: list[int] = []

    def ordered_range(*args):
        indices = builtins.range(*args)  # the kernels' own globals may be patched
        if sys._getframe(1).f_code is not grid_loop:
            return indices
        indices = list(indices)
        reordered.append(len(indices))
        if order == "reversed":
            indices.reverse()
        elif order == "shuffled":
            gen.shuffle(indices)
        return indices

    with mock.patch.object(interpreter, "range", ordered_range, create=True):
        yield reordered


@triton.jit
def _arrival_kernel(counter_ptr, arrival_ptr):
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(arrival_ptr + pid, tl.atomic_add(counter_ptr, 1))


@pytest.mark.parametrize("order", ("ascending", *ORDERS))
def test_program_order_changes_the_order_programs_arrive_in(order):
    """The helper itself: programs take a ticket from a counter as they run."""
    counter = torch.zeros(1, dtype=torch.int32)
    arrival = torch.full((24,), -1, dtype=torch.int32)
    with program_order(order) as reordered:
        _arrival_kernel[(4, 6)](counter, arrival)
    assert reordered, "the interpreter's grid loop was not reached"
    tickets = arrival.tolist()
    assert sorted(tickets) == list(range(24))
    if order == "ascending":
        assert tickets == list(range(24))
    elif order == "reversed":
        assert tickets == list(range(24))[::-1]
    else:
        assert tickets != list(range(24)) and tickets != list(range(24))[::-1]


def _same_bytes(name, got, want):
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
        f"{name} differs from the ascending order's at "
        f"{(got.view(torch.uint8) != want.view(torch.uint8)).nonzero()[:4].tolist()}"
    )


# --------------------------------------------------------------------------
# Stage 2: the three decode launches, with many splits and a selection store


@pytest.mark.parametrize(
    "hkv,g,d,bs,ps,dtype,force,layout,kt_dtype,n_sms,sinks",
    [
        (2, 4, 64, 16, 4, tk.BF16, True, "token", tk.FP8, 32, True),
        (2, 2, 32, 16, 2, tk.F32, False, "cpu_vec", tk.AUTO, 64, False),
    ],
)
def test_hsa_decode_does_not_depend_on_program_order(
    hkv, g, d, bs, ps, dtype, force, layout, kt_dtype, n_sms, sinks
):
    """Two steps over the same batch: one where every slotted row selects and
    stores its pages, one where half of them reuse the store; many splits
    per row (SMs mocked up), so every launch merges through its counters."""
    c0, q, args, max_pages, max_select = tdl._batch(
        hkv, g, d, bs, ps, dtype, layout=layout, kt_dtype=kt_dtype, seed=3
    )
    batch = q.shape[0]
    sink = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(4)) if sinks else None
    slots = torch.arange(batch, dtype=torch.int32)

    def run(order):
        c = c0.clone()
        store = torch.full((batch + 1, hkv, max_select + 2), -1, dtype=torch.int32)
        outs = []
        with tdl.sms(n_sms), program_order(order, seed=n_sms) as reordered:
            ws = tdl._workspace(q, hkv, max_pages, max_select, force)
            for reuse in (torch.zeros_like(slots), (slots % 2).to(torch.int32)):
                out = torch.full_like(q, 7.0)
                triton_ops.hsa_decode(
                    q,
                    c.k,
                    c.v,
                    c.kt,
                    *args,
                    max_pages,
                    max_select,
                    force,
                    out=out,
                    sinks=sink,
                    workspace=ws,
                    selections=store,
                    sel_slot=slots,
                    reuse=reuse,
                )
                assert bool((ws.counters == 0).all()), f"{order}: a merge counter was left set"
                outs.append(out)
        assert reordered
        return outs, c, store

    want_outs, want_cache, want_store = run("ascending")
    assert bool((want_store >= 0).any())  # the selecting step stored pages
    for order in ORDERS:
        outs, cache, store = run(order)
        for step, (got, want) in enumerate(zip(outs, want_outs)):
            _same_bytes(f"{order}: step {step} output", got, want)
        _same_bytes(f"{order}: selection store", store, want_store)
        tk._same_storage(cache, want_cache)


@pytest.mark.parametrize("order", ORDERS)
def test_page_selection_merge_does_not_depend_on_program_order(order):
    """Rows long enough for the large merge block (candidates read in chunks)
    beside short rows and an empty one, with plateaus of ties across
    splits."""
    gen = torch.Generator().manual_seed(5)
    ps, hkv, max_pages = 4, 2, 1100
    num_pages = [1030, 12, 0, 120]
    probs = torch.full((len(num_pages), hkv, max_pages), -1.0)
    levels = torch.tensor([0.0, 1e-3, 0.25, 0.5, 2.0])
    for b, n in enumerate(num_pages):
        probs[b, :, :n] = levels[torch.randint(0, 5, (hkv, n), generator=gen)]
        probs[b, 0, :n] = torch.rand(n, generator=gen)
    specs = [(n * ps, n * ps, n * ps) for n in num_pages]
    rows = [tk._ints([s[i] for s in specs]) for i in range(3)]
    topk = tk._ints([60 * ps, 5 * ps, ps, 64 * ps])

    def run(order):
        with tdl.sms(64), program_order(order, seed=1) as reordered:
            plan = hsa_score.plan_score(len(specs), hkv, max_pages, 64, False, 64)
            assert plan.merge_block > hsa_score.MERGE_SMALL_BLOCK and plan.splits > 8
            sel = hsa_score.select_pages(probs, 64, *rows, topk, ps, "triton")
        assert reordered
        return sel

    want, got = run("ascending"), run(order)
    for b, n in enumerate(num_pages):  # entries past a row's n_use are not written
        n_use = min(max(int(topk[b]) // ps, 1), n, 64)
        _same_bytes(f"{order}: row {b}'s selection", got[b, :, :n_use], want[b, :, :n_use])


# --------------------------------------------------------------------------
# Stage 1: scores, in-place compaction, KT pages of one prompt


@pytest.mark.parametrize(
    "n,hkv,g,d,bs,ps,dtype,budget,layout,kt_dtype",
    [
        (330, 2, 3, 64, 16, 4, tk.F32, 100, "cpu_vec", tk.AUTO),
        (260, 2, 2, 128, 32, 8, tk.BF16, 120, "split", tk.FP8),
    ],
)
def test_stage1_compress_does_not_depend_on_program_order(
    n, hkv, g, d, bs, ps, dtype, budget, layout, kt_dtype
):
    gen = torch.Generator().manual_seed(n)
    c0 = tk.Cache(n // bs + 4, hkv, d, bs, ps, dtype, layout, kt_dtype=kt_dtype)
    row = c0.new_row(-(-n // bs))
    c0.fill(row, 0, n, gen)
    q = torch.randn(16, hkv * g, d, generator=gen).to(dtype)

    def run(order):
        c = c0.clone()
        with program_order(order, seed=n) as reordered:
            kept = TritonStage1().compress(
                c.k, c.v, c.kt, row, q, n, budget, n // bs * bs, 7, ps, d**-0.5
            )
        assert reordered
        return kept, c

    want_kept, want_cache = run("ascending")
    for order in ORDERS:
        kept, cache = run(order)
        _same_bytes(f"{order}: kept positions", kept, want_kept)
        tk._same_storage(cache, want_cache)
