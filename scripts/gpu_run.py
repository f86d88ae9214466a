#!/usr/bin/env python3
"""The GPU check on the device machine (run by scripts/gpu_check.sh; standard library only).

    gpu_run.py call [--dry-run]    every device call's command (the foreground)
    gpu_run.py worker --state DIR  the background worker a call starts (its own session)
    gpu_run.py model-step --state DIR   reassemble, check and rebuild the staged model

A call stages what it carries (.gpu-bundle/tK: a chunk of the vLLM bundle, a slice of the
model), makes sure the worker runs, tells it the time left (from GPU_BUDGET_LEFT and
GPU_START_LEFT, the device tool's status budget_left_s before this call and before the first),
copies the results there are into $OUT and returns; a staging call returns in seconds, so the
next transfer can start, while the worker keeps the GPU busy (processes in their own session
outlive a call). The last call (everything staged) stays until the worker is done or its own
limit is near, then stops the worker and returns every result.

The worker runs gpu_plan.STEPS in value order, each as soon as its inputs are there and the GPU
allows (gpu_plan.pick): timings alone on the GPU, checks two at a time, CPU steps beside them,
each with a time-out from the time left (gpu_plan.step_timeout). Each step's results are written
as it ends (into the state dir's out/, copied to $OUT by every call), so a later time-out loses
nothing earlier. A step that fails under Model Runner V2 (vLLM's default on NVIDIA) is recorded
(summary.json attempts; a failed check is kept in checks-h200.json as "<check> [model runner
V2]"), then retried once with VLLM_USE_V2_MODEL_RUNNER=0.

Files returned (at most 8, under 16 MiB each): summary.json, gpu-check.log (every call and step
log), kernels-h200.json, kernels-fa-h200.json, checks-h200.json, e2e-h200.json.
Environment: GPU_BUDGET_LEFT, GPU_START_LEFT (seconds), OUT, GPU_CHECK_STATE (state dir,
default /tmp/gpu-check, dry run /tmp/gpu-check-dry), GPU_CHECK_STEPS (comma list: run only
these steps, e.g. a rerun; the others keep their results), PYTHON (the interpreter of the steps,
default this one), GPU_CHECK_CARRY (dry run only: which .gpu-bundle/tK count as carried; t1
starts a fresh state), GPU_EST_* (gpu_plan.Estimates). A worker started where one ran before
does not redo the steps that ended ok.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import gpu_e2e  # noqa: E402  (standard library at import time)
import gpu_plan  # noqa: E402

TAG = "h200"
STOP_MARGIN_S = 10  # the last call stops the worker this long before its own limit
POLL_S = 0.5
RUNNER_STEPS = ("e2e-flash", "e2e-rocketkv", "e2e-fp8", "e2e-piecewise", "serve", "e2e-bench")
LOG_CAP = 1 << 20  # bytes of each log kept in gpu-check.log (head 64 KiB + tail)


def now() -> float:
    return time.time()


def read_json(path: str, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def write_json(path: str, data) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def read_info(path: str) -> dict:
    info = {}
    with open(path) as f:
        for line in f:
            k, _, v = line.strip().partition("=")
            if k:
                info[k] = v.strip('"')
    return info


class State:
    """Paths of the state dir (survives between calls while the machine stays warm)."""

    def __init__(self, base: str, dry: bool):
        self.base, self.dry = base, dry
        self.stage = os.path.join(base, "stage")  # the recipe's STAGE
        self.mstage = os.path.join(base, "stage-model")
        self.site = os.path.join(base, "site")  # the recipe's SITE
        self.rkv = os.path.join(base, "rkv-site")  # our package, importable
        self.model = os.path.join(base, "smollm2")
        self.work = os.path.join(base, "work")  # raw engine outputs
        self.out = os.path.join(base, "out")  # results to return
        self.logs = os.path.join(base, "logs")
        for d in (self.stage, self.mstage, self.work, self.out, self.logs):
            os.makedirs(d, exist_ok=True)
        self.control = os.path.join(base, "control.json")  # deadline, final (from calls)
        self.stop = os.path.join(base, "stop")
        self.pid = os.path.join(base, "worker.pid")
        self.summary = os.path.join(self.out, "summary.json")
        self.staged = os.path.join(base, "staged.json")
        self.calls_log = os.path.join(self.logs, "00-calls.log")

    def have(self) -> set[str]:
        """The payloads fully staged: "bundle", "model"."""
        got = set()
        for what, d, key in (
            ("bundle", self.stage, "BUNDLE_INFO"),
            ("model", self.mstage, "MODEL_INFO"),
        ):
            p = os.path.join(d, key)
            if not os.path.exists(p):
                continue
            info = read_info(p)
            n = int(info.get("NPARTS") or info.get("NPIECES") or 0)
            if n and all(
                os.path.exists(os.path.join(d, f"{info['PREFIX']}.{i:02d}"))
                for i in range(1, n + 1)
            ):
                got.add(what)
        return got


# ---------------------------------------------------------------- environment
def make_shim(st: State, py: str) -> None:
    """rocketkv_vllm (kernels/ and configs/ mapped as in pyproject.toml) and rocketkv_eval as
    symlinks into this checkout, a dist-info carrying pyproject's entry points (so vLLM and
    every process it spawns find the plugin through PYTHONPATH), and a `vllm` command."""
    if os.path.exists(os.path.join(st.rkv, ".complete")):
        return
    shutil.rmtree(st.rkv, ignore_errors=True)
    pkg = os.path.join(st.rkv, "rocketkv_vllm")
    os.makedirs(pkg)
    os.makedirs(os.path.join(st.rkv, "bin"))
    for f in os.listdir(os.path.join(ROOT, "rocketkv_vllm")):
        if f != "__pycache__":
            os.symlink(os.path.join(ROOT, "rocketkv_vllm", f), os.path.join(pkg, f))
    os.symlink(os.path.join(ROOT, "kernels"), os.path.join(pkg, "kernels"))
    os.symlink(os.path.join(ROOT, "configs"), os.path.join(pkg, "configs"))
    os.symlink(os.path.join(ROOT, "rocketkv_eval"), os.path.join(st.rkv, "rocketkv_eval"))
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        proj = tomllib.load(f)["project"]
    d = os.path.join(st.rkv, f"{proj['name'].replace('-', '_')}-{proj['version']}.dist-info")
    os.makedirs(d)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {proj['name']}\nVersion: {proj['version']}\n")
    with open(os.path.join(d, "entry_points.txt"), "w") as f:
        for group, eps in proj.get("entry-points", {}).items():
            f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n")
    vllm = os.path.join(st.rkv, "bin", "vllm")
    with open(vllm, "w") as f:
        f.write(f'#!/bin/sh\nexec "{py}" -m vllm.entrypoints.cli.main "$@"\n')
    os.chmod(vllm, 0o755)
    open(os.path.join(st.rkv, ".complete"), "w").close()


def step_env(st: State, with_vllm: bool) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if st.dry:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = st.rkv + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PATH"] = os.path.join(st.rkv, "bin") + ":" + env.get("PATH", "")
    env_sh = os.path.join(st.site, ".bundle", "env.sh")
    if with_vllm and os.path.exists(env_sh):
        # the recipe's `export PYTHONPATH=/tmp/site${PYTHONPATH:+:...} ...` line, applied by bash
        r = subprocess.run(
            ["bash", "-c", f'. "{env_sh}" && env -0'], env=env, capture_output=True, timeout=30
        )
        if r.returncode == 0:
            env = dict(kv.split("=", 1) for kv in r.stdout.decode().split("\0") if "=" in kv)
    return env


# ---------------------------------------------------------------- the steps' commands
def command_for(name: str, st: State, py: str, timeout: int) -> tuple[list[str], bool]:
    """(argv, needs the vLLM environment) of step ``name`` given ``timeout`` seconds."""
    out = lambda f: os.path.join(st.out, f)  # noqa: E731
    s = gpu_plan.step(name)
    if name == "kernels":
        tb = max(30, min(timeout - 60, s.est_s - 10))
        argv = [
            py,
            os.path.join(ROOT, "scripts/bench_kernels.py"),
            "--time-budget",
            str(tb),
            "--out",
            out(f"kernels-{TAG}.json"),
        ]
        return (argv + ["--smoke"] if st.dry else argv), False
    if name == "kernels-fa":
        tb = max(15, timeout - 30)
        argv = [
            py,
            os.path.join(ROOT, "scripts/bench_kernels.py"),
            "--methods",
            "dense_flash_attn,dense_triton_attn,dense_own",
            "--stage1-context",
            "0",
            "--time-budget",
            str(tb),
            "--out",
            out(f"kernels-fa-{TAG}.json"),
        ]
        return (argv + ["--smoke"] if st.dry else argv), True
    if name == "install":
        if st.dry:  # the CUDA wheels cannot install here: check the archive instead
            return [py, __file__, "check-bundle", "--state", st.base], False
        return [
            "env",
            f"STAGE={st.stage}",
            f"SITE={st.site}",
            f"PY={py}",
            "bash",
            os.path.join(st.stage, "tools", "install.sh"),
        ], False
    if name == "model":
        return [py, __file__, "model-step", "--state", st.base, "--python", py], False
    if name.startswith("e2e-") and name != "e2e-bench":
        argv = [
            py,
            os.path.join(HERE, "gpu_e2e.py"),
            "engine",
            name[4:],
            "--model",
            st.model,
            "--work",
            st.work,
        ]
        return (argv + ["--dry-run"] if st.dry else argv), True
    if name == "serve":
        argv = [
            py,
            os.path.join(HERE, "gpu_e2e.py"),
            "serve",
            "--model",
            st.model,
            "--out",
            out(f"checks-{TAG}.json"),
            "--log",
            os.path.join(st.logs, "serve-server.log"),
            "--pid-file",
            os.path.join(st.base, "serve.pid"),
            "--ready-timeout",
            str(max(30, timeout - 40)),
        ]
        return (argv + ["--dry-run"] if st.dry else argv), True
    if name == "e2e-bench":
        argv = [
            py,
            os.path.join(ROOT, "scripts/bench_e2e.py"),
            "--model",
            st.model,
            "--prompts",
            "8",
            "--prompt-tokens",
            "7000",
            "--new-tokens",
            "128",
            "--methods",
            "dense,token_budget=256",
            "--kv-cache-gib",
            "8",
            "--out",
            out(f"e2e-{TAG}.json"),
        ]
        return (argv[:2] + ["--help"] if st.dry else argv), True
    if name == "tests":
        argv = [
            py,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            "--noconftest",
            os.path.join(ROOT, "tests/test_kernels.py"),
        ]
        if st.dry:
            return argv + ["--co"], False
        return argv + ["-n", "8"], False
    raise ValueError(f"unknown step {name}")


def uses_runner(name: str) -> bool:
    return name in RUNNER_STEPS


def attempt_runner(name: str, st: State, env_v1: bool) -> str:
    """Which model runner the attempt used: "v1", "v2" or "v2?" (not known, default on)."""
    if env_v1:
        return "v1"
    if name.startswith("e2e-") and name != "e2e-bench":
        raw = read_json(os.path.join(st.work, f"{name[4:]}.json"), {})
        v2 = raw.get("facts", {}).get("v2_model_runner")
        if isinstance(v2, bool):
            return "v2" if v2 else "v1"
    return "v2?"


def environment() -> dict:
    """The card as nvidia-smi reads it, and this interpreter (for results/)."""
    env = {"python": sys.version.split()[0]}
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
        )
        if r.returncode == 0 and r.stdout.strip():
            env["nvidia_smi"] = r.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return env


# ---------------------------------------------------------------- the worker
class Worker:
    """Runs the steps (see the module docstring). ``steps``/``command`` can be replaced (tests)."""

    def __init__(
        self,
        st: State,
        py: str,
        steps=None,
        command=None,
        compare=None,
        parallel: int | None = None,
    ):
        self.st, self.py = st, py
        self.steps = list(steps or gpu_plan.STEPS)
        self.command = command or (lambda name, timeout: command_for(name, st, py, timeout))
        self.compare = compare if compare is not None else self.run_compare
        if parallel is not None:
            gpu_plan.MAX_SHARED = parallel
        self.pending = list(self.steps)
        self.running: dict[str, dict] = {}
        self.result: dict[str, str] = {}
        self.attempts: dict[str, list] = {s.name: [] for s in self.steps}
        self.v1: set[str] = set()  # steps to run (again) with VLLM_USE_V2_MODEL_RUNNER=0
        self.preempted: set[str] = set()
        self.events: list[str] = []
        self.environment = environment()
        self.resume(os.environ.get("GPU_CHECK_STEPS"))

    def resume(self, only: str | None) -> None:
        """A worker started where one ran before (it stopped at its deadline, or a rerun)
        does not redo the steps that ended ok; with GPU_CHECK_STEPS it runs just those, the
        others keep their earlier result (a step that needs one that never passed is dropped)."""
        prev = (read_json(self.st.summary, {}) or {}).get("steps", {})
        keep = {x.strip() for x in only.split(",") if x.strip()} if only else None
        for s in list(self.pending):
            p = prev.get(s.name, {})
            if keep is not None and s.name not in keep:
                self.result[s.name] = (
                    "ok"
                    if p.get("status") == "ok"
                    else f"not run ({p.get('status', 'not in GPU_CHECK_STEPS')})"
                )
            elif keep is None and p.get("status") == "ok":
                self.result[s.name] = "ok"
            else:
                continue
            self.attempts[s.name] = p.get("attempts", [])
            self.pending.remove(s)

    # -- bookkeeping
    def say(self, msg: str) -> None:
        line = f"[worker {time.strftime('%H:%M:%S')}] {msg}"
        self.events.append(line)
        print(line, flush=True)

    def control(self) -> dict:
        return read_json(self.st.control, {}) or {}

    def summary(self, state: str = "running") -> None:
        c = self.control()
        steps = {}
        for s in self.steps:
            status = self.result.get(s.name)
            if s.name in self.running:
                status = "running"
            steps[s.name] = {
                "status": status or "pending",
                "attempts": self.attempts[s.name],
                "writes": s.writes,
            }
        write_json(
            self.st.summary,
            {
                "worker": state,
                "updated": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "deadline_in_s": round(c.get("deadline", now()) - now()),
                "calls": c.get("calls", []),
                "environment": self.environment,
                "steps": steps,
                "events": self.events[-200:],
            },
        )

    # -- one step
    def start(self, s: gpu_plan.Step, timeout: int) -> None:
        argv, with_vllm = self.command(s.name, timeout)
        env = step_env(self.st, with_vllm)
        v1 = s.name in self.v1
        if v1:
            env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        log_path = os.path.join(
            self.st.logs, f"{len(self.events):03d}-{s.name}{'-v1' if v1 else ''}.log"
        )
        logf = open(log_path, "w")
        v1_note = ", VLLM_USE_V2_MODEL_RUNNER=0" if v1 else ""
        logf.write(f"$ {' '.join(argv)}\n(timeout {timeout} s{v1_note})\n")
        logf.flush()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.st.rkv if os.path.isdir(self.st.rkv) else None,
            start_new_session=True,
        )
        self.running[s.name] = {
            "step": s,
            "proc": proc,
            "t0": now(),
            "timeout": timeout,
            "log": log_path,
            "logf": logf,
            "v1": v1,
        }
        self.save_groups()
        self.say(
            f"start {s.name} (timeout {timeout} s{', model runner V1' if v1 else ''}): "
            f"{' '.join(argv)}"
        )

    def kill(self, names: list[str], why: str, grace: float = 6.0) -> None:
        """SIGTERM the steps' process groups (a server step stops its server on it), SIGKILL
        what is left after ``grace`` seconds."""
        procs = []
        for name in names:
            r = self.running[name]
            r["killed"] = why
            procs.append(r["proc"])
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
            t_end = now() + (grace if sig == signal.SIGTERM else 5)
            while now() < t_end and any(p.poll() is None for p in procs):
                time.sleep(0.1)

    def save_groups(self) -> None:
        """The running steps' process groups, so a worker after this one can end them."""
        write_json(
            os.path.join(self.st.base, "groups.json"),
            {n: r["proc"].pid for n, r in self.running.items()},
        )

    def end_orphans(self) -> None:
        """Steps a worker that died (SIGKILL) left running in their own sessions."""
        for name, pgid in (read_json(os.path.join(self.st.base, "groups.json"), {}) or {}).items():
            try:  # only a group whose leader is still that step (pids get reused)
                with open(f"/proc/{int(pgid)}/cmdline", "rb") as f:
                    cmdline = f.read().decode(errors="replace")
                ours = (
                    os.path.join(ROOT, "scripts") + os.sep,
                    os.path.join(ROOT, "tests") + os.sep,
                    self.st.base,
                )
                if not any(m in cmdline for m in ours):
                    continue
                os.killpg(int(pgid), signal.SIGKILL)
                self.say(f"ended {name} (process group {pgid}) left by an earlier worker")
            except (OSError, TypeError, ValueError):
                pass
        write_json(os.path.join(self.st.base, "groups.json"), {})

    def finish(self, name: str) -> None:
        r = self.running.pop(name)
        self.save_groups()
        r["logf"].close()
        s, rc = r["step"], r["proc"].returncode
        dt = round(now() - r["t0"], 1)
        why = r.get("killed")
        if why == "preempted":
            self.say(f"{name} preempted after {dt} s (an earlier step needs the GPU)")
            self.attempts[name].append({"status": "preempted", "s": dt, "log": r["log"]})
            if name in self.preempted:
                self.result[name] = "skipped: preempted twice"
            else:
                self.preempted.add(name)
                self.pending.append(s)
                self.pending.sort(key=self.steps.index)
            return
        if why:
            status = why
        elif rc == 0:
            status = "ok"
        else:
            status = f"FAIL (exit {rc})"
        runner = attempt_runner(name, self.st, r["v1"]) if uses_runner(name) else None
        att = {
            "status": status,
            "rc": rc,
            "s": dt,
            "timeout_s": r["timeout"],
            "log": os.path.basename(r["log"]),
        }
        if runner:
            att["runner"] = runner
        self.attempts[name].append(att)
        self.say(f"{name}: {status} after {dt} s" + (f" (model runner {runner})" if runner else ""))
        self.result[name] = status
        if name == "serve":
            pid = read_json(os.path.join(self.st.base, "serve.pid"))
            if isinstance(pid, int):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        failed = {name} if status != "ok" else set()
        if name.startswith("e2e-") and name != "e2e-bench":
            failed |= self.compare(name)
        if not status.startswith("stopped"):
            for f in sorted(failed):
                self.maybe_retry(f)

    def maybe_retry(self, name: str) -> None:
        """A step that failed under Model Runner V2 goes again, once, under V1 (its V2 failure
        is recorded first: its attempt in the summary, its checks as "<check> [model runner
        V2]", its raw outputs as work/NAME-v2.json)."""
        if not uses_runner(name) or name in self.v1 or name in self.running:
            return
        att = [a for a in self.attempts.get(name, []) if a.get("runner")]
        if not att or att[-1]["runner"] == "v1":
            return
        self.v1.add(name)
        if name.startswith("e2e-") and name != "e2e-bench":
            raw = os.path.join(self.st.work, f"{name[4:]}.json")
            if os.path.exists(raw):
                os.replace(raw, os.path.join(self.st.work, f"{name[4:]}-v2.json"))
            checks = os.path.join(self.st.out, f"checks-{TAG}.json")
            data = read_json(checks, {}) or {}
            failed = {
                f"{key} [model runner V2]": c
                for key, c in data.items()
                if isinstance(c, dict)
                and name in c.get("blame", [])
                and c.get("status") == "FAIL"
                and "[" not in key
            }
            if failed:
                gpu_e2e.merge_out(checks, failed)
        s = next(x for x in self.steps if x.name == name)
        self.result.pop(name, None)
        if s not in self.pending:
            self.pending.append(s)
            self.pending.sort(key=self.steps.index)
        self.say(
            f"{name} failed under model runner V2 (recorded): retrying once with "
            "VLLM_USE_V2_MODEL_RUNNER=0"
        )

    def run_compare(self, name: str) -> set[str]:
        """Recompute the checks; the steps blamed for a FAIL involving ``name``."""
        checks = os.path.join(self.st.out, f"checks-{TAG}.json")
        argv = [
            self.py,
            os.path.join(HERE, "gpu_e2e.py"),
            "compare",
            "--work",
            self.st.work,
            "--out",
            checks,
        ]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            for line in (r.stdout + r.stderr).splitlines()[-12:]:
                self.say("compare: " + line)
        except subprocess.TimeoutExpired:
            self.say("compare: timed out")
            return set()
        data = read_json(checks, {})
        blamed = set()
        for key, c in data.items():
            if (
                isinstance(c, dict)
                and c.get("status") == "FAIL"
                and "[" not in key
                and name in c.get("blame", [])
            ):
                blamed |= set(c["blame"])
        return {b for b in blamed if self.result.get(b) is not None}

    # -- the loop
    def run(self) -> int:
        self.say(f"worker {os.getpid()} up; steps: {' '.join(s.name for s in self.steps)}")
        self.end_orphans()
        self.summary()
        while True:
            c = self.control()
            deadline, final = c.get("deadline", now() + 60), bool(c.get("final"))
            stop = os.path.exists(self.st.stop) or now() >= deadline
            for name, r in list(self.running.items()):
                if r["proc"].poll() is not None:
                    self.finish(name)
                elif now() - r["t0"] > r["timeout"]:
                    self.kill([name], f"FAIL (timed out after {r['timeout']} s)")
                    self.finish(name)
            if stop and self.running:
                names = list(self.running)
                self.kill(names, "stopped: the check's time is up")
                for name in names:
                    self.finish(name)
            if stop:
                for s in self.pending:
                    self.result[s.name] = "skipped: the check's time is up"
                self.pending = []
                self.say("time is up: stopped" if now() >= deadline else "stopped by the call")
                self.summary("stopped")
                return 0
            start, preempt, drop = gpu_plan.pick(
                self.pending,
                [r["step"] for r in self.running.values()],
                self.st.have(),
                self.result,
                final,
            )
            for s in preempt:
                self.kill([s.name], "preempted")
                self.finish(s.name)
            for s, why in drop:
                self.pending.remove(s)
                self.result[s.name] = f"skipped: {why}"
                self.say(f"{s.name} skipped: {why}")
            for s in start:
                self.pending.remove(s)
                timeout = gpu_plan.step_timeout(s, deadline - now())
                if timeout == 0:
                    self.result[s.name] = "skipped: time"
                    self.say(f"{s.name} skipped: {round(deadline - now())} s left < {s.min_s} s")
                    continue
                try:
                    self.start(s, timeout)
                except Exception as exc:  # noqa: BLE001
                    self.result[s.name] = f"FAIL (could not start: {exc})"[:200]
                    self.say(f"{s.name}: could not start: {exc}")
            if (
                start
                or drop
                or preempt
                or any(r["proc"].poll() is not None for r in self.running.values())
            ):
                self.summary()
            if not self.pending and not self.running:
                self.say("all steps ended")
                self.summary("done")
                return 0
            time.sleep(POLL_S)


# ---------------------------------------------------------------- the model step
def model_step(st: State, py: str) -> int:
    """Reassemble the staged model payload, check its sha256, unpack, rebuild the HF model."""
    if os.path.exists(os.path.join(st.model, ".rocketkv-complete")) and os.path.exists(
        os.path.join(st.model, "model.safetensors")
    ):
        print(f"model-step: {st.model} already built")
        return 0
    info = read_info(os.path.join(st.mstage, "MODEL_INFO"))
    pieces = [
        os.path.join(st.mstage, f"{info['PREFIX']}.{i:02d}")
        for i in range(1, int(info["NPIECES"]) + 1)
    ]
    h = hashlib.sha256()
    for p in pieces:
        with open(p, "rb") as f:
            for b in iter(lambda: f.read(1 << 20), b""):
                h.update(b)
    if h.hexdigest() != info["SHA256"]:
        print(f"model-step: reassembled payload sha256 {h.hexdigest()} != {info['SHA256']}")
        return 1
    x = os.path.join(st.base, "model-x")
    shutil.rmtree(x, ignore_errors=True)
    os.makedirs(x)
    cat = subprocess.Popen(["cat"] + pieces, stdout=subprocess.PIPE)
    if shutil.which("xz"):
        rc = subprocess.run(["tar", "-xJ", "-C", x], stdin=cat.stdout).returncode
    else:
        import tarfile

        with tarfile.open(fileobj=cat.stdout, mode="r|xz") as tar:
            tar.extractall(x)
        rc = 0
    cat.wait()
    if rc or cat.returncode:
        print("model-step: unpacking failed")
        return 1
    return subprocess.run(
        [
            py,
            os.path.join(HERE, "gpu_model.py"),
            "rebuild",
            os.path.join(x, "smollm2.gguf"),
            os.path.join(x, "smollm2-meta.tar.xz"),
            st.model,
        ]
    ).returncode


def check_bundle(st: State) -> int:
    """Dry run: the staged bundle chunks reassemble to the archive's sha256, and xz reads it."""
    info = read_info(os.path.join(st.stage, "BUNDLE_INFO"))
    chunks = [
        os.path.join(st.stage, f"{info['PREFIX']}.{i:02d}")
        for i in range(1, int(info["NPARTS"]) + 1)
    ]
    h = hashlib.sha256()
    xz = subprocess.Popen(["xz", "-t"], stdin=subprocess.PIPE)
    for c in chunks:
        with open(c, "rb") as f:
            for b in iter(lambda: f.read(1 << 20), b""):
                h.update(b)
                xz.stdin.write(b)
    xz.stdin.close()
    rc = xz.wait()
    got = h.hexdigest()
    ok = got == info["SHA256"] and rc == 0
    print(
        f"check-bundle: {len(chunks)} chunks, sha256 {got[:16]} "
        f"{'==' if got == info['SHA256'] else '!='} {info['SHA256'][:16]}, xz -t rc {rc}: "
        f"{'ok' if ok else 'BAD'} (dry run: install.sh not run)"
    )
    return 0 if ok else 1


# ---------------------------------------------------------------- a call (the foreground)
class Call:
    def __init__(self, dry: bool):
        self.dry = dry
        self.t0 = now()
        base = os.environ.get("GPU_CHECK_STATE") or (
            "/tmp/gpu-check-dry" if dry else "/tmp/gpu-check"
        )
        if dry and os.environ.get("GPU_CHECK_CARRY") == "t1" and os.path.isdir(base):
            shutil.rmtree(base)  # a rehearsal's first call: a fresh machine
        self.st = State(base, dry)
        self.py = os.environ.get("PYTHON") or sys.executable
        self.out = os.environ.get("OUT") or os.path.join(base, "returned")
        os.makedirs(self.out, exist_ok=True)
        self.ok = True
        self.proc = None

    def say(self, msg: str) -> None:
        line = f"[gpu_check {time.strftime('%H:%M:%S')} +{now() - self.t0:.0f}s] {msg}"
        print(line, flush=True)
        with open(self.st.calls_log, "a") as f:
            f.write(line + "\n")

    def carried(self) -> list[tuple[int, str, dict]]:
        """The .gpu-bundle/tK folders here (this call's carry; on a warm machine the earlier
        calls' carries may still be there). Dry run: GPU_CHECK_CARRY=tK says which."""
        only = os.environ.get("GPU_CHECK_CARRY") if self.dry else None
        found = []
        for d in glob.glob(os.path.join(ROOT, ".gpu-bundle", "t[0-9]*")):
            if only is not None and os.path.basename(d) not in only.split(","):
                continue
            p = os.path.join(d, "TRANSFER_INFO")
            if os.path.exists(p):
                info = read_info(p)
                found.append((int(info["CALL"]), d, info))
        return sorted(found)

    def stage(self, d: str) -> bool:
        ok = True
        tools = os.path.join(self.st.stage, "tools")
        os.makedirs(tools, exist_ok=True)
        for f in glob.glob(os.path.join(d, "tools", "*.sh")):
            shutil.copy(f, tools)
        for p in sorted(glob.glob(os.path.join(d, "parts[0-9]*"))):
            r = subprocess.run(
                ["bash", os.path.join(tools, "stage.sh"), p],
                env=dict(os.environ, STAGE=self.st.stage),
                capture_output=True,
                text=True,
            )
            for line in (r.stdout + r.stderr).strip().splitlines():
                self.say("  " + line)
            ok &= r.returncode == 0
        m = os.path.join(d, "model")
        if os.path.isdir(m):
            for line in open(os.path.join(m, "SHA256SUMS")):
                sha, name = line.split()
                dst = os.path.join(self.st.mstage, name)
                shutil.copy(os.path.join(m, name), dst)
                if sha256_file(dst) != sha:
                    os.remove(dst)
                    self.say(f"  model slice {name}: CHECKSUM MISMATCH (removed; carry again)")
                    ok = False
                else:
                    self.say(f"  model slice {name} staged")
            shutil.copy(os.path.join(m, "MODEL_INFO"), self.st.mstage)
        return ok

    def worker_alive(self) -> bool:
        if self.proc is not None:  # started by this call: its child
            return self.proc.poll() is None
        pid = read_json(self.st.pid)
        if not isinstance(pid, int):
            return False
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:  # an exited worker nobody reaped yet
                return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
        except OSError:
            return False

    def copy_out(self) -> None:
        """The results there are, into $OUT (files only, at most 8, each under 16 MiB)."""
        for name in gpu_plan.RESULT_FILES:
            src = os.path.join(self.st.out, name)
            if name == "gpu-check.log":
                self.write_log(os.path.join(self.out, name))
            elif os.path.exists(src):
                shutil.copy(src, os.path.join(self.out, name + ".tmp"))
                os.replace(os.path.join(self.out, name + ".tmp"), os.path.join(self.out, name))

    def write_log(self, dst: str) -> None:
        parts = sorted(glob.glob(os.path.join(self.st.logs, "*.log")))
        with open(dst + ".tmp", "wb") as out:
            for p in parts:
                out.write(f"\n===== {os.path.basename(p)} =====\n".encode())
                size = os.path.getsize(p)
                with open(p, "rb") as f:
                    if size <= LOG_CAP:
                        out.write(f.read())
                    else:
                        out.write(f.read(64 << 10))
                        out.write(f"\n[... {size - LOG_CAP} bytes left out ...]\n".encode())
                        f.seek(size - (LOG_CAP - (64 << 10)))
                        out.write(f.read())
        os.replace(dst + ".tmp", dst)

    def run(self) -> int:
        st = self.st
        carried = self.carried()
        staged = read_json(st.staged, {}) or {}
        fresh = not staged and not os.path.exists(st.control)
        new = [(k, d, i) for k, d, i in carried if os.path.basename(d) not in staged]
        info = (new or carried or [(0, "", {})])[-1][2]
        ncalls = int(info.get("NCALLS", 0) or 0)
        call = max([k for k, _, _ in new], default=ncalls)
        sends = [int(x) for x in info.get("SENDS", "").split()] or [0] * max(ncalls, 1)
        budget = os.environ.get("GPU_BUDGET_LEFT")
        start_left = os.environ.get("GPU_START_LEFT")
        control = read_json(st.control, {}) or {}
        dry = " (DRY RUN, CPU)" if self.dry else ""
        self.say(
            f"call {call or '(rerun)'} of {ncalls or '?'}{dry}; state {st.base}; "
            f"out {self.out}; GPU_BUDGET_LEFT={budget} GPU_START_LEFT={start_left}"
        )
        if start_left is None:
            start_left = control.get("start_left", budget)
        if budget is None:
            # no status read before this call: estimate from the first call's numbers
            if control.get("first"):
                f = control["first"]
                est = gpu_plan.Estimates.from_env()
                budget = (
                    f["budget_left"]
                    - est.start_s
                    - (now() - f["command_at"])
                    - est.transfer_s(sends[call - 1] if call else 0)
                )
                self.say(
                    f"WARNING: GPU_BUDGET_LEFT not given: estimated {budget:.0f} s from "
                    "the first call (give the status budget_left_s)"
                )
            else:
                budget = start_left or 900
                self.say(
                    f"WARNING: GPU_BUDGET_LEFT not given: assuming {budget} s (a drawn "
                    "task's 15 minutes); give the status budget_left_s"
                )
        budget, start_left = float(budget), float(start_left or budget)
        if call > 1 and fresh:
            self.say(
                f"WARNING: a fresh machine (nothing staged before): t1..t{call - 1} are not "
                "here (the machine went back between calls?); carry them again"
            )
        for _, d, _ in new:
            self.say(f"staging {os.path.relpath(d, ROOT)}")
            ok = self.stage(d)
            staged[os.path.basename(d)] = {"ok": ok, "at": time.strftime("%H:%M:%S")}
            self.ok &= ok
        write_json(st.staged, staged)
        have = st.have()
        final = ncalls == 0 or call >= ncalls or {"bundle", "model"} <= have
        if call == 0:
            call = ncalls or 1
        n = max(ncalls, call, 1)
        sends = (sends + [0] * n)[:n]
        est = gpu_plan.Estimates.from_env()
        # seconds since the previous call's command ended: bounds this call's transfer
        since = self.t0 - control["last_end"] if control.get("last_end") else None
        limit = gpu_plan.call_limit(call, n, budget, start_left, sends, est, since)
        rel = gpu_plan.deadline_in(call, n, budget, start_left, sends, est, since)
        deadline = self.t0 + rel - (STOP_MARGIN_S if final else 0)
        calls = control.get("calls", []) + [
            {
                "call": call,
                "at": time.strftime("%H:%M:%S"),
                "budget_left": budget,
                "limit_s": limit,
                "since_last_call_s": since,
                "staged": sorted(have),
                "final": final,
            }
        ]
        control.update(deadline=deadline, final=final, start_left=start_left, calls=calls)
        control.setdefault("first", {"budget_left": budget, "command_at": self.t0})
        write_json(st.control, control)
        if os.path.exists(st.stop):
            os.remove(st.stop)
        self.say(
            f"staged: {', '.join(sorted(have)) or 'nothing complete yet'}; this call's limit "
            f"{limit} s, the worker's deadline in {deadline - now():.0f} s"
            f"{'; last call' if final else ''}"
        )
        make_shim(st, self.py)
        if not self.worker_alive():
            logf = open(os.path.join(st.logs, "01-worker.log"), "a")
            proc = subprocess.Popen(
                [self.py, __file__, "worker", "--state", st.base]
                + (["--dry-run"] if self.dry else []),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=st.base,
            )
            write_json(st.pid, proc.pid)
            self.proc = proc
            self.say(f"worker started (pid {proc.pid}, its own session)")
        else:
            self.say("worker already running: it picks up what was staged")
        if not final:
            time.sleep(2)
            self.copy_out()
            self.print_summary(short=True)
            self.mark_end()
            return 0 if self.ok else 1
        # the last call: wait for the worker, copying results as they come
        end = self.t0 + limit - STOP_MARGIN_S + 2
        printed: set[str] = set()
        while self.worker_alive() and now() < end:
            time.sleep(2)
            self.copy_out()
            for line in (read_json(st.summary, {}) or {}).get("events", []):
                if line not in printed and "compare:" not in line:
                    print("  " + line[:240], flush=True)
                printed.add(line)
        if self.worker_alive():
            open(st.stop, "w").close()
            for _ in range(16):
                if not self.worker_alive():
                    break
                time.sleep(0.5)
        self.copy_out()
        self.mark_end()
        return self.print_summary()

    def mark_end(self) -> None:
        """This call's command ends now (the next call measures its transfer from here)."""
        control = read_json(self.st.control, {}) or {}
        control["last_end"] = now()
        write_json(self.st.control, control)

    def print_summary(self, short: bool = False) -> int:
        s = read_json(self.st.summary, {}) or {}
        steps = s.get("steps", {})
        print(
            f"\n== GPU check summary (worker {s.get('worker', '?')}, "
            f"{now() - self.t0:.0f}s in this call)",
            flush=True,
        )
        bad = 0
        for name, v in steps.items():
            att = v.get("attempts", [])
            extra = "; ".join(
                f"{a.get('runner', '')} {a['status']} {a.get('s')}s".strip() for a in att
            )
            print(f"  {name:14} {v['status']:34} {extra}")
            bad += v["status"].startswith("FAIL")
        checks = read_json(os.path.join(self.st.out, f"checks-{TAG}.json"), {}) or {}
        for key, c in checks.items():
            if isinstance(c, dict) and "status" in c:
                print(f"  check {key}: {c['status']}")
        print(f"  files in $OUT: {' '.join(sorted(os.listdir(self.out)))}", flush=True)
        if short:
            return 0
        return 1 if (bad or not self.ok) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("call")
    c.add_argument("--dry-run", action="store_true")
    w = sub.add_parser("worker")
    w.add_argument("--state", required=True)
    w.add_argument("--dry-run", action="store_true")
    m = sub.add_parser("model-step")
    m.add_argument("--state", required=True)
    m.add_argument("--python", default=sys.executable)
    b = sub.add_parser("check-bundle")
    b.add_argument("--state", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "call":
        return Call(a.dry_run).run()
    if a.cmd == "model-step":
        return model_step(State(a.state, False), a.python)
    if a.cmd == "check-bundle":
        return check_bundle(State(a.state, True))
    st = State(a.state, a.dry_run)
    py = os.environ.get("PYTHON") or sys.executable
    write_json(st.pid, os.getpid())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the steps too (below)
    w = Worker(st, py)
    try:
        return w.run()
    except BaseException as exc:  # the summary must say so, and no step may outlive us
        import traceback

        traceback.print_exc()
        w.say(f"worker FAILED: {type(exc).__name__}: {exc}")
        if w.running:
            why = f"stopped: worker failed ({type(exc).__name__})"
            w.kill(list(w.running), why)
            for name in list(w.running):
                w.running.pop(name)["logf"].close()
                w.result[name] = why
        w.summary("failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
