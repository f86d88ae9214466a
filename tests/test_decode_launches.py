"""Stage 2 decode built for latency (issue 38): CPU-checkable proxies.

* launches: one decode layer (``ops.triton.hsa_decode``) starts at most
  ``MAX_LAUNCHES`` Triton kernels and no torch op that would run a GPU
  kernel (counted through Triton's launch entry point,
  ``KernelInterface.__getitem__``, and a ``TorchDispatchMode``);
* allocation: with a ``DecodeWorkspace`` and a given ``out`` the call
  allocates no tensor (torch's factories raise during it);
* grids: ``decode_launches`` / ``plan_decode`` report each launch's grid,
  the grids are the ones launched, and at batch 1 on a 132-SM GPU (H100 /
  H200) the scoring, selection and attention launches of a Llama-3.1-8B
  layer (Hq 32, Hkv 8, d 128) with the ``trtllm`` preset have >= 132
  programs with work at 8k / 32k / 128k contexts;
* correctness where the split machinery is exercised (many splits: the SM
  count mocked up), against the per-request oracle, and the counters of the
  last-arriving merges are back to 0 after every call (CUDA-graph replays).

The kernels run in Triton's interpreter without a GPU.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import test_kernels as tk  # noqa: E402  (the kernel tests' cache and oracle helpers)
from reference import paged  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.jit import KernelInterface  # noqa: E402

from rocketkv_vllm.kernels import hsa_score, page_select, sparse_decode  # noqa: E402
from rocketkv_vllm.ops import triton as triton_ops  # noqa: E402

MAX_LAUNCHES = 3
H200_SMS = 132
DEVICE = tk.DEVICE


# --------------------------------------------------------------------------
# Recording launches and torch ops


class _Recorder(TorchDispatchMode):
    """Triton launches (kernel name, grid) and the torch ops issued outside
    them (the interpreter's own argument copies inside a launch are not the
    caller's)."""

    def __init__(self):
        super().__init__()
        self.launches: list[tuple[str, tuple]] = []
        self.ops: list = []
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.ops.append(func)
        return func(*args, **(kwargs or {}))

    def kernel_ops(self) -> list[str]:
        """The recorded torch ops that are not views (a GPU kernel each)."""
        return [str(f) for f in self.ops if not getattr(f, "is_view", False)]


@contextlib.contextmanager
def recording():
    rec = _Recorder()
    launch_of = KernelInterface.__getitem__

    def getitem(self, grid):
        launch = launch_of(self, grid)
        name = getattr(getattr(self, "fn", self), "__name__", repr(self))

        def run(*args, **kwargs):
            rec.launches.append((name, tuple(grid)))
            rec.inside += 1
            try:
                return launch(*args, **kwargs)
            finally:
                rec.inside -= 1

        return run

    with mock.patch.object(KernelInterface, "__getitem__", getitem), rec:
        yield rec


@contextlib.contextmanager
def sms(n: int):
    """The SM count the launchers plan for (the interpreter's default is 2)."""
    with (
        mock.patch.object(hsa_score, "num_sms", lambda device: n),
        mock.patch.object(page_select, "num_sms", lambda device: n),
        mock.patch.object(sparse_decode, "num_sms", lambda device: n),
    ):
        yield


_FACTORIES = (
    "empty",
    "empty_like",
    "empty_strided",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "full",
    "full_like",
    "arange",
    "tensor",
    "as_tensor",
)


@contextlib.contextmanager
def no_allocation(rec: _Recorder | None = None):
    """torch's tensor factories raise (outside Triton's own launch code)."""

    def refuse(name, real):
        def factory(*args, **kwargs):
            if rec is not None and rec.inside:
                return real(*args, **kwargs)
            raise AssertionError(f"torch.{name} called during a decode step")

        return factory

    with contextlib.ExitStack() as stack:
        for name in _FACTORIES:
            stack.enter_context(mock.patch.object(torch, name, refuse(name, getattr(torch, name))))
        yield


# --------------------------------------------------------------------------
# A decode batch (the kernel tests' padded caches, NaN outside the views)


SPECS = [(37, 96, 150), (64, 64, 70), (0, 0, 0), (13, 32, 33), (40, 128, 140)]


def _batch(
    hkv,
    g,
    d,
    bs,
    ps,
    dtype,
    layout="token",
    kt_dtype=tk.AUTO,
    seed=0,
    force=False,
    specs=SPECS,
    topk_pages=(4, 2, 1, 100, 3),
    topr=None,
):
    """(cache, clean copy for the oracle, query, hsa_decode args after the
    caches, max_pages, max_select): each row's new token stored. Rows:
    ``specs`` (num_compact, tail_start, seq_len), each selecting
    ``topk_pages`` pages with ``topr`` channels (default d, 16, 16, 7, d/2)."""
    c, rows = tk._decode_batch(
        hkv, d, bs, ps, dtype, specs, seed=seed, poison=False, layout=layout, kt_dtype=kt_dtype
    )
    gen = torch.Generator().manual_seed(seed + 1)
    seqs = [s[2] + 1 if s[2] else 0 for s in specs]
    for b, (_nc, _ts, seq) in enumerate(specs):
        if seq:
            c.fill(rows[b], seq, seq + 1, gen)
    topk = [k * ps for k in topk_pages]
    topr = list(topr or [d, 16, 16, 7, d // 2])
    q = tk._queries_without_channel_ties(len(specs), hkv, g, d, dtype, topr, gen)
    args = (
        tk._table(rows),
        *(tk._ints([s[i] for s in specs]) for i in (0, 1)),
        tk._ints(seqs),
        tk._ints(topk),
        tk._ints(topr),
        ps,
        d**-0.5,
    )
    # a FULL graph's: far above every row's
    max_pages = max(40 * 64 // ps, 2 * max(s[2] for s in specs) // ps)
    max_select = max(max(k // ps, 1) for k in topk)
    return c, q, args, max_pages, max_select


def _decode_args(args, max_pages, max_select, **slots):
    """``hsa_decode``'s (rows, page_size, scale) from ``_batch``'s args."""
    return (triton_ops.DecodeRows(*args[:6], max_pages, max_select, **slots), *args[6:])


def _workspace(q, hkv, max_pages, max_select, force, rows=None):
    return triton_ops.DecodeWorkspace(
        q.device,
        rows or q.shape[0],
        q.shape[1],
        hkv,
        q.shape[2],
        max_pages,
        max_select,
        force,
    )


# --------------------------------------------------------------------------
# Launch count and allocation


@pytest.mark.parametrize(
    "ps,dtype,force,kt_dtype,kv,sinks,n_sms,store",
    [
        (4, tk.BF16, False, tk.AUTO, "auto", False, 16, False),
        (2, tk.F32, True, tk.FP8, "auto", True, 64, False),
        (4, tk.BF16, True, tk.AUTO, "fp8_e4m3", False, 2, False),
        (4, tk.BF16, True, tk.AUTO, "auto", False, 16, True),
    ],
)
def test_one_decode_layer_is_at_most_three_launches_and_allocates_nothing(
    ps, dtype, force, kt_dtype, kv, sinks, n_sms, store
):
    """Also with a selection store (``reselect_every``), rows reusing it
    beside rows selecting: the same three launches."""
    hkv, g, d, bs = 2, 4, 64, 16
    c, q, args, max_pages, max_select = _batch(hkv, g, d, bs, ps, dtype, kt_dtype=kt_dtype)
    k_cache, v_cache = c.k, c.v
    if kv != "auto":
        from rocketkv_vllm.fp8_kv import FP8_FORMATS, Fp8KV

        fmt = FP8_FORMATS[kv]
        codes_k = c.k.to(fmt).view(torch.uint8)
        codes_v = c.v.to(fmt).view(torch.uint8)
        k_cache, v_cache = Fp8KV(codes_k, fmt, 1.0), Fp8KV(codes_v, fmt, 1.0)
    sink = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(3)) if sinks else None
    out = torch.full_like(q, 7.0)
    selections, slots = None, {}
    if store:
        batch = q.shape[0]
        sel_slot = torch.arange(batch, dtype=torch.int32)
        selections = torch.full((batch + 1, hkv, max_select + 1), -1, dtype=torch.int32)
        slots = dict(sel_slot=sel_slot, reuse=torch.zeros_like(sel_slot))
    decode_args = _decode_args(args, max_pages, max_select, **slots)

    def decode(out):
        triton_ops.hsa_decode(
            q,
            k_cache,
            v_cache,
            c.kt,
            *decode_args,
            force,
            out=out,
            sinks=sink,
            workspace=ws,
            selections=selections,
        )

    with sms(n_sms):
        ws = _workspace(q, hkv, max_pages, max_select, force)
        if store:  # a selecting step fills the store; the counted one reuses half
            decode(out.clone())
            decode_args[0].reuse = (sel_slot % 2).to(torch.int32)
        with recording() as rec, no_allocation(rec):
            decode(out)
    names = [n for n, _ in rec.launches]
    assert len(names) <= MAX_LAUNCHES, f"{len(names)} launches: {names}"
    assert names == ["_score_kernel", "_select_kernel", "_sparse_decode_kernel"]
    assert rec.kernel_ops() == [], f"torch ops in the decode step: {rec.kernel_ops()}"
    assert bool((ws.counters == 0).all()), "a merge counter was left set"
    assert bool((out[2] == 7.0).all()), "the padding row was written"


def test_pdl_from_compute_capability_9_unless_turned_off(monkeypatch):
    """Programmatic dependent launch on CUDA devices of compute capability
    9.0 and later, never under the interpreter, on CPU or on ROCm, off with
    ROCKETKV_PDL=0."""
    from rocketkv_vllm.kernels import _utils

    cuda = torch.device("cuda", 0)
    capability = {"cc": (9, 0)}
    monkeypatch.setattr(_utils, "_cuda_capability", lambda index: capability["cc"])
    monkeypatch.delenv("ROCKETKV_PDL", raising=False)
    assert not _utils.uses_pdl(cuda)  # the interpreter (set for this module)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not _utils.uses_pdl(torch.device("cpu"))
    for cc, want in (((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)):
        capability["cc"] = cc
        assert _utils.uses_pdl(cuda) is want, cc
    monkeypatch.setattr(torch.version, "hip", "6.2")  # ROCm: "cuda" devices, no PDL
    assert not _utils.uses_pdl(cuda)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("ROCKETKV_PDL", "0")
    assert not _utils.uses_pdl(cuda)


@pytest.mark.parametrize("on", [True, False])
def test_the_three_decode_launches_carry_pdl_when_it_is_on(on):
    """With uses_pdl on (as on an H100), each decode launch gets both its
    kernel's PDL constexpr (the wait in every program) and the launch
    attribute; with it off, neither. Launches recorded, not run (the
    interpreter has no griddepcontrol)."""
    hkv, g, d, bs, ps = 2, 4, 64, 16, 4
    c, q, args, max_pages, max_select = _batch(hkv, g, d, bs, ps, tk.BF16)
    seen = []

    def getitem(self, grid):
        name = getattr(getattr(self, "fn", self), "__name__", repr(self))
        return lambda *a, **kw: seen.append((name, kw.get("PDL"), kw.get("launch_pdl")))

    with (
        mock.patch.object(KernelInterface, "__getitem__", getitem),
        mock.patch.object(hsa_score, "uses_pdl", lambda device: on),
        mock.patch.object(page_select, "uses_pdl", lambda device: on),
        mock.patch.object(sparse_decode, "uses_pdl", lambda device: on),
    ):
        triton_ops.hsa_decode(q, c.k, c.v, c.kt, *_decode_args(args, max_pages, max_select), False)
    assert seen == [
        ("_score_kernel", on, on),
        ("_select_kernel", on, on),
        ("_sparse_decode_kernel", on, on),
    ]


def test_reported_grids_are_the_launched_ones():
    hkv, g, d, bs, ps = 2, 4, 64, 16, 4
    c, q, args, max_pages, max_select = _batch(hkv, g, d, bs, ps, tk.BF16)
    for n_sms in (2, 16):
        with sms(n_sms), recording() as rec:
            triton_ops.hsa_decode(
                q, c.k, c.v, c.kt, *_decode_args(args, max_pages, max_select), False
            )
        plan = triton_ops.plan_decode(
            q.shape[0], q.shape[1], hkv, d, max_pages, max_select, ps, False, q.dtype, n_sms
        )
        want = [(la.kernel, la.grid) for la in plan.launches()]
        assert rec.launches == want, n_sms


# --------------------------------------------------------------------------
# Grids at batch 1: Llama-3.1-8B layer, trtllm preset, 132 SMs


def _trtllm_launches(context: int, batch: int = 1, generated: int = 32):
    """(launches, row view pages, selected pages) of a FULL-graph decode
    step, everything derived as the backend derives it."""
    from rocketkv_vllm.budget import max_view_pages, pages_selected
    from rocketkv_vllm.config import parse_config, resolve_settings
    from rocketkv_vllm.plan import plan_request, view_pages

    hq, hkv, d, bs = 32, 8, 128, 16
    mml = context + generated
    settings = resolve_settings(parse_config({"preset": "trtllm"}), bs, d, mml)
    plan = plan_request(settings, context)
    assert plan.compress
    ps = settings.page_size
    row_pages = int(view_pages(plan.num_compact, plan.tail_start, context + generated, ps))
    max_pages = max_view_pages(mml, ps)
    max_select = min(pages_selected(settings.topk, ps), max_pages)  # graphs.shape_for
    n_use = min(pages_selected(plan.topk, ps), row_pages)
    dp = triton_ops.plan_decode(
        batch,
        hq,
        hkv,
        d,
        max_pages,
        max_select,
        ps,
        settings.force_current_page,
        torch.bfloat16,
        H200_SMS,
    )
    launches = dp.launches(row_pages, n_use)
    # the public entry point (B, Hkv, Hq, context, page size, budget, SMs) agrees
    assert launches == triton_ops.decode_launches(
        batch,
        hkv,
        hq,
        context,
        ps,
        plan.topk,
        H200_SMS,
        head_dim=d,
        prompt_budget=plan.prompt_budget,
        generated=generated,
    )
    return launches, row_pages, n_use


@pytest.mark.parametrize("context", [8192, 32768, 131072])
def test_decode_grids_fill_132_sms_at_batch_1(context):
    launches, row_pages, n_use = _trtllm_launches(context)
    table = "\n".join(
        f"  {la.kernel:<22} grid {str(la.grid):<10} programs {la.programs:>4}  "
        f"with work {la.busy:>4}"
        for la in launches
    )
    print(f"\ncontext {context} x 1 (view {row_pages} pages, {n_use} selected):\n{table}")
    assert len(launches) <= MAX_LAUNCHES
    for la in launches:
        assert la.programs >= H200_SMS, f"{la.kernel}: grid {la.grid}\n{table}"
        assert la.busy >= H200_SMS, f"{la.kernel}: {la.busy} programs with work\n{table}"


# --------------------------------------------------------------------------
# Correctness with many splits (the counters and merges at work)


@pytest.mark.parametrize(
    "hkv,g,d,bs,ps,dtype,force,layout,kt_dtype,n_sms,sinks",
    [
        (2, 4, 64, 16, 4, tk.BF16, False, "token", tk.AUTO, 32, False),
        (1, 3, 64, 16, 2, tk.F32, True, "cpu_vec", tk.FP8, 64, True),
        (2, 2, 32, 16, 4, tk.F16, True, "head_rows", tk.AUTO, 40, False),
        (2, 4, 128, 32, 8, tk.BF16, False, "split", tk.FP8, 24, True),
    ],
)
def test_hsa_decode_with_many_splits_matches_the_oracle(
    hkv, g, d, bs, ps, dtype, force, layout, kt_dtype, n_sms, sinks
):
    c, q, args, max_pages, max_select = _batch(
        hkv, g, d, bs, ps, dtype, layout=layout, kt_dtype=kt_dtype, seed=hkv + g
    )
    clean = c.clone()
    sink = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(4)) if sinks else None
    ref = paged.hsa_decode_rows(
        q, clean.k, clean.v, clean.kt, *args, force_current_page=force, sinks=sink
    )
    out = torch.full_like(q, 7.0)
    with sms(n_sms):
        ws = _workspace(q, hkv, max_pages, max_select, force, rows=8)
        for step in range(2):  # the second call reuses the workspace (a replay)
            if step:
                c = clean.clone()
            triton_ops.hsa_decode(
                q,
                c.k,
                c.v,
                c.kt,
                *_decode_args(args, max_pages, max_select),
                force,
                out=out,
                sinks=sink,
                workspace=ws,
            )
            assert bool((ws.counters == 0).all())
            for b, spec in enumerate(SPECS):
                if spec[2]:
                    tk._close(out[b], ref[b], dtype, f"step {step} row {b}")
                else:
                    assert bool((out[b] == 7.0).all()), f"padding row {b} was written"
        # the fused KT update wrote the newest pages as the oracle's did
        tk._same_storage(c, clean)


def _expected_selection(probs_row: torch.Tensor, n: int) -> list[int]:
    """Top n by (probability desc, page asc), in ascending page order."""
    order = sorted(range(probs_row.numel()), key=lambda j: (-float(probs_row[j]), j))
    return sorted(order[:n])


def test_select_pages_two_level_merge_with_long_rows():
    """Many splits (SMs mocked up): rows whose candidates need the large
    merge block (read in chunks past it), rows that fit the small one,
    plateaus of ties across splits; exactly the reference's choice, in
    ascending page order."""
    gen = torch.Generator().manual_seed(2)
    ps, hkv = 4, 2
    specs = [(4000, 4096, 80000), (40, 64, 100), (0, 0, 0), (400, 512, 3000)]
    num_pages = [paged.view_page_starts(*s, ps, "cpu").numel() if s[2] else 0 for s in specs]
    max_pages = max(num_pages) + 5
    probs = torch.full((len(specs), hkv, max_pages), -1.0)
    levels = torch.tensor([0.0, 1e-3, 0.25, 0.5, 2.0])
    for b, n in enumerate(num_pages):
        probs[b, :, :n] = levels[torch.randint(0, 5, (hkv, n), generator=gen)]
        probs[b, 0, :n] = torch.rand(n, generator=gen)  # head 0: distinct values
    topk = [60 * ps, 12 * ps, ps, 64 * ps]
    rows = [tk._ints([s[i] for s in specs]) for i in range(3)]
    with sms(64):
        plan = hsa_score.plan_score(len(specs), hkv, max_pages, 64, False, 64)
        assert plan.merge_block > hsa_score.MERGE_SMALL_BLOCK and plan.splits > 8
        sel = page_select.select_pages(probs.to(DEVICE), 64, *rows, tk._ints(topk), ps, "triton")
    sel = sel.cpu()
    for b, n in enumerate(num_pages):
        n_use = min(max(topk[b] // ps, 1), n, 64)
        for h in range(hkv):
            got = sel[b, h, :n_use].tolist()
            assert got == _expected_selection(probs[b, h, :n], n_use), (b, h)


def test_probabilities_out_of_the_fused_selection():
    """``hsa_decode_checked(probs_out=)`` gives the probabilities of
    ``hsa_page_probs`` (the same kernels, selection on / off)."""
    hkv, g, d, bs, ps = 2, 4, 64, 16, 4
    c, q, args, max_pages, max_select = _batch(hkv, g, d, bs, ps, tk.F32, seed=5)
    table, nc, ts, seq, topk, topr = args[:6]
    with sms(16):  # 7 scoring splits a row
        probs = torch.full((q.shape[0], hkv, max_pages), 7.0, device=DEVICE)
        triton_ops.hsa_decode_checked(
            q,
            c.k,
            c.v,
            c.kt,
            *_decode_args(args, max_pages, max_select),
            True,
            update_kt=False,
            probs_out=probs,
        )
        want = torch.full_like(probs, 7.0)
        page_select.hsa_page_probs(q, c.kt, table, nc, ts, seq, topr, ps, max_pages, True, out=want)
    assert bool((probs != 7.0).any())
    assert torch.equal(probs, want)


# --------------------------------------------------------------------------
# The backend: the builder's workspace, one decode step of a FULL-graph layout


def test_the_builder_workspace_serves_every_step_without_allocation(model_path):
    """The metadata builder makes one workspace (at the first Stage 2 step)
    and hands the same one to the capture and to every later step; the
    engine's Stage 2 call on a FULL-graph step then starts three kernels,
    no torch op and no allocation, leaves the counters at 0 and gives what
    a call with its own scratch gives."""
    import test_builder as tb

    b = tb._make_builder(
        model_path,
        {"token_budget": 256, "kernel": "triton"},
        4096,
        testing={"force_graph_layout": True},
    )
    assert isinstance(b.stage2, triton_ops.TritonStage2)
    table = torch.zeros(4, 512, dtype=torch.int32)
    capture = b.build(0, tb._cm(b, [(5, 1, 0)] * 4, table, runner="dummy"))
    ws = capture.decode.workspace
    assert isinstance(ws, triton_ops.DecodeWorkspace)
    gen = torch.Generator().manual_seed(3)
    kv, _, _, _ = tb._compressed_requests(b.settings, {0: 1800, 2: 700}, table, gen)
    tb._v2_new_requests(b, [(4, 1800), (9, 90), (6, 700)])
    cm = tb._cm(
        b, [(1800, 1, 1800), (90, 1, 90), (700, 1, 700), (0, 1, 0)], table, req_idx=[4, 9, 6]
    )
    cm.seq_lens[3] = 0
    cm.seq_lens_cpu_upper_bound[3] = 0
    step = b.build(0, cm)
    assert step.decode.in_place and step.decode.workspace is ws  # made once
    query = torch.randn(4, tb.HKV * tb.G, tb.D, generator=gen)
    out = torch.full_like(query, 7.0)
    kv_before = kv.clone()
    with recording() as rec, no_allocation(rec):
        b.stage2.decode(query, kv, step.decode, tb.D**-0.5, out=out)
    assert [n for n, _ in rec.launches] == [
        "_score_kernel",
        "_select_kernel",
        "_sparse_decode_kernel",
    ]
    assert rec.kernel_ops() == [], rec.kernel_ops()
    assert bool((ws.counters == 0).all())
    own = torch.full_like(query, 7.0)
    kv.copy_(kv_before)  # the KT update again
    rows = step.decode
    rows.workspace = None
    b.stage2.decode(query, kv, rows, tb.D**-0.5, out=own)
    assert torch.equal(out, own)
    assert bool((out[1] == 7.0).all()) and bool((out[3] == 7.0).all())
