"""Triton launches as a GPU runs them: any program order, programs side by side.

Triton's interpreter runs a launch's programs one after the other in grid
order (x, then y, then z, ascending): the split with the highest index is
always the last to arrive at a merge counter, and every program sees all the
writes of the programs before it. On a GPU any program may run first or
last, or beside any other. Code that leans on the interpreter's order passes
the other kernel tests and is wrong on CUDA, so each launch here runs

* with its programs in ascending, reversed and shuffled order along each
  grid dimension (``program_order``), and must give the ascending run's
  bytes: outputs, KT pages, compacted K/V, the selection store, selections,
  with the merge counters back at 0;
* under a race check (``race_check``): every load, store, atomic and
  barrier of each program is recorded. Two accesses to one byte in a launch,
  one of them a write, must be ordered as a GPU orders them: in one program
  by a barrier between them (the interpreter does not model a program's
  threads, so any two may be different threads); across programs by a
  barrier and a release atomic after the first access, then an acquire
  atomic on the same address before the second (the "last to arrive merges"
  counters).

Interpreter only: on CUDA the hardware picks the order.
"""

from __future__ import annotations

import builtins
import contextlib
import inspect
import os
import random
import sys
from dataclasses import dataclass, field
from unittest import mock

import numpy as np
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

from rocketkv_vllm.kernels import hsa_score, page_select  # noqa: E402
from rocketkv_vllm.ops import triton as triton_ops  # noqa: E402
from rocketkv_vllm.ops.triton import TritonStage1  # noqa: E402

ORDERS = ("ascending", "reversed", "shuffled")
DIRTY_F32 = dict(ascending=0.0, reversed=float("nan"), shuffled=-3.0e38)
DIRTY_I32 = dict(ascending=0, reversed=-1, shuffled=(1 << 31) - 1)


# --------------------------------------------------------------------------
# Program order


@contextlib.contextmanager
def program_order(order: str, seed: int = 0):
    """Interpreted launches run their programs in ``order`` along each grid
    dimension. The interpreter's grid loop iterates ``range(grid[i])``; only
    calls made from that loop get the reordered indices. Yields the list of
    grid dimensions reordered, so a caller can tell the patch took effect."""
    grid_loop = inspect.unwrap(interpreter.GridExecutor.__call__).__code__
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


# --------------------------------------------------------------------------
# Race check


@dataclass
class Access:
    time: int
    program: tuple[int, int, int]
    write: bool
    addresses: np.ndarray  # bytes touched (int64, unique)


@dataclass
class Launch:
    kernel: str
    time: int = 0
    accesses: list[Access] = field(default_factory=list)
    # program -> [(time, byte address, release, acquire)]
    atomics: dict = field(default_factory=dict)
    barriers: dict = field(default_factory=dict)  # program -> [time of each barrier]

    def _barrier_between(self, program, t0: int, t1: int) -> bool:
        return any(t0 < t < t1 for t in self.barriers.get(program, ()))

    def ordered(self, first: Access, then: Access) -> bool:
        """``first`` happens before ``then`` on a GPU. In one program: a
        barrier between them (its threads may hold different elements). Across
        programs: a barrier after ``first`` (so its program's other threads'
        accesses are done), then a release atomic by that program, then an
        acquire atomic by then's program on the same address before ``then``
        (its threads learn the result through the barrier Triton puts after a
        scalar atomic whose value is used: checked in its PTX, 3.6 and 3.9;
        the barrier before the release is the kernel's own in 3.6)."""
        if first.program == then.program:
            return self._barrier_between(first.program, first.time, then.time)
        for t_rel, addr, release, _ in self.atomics.get(first.program, ()):
            if not (release and self._barrier_between(first.program, first.time, t_rel)):
                continue
            for t_acq, addr2, _, acquire in self.atomics.get(then.program, ()):
                if acquire and addr2 == addr and t_rel < t_acq < then.time:
                    return True
        return False

    def races(self, limit: int = 5) -> list[tuple[int, Access, Access]]:
        """Unordered pairs of accesses to one byte, one of them a write:
        (byte address, earlier access, later access)."""
        if not any(a.write for a in self.accesses):
            return []
        written = np.unique(np.concatenate([a.addresses for a in self.accesses if a.write]))
        owner = np.concatenate([np.full(a.addresses.size, i) for i, a in enumerate(self.accesses)])
        addrs = np.concatenate([a.addresses for a in self.accesses])
        keep = np.isin(addrs, written)
        addrs, owner = addrs[keep], owner[keep]
        order = np.lexsort((owner, addrs))
        addrs, owner = addrs[order], owner[order]
        starts = np.flatnonzero(np.r_[True, addrs[1:] != addrs[:-1]])
        groups: dict[tuple[int, ...], int] = {}  # accesses sharing a byte -> one such byte
        for start, ids in zip(starts, np.split(owner, starts[1:])):
            groups.setdefault(tuple(ids.tolist()), int(addrs[start]))
        found, checked = [], set()
        for ids, addr in groups.items():
            for x in ids:
                for y in ids:
                    a, b = self.accesses[x], self.accesses[y]
                    if a.time >= b.time or not (a.write or b.write):
                        continue
                    if (x, y) in checked:
                        continue
                    checked.add((x, y))
                    if not self.ordered(a, b):
                        found.append((addr, a, b))
                        if len(found) >= limit:
                            return found
        return found


def _bytes_touched(ptrs, mask, width: int) -> np.ndarray:
    addrs = np.asarray(ptrs.data).reshape(-1).astype(np.int64)
    if mask is not None:
        on = np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data))
        addrs = addrs[on.reshape(-1)]
    return np.unique((addrs[:, None] + np.arange(width, dtype=np.int64)[None, :]).reshape(-1))


def _width(ptrs) -> int:
    return max(ptrs.get_element_ty().primitive_bitwidth // 8, 1)


@contextlib.contextmanager
def race_check():
    """Records every interpreted launch's loads, stores and atomics per
    program; yields the list of ``Launch``es, filled as they end."""
    builder = interpreter.interpreter_builder
    sem = type(next(iter(builder.ir_sem_to_interpreter_sem)))
    releases = {sem.RELEASE, sem.ACQUIRE_RELEASE}
    acquires = {sem.ACQUIRE, sem.ACQUIRE_RELEASE}
    launches: list[Launch] = []
    running: list[Launch] = []
    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas
    grid_call = interpreter.GridExecutor.__call__

    def access(ptrs, mask, write):
        if running:
            launch = running[-1]
            launch.time += 1
            addrs = _bytes_touched(ptrs, mask, _width(ptrs))
            if addrs.size:
                launch.accesses.append(Access(launch.time, builder.grid_idx, write, addrs))

    def atomic(ptrs, mask, s):
        if running:
            launch = running[-1]
            launch.time += 1
            for addr in _bytes_touched(ptrs, mask, 1).tolist():
                launch.atomics.setdefault(builder.grid_idx, []).append(
                    (launch.time, addr, s in releases, s in acquires)
                )

    def barrier():
        if running:
            launch = running[-1]
            launch.time += 1
            launch.barriers.setdefault(builder.grid_idx, []).append(launch.time)

    # (the cache arguments after the mask differ between Triton versions)
    def masked_load(ptrs, mask, *rest):
        access(ptrs, mask, False)
        return load(ptrs, mask, *rest)

    def masked_store(ptrs, value, mask, *rest):
        access(ptrs, mask, True)
        return store(ptrs, value, mask, *rest)

    def atomic_rmw(op, ptr, val, mask, s, scope):
        atomic(ptr, mask, s)
        return rmw(op, ptr, val, mask, s, scope)

    def atomic_cas(ptr, cmp, val, s, scope):
        atomic(ptr, None, s)
        return cas(ptr, cmp, val, s, scope)

    def call(self, *args, **kwargs):
        running.append(Launch(getattr(self.fn, "__name__", repr(self.fn))))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.append(running.pop())

    with (
        mock.patch.multiple(
            builder,
            create_masked_load=masked_load,
            create_masked_store=masked_store,
            create_atomic_rmw=atomic_rmw,
            create_atomic_cas=atomic_cas,
            create_barrier=barrier,
        ),
        mock.patch.object(interpreter.GridExecutor, "__call__", call),
    ):
        yield launches


def _where(addr: int, tensors: dict[str, torch.Tensor]) -> str:
    for name, t in tensors.items():
        start = t.untyped_storage().data_ptr()
        if start <= addr < start + t.untyped_storage().nbytes():
            return f"{name} byte {addr - start}"
    return hex(addr)


def assert_no_race(launches: list[Launch], tensors: dict[str, torch.Tensor], context: str):
    assert launches, f"{context}: no interpreted launch was recorded"
    for launch in launches:
        found = launch.races()
        if found:
            pytest.fail(
                f"{context}: {launch.kernel} races:\n"
                + "\n".join(
                    f"  {_where(addr, tensors)}: program {a.program} "
                    f"{'writes' if a.write else 'reads'}, then program {b.program} "
                    f"{'writes' if b.write else 'reads'}, unordered"
                    for addr, a, b in found
                ),
                pytrace=False,
            )


@contextlib.contextmanager
def as_on_a_gpu(order: str, tensors: dict[str, torch.Tensor], seed: int = 0):
    """Programs in ``order`` and the race check over every launch inside."""
    with program_order(order, seed) as reordered, race_check() as launches:
        yield
    assert reordered, "the interpreter's grid loop was not reached"
    assert_no_race(launches, tensors, order)


def _same_bytes(name, got, want):
    g, w = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    assert torch.equal(g, w), (
        f"{name} differs from the ascending order's at {(g != w).nonzero()[:4].tolist()}"
    )


# --------------------------------------------------------------------------
# The two aids themselves


@triton.jit
def _arrival_kernel(counter_ptr, arrival_ptr):
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(arrival_ptr + pid, tl.atomic_add(counter_ptr, 1))


@pytest.mark.parametrize("order", ORDERS)
def test_program_order_changes_the_order_programs_arrive_in(order):
    """Programs take a ticket from a counter as they run."""
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


@triton.jit
def _merge_kernel(part_ptr, count_ptr, out_ptr, N: tl.constexpr, MODE: tl.constexpr):
    """Each program writes its part, then MODE 0: a barrier and the last to
    arrive at an acq_rel counter sums the parts; 1: the last by index sums
    them; 2: every program adds its part to out (read-modify-write); 3: as 0
    without the barrier; 4: as 0 with a relaxed counter."""
    pid = tl.program_id(0)
    tl.store(part_ptr + pid, pid + 1.0)
    if MODE == 1:
        if pid == N - 1:
            tl.store(out_ptr, tl.sum(tl.load(part_ptr + tl.arange(0, N))))
    elif MODE == 2:
        tl.store(out_ptr, tl.load(out_ptr) + pid + 1.0)
    else:
        if MODE != 3:
            tl.debug_barrier()
        if MODE == 4:
            done = tl.atomic_add(count_ptr, 1, sem="relaxed")
        else:
            done = tl.atomic_add(count_ptr, 1, sem="acq_rel")
        if done == N - 1:
            tl.store(out_ptr, tl.sum(tl.load(part_ptr + tl.arange(0, N))))


@triton.jit
def _reverse_kernel(buf_ptr, out_ptr, N: tl.constexpr, BARRIER: tl.constexpr):
    """One program writes a block and reads it back reversed: other threads'
    elements, so only a barrier between orders them."""
    i = tl.arange(0, N)
    tl.store(buf_ptr + i, i.to(tl.float32))
    if BARRIER:
        tl.debug_barrier()
    tl.store(out_ptr + i, tl.load(buf_ptr + N - 1 - i))


@pytest.mark.parametrize("mode,racy", [(0, False), (1, True), (2, True), (3, True), (4, True)])
def test_race_check_tells_a_synchronised_merge_from_racy_ones(mode, racy):
    parts = torch.zeros(8)
    out = torch.zeros(1)
    with race_check() as launches:
        _merge_kernel[(8,)](parts, torch.zeros(1, dtype=torch.int32), out, N=8, MODE=mode)
    assert float(out) == 36.0  # the interpreter's order gets it right every time
    found = launches[0].races()
    assert bool(found) == racy, found


@pytest.mark.parametrize("barrier", [True, False])
def test_race_check_needs_a_barrier_inside_a_program(barrier):
    out = torch.zeros(16)
    with race_check() as launches:
        _reverse_kernel[(1,)](torch.zeros(16), out, N=16, BARRIER=barrier)
    assert out.tolist() == list(range(16))[::-1]
    assert bool(launches[0].races()) != barrier


# --------------------------------------------------------------------------
# Stage 2: the three decode launches, with many splits and a selection store


# A row of 1,231 view pages scored by one split (1 SM): more than the
# selection's SELECT_SUB_PAGES, so its probabilities go through the scratch
# and are read back (a LONG plan).
LONG_ROWS = dict(
    specs=[(600, 640, 2500), (0, 0, 0), (13, 32, 33)], topk_pages=(40, 1, 3), topr=(32, 16, 7)
)


# Each many-split case against one other order: reversed for one, shuffled
# for the other. 8 and 16 SMs give 4 and 7 scoring splits a row (and as many
# decode splits merging), enough for every merge path; more SMs only add
# interpreted programs.
@pytest.mark.parametrize(
    "hkv,g,d,bs,ps,dtype,force,layout,kt_dtype,n_sms,sinks,rows,orders",
    [
        (2, 4, 64, 16, 4, tk.BF16, True, "token", tk.FP8, 8, True, {}, ("reversed",)),
        (2, 2, 32, 16, 2, tk.F32, False, "cpu_vec", tk.AUTO, 16, False, {}, ("shuffled",)),
        (2, 2, 32, 16, 2, tk.F32, True, "head_rows", tk.AUTO, 1, False, LONG_ROWS, ORDERS[1:]),
    ],
    ids=["many-splits-bf16", "many-splits-f32", "long-row"],
)
def test_hsa_decode_as_on_a_gpu(
    hkv, g, d, bs, ps, dtype, force, layout, kt_dtype, n_sms, sinks, rows, orders
):
    """Two steps over the same batch: one where every slotted row selects and
    stores its pages, one where half of them reuse the store; many splits
    per row (SMs mocked up), so every launch merges through its counters,
    or one split holding a row longer than the selection's block. Each
    order starts from other leftovers in the workspace's scratch (the
    counters excepted: zeroed once, kept at 0 by the launches), so a read of
    scratch no program of the step wrote changes the bytes."""
    c0, q, args, max_pages, max_select = tdl._batch(
        hkv, g, d, bs, ps, dtype, layout=layout, kt_dtype=kt_dtype, seed=3, **rows
    )
    if rows:
        plan = hsa_score.plan_score(q.shape[0], hkv, max_pages, max_select, force, n_sms)
        assert plan.long and plan.splits == 1
    batch = q.shape[0]
    sink = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(4)) if sinks else None
    slots = torch.arange(batch, dtype=torch.int32)

    def run(order):
        c = c0.clone()
        store = torch.full((batch + 1, hkv, max_select + 2), -1, dtype=torch.int32)
        outs = [torch.full_like(q, 7.0) for _ in range(2)]
        with tdl.sms(n_sms):
            ws = tdl._workspace(q, hkv, max_pages, max_select, force)
            # scratch as a GPU leaves it: each order its own leftovers
            ws.f32.fill_(DIRTY_F32[order])
            ws.i32.fill_(DIRTY_I32[order])
            tensors = dict(cache=c.storage, store=store, out0=outs[0], out1=outs[1])
            tensors.update({f"workspace.{k}": v for k, v in vars(ws).items() if torch.is_tensor(v)})
            with as_on_a_gpu(order, tensors, seed=n_sms):
                for out, reuse in zip(outs, (torch.zeros_like(slots), slots % 2)):
                    slotted = dict(sel_slot=slots, reuse=reuse.to(torch.int32))
                    triton_ops.hsa_decode(
                        q,
                        c.k,
                        c.v,
                        c.kt,
                        *tdl._decode_args(args, max_pages, max_select, **slotted),
                        force,
                        out=out,
                        sinks=sink,
                        workspace=ws,
                        selections=store,
                    )
                    assert bool((ws.counters == 0).all()), f"{order}: a merge counter was left set"
        return outs, c, store

    want_outs, want_cache, want_store = run("ascending")
    assert bool((want_store >= 0).any())  # the selecting step stored pages
    for order in orders:
        outs, cache, store = run(order)
        for step, (got, want) in enumerate(zip(outs, want_outs)):
            _same_bytes(f"{order}: step {step} output", got, want)
        _same_bytes(f"{order}: selection store", store, want_store)
        tk._same_storage(cache, want_cache)


def test_page_selection_merge_as_on_a_gpu():
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
        with tdl.sms(64), as_on_a_gpu(order, dict(probs=probs), seed=1):
            plan = hsa_score.plan_score(len(specs), hkv, max_pages, 64, False, 64)
            assert plan.merge_block > hsa_score.MERGE_SMALL_BLOCK and plan.splits > 8
            return page_select.select_pages(probs, 64, *rows, topk, ps, "triton")

    want = run("ascending")
    for order in ORDERS[1:]:
        got = run(order)
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
def test_stage1_compress_as_on_a_gpu(n, hkv, g, d, bs, ps, dtype, budget, layout, kt_dtype):
    gen = torch.Generator().manual_seed(n)
    c0 = tk.Cache(n // bs + 4, hkv, d, bs, ps, dtype, layout, kt_dtype=kt_dtype)
    row = c0.new_row(-(-n // bs))
    c0.fill(row, 0, n, gen)
    q = torch.randn(16, hkv * g, d, generator=gen).to(dtype)

    def run(order):
        c = c0.clone()
        with as_on_a_gpu(order, dict(cache=c.storage), seed=n):
            kept = TritonStage1().compress(
                c.k, c.v, c.kt, row, q, n, budget, n // bs * bs, 7, ps, d**-0.5
            )
        return kept, c

    want_kept, want_cache = run("ascending")
    for order in ORDERS[1:]:
        kept, cache = run(order)
        _same_bytes(f"{order}: kept positions", kept, want_kept)
        tk._same_storage(cache, want_cache)
