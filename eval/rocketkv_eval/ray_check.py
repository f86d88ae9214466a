"""ROCKETKV under vLLM's Ray executor gives one process's greedy tokens.

    pip install ray            # not in the CPU install (see below)
    python scripts/ray_check.py [--tp 1] [--model DIR] [--json out.json]

Starts two engines one after the other on the same prompts (RULER-style
needle samples of ~1,024 tokens, compressed at ``token_budget`` 128):
vLLM's default executor for that TP size and
``distributed_executor_backend="ray"`` at ``--tp`` ranks, and compares their
greedy tokens. Exit status 1 when they differ.

Why a script and not a CI test: vLLM 0.32's CPU platform has no Ray device
key, so its Ray executor refuses to start there ("ValueError: current platform
cpu does not support ray.", ``vllm/v1/executor/ray_utils.py``; measured on
the CPU build, 2026-12-01). It needs an NVIDIA (or other Ray-capable) vLLM
build; ``--tp`` must divide the model's KV heads (SmolLM2: 1 or 3) and fit
the GPUs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROCKETKV = {"token_budget": 128, "max_new_tokens": 16}


def greedy_tokens(model: str, prompts, executor: str | None, tp: int) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    kw = dict(
        model=model,
        attention_backend="ROCKETKV",
        tensor_parallel_size=tp,
        max_model_len=1100,
        enforce_eager=True,
        seed=0,
        additional_config={"rocketkv": ROCKETKV},
    )
    if executor is not None:
        kw["distributed_executor_backend"] = executor
    llm = LLM(**kw)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: embedded SmolLM2")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    from rocketkv_eval import tasks as eval_tasks
    from rocketkv_eval.model import prepare_default_model

    model = args.model or prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    samples = eval_tasks.make_samples("niah_single", tokenizer, 1024, args.samples)
    prompts = [TokensPrompt(prompt_token_ids=s.token_ids) for s in samples]
    one = greedy_tokens(model, prompts, None, args.tp)
    ray = greedy_tokens(model, prompts, "ray", args.tp)
    same = one == ray
    result = {"tp": args.tp, "executor": "ray", "prompts": len(prompts), "same_greedy_tokens": same}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
