#!/usr/bin/env python
"""Per-layer decode attention: dense paged flash-decoding vs RocketKV (HSA).

For each context length and batch (Llama-3.1-8B-like layer: Hq=32, Hkv=8,
d=128, bf16, block 16):
  * dense     -- ``kernels.dense_decode`` over the full context;
  * rocketkv  -- ``triton_ops.hsa_decode_batch`` (KT update + page scoring +
                 top-n selection + sparse attention, all counted) on the
                 compressed view a request of that prompt length has, per token
                 budget (``RocketKVSettings`` via ``resolve_settings`` +
                 ``plan_request``: prompt_budget, page_size, topk, topr), with a
                 short tail of generated tokens;
and each kernel's achieved HBM bandwidth against the card's copy bandwidth
(measured here with a large torch copy). Plus Stage 1 (window scores, pool,
top-k, compaction, KT build) as a fraction of the prefill attention of the
same 32k prompt (torch SDPA, flash on CUDA).

Timing: CUDA events, warmup, median of --iters. "ms" is the replay of the
call captured in a CUDA graph (as vLLM runs decode; this also checks that
the path is capturable), "ms_eager" the plain call including Python launch
overhead; the per-kernel fields are eager. Sizes that
do not fit in free GPU memory are skipped (and listed). ``--smoke`` runs tiny
sizes on CPU under TRITON_INTERPRET=1 (wall-clock timing, numbers meaningless)
to check the script.

JSON (--out): {"card", "date", "command", "copy_bandwidth_gbs", "rows": [{
"context", "batch", "method": "dense"|"rocketkv", "budget", "ms", ...}],
"stage1": {...}, "skipped": [...]}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import types

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

try:  # config.py imports yaml only for presets; a bare GPU host may lack it
    import yaml  # noqa: F401
except ImportError:
    sys.modules["yaml"] = types.ModuleType("yaml")

from rocketkv_vllm import paged, triton_ops  # noqa: E402
from rocketkv_vllm.config import RocketKVConfig, plan_request, resolve_settings  # noqa: E402
from rocketkv_vllm.kernels.dense_decode import dense_decode  # noqa: E402
from rocketkv_vllm.kernels.hsa_score import hsa_page_probs, select_pages  # noqa: E402
from rocketkv_vllm.kernels.kt_update import kt_update  # noqa: E402
from rocketkv_vllm.kernels.sparse_decode import sparse_decode  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (interpreter)")
    p.add_argument("--contexts", default="4096,16384,32768,65536,131072")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--budgets", default="256,1024,2048")
    p.add_argument("--heads", default="32,8", help="Hq,Hkv")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--generated", type=int, default=32,
                   help="tokens already generated (the view's tail past the prompt)")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="generation length the budget split and max_pages assume")
    p.add_argument("--stage1-context", type=int, default=32768)
    p.add_argument("--stage1-budget", type=int, default=2048)
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: start no new (context, batch) after this (listed as skipped)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    if args.smoke:
        args.contexts, args.batches, args.budgets = "256,512", "1,2", "64,128"
        args.heads, args.head_dim = "8,2", 64
        args.stage1_context, args.stage1_budget = 512, 128
        args.warmup, args.iters, args.generated, args.max_new_tokens = 1, 2, 8, 32
    return args


class Timer:
    def __init__(self, device, warmup, iters):
        self.cuda = device.type == "cuda"
        self.warmup, self.iters = warmup, iters

    def __call__(self, fn) -> float:
        """Median milliseconds of fn()."""
        for _ in range(self.warmup):
            fn()
        times = []
        if self.cuda:
            torch.cuda.synchronize()
            for _ in range(self.iters):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        else:
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def graph(self, fn) -> tuple[float | None, str | None]:
        """Median ms of replaying fn captured in a CUDA graph (how vLLM runs
        decode), or (None, reason)."""
        if not self.cuda:
            return None, "no CUDA"
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
                fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            ms = self(g.replay)
            del g
            return ms, None
        except Exception as exc:  # noqa: BLE001
            torch.cuda.synchronize()
            return None, f"{type(exc).__name__}: {exc}"[:300]


def copy_bandwidth(device, timer, nbytes) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


def free_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return 8 << 30


def make_cache(num_blocks, hkv, d, bs, page_size, dtype, device):
    """KV cache view with the KT padding after each block (ROCKETKV layout);
    page_size None: a plain dense cache."""
    width = 2 * d
    block = hkv * bs * width + (hkv * (bs // page_size) * width if page_size else 0)
    storage = torch.empty(num_blocks * block, dtype=dtype, device=device)
    storage.normal_()
    kv = torch.as_strided(storage, (num_blocks, hkv, bs, width), (block, bs * width, width, 1))
    kt = paged.kt_cache_view(kv, page_size) if page_size else None
    return kv, kt


def bench_dense(ctx, batch, a, dev, timer):
    hq, hkv, d, bs = a.hq, a.hkv, a.head_dim, a.block_size
    blocks_per_row = -(-ctx // bs)
    kv, _ = make_cache(batch * blocks_per_row, hkv, d, bs, None, a.dtype, dev)
    table = torch.randperm(batch * blocks_per_row, device=dev, dtype=torch.int64)
    table = table.view(batch, blocks_per_row).to(torch.int32)
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, hq, d, dtype=a.dtype, device=dev)
    out = torch.empty_like(q)
    scale = d**-0.5
    def call():
        dense_decode(q, kv, table, seq, scale, ctx, out=out)

    ms_eager = timer(call)
    ms_graph, why = timer.graph(call)
    ms = ms_graph if ms_graph is not None else ms_eager
    nbytes = batch * ctx * hkv * 2 * d * kv.element_size()
    del kv
    return {"ms": ms, "ms_eager": ms_eager, "ms_graph": ms_graph, "graph_error": why,
            "bytes": nbytes, "gbs": nbytes / (ms * 1e-3) / 1e9}


def rocket_plan(ctx, budget, a):
    cfg = RocketKVConfig(token_budget=budget, max_new_tokens=a.max_new_tokens)
    settings = resolve_settings(cfg, a.block_size, a.head_dim, ctx + a.max_new_tokens)
    return settings, plan_request(settings, ctx)


def bench_rocket(ctx, budget, batch, a, dev, timer):
    hq, hkv, d, bs = a.hq, a.hkv, a.head_dim, a.block_size
    settings, plan = rocket_plan(ctx, budget, a)
    ps = settings.page_size
    if not plan.compress:
        return None
    nc, ts = plan.num_compact, plan.tail_start
    seq_len = ctx + a.generated
    # Engine-wide bounds the backend would use: view <= prompt_budget +
    # one block + max_new_tokens.
    max_pages = -(-plan.prompt_budget // ps) + -(-(bs + a.max_new_tokens) // ps) + 1
    max_select = max(plan.topk // ps, 1)
    compact_blocks = -(-nc // bs)
    tail_blocks = -(-(seq_len - ts) // bs)
    view_blocks = compact_blocks + tail_blocks
    kv, kt = make_cache(batch * view_blocks + 1, hkv, d, bs, ps, a.dtype, dev)
    logical_blocks = -(-seq_len // bs)
    table = torch.zeros(batch, logical_blocks, dtype=torch.int32, device=dev)
    perm = torch.randperm(batch * view_blocks, device=dev).add(1).to(torch.int32)
    perm = perm.view(batch, view_blocks)
    table[:, :compact_blocks] = perm[:, :compact_blocks]
    table[:, ts // bs: ts // bs + tail_blocks] = perm[:, compact_blocks:]
    # KT pages of the view (Stage 1 builds them; values do not matter here)
    for b in range(batch):
        triton_ops.write_kt_pages(kv, kt, table[b], 0, nc, ps)
        triton_ops.write_kt_pages(kv, kt, table[b], ts, seq_len, ps)

    def ints(v):
        return torch.full((batch,), v, dtype=torch.int32, device=dev)

    nc_t, ts_t, seq_t = ints(nc), ints(ts), ints(seq_len)
    topk_t, topr_t = ints(plan.topk), ints(plan.topr)
    q = torch.randn(batch, hq, d, dtype=a.dtype, device=dev)
    out = torch.empty_like(q)
    scale = d**-0.5
    def call():
        triton_ops.hsa_decode_batch(q, kv, kt, table, nc_t, ts_t, seq_t, topk_t, topr_t,
                                    ps, scale, max_pages, max_select, out=out)

    ms_eager = timer(call)
    ms_graph, why = timer.graph(call)
    ms = ms_graph if ms_graph is not None else ms_eager
    # components
    ms_kt = timer(lambda: kt_update(kv, kt, table, seq_t, ps))
    ms_score = timer(lambda: hsa_page_probs(q, kt, table, nc_t, ts_t, seq_t, topr_t,
                                            ps, max_pages))
    probs = hsa_page_probs(q, kt, table, nc_t, ts_t, seq_t, topr_t, ps, max_pages)
    ms_topk = timer(lambda: select_pages(probs, max_select, nc_t, ts_t, seq_t, topk_t, ps))
    ms_topk_torch = timer(lambda: select_pages(probs, max_select, impl="torch"))
    sel = select_pages(probs, max_select, nc_t, ts_t, seq_t, topk_t, ps)
    ms_sparse = timer(lambda: sparse_decode(q, kv, table, sel, nc_t, ts_t, seq_t, topk_t,
                                            ps, scale, out=out))
    esize = kv.element_size()
    num_pages = -(-nc // ps) + -(-(seq_len - ts) // ps)
    sparse_bytes = batch * hkv * min(max_select, num_pages) * ps * 2 * d * esize
    # scoring reads the whole KT page (min|max, 2d values) of every view
    # page, writes + reads the fp32 logits, writes the probabilities
    score_bytes = (batch * hkv * num_pages * 2 * d * esize
                   + batch * hq * num_pages * 4 * 2 + batch * hkv * max_pages * 4)
    del kv, kt
    return {
        "ms": ms, "ms_eager": ms_eager, "ms_graph": ms_graph, "graph_error": why,
        "ms_select_torch_topk": ms_topk_torch, "page_size": ps, "prompt_budget": plan.prompt_budget,
        "num_compact": nc, "tail_start": ts, "seq_len": seq_len, "topk": plan.topk,
        "topr": plan.topr, "view_pages": num_pages, "max_pages": max_pages,
        "max_select": max_select, "ms_kt_update": ms_kt, "ms_scoring": ms_score,
        "ms_select": ms_topk, "ms_sparse_attention": ms_sparse,
        "sparse_bytes": sparse_bytes,
        "sparse_gbs": sparse_bytes / (ms_sparse * 1e-3) / 1e9,
        "scoring_bytes": score_bytes,
        "scoring_gbs": score_bytes / (ms_score * 1e-3) / 1e9,
    }


def bench_stage1(a, dev, timer):
    """Stage 1 of one request vs the prefill attention over its prompt."""
    n, hq, hkv, d, bs = a.stage1_context, a.hq, a.hkv, a.head_dim, a.block_size
    settings, plan = rocket_plan(n, a.stage1_budget, a)
    ps, w, kernel = settings.page_size, settings.window_size, settings.kernel_size
    blocks = -(-n // bs)
    kv, kt = make_cache(blocks + 1, hkv, d, bs, ps, a.dtype, dev)
    row = torch.randperm(blocks, device=dev).add(1).to(torch.int32)
    q_win = torch.randn(w, hq, d, dtype=a.dtype, device=dev)
    scale = d**-0.5
    protect_from = min(n - w, plan.tail_start)

    def stage1():
        return triton_ops.snapkv_compress(kv, kt, row, q_win, n, plan.prompt_budget,
                                          plan.tail_start, kernel, ps, scale)

    ms_total = timer(stage1)
    ms_scores = timer(lambda: triton_ops.window_scores(q_win, kv, row, n, scale))
    ms_keep = timer(lambda: triton_ops.snapkv_keep_positions(
        kv, row, q_win, n, plan.prompt_budget, kernel, protect_from, scale))
    kept = stage1()
    num_compact = plan.prompt_budget - (n - plan.tail_start)
    ms_compact = timer(lambda: triton_ops.compact_kept_tokens(
        kv, row, kept[:, :num_compact]))
    ms_kt = timer(lambda: (
        triton_ops.write_kt_pages(kv, kt, row, 0, num_compact, ps),
        triton_ops.write_kt_pages(kv, kt, row, plan.tail_start, n, ps)))
    # Prefill attention over the same prompt (one layer), GQA via expansion.
    q = torch.randn(1, hq, n, d, dtype=a.dtype, device=dev)
    k = torch.randn(1, hkv, n, d, dtype=a.dtype, device=dev)
    v = torch.randn_like(k)
    group = hq // hkv
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def prefill_gqa():
        return sdpa(q, k, v, is_causal=True, enable_gqa=True)

    def prefill_expand():
        return sdpa(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                    is_causal=True)

    def run_prefill():
        for fn, how in ((prefill_gqa, "sdpa enable_gqa"), (prefill_expand, "sdpa expand")):
            try:
                fn()
            except Exception:  # noqa: BLE001  (backend without GQA support)
                continue
            return timer(fn), how
        raise RuntimeError("no SDPA backend ran")

    backend = "default"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        if dev.type == "cuda":
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                ms_prefill, how = run_prefill()
            backend = "flash"
        else:
            ms_prefill, how = run_prefill()
    except (ImportError, RuntimeError):
        ms_prefill, how = run_prefill()
    ms_expand = timer(lambda: (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    if how != "sdpa expand":
        ms_expand = 0.0
    return {
        "context": n, "budget": a.stage1_budget, "prompt_budget": plan.prompt_budget,
        "page_size": ps, "window": w, "kernel_size": kernel,
        "ms_stage1": ms_total, "ms_window_scores": ms_scores,
        "ms_scores_pool_topk": ms_keep, "ms_compaction": ms_compact,
        "ms_kt_build": ms_kt, "ms_prefill_attention": ms_prefill,
        "ms_prefill_gqa_expand": ms_expand, "prefill_impl": f"{how} ({backend})",
        "fraction_of_prefill_attention": ms_total / ms_prefill,
        "fraction_excluding_expand": ms_total / max(ms_prefill - ms_expand, 1e-9),
    }


def main():
    a = parse_args()
    a.hq, a.hkv = (int(x) for x in a.heads.split(","))
    dev = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    if not a.smoke and dev.type != "cuda":
        sys.exit("no CUDA device: use --smoke for the CPU check")
    a.dtype = torch.bfloat16
    torch.manual_seed(0)
    timer = Timer(dev, a.warmup, a.iters)
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (interpreter)"
    copy_gbs = copy_bandwidth(dev, timer, (4 << 30) if dev.type == "cuda" else (64 << 20))
    print(f"card: {card}   copy bandwidth: {copy_gbs:.0f} GB/s   "
          f"torch {torch.__version__}", flush=True)
    print(f"triton {triton.__version__}  Hq={a.hq} Hkv={a.hkv} d={a.head_dim} "
          f"bs={a.block_size} bf16", flush=True)

    rows, skipped = [], []
    result = {
        "card": card,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "torch": torch.__version__, "triton": triton.__version__,
        "shape": {"hq": a.hq, "hkv": a.hkv, "head_dim": a.head_dim,
                  "block_size": a.block_size, "dtype": "bfloat16",
                  "generated": a.generated, "max_new_tokens": a.max_new_tokens},
        "copy_bandwidth_gbs": copy_gbs,
        "rows": rows,
        "stage1": None,
        "skipped": skipped,
        "smoke": bool(a.smoke),
    }

    def dump():
        """(Re)write the JSON: partial results survive a timeout."""
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out + ".tmp", "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)
            os.replace(a.out + ".tmp", a.out)

    try:  # first, so that a time-out in the big table does not lose it
        stage1 = bench_stage1(a, dev, timer)
        print("stage 1 at {context} tokens (budget {budget}, prompt_budget {prompt_budget}): "
              "{ms_stage1:.3f} ms = window scores {ms_window_scores:.3f} + pool/topk "
              "(incl. scores) {ms_scores_pool_topk:.3f} + compaction {ms_compaction:.3f} + "
              "KT build {ms_kt_build:.3f}; prefill attention {ms_prefill_attention:.3f} ms "
              "[{prefill_impl}] -> {frac:.1%} of prefill attention"
              .format(frac=stage1["fraction_of_prefill_attention"], **stage1), flush=True)
    except Exception as exc:  # noqa: BLE001
        stage1 = {"error": f"{type(exc).__name__}: {exc}"}
        print("stage 1 failed:", stage1["error"], flush=True)
    result["stage1"] = stage1
    dump()
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    contexts = [int(x) for x in a.contexts.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    budgets = [int(x) for x in a.budgets.split(",")]
    header = (f"{'context':>8} {'batch':>5} {'method':>9} {'budget':>6} {'ms':>9} "
              f"{'GB/s':>7} {'%copy':>6} {'speedup':>8}  detail")
    print(header)
    t_start = time.time()
    for ctx in contexts:
        for batch in batches:
            if a.time_budget is not None and time.time() - t_start > a.time_budget:
                skipped.append({"context": ctx, "batch": batch, "reason": "time budget"})
                print(f"{ctx:>8} {batch:>5} skipped (time budget)", flush=True)
                continue
            need = batch * ctx * a.hkv * 2 * a.head_dim * 2
            if need * 1.3 + (1 << 30) > free_bytes(dev):
                skipped.append({"context": ctx, "batch": batch,
                                "reason": f"dense cache {need / 2**30:.1f} GiB"})
                print(f"{ctx:>8} {batch:>5} skipped (memory)", flush=True)
                continue
            dense = bench_dense(ctx, batch, a, dev, timer)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(dict(dense, context=ctx, batch=batch, method="dense", budget=None,
                             pct_copy_bw=100 * dense["gbs"] / copy_gbs))
            print(f"{ctx:>8} {batch:>5} {'dense':>9} {'-':>6} {dense['ms']:>9.4f} "
                  f"{dense['gbs']:>7.0f} {100 * dense['gbs'] / copy_gbs:>5.0f}% "
                  f"{'1.00':>8}  eager {dense['ms_eager']:.4f}"
                  + (f" (no graph: {dense['graph_error']})" if dense["graph_error"]
                     and dev.type == "cuda" else ""), flush=True)
            for budget in budgets:
                r = bench_rocket(ctx, budget, batch, a, dev, timer)
                if r is None:
                    continue
                r.update({"context": ctx, "batch": batch, "method": "rocketkv",
                          "budget": budget, "speedup_vs_dense": dense["ms"] / r["ms"],
                          "pct_copy_bw_sparse": 100 * r["sparse_gbs"] / copy_gbs})
                rows.append(r)
                print(f"{ctx:>8} {batch:>5} {'rocketkv':>9} {budget:>6} {r['ms']:>9.4f} "
                      f"{r['sparse_gbs']:>7.0f} {r['pct_copy_bw_sparse']:>5.0f}% "
                      f"{r['speedup_vs_dense']:>8.2f}  "
                      f"ps={r['page_size']} pages={r['view_pages']}/{r['max_pages']} "
                      f"sel={r['max_select']} r={r['topr']} | kt {r['ms_kt_update']:.4f} "
                      f"score {r['ms_scoring']:.4f} ({r['scoring_gbs']:.0f} GB/s) "
                      f"select {r['ms_select']:.4f} (torch.topk {r['ms_select_torch_topk']:.4f}) "
                      f"attn {r['ms_sparse_attention']:.4f} | eager {r['ms_eager']:.4f}",
                      flush=True)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()

            dump()

    dump()
    if a.out:
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
