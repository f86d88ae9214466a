"""Stage 1's kernels are compiled at engine start (``backend.warmup``), so no
Triton compile happens during inference.

Triton compiles a kernel once per key: its constexprs, the dtypes of its
tensor arguments, and for the others not listed in ``do_not_specialize``
whether an integer is 1 or a multiple of 16 and whether a pointer is 16-byte
aligned. Under the CPU interpreter nothing is compiled, so the test records
that key for every launch (the same rules, ``_compile_key``) and checks that
real Stage 1 calls (prompts of many lengths and budgets, block-table rows at
odd offsets, query views with vLLM's strides, fp8 KT) only launch keys the
warm-up launched. On CUDA the same test also counts the compiled kernels
Triton holds before and after.
"""

from __future__ import annotations

import inspect
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402

from rocketkv_vllm.backend.warmup import dummy_prompt, warm_up_stage1  # noqa: E402
from rocketkv_vllm.config import parse_config, resolve_settings  # noqa: E402
from rocketkv_vllm.kernels import (  # noqa: E402
    compact,
    hsa_score,
    page_select,
    sparse_decode,
    window_scores,
)
from rocketkv_vllm.layout import kt_cache_view, kt_row_bytes, split_kv  # noqa: E402
from rocketkv_vllm.ops.triton import TritonStage1  # noqa: E402
from rocketkv_vllm.plan import plan_request  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")
STAGE1_KERNELS = {
    "_window_stats_kernel": (window_scores._window_stats_kernel, "STAGE1_PER_PROMPT_STATS"),
    "_window_colsum_kernel": (window_scores._window_colsum_kernel, "STAGE1_PER_PROMPT_COLSUM"),
    "_compact_kernel": (compact._compact_kernel, "STAGE1_PER_PROMPT_COMPACT"),
    "_kt_pages_kernel": (compact._kt_pages_kernel, "STAGE1_PER_PROMPT_KT_PAGES"),
}


def _python_fn(kernel):
    return kernel.fn


def _do_not_specialize(kernel) -> set[str]:
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:  # the interpreter keeps the decorator's arguments
        names = kernel.kwargs.get("do_not_specialize") or []
    params = list(inspect.signature(_python_fn(kernel)).parameters)
    return {params[n] if isinstance(n, int) else n for n in names}


def _compile_key(kernel, args, kwargs) -> tuple:
    """What Triton compiles this launch for (see the module docstring)."""
    params = inspect.signature(_python_fn(kernel)).parameters
    bound = dict(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    free = _do_not_specialize(kernel)
    key = [_python_fn(kernel).__name__]
    for name, p in params.items():
        v = bound.get(name)
        if "constexpr" in str(p.annotation):
            key.append((name, v))
        elif isinstance(v, torch.Tensor):
            aligned = None if name in free else v.data_ptr() % 16 == 0
            key.append((name, str(v.dtype), aligned))
        elif isinstance(v, bool) or v is None:
            key.append((name, v))
        elif isinstance(v, int):
            width = "i32" if -(2**31) <= v < 2**31 else "i64"
            spec = None if name in free else ("1" if v == 1 else "D" if v % 16 == 0 else "")
            key.append((name, width, spec))
        else:
            key.append((name, type(v).__name__))
    launch_kw = tuple(sorted((k, v) for k, v in kwargs.items() if k.startswith("num_")))
    return (*key, launch_kw)


def _record(monkeypatch, kernels) -> list[tuple]:
    """Compile keys of these kernels' launches, in order."""
    seen: list[tuple] = []
    for kernel in kernels:
        original = kernel.run

        def run(*args, _k=kernel, _run=original, **kwargs):
            seen.append(_compile_key(_k, args, kwargs))
            return _run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    return seen


@pytest.fixture
def launches(monkeypatch):
    """Compile keys of the Stage 1 kernels' launches, in order."""
    return _record(monkeypatch, [kernel for kernel, _ in STAGE1_KERNELS.values()])


def _engine_cache(num_blocks, hkv, d, bs, dtype, page_size, kt_dtype, seed=0):
    """A layer's KV cache as vLLM allocates it for ROCKETKV: [num_blocks,
    Hkv, bs, 2d] blocks, each followed by its KT pages, random K/V."""
    width = 2 * d
    kt = hkv * (bs // page_size) * kt_row_bytes(d, dtype, kt_dtype)
    block_elems = hkv * bs * width + -(-kt // dtype.itemsize)
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randn(num_blocks * block_elems, generator=gen).to(dtype).to(DEVICE)
    return storage.as_strided((num_blocks, hkv, bs, width), (block_elems, bs * width, width, 1))


CASES = [
    # hkv, g, d, bs, dtype, layout, budget, kt_dtype
    (2, 3, 64, 16, torch.float32, "token", 128, "auto"),
    (1, 4, 128, 16, torch.bfloat16, "head_rows", 256, "fp8_e4m3"),
    (2, 2, 64, 32, torch.float16, "cpu_vec", 128, "auto"),
]


@pytest.mark.parametrize("hkv,g,d,bs,dtype,layout,budget,kt_dtype", CASES)
def test_warm_up_launches_every_key_stage1_launches(
    launches, hkv, g, d, bs, dtype, layout, budget, kt_dtype
):
    cfg = {"token_budget": budget, "kt_dtype": kt_dtype}
    settings = resolve_settings(parse_config(cfg), bs, d, 8192)
    stage1 = TritonStage1()
    num_blocks = 160
    kv_cache = _engine_cache(num_blocks, hkv, d, bs, dtype, settings.page_size, kt_dtype)
    hq = hkv * g
    warm_up_stage1(
        stage1,
        kv_cache,
        kv_layout=layout,
        quant=None,
        settings=settings,
        num_q_heads=hq,
        query_dtype=dtype,
        scale=d**-0.5,
        sinks=None,
    )
    warm = set(launches)
    assert {k[0] for k in warm} == set(STAGE1_KERNELS), "the warm-up skipped a Stage 1 kernel"
    launches.clear()

    # Real compactions as RocketKVImpl._stage1 makes them: vLLM's query for a
    # step is [tokens, Hq + 2 Hkv, d] (q, k, v of a fused projection), its
    # window a slice of that; block rows are rows of a block table.
    table = torch.arange(1, num_blocks, dtype=torch.int32, device=DEVICE)
    k_cache, v_cache = split_kv(kv_cache, layout)
    kt_cache = kt_cache_view(kv_cache, settings.page_size, kt_dtype)
    w = settings.window_size
    # lengths: one and several 1024-token chunks of the window scores, multiples
    # of 16 and not; budgets: the engine's and per-request ones
    lengths = [dummy_prompt(settings)[0] + 1, 320, 1040, 1091]
    for i, n in enumerate(lengths):
        for request_budget in (None, 176):
            plan = plan_request(settings, n, request_budget)
            if not plan.compress:
                continue
            qkv = torch.randn(n + 3, hq + 2 * hkv, d, dtype=torch.float32).to(dtype).to(DEVICE)
            q_window = qkv[n + 3 - w :, :hq]
            start = 1 + 3 * i  # rows at odd offsets: unaligned block-row pointers
            block_row = table[start : start + -(-n // bs)]
            stage1.compress(
                k_cache,
                v_cache,
                kt_cache,
                block_row,
                q_window,
                n,
                plan.prompt_budget,
                plan.tail_start,
                settings.kernel_size,
                settings.page_size,
                d**-0.5,
            )
    real = set(launches)
    assert len(launches) >= 20
    assert {k[0] for k in real} == set(STAGE1_KERNELS)
    missing = real - warm
    assert not missing, f"compiled during inference: {sorted(missing)[:2]}"


def test_per_prompt_arguments_name_kernel_parameters():
    """Every name in a Stage 1 kernel's do_not_specialize list is one of its
    parameters (Triton ignores unknown names: a typo would silently bring a
    per-prompt specialization back)."""
    for name, (kernel, listed) in STAGE1_KERNELS.items():
        module = window_scores if hasattr(window_scores, listed) else compact
        names = set(getattr(module, listed))
        params = set(inspect.signature(_python_fn(kernel)).parameters)
        assert names <= params, (name, names - params)
        assert _do_not_specialize(kernel) == names, name


# --------------------------------------------------------------------------
# Stage 2: eager decode steps (a prompt chunk beside decodes, enforce_eager)

STAGE2_KERNELS = {
    "_score_kernel": hsa_score._score_kernel,
    "_select_kernel": page_select._select_kernel,
    "_sparse_decode_kernel": sparse_decode._sparse_decode_kernel,
}


@pytest.mark.parametrize("reselect_every", [1, 2])
def test_warm_up_launches_every_key_eager_decode_steps_launch(
    model_path, monkeypatch, reselect_every
):
    """Stage 2 steps built by the metadata builder for the eager path (batches
    of 1 to 9 compressed rows, a request with its own larger budget among
    them) launch only keys ``warm_up_stage2`` launched, also with the
    layer's selection store (``reselect_every``). The GPU is a 6-SM
    one here, so the split counts (and with them the constexprs) change
    with the batch as on an H200, at grids the interpreter can run."""
    import test_builder as tb

    from rocketkv_vllm.backend.warmup import warm_up_stage2

    for module in (hsa_score, sparse_decode):
        monkeypatch.setattr(module, "num_sms", lambda device: 6)
    max_model_len = 1024
    cfg = {"token_budget": 256, "kernel": "triton", "reselect_every": reselect_every}
    b = tb._make_builder(model_path, cfg, max_model_len)
    store = tb._store(b) if reselect_every > 1 else None
    assert b.stage2.fixed_shapes and b.graph is None
    s = b.settings
    table = torch.zeros(9, 512, dtype=torch.int32)
    gen = torch.Generator().manual_seed(5)
    # three requests at the engine's budget, a fourth at its own larger one
    prompts, own = {0: 900, 1: 350, 2: 550, 3: 900}, {3: 512}
    kv, _, _, _ = tb._compressed_requests(s, prompts, table, gen, own)
    compressed = table.clone()
    hq, scale = tb.HKV * tb.G, tb.D**-0.5
    seen = _record(monkeypatch, STAGE2_KERNELS.values())
    calls = warm_up_stage2(
        b.stage2,
        kv,
        quant=None,
        settings=s,
        max_model_len=max_model_len,
        max_rows=b.vllm_config.scheduler_config.max_num_seqs,
        num_q_heads=hq,
        query_dtype=torch.float32,
        scale=scale,
        sinks=None,
        selections=store,
    )
    warm = set(seen)
    assert {k[0] for k in warm} == set(STAGE2_KERNELS)
    assert calls >= 4, f"{calls} distinct eager shapes: the case does not vary the plan"
    seen.clear()

    slot = 0
    for batch in (1, 2, 3, 5, 9):
        # rows share the compressed requests' blocks; the batch of 9 holds the
        # one with its own budget (the widest shape)
        source = [3 if batch == 9 and i == 3 else i % 3 for i in range(batch)]
        lengths = [prompts[j] for j in source]
        for i, j in enumerate(source):
            table[i] = compressed[j]
        slots = list(range(slot, slot + batch))
        slot += batch
        budgets = [own.get(j) for j in source]
        tb._v2_new_requests(b, list(zip(slots, lengths)), budgets)
        cm = tb._cm(b, [(n, 1, n) for n in lengths], table, req_idx=slots)
        rows = b.build(0, cm).decode
        assert rows is not None and not rows.in_place and rows.decode_rows.seq_lens.numel() == batch
        query = torch.randn(batch, hq, tb.D, generator=gen)
        b.stage2.decode(query[rows.tokens], kv, rows, scale, selections=store)
    real = set(seen)
    assert {k[0] for k in real} == set(STAGE2_KERNELS)
    assert len(real) >= 6, f"{len(real)} keys: the steps did not vary the plan"
    missing = real - warm
    assert not missing, f"compiled during inference: {sorted(missing, key=str)[:2]}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")
def test_no_compile_after_warm_up_on_cuda():
    """On CUDA: the number of compiled Stage 1 kernels Triton holds does not
    grow after the warm-up, over prompts of many lengths."""
    hkv, g, d, bs, dtype = 8, 4, 128, 16, torch.bfloat16
    settings = resolve_settings(parse_config({"token_budget": 256}), bs, d, 8192)
    kv_cache = _engine_cache(700, hkv, d, bs, dtype, settings.page_size, "auto")
    stage1 = TritonStage1()
    warm_up_stage1(
        stage1,
        kv_cache,
        kv_layout="token",
        quant=None,
        settings=settings,
        num_q_heads=hkv * g,
        query_dtype=dtype,
        scale=d**-0.5,
        sinks=None,
    )

    def compiled() -> int:
        total = 0
        for kernel, _ in STAGE1_KERNELS.values():
            for cache in kernel.device_caches.values():
                total += len(cache[0])
        return total

    before = compiled()
    assert before >= len(STAGE1_KERNELS)
    k_cache, v_cache = split_kv(kv_cache, "token")
    kt_cache = kt_cache_view(kv_cache, settings.page_size)
    table = torch.arange(1, 700, dtype=torch.int32, device=DEVICE)
    for i, n in enumerate([700, 1025, 2048, 4097, 8000]):
        plan = plan_request(settings, n)
        qkv = torch.randn(n, hkv * g + 2 * hkv, d, device=DEVICE, dtype=dtype)
        stage1.compress(
            k_cache,
            v_cache,
            kt_cache,
            table[1 + i : 1 + i + -(-n // bs)],
            qkv[n - settings.window_size :, : hkv * g],
            n,
            plan.prompt_budget,
            plan.tail_start,
            settings.kernel_size,
            settings.page_size,
            d**-0.5,
        )
    torch.cuda.synchronize()
    assert compiled() == before, f"{compiled() - before} Stage 1 kernels compiled after warm-up"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA)")
def test_no_stage2_compile_after_warm_up_on_cuda():
    """On CUDA: after ``warm_up_stage2``, eager Stage 2 calls of 1 to 8
    compressed rows (laid out as the builder lays them out, one with a
    larger own budget) compile no Stage 2 kernel. (Up to 8 rows: an engine
    warms up to max_num_seqs; here each distinct plan costs a compile.)"""
    from rocketkv_vllm.backend import graphs
    from rocketkv_vllm.backend.warmup import warm_up_stage2
    from rocketkv_vllm.kernels.rows import DecodeRows
    from rocketkv_vllm.ops.base import HsaRows
    from rocketkv_vllm.ops.triton import TritonStage2
    from rocketkv_vllm.plan import pages_selected

    hkv, g, d, bs, dtype, mml = 8, 4, 128, 16, torch.bfloat16, 8192
    settings = resolve_settings(parse_config({"token_budget": 256}), bs, d, mml)
    kv_cache = _engine_cache(1200, hkv, d, bs, dtype, settings.page_size, "auto")
    stage2 = TritonStage2(settings, "token")
    hq, scale = hkv * g, d**-0.5
    warm_up_stage2(
        stage2,
        kv_cache,
        quant=None,
        settings=settings,
        max_model_len=mml,
        max_rows=8,
        num_q_heads=hq,
        query_dtype=dtype,
        scale=scale,
        sinks=None,
    )

    def compiled() -> int:
        return sum(
            len(cache[0]) for k in STAGE2_KERNELS.values() for cache in k.device_caches.values()
        )

    before = compiled()
    assert before >= len(STAGE2_KERNELS)
    shape = graphs.shape_for(settings, mml, 1)
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 2, 3, 5, 6, 7, 8):
        lengths = torch.randint(400, mml - 8, (batch,), generator=gen).tolist()
        plans = [plan_request(settings, n, 1024 if i == 2 else None) for i, n in enumerate(lengths)]
        cols = torch.zeros(7, graphs.aligned_rows(batch), dtype=torch.int32)
        for i, (n, p) in enumerate(zip(lengths, plans)):
            cols[:, i] = torch.tensor(
                [
                    p.num_compact,
                    p.tail_start,
                    n + 1,
                    p.topk,
                    p.topr,
                    pages_selected(p.topk, settings.page_size),
                    0,
                ]
            )
        cols = cols.to(DEVICE)
        max_select = int(cols[5, :batch].max())
        max_pages, max_select = graphs.eager_bounds(shape, max_select)
        table = torch.randint(1, 1200, (batch, 512), generator=gen, dtype=torch.int32)
        rows = HsaRows(
            tokens=torch.arange(batch, device=DEVICE),
            decode_rows=DecodeRows(
                table.to(DEVICE), *cols[:5, :batch], max_pages=max_pages, max_select=max_select
            ),
            num_select=cols[5, :batch],
        )
        query = torch.randn(batch, hq, d, device=DEVICE, dtype=dtype)
        stage2.decode(query, kv_cache, rows, scale)
    torch.cuda.synchronize()
    assert compiled() == before, f"{compiled() - before} Stage 2 kernels compiled after warm-up"


_ = triton  # imported for its side effect: the interpreter decided above
