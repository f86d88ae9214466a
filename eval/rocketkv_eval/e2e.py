"""End-to-end speed, side by side: vLLM's own attention backend vs ROCKETKV.

One in-process vLLM engine per method, the same N prompts of L tokens each
(needle-in-a-haystack text from the model's own tokenizer), T new tokens
each (greedy, ignore EOS), prefix caching off for all. Per method:

- prefill s: first scheduling of any request to the last request's first
  token (vLLM's per-request timestamps);
- decode tok/s: each request's tokens after its first over the time from
  its first to its last token (vLLM's timestamps), summed over the requests
  (they decode side by side); also the slowest request's own rate, and the
  rate over the steps in which every request was decoding;
- Stage 1 share: ROCKETKV's Stage 1 time (all layers) / prefill time;
- peak requests decoding at once, KV blocks each request holds after prefill.

    python scripts/bench_e2e.py                                # CPU defaults
    python scripts/bench_e2e.py --prompts 2 --prompt-tokens 7800 --new-tokens 256 \\
        --methods dense,token_budget=256 --json
    python scripts/bench_e2e.py --model /models/Llama-3.1-8B-Instruct \\
        --prompt-tokens 32000 --new-tokens 4096 --methods dense,preset=trtllm

At real scale without carrying weights: ``--model-config llama-3.1-8b`` (a
config.json in ``rocketkv_eval/model_configs/``, or a path to one) starts that
architecture with vLLM's ``load_format="dummy"`` (random weights, no
tokenizer: the prompts are random token ids of exactly L tokens). Speed only:
the tokens mean nothing, and each request generates exactly T of them.

    python scripts/bench_e2e.py --model-config llama-3.1-8b --prompts 8 \
        --prompt-tokens 32000 --new-tokens 256 --methods dense,preset=trtllm

A method is `dense` or a comma-free ROCKETKV setting list joined by `+`
(`token_budget=256`, `preset=trtllm`, `prompt_budget=1024+topk=128`).
Each ROCKETKV row is compared with the dense run before it, so a repeated
`dense,token_budget=256,dense,token_budget=256` shows the run-to-run spread.
Runs unchanged on a GPU machine; `--json` writes results/e2e-<platform>.json
(`e2e-<platform>-<name>.json` for `--model gemma3-270m`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rocketkv_eval.engines import external_id, held_blocks, in_process
from rocketkv_eval.model import MODEL_HELP, model_tag


def parse_method(text: str) -> tuple[str, dict | None]:
    if text == "dense":
        return "dense", None
    cfg = {}
    for item in text.split("+"):
        key, _, value = item.partition("=")
        if not value:
            raise SystemExit(f"bad method {text!r}: expected dense or key=value[+...]")
        try:
            cfg[key] = json.loads(value)
        except json.JSONDecodeError:
            cfg[key] = value
    return text, cfg


def platform_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0).split()[-1].lower()
    return "cpu"


def machine_info() -> dict:
    """The machine a benchmark's report was measured on."""
    import torch

    return {
        "platform": platform_name(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def dense_backend_name() -> str:
    from vllm.platforms import current_platform

    return "CPU_ATTN" if current_platform.is_cpu() else "FLASH_ATTN"


MODEL_CONFIGS = os.path.join(os.path.dirname(__file__), "model_configs")


def model_config_dir(name_or_path: str) -> str:
    """A directory holding only the config.json of ``--model-config`` (a name
    in ``model_configs/`` or a path to a config.json): what vLLM's dummy
    loader needs to build the architecture with random weights."""
    import tempfile

    path = name_or_path
    if not os.path.isfile(path):
        path = os.path.join(MODEL_CONFIGS, f"{name_or_path}.json")
    if not os.path.isfile(path):
        known = sorted(f[:-5] for f in os.listdir(MODEL_CONFIGS) if f.endswith(".json"))
        raise SystemExit(f"--model-config {name_or_path!r}: no such file; known names: {known}")
    with open(path) as f:
        config = json.load(f)
    out = tempfile.mkdtemp(prefix="rocketkv-dummy-model-")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def random_prompts(vocab_size: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Token ids for dummy weights (no tokenizer): ``count`` prompts of
    exactly ``length`` ids, away from the special ids at the vocabulary's ends."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    low, high = 1000, max(vocab_size - 1000, 1001)
    return [torch.randint(low, high, (length,), generator=gen).tolist() for _ in range(count)]


def run_method(
    args,
    model: str,
    method: str,
    rocketkv: dict | None,
    workloads: list[list[list[int]]],
    progress,
) -> list[dict]:
    """One engine for ``method``; each workload (a list of prompts) runs on it
    in turn, all its requests added at once. One row per workload."""
    from vllm import LLM

    from rocketkv_vllm.state import worker_state

    backend = dense_backend_name() if rocketkv is None else "ROCKETKV"
    kw = dict(
        model=model,
        attention_backend=backend,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enable_prefix_caching=False,
        max_num_seqs=max(max(len(w) for w in workloads), 1),
        disable_log_stats=False,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=0,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.model_config:
        kw.update(load_format="dummy", skip_tokenizer_init=True)
    if args.kv_cache_gib:
        kw["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    if args.block_size:
        kw["block_size"] = args.block_size
    if args.gpu_memory_utilization:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.enforce_eager:
        kw["enforce_eager"] = True
    if rocketkv is not None:
        kw["additional_config"] = {"rocketkv": rocketkv}
    with in_process():  # the scheduler and the worker's counters are read here
        llm = LLM(**kw)
    engine = llm.llm_engine
    # The worker's counters (in this process: the engine's own config object).
    counters = worker_state(engine.vllm_config).counters
    rows = []
    try:
        for j, prompts in enumerate(workloads):
            before = counters.as_dict()
            row = _run_workload(args, engine, f"w{j}", prompts, progress, method)
            after = counters.as_dict()
            stage1_s = after["stage1_seconds"] - before["stage1_seconds"]
            row.update(
                method=method,
                backend=backend,
                rocketkv=rocketkv,
                stage1_s=round(stage1_s, 3) if rocketkv else None,
                stage1_share_of_prefill=round(stage1_s / row["prefill_s"], 4)
                if rocketkv and row["prefill_s"] > 0
                else None,
                prompts_compressed=after["prompts_compressed"] - before["prompts_compressed"]
                if rocketkv
                else None,
            )
            rows.append(row)
    finally:
        engine.engine_core.shutdown()
        del llm
    return rows


def _run_workload(args, engine, tag: str, prompts: list[list[int]], progress, method) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sched = engine.engine_core.engine_core.scheduler
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.new_tokens,
        ignore_eos=True,
        detokenize=not args.model_config,
    )
    ids = [f"{tag}r{i}" for i in range(len(prompts))]
    for rid, toks in zip(ids, prompts):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=toks), params)
    peak = 0
    blocks: dict[str, int] = {}
    finished = {}
    progress.set_description(f"{method} {len(prompts)}x{len(prompts[0])}")
    progress.reset(total=len(prompts) * args.new_tokens)
    done_tokens = 0
    decode_steps_s, decode_step_tokens = 0.0, 0
    while engine.has_unfinished_requests():
        # A step where every request is past its prompt decodes one token each.
        pure_decode = not sched.waiting and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running
        )
        step_start = time.perf_counter()
        step_tokens = len(sched.running)
        outputs = engine.step()
        if pure_decode:
            decode_steps_s += time.perf_counter() - step_start
            decode_step_tokens += step_tokens
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out
        decoding = [r for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens]
        peak = max(peak, len(decoding))
        for r in decoding:
            if r.num_computed_tokens > r.num_prompt_tokens and external_id(r) not in blocks:
                blocks[external_id(r)] = held_blocks(sched, r.request_id)
        generated = sum(r.num_output_tokens for r in sched.running) + sum(
            len(o.outputs[0].token_ids) for o in finished.values()
        )
        progress.update(generated - done_tokens)
        done_tokens = generated

    metrics = [finished[rid].metrics for rid in ids]
    start = min(m.scheduled_ts for m in metrics)
    prefill_s = max(m.first_token_ts for m in metrics) - start
    per_request = [
        (m.num_generation_tokens - 1) / (m.last_token_ts - m.first_token_ts)
        for m in metrics
        if m.last_token_ts > m.first_token_ts
    ]
    return {
        "prompts": len(prompts),
        "prompt_tokens": len(prompts[0]),
        "prefill_s": round(prefill_s, 3),
        # Requests decode side by side: their own rates add up.
        "decode_tok_s": round(sum(per_request), 3) if per_request else None,
        "slowest_request_decode_tok_s": round(min(per_request), 3) if per_request else None,
        # what one user sees: a request's own decode rate, averaged
        "per_user_decode_tok_s": round(sum(per_request) / len(per_request), 3)
        if per_request
        else None,
        "pure_decode_steps_tok_s": round(decode_step_tokens / decode_steps_s, 3)
        if decode_steps_s
        else None,
        "peak_decoding": peak,
        "blocks_per_request_after_prefill": [blocks.get(rid, -1) for rid in ids],
        "outputs": [list(finished[rid].outputs[0].token_ids) for rid in ids],
    }


def compare_with_dense(rows: list[dict]) -> None:
    """Each row against the dense run of the same workload before it (the
    first one if none is): repeating "dense,X" pairs shows the machine's
    run-to-run spread."""

    def workload(r):
        return (r["prompts"], r["prompt_tokens"])

    dense: dict = {}
    for r in rows:
        if r["rocketkv"] is None:
            dense.setdefault(workload(r), r)
    for r in rows:
        if r["rocketkv"] is None:
            dense[workload(r)] = r
            continue
        d = dense.get(workload(r))
        if d is None:
            continue
        r["prefill_vs_dense"] = round(r["prefill_s"] / d["prefill_s"], 3)
        if r["decode_tok_s"] and d["decode_tok_s"]:
            r["decode_speedup_vs_dense"] = round(r["decode_tok_s"] / d["decode_tok_s"], 3)
        if r["per_user_decode_tok_s"] and d["per_user_decode_tok_s"]:
            r["per_user_decode_speedup_vs_dense"] = round(
                r["per_user_decode_tok_s"] / d["per_user_decode_tok_s"], 3
            )
        r["same_tokens_as_dense"] = sum(a == b for a, b in zip(r["outputs"], d["outputs"]))


def write_report(args, argv, model: str, workloads, rows: list[dict]) -> None:
    report = {
        "command": " ".join(
            ["python", "scripts/bench_e2e.py"] + (argv if argv is not None else sys.argv[1:])
        ),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "model": args.model_config or os.path.basename(model.rstrip("/")),
        "weights": "dummy (random, load_format=dummy)" if args.model_config else "real",
        "workloads": [{"prompts": len(w), "prompt_tokens": len(w[0])} for w in workloads],
        "new_tokens": args.new_tokens,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows],
    }
    tag = model_tag(args.model)  # a second prepared model writes its own file
    if args.model_config:
        tag = os.path.basename(args.model_config).removesuffix(".json") + "-dummy"
    name = f"e2e-{platform_name()}-{tag}" if tag else f"e2e-{platform_name()}"
    path = args.out or os.path.join("results", f"{name}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print("wrote", path, file=sys.stderr)


def main(argv=None) -> int:
    os.environ.setdefault("ROCKETKV_TIMING", "1")  # Stage 1 share of prefill
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument(
        "--model-config",
        default=None,
        help="instead of --model: a config.json (or a name in rocketkv_eval/model_configs: "
        "llama-3.1-8b) run with random weights (vLLM's load_format=dummy), for speed only",
    )
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument(
        "--workloads",
        default=None,
        help="instead of --prompts/--prompt-tokens: TOKENSxPROMPTS,... (e.g. "
        "32000x1,32000x8), run in turn on one engine per method",
    )
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--methods", default="dense,token_budget=256")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="vLLM's kv_cache_dtype for every method (fp8 on CPU: AVX-512 or AMX)",
    )
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: prompt + new tokens, rounded up to 1024",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="KV cache size (default: 2 on CPU, vLLM's own sizing on GPU)",
    )
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's share of GPU memory (default: vLLM's 0.9)",
    )
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--json", action="store_true", help="write results/e2e-<platform>.json (or --out)"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.kv_cache_gib is None:
        import torch

        if not torch.cuda.is_available():
            args.kv_cache_gib = 2.0
    if args.workloads:
        try:
            shapes = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
            assert shapes and all(len(t) == 2 and min(t) > 0 for t in shapes)
        except (ValueError, AssertionError):
            raise SystemExit(
                f"--workloads {args.workloads!r}: expected TOKENSxPROMPTS,... (32000x8)"
            ) from None
    else:
        shapes = [(args.prompt_tokens, args.prompts)]
    if args.max_model_len is None:
        need = max(t for t, _ in shapes) + args.new_tokens + 64
        args.max_model_len = -(-need // 1024) * 1024

    from tqdm import tqdm
    from transformers import AutoTokenizer

    from rocketkv_eval.model import resolve_model
    from rocketkv_eval.needle import build_needle_prompt

    if args.model_config:
        if args.model:
            raise SystemExit("give --model or --model-config, not both")
        model = model_config_dir(args.model_config)
        with open(os.path.join(model, "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
        workloads = [random_prompts(vocab_size, n, t, seed=j) for j, (t, n) in enumerate(shapes)]
    else:
        model = resolve_model(args.model)
        tokenizer = AutoTokenizer.from_pretrained(model)
        workloads = [
            [build_needle_prompt(tokenizer, t, 0.5, seed=1000 * j + i).token_ids for i in range(n)]
            for j, (t, n) in enumerate(shapes)
        ]
    methods = [parse_method(m) for m in args.methods.split(",")]
    rows = []
    with tqdm(total=1, unit="tok", file=sys.stderr) as progress:
        for name, cfg in methods:
            rows.extend(run_method(args, model, name, cfg, workloads, progress))
            compare_with_dense(rows)
            if args.json or args.out:  # after every method: a later failure loses nothing
                write_report(args, argv, model, workloads, rows)
    print(f"{args.new_tokens} new tokens a request, dtype {args.dtype}")
    print(
        f"{'method':28} {'workload':>12} {'prefill s':>9} {'x dense':>7} {'decode tok/s':>12} "
        f"{'x dense':>7} {'per user':>9} {'x dense':>7} {'stage1 %':>8} {'peak':>4}  blocks/request"
    )
    for r in rows:
        share = r["stage1_share_of_prefill"]
        print(
            f"{r['method']:28} {str(r['prompt_tokens']) + 'x' + str(r['prompts']):>12} "
            f"{r['prefill_s']:>9.2f} "
            f"{r.get('prefill_vs_dense', 1.0):>7.2f} {r['decode_tok_s'] or 0:>12.2f} "
            f"{r.get('decode_speedup_vs_dense', 1.0):>7.2f} "
            f"{r['per_user_decode_tok_s'] or 0:>9.2f} "
            f"{r.get('per_user_decode_speedup_vs_dense', 1.0):>7.2f} "
            f"{'-' if share is None else f'{100 * share:.1f}':>8} "
            f"{r['peak_decoding']:>4}  {r['blocks_per_request_after_prefill']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
