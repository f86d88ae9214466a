"""Decode attention of one layer on CPU: vLLM's CPU_ATTN kernel over the whole
context against ROCKETKV's Stage 2 over a compressed one (batched PyTorch and
the C++ kernel), with KT pages in the model dtype and in fp8
(``rocketkv.kt_dtype = "fp8_e4m3"``).

    .venv/bin/python scripts/bench_hsa_cpu.py --context 7800 --batch 2

Same cache tensor, layout and dtype for both (bf16 with AMX where the CPU has
it: 32-token blocks; else the vec layout); the compressed request keeps what
``token_budget`` keeps for a prompt of that length. Prints milliseconds per
call (mean of --iters after two warm-up calls; CPU time of the process
unless --wall). vLLM CPU build only. Set
threads with OMP_NUM_THREADS (vLLM's CPU kernels read it; on a busy machine
use 1, as OpenMP spin-waits make everything else meaningless).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def cpu_attn_decoder(
    query: torch.Tensor,
    kv: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    isa: str,
    cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    enable_kv_split: bool = False,
):
    """vLLM CPU_ATTN's own decode kernel, one query token per row of
    ``block_table`` [B, blocks] (int32) at position seq_lens[b] - 1, over a
    ROCKETKV-shaped cache ``kv`` [num_blocks, Hkv, bs, 2d] (CPU_ATTN's
    forward hands the kernel each head's block as [2 * bs, d] halves).
    Returns a call that runs the kernel (scheduler metadata made once) and
    returns its output [B, Hq, d]."""
    from vllm import _custom_ops as ops

    num_blocks, hkv, bs, width = kv.shape
    d = width // 2
    batch = query.shape[0]
    out = torch.empty_like(query)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch,
        num_heads=query.shape[1],
        num_kv_heads=hkv,
        head_dim=d,
        seq_lens=seq_lens,
        dtype=query.dtype,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=enable_kv_split,
        kv_cache_dtype=cache_dtype,
    )
    rows = kv.view(num_blocks, hkv, 2 * bs, d)

    def decode() -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(
            query=query,
            key_cache=rows[:, :, :bs],
            value_cache=rows[:, :, bs:],
            output=out,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            scale=d**-0.5,
            causal=True,
            alibi_slopes=None,
            sliding_window=-1,
            block_table=block_table,
            softcap=0,
            scheduler_metadata=meta,
            s_aux=None,
            k_scale=k_scale,
            v_scale=v_scale,
            kv_cache_dtype=cache_dtype,
        )
        return out

    return decode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=7800)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument(
        "--wall", action="store_true", help="wall-clock time instead of this process's CPU time"
    )
    args = ap.parse_args(argv)
    if torch.cpu._is_amx_tile_supported():
        # A process must ask the kernel for AMX state before using it (in an
        # engine the model's first bf16 matmul does).
        torch.cpu._init_amx()

    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from rocketkv_vllm.backend.native import cpu_kv_layout
    from rocketkv_vllm.config import RocketKVConfig, resolve_settings
    from rocketkv_vllm.kernels.rows import DecodeRows
    from rocketkv_vllm.layout import kt_cache_view, split_kv
    from rocketkv_vllm.ops import pytorch as torch_ops
    from rocketkv_vllm.plan import plan_request

    dtype, bs, hkv, g, d = torch.bfloat16, 32, args.kv_heads, args.group, args.head_dim
    isa = _get_attn_isa(dtype, bs, d)
    layout = cpu_kv_layout(isa, dtype, d, bs)
    settings = resolve_settings(
        RocketKVConfig(token_budget=args.token_budget), bs, d, args.context + 512
    )
    n = args.context
    plan = plan_request(settings, n)
    ps = settings.page_size
    blocks_per_row = -(-(n + 1) // bs)
    num_blocks = args.batch * blocks_per_row + 1
    block_elems = hkv * bs * 2 * d + hkv * (bs // ps) * 2 * d
    gen = torch.Generator().manual_seed(0)
    storage = torch.randn(num_blocks * block_elems, generator=gen).to(dtype)
    kv = storage.as_strided((num_blocks, hkv, bs, 2 * d), (block_elems, bs * 2 * d, 2 * d, 1))
    k_cache, v_cache = split_kv(kv, layout)
    # Room for bf16 KT rows, which are larger than fp8 ones: each format's
    # view starts at the same place, so each is written before its runs.
    kt_views = {kt: kt_cache_view(kv, ps, kt) for kt in ("auto", "fp8_e4m3")}
    table = (
        (torch.randperm(num_blocks - 1, generator=gen)[: args.batch * blocks_per_row] + 1)
        .view(args.batch, blocks_per_row)
        .int()
    )
    seq = torch.full((args.batch,), n + 1, dtype=torch.int32)
    query = torch.randn(args.batch, hkv * g, d, generator=gen).to(dtype)

    # CPU time of this process: with OMP_NUM_THREADS=1 it is the compute a
    # call costs even while other jobs share the cores (wall time is not).
    clock = time.perf_counter if args.wall else time.process_time

    def bench(fn) -> float:
        fn()
        fn()
        start = clock()
        for _ in range(args.iters):
            fn()
        return (clock() - start) / args.iters * 1e3

    dense = cpu_attn_decoder(query, kv, table, seq, isa, enable_kv_split=True)

    col = lambda v: torch.full((args.batch,), v, dtype=torch.int32)  # noqa: E731
    num_compact, tail_start = col(plan.num_compact), col(plan.tail_start)
    max_pages = -(-plan.num_compact // ps) + -(-(n + 1 - plan.tail_start) // ps)
    view = torch_ops.view_pages(table, num_compact, tail_start, seq, ps, bs, max_pages)
    num_select = max(plan.topk // ps, 1)
    rows = DecodeRows(
        table,
        num_compact,
        tail_start,
        seq,
        col(plan.topk),
        col(plan.topr),
        max_pages,
        num_select,
    )

    from rocketkv_vllm.ops import cpu as cpu_ops

    def write_kt(kt_cache) -> None:
        # A compressed request's KT pages: its compact part and its tail.
        for row in table:
            torch_ops.write_kt_pages(k_cache, kt_cache, row, 0, plan.num_compact, ps)
            torch_ops.write_kt_pages(k_cache, kt_cache, row, plan.tail_start, n + 1, ps)

    def stage2(kt_dtype: str):
        kt_cache = kt_views[kt_dtype]
        write_kt(kt_cache)

        def sparse() -> None:
            torch_ops.hsa_decode(
                query,
                k_cache,
                v_cache,
                kt_cache,
                rows,
                view,
                col(num_select),
                ps,
                d**-0.5,
                settings.force_current_page,
            )

        def native() -> None:
            cpu_ops.hsa_decode(
                query,
                kv,
                kt_cache,
                layout,
                rows,
                col(num_select),
                ps,
                d**-0.5,
                settings.force_current_page,
            )

        return bench(sparse), bench(native)

    dense_ms = bench(dense)
    sparse_ms, native_ms = stage2("auto")
    sparse8_ms, native8_ms = stage2("fp8_e4m3")
    print(
        f"{'wall' if args.wall else 'CPU'} time; "
        f"isa {isa}, layout {layout}, OMP threads {torch.get_num_threads()}, batch "
        f"{args.batch}, context {n}, kept {plan.prompt_budget}, page {ps}, "
        f"top-k {plan.topk}, top-r {plan.topr}"
    )
    print(f"CPU_ATTN decode (whole context): {dense_ms:.3f} ms per layer")
    print(
        f"ROCKETKV Stage 2 (batched torch): {sparse_ms:.3f} ms per layer "
        f"({dense_ms / sparse_ms:.2f}x of dense speed)"
    )
    print(
        f"ROCKETKV Stage 2 (C++ kernel):    {native_ms:.3f} ms per layer "
        f"({dense_ms / native_ms:.2f}x of dense speed)"
    )
    print(
        f"  with fp8 KT pages: batched torch {sparse8_ms:.3f} ms, C++ kernel "
        f"{native8_ms:.3f} ms per layer ({dense_ms / native8_ms:.2f}x of dense speed)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
