#!/usr/bin/env python3
"""The GPU check's plan: device calls, transfers and the time each step is given.

Pure planning (standard library only, no torch / vLLM); used here to print the plan and the exact
arguments of each device call, by scripts/gpu_pack.py to lay the transfers out, and on the device
by scripts/gpu_run.py for every time limit. Nothing here assumes how much device time is left:
every limit is computed from ``budget_left`` (the device tool's ``status`` ``budget_left_s``
read just before the call) and ``start_left`` (the same number read before the first call).

    gpu_plan.py plan [--budget-left B] [--bundle-dir .gpu-bundle]     the whole check (CPU)
    gpu_plan.py next --call K --budget-left B --start-left S          call K's run() arguments
    gpu_plan.py limit --call K --ncalls N --budget-left B --start-left S --sends "b1 b2 .."
                                                                      seconds call K may run

The check, from the first call to the end of the last, machine start and transfers included,
lasts at most CHECK_S (12 minutes) and ends CHECK_FLOOR_S before the session's device time
runs out. Each call sends the working tree plus its carry, at most LIMIT_MIB (64 MiB).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

MIB = 1 << 20
LIMIT_MIB = 64  # per call: working tree + carry (device README, Limits)
MARGIN_MIB = 1.5  # the tree may grow (others work in the same checkout)
CHECK_S = 720  # the whole check: 12 minutes from the first call
CHECK_FLOOR_S = 30  # device time kept back at the end (give_back, rounding)
COMMAND_MAX_S = 600  # one command (device README, Limits)
SLACK_S = 15  # run(timeout_s) = the script's own limit + this: the script ends first
STAGE_CALL_S = 40  # a staging call's own limit (it needs ~5 s: copy, sha256, start worker)
INFO_BYTES = 64 << 10  # per call: tools, checksum and info files


@dataclasses.dataclass(frozen=True)
class Estimates:
    """Assumed costs the budget cannot tell in advance (conservative; override with env
    GPU_EST_START_S, GPU_EST_MIB_PER_S, GPU_EST_CALL_S, GPU_EST_GAP_S)."""

    start_s: float = 120.0  # machine start on the first call ("a minute or more")
    mib_per_s: float = 5.0  # transfer rate onto the device
    call_s: float = 8.0  # per call: set-up and the return of $OUT (small files)
    gap_s: float = 15.0  # between a call's return and the next call (warm only ~30 s)
    stage_s: float = 5.0  # a staging call's command (copy + sha256 + start the worker)

    @classmethod
    def from_env(cls, env=None) -> Estimates:
        env = os.environ if env is None else env
        names = {
            "start_s": "GPU_EST_START_S",
            "mib_per_s": "GPU_EST_MIB_PER_S",
            "call_s": "GPU_EST_CALL_S",
            "gap_s": "GPU_EST_GAP_S",
        }
        return cls(**{k: float(env[v]) for k, v in names.items() if env.get(v)})

    def transfer_s(self, send_bytes: int) -> float:
        """One call's overhead: sending tree + carry, and the return of $OUT."""
        return self.call_s + send_bytes / MIB / self.mib_per_s


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the check, in value order (STEPS). ``gpu``: "excl" (a timing: nothing else on
    the GPU meanwhile), "shared" (a check: may run beside other checks), None (CPU only).
    ``needs``: "bundle" / "model" (all of it staged), or names of steps that must have ended
    ok. ``after``: steps that must have ended (any way) first. min_s: skipped when less is
    left; max_s: its time-out; est_s: what it is expected to take (for the plan)."""

    name: str
    gpu: str | None
    needs: tuple[str, ...]
    min_s: int
    est_s: int
    max_s: int
    writes: str
    what: str
    filler: bool = False  # may run while earlier steps wait; stopped when they can start
    after: tuple[str, ...] = ()


STEPS: tuple[Step, ...] = (
    Step(
        "kernels",
        "excl",
        (),
        60,
        130,
        240,
        "kernels-h200.json",
        "scripts/bench_kernels.py: Stage 2 (3 configs) and dense_own per context x batch, "
        "Stage 1; vLLM not needed (starts in call 1)",
    ),
    Step(
        "install",
        None,
        ("bundle",),
        40,
        90,
        240,
        "-",
        "vLLM 0.32 from the staged bundle (the recipe's install.sh) into the state dir",
    ),
    Step(
        "model",
        None,
        ("model",),
        15,
        30,
        180,
        "-",
        "SmolLM2 rebuilt from the staged GGUF payload (scripts/gpu_model.py), bit-checked",
    ),
    Step(
        "kernels-fa",
        "excl",
        ("install",),
        20,
        45,
        120,
        "kernels-fa-h200.json",
        "scripts/bench_kernels.py: vLLM's FLASH_ATTN / TRITON_ATTN decode + dense_own "
        "(the rows kernels could not have without vLLM)",
        after=("kernels",),
    ),
    Step(
        "e2e-flash",
        "shared",
        ("install", "model"),
        45,
        90,
        200,
        "checks-h200.json",
        "FLASH_ATTN engine: 4 chat/needle prompts x 32 greedy tokens, 9 needle cases "
        "(the reference)",
    ),
    Step(
        "e2e-rocketkv",
        "shared",
        ("install", "model"),
        45,
        90,
        200,
        "checks-h200.json",
        "ROCKETKV engine (token_budget 256, FULL decode graphs): the 4 prompts uncompressed "
        "(request budget 0) == FLASH_ATTN, 9 needle cases",
    ),
    Step(
        "e2e-fp8",
        "shared",
        ("install", "model"),
        30,
        45,
        150,
        "checks-h200.json",
        "ROCKETKV engine, fp8 KT pages: 9 needle cases",
    ),
    Step(
        "e2e-piecewise",
        "shared",
        ("install", "model"),
        30,
        45,
        150,
        "checks-h200.json",
        "ROCKETKV engine, cudagraph_mode PIECEWISE: 9 needle cases == FULL-graph tokens",
    ),
    Step(
        "serve",
        "shared",
        ("install", "model"),
        40,
        60,
        150,
        "checks-h200.json",
        "vllm serve --attention-backend ROCKETKV + one OpenAI chat request + one long completion",
    ),
    Step(
        "e2e-bench",
        "excl",
        ("install", "model"),
        60,
        100,
        240,
        "e2e-h200.json",
        "scripts/bench_e2e.py: dense vs token_budget=256, 8 x 7,000 tokens x 128 new",
    ),
    Step(
        "tests",
        "shared",
        (),
        30,
        90,
        180,
        "gpu-check.log",
        "tests/test_kernels.py on CUDA (pytest, xdist); only in time left over",
        filler=True,
        after=("kernels",),
    ),
)
STEP_NAMES = tuple(s.name for s in STEPS)
RESULT_FILES = (
    "summary.json",
    "gpu-check.log",
    "kernels-h200.json",
    "kernels-fa-h200.json",
    "checks-h200.json",
    "e2e-h200.json",
)
MAX_SHARED = 2  # checks that may share the GPU at once


def step(name: str) -> Step:
    return next(s for s in STEPS if s.name == name)


# ---------------------------------------------------------------- transfers
def layout(streams: list[tuple[str, int]], cap: int) -> list[list[tuple[str, int, int]]]:
    """Fill calls of ``cap`` payload bytes with the streams, in order: a list per call of
    (stream, offset, length). Every byte goes exactly once; no call holds more than cap."""
    if cap <= 0:
        raise ValueError(f"no room for a payload in a call (cap {cap} bytes)")
    calls: list[list[tuple[str, int, int]]] = [[]]
    room = cap
    for name, size in streams:
        off = 0
        while off < size:
            if room <= 0:
                calls.append([])
                room = cap
            n = min(room, size - off)
            calls[-1].append((name, off, n))
            off += n
            room -= n
    return [c for c in calls if c]


def call_cap(tree_bytes_: int, limit_mib: float = LIMIT_MIB, margin_mib: float = MARGIN_MIB) -> int:
    """Payload bytes one call can carry beside the working tree."""
    return int((limit_mib - margin_mib) * MIB) - tree_bytes_ - INFO_BYTES


def tree_bytes(path: str) -> int:
    """Bytes of the files under path (du -b)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def worktree_bytes(root: str) -> int:
    """What every call sends besides its carry: tracked + untracked-not-ignored files."""
    out = subprocess.run(
        ["git", "-C", root, "ls-files", "-co", "--exclude-standard", "-z"],
        check=True,
        capture_output=True,
    ).stdout
    total = 0
    for rel in out.split(b"\0"):
        p = os.path.join(root, rel.decode())
        if rel and os.path.isfile(p) and not os.path.islink(p):
            total += os.path.getsize(p)
    return total


# ---------------------------------------------------------------- time
def window_s(start_left: float) -> float:
    """Seconds the whole check may last, from the first call."""
    return max(0.0, min(CHECK_S, start_left - CHECK_FLOOR_S))


def remaining_s(budget_left: float, start_left: float) -> float:
    """Seconds of the check's window left when budget_left is read."""
    return window_s(start_left) - max(0.0, start_left - budget_left)


def own_cost(call: int, sends: list[int], est: Estimates, since_last: float | None) -> float:
    """What call ``call`` costs before its command starts, plus the return of its files: the
    estimate, or on the device (calls after the first) ``since_last``, the seconds since the
    previous call's command ended. The status was read after that, so since_last bounds the
    part of the gap after it plus the transfer from above: the limits then hold whatever the
    transfer rate really was."""
    if since_last is not None:
        return since_last + est.call_s
    return est.transfer_s(sends[call - 1]) + (est.start_s if call == 1 else 0.0)


def call_limit(
    call: int,
    ncalls: int,
    budget_left: float,
    start_left: float,
    sends: list[int],
    est: Estimates | None = None,
    since_last: float | None = None,
) -> int:
    """Seconds call ``call`` (1-based) of ``ncalls`` may run its command, read off the budget
    just before the call; ``sends`` are the bytes each call sends. A staging call gets what it
    needs (STAGE_CALL_S) if the later calls still fit; the last call gets the rest of the window,
    less its transfer, the return of its files and SLACK_S (its run() timeout_s adds SLACK_S)."""
    est = est or Estimates()
    left = remaining_s(budget_left, start_left) - own_cost(call, sends, est, since_last)
    if call < ncalls:
        later = sum(
            est.gap_s + est.transfer_s(sends[j]) + est.stage_s for j in range(call, ncalls - 1)
        )
        later += est.gap_s + est.transfer_s(sends[ncalls - 1])
        return int(max(0, min(STAGE_CALL_S, left - later - SLACK_S)))
    return int(max(0, min(COMMAND_MAX_S - SLACK_S, left - SLACK_S)))


def deadline_in(
    call: int,
    ncalls: int,
    budget_left: float,
    start_left: float,
    sends: list[int],
    est: Estimates | None = None,
    since_last: float | None = None,
) -> float:
    """Seconds from call ``call``'s command start until the worker must have stopped: the last
    call's own limit. From a staging call it is an estimate (later transfers run while the
    worker works, so only the last call's return and the slack come off); each call refines it
    with a fresh budget_left."""
    est = est or Estimates()
    if call == ncalls:
        return float(call_limit(call, ncalls, budget_left, start_left, sends, est, since_last))
    left = remaining_s(budget_left, start_left) - own_cost(call, sends, est, since_last)
    # ... and the last call's command runs at most COMMAND_MAX_S - SLACK_S
    until_last = est.stage_s + sum(
        est.gap_s + est.transfer_s(sends[j]) + est.stage_s for j in range(call, ncalls - 1)
    )
    until_last += est.gap_s + est.transfer_s(sends[ncalls - 1]) - est.call_s
    return max(0.0, min(left - SLACK_S - est.call_s, until_last + COMMAND_MAX_S - SLACK_S))


def step_timeout(s: Step, left: float) -> int:
    """A step's time-out when ``left`` seconds remain: 0 means skip it (less than its minimum)."""
    if left < s.min_s:
        return 0
    return int(min(s.max_s, left))


def pick(
    pending: list[Step], running: list[Step], have: set[str], result: dict[str, str], final: bool
) -> tuple[list[Step], list[Step], list[tuple[Step, str]]]:
    """The scheduler's one decision, shared by the plan and the device worker.

    pending: steps not started, in value order; running: steps running; have: payloads fully
    staged ("bundle", "model"); result: step -> "ok" or why it did not pass, for ended steps;
    final: no more staging will come. Returns (start, preempt, drop): steps to start now,
    running fillers to stop so an earlier step can have the GPU, and (step, reason) for steps
    that can never run. GPU claims follow value order: once a ready GPU step waits for the GPU,
    no later GPU step starts; CPU steps go as soon as their inputs are there."""
    start: list[Step] = []
    preempt: list[Step] = []
    drop: list[tuple[Step, str]] = []
    run = list(running)
    gpu_blocked = False
    for s in pending:
        dead = [d for d in s.needs if d in result and result[d] != "ok"]
        if dead:
            drop.append((s, f"needs {dead[0]} ({result[dead[0]]})"))
            continue
        missing = [d for d in s.needs if d in ("bundle", "model") and d not in have]
        if missing and final:
            drop.append((s, f"{missing[0]} not staged"))
            continue
        waiting = [d for d in s.needs if d not in ("bundle", "model") and d not in result]
        if missing or waiting or any(a not in result for a in s.after):
            continue
        if s.gpu is None:
            start.append(s)
            continue
        if gpu_blocked:
            continue
        excl = any(r.gpu == "excl" for r in run)
        shared = sum(1 for r in run if r.gpu == "shared")
        free = not excl and (shared == 0 if s.gpu == "excl" else shared < MAX_SHARED)
        if free:
            start.append(s)
            run.append(s)
            continue
        gpu_blocked = True
        if not s.filler:
            preempt += [r for r in run if r.filler and r not in preempt]
    return start, preempt, drop


# ---------------------------------------------------------------- the plan
def simulate(
    sends: list[int], budget_left: float, start_left: float, staged_at: dict, est: Estimates
) -> dict:
    """Expected timeline of the whole check, each step taking est_s (cut at its time-out), with
    the worker's own scheduler (pick). ``staged_at``: {"bundle": call, "model": call}, the
    call whose staging completes each payload."""
    n = len(sends)
    t = 0.0
    calls = []
    cmd_start = {}
    for k in range(1, n + 1):
        left_b = budget_left - t  # what status would say just before this call
        lim = call_limit(k, n, left_b, start_left, sends, est)
        begin = t
        if k == 1:
            t += est.start_s
        t += est.transfer_s(sends[k - 1]) - est.call_s
        cmd_start[k] = t
        calls.append(
            {
                "call": k,
                "requested_at": round(begin),
                "command_at": round(t),
                "budget_left": round(left_b),
                "limit_s": lim,
                "timeout_s": lim + SLACK_S,
                "send_bytes": sends[k - 1],
            }
        )
        if k < n:
            t += est.stage_s + est.call_s + est.gap_s
    deadline = cmd_start[n] + calls[-1]["limit_s"]
    staged = sorted((cmd_start[k] + 2, what) for what, k in staged_at.items())
    pending = list(STEPS)
    running: list[tuple[float, Step]] = []
    result: dict[str, str] = {}
    rows: list[dict] = []
    preempted: set[str] = set()
    now = cmd_start[1] + 2
    while pending or running:
        have = {what for at, what in staged if at <= now}
        final = now >= cmd_start[n]
        start, preempt, drop = pick(pending, [s for _, s in running], have, result, final)
        for s in preempt:  # back to pending (once), after the steps before it
            end = next(e for e, r in running if r is s)
            running.remove((end, s))
            row = next(r for r in reversed(rows) if r["step"] == s.name)
            row.update(expected_s=round(now - row["start_at"]), status="preempted")
            if s.name in preempted:
                result[s.name] = "skipped: preempted twice"
            else:
                preempted.add(s.name)
                pending.append(s)
                pending.sort(key=STEPS.index)
        for s, why in drop:
            pending.remove(s)
            result[s.name] = f"skipped: {why}"
            rows.append(
                {
                    "step": s.name,
                    "start_at": round(now),
                    "timeout_s": 0,
                    "expected_s": 0,
                    "status": f"skipped: {why}",
                }
            )
        for s in start:
            pending.remove(s)
            to = step_timeout(s, deadline - now)
            if to == 0:
                result[s.name] = "skipped: time"
                rows.append(
                    {
                        "step": s.name,
                        "start_at": round(now),
                        "timeout_s": 0,
                        "expected_s": 0,
                        "status": "skipped: time",
                    }
                )
                continue
            dur = min(s.est_s, to)
            running.append((now + dur, s))
            rows.append(
                {
                    "step": s.name,
                    "start_at": round(now),
                    "timeout_s": to,
                    "expected_s": dur,
                    "status": "ok" if dur == s.est_s else "cut",
                }
            )
        if start or drop or preempt:
            continue
        events = [end for end, _ in running] + [at for at, _ in staged if at > now]
        if not events:
            events = [cmd_start[n]] if now < cmd_start[n] else []
        if not events:
            break
        now = min(events)
        for end, s in [r for r in running if r[0] <= now]:
            running.remove((end, s))
            result[s.name] = "ok"
    work_end = max([cmd_start[n]] + [r["start_at"] + r["expected_s"] for r in rows])
    end = min(work_end, deadline) + est.call_s
    return {
        "calls": calls,
        "steps": rows,
        "expected_end_s": round(end),
        "deadline_s": round(deadline),
        "window_s": window_s(start_left),
        "bound_s": round(cmd_start[n] + calls[-1]["timeout_s"] + est.call_s),
    }


def bundle_layout(bundle_dir: str) -> tuple[list[int], dict, int] | None:
    """(carry bytes per call, {"bundle": call, "model": call}, ncalls) of .gpu-bundle/t*."""
    ts = (
        sorted(
            (d for d in os.listdir(bundle_dir) if d[:1] == "t" and d[1:].isdigit()),
            key=lambda d: int(d[1:]),
        )
        if os.path.isdir(bundle_dir)
        else []
    )
    if not ts:
        return None
    sizes, staged = [], {}
    for k, d in enumerate(ts, start=1):
        p = os.path.join(bundle_dir, d)
        sizes.append(tree_bytes(p))
        if os.path.isdir(os.path.join(p, f"parts{k}")):
            staged["bundle"] = k
        if os.path.isdir(os.path.join(p, "model")):
            staged["model"] = k
    return sizes, staged, len(ts)


# Sizes measured on 2026-12-02 (gpu_bundle.sh): the trimmed bundle and the model payload; used
# by `plan` when .gpu-bundle/ is not built (CI).
DEFAULT_PAYLOAD = {"bundle": 93_410_656, "model": 90_913_456}


def default_layout(tree: int) -> tuple[list[int], dict, int]:
    cap = call_cap(tree)
    calls = layout(
        [("bundle", DEFAULT_PAYLOAD["bundle"]), ("model", DEFAULT_PAYLOAD["model"])], cap
    )
    sizes = [sum(n for _, _, n in c) + INFO_BYTES for c in calls]
    staged = {}
    for k, c in enumerate(calls, start=1):
        for name, _, _ in c:
            staged[name] = k
    return sizes, staged, len(calls)


def run_args(call: int, budget_left: float, start_left: float, limit: int) -> dict:
    return {
        "command": f"GPU_START_LEFT={int(start_left)} GPU_BUDGET_LEFT={int(budget_left)} "
        f"bash scripts/gpu_check.sh",
        "carry": [f".gpu-bundle/t{call}"],
        "timeout_s": limit + SLACK_S,
    }


def make_plan(
    tree: int,
    carries: list[int],
    staged: dict,
    budget_left: float,
    start_left: float | None = None,
    est: Estimates | None = None,
) -> dict:
    est = est or Estimates()
    start_left = budget_left if start_left is None else start_left
    sends = [tree + c for c in carries]
    sim = simulate(sends, budget_left, start_left, staged, est)
    problems = []
    for c in sim["calls"]:
        c["carry_bytes"] = carries[c["call"] - 1]
        c["run"] = run_args(c["call"], c["budget_left"], start_left, c["limit_s"])
        if c["send_bytes"] > LIMIT_MIB * MIB:
            problems.append(
                f"call {c['call']} sends {c['send_bytes'] / MIB:.1f} MiB > {LIMIT_MIB} MiB"
            )
        if c["limit_s"] <= 0:
            problems.append(f"call {c['call']} has no time left to run")
    for s in sim["steps"]:
        if not step(s["step"]).filler and s["status"] not in ("ok",):
            problems.append(f"step {s['step']}: {s['status']} in the expected timeline")
    if sim["expected_end_s"] > sim["window_s"]:
        problems.append(f"expected end {sim['expected_end_s']} s > window {sim['window_s']} s")
    if sim["bound_s"] > sim["window_s"] + 1:
        problems.append(f"worst case {sim['bound_s']} s > window {sim['window_s']} s")
    sim.update(
        tree_bytes=tree, estimates=dataclasses.asdict(est), problems=problems, start_left=start_left
    )
    return sim


def format_plan(p: dict) -> str:
    mib = lambda b: f"{b / MIB:.1f}"  # noqa: E731
    e = p["estimates"]
    out = [
        f"GPU check plan: {len(p['calls'])} device calls; window {p['window_s']:.0f} s "
        f"(min({CHECK_S}, start_left {p['start_left']:.0f} - {CHECK_FLOOR_S})), "
        f"from the first call, machine start and transfers included",
        f"assumed: machine start {e['start_s']:.0f} s, transfers {e['mib_per_s']:g} MiB/s "
        f"+ {e['call_s']:.0f} s a call, {e['gap_s']:.0f} s between calls "
        f"(the machine stays warm ~30 s)",
        "",
    ]
    for c in p["calls"]:
        r = c["run"]
        ok = "ok" if c["send_bytes"] <= LIMIT_MIB * MIB else "OVER"
        out.append(
            f"call {c['call']} at ~{c['requested_at']} s (budget_left ~"
            f'{c["budget_left"]}): run(command="{r["command"]}", '
            f"carry={json.dumps(r['carry'])}, timeout_s={r['timeout_s']})"
        )
        out.append(
            f"    sends {mib(c['send_bytes'])} MiB = carry {mib(c['carry_bytes'])} + "
            f"tree {mib(p['tree_bytes'])} <= {LIMIT_MIB} MiB: {ok}; command from ~"
            f"{c['command_at']} s, its own limit {c['limit_s']} s"
        )
    out += ["", f"{'step':14} {'start':>6} {'expect':>7} {'timeout':>7}  writes / what"]
    for s in p["steps"]:
        spec = step(s["step"])
        out.append(
            f"{s['step']:14} {s['start_at']:>5}s {s['expected_s']:>6}s "
            f"{s['timeout_s']:>6}s  {spec.writes}: {spec.what}"
            + ("" if s["status"] == "ok" else f" [{s['status']}]")
        )
    out += [
        "",
        f"expected end ~{p['expected_end_s']} s; worst case (every step to its "
        f"time-out, the last call to its timeout_s) {p['bound_s']} s; window "
        f"{p['window_s']:.0f} s: "
        + ("OK" if not p["problems"] else "PROBLEMS: " + "; ".join(p["problems"])),
    ]
    return "\n".join(out)


def main(argv=None) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="print the whole check (runs here, on CPU)")
    p.add_argument(
        "--budget-left",
        type=float,
        default=None,
        help="status budget_left_s now (default: GPU_BUDGET_LEFT, else 900: a "
        "drawn task's 15 minutes)",
    )
    p.add_argument("--start-left", type=float, default=None)
    p.add_argument("--bundle-dir", default=os.path.join(root, ".gpu-bundle"))
    p.add_argument("--tree-bytes", type=int, default=None)
    p.add_argument("--json", action="store_true")
    n = sub.add_parser("next", help="the run() arguments of call K")
    n.add_argument("--call", type=int, required=True)
    n.add_argument("--budget-left", type=float, required=True)
    n.add_argument("--start-left", type=float, default=None)
    n.add_argument("--bundle-dir", default=os.path.join(root, ".gpu-bundle"))
    lim = sub.add_parser("limit", help="seconds call K may run (used on the device)")
    for q in (lim,):
        q.add_argument("--call", type=int, required=True)
        q.add_argument("--ncalls", type=int, required=True)
        q.add_argument("--budget-left", type=float, required=True)
        q.add_argument("--start-left", type=float, required=True)
        q.add_argument("--sends", required=True, help="bytes each call sends, space separated")
        q.add_argument(
            "--deadline",
            action="store_true",
            help="print the worker's deadline (seconds from now) instead",
        )
    a = ap.parse_args(argv)
    est = Estimates.from_env()
    if a.cmd == "limit":
        sends = [int(x) for x in a.sends.split()]
        f = deadline_in if a.deadline else call_limit
        print(int(f(a.call, a.ncalls, a.budget_left, a.start_left, sends, est)))
        return 0
    tree = worktree_bytes(root) if getattr(a, "tree_bytes", None) is None else a.tree_bytes
    got = bundle_layout(a.bundle_dir)
    source = a.bundle_dir
    if got is None:
        got, source = default_layout(tree), "sizes measured 2026-12-02 (.gpu-bundle/ not built)"
    carries, staged, ncalls = got
    if a.cmd == "next":
        if not 1 <= a.call <= ncalls:
            raise SystemExit(f"call must be 1..{ncalls}")
        start = a.budget_left if a.start_left is None else a.start_left
        sends = [tree + c for c in carries]
        limit = call_limit(a.call, ncalls, a.budget_left, start, sends, est)
        send = sends[a.call - 1]
        print(json.dumps(run_args(a.call, a.budget_left, start, limit)))
        if send > LIMIT_MIB * MIB:
            print(
                f"WARNING: call {a.call} sends {send / MIB:.1f} MiB > {LIMIT_MIB} MiB "
                f"(tree {tree / MIB:.1f} MiB grew?): rerun scripts/gpu_bundle.sh",
                file=sys.stderr,
            )
            return 1
        return 0
    budget = (
        a.budget_left
        if a.budget_left is not None
        else float(os.environ.get("GPU_BUDGET_LEFT", 900))
    )
    plan = make_plan(tree, carries, staged, budget, a.start_left, est)
    plan["source"] = source
    print(
        json.dumps(plan, indent=1) if a.json else f"(transfers from {source})\n" + format_plan(plan)
    )
    return 1 if plan["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
