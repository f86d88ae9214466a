"""Issue 59's ablation: the facts of bench_multiturn's conversations asked one
at a time (document + one question, no chat history), per method, each
answer classified: right, a truncated right number (fewer digits), another
fact's number (or a truncation of one), or wrong. Separates what the
multi-turn chat adds from what compression does to a single question.

    .venv/bin/python scripts/multiturn_single_turn.py --conversations 8 \\
        --doc-tokens 2000-6000 --pick 2,5,6,7 --json results/multiturn-single-turn.json

With ``--chat``, each fact is asked as its turn of the chat instead (the
document, the earlier questions, and the **dense engine's** own earlier
answers: dense runs first), so every method answers the same prompt and a
method's own earlier mistakes do not carry into its later turns.

Methods: dense (vLLM's CPU_ATTN), rocketkv (``token_budget`` B), and the
accuracy harness's ``rocketkv_stage1_only`` / ``rocketkv_stage2_only`` at
the same split. One engine per conversation and method (the ablations'
knobs follow the prompt length), prefix caching on (the four questions
share the document), bf16, greedy, ``min_tokens`` = ``max_tokens`` as the
multi-turn bench runs.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))


def classify(text: str, value: str, others: list[str]) -> str:
    if value in text:
        return "right"
    m = re.search(r"\d+", text)
    number = m.group(0) if m else ""
    if number and value.startswith(number):
        return "truncated"
    if number in others:
        return "other fact"
    if number and any(o.startswith(number) for o in others):
        return "other fact, truncated"
    return "wrong"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--doc-tokens", default="2000-6000")
    ap.add_argument("--pick", default=None, help="conversation indices (default: all)")
    ap.add_argument("--methods", default="dense,rocketkv,rocketkv_stage1_only,rocketkv_stage2_only")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chat", action="store_true", help="ask fact t as turn t of dense's chat")
    ap.add_argument(
        "--rocketkv-extra", default="{}", help="settings (JSON) added to every ROCKETKV method's"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from rocketkv_eval.accuracy import method_settings
    from rocketkv_eval.bench_multiturn import doc_lengths
    from rocketkv_eval.engines import in_process
    from rocketkv_eval.model import resolve_model
    from rocketkv_eval.multiturn import make_conversation, prompt_ids, question_ids

    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = doc_lengths(args.doc_tokens, args.conversations)
    picked = (
        [int(c) for c in args.pick.split(",")] if args.pick else list(range(args.conversations))
    )
    methods = args.methods.split(",")
    if args.chat and methods[0] != "dense":
        ap.error("--chat needs dense as the first method (its answers make the chat)")
    rows = []
    for c in picked:
        conv = make_conversation(tokenizer, lengths[c], args.turns, seed=args.seed + c)
        prompts = [question_ids(tokenizer, conv, f) for f in range(args.turns)]
        values = [f.value for f in conv.facts]
        for method in methods:
            length = sum(map(len, prompts)) // len(prompts)
            settings = method_settings(
                method, args.budget, args.max_tokens, head_dim=64, length=length
            )
            if settings is not None:
                settings = {**settings, **json.loads(args.rocketkv_extra)}
            kw = dict(
                model=model,
                dtype=args.dtype,
                enforce_eager=True,
                max_model_len=8192,
                kv_cache_memory_bytes=1 << 30,
                seed=args.seed,
                enable_prefix_caching=True,
            )
            if settings is None:
                kw.update(attention_backend="CPU_ATTN", block_size=32)
            else:
                kw.update(attention_backend="ROCKETKV", additional_config={"rocketkv": settings})
            with in_process():
                llm = LLM(**kw)
            try:
                t0 = time.perf_counter()
                params = SamplingParams(
                    temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens
                )
                if args.chat and method == "dense":  # turn by turn, its answers the chat's
                    outs, answers = [], []
                    for t in range(args.turns):
                        prompts[t] = prompt_ids(tokenizer, conv, t, answers)
                        (out,) = llm.generate(
                            [{"prompt_token_ids": prompts[t]}], params, use_tqdm=False
                        )
                        outs.append(out)
                        answers.append(out.outputs[0].text)
                else:
                    outs = llm.generate(
                        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
                    )
                took = time.perf_counter() - t0
            finally:
                llm.llm_engine.engine_core.shutdown()
            for f, out in enumerate(outs):
                text = out.outputs[0].text
                others = [v for i, v in enumerate(values) if i != f]
                rows.append(
                    {
                        "conversation": c,
                        "fact": f,
                        "method": method,
                        "settings": settings,
                        "prompt_tokens": len(prompts[f]),
                        "value": values[f],
                        "text": text,
                        "class": classify(text, values[f], others),
                    }
                )
                print(c, f, method, rows[-1]["class"], repr(text), flush=True)
            print(f"  conversation {c} {method}: {took:.1f} s", flush=True)
    summary = {}
    for r in rows:
        summary.setdefault(r["method"], {}).setdefault(r["class"], 0)
        summary[r["method"]][r["class"]] += 1
    for method, counts in summary.items():
        print(method, counts)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": " ".join(sys.argv),
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "summary": summary,
                    "rows": rows,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
