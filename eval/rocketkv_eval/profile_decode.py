"""Where a decode step's time goes: one in-process engine, torch.profiler.

    .venv/bin/python scripts/profile_decode.py --method dense --length 4000
    .venv/bin/python scripts/profile_decode.py --method token_budget=256 --length 4000

Prefills N prompts of L tokens (needle prompts, prefix caching off), times
--steps decode steps, then profiles --profile-steps more and prints the top
operators by self CPU time. `--method dense` is vLLM's own backend for the
platform; anything else is ROCKETKV with those settings (`+`-joined, as in
bench_e2e.py). Results of a run: results/profile-cpu-decode.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from unittest import mock

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # profile in-process
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rocketkv_eval.e2e import parse_method  # same method syntax as bench_e2e.py


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="token_budget=256")
    ap.add_argument("--model", default=None, help="model dir (default: embedded SmolLM2)")
    ap.add_argument("--length", type=int, default=4000)
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-steps", type=int, default=10)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--rows", type=int, default=25, help="operators to print")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from rocketkv_eval.model import prepare_default_model
    from rocketkv_eval.needle import build_needle_prompt

    model = args.model or prepare_default_model()
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [
        build_needle_prompt(tok, args.length, 0.5, seed=i).token_ids
        for i in range(args.num_prompts)
    ]
    new_tokens = 5 + args.steps + args.profile_steps + 5
    kw = dict(
        model=model,
        dtype=args.dtype,
        max_model_len=args.length + new_tokens + 64,
        enable_prefix_caching=False,
        max_num_batched_tokens=2048,
        seed=0,
    )
    if torch.cuda.is_available():
        kw["gpu_memory_utilization"] = 0.5
    else:
        kw["kv_cache_memory_bytes"] = 2 << 30
    if args.block_size:
        kw["block_size"] = args.block_size
    _, settings = parse_method(args.method)
    if settings is not None:
        kw.update(attention_backend="ROCKETKV", additional_config={"rocketkv": settings})
    llm = LLM(**kw)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=ids), params)
    scheduler = engine.engine_core.engine_core.scheduler

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    start, steps = time.perf_counter(), 0
    while scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
    ):
        engine.step()
        steps += 1
    sync()
    print(f"prefill: {time.perf_counter() - start:.2f} s in {steps} steps")
    for _ in range(5):
        engine.step()
    sync()
    builds = []  # host time of ROCKETKV's metadata builder in the timed steps
    timing = contextlib.nullcontext()
    if settings is not None:
        from rocketkv_vllm.backend.metadata import RocketKVMetadataBuilder

        build = RocketKVMetadataBuilder.build

        def timed_build(self, *a, **k):
            t = time.perf_counter()
            try:
                return build(self, *a, **k)
            finally:
                builds.append(time.perf_counter() - t)

        timing = mock.patch.object(RocketKVMetadataBuilder, "build", timed_build)
    start = time.perf_counter()
    with timing:
        for _ in range(args.steps):
            engine.step()
        sync()
    ms = (time.perf_counter() - start) / args.steps * 1e3
    print(f"decode step: {ms:.1f} ms ({args.num_prompts} tokens per step)")
    if builds:
        print(
            f"metadata builder: {sum(builds) / args.steps * 1e3:.3f} ms of host time per step "
            f"({len(builds) / args.steps:g} calls a step)"
        )
    with torch.profiler.profile() as prof:
        for _ in range(args.profile_steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
