"""Which layer-heads Stage 1 keeps a fact's number in (issue 59's ablation):
one of bench_multiturn's conversations, one fact asked alone, ROCKETKV's
Stage 1 only (the accuracy harness's ``rocketkv_stage1_only`` at budget B),
the kept positions recorded (test aid ``record_kept_positions``); for each
fact, the layer-heads that keep all of its number's tokens, part, none.

    .venv/bin/python scripts/stage1_kept_number.py --conversation 5 --fact 3
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--doc-tokens", default="2000-6000")
    ap.add_argument("--conversation", type=int, default=5)
    ap.add_argument("--fact", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker state in this process

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from rocketkv_eval.accuracy import method_settings
    from rocketkv_eval.bench_multiturn import doc_lengths
    from rocketkv_eval.model import resolve_model
    from rocketkv_eval.multiturn import make_conversation, question_ids
    from rocketkv_vllm.state import worker_state

    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    length = doc_lengths(args.doc_tokens, args.conversations)[args.conversation]
    conv = make_conversation(tokenizer, length, args.turns, seed=args.seed + args.conversation)
    ids = question_ids(tokenizer, conv, args.fact)
    settings = method_settings(
        "rocketkv_stage1_only", args.budget, 16, head_dim=64, length=len(ids)
    )
    llm = LLM(
        model=model,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=8192,
        kv_cache_memory_bytes=1 << 30,
        attention_backend="ROCKETKV",
        enable_prefix_caching=False,
        additional_config={
            "rocketkv": settings,
            "rocketkv_testing": {"record_kept_positions": True},
        },
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    print(f"{len(ids)} prompt tokens, settings {settings}")
    print(f"answer {out.outputs[0].text!r} (asked: {conv.facts[args.fact].value})")
    kept = worker_state(llm.llm_engine.vllm_config).kept_positions  # one entry per layer
    for i, fact in enumerate(conv.facts):
        digits = tokenizer.encode(fact.value, add_special_tokens=False)
        at = next(p for p in range(len(ids)) if ids[p : p + len(digits)] == digits)
        span = set(range(at, at + len(digits)))
        counts = {"whole": 0, "part": 0, "none": 0}
        dropped = []
        for layer, (_, positions) in enumerate(kept):
            for head in range(positions.shape[0]):
                n = len(span & set(positions[head].tolist()))
                key = "whole" if n == len(span) else "part" if n else "none"
                counts[key] += 1
                if not n:
                    dropped.append((layer, head))
        print(f"fact {i} {fact.value} ({len(digits)} tokens at {at}): layer-heads {counts}")
        if i == args.fact:
            print(f"  (layer, KV head) keeping none of it: {dropped}")
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
