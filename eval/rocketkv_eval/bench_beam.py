"""Requests that decode nothing, side by side: vLLM's own attention backend
vs ROCKETKV.

Two workloads on one in-process engine per backend (prefix caching on, as
vLLM's default):

- beam search: ``LLM.beam_search`` over P needle prompts of L tokens (beam
  width W, T new tokens). vLLM runs each step as ``max_tokens`` 1 requests
  over the beams' whole sequences;
- scoring: 4 x P prompts (prefixes of the same prompts) with ``max_tokens``
  1 and the top-5 logprobs of the one token.

Per backend: the wall time of each workload; then whether ROCKETKV's beams
(tokens, cumulative logprobs to 1e-4) and first tokens equal the dense
backend's.

    python scripts/bench_beam.py
    python scripts/bench_beam.py --prompt-tokens 3000,4000 --beam-width 4 --new-tokens 16 --json

``--json`` writes results/beam-<platform>.json with the command, machine and date.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rocketkv_eval.e2e import dense_backend_name, machine_info, platform_name  # noqa: E402
from rocketkv_eval.engines import in_process  # noqa: E402
from rocketkv_eval.model import MODEL_HELP, resolve_model  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--prompt-tokens", default="3000,4000", help="one prompt per length")
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=256, help="ROCKETKV's token_budget")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="both engines' (default: ROCKETKV's, 32 on CPU, so both run one dense kernel)",
    )
    ap.add_argument("--json", action="store_true", help="write results/beam-<platform>.json")
    return ap.parse_args(argv)


def run_backend(args, model: str, ids: list[list[int]], backend: str) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform
    from vllm.sampling_params import BeamSearchParams

    from rocketkv_vllm.engine import DEFAULT_CPU_BLOCK_SIZE

    extra = {}
    if args.block_size or current_platform.is_cpu():
        extra["block_size"] = args.block_size or DEFAULT_CPU_BLOCK_SIZE
    if backend == "ROCKETKV":
        extra["additional_config"] = {"rocketkv": {"token_budget": args.token_budget}}
    with in_process():
        llm = LLM(
            model=model,
            attention_backend=backend,
            dtype=args.dtype,
            max_model_len=max(map(len, ids)) + args.new_tokens + 64,
            kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
            **extra,
        )
    try:
        t0 = time.perf_counter()
        beams = llm.beam_search(
            [TokensPrompt(prompt_token_ids=i) for i in ids],
            BeamSearchParams(beam_width=args.beam_width, max_tokens=args.new_tokens),
        )
        beam_s = time.perf_counter() - t0
        scored = [i[: len(i) * (4 + k) // 8] for k in range(4) for i in ids]
        t0 = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=i) for i in scored],
            SamplingParams(max_tokens=1, logprobs=5, temperature=0.0),
            use_tqdm=False,
        )
        score_s = time.perf_counter() - t0
    finally:
        llm.llm_engine.engine_core.shutdown()
    first = []
    for o in outs:
        token = o.outputs[0].token_ids[0]
        first.append((token, o.outputs[0].logprobs[0][token].logprob))
    return {
        "backend": backend,
        "beam_search_s": round(beam_s, 2),
        "scoring_s": round(score_s, 2),
        "beams": [
            [(s.tokens[len(i) :], s.cum_logprob) for s in b.sequences] for b, i in zip(beams, ids)
        ],
        "first_tokens": first,
    }


def same(a: list, b: list) -> bool:
    """Token lists equal, logprobs within 1e-4 (nested (tokens, logprob) pairs)."""
    return len(a) == len(b) and all(x[0] == y[0] and abs(x[1] - y[1]) <= 1e-4 for x, y in zip(a, b))


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from rocketkv_eval.needle import build_needle_prompt

    model = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model)
    lengths = [int(x) for x in args.prompt_tokens.split(",")]
    ids = [
        tok(build_needle_prompt(tok, n, 0.5, seed=s).prompt).input_ids
        for s, n in enumerate(lengths, 1)
    ]
    rows = [run_backend(args, model, ids, b) for b in (dense_backend_name(), "ROCKETKV")]
    dense, ours = rows
    ours["beams_equal_dense"] = all(same(a, b) for a, b in zip(ours["beams"], dense["beams"]))
    ours["first_tokens_equal_dense"] = same(ours["first_tokens"], dense["first_tokens"])
    for r in rows:
        print(
            f"{r['backend']:>10}: beam search {r['beam_search_s']:7.2f} s, "
            f"scoring {r['scoring_s']:6.2f} s"
        )
    print(
        f"ROCKETKV equals {dense['backend']}: beams {ours['beams_equal_dense']}, "
        f"first tokens {ours['first_tokens_equal_dense']}"
    )
    if args.json:
        report = {
            "command": " ".join(
                ["python", "scripts/bench_beam.py"] + (argv if argv is not None else sys.argv[1:])
            ),
            "date": time.strftime("%Y-%m-%d"),
            "machine": machine_info(),
            "prompt_tokens": [len(i) for i in ids],
            "beam_width": args.beam_width,
            "new_tokens": args.new_tokens,
            "token_budget": args.token_budget,
            "dtype": args.dtype,
            "rows": rows,
        }
        path = os.path.join("results", f"beam-{platform_name()}.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print("wrote", path, file=sys.stderr)
    return 0
