"""Offline long-context accuracy: dense vs SnapKV, Quest, oracle top-k, RocketKV.

Synthetic RULER-style tasks (``rocketkv_eval.tasks``: niah_single,
niah_multikey, niah_multivalue, niah_multiquery, vt), sized with the model's
own tokenizer to exact prompt lengths, run through real vLLM (in-process
engine, greedy, prefix caching off, enforce_eager). One engine per
(method, budget), reused for every task and length. Every method except
``dense`` is a setting of the same ROCKETKV backend, so they share all glue;
at token budget B (tokens attended per decode step):

- ``dense``: vLLM's own backend (attention_backend unset: CPU_ATTN on CPU,
  FLASH_ATTN/TRITON_ATTN on GPU); budget null.
- ``rocketkv``: ``{"token_budget": B, "max_new_tokens": T}`` (SPEC §1 split;
  T = the longest generation of the run, the length the split assumes).
- ``snapkv`` (Stage 1 only): ``{"prompt_budget": B, "page_size": 4,
  "topk": >= B + T + 8, "force_current_page": false}``: keep B tokens per KV
  head, attend to everything kept.
- ``quest`` (Stage 2 only): ``{"evict": false, "page_size": 16, "topk": B,
  "force_current_page": true}``: nothing evicted, min/max page scores over
  all channels, top-B tokens' pages plus the page being written. Without
  that page SmolLM2 loses every needle within 3-4 tokens even at B = half
  the context: a page holding 1-2 new tokens has an exact score, full pages
  an inflated upper bound, so in most layers the newest tokens are dropped
  (``scripts/page_recall.py``, page 16: the current page is chosen in 1
  and 6 of 30 layers at the 2nd and 3rd generated token at B = 1024 of
  2048, in 0 of 30 at B = 256).
  Serving Quest implementations (e.g. SGLang's) keep recent pages too. Other differences
  to Quest's own evaluation code: it keeps layers 0-1 dense and bounds each
  query head separately; here a GQA group shares one page set (RocketKV's
  scoring, the same kernels as the other methods).
- ``rocketkv_fp8kt``: ``rocketkv`` with ``"kt_dtype": "fp8_e4m3"`` (KT pages
  in fp8, rounded outward: ``algorithm.kt_fp8``); not in the default grid.
- ``oracle``: ``{"evict": false, "page_size": 1, "topk": B,
  "force_current_page": false}``: pages of one token over all channels score
  exactly q.k, so this attends to the top-B tokens by true attention score.

A method whose settings the backend refuses (or whose engine fails to start)
is recorded under ``errors`` and skipped; the run goes on.

Per cell (task, length, method, budget) the JSON ``rows`` hold: accuracy
(mean over samples of RULER's string_match_all, 0-100), n, std (population
standard deviation of the per-sample scores), agreement (fraction of samples
whose greedy tokens equal dense's exactly) and first_divergence_mean (mean
index of the first generated token that differs from dense; a sample equal to
dense counts its full length). ``outputs`` keeps every sample's tokens, text,
score and depth, so agreement can be recomputed and a killed run resumed.

Usage (CPU, the embedded SmolLM2-135M-Instruct). The default grid is 5 tasks
x lengths 2048, 6144 x 8 samples x 13 configs (dense + 4 methods x budgets
128, 256, 1024) = 130 cells, 1,040 prompts, 4.3 M prompt tokens; estimated
at about 2 h on an idle 2-core machine (about 9 s per 6k prompt and 3 s per
2k prompt, decode included, plus ~15 s per engine start), 3.5-4 h when the
cores are shared with other jobs:

    python scripts/eval_accuracy.py --resume          # full default grid
    python scripts/eval_accuracy.py --smoke           # niah_single @1k, ~1.5 min
    python scripts/eval_accuracy.py --tasks niah_single --lengths 2048 \\
        --samples 2 --methods dense,rocketkv --budgets 256 --out /tmp/tiny.json

Background + resumable: ``nohup python scripts/eval_accuracy.py --resume &``;
rerun the same command after a kill and finished cells are skipped (results
are written after every cell). Changing --samples or --seed between runs of
the same file mixes grids: use a new --out.

GPU machine, bigger model, longer contexts (nothing else changes; the KV
cache is then sized by vLLM's --gpu-memory-utilization default):

    python scripts/eval_accuracy.py --model /models/Llama-3.1-8B-Instruct \\
        --lengths 4096,16384,32768 --budgets 256,1024,4096 --samples 25 \\
        --out results/accuracy-llama8b.json --resume

--max-model-len defaults to the longest length + the longest generation;
the model must support it. Outputs: the JSON at --out, a CSV beside it with
the same rows, and PNG plots beside it when matplotlib is installed
(<out>-budget.png: accuracy vs budget per task, one line per method, dense
as a horizontal line; <out>-depth.png: niah_single depth x length heat map
per method, at the smallest budget).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# the checkout (eval/rocketkv_eval/ -> ../..): default results/ path
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rocketkv_eval import tasks as eval_tasks  # noqa: E402
from rocketkv_eval.model import MODEL_HELP, model_tag  # noqa: E402

METHODS = ("dense", "snapkv", "quest", "oracle", "rocketkv", "rocketkv_fp8kt")
DEFAULT_METHODS = METHODS[:5]  # the fp8-KT variant on request (--methods)
ROW_FIELDS = (
    "task",
    "length",
    "method",
    "budget",
    "accuracy",
    "n",
    "std",
    "agreement",
    "first_divergence_mean",
)


def method_settings(method: str, budget: int | None, max_tokens: int) -> dict | None:
    """ROCKETKV ``additional_config["rocketkv"]`` for a method at budget B."""
    if method == "dense":
        return None
    b = int(budget)
    if method == "rocketkv":
        return {"token_budget": b, "max_new_tokens": max_tokens}
    if method == "rocketkv_fp8kt":
        return {"token_budget": b, "max_new_tokens": max_tokens, "kt_dtype": "fp8_e4m3"}
    if method == "snapkv":
        # The kept part and the tail may each end in a partial page: two
        # pages of slack make the selection cover the whole view.
        return {
            "prompt_budget": b,
            "page_size": 4,
            "topk": -(-(b + max_tokens) // 4) * 4 + 8,
            "force_current_page": False,
        }
    if method == "quest":
        return {"evict": False, "page_size": 16, "topk": b, "force_current_page": True}
    if method == "oracle":
        return {"evict": False, "page_size": 1, "topk": b, "force_current_page": False}
    raise SystemExit(f"unknown method {method!r}: choose from {METHODS}")


def cell_key(task: str, length: int, method: str, budget: int | None) -> str:
    return f"{task}/{length}/{method}/{budget}"


def platform_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


# ------------------------------------------------------------- results file
def load(path: str) -> dict:
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    return {}


def finalize(report: dict) -> None:
    """Recompute every row's agreement with dense from the stored outputs."""
    outs = report["outputs"]
    for row in report["rows"]:
        key = cell_key(row["task"], row["length"], row["method"], row["budget"])
        dense = outs.get(cell_key(row["task"], row["length"], "dense", None))
        mine = outs.get(key)
        if not dense or not mine or len(dense) != len(mine):
            row["agreement"] = row["first_divergence_mean"] = None
            continue
        pairs = [(a["tokens"], b["tokens"]) for a, b in zip(mine, dense)]
        row["agreement"] = round(sum(a == b for a, b in pairs) / len(pairs), 4)
        row["first_divergence_mean"] = round(
            sum(len(a) if a == b else eval_tasks.common_prefix(a, b) for a, b in pairs)
            / len(pairs),
            2,
        )


def save(report: dict, path: str) -> None:
    finalize(report)
    order = {m: i for i, m in enumerate(METHODS)}
    report["rows"].sort(
        key=lambda r: (r["task"], r["length"], order.get(r["method"], 99), r["budget"] or 0)
    )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)
    with open(os.path.splitext(path)[0] + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        w.writeheader()
        for r in report["rows"]:
            w.writerow({k: r.get(k) for k in ROW_FIELDS})


# ------------------------------------------------------------------ plots
def plot(report: dict, path: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed: no plots (pip install matplotlib, then "
            "rerun with --resume to draw them from the results file)"
        )
        return []
    rows = report["rows"]
    base = os.path.splitext(path)[0]
    written = []
    tasks = sorted({r["task"] for r in rows})
    lengths = sorted({r["length"] for r in rows})
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    if tasks and lengths:
        # At least 7 inches wide: the title and a one-row legend of every method.
        width = max(3.2 * len(tasks), 7.0)
        fig, axes = plt.subplots(
            len(lengths), len(tasks), squeeze=False, figsize=(width, 2.8 * len(lengths))
        )
        for i, length in enumerate(lengths):
            for j, task in enumerate(tasks):
                ax = axes[i][j]
                cell = [r for r in rows if r["task"] == task and r["length"] == length]
                for m in methods:
                    pts = sorted(
                        (r["budget"], r["accuracy"])
                        for r in cell
                        if r["method"] == m and r["budget"] is not None
                    )
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=m)
                    dense = [r["accuracy"] for r in cell if r["method"] == "dense"]
                    if m == "dense" and dense:
                        ax.axhline(dense[0], color="black", ls="--", label="dense")
                ax.set_xscale("log", base=2)
                ax.set_ylim(-5, 105)
                ax.set_title(f"{task} @ {length}", fontsize=9)
                if i == len(lengths) - 1:
                    ax.set_xlabel("token budget")
                if j == 0:
                    ax.set_ylabel("accuracy")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(handles))
        fig.suptitle(f"{report.get('model')}: accuracy vs token budget")
        fig.tight_layout(rect=(0, 0.05, 1, 0.97))
        out = base + "-budget.png"
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)

    # niah_single heat map: depth bins x length, one panel per method.
    outs = report["outputs"]
    single = [r for r in rows if r["task"] == "niah_single"]
    if single:
        budgets = sorted({r["budget"] for r in single if r["budget"] is not None})
        configs = [
            (m, None if m == "dense" else (budgets[0] if budgets else None)) for m in methods
        ]
        configs = [
            c for c in configs if any(r["method"] == c[0] and r["budget"] == c[1] for r in single)
        ]
        bins = 5
        fig, axes = plt.subplots(
            1, len(configs), squeeze=False, figsize=(2.6 * len(configs) + 1, 3)
        )
        for col, (ax, (m, b)) in enumerate(zip(axes[0], configs)):
            grid = [[math.nan] * len(lengths) for _ in range(bins)]
            for j, length in enumerate(lengths):
                samples = outs.get(cell_key("niah_single", length, m, b)) or []
                for k in range(bins):
                    got = [
                        s["score"] for s in samples if min(int(s["depth"] * bins), bins - 1) == k
                    ]
                    if got:
                        grid[k][j] = sum(got) / len(got)
            im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", origin="upper")
            ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
            # Depth labels on the first panel only (they would overlap the next one).
            labels = [f"{100 * k // bins}-{100 * (k + 1) // bins}%" for k in range(bins)]
            ax.set_yticks(range(bins), labels if col == 0 else [])
            ax.set_title(m if b is None else f"{m} B={b}", fontsize=9)
            ax.set_xlabel("length")
        axes[0][0].set_ylabel("needle depth")
        fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
        out = base + "-depth.png"
        fig.savefig(out, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(out)
    return written


# ------------------------------------------------------------------ engine
def make_engine(args, model: str, settings: dict | None, max_model_len: int):
    from vllm import LLM

    kw = dict(
        model=model,
        dtype=args.dtype,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
        enforce_eager=True,
        seed=0,
        max_num_seqs=max(1, args.samples),
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if args.kv_cache_gib:
        kw["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if settings is not None:
        kw["attention_backend"] = "ROCKETKV"
        kw["additional_config"] = {"rocketkv": settings}
    return LLM(**kw)


def close_engine(llm) -> None:
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort on the way out
        pass
    del llm
    gc.collect()


def run_cell(llm, samples, max_tokens: int | None) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(max_tokens or s.max_tokens, []).append(i)
    result: list[dict | None] = [None] * len(samples)
    for mt, idx in groups.items():
        params = SamplingParams(temperature=0.0, max_tokens=mt)
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=samples[i].token_ids) for i in idx],
            params,
            use_tqdm=False,
        )
        for i, o in zip(idx, outs):
            text = o.outputs[0].text
            result[i] = {
                "tokens": list(o.outputs[0].token_ids),
                "text": text,
                "score": eval_tasks.score(text, samples[i].references),
                "depth": round(samples[i].depth, 4),
                "references": samples[i].references,
            }
    return result  # type: ignore[return-value]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--tasks", default=",".join(eval_tasks.TASKS))
    ap.add_argument("--lengths", default="2048,6144", help="prompt tokens, comma-separated")
    ap.add_argument("--budgets", default="128,256,1024")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS))
    ap.add_argument("--samples", type=int, default=8, help="samples per cell")
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"generation length (default: per task, {eval_tasks.DEFAULT_MAX_TOKENS})",
    )
    ap.add_argument(
        "--haystack",
        choices=eval_tasks.HAYSTACKS,
        default=None,
        help=f"filler for every task (default per task: {eval_tasks.DEFAULT_HAYSTACK})",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="vLLM's kv_cache_dtype for every engine (fp8, fp8_e4m3, fp8_e5m2: CPUs with "
        "AVX-512 or AMX)",
    )
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="KV cache size (default: 3 on CPU, vLLM's own sizing on GPU)",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="results JSON (default results/accuracy-smollm2.json; "
        "results/accuracy-smoke.json with --smoke)",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the cells already in --out and run only the missing ones",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny grid: niah_single @1024, 4 samples, dense + rocketkv B=128",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.tasks, args.lengths, args.samples = "niah_single", "1024", 4
        args.methods, args.budgets = "dense,rocketkv", "128"
    if args.out is None:
        tag = model_tag(args.model)  # a second prepared model writes its own file
        name = "accuracy-smoke" if args.smoke else "accuracy-smollm2"
        if tag:
            name = f"accuracy-smoke-{tag}" if args.smoke else f"accuracy-{tag}"
        args.out = os.path.join(ROOT, "results", f"{name}.json")
    import torch

    if args.kv_cache_gib is None and not torch.cuda.is_available():
        args.kv_cache_gib = 3.0

    from tqdm import tqdm
    from transformers import AutoTokenizer

    from rocketkv_eval.model import resolve_model

    tasks = [t for t in args.tasks.split(",") if t]
    for t in tasks:
        if t not in eval_tasks.TASKS:
            raise SystemExit(f"unknown task {t!r}: choose from {eval_tasks.TASKS}")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    budgets = [int(x) for x in args.budgets.split(",") if x]
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}: choose from {METHODS}")
    methods.sort(key=lambda m: m != "dense")  # dense first: the others compare to it
    gen = args.max_tokens or max(eval_tasks.DEFAULT_MAX_TOKENS[t] for t in tasks)
    max_model_len = args.max_model_len or max(lengths) + gen
    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)

    report = load(args.out) if args.resume else {}
    report.setdefault("rows", [])
    report.setdefault("outputs", {})
    report["errors"] = []
    report.update(
        {
            "command": " ".join(
                ["python", "scripts/eval_accuracy.py"]
                + (argv if argv is not None else sys.argv[1:])
            ),
            "machine": {
                "platform": platform_name(),
                "node": platform.node(),
                "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(),
            },
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "model": os.path.basename(model.rstrip("/")),
            "settings": {
                "samples": args.samples,
                "seed": args.seed,
                "dtype": args.dtype,
                "kv_cache_dtype": args.kv_cache_dtype,
                "max_tokens": args.max_tokens
                or {t: eval_tasks.DEFAULT_MAX_TOKENS[t] for t in tasks},
                "haystack": args.haystack or {t: eval_tasks.DEFAULT_HAYSTACK[t] for t in tasks},
                "max_model_len": max_model_len,
            },
        }
    )
    report["settings"]["methods"] = {
        m: (
            None
            if m == "dense"
            else json.dumps(method_settings(m, 0, gen)).replace('": 0', '": "B"')
        )
        for m in methods
    }
    done = {cell_key(r["task"], r["length"], r["method"], r["budget"]) for r in report["rows"]}

    # Dense first, then budget by budget: a partial run compares methods early.
    configs = [("dense", None)] if "dense" in methods else []
    configs += [(m, b) for b in budgets for m in methods if m != "dense"]
    cells = [(m, b, t, n) for m, b in configs for t in tasks for n in lengths]
    todo = [c for c in cells if cell_key(c[2], c[3], c[0], c[1]) not in done]
    print(
        f"{len(cells)} cells ({len(cells) - len(todo)} already in {args.out}), "
        f"{args.samples} samples each, model {report['model']}",
        file=sys.stderr,
    )
    samples_cache: dict[tuple[str, int], list] = {}

    def samples_for(task: str, length: int):
        if (task, length) not in samples_cache:
            samples_cache[(task, length)] = eval_tasks.make_samples(
                task, tokenizer, length, args.samples, seed=args.seed, haystack=args.haystack
            )
        return samples_cache[(task, length)]

    started = time.time()
    with tqdm(total=len(todo), unit="cell", file=sys.stderr) as bar:
        for method, budget in configs:
            mine = [c for c in todo if c[0] == method and c[1] == budget]
            if not mine:
                continue
            name = method if budget is None else f"{method}@{budget}"
            bar.set_description(name)
            settings = method_settings(method, budget, gen)
            llm = None
            try:
                if settings is not None:
                    from rocketkv_vllm.config import parse_config

                    parse_config(settings)  # refuse early with the clear message
                llm = make_engine(args, model, settings, max_model_len)
            except Exception as exc:  # noqa: BLE001 - record and go on
                msg = f"{type(exc).__name__}: {exc}".strip()
                print(f"\n{name}: skipped: {msg}", file=sys.stderr)
                if not isinstance(exc, ValueError):
                    traceback.print_exc()
                report["errors"].append(
                    {"method": method, "budget": budget, "settings": settings, "error": msg[:2000]}
                )
                save(report, args.out)
                bar.update(len(mine))
                continue
            try:
                for _, _, task, length in mine:
                    t0 = time.time()
                    res = run_cell(llm, samples_for(task, length), args.max_tokens)
                    scores = [r["score"] for r in res]
                    acc, std = eval_tasks.mean_std(scores)
                    report["outputs"][cell_key(task, length, method, budget)] = res
                    report["rows"].append(
                        {
                            "task": task,
                            "length": length,
                            "method": method,
                            "budget": budget,
                            "accuracy": round(acc, 2),
                            "n": len(res),
                            "std": round(std, 2),
                            "agreement": None,
                            "first_divergence_mean": None,
                            "seconds": round(time.time() - t0, 1),
                        }
                    )
                    save(report, args.out)
                    bar.set_postfix_str(f"{task}@{length}: {acc:.0f}")
                    bar.update(1)
            finally:
                close_engine(llm)
    report["elapsed_s_last_run"] = round(time.time() - started, 1)
    save(report, args.out)

    print(
        f"\n{'task':16} {'length':>6} {'method':9} {'budget':>6} {'acc':>6} "
        f"{'std':>6} {'agree':>6} {'1st div':>7}"
    )
    for r in report["rows"]:
        ag, fd = r.get("agreement"), r.get("first_divergence_mean")
        print(
            f"{r['task']:16} {r['length']:>6} {r['method']:9} "
            f"{'-' if r['budget'] is None else r['budget']:>6} {r['accuracy']:>6.1f} "
            f"{r['std']:>6.1f} {'-' if ag is None else f'{ag:.2f}':>6} "
            f"{'-' if fd is None else f'{fd:.1f}':>7}"
        )
    for e in report["errors"]:
        print(f"error: {e['method']}@{e['budget']}: {e['error'][:200]}")
    print("wrote", args.out, "and", os.path.splitext(args.out)[0] + ".csv")
    for p in plot(report, args.out):
        print("wrote", p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
