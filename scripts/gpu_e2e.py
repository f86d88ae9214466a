#!/usr/bin/env python3
"""End-to-end checks of ROCKETKV inside vLLM on a GPU (steps of scripts/gpu_run.py).

    python3 scripts/gpu_e2e.py engine NAME --model DIR --work DIR   (flash rocketkv fp8 piecewise)
    python3 scripts/gpu_e2e.py compare --work DIR --out checks.json
    python3 scripts/gpu_e2e.py serve --model DIR --out checks.json --log serve.log
    python3 scripts/gpu_e2e.py engine NAME --model DIR --work DIR --dry-run   (CPU: validate only)

Engines are sized for a check, not for serving: ``max_num_seqs`` 16, CUDA graphs captured for
batch sizes 1, 2, 4, 8, 16 only, ``max_model_len`` 8192 (SmolLM2's context),
``max_num_batched_tokens`` 8192, a fixed 4 GiB KV cache (``kv_cache_memory_bytes``: no memory
profiling to wait for) and ``gpu_memory_utilization`` 0.2, so two checks can share the GPU. The
rest is vLLM's default on NVIDIA (Model Runner V2, torch.compile, FULL_AND_PIECEWISE graphs,
async scheduling). One engine per configuration, each used for every check it serves:

  flash      FLASH_ATTN: the 4 "eq" prompts (2 short chats, needle prompts of ~1,500 and ~700
             tokens) x 32 greedy tokens and the 9 needle cases (2,000 / 4,000 / 7,000 tokens x
             depth 0.1 / 0.5 / 0.9) x 16 tokens, both with top-2 logprobs: the reference.
  rocketkv   ROCKETKV, token_budget 256, vLLM's default graphs (FULL for uniform decode): the eq
             prompts with the request budget 0 (served uncompressed) and the needle cases.
  fp8        the same with kt_dtype fp8_e4m3 (the Triton fp8 KT path): the needle cases.
  piecewise  rocketkv with cudagraph_mode PIECEWISE (attention, Stage 2 included, eager): the
             needle cases.

Each engine step writes its raw outputs to WORK/NAME.json (engine facts first, then each prompt
set as it completes); ``compare`` (CPU, a second) turns whatever raw files exist into checks:

  uncompressed_vs_flash_attn       rocketkv eq == flash eq: PASS; diverging only where
                                   FLASH_ATTN's top-2 logprobs are within --tie-gap nats:
                                   PASS_NEAR_TIE; else FAIL
  needle_token_budget_256          rocketkv finds >= flash's needles - 1 (the CPU test's rule)
  needle_token_budget_256_fp8_kt   fp8's needles and outputs equal to rocketkv's: REPORT, never FAIL
                                   (on CPU fp8 KT lost 2 of 12 single needles at this budget)
  rocketkv_full_graph_vs_piecewise piecewise needle tokens == rocketkv's (FULL decode graphs),
                                   with the same tie rule (a FULL graph giving other tokens than
                                   eager attention is silent wrongness)

Each check names the engine steps it blames (``blame``): gpu_run.py retries those once with
VLLM_USE_V2_MODEL_RUNNER=0 when the check fails under Model Runner V2. ``serve`` starts
``vllm serve MODEL --attention-backend ROCKETKV`` (token budget 256, sized as above), sends one
OpenAI chat request ("What is the capital of France?": PASS if the answer says Paris) and one
long completion that is compressed; the server log must show "ROCKETKV settings".

Results are merged into --out (JSON, under a lock: steps may run side by side).
Exit status: engine 0 when every prompt set ran, non-zero on an error; compare 1 when a check
FAILs; serve 1 when it FAILs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

NEEDLE_CASES = [(n, d) for n in (2000, 4000, 7000) for d in (0.1, 0.5, 0.9)]
MAX_MODEL_LEN = 8192
CAPTURE_SIZES = [1, 2, 4, 8, 16]
CHECK_ENGINE = {
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 8192,
    "kv_cache_memory_bytes": 4 << 30,
    "gpu_memory_utilization": 0.2,
    "enable_prefix_caching": False,
    "seed": 0,
}
BUDGET = 256
ENGINES = {
    "flash": {
        "backend": "FLASH_ATTN",
        "rocketkv": None,
        "cudagraph_mode": None,
        "sets": ("eq", "needle"),
    },
    "rocketkv": {
        "backend": "ROCKETKV",
        "rocketkv": {"token_budget": BUDGET},
        "cudagraph_mode": None,
        "sets": ("eq0", "needle"),
    },
    "fp8": {
        "backend": "ROCKETKV",
        "rocketkv": {"token_budget": BUDGET, "kt_dtype": "fp8_e4m3"},
        "cudagraph_mode": None,
        "sets": ("needle",),
    },
    "piecewise": {
        "backend": "ROCKETKV",
        "rocketkv": {"token_budget": BUDGET},
        "cudagraph_mode": "PIECEWISE",
        "sets": ("needle",),
    },
}
STEP_OF = {name: f"e2e-{name}" for name in ENGINES}  # gpu_plan step names


def log(msg: str) -> None:
    print(f"[gpu_e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextlib.contextmanager
def locked(path: str):
    """An exclusive lock beside ``path`` (steps running side by side merge into one file)."""
    import fcntl

    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_json(path: str, data) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def merge_out(path: str | None, updates: dict) -> None:
    """Merge top-level keys into the JSON file ``path`` (atomic, under a lock)."""
    if not path:
        return
    with locked(path):
        data = {}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
        data.update(updates)
        data.setdefault("date", time.strftime("%Y-%m-%dT%H:%M:%S"))
        torch = sys.modules.get("torch")  # only where torch is in use: compare starts no CUDA
        with contextlib.suppress(Exception):
            if torch is not None and torch.cuda.is_available():
                data.setdefault("gpu", torch.cuda.get_device_name(0))
        write_json(path, data)


# ---------------------------------------------------------------- engines
def engine_kwargs(name: str, model: str) -> dict:
    """vllm.LLM keyword arguments of engine ``name`` (see the module docstring)."""
    spec = ENGINES[name]
    cc = {
        "cudagraph_capture_sizes": list(CAPTURE_SIZES),
        "max_cudagraph_capture_size": max(CAPTURE_SIZES),
    }
    if spec["cudagraph_mode"]:
        cc["cudagraph_mode"] = spec["cudagraph_mode"]
    kw = dict(model=model, attention_backend=spec["backend"], compilation_config=cc, **CHECK_ENGINE)
    if spec["rocketkv"] is not None:
        kw["additional_config"] = {"rocketkv": dict(spec["rocketkv"])}
    return kw


def serve_command(model: str, port: int) -> list[str]:
    """`vllm serve` with the check's engine sizes (ROCKETKV, token budget 256)."""
    cc = {
        "cudagraph_capture_sizes": list(CAPTURE_SIZES),
        "max_cudagraph_capture_size": max(CAPTURE_SIZES),
    }
    e = CHECK_ENGINE
    vllm_cmd = (
        [shutil.which("vllm")]
        if shutil.which("vllm")
        else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    )
    return vllm_cmd + [
        "serve",
        model,
        "--attention-backend",
        "ROCKETKV",
        "--additional-config",
        json.dumps({"rocketkv": {"token_budget": BUDGET}}),
        "--max-model-len",
        str(e["max_model_len"]),
        "--max-num-seqs",
        str(e["max_num_seqs"]),
        "--max-num-batched-tokens",
        str(e["max_num_batched_tokens"]),
        "--kv-cache-memory-bytes",
        str(e["kv_cache_memory_bytes"]),
        "--gpu-memory-utilization",
        str(e["gpu_memory_utilization"]),
        "--compilation-config",
        json.dumps(cc),
        "--no-enable-prefix-caching",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def engine_facts(llm) -> dict:
    """What the engine actually runs with (read back from its config)."""
    facts = {}
    getters = {
        "attention_backend": lambda c: str(c.attention_config.backend),
        "v2_model_runner": lambda c: bool(c.use_v2_model_runner),
        "async_scheduling": lambda c: c.scheduler_config.async_scheduling,
        "cudagraph_mode": lambda c: str(c.compilation_config.cudagraph_mode),
        "cudagraph_capture_sizes": lambda c: list(c.compilation_config.cudagraph_capture_sizes),
        "compile_mode": lambda c: str(c.compilation_config.mode),
        "max_num_seqs": lambda c: c.scheduler_config.max_num_seqs,
        "enforce_eager": lambda c: c.model_config.enforce_eager,
        "block_size": lambda c: c.cache_config.block_size,
        "dtype": lambda c: str(c.model_config.dtype),
    }
    for key, get in getters.items():
        try:
            facts[key] = get(llm.llm_engine.vllm_config)
        except Exception as exc:  # noqa: BLE001
            facts[key] = f"? ({type(exc).__name__}: {exc})"[:200]
    return facts


def prompt_sets(tokenizer) -> dict:
    """The prompt sets (token ids + what compare needs), the same for every engine."""
    from rocketkv_eval.needle import build_needle_prompt

    def chat(text: str) -> list[int]:
        # as rocketkv_eval.needle renders its prompts: the template holds the special tokens
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer.encode(prompt, add_special_tokens=False))

    eq = [
        chat("What is the capital of France? Answer in one sentence."),
        chat("Write a short poem about the sea."),
        build_needle_prompt(tokenizer, 1500, 0.5, seed=1).token_ids,
        build_needle_prompt(tokenizer, 700, 0.2, seed=2).token_ids,
    ]
    cases = [build_needle_prompt(tokenizer, n, d, seed=i) for i, (n, d) in enumerate(NEEDLE_CASES)]
    return {
        "eq": {"prompts": eq, "max_tokens": 32, "meta": [{"tokens": len(p)} for p in eq]},
        "needle": {
            "prompts": [c.token_ids for c in cases],
            "max_tokens": 16,
            "meta": [{"tokens": c.num_tokens, "depth": c.depth, "answer": c.answer} for c in cases],
        },
    }


def generate(llm, prompts, max_tokens, budget=None):
    from vllm import SamplingParams

    extra = None if budget is None else {"rocketkv_token_budget": budget}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, extra_args=extra)
    t0 = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        steps = []
        for tok, step in zip(c.token_ids, c.logprobs or []):
            top = sorted(((t, lp.logprob) for t, lp in step.items()), key=lambda x: -x[1])[:2]
            steps.append({"lp": step[tok].logprob, "top": top})
        res.append({"token_ids": list(c.token_ids), "text": c.text, "logprobs": steps})
    return res, round(time.time() - t0, 2)


def cmd_engine(args) -> int:
    spec = ENGINES[args.name]
    kw = engine_kwargs(args.name, args.model)
    raw_path = os.path.join(args.work, f"{args.name}.json")
    os.makedirs(args.work, exist_ok=True)
    runner_env = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    raw = {
        "engine": args.name,
        "kwargs": kw,
        "env_VLLM_USE_V2_MODEL_RUNNER": runner_env,
        "facts": {},
        "sets": {},
        "status": "starting",
    }
    if args.dry_run:
        return dry_engine(args, kw)
    write_json(raw_path, raw)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sets = prompt_sets(tokenizer)
    from vllm import LLM

    log(f"LLM({kw})")
    t0 = time.time()
    try:
        llm = LLM(**kw)
    except Exception as exc:  # noqa: BLE001
        raw.update(status="engine failed to start", error=f"{type(exc).__name__}: {exc}"[:2000])
        write_json(raw_path, raw)
        raise
    raw["facts"] = engine_facts(llm)
    raw["facts"]["init_s"] = round(time.time() - t0, 1)
    raw["status"] = "started"
    write_json(raw_path, raw)
    log(f"engine {args.name} up in {raw['facts']['init_s']} s: {raw['facts']}")
    for set_name in spec["sets"]:
        base = sets["eq" if set_name == "eq0" else set_name]
        budget = 0 if set_name == "eq0" else None
        outs, secs = generate(llm, base["prompts"], base["max_tokens"], budget)
        raw["sets"][set_name] = {
            "outputs": outs,
            "meta": base["meta"],
            "generate_s": secs,
            "request_budget": budget,
        }
        write_json(raw_path, raw)
        log(f"{args.name}: {set_name} ({len(outs)} prompts) in {secs} s")
    raw["status"] = "done"
    write_json(raw_path, raw)
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    return 0


def dry_engine(args, kw) -> int:
    """CPU: the engine's arguments must make a VllmConfig (no engine is started) and the prompt
    sets must build; writes raw outputs of the right shape (every engine "answers" the same,
    the needle included) so that compare and the worker's retry logic run too."""
    from transformers import AutoTokenizer
    from vllm.engine.arg_utils import EngineArgs

    try:
        cfg = EngineArgs(**dict(kw)).create_engine_config()
    except Exception as exc:  # noqa: BLE001
        log(f"dry run: {args.name}: EngineArgs({kw}) FAILED: {type(exc).__name__}: {exc}")
        return 2
    cc = cfg.compilation_config
    log(
        f"dry run: {args.name}: config ok (this platform: cudagraph_mode {cc.cudagraph_mode}, "
        f"capture sizes {cc.cudagraph_capture_sizes}, max_num_seqs "
        f"{cfg.scheduler_config.max_num_seqs}, kv_cache_memory_bytes "
        f"{cfg.cache_config.kv_cache_memory_bytes})"
    )
    sets = prompt_sets(AutoTokenizer.from_pretrained(args.model))
    raw = {
        "engine": args.name,
        "kwargs": kw,
        "dry_run": True,
        "env_VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
        "facts": {"v2_model_runner": bool(cfg.use_v2_model_runner)},
        "sets": {},
        "status": "done",
    }
    for set_name in ENGINES[args.name]["sets"]:
        base = sets["eq" if set_name == "eq0" else set_name]
        outs = []
        for m in base["meta"]:
            text = f" {m.get('answer', 'Paris')}"
            outs.append(
                {
                    "token_ids": [1, 2, 3],
                    "text": text,
                    "logprobs": [{"lp": -0.1, "top": [[1, -0.1], [5, -3.0]]}] * 3,
                }
            )
        raw["sets"][set_name] = {
            "outputs": outs,
            "meta": base["meta"],
            "generate_s": 0.0,
            "request_budget": 0 if set_name == "eq0" else None,
        }
    write_json(os.path.join(args.work, f"{args.name}.json"), raw)
    sizes = ", ".join(f"{k}: {len(v['prompts'])}" for k, v in sets.items())
    log(f"dry run: {args.name}: prompt sets built ({sizes}); synthetic raw outputs written")
    return 0


# ---------------------------------------------------------------- compare
def compare_tokens(ref: list, ours: list, tie_gap: float) -> dict:
    """Greedy tokens of ``ours`` against ``ref``: PASS, PASS_NEAR_TIE or FAIL (see docstring)."""
    rows, status = [], "PASS"
    if len(ref) != len(ours):
        return {
            "status": "FAIL",
            "tie_gap": tie_gap,
            "error": f"{len(ref)} reference outputs, {len(ours)} to compare",
        }
    for i, (a, b) in enumerate(zip(ref, ours)):
        ta, tb = a["token_ids"], b["token_ids"]
        same = 0
        for x, y in zip(ta, tb):
            if x != y:
                break
            same += 1
        lp_diff = max(
            (
                abs(sa["lp"] - sb["lp"])
                for sa, sb in zip(a["logprobs"][:same], b["logprobs"][:same])
            ),
            default=0.0,
        )
        row = {
            "prompt": i,
            "tokens": len(ta),
            "common_prefix": same,
            "max_logprob_diff_on_prefix": round(lp_diff, 5),
        }
        if ta != tb:
            top = a["logprobs"][same]["top"] if same < len(a["logprobs"]) else []
            gap = top[0][1] - top[1][1] if len(top) == 2 else None
            row.update(
                ref_top2_at_divergence=top, ref_gap=gap, ref_text=a["text"], other_text=b["text"]
            )
            if gap is not None and gap < tie_gap:
                row["verdict"] = "near tie"
                status = "PASS_NEAR_TIE" if status == "PASS" else status
            else:
                row["verdict"] = "DIVERGED"
                status = "FAIL"
        rows.append(row)
    return {"status": status, "tie_gap": tie_gap, "prompts": rows}


def found(out_set: dict) -> list[bool]:
    return [
        m["answer"].lower() in o["text"].lower()
        for o, m in zip(out_set["outputs"], out_set["meta"])
    ]


def runner_of(raw: dict) -> str:
    """ "v2", "v1" or "v2?" (the engine did not say, and VLLM_USE_V2_MODEL_RUNNER was not 0)."""
    v2 = raw.get("facts", {}).get("v2_model_runner")
    if isinstance(v2, bool):
        return "v2" if v2 else "v1"
    return "v1" if raw.get("env_VLLM_USE_V2_MODEL_RUNNER") == "0" else "v2?"


def compare(raws: dict, tie_gap: float = 0.1) -> dict:
    """Checks from the raw engine outputs there are ({engine name: raw dict}); a check whose
    inputs are missing says which (status NOT_RUN)."""

    def get(name, set_name):
        r = raws.get(name)
        return None if r is None else r.get("sets", {}).get(set_name)

    def missing(*pairs):
        gone = [f"{STEP_OF[n]} {s}" for n, s in pairs if get(n, s) is None]
        return {"status": "NOT_RUN", "missing": gone} if gone else None

    def runners(*names):
        return {STEP_OF[n]: runner_of(raws[n]) for n in names if n in raws}

    checks = {}
    c = missing(("flash", "eq"), ("rocketkv", "eq0")) or compare_tokens(
        get("flash", "eq")["outputs"], get("rocketkv", "eq0")["outputs"], tie_gap
    )
    checks["uncompressed_vs_flash_attn"] = dict(
        c,
        blame=["e2e-rocketkv"],
        runners=runners("flash", "rocketkv"),
        what="ROCKETKV (request budget 0: uncompressed) greedy tokens == FLASH_ATTN's",
    )

    c = missing(("flash", "needle"), ("rocketkv", "needle"))
    if c is None:
        dense_ok, ours_ok = found(get("flash", "needle")), found(get("rocketkv", "needle"))
        c = {
            "status": "PASS" if sum(ours_ok) >= sum(dense_ok) - 1 else "FAIL",
            "flash_attn_found": sum(dense_ok),
            "rocketkv_found": sum(ours_ok),
            "cases": [
                dict(m, flash_attn=[a, ra["text"]], rocketkv=[b, rb["text"]])
                for m, a, b, ra, rb in zip(
                    get("rocketkv", "needle")["meta"],
                    dense_ok,
                    ours_ok,
                    get("flash", "needle")["outputs"],
                    get("rocketkv", "needle")["outputs"],
                )
            ],
        }
    checks["needle_token_budget_256"] = dict(
        c,
        blame=["e2e-rocketkv"],
        runners=runners("flash", "rocketkv"),
        what="needles found at token_budget 256 >= FLASH_ATTN's - 1",
    )

    c = missing(("fp8", "needle"))
    if c is None:
        fp8 = get("fp8", "needle")
        c = {"status": "REPORT", "rocketkv_fp8_kt_found": sum(found(fp8))}
        if get("rocketkv", "needle") is not None:
            bf16 = get("rocketkv", "needle")
            c["rocketkv_found"] = sum(found(bf16))
            c["same_text_as_bf16_kt"] = sum(
                a["text"] == b["text"] for a, b in zip(fp8["outputs"], bf16["outputs"])
            )
        if get("flash", "needle") is not None:
            c["flash_attn_found"] = sum(found(get("flash", "needle")))
        c["texts"] = [o["text"] for o in fp8["outputs"]]
    checks["needle_token_budget_256_fp8_kt"] = dict(
        c,
        blame=["e2e-fp8"],
        runners=runners("fp8", "rocketkv"),
        what="needles found with fp8 KT pages (reported, never FAIL)",
    )

    c = missing(("rocketkv", "needle"), ("piecewise", "needle"))
    if c is None:
        c = compare_tokens(
            get("rocketkv", "needle")["outputs"], get("piecewise", "needle")["outputs"], tie_gap
        )
        c["reference"] = (
            "ROCKETKV token_budget 256 with vLLM's default cudagraph_mode "
            "(ref_text); other_text: the same engine with PIECEWISE"
        )
        c["engine_facts"] = {
            "default": raws["rocketkv"].get("facts"),
            "piecewise": raws["piecewise"].get("facts"),
        }
        c["rocketkv_piecewise_found"] = sum(found(get("piecewise", "needle")))
        c["rocketkv_found"] = sum(found(get("rocketkv", "needle")))
    checks["rocketkv_full_graph_vs_piecewise"] = dict(
        c,
        blame=["e2e-rocketkv", "e2e-piecewise"],
        runners=runners("rocketkv", "piecewise"),
        what="FULL-graph decode tokens == piecewise (eager attention) tokens",
    )
    checks["engines"] = {
        n: dict(
            r.get("facts", {}),
            status=r.get("status"),
            runner=runner_of(r),
            **({"error": r["error"]} if "error" in r else {}),
        )
        for n, r in raws.items()
    }
    return checks


def load_raws(work: str) -> dict:
    raws = {}
    for name in ENGINES:
        p = os.path.join(work, f"{name}.json")
        if os.path.exists(p):
            with open(p) as f:
                raws[name] = json.load(f)
    return raws


def cmd_compare(args) -> int:
    checks = compare(load_raws(args.work), args.tie_gap)
    merge_out(args.out, checks)
    for key, c in checks.items():
        if key != "engines":
            log(
                f"{key}: {c['status']}"
                + (f" (missing {', '.join(c['missing'])})" if c["status"] == "NOT_RUN" else "")
            )
    return 1 if any(c.get("status") == "FAIL" for c in checks.values()) else 0


# ---------------------------------------------------------------- serve
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(proc, timeout=20) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def dry_serve(args) -> int:
    """CPU: vLLM's own `serve` argument parser must accept the command (no server started)."""
    cmd = serve_command(args.model, 8000)
    log("dry run: " + " ".join(cmd))
    try:
        try:
            from vllm.entrypoints.launchers.cli_args import make_arg_parser
        except ImportError:  # older layout
            from vllm.entrypoints.openai.cli_args import make_arg_parser
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser())
        ns = parser.parse_args(cmd[cmd.index("serve") + 1 :])
        ns.model = ns.model_tag  # what `vllm serve` itself does with the positional model
        cfg = AsyncEngineArgs.from_cli_args(ns).create_engine_config()
    except SystemExit as exc:
        log(f"dry run: serve arguments refused (exit {exc.code})")
        return 2
    except Exception as exc:  # noqa: BLE001
        log(f"dry run: serve config FAILED: {type(exc).__name__}: {exc}")
        return 2
    log(
        f"dry run: serve arguments ok (max_num_seqs {cfg.scheduler_config.max_num_seqs}, "
        f"kv_cache_memory_bytes {cfg.cache_config.kv_cache_memory_bytes})"
    )
    return 0


def cmd_serve(args) -> int:
    if args.dry_run:
        return dry_serve(args)
    import urllib.request

    from rocketkv_eval.needle import build_needle_prompt

    port = _free_port()
    cmd = serve_command(args.model, port)
    log(" ".join(cmd))
    logf = open(args.log, "w")
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
    )
    if args.pid_file:  # the server has its own session: let the caller clean up too
        with open(args.pid_file, "w") as f:
            f.write(f"{proc.pid}\n")
    # a time-out's SIGTERM must still stop the server (finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = {
        "command": " ".join(cmd),
        "status": "FAIL",
        "env_VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER"),
    }
    try:
        deadline = t0 + args.ready_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError(f"not ready after {args.ready_timeout} s") from None
                time.sleep(0.5)
        res["ready_s"] = round(time.time() - t0, 1)
        log(f"server ready in {res['ready_s']} s")
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        r = client.chat.completions.create(
            model=args.model,
            max_tokens=16,
            temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        answer = r.choices[0].message.content or ""
        res["chat_answer"] = answer
        log(f"chat answer: {answer!r}")
        res["status"] = "PASS" if "paris" in answer.lower() else "FAIL"
        merge_out(args.out, {"serve": res})  # the chat answer is in, whatever comes next
        from transformers import AutoTokenizer

        case = build_needle_prompt(AutoTokenizer.from_pretrained(args.model), 3000, 0.5, seed=3)
        long = client.completions.create(
            model=args.model, prompt=case.prompt, max_tokens=16, temperature=0
        )
        res["long_prompt_tokens"] = long.usage.prompt_tokens
        res["long_answer"] = long.choices[0].text
        res["long_found_needle"] = case.answer.lower() in long.choices[0].text.lower()
        log(
            f"long completion ({long.usage.prompt_tokens} tokens, compressed): "
            f"{long.choices[0].text!r} (needle {case.answer!r})"
        )
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"[:500]
        log(f"serve FAILED: {res['error']}")
    finally:
        _kill_group(proc)
        logf.close()
    text = open(args.log, errors="replace").read()
    res["rocketkv_settings_logged"] = "ROCKETKV settings" in text
    res["v2_model_runner_logged"] = "V2 Model Runner" in text or "Model Runner V2" in text
    if not res["rocketkv_settings_logged"]:
        res["status"] = "FAIL"
    keys = ("ROCKETKV settings", "Model Runner", "CUDAGraphMode", "Error")
    for line in text.splitlines():
        if any(k in line for k in keys):
            log("server: " + line.strip()[:300])
    log(f"serve: {res['status']}")
    merge_out(args.out, {"serve": res})
    return 0 if res["status"] == "PASS" else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engine", help="start one check engine, write its raw outputs")
    e.add_argument("name", choices=sorted(ENGINES))
    e.add_argument("--model", required=True)
    e.add_argument("--work", required=True, help="folder of the raw outputs (NAME.json)")
    e.add_argument("--dry-run", action="store_true", help="CPU: validate the engine arguments")
    c = sub.add_parser("compare", help="checks from the raw outputs (no GPU, no vLLM)")
    c.add_argument("--work", required=True)
    c.add_argument("--out", required=True, help="JSON file the checks are merged into")
    c.add_argument(
        "--tie-gap",
        type=float,
        default=0.1,
        help="nats: a divergence where the reference's top-2 logprobs are closer "
        "than this is a near tie",
    )
    s = sub.add_parser("serve", help="vllm serve + one OpenAI request")
    s.add_argument("--model", required=True)
    s.add_argument("--out", default=None, help="JSON file the result is merged into")
    s.add_argument("--log", default="serve.log")
    s.add_argument(
        "--pid-file", default=None, help="write the server's pid (= its process group) here"
    )
    s.add_argument("--ready-timeout", type=float, default=150)
    s.add_argument("--dry-run", action="store_true", help="CPU: validate the serve arguments")
    args = ap.parse_args(argv)
    return {"engine": cmd_engine, "compare": cmd_compare, "serve": cmd_serve}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
