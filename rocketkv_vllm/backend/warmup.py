"""ROCKETKV's kernels compiled at engine start, not during inference.

Stage 1 runs only at the end of a long prompt's prefill, which vLLM's own
warm-up (dummy batches, CUDA graph capture) never reaches: without this, the
Triton kernels of Stage 1 compiled during the first compressed request of
every engine (vLLM's JIT monitor warned of a latency spike on the H200).

What a Triton kernel is compiled for: its constexprs, the dtypes of its
arguments and the specialization of the others (an integer equal to 1 or a
multiple of 16, a pointer 16-byte aligned). Stage 1's kernels take everything
that changes from prompt to prompt unspecialized (their
``STAGE1_PER_PROMPT_*`` lists), so what is left is fixed by the layer: one
dummy compaction per distinct layer shape compiles every variant the engine
can launch. ``tests/test_warmup.py`` checks that claim key by key.

Stage 2: FULL CUDA graphs compile their launches at capture, but steps
that run eagerly (a prompt chunk beside decodes, ``enforce_eager``, batches
past the largest graph) would compile a variant for each new batch size.
Eager calls launch at the engine's shape (``graphs.eager_bounds``), so their
specializations depend on the row count only; ``warm_up_stage2`` launches
one call of padding rows for each distinct one (``DecodePlan.compile_key``).

The dummy prompt lives in vLLM's null block (block 0, never handed to a
request): its K/V and KT page there are scratch that nothing reads.
"""

from __future__ import annotations

import time

import torch
from vllm.logger import init_logger

from rocketkv_vllm.backend import graphs
from rocketkv_vllm.config import RocketKVSettings
from rocketkv_vllm.kernels.rows import DecodeRows
from rocketkv_vllm.layout import kt_cache_view, split_kv
from rocketkv_vllm.ops.base import HsaRows

logger = init_logger(f"vllm.{__name__}")

NULL_BLOCK = 0


def dummy_prompt(settings: RocketKVSettings) -> tuple[int, int, int]:
    """(num_prompt_tokens, prompt_budget, tail_start) of a prompt that
    evicts: past the window, ending in a partial block, keeping one block of
    chosen tokens besides the protected ones."""
    bs = settings.block_size
    n = settings.window_size + 4 * bs + max(bs // 2, 1)
    tail_start = n // bs * bs
    protect_from = min(n - settings.window_size, tail_start)
    return n, (n - protect_from) + bs, tail_start


def warm_up_stage1(
    stage1,
    kv_cache: torch.Tensor,
    *,
    kv_layout: str,
    quant,
    settings: RocketKVSettings,
    num_q_heads: int,
    query_dtype: torch.dtype,
    scale: float,
    sinks: torch.Tensor | None,
) -> None:
    """One Stage 1 compaction (``stage1.compress``, every Stage 1 kernel) of
    a dummy prompt in the null block of this layer's cache, with the
    arguments ``RocketKVImpl._stage1`` derives from the same cache."""
    n, prompt_budget, tail_start = dummy_prompt(settings)
    k_cache, v_cache = split_kv(kv_cache, kv_layout, quant)
    kt_cache = kt_cache_view(kv_cache, settings.page_size, settings.kt_dtype)
    block_row = torch.full(
        (-(-n // settings.block_size),), NULL_BLOCK, dtype=torch.int32, device=kv_cache.device
    )
    head_size = k_cache.shape[-1]
    q_window = torch.zeros(
        settings.window_size, num_q_heads, head_size, dtype=query_dtype, device=kv_cache.device
    )
    stage1.compress(
        k_cache,
        v_cache,
        kt_cache,
        block_row,
        q_window,
        n,
        prompt_budget,
        tail_start,
        settings.kernel_size,
        settings.page_size,
        scale,
        sinks=sinks,
    )


def padding_rows(batch: int, max_pages: int, max_select: int, device) -> HsaRows:
    """``batch`` Stage 2 rows that are all padding (seq_len 0: the kernels
    launch and skip them), their vectors laid out as the builder lays a
    step's out (``graphs.aligned_rows``)."""
    columns = torch.zeros(8, graphs.aligned_rows(batch), dtype=torch.int32, device=device)
    columns[6] = -1  # no selection slot
    num_compact, tail_start, seq_lens, topk, topr, num_select, sel_slot, reuse = (
        c[:batch] for c in columns
    )
    return HsaRows(
        tokens=torch.arange(batch, device=device),
        decode_rows=DecodeRows(
            block_table=torch.zeros(batch, 1, dtype=torch.int32, device=device),
            num_compact=num_compact,
            tail_start=tail_start,
            seq_lens=seq_lens,
            topk=topk,
            topr=topr,
            max_pages=max_pages,
            max_select=max_select,
            sel_slot=sel_slot,
            reuse=reuse,
        ),
        num_select=num_select,
    )


def warm_up_stage2(
    stage2,
    kv_cache: torch.Tensor,
    *,
    quant,
    settings: RocketKVSettings,
    max_model_len: int,
    max_rows: int,
    num_q_heads: int,
    query_dtype: torch.dtype,
    scale: float,
    sinks: torch.Tensor | None,
    selections: torch.Tensor | None = None,
) -> int:
    """One eager Stage 2 call (every Stage 2 kernel) of padding rows per
    distinct specialization an eager step of this layer can launch: eager
    calls run at the engine's shape (``graphs.eager_bounds``: its selection,
    or every page for a larger per-request budget), in row chunks of up to
    ``eager_chunk``, so their specializations depend on the rows' count
    alone. Returns the calls made."""
    if not stage2.fixed_shapes:
        return 0
    shape = graphs.shape_for(settings, max_model_len, 1)
    num_kv_heads = kv_cache.shape[1]
    seen, calls = set(), 0
    chunk = stage2.eager_chunk(num_q_heads, num_kv_heads, shape.max_pages)
    for max_select in sorted({shape.max_select, shape.max_pages}):
        for batch in range(1, max(1, min(max_rows, chunk)) + 1):
            plan = stage2.eager_plan(
                batch, num_q_heads, query_dtype, kv_cache, quant, shape.max_pages, max_select
            )
            key = plan.compile_key()
            if key in seen:
                continue
            seen.add(key)
            rows = padding_rows(batch, shape.max_pages, max_select, kv_cache.device)
            query = torch.zeros(
                batch, num_q_heads, plan.head_dim, dtype=query_dtype, device=kv_cache.device
            )
            stage2.decode(
                query, kv_cache, rows, scale, sinks=sinks, quant=quant, selections=selections
            )
            calls += 1
    return calls


def warm_up_worker(vllm_config) -> int:
    """Warm Stage 1 and Stage 2 up on every distinct ROCKETKV layer shape of
    this worker (after its KV cache is bound, before vLLM's warm-up and
    graph capture). Returns the number of layer shapes warmed up."""
    from rocketkv_vllm.backend.impl import RocketKVImpl
    from rocketkv_vllm.fp8_kv import kv_quant_for

    t0 = time.perf_counter()
    seen, runs, decode_calls = set(), 0, 0
    for layer in vllm_config.compilation_config.static_forward_context.values():
        impl = getattr(layer, "impl", None)
        kv_cache = getattr(layer, "kv_cache", None)
        if not isinstance(impl, RocketKVImpl) or not isinstance(kv_cache, torch.Tensor):
            continue
        if kv_cache.numel() == 0:
            continue
        quant = kv_quant_for(impl.kv_cache_dtype, layer)
        sinks = impl._sinks()
        key = (
            type(impl.stage1),
            type(impl.stage2),
            impl.kv_layout,
            impl.num_heads,
            kv_cache.dtype,
            tuple(kv_cache.shape[1:]),
            kv_cache.stride(),
            None if quant is None else quant.fp8_dtype,
            sinks is not None,
            impl.settings,
        )
        if key in seen:
            continue
        seen.add(key)
        warm_up_stage1(
            impl.stage1,
            kv_cache,
            kv_layout=impl.kv_layout,
            quant=quant,
            settings=impl.settings,
            num_q_heads=impl.num_heads,
            query_dtype=vllm_config.model_config.dtype,
            scale=impl.scale,
            sinks=sinks,
        )
        decode_calls += warm_up_stage2(
            impl.stage2,
            kv_cache,
            quant=quant,
            settings=impl.settings,
            max_model_len=vllm_config.model_config.max_model_len,
            max_rows=vllm_config.scheduler_config.max_num_seqs,
            num_q_heads=impl.num_heads,
            query_dtype=vllm_config.model_config.dtype,
            scale=impl.scale,
            sinks=sinks,
            selections=impl.selections,
        )
        runs += 1
    if runs:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the compile time belongs to the warm-up
        logger.info(
            "ROCKETKV: Stage 1 and Stage 2 warmed up on %d layer shape(s) "
            "(%d eager decode shape(s)) in %.2f s.",
            runs,
            decode_calls,
            time.perf_counter() - t0,
        )
    return runs
