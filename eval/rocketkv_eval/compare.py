"""Paired comparison of accuracy cells, pooled over runs with different seeds.

Two methods run on the same prompts (one --seed, one --samples) pass and fail
on the same samples more often than not, so the question "is ROCKETKV below
SnapKV here" is answered by the samples where they disagree: b = only A
passes, c = only B passes, and McNemar's exact test (two-sided binomial
p-value of min(b, c) in b + c fair coin flips). The unpaired 95% intervals
of the two rates overlap long before a paired test stops telling them apart.

Several result files of ``rocketkv_eval.accuracy`` can be pooled when each
was run with its own --seed (new prompts): their samples are concatenated per
cell (task, length, method, budget); two files with the same seed are
refused (they hold the same prompts and would count them twice).

    python scripts/compare_accuracy.py results/grid-smollm2-cpu.json \\
        results/grid-smollm2-cpu-seed1.json --ref snapkv

prints one markdown row per cell with a reference beside it: passes, the
Wilson 95% interval of the pooled rate, the paired split against the
reference and its p-value, and the difference in points.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from rocketkv_eval.accuracy import confidence_interval

PASS = 100  # a sample passes when its score is full marks


def mcnemar_p(only_a: int, only_b: int) -> float:
    """Exact two-sided McNemar p-value: the probability, under a fair coin
    over the ``only_a + only_b`` discordant samples, of a split at least as
    uneven as the one seen (1.0 when there is none)."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def pooled_scores(reports: list[dict]) -> dict[str, list[float]]:
    """Per cell key, the scores of every sample of every report, in report
    order. Refuses two reports run with the same seed."""
    seeds: dict[int, int] = {}
    for i, report in enumerate(reports):
        seed = int((report.get("settings") or {}).get("seed", 0))
        if seed in seeds:
            raise ValueError(
                f"reports {seeds[seed]} and {i} were both run with --seed {seed}: they hold "
                "the same prompts; pool only runs with different seeds"
            )
        seeds[seed] = i
    keys = {key for report in reports for key in report.get("outputs", {})}
    pooled: dict[str, list[float]] = {}
    for key in sorted(keys):
        # A cell missing from one report cannot be paired sample by sample.
        if all(key in report.get("outputs", {}) for report in reports):
            pooled[key] = [float(s["score"]) for report in reports for s in report["outputs"][key]]
    return pooled


def compare(pooled: dict[str, list[float]], ref: str) -> list[dict]:
    """One row per cell whose (task, length, budget) also has ``ref``
    (``ref`` "dense" matches the budget-less dense cell)."""
    rows = []
    for key, scores in pooled.items():
        task, length, method, budget = key.split("/")
        ref_key = f"{task}/{length}/{ref}/{'None' if ref == 'dense' else budget}"
        if method == ref or ref_key not in pooled:
            continue
        ref_scores = pooled[ref_key]
        if len(ref_scores) != len(scores):
            raise ValueError(f"{key}: {len(scores)} samples, {ref_key}: {len(ref_scores)}")
        passed = [s == PASS for s in scores]
        ref_passed = [s == PASS for s in ref_scores]
        only_a = sum(a and not b for a, b in zip(passed, ref_passed))
        only_b = sum(b and not a for a, b in zip(passed, ref_passed))
        lo, hi = confidence_interval(scores)
        rows.append(
            {
                "task": task,
                "length": int(length),
                "budget": None if budget == "None" else int(budget),
                "method": method,
                "ref": ref,
                "n": len(scores),
                "passed": sum(passed),
                "ref_passed": sum(ref_passed),
                "accuracy": sum(scores) / len(scores),  # scores are 0-100
                "ref_accuracy": sum(ref_scores) / len(ref_scores),
                "ci": (lo, hi),
                "only_method": only_a,
                "only_ref": only_b,
                "p": mcnemar_p(only_a, only_b),
            }
        )
    rows.sort(key=lambda r: (r["task"], r["length"], r["method"], r["budget"] or 0))
    return rows


def markdown(rows: list[dict]) -> str:
    out = [
        "| task | length | budget | method | passed | accuracy (95% CI) | ref | ref passed "
        "| difference | only method / only ref | McNemar p |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["ci"]
        out.append(
            f"| {r['task']} | {r['length']} | {r['budget']} | {r['method']} "
            f"| {r['passed']}/{r['n']} | {r['accuracy']:.1f} ({lo:.0f}-{hi:.0f}) "
            f"| {r['ref']} | {r['ref_passed']}/{r['n']} "
            f"| {r['accuracy'] - r['ref_accuracy']:+.1f} "
            f"| {r['only_method']} / {r['only_ref']} | {r['p']:.2g} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reports", nargs="+", help="result JSONs of scripts/eval_accuracy.py")
    ap.add_argument("--ref", default="snapkv", help="reference method (default snapkv)")
    ap.add_argument("--methods", default=None, help="comma list: only these methods")
    args = ap.parse_args(argv)
    reports = []
    for path in args.reports:
        with open(path) as f:
            reports.append(json.load(f))
    rows = compare(pooled_scores(reports), args.ref)
    if args.methods:
        keep = set(args.methods.split(","))
        rows = [r for r in rows if r["method"] in keep]
    if not rows:
        print(f"no cell has both a method and {args.ref!r} in every report", file=sys.stderr)
        return 1
    print(markdown(rows))
    return 0
