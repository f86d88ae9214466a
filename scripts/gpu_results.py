#!/usr/bin/env python3
"""Copy a GPU check's returned files into results/, each with the card, date and command.

    python scripts/gpu_results.py FILES_AT [--results results] [--dry-run]

FILES_AT is the folder a device call's files came back to (run's files_at; the last call's holds
every result). Each JSON result (kernels-h200.json, kernels-fa-h200.json, checks-h200.json,
e2e-h200.json) is written to results/ with a "gpu_check" entry: the card (nvidia-smi's name,
memory and driver as the worker read them, else torch's device name), the date, the device calls
made (their commands, budget and limits, from summary.json), the command of the step that wrote
it and the status of every step. The kernel bench ran in two parts (without vLLM from call 1,
vLLM's FLASH_ATTN / TRITON_ATTN rows once vLLM was installed): each ROCKETKV row of
kernels-h200.json gets the FLASH_ATTN time of its (context, batch) and ``speedup_vs_flash_attn``
from kernels-fa-h200.json, and ``dense_own_ratio`` (dense_own's time in the second run over the
first: the run-to-run spread). summary.json goes to results/gpu-check-h200-summary.json and
gpu-check.log is left where it is (logs are not results). Prints the lines to paste into
docs/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = ("kernels-h200.json", "kernels-fa-h200.json", "checks-h200.json", "e2e-h200.json")


def card_of(summary: dict, results: dict) -> str:
    env = summary.get("environment", {})
    if env.get("nvidia_smi"):
        return env["nvidia_smi"]
    for r in results.values():
        if isinstance(r, dict) and r.get("gpu"):
            return r["gpu"]
    return "unknown card"


def step_command(summary: dict, step: str) -> str | None:
    """The command of the step's last start, from the worker's events."""
    cmd = None
    for line in summary.get("events", []):
        if f"start {step} (" in line and "): " in line:
            cmd = line.split("): ", 1)[1]
    return cmd


def merge_kernels(kernels: dict, fa: dict) -> int:
    """Add FLASH_ATTN's time and the speedup to kernels' ROCKETKV rows; returns rows updated."""

    def by_size(rows, method):
        return {(r["context"], r["batch"]): r["ms"] for r in rows if r["method"] == method}

    flash = by_size(fa.get("rows", []), "dense_flash_attn")
    own_b = by_size(fa.get("rows", []), "dense_own")
    n = 0
    for r in kernels.get("rows", []):
        key = (r["context"], r["batch"])
        if r["method"] == "rocketkv" and key in flash and r.get("ms"):
            r["flash_attn_ms"] = flash[key]
            r["speedup_vs_flash_attn"] = round(flash[key] / r["ms"], 3)
            n += 1
        if r["method"] == "dense_own" and key in own_b and r.get("ms"):
            r["dense_own_ratio"] = round(own_b[key] / r["ms"], 3)
    return n


def collect(files_at: str, results_dir: str, dry: bool = False) -> list[str]:
    summary = json.load(open(os.path.join(files_at, "summary.json")))
    loaded = {}
    for name in RESULTS:
        p = os.path.join(files_at, name)
        if os.path.exists(p):
            loaded[name] = json.load(open(p))
    card = card_of(summary, loaded)
    if "kernels-h200.json" in loaded and "kernels-fa-h200.json" in loaded:
        merge_kernels(loaded["kernels-h200.json"], loaded["kernels-fa-h200.json"])
    writer = {
        "kernels-h200.json": "kernels",
        "kernels-fa-h200.json": "kernels-fa",
        "e2e-h200.json": "e2e-bench",
        "checks-h200.json": "e2e-flash",
    }
    steps = {k: v.get("status") for k, v in summary.get("steps", {}).items()}
    lines = []
    for name, data in loaded.items():
        data["gpu_check"] = {
            "card": card,
            "date": summary.get("updated", time.strftime("%Y-%m-%dT%H:%M:%S")),
            "device_calls": summary.get("calls", []),
            "step_command": step_command(summary, writer[name]),
            "steps": steps,
            "made_by": "scripts/gpu_check.sh (scripts/gpu_run.py worker)",
        }
        dst = os.path.join(results_dir, name)
        if not dry:
            with open(dst, "w") as f:
                json.dump(data, f, indent=1)
        lines.append(
            f"- `{os.path.relpath(dst, ROOT)}`: {card}, {data['gpu_check']['date']}, "
            f"`{data['gpu_check']['step_command'] or 'see gpu_check.steps'}`"
        )
    dst = os.path.join(results_dir, "gpu-check-h200-summary.json")
    if not dry:
        shutil.copy(os.path.join(files_at, "summary.json"), dst)
    lines.append(f"- `{os.path.relpath(dst, ROOT)}`: every step's status, attempts and time")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files_at")
    ap.add_argument("--results", default=os.path.join(ROOT, "results"))
    ap.add_argument("--dry-run", action="store_true", help="print, write nothing")
    a = ap.parse_args(argv)
    for line in collect(a.files_at, a.results, a.dry_run):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
