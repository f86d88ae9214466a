"""How many long requests decode at once under one KV-cache size: dense vs ROCKETKV.

Sends N long-prompt requests to an in-process vLLM engine with a fixed KV
cache size and steps it to completion, watching vLLM's own scheduler:
peak number of requests decoding at once, preemptions, wall time, and KV
blocks each request holds right after its prefill.

    python scripts/bench_capacity.py                       # CPU, SmolLM2
    python scripts/bench_capacity.py --json --requests 8 --prompt-tokens 6000

Runs unchanged on a GPU machine (pass --model and --dtype as needed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

from rocketkv_eval.engines import external_id, held_blocks, in_process, scheduler
from rocketkv_eval.model import MODEL_HELP

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class CapacityResult:
    method: str
    budget: int | None
    requests: int
    finished: int
    peak_decoding: int
    preemptions: int
    wall_s: float
    num_blocks: int
    block_size: int
    block_bytes: int  # one block of every layer, KT pages included
    blocks_after_prefill: list[int] = field(default_factory=list)
    expected_blocks: int | None = None
    outputs: dict[str, list[int]] = field(default_factory=dict, repr=False)


def _attention_layers(cfg: dict) -> tuple[int, int, int | None]:
    """(full-attention layers, sliding-window layers, window) of a config."""
    layers = cfg["num_hidden_layers"]
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if not window:
        return layers, 0, None
    if types is None:  # every layer slides (Mistral-style)
        return 0, layers, window
    sliding = sum(t == "sliding_attention" for t in types)
    return layers - sliding, sliding, window


def kv_bytes_for_tokens(
    model_path: str, tokens: int, dtype_bytes: int, block_size: int = 32
) -> int:
    """Plain (dense) KV bytes for `tokens` tokens of the model: every token
    in full-attention layers, a window's blocks in sliding-window layers."""
    cfg = json.load(open(os.path.join(model_path, "config.json")))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    full, sliding, window = _attention_layers(cfg)
    held = 0 if window is None else min(tokens, (math.ceil(window / block_size) + 1) * block_size)
    return int(per_token * (full * tokens + sliding * held))


def has_sliding_layers(model_path: str) -> bool:
    cfg = json.load(open(os.path.join(model_path, "config.json")))
    return _attention_layers(cfg)[1] > 0


def run_capacity(
    model_path: str,
    backend: str,
    prompts: list[list[int]],
    kv_cache_bytes: int,
    rocketkv: dict | None = None,
    max_tokens: int = 32,
    block_size: int = 32,
    dtype: str = "auto",
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 8192,
    engine_kw: dict | None = None,
    testing: dict | None = None,
    logprobs: bool = False,
) -> CapacityResult:
    """One batch of ``prompts`` through a fresh engine with ``kv_cache_bytes``
    of KV cache; ``logprobs``: each output is (token ids, their logprobs)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(
        model=model_path,
        attention_backend=backend,
        max_model_len=max_model_len,
        enforce_eager=True,
        dtype=dtype,
        block_size=block_size,
        kv_cache_memory_bytes=kv_cache_bytes,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=len(prompts),
    )
    if rocketkv is not None:
        kw["additional_config"] = {"rocketkv": rocketkv}
        if testing:  # ROCKETKV's test aids (config.TestAids)
            kw["additional_config"]["rocketkv_testing"] = testing
    kw.update(engine_kw or {})
    with in_process():
        llm = LLM(**kw)
    engine = llm.llm_engine
    sched = scheduler(llm)
    num_blocks = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    block_bytes = sum(
        g.kv_cache_spec.page_size_bytes * len(g.layer_names)
        for g in sched.kv_cache_config.kv_cache_groups
    )

    preemptions = 0
    original_preempt = sched._preempt_request

    def counting_preempt(*args, **kwargs):
        nonlocal preemptions
        preemptions += 1
        return original_preempt(*args, **kwargs)

    sched._preempt_request = counting_preempt
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1 if logprobs else None
    )
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, toks in zip(ids, prompts):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=toks), params)

    peak = 0
    after_prefill: dict[str, int] = {}
    outputs: dict[str, list[int] | tuple[list[int], list[float]]] = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                tokens = list(o.token_ids)
                outputs[out.request_id] = (
                    (tokens, [step[t].logprob for step, t in zip(o.logprobs, tokens)])
                    if logprobs
                    else tokens
                )
        decoding = [r for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens]
        peak = max(peak, len(decoding))
        for r in decoding:
            # Blocks go back when the request is next scheduled, so look once
            # its first decode step has run.
            if r.num_computed_tokens > r.num_prompt_tokens and external_id(r) not in after_prefill:
                after_prefill[external_id(r)] = held_blocks(sched, r.request_id)
    wall = time.perf_counter() - start
    free_after = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    llm.llm_engine.engine_core.shutdown()
    del llm
    assert free_after == num_blocks, f"leak: {num_blocks - free_after} blocks"
    budget = (rocketkv or {}).get("prompt_budget")
    return CapacityResult(
        method="rocketkv" if backend == "ROCKETKV" else "dense",
        budget=budget,
        requests=len(prompts),
        finished=len(outputs),
        peak_decoding=peak,
        preemptions=preemptions,
        wall_s=round(wall, 2),
        num_blocks=num_blocks,
        block_size=block_size,
        block_bytes=block_bytes,
        blocks_after_prefill=[after_prefill.get(r, -1) for r in ids],
        outputs=outputs,
    )


def expected_blocks(prompt_budget: int, num_prompt_tokens: int, block_size: int) -> int:
    """ceil((prompt_budget + tail) / block_size) of the acceptance criterion,
    tail = the tokens held in place in the prompt's last, partly filled block."""
    tail = num_prompt_tokens % block_size
    return math.ceil((prompt_budget + tail) / block_size)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=6000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--budget", type=int, default=512, help="ROCKETKV prompt_budget")
    ap.add_argument(
        "--fit-dense",
        type=float,
        default=2.2,
        help="KV cache size in dense requests it holds (default 2.2)",
    )
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="prefill chunk (vLLM's; a sliding-window layer holds its window plus one chunk "
        "while a prompt fills it: keep it small for hybrid models)",
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="vLLM's kv_cache_dtype for both methods (fp8 on CPU: AVX-512 or AMX); the cache "
        "stays sized by --fit-dense requests of the model dtype",
    )
    ap.add_argument("--methods", default="dense,rocketkv")
    ap.add_argument(
        "--dense-backend", default=None, help="vLLM backend for the dense run (default: platform's)"
    )
    ap.add_argument(
        "--no-prefix-caching", action="store_true", help="switch vLLM's prefix caching off"
    )
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--out", default=None, help="also write the JSON report here")
    args = ap.parse_args(argv)

    from rocketkv_eval.model import resolve_model

    model = resolve_model(args.model)
    import random

    rng = random.Random(0)
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(model).vocab_size
    prompts = [
        [rng.randrange(100, vocab - 100) for _ in range(args.prompt_tokens)]
        for _ in range(args.requests)
    ]
    dtype_bytes = 4 if args.dtype == "float32" else 2
    kv_bytes = int(
        args.fit_dense
        * kv_bytes_for_tokens(
            model, args.prompt_tokens + args.max_tokens, dtype_bytes, args.block_size
        )
    )

    caching = {
        "enable_prefix_caching": not args.no_prefix_caching,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    results = []
    for method in args.methods.split(","):
        if method == "dense":
            from vllm.platforms import current_platform

            backend = args.dense_backend or (
                "CPU_ATTN" if current_platform.is_cpu() else "TRITON_ATTN"
            )
            res = run_capacity(
                model,
                backend,
                prompts,
                kv_bytes,
                None,
                args.max_tokens,
                args.block_size,
                args.dtype,
                max_num_batched_tokens=args.max_num_batched_tokens,
                engine_kw=caching,
            )
        else:
            res = run_capacity(
                model,
                "ROCKETKV",
                prompts,
                kv_bytes,
                {"prompt_budget": args.budget},
                args.max_tokens,
                args.block_size,
                args.dtype,
                max_num_batched_tokens=args.max_num_batched_tokens,
                engine_kw=caching,
            )
            if not has_sliding_layers(model):  # held_blocks counts every group
                res.expected_blocks = expected_blocks(
                    args.budget, args.prompt_tokens, args.block_size
                )
        results.append(res)

    rows = [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in results]
    report = {
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
        "date": time.strftime("%Y-%m-%d"),
        "kv_cache_bytes": kv_bytes,
        "prompt_tokens": args.prompt_tokens,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "prefix_caching": not args.no_prefix_caching,
        "results": rows,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"KV cache {kv_bytes / 2**20:.0f} MiB, {args.requests} requests x "
        f"{args.prompt_tokens} prompt tokens, {args.max_tokens} new tokens"
    )
    print(
        f"{'method':10} {'budget':>6} {'done':>5} {'peak':>5} {'preempt':>8} "
        f"{'wall s':>7} {'blocks':>7} {'KiB/block':>9} {'held/request after prefill'}"
    )
    for r in results:
        expected = f" (expected {r.expected_blocks})" if r.expected_blocks else ""
        print(
            f"{r.method:10} {str(r.budget or '-'):>6} {r.finished:>5} "
            f"{r.peak_decoding:>5} {r.preemptions:>8} {r.wall_s:>7} "
            f"{r.num_blocks:>7} {r.block_bytes / 1024:>9.1f} {r.blocks_after_prefill}{expected}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
