"""Multi-turn chats over long documents: dense vs ROCKETKV, with vLLM's
prefix cache on and off.

C conversations x T turns over documents of L tokens (``multiturn``: one
passphrase fact asked per turn, each turn the whole conversation so far),
all conversations at once, each next turn sent when its previous one
finished. One in-process engine per method, the same KV cache size for all:

- ``dense``: vLLM's own backend for the platform, prefix caching on;
- ``rocketkv``: ROCKETKV (``--rocketkv`` settings), prefix caching on;
- ``rocketkv-nocache``: ROCKETKV, prefix caching off;
- ``dense+host``, ``rocketkv+host`` (with ``--host-gib``): the same with a host
  tier of that size (vLLM's ``kv_offloading_size``): prefix-cache blocks the
  KV cache evicts are loaded back from host memory.

Per method and turn: TTFT p50 / p90 (vLLM's engine timestamps, queued to
first token), wall time of the turn (first submission to last finish), the
share of prompt tokens served from the prefix cache (and, per method, the
cached tokens that came from the device and from the host), KV blocks held per
request after its prefill, answers right; per method: wall time, peak
requests running at once, preemptions, and the pool's blocks beside the
time-weighted mean of its free ones (the most the prefix cache can hold
while the requests run: cached blocks are free blocks).

    python scripts/bench_multiturn.py --conversations 1 --turns 4 --doc-tokens 6000
    python scripts/bench_multiturn.py --conversations 8 --turns 4 \\
        --doc-tokens 2000-6000 --fit-dense-conversations 3 --json

Runs unchanged on a GPU machine (``--model``, ``--dtype``); ``--json``
writes results/multiturn-<platform>.json with the command, machine and date.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rocketkv_eval.model import MODEL_HELP  # noqa: E402

METHODS = ("dense", "rocketkv", "rocketkv-nocache")
HOST_METHODS = ("dense+host", "rocketkv+host")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--conversations", type=int, default=1)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument(
        "--doc-tokens",
        default="6000",
        help="document length, or LO-HI spread over the conversations",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        help="new tokens per turn: exactly this many (EOS masked, as vLLM's "
        "multi_turn benchmark with --no-early-stop), so every method "
        "does the same work",
    )
    ap.add_argument(
        "--early-stop",
        action="store_true",
        help="let a turn end at EOS (the methods' work then differs)",
    )
    ap.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated, of {', '.join(METHODS + HOST_METHODS)} (default: the first three)",
    )
    ap.add_argument(
        "--host-gib",
        type=float,
        default=None,
        help="host tier size for the +host methods (GiB of host memory, vLLM's "
        "--kv-offloading-size)",
    )
    ap.add_argument(
        "--host-copies",
        choices=("sync", "async"),
        default="sync",
        help="the host tier's copies on vLLM's CPU build: sync (done in the step that issues "
        "them) or async (a background thread, each done 0-3 steps later, seeded by --seed: "
        "how vLLM's CUDA worker completes them)",
    )
    ap.add_argument("--rocketkv", default='{"token_budget": 256}', help="ROCKETKV settings (JSON)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument(
        "--fit-dense-conversations",
        type=float,
        default=None,
        help="KV cache sized to hold this many dense conversations at their "
        "last turn (default: 1 GiB on CPU, vLLM's choice on GPU)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--json", action="store_true", help="add this workload to results/multiturn-<platform>.json"
    )
    ap.add_argument("--out", default=None, help="write the JSON report here")
    return ap.parse_args(argv)


def doc_lengths(spec: str, n: int) -> list[int]:
    if "-" in spec:
        lo, hi = (int(x) for x in spec.split("-"))
        return [lo + round((hi - lo) * i / max(n - 1, 1)) for i in range(n)]
    return [int(spec)] * n


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def summarize(result, turns: int) -> dict:
    per_turn = []
    for t in range(turns):
        rows = [r for r in result.turns if r.turn == t]
        if not rows:
            continue
        prompt = sum(r.prompt_tokens for r in rows)
        per_turn.append(
            {
                "turn": t + 1,
                "ttft_p50_s": round(pct([r.ttft_s for r in rows], 0.5), 3),
                "ttft_p90_s": round(pct([r.ttft_s for r in rows], 0.9), 3),
                "wall_s": round(max(r.wall_s for r in rows), 2),
                "prompt_tokens": prompt,
                "cached_share": round(sum(r.cached_tokens for r in rows) / prompt, 4),
                "blocks_after_prefill": statistics.mean(
                    r.blocks_after_prefill for r in rows if r.blocks_after_prefill is not None
                )
                if any(r.blocks_after_prefill is not None for r in rows)
                else None,
                "correct": sum(r.correct for r in rows),
                "requests": len(rows),
            }
        )
    later = result.later()
    later_prompt = sum(r.prompt_tokens for r in later)
    return {
        "wall_s": round(result.wall_s, 2),
        "peak_running": result.peak_running,
        "preemptions": result.preemptions,
        "pool_blocks": result.pool_blocks,
        "free_blocks_mean": round(result.free_blocks_mean, 1),
        "finished": len(result.turns),
        "correct": sum(r.correct for r in result.turns),
        "later_turns_wall_s": round(sum(r.wall_s for r in later), 2),
        "later_turns_cached_share": round(sum(r.cached_tokens for r in later) / later_prompt, 4)
        if later_prompt
        else None,
        "per_turn": per_turn,
        "answers": [[r.conversation, r.turn, r.text] for r in result.turns],
    }


def kv_bytes_for_conversations(model: str, tokens: float, dtype: str) -> int:
    from rocketkv_eval.capacity import kv_bytes_for_tokens

    return int(kv_bytes_for_tokens(model, int(tokens), 4 if dtype == "float32" else 2))


def run_method(args, method: str, model: str, tokenizer, conversations, kv_bytes, progress) -> dict:
    from vllm import LLM
    from vllm.platforms import current_platform

    from rocketkv_eval.engines import in_process
    from rocketkv_eval.multiturn import run_conversations

    rocketkv = method.startswith("rocketkv")
    host = method.endswith("+host")
    kw = dict(
        model=model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=max(len(conversations), 1),
        disable_log_stats=False,
        enable_prefix_caching=method != "rocketkv-nocache",
        seed=args.seed,
    )
    if current_platform.is_cpu():
        kw["enforce_eager"] = True
        kw.setdefault("kv_cache_memory_bytes", 1 << 30)
    if kv_bytes:
        kw["kv_cache_memory_bytes"] = kv_bytes
    if host:
        kw["kv_offloading_size"] = args.host_gib
        if args.host_copies == "async":
            from vllm.config import KVTransferConfig

            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector_extra_config={
                    "copy_mode": "async",
                    "async_max_delay_steps": 3,
                    "async_seed": args.seed,
                }
            )
    if rocketkv:
        kw["attention_backend"] = "ROCKETKV"
        kw["additional_config"] = {"rocketkv": json.loads(args.rocketkv)}
    else:
        kw["attention_backend"] = "CPU_ATTN" if current_platform.is_cpu() else None
        kw["block_size"] = 32 if current_platform.is_cpu() else 16  # as ROCKETKV's
    kw = {k: v for k, v in kw.items() if v is not None}
    with in_process():
        llm = LLM(**kw)
    progress.set_description(method)
    try:
        fixed = {} if args.early_stop else {"min_tokens": args.max_tokens}
        result = run_conversations(
            llm,
            tokenizer,
            conversations,
            args.turns,
            args.max_tokens,
            progress,
            request_kwargs=fixed,
        )
        by_source = {
            m.labels["source"]: int(m.value)
            for m in llm.get_metrics()
            if m.name == "vllm:prompt_tokens_cached_by_source"
        }
    finally:
        llm.llm_engine.engine_core.shutdown()
    summary = summarize(result, args.turns)
    summary["cached_tokens_device"] = by_source.get("device", 0)
    summary["cached_tokens_host"] = by_source.get("host", 0)
    return summary


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from rocketkv_eval.model import resolve_model
    from rocketkv_eval.multiturn import make_conversation, prompt_ids

    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    lengths = doc_lengths(args.doc_tokens, args.conversations)
    conversations = [
        make_conversation(tokenizer, n, args.turns, seed=args.seed + i)
        for i, n in enumerate(lengths)
    ]
    kv_bytes = None
    if args.fit_dense_conversations:
        # A dense conversation's KV at its last turn: the prompt plus answers.
        last = [
            len(prompt_ids(tokenizer, c, args.turns - 1, [" 1234567."] * args.turns))
            + args.max_tokens
            for c in conversations
        ]
        kv_bytes = kv_bytes_for_conversations(
            model, args.fit_dense_conversations * statistics.mean(last), args.dtype
        )
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS + HOST_METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; allowed: {METHODS + HOST_METHODS}")
    if any(m in HOST_METHODS for m in methods) and not args.host_gib:
        raise SystemExit("--methods with +host needs --host-gib (host tier size, GiB)")
    results = {}
    with tqdm(
        total=len(methods) * len(conversations) * args.turns, unit="turn", file=sys.stderr
    ) as progress:
        for method in methods:
            results[method] = run_method(
                args, method, model, tokenizer, conversations, kv_bytes, progress
            )
    print(table(results))
    if args.json or args.out:
        from vllm.platforms import current_platform

        name = "cpu" if current_platform.is_cpu() else "gpu"
        out = args.out or os.path.join("results", f"multiturn-{name}.json")
        doc = {
            "command": shlex.join(
                ["python", "scripts/bench_multiturn.py", *(sys.argv[1:] if argv is None else argv)]
            ),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {
                "processor": platform.processor() or platform.machine(),
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
            },
            "settings": vars(args),
            "doc_tokens": lengths,
            "kv_cache_bytes": kv_bytes,
            "results": results,
        }
        # One file per platform, one entry per workload: a run replaces the
        # entry of its own workload and keeps the others.
        workload = f"{args.conversations}x{args.turns} doc {args.doc_tokens}"
        runs = {}
        if os.path.exists(out):
            with open(out) as f:
                runs = json.load(f).get("runs", {})
        runs[workload] = doc
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"runs": runs}, f, indent=1)
        print(f"wrote {out} ({workload!r})")
    return 0


def table(results: dict) -> str:
    lines = [
        f"{'method':18} {'wall s':>7} {'later s':>8} {'cached':>7} {'peak':>5} "
        f"{'preempt':>8} {'free/pool':>10} {'right':>6} {'dev/host cached':>16}  "
        "per turn: wall s / TTFT p50 s / cached"
    ]
    for method, r in results.items():
        turns = "  ".join(
            f"{t['wall_s']}/{t['ttft_p50_s']}/{t['cached_share']:.0%}" for t in r["per_turn"]
        )
        share = r["later_turns_cached_share"]
        lines.append(
            f"{method:18} {r['wall_s']:>7} {r['later_turns_wall_s']:>8} "
            f"{(f'{share:.0%}' if share is not None else '-'):>7} {r['peak_running']:>5} "
            f"{r['preemptions']:>8} {r['free_blocks_mean']:>5.0f}/{r['pool_blocks']:<4} "
            f"{r['correct']:>3}/{r['finished']:<3} "
            f"{r['cached_tokens_device']:>8}/{r['cached_tokens_host']:<7} {turns}"
        )
    return "\n".join(lines)
