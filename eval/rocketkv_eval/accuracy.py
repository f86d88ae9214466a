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
- ``rocketkv_reuse2`` / ``rocketkv_reuse4``: ``rocketkv`` with
  ``"reselect_every"`` 2 / 4 (a page selection serves up to 2 / 4 decode
  steps within the newest token's page; needs a page size >= that, which
  the split gives at small budgets); not in the default grid.
- ``streaming`` / ``h2o``: ``snapkv``'s settings with ``"keep_rule"``
  ``"streaming"`` (4 attention sinks + the most recent tokens) / ``"h2o"``
  (the recent window + the highest attention summed over every prompt
  query; prefix caching is off in every engine here, which H2O needs):
  the Stage 1 baselines of docs/keep-rules.md; not in the default grid.
- ``oracle``: ``{"evict": false, "page_size": 1, "topk": B,
  "force_current_page": false}``: pages of one token over all channels score
  exactly q.k, so this attends to the top-B tokens by true attention score.

Ablations of ``rocketkv`` (issue 40: which part of the split costs answers at
small budgets). Each is built from ``budget.kernel_budget``'s numbers for
the run's prompt length L (page size p, prompt budget P, top-k K = B/2 but
at least min(B, 128) in whole pages, top-r R = d since 2470628; block size
``ABLATION_BLOCK_SIZE``, which only caps the page size and floors P) and
the model's head dim d (its config.json), so they need a single --lengths
value (refused otherwise). Not in the default grid.

- ``rocketkv_explicit``: ``{"prompt_budget": P, "page_size": p, "topk": K,
  "topr": R}`` (force_current_page and evict as ``rocketkv``: true): the
  same numbers as explicit knobs; must reproduce ``rocketkv`` (a sanity
  check of the ablations' construction).
- ``rocketkv_topr_spec``: as explicit, top-r = SPEC §1's channel cut in
  16-channel lanes (``budget.spec_topr``: 176 of 256 at B = 256, L = 8192),
  what ``rocketkv`` ran with before 2470628. (The results of 2026-12-04/05,
  run before that commit, have ``rocketkv``, ``rocketkv_topk_x2``,
  ``rocketkv_ps2`` and ``rocketkv_stage2_only`` with that cut, and a
  ``rocketkv_topr_full`` = today's ``rocketkv``: each row's settings are in
  its JSON.)
- ``rocketkv_topk_x2``: as explicit, Stage 2's top-k = the split's for 2B
  (B in whole pages: twice the split's B/2; at B = 128, 128 tokens as the
  split's own since its floor).
- ``rocketkv_ps8`` / ``rocketkv_ps2``: page size 8 / 2, top-k as
  ``kernel_budget`` gives it for that page size (in whole pages), top-r
  = d; P is unchanged (it does not depend on the page size).
- ``rocketkv_stage1_only``: Stage 1 with the split's P, Stage 2 attends to
  everything kept (as ``snapkv``: top-k >= P + T + two pages of slack, no
  forced page, top-r = d).
- ``rocketkv_stage2_only``: ``{"evict": false, "page_size": p, "topk": K,
  "topr": R, "force_current_page": true}``: nothing evicted, the split's
  Stage 2.

Kept tokens per KV head after prefill (the memory a method frees): P for
``rocketkv`` and its ablations with eviction (1,432 of 8,192 at B = 256),
B for ``snapkv``, ``streaming`` and ``h2o``, the whole prompt for ``quest``, ``oracle``,
``rocketkv_stage2_only`` and ``dense``.

A method whose settings the backend refuses (or whose engine fails to start)
is recorded under ``errors`` and skipped; the run goes on.

Per cell (task, length, method, budget) the JSON ``rows`` hold: accuracy
(mean over samples of RULER's string_match_all, 0-100), n, std (population
standard deviation of the per-sample scores), agreement (fraction of samples
whose greedy tokens equal dense's exactly), first_divergence_mean (mean
index of the first generated token that differs from dense; a sample equal to
dense counts its full length), and ci_low / ci_high: a 95% confidence
interval of the accuracy (``confidence_interval``). When every per-sample
score is 0 or 100 (niah_single: one reference) it is the Wilson score
interval of the pass rate; when some score is fractional (tasks with several
references) it is the normal interval on the mean, mean +- 1.96 s / sqrt(n)
with the sample standard deviation s, clipped to [0, 100]. Both are
recomputed from the stored outputs on every save, so older results files
gain them on ``--resume``. ``outputs`` keeps every sample's tokens, text,
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
per method, at the smallest budget; <out>-methods.png: accuracy with its
interval per method at each (task, length, budget), for ablation runs). The
budget plot draws each point's interval as an error bar.

Ablation run (issue 40; docs/results.md):

    python scripts/eval_accuracy.py --model gemma3-270m --tasks niah_single \
        --lengths 8192 --max-model-len 8208 --budgets 256 --samples 32 \
        --dtype bfloat16 --methods rocketkv,rocketkv_topr_spec,... --resume \
        --out results/ablation-gemma3-270m-cpu.json
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

ABLATIONS = (
    "rocketkv_explicit",
    "rocketkv_topr_spec",
    "rocketkv_topk_x2",
    "rocketkv_ps8",
    "rocketkv_ps2",
    "rocketkv_stage1_only",
    "rocketkv_stage2_only",
)
REUSE_METHODS = {"rocketkv_reuse2": 2, "rocketkv_reuse4": 4}
# Stage 1 baselines (docs/keep-rules.md): ``snapkv``'s settings with another keep rule.
KEEP_RULE_METHODS = {"streaming": "streaming", "h2o": "h2o"}
METHODS = (
    ("dense", "snapkv", "quest", "oracle", "rocketkv", "rocketkv_fp8kt")
    + ABLATIONS
    + tuple(REUSE_METHODS)
    + tuple(KEEP_RULE_METHODS)
)
DEFAULT_METHODS = METHODS[:5]  # the fp8-KT variant and the ablations on request (--methods)
# The KV block size the ablations' split assumes: it only caps the page size
# and floors the prompt budget (window + block), neither binding at the
# budgets studied (vLLM's CPU engine runs Gemma 3 with 32-token blocks,
# SmolLM2 with 16: the same numbers).
ABLATION_BLOCK_SIZE = 16
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
    "ci_low",
    "ci_high",
    "kept_tokens",
)
Z95 = 1.959963984540054


def confidence_interval(scores) -> tuple[float, float] | None:
    """95% interval of the mean of per-sample scores (0-100): Wilson's score
    interval when every score is 0 or 100, else the normal interval on the
    mean (sample standard deviation), clipped to [0, 100]. None without
    scores."""
    n = len(scores)
    if n == 0:
        return None
    if all(s in (0, 100) for s in scores):
        p = sum(s == 100 for s in scores) / n
        z2 = Z95 * Z95
        centre = (p + z2 / (2 * n)) / (1 + z2 / n)
        half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
        lo, hi = 100 * (centre - half), 100 * (centre + half)
    else:
        m = sum(scores) / n
        sd = math.sqrt(sum((s - m) ** 2 for s in scores) / (n - 1)) if n > 1 else 0.0
        lo, hi = m - Z95 * sd / math.sqrt(n), m + Z95 * sd / math.sqrt(n)
    return round(max(0.0, lo), 2), round(min(100.0, hi), 2)


def model_head_dim(model_dir: str) -> int:
    """Attention head dim from a model directory's config.json (``head_dim``,
    else hidden_size / num_attention_heads; a multimodal model's
    ``text_config`` when present)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])


def ablation_settings(method: str, budget: int, max_tokens: int, head_dim: int, length: int):
    """The explicit knobs of an ablation method (module docstring), from
    ``kernel_budget``'s split of ``budget`` for a ``length``-token prompt."""
    from dataclasses import replace

    from rocketkv_vllm.budget import kernel_budget, spec_topr
    from rocketkv_vllm.config import parse_config

    knobs = parse_config({"token_budget": budget, "max_new_tokens": max_tokens})

    def split(**changes):
        return kernel_budget(
            replace(knobs, **changes), length, head_dim=head_dim, block_size=ABLATION_BLOCK_SIZE
        )

    kb = split()
    p = kb.page_size
    explicit = {"prompt_budget": kb.prompt_budget, "page_size": p, "topk": kb.topk, "topr": kb.topr}
    if method == "rocketkv_explicit":
        return explicit
    if method == "rocketkv_topr_spec":
        return {**explicit, "topr": spec_topr(budget, length, max_tokens, head_dim, p)}
    if method == "rocketkv_topk_x2":
        return {**explicit, "topk": split(token_budget=2 * budget).topk}
    if method in ("rocketkv_ps8", "rocketkv_ps2"):
        other = split(page_size=int(method[-1]))
        return {
            "prompt_budget": other.prompt_budget,
            "page_size": other.page_size,
            "topk": other.topk,
            "topr": other.topr,
        }
    if method == "rocketkv_stage1_only":
        return {
            "prompt_budget": kb.prompt_budget,
            "page_size": p,
            "topk": -(-(kb.prompt_budget + max_tokens) // p) * p + 2 * p,
            "topr": head_dim,
            "force_current_page": False,
        }
    if method == "rocketkv_stage2_only":
        return {
            "evict": False,
            "page_size": p,
            "topk": kb.topk,
            "topr": kb.topr,
            "force_current_page": True,
        }
    raise SystemExit(f"unknown ablation {method!r}: choose from {ABLATIONS}")


def kept_tokens(method: str, settings: dict | None, length: int) -> int:
    """KV tokens each KV head keeps of a ``length``-token prompt after
    prefill under a method's settings (``plan_request``'s kept_tokens at
    ``ABLATION_BLOCK_SIZE``); dense: the prompt."""
    if settings is None:
        return length
    from rocketkv_vllm.config import parse_config, resolve_settings
    from rocketkv_vllm.plan import plan_request

    cfg = parse_config(settings)
    # head dim 256 covers every top-r here; it does not change the kept tokens.
    engine = resolve_settings(cfg, ABLATION_BLOCK_SIZE, 256, length + cfg.max_new_tokens)
    return plan_request(engine, length).kept_tokens()


def method_settings(
    method: str,
    budget: int | None,
    max_tokens: int,
    *,
    head_dim: int | None = None,
    length: int | None = None,
) -> dict | None:
    """ROCKETKV ``additional_config["rocketkv"]`` for a method at budget B
    (the ablations also need the model's head dim and the prompt length)."""
    if method == "dense":
        return None
    b = int(budget)
    if method in ABLATIONS:
        if head_dim is None or length is None:
            raise ValueError(f"{method} needs the model's head dim and the prompt length")
        return ablation_settings(method, b, max_tokens, head_dim, length)
    if method == "rocketkv":
        return {"token_budget": b, "max_new_tokens": max_tokens}
    if method == "rocketkv_fp8kt":
        return {"token_budget": b, "max_new_tokens": max_tokens, "kt_dtype": "fp8_e4m3"}
    if method in REUSE_METHODS:
        every = REUSE_METHODS[method]
        return {"token_budget": b, "max_new_tokens": max_tokens, "reselect_every": every}
    if method == "snapkv" or method in KEEP_RULE_METHODS:
        # The kept part and the tail may each end in a partial page: two
        # pages of slack make the selection cover the whole view.
        settings = {
            "prompt_budget": b,
            "page_size": 4,
            "topk": -(-(b + max_tokens) // 4) * 4 + 8,
            "force_current_page": False,
        }
        if method in KEEP_RULE_METHODS:
            settings["keep_rule"] = KEEP_RULE_METHODS[method]
        return settings
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
        scores = [s["score"] for s in outs.get(key) or [] if "score" in s]
        ci = confidence_interval(scores) if scores else None
        row["ci_low"], row["ci_high"] = ci if ci else (None, None)
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
                        (r["budget"], r["accuracy"], r.get("ci_low"), r.get("ci_high"))
                        for r in cell
                        if r["method"] == m and r["budget"] is not None
                    )
                    if pts:
                        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                        # the 95% interval as an error bar (none for rows without one)
                        err = [
                            [y - lo if lo is not None else 0 for _, y, lo, _ in pts],
                            [hi - y if hi is not None else 0 for _, y, _, hi in pts],
                        ]
                        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=m)
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

    # Ablation view: one horizontal bar per method with its interval, one
    # panel per (task, length, budget) that has any ablation row.
    panels = sorted(
        {(r["task"], r["length"], r["budget"]) for r in rows if r["method"] in ABLATIONS}
    )
    if panels:
        fig, axes = plt.subplots(
            len(panels), 1, squeeze=False, figsize=(7.5, 0.5 + 0.32 * len(METHODS) * len(panels))
        )
        for ax, (task, length, budget) in zip(axes[:, 0], panels):
            cell = [
                r
                for r in rows
                if r["task"] == task
                and r["length"] == length
                and (r["budget"] == budget or r["method"] == "dense")
            ]
            cell.sort(key=lambda r: METHODS.index(r["method"]) if r["method"] in METHODS else 99)
            names = [
                f"{r['method']} (n={r['n']}, kept {r.get('kept_tokens') or '?'})" for r in cell
            ]
            ys = list(range(len(cell)))[::-1]
            acc = [r["accuracy"] for r in cell]
            err = [
                [
                    r["accuracy"]
                    - (r.get("ci_low") if r.get("ci_low") is not None else r["accuracy"])
                    for r in cell
                ],
                [
                    (r.get("ci_high") if r.get("ci_high") is not None else r["accuracy"])
                    - r["accuracy"]
                    for r in cell
                ],
            ]
            colors = ["C0" if r["method"] in ABLATIONS else "C7" for r in cell]
            ax.barh(ys, acc, xerr=err, color=colors, capsize=3)
            ax.set_yticks(ys, names, fontsize=8)
            ax.set_xlim(0, 105)
            ax.set_xlabel("accuracy (95% interval)")
            ax.set_title(f"{task} @ {length}, budget {budget}", fontsize=9)
        fig.suptitle(f"{report.get('model')}: ROCKETKV ablations", fontsize=10)
        fig.tight_layout()
        out = base + "-methods.png"
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
    ablations = [m for m in methods if m in ABLATIONS]
    if ablations and len(lengths) != 1:
        raise SystemExit(
            f"--methods {','.join(ablations)}: ablation methods are built from the budget "
            f"split of one prompt length; give a single --lengths value, not {args.lengths!r}"
        )
    gen = args.max_tokens or max(eval_tasks.DEFAULT_MAX_TOKENS[t] for t in tasks)
    max_model_len = args.max_model_len or max(lengths) + gen
    model = resolve_model(args.model)
    head_dim = model_head_dim(model)
    tokenizer = AutoTokenizer.from_pretrained(model)

    def settings_of(method: str, budget: int | None, length: int | None = None):
        return method_settings(method, budget, gen, head_dim=head_dim, length=length or lengths[0])

    report = load(args.out) if args.resume else {}
    report.setdefault("rows", [])
    report.setdefault("outputs", {})
    report["errors"] = []
    # Each run's command (a resumed file may have been built by several).
    if report.get("command") and not report.get("commands"):
        report["commands"] = [report["command"]]
    old_methods = (report.get("settings") or {}).get("methods") or {}
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
            "head_dim": head_dim,
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
    report.setdefault("commands", []).append(report["command"])
    report["settings"]["methods"] = {
        **old_methods,
        **{
            m: (
                None
                if m == "dense"
                # ablations: their numbers at each budget of this run
                else {str(b): settings_of(m, b) for b in budgets}
                if m in ABLATIONS
                else json.dumps(method_settings(m, 0, gen)).replace('": 0', '": "B"')
            )
            for m in methods
        },
    }
    for row in report["rows"]:  # files written before kept_tokens was recorded
        if row.get("kept_tokens") is None and (
            row["method"] not in ABLATIONS or row["length"] == lengths[0]
        ):
            row["kept_tokens"] = kept_tokens(
                row["method"],
                settings_of(row["method"], row["budget"], row["length"]),
                row["length"],
            )
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
            settings = settings_of(method, budget)
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
                            "kept_tokens": kept_tokens(method, settings, length),
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
        f"\n{'task':16} {'length':>6} {'method':20} {'budget':>6} {'acc':>6} "
        f"{'std':>6} {'95% CI':>13} {'agree':>6} {'1st div':>7}"
    )
    for r in report["rows"]:
        ag, fd = r.get("agreement"), r.get("first_divergence_mean")
        lo, hi = r.get("ci_low"), r.get("ci_high")
        ci = "-" if lo is None else f"{lo:.1f}-{hi:.1f}"
        print(
            f"{r['task']:16} {r['length']:>6} {r['method']:20} "
            f"{'-' if r['budget'] is None else r['budget']:>6} {r['accuracy']:>6.1f} "
            f"{r['std']:>6.1f} {ci:>13} {'-' if ag is None else f'{ag:.2f}':>6} "
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
