"""The GPU check's plan and machinery, on CPU in a few seconds (no engine, no GPU, no vLLM).

scripts/gpu_plan.py (the plan: calls, transfers, time limits, the scheduler's decisions),
scripts/gpu_pack.py (transfer layout and the bundle trim), scripts/gpu_run.py (the device worker:
value order, time-outs, results kept, Model Runner V2 retries) and scripts/gpu_e2e.py's compare.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
_env = dict(os.environ)
import gpu_e2e  # noqa: E402
import gpu_pack  # noqa: E402
import gpu_plan  # noqa: E402
import gpu_results  # noqa: E402
import gpu_run  # noqa: E402

os.environ.clear()  # gpu_e2e sets HF offline defaults at import: keep ours as they were
os.environ.update(_env)

MIB = 1 << 20
TREE = 2 * MIB


def default_plan(budget=900.0, start=None, est=None, tree=TREE):
    carries, staged, _ = gpu_plan.default_layout(tree)
    return gpu_plan.make_plan(tree, carries, staged, budget, start, est or gpu_plan.Estimates())


# ---------------------------------------------------------------- the plan
def test_plan_fits_one_lease():
    p = default_plan()
    assert p["problems"] == []
    assert len(p["calls"]) == 3  # bundle 89 MiB + model 87 MiB, 60 a call
    assert p["window_s"] == gpu_plan.CHECK_S == 720
    assert p["expected_end_s"] <= 720 and p["bound_s"] <= 720
    for c in p["calls"]:
        assert c["send_bytes"] <= 64 * MIB
        assert 0 < c["run"]["timeout_s"] <= 600
        assert c["run"]["carry"] == [f".gpu-bundle/t{c['call']}"]
        assert f"GPU_BUDGET_LEFT={c['budget_left']}" in c["run"]["command"]
    # every step of the value order is given time, in that order of start for the GPU ones
    steps = {s["step"]: s for s in p["steps"]}
    assert set(gpu_plan.STEP_NAMES) <= set(steps)
    for s in p["steps"]:
        if s["step"] != "tests":
            assert s["timeout_s"] > 0 and s["status"] in ("ok", "cut"), s
    order = ["kernels", "kernels-fa", "e2e-flash", "e2e-fp8", "serve", "e2e-bench"]
    starts = [steps[n]["start_at"] for n in order]
    assert starts == sorted(starts)
    assert steps["kernels"]["start_at"] < p["calls"][1]["requested_at"]  # from call 1 on


def test_plan_flags_an_overrun_and_a_big_transfer():
    slow = gpu_plan.Estimates(start_s=600)
    p = default_plan(est=slow)
    assert p["problems"], "a 10-minute machine start cannot fit in 12 minutes"
    carries, staged, _ = gpu_plan.default_layout(TREE)
    carries[1] = 63 * MIB  # with the 2 MiB tree: over 64 MiB
    p = gpu_plan.make_plan(TREE, carries, staged, 900)
    assert any("MiB > 64 MiB" in x for x in p["problems"])


def test_limits_come_from_the_budget_left():
    sends = [62 * MIB, 62 * MIB, 57 * MIB]
    est = gpu_plan.Estimates()
    last = [gpu_plan.call_limit(3, 3, b, 900, sends, est) for b in (700, 650, 400)]
    assert last[0] > last[1] > last[2] > 0
    # the last call gets the rest of the 12 minutes: used = 900 - 700 s, less its transfer
    assert last[0] == int(720 - 200 - est.transfer_s(sends[2]) - gpu_plan.SLACK_S)
    assert gpu_plan.call_limit(3, 3, 900, 900, sends, est) == 600 - gpu_plan.SLACK_S
    # a smaller session: the window shrinks to what is left, less the floor
    assert gpu_plan.window_s(600) == 600 - gpu_plan.CHECK_FLOOR_S
    assert gpu_plan.call_limit(1, 3, 900, 900, sends, est) == gpu_plan.STAGE_CALL_S
    assert gpu_plan.call_limit(1, 3, 200, 200, sends, est) == 0  # no time: nothing to run
    # the worker's deadline seen from a staging call reaches past that call
    assert gpu_plan.deadline_in(1, 3, 900, 900, sends, est) > 400
    # on the device a later call measures its transfer (seconds since the previous call ended)
    slow = gpu_plan.call_limit(3, 3, 700, 900, sends, est, since_last=60)
    assert slow == int(720 - 200 - 60 - est.call_s - gpu_plan.SLACK_S) < last[0]


def test_plan_cli_prints_calls_transfers_and_steps():
    r = subprocess.run(
        [
            "bash",
            os.path.join(ROOT, "scripts/gpu_check.sh"),
            "--plan",
            "--bundle-dir",
            "/nonexistent",
            "--tree-bytes",
            str(TREE),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    calls = re.findall(r"run\(command=\"([^\"]+)\", carry=(\[[^\]]*\]), timeout_s=(\d+)\)", out)
    assert len(calls) == 3
    assert all(int(t) <= 600 for _, _, t in calls)
    sends = [float(x) for x in re.findall(r"sends ([\d.]+) MiB", out)]
    assert len(sends) == 3 and max(sends) <= 64
    for name in gpu_plan.STEP_NAMES:
        assert re.search(rf"^{re.escape(name)} +\d+s +\d+s +\d+s", out, re.M), name
    assert "window 720 s: OK" in out
    # over budget: the plan says so and the exit status is 1
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts/gpu_plan.py"),
            "plan",
            "--bundle-dir",
            "/nonexistent",
            "--tree-bytes",
            str(TREE),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, GPU_EST_START_S="650"),
    )
    assert r.returncode == 1 and "PROBLEMS" in r.stdout


def test_next_gives_the_exact_run_arguments():
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts/gpu_plan.py"),
            "next",
            "--call",
            "3",
            "--budget-left",
            "690",
            "--start-left",
            "900",
            "--bundle-dir",
            "/nonexistent",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    args = json.loads(r.stdout)
    assert args["carry"] == [".gpu-bundle/t3"]
    assert args["command"] == "GPU_START_LEFT=900 GPU_BUDGET_LEFT=690 bash scripts/gpu_check.sh"
    assert 300 < args["timeout_s"] <= 600


# ---------------------------------------------------------------- transfers
def test_layout_fills_calls_in_order_under_the_cap():
    cap = 60 * MIB
    calls = gpu_plan.layout([("bundle", 89 * MIB + 5), ("model", 87 * MIB)], cap)
    assert len(calls) == 3
    assert all(sum(n for _, _, n in c) <= cap for c in calls)
    flat = [p for c in calls for p in c]
    for name, size in (("bundle", 89 * MIB + 5), ("model", 87 * MIB)):
        pieces = [(o, n) for s, o, n in flat if s == name]
        assert sum(n for _, n in pieces) == size
        assert [o for o, _ in pieces] == [sum(n for _, n in pieces[:i]) for i in range(len(pieces))]
    assert flat[0][0] == "bundle" and flat[-1][0] == "model"  # vLLM first: install early
    with pytest.raises(ValueError):
        gpu_plan.layout([("x", 1)], 0)


def test_split_writes_stageable_calls(tmp_path):
    bundle, model = tmp_path / "b.tar.xz", tmp_path / "m.tar.xz"
    bundle.write_bytes(os.urandom(250_000))
    model.write_bytes(os.urandom(180_000))
    tool = tmp_path / "stage.sh"
    tool.write_text("#!/bin/sh\n")
    out = tmp_path / "bundle"
    res = gpu_pack.split(str(bundle), str(model), str(out), 200_000, [str(tool)], tree=1000)
    assert [c["call"] for c in res] == [1, 2, 3]
    got = {"bundle": b"", "model": b""}
    for c in res:
        t = out / f"t{c['call']}"
        info = gpu_run.read_info(str(t / "TRANSFER_INFO"))
        assert info["NCALLS"] == "3" and len(info["SENDS"].split()) == 3
        assert (t / "tools" / "stage.sh").exists()
        for sub, key in ((f"parts{c['call']}", "bundle"), ("model", "model")):
            d = t / sub
            if not d.is_dir():
                continue
            for line in (d / "SHA256SUMS").read_text().splitlines():
                sha, name = line.split()
                assert gpu_run.sha256_file(str(d / name)) == sha
                got[key] += (d / name).read_bytes()
        assert c["bytes"] <= 200_000 + gpu_plan.INFO_BYTES
    assert got["bundle"] == bundle.read_bytes() and got["model"] == model.read_bytes()
    meta = gpu_run.read_info(str(out / "t1" / "parts1" / "BUNDLE_INFO"))
    assert meta["NPARTS"] == "2" and meta["SHA256"] == gpu_run.sha256_file(str(bundle))


def test_trim_drops_members_and_their_record_lines(tmp_path):
    w = tmp_path / "pycountry-1-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr("pycountry/__init__.py", "x = 1\n")
        z.writestr("pycountry/locales/fr/a.mo", b"\0" * 1000)
        z.writestr(
            "pycountry-1.dist-info/RECORD", "pycountry/__init__.py,,\npycountry/locales/fr/a.mo,,\n"
        )
    assert gpu_pack.rewrite_wheel(str(w), "pycountry/locales/*") == 1000
    with zipfile.ZipFile(w) as z:
        assert z.namelist() == ["pycountry/__init__.py", "pycountry-1.dist-info/RECORD"]
        assert "locales" not in z.read("pycountry-1.dist-info/RECORD").decode()
    assert gpu_pack.rewrite_wheel(str(w), "pycountry/locales/*") == 0


# ---------------------------------------------------------------- the scheduler
def S(name, gpu, needs=(), **kw):
    return gpu_plan.Step(
        name,
        gpu,
        tuple(needs),
        kw.pop("min_s", 0),
        kw.pop("est_s", 1),
        kw.pop("max_s", 10),
        "-",
        "-",
        **kw,
    )


def test_pick_keeps_value_order_on_the_gpu():
    k, inst, fa = (
        S("kernels", "excl"),
        S("install", None, ["bundle"]),
        S("kernels-fa", "excl", ["install"]),
    )
    a, b, c = (
        S("e2e-a", "shared", ["install"]),
        S("e2e-b", "shared", ["install"]),
        S("e2e-c", "shared", ["install"]),
    )
    bench, t = S("bench", "excl", ["install"]), S("tests", "shared", filler=True)
    steps = [k, inst, fa, a, b, c, bench, t]
    # call 1: only the kernel bench can run; install waits for the bundle
    start, pre, drop = gpu_plan.pick(steps, [], set(), {}, final=False)
    assert start == [k] and not pre and not drop
    # bundle staged while the bench runs: install (CPU) goes beside it, nothing else on the GPU
    start, _, _ = gpu_plan.pick(steps[1:], [k], {"bundle"}, {}, final=False)
    assert start == [inst]
    # bench done, install running: the filler may use the idle GPU ...
    start, _, _ = gpu_plan.pick(
        [fa, a, b, c, bench, t], [inst], {"bundle"}, {"kernels": "ok"}, False
    )
    assert start == [t]
    # ... and is stopped once an earlier step can start
    res = {"kernels": "ok", "install": "ok"}
    start, pre, _ = gpu_plan.pick([fa, a, b, c, bench], [t], {"bundle"}, res, False)
    assert start == [] and pre == [t]
    # checks share the GPU two at a time; a timing waits for them and blocks later steps
    start, _, _ = gpu_plan.pick(
        [a, b, c, bench], [], {"bundle"}, dict(res, **{"kernels-fa": "ok"}), False
    )
    assert start == [a, b]
    start, _, _ = gpu_plan.pick([bench, t], [c], {"bundle"}, res, False)
    assert start == []
    # a failed dependency drops its dependents; a payload never staged drops at the last call
    start, _, drop = gpu_plan.pick([fa, a], [], set(), {"install": "FAIL (exit 1)"}, True)
    assert start == [] and [s.name for s, _ in drop] == ["kernels-fa", "e2e-a"]
    _, _, drop = gpu_plan.pick([inst], [], set(), {}, True)
    assert drop and "bundle not staged" in drop[0][1]


def test_step_timeout_follows_time_left():
    s = S("x", "shared", min_s=30, max_s=200)
    assert gpu_plan.step_timeout(s, 500) == 200
    assert gpu_plan.step_timeout(s, 90.5) == 90
    assert gpu_plan.step_timeout(s, 29) == 0


# ---------------------------------------------------------------- the worker
def fake_worker(tmp_path, steps, scripts, deadline_s=60):
    st = gpu_run.State(str(tmp_path / "state"), dry=True)
    gpu_run.write_json(st.control, {"deadline": time.time() + deadline_s, "final": True})

    def command(name, timeout):
        return [sys.executable, "-c", scripts[name].replace("OUT", st.out)], False

    return st, gpu_run.Worker(
        st, sys.executable, steps=steps, command=command, compare=lambda name: set()
    )


def test_worker_retries_a_v2_failure_once_under_v1_and_loses_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_run, "POLL_S", 0.05)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.delenv("GPU_CHECK_STEPS", raising=False)
    steps = [
        S("kernels", "excl"),
        S("serve", "shared"),
        S("e2e-bench", "excl", max_s=1),
        S("tests", "shared"),
    ]
    scripts = {
        "kernels": "open('OUT/kernels-h200.json', 'w').write('{\"rows\": [1]}')",
        # fails under Model Runner V2, passes under V1
        "serve": "import os, sys; sys.exit(os.environ.get('VLLM_USE_V2_MODEL_RUNNER') != '0')",
        "e2e-bench": "import time; time.sleep(30)",  # times out, twice
        "tests": "print('tests ran')",
    }
    st, w = fake_worker(tmp_path, steps, scripts)
    t0 = time.time()
    assert w.run() == 0
    assert time.time() - t0 < 15
    s = json.load(open(st.summary))
    serve = s["steps"]["serve"]
    assert serve["status"] == "ok"
    assert [(a["runner"], a["status"]) for a in serve["attempts"]] == [
        ("v2?", "FAIL (exit 1)"),
        ("v1", "ok"),
    ]  # the V2 failure recorded first
    ev = "\n".join(s["events"])
    assert (
        ev.index("serve: FAIL")
        < ev.index("retrying once with VLLM_USE_V2_MODEL_RUNNER=0")
        < ev.index("start serve (timeout 10 s, model runner V1)")
    )
    bench = s["steps"]["e2e-bench"]
    assert [a["status"] for a in bench["attempts"]] == ["FAIL (timed out after 1 s)"] * 2
    assert s["steps"]["tests"]["status"] == "ok"  # a later step still runs
    assert json.load(open(os.path.join(st.out, "kernels-h200.json"))) == {"rows": [1]}
    assert s["steps"]["kernels"]["attempts"][0].get("runner") is None  # no model runner


def test_a_check_failing_under_v2_is_kept_and_its_engine_rerun_under_v1(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_run, "POLL_S", 0.05)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.delenv("GPU_CHECK_STEPS", raising=False)
    steps = [S("e2e-rocketkv", "shared")]
    engine = (
        "import json, os; v2 = os.environ.get('VLLM_USE_V2_MODEL_RUNNER') != '0'; "
        "json.dump({'facts': {'v2_model_runner': v2}}, open('WORK/rocketkv.json', 'w'))"
    )
    st, w = fake_worker(tmp_path, steps, {})
    w.command = lambda name, timeout: (
        [sys.executable, "-c", engine.replace("WORK", st.work)],
        False,
    )
    checks = os.path.join(st.out, "checks-h200.json")

    def compare(name):  # the needle check fails under V2 only
        v2 = json.load(open(os.path.join(st.work, "rocketkv.json")))["facts"]["v2_model_runner"]
        gpu_e2e.merge_out(
            checks,
            {
                "needle_token_budget_256": {
                    "status": "FAIL" if v2 else "PASS",
                    "blame": ["e2e-rocketkv"],
                }
            },
        )
        return {"e2e-rocketkv"} if v2 else set()

    w.compare = compare
    assert w.run() == 0
    s = json.load(open(st.summary))["steps"]["e2e-rocketkv"]
    assert [(a["runner"], a["status"]) for a in s["attempts"]] == [("v2", "ok"), ("v1", "ok")]
    data = json.load(open(checks))
    assert data["needle_token_budget_256 [model runner V2]"]["status"] == "FAIL"
    assert data["needle_token_budget_256"]["status"] == "PASS"
    assert json.load(open(os.path.join(st.work, "rocketkv-v2.json")))["facts"]["v2_model_runner"]


def test_worker_keeps_to_the_deadline(tmp_path, monkeypatch):
    import threading

    monkeypatch.setattr(gpu_run, "POLL_S", 0.05)
    monkeypatch.delenv("GPU_CHECK_STEPS", raising=False)
    steps = [S("kernels", "excl", max_s=60), S("tests", "shared", min_s=1)]
    scripts = {"kernels": "import time; time.sleep(30)", "tests": "pass"}
    # a step's time-out never reaches past the deadline
    st, w = fake_worker(tmp_path, steps, scripts, deadline_s=1.5)
    assert w.run() == 0
    s = json.load(open(st.summary))
    assert s["steps"]["kernels"]["attempts"][0]["timeout_s"] == 1
    assert s["steps"]["tests"]["status"] == "skipped: time"
    # a later call that finds the time up (a new deadline) stops the worker and its steps
    st, w = fake_worker(tmp_path / "b", steps, scripts, deadline_s=60)
    threading.Timer(
        0.5, gpu_run.write_json, (st.control, {"deadline": time.time() + 0.6, "final": True})
    ).start()
    t0 = time.time()
    assert w.run() == 0
    assert time.time() - t0 < 10
    s = json.load(open(st.summary))
    assert s["worker"] == "stopped"
    assert s["steps"]["kernels"]["status"].startswith("stopped")
    assert s["steps"]["tests"]["status"].startswith("skipped")


def test_worker_resumes_and_reruns_only_what_it_is_told(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_run, "POLL_S", 0.05)
    steps = [S("kernels", "excl"), S("install", None), S("kernels-fa", "excl", ["install"])]
    scripts = {"kernels": "import sys; sys.exit(3)", "install": "pass", "kernels-fa": "pass"}
    prev = {
        "steps": {
            "kernels": {"status": "ok", "attempts": [{"status": "ok", "s": 9}]},
            "install": {"status": "FAIL (exit 1)", "attempts": []},
        }
    }
    # a rerun of one step: the others keep their results, a step needing a failed one is dropped
    monkeypatch.setenv("GPU_CHECK_STEPS", "kernels-fa")
    st, w = fake_worker(tmp_path / "a", [], {})
    gpu_run.write_json(st.summary, prev)
    st, w = fake_worker(tmp_path / "a", steps, scripts)
    assert w.run() == 0
    s = json.load(open(st.summary))["steps"]
    assert s["kernels"]["status"] == "ok" and s["kernels"]["attempts"] == [{"status": "ok", "s": 9}]
    assert s["kernels-fa"]["status"].startswith("skipped: needs install")
    # a new worker after one that stopped: what ended ok is not redone, the rest runs
    monkeypatch.delenv("GPU_CHECK_STEPS")
    st, w = fake_worker(tmp_path / "b", [], {})
    gpu_run.write_json(st.summary, prev)
    st, w = fake_worker(tmp_path / "b", steps, scripts)
    assert w.run() == 0
    s = json.load(open(st.summary))["steps"]
    assert s["kernels"]["status"] == "ok"  # exit 3 would have failed it
    assert s["install"]["status"] == "ok" and s["kernels-fa"]["status"] == "ok"


def test_a_new_worker_ends_steps_a_killed_worker_left(tmp_path):
    st, w = fake_worker(tmp_path, [], {})
    mine = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", st.base], start_new_session=True
    )
    other = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )  # not ours: left alone
    try:
        gpu_run.write_json(
            os.path.join(st.base, "groups.json"), {"kernels": mine.pid, "x": other.pid}
        )
        w.end_orphans()
        assert mine.wait(timeout=5) == -9
        time.sleep(0.3)  # a SIGKILL sent to it would have landed by now
        assert other.poll() is None
    finally:
        other.kill()
        mine.kill()


# ---------------------------------------------------------------- compare
def out(tokens, text="", gap=5.0):
    return {
        "token_ids": tokens,
        "text": text,
        "logprobs": [{"lp": -0.1, "top": [[t, -0.1], [0, -0.1 - gap]]} for t in tokens],
    }


def raw(name, sets, v2=True):
    return {"engine": name, "facts": {"v2_model_runner": v2}, "sets": sets, "status": "done"}


def test_compare_verdicts_and_blame():
    meta = [{"answer": "amber-wolf"}, {"answer": "ocean-lion"}]
    eq = {"outputs": [out([1, 2, 3]), out([4, 5])], "meta": [{}, {}]}
    needle = {"outputs": [out([7], "amber-wolf"), out([8], "ocean-lion")], "meta": meta}
    raws = {
        "flash": raw("flash", {"eq": eq, "needle": needle}),
        "rocketkv": raw("rocketkv", {"eq0": eq, "needle": needle}),
    }
    c = gpu_e2e.compare(raws)
    assert c["uncompressed_vs_flash_attn"]["status"] == "PASS"
    assert c["needle_token_budget_256"]["status"] == "PASS"
    assert c["needle_token_budget_256_fp8_kt"]["status"] == "NOT_RUN"
    assert c["rocketkv_full_graph_vs_piecewise"]["missing"] == ["e2e-piecewise needle"]
    assert c["uncompressed_vs_flash_attn"]["runners"] == {"e2e-flash": "v2", "e2e-rocketkv": "v2"}
    # a divergence at a clear top-1 fails; at a near tie it passes as such
    bad = {"outputs": [out([1, 9, 3]), out([4, 5])], "meta": [{}, {}]}
    raws["rocketkv"]["sets"]["eq0"] = bad
    c = gpu_e2e.compare(raws)
    assert c["uncompressed_vs_flash_attn"]["status"] == "FAIL"
    assert c["uncompressed_vs_flash_attn"]["blame"] == ["e2e-rocketkv"]
    raws["flash"]["sets"]["eq"] = {
        "outputs": [out([1, 2, 3], gap=0.01), out([4, 5])],
        "meta": [{}, {}],
    }
    assert gpu_e2e.compare(raws)["uncompressed_vs_flash_attn"]["status"] == "PASS_NEAR_TIE"
    # two needles fewer than FLASH_ATTN fails; the piecewise comparison blames both engines
    lost = {"outputs": [out([9], "no"), out([9], "no")], "meta": meta}
    raws["rocketkv"]["sets"]["needle"] = lost
    raws["piecewise"] = raw("piecewise", {"needle": needle})
    c = gpu_e2e.compare(raws)
    assert c["needle_token_budget_256"]["status"] == "FAIL"
    g = c["rocketkv_full_graph_vs_piecewise"]
    assert g["status"] == "FAIL" and g["blame"] == ["e2e-rocketkv", "e2e-piecewise"]


def test_check_engines_are_sized_for_a_check():
    for name in gpu_e2e.ENGINES:
        kw = gpu_e2e.engine_kwargs(name, "/m")
        assert kw["max_num_seqs"] <= 32
        cc = kw["compilation_config"]
        assert max(cc["cudagraph_capture_sizes"]) == cc["max_cudagraph_capture_size"] <= 32
        assert kw["max_model_len"] <= 8192 and kw["kv_cache_memory_bytes"] <= 8 << 30
    assert (
        gpu_e2e.engine_kwargs("piecewise", "/m")["compilation_config"]["cudagraph_mode"]
        == "PIECEWISE"
    )
    assert "cudagraph_mode" not in gpu_e2e.engine_kwargs("rocketkv", "/m")["compilation_config"]
    cmd = gpu_e2e.serve_command("/m", 1234)
    assert cmd[cmd.index("--max-num-seqs") + 1] == "16"
    assert (
        json.loads(cmd[cmd.index("--compilation-config") + 1])["max_cudagraph_capture_size"] <= 32
    )


def test_results_get_card_date_and_command(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    summary = {
        "updated": "2026-12-03T10:00:00",
        "environment": {"nvidia_smi": "NVIDIA H200, 143771 MiB, 580.159.03"},
        "calls": [{"call": 3, "budget_left": 690}],
        "steps": {"kernels": {"status": "ok"}},
        "events": [
            "[worker 10:00:00] start kernels (timeout 240 s): python3 "
            "scripts/bench_kernels.py --out x"
        ],
    }
    (files / "summary.json").write_text(json.dumps(summary))
    (files / "kernels-h200.json").write_text(json.dumps({"rows": [1]}))
    res = tmp_path / "results"
    res.mkdir()
    lines = gpu_results.collect(str(files), str(res))
    k = json.loads((res / "kernels-h200.json").read_text())
    assert k["rows"] == [1]
    g = k["gpu_check"]
    assert g["card"].startswith("NVIDIA H200") and g["date"] == "2026-12-03T10:00:00"
    assert g["step_command"] == "python3 scripts/bench_kernels.py --out x"
    assert g["device_calls"] == [{"call": 3, "budget_left": 690}]
    assert (res / "gpu-check-h200-summary.json").exists() and len(lines) == 2


def test_kernel_rows_get_flash_attn_speedups():
    k = {
        "rows": [
            {"context": 4096, "batch": 8, "method": "dense_own", "ms": 2.0},
            {"context": 4096, "batch": 8, "method": "rocketkv", "ms": 0.5},
            {"context": 32768, "batch": 8, "method": "rocketkv", "ms": 1.0},
        ]
    }
    fa = {
        "rows": [
            {"context": 4096, "batch": 8, "method": "dense_flash_attn", "ms": 1.5},
            {"context": 4096, "batch": 8, "method": "dense_own", "ms": 2.2},
        ]
    }
    assert gpu_results.merge_kernels(k, fa) == 1
    assert k["rows"][1]["speedup_vs_flash_attn"] == 3.0 and k["rows"][1]["flash_attn_ms"] == 1.5
    assert k["rows"][0]["dense_own_ratio"] == 1.1
    assert "speedup_vs_flash_attn" not in k["rows"][2]  # FLASH_ATTN not measured there
