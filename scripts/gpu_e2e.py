#!/usr/bin/env python3
"""End-to-end checks of ROCKETKV inside vLLM on a GPU (run by gpu_check.sh).

    python3 scripts/gpu_e2e.py engines --model DIR --out checks.json
    python3 scripts/gpu_e2e.py serve   --model DIR --out checks.json --log serve.log

Engines are started with vLLM's defaults for the machine (on NVIDIA: Model
Runner V2, torch.compile + CUDA graphs, async scheduling); only the memory
share (``--gpu-memory-utilization``, so engines started one after another
fit) and ``max_model_len`` 8192 (SmolLM2's context) are set.

``engines`` (one process, five engines one after another):
  1. FLASH_ATTN: 4 prompts (2 short chats, needle prompts of ~1500 and ~700
     tokens) x 32 greedy tokens with top-2 logprobs; 9 needle cases
     (2000/4000/7000 tokens x depth 0.1/0.5/0.9) x 16 tokens.
  2. ROCKETKV, prompt_budget 4096 (larger than every prompt, so nothing is
     compressed): the 4 prompts. PASS when the greedy tokens equal
     FLASH_ATTN's; a divergence only where FLASH_ATTN's top-2 logprobs are
     within --tie-gap nats counts as PASS_NEAR_TIE (a different attention
     kernel, which may split and sum differently); anything else FAILs.
  3. ROCKETKV, token_budget 256: the 9 needle cases (with top-2 logprobs, for
     step 5). PASS when it finds at least as many needles as FLASH_ATTN minus
     one (the CPU test's rule).
  4. The same with ``kt_dtype`` fp8_e4m3 (the Triton fp8 KT path in a real
     engine): needles found and how many outputs equal step 3's, reported
     (on CPU fp8 KT lost 2 of 12 single needles at this budget), never FAIL.
  5. Step 3 again with ``compilation_config={"cudagraph_mode": "PIECEWISE"}``
     (attention, all of ROCKETKV's Stage 2 included, runs eagerly), while
     step 3 ran vLLM's default (FULL_AND_PIECEWISE: decode steps replay FULL
     CUDA graphs with attention inside). PASS when the greedy tokens equal
     step 3's, PASS_NEAR_TIE when they diverge only where step 3's top-2
     logprobs are within --tie-gap nats, else FAIL (a full graph that gives
     other tokens than eager is silent wrongness). Both engines' facts
     (cudagraph_mode as the front end reads it) are recorded.
``serve``: ``vllm serve MODEL --attention-backend ROCKETKV`` (token budget
  256) and one ``openai`` client chat request ("What is the capital of
  France?", PASS if the answer says Paris) plus one long completion that is
  compressed; the server log must show "ROCKETKV settings".

Results are merged into --out (JSON); exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import gc
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


def log(msg: str) -> None:
    print(f"[gpu_e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def merge_out(path: str | None, key: str, value) -> None:
    if not path:
        return
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data[key] = value
    data.setdefault("date", time.strftime("%Y-%m-%dT%H:%M:%S"))
    try:
        import torch

        if torch.cuda.is_available():
            data.setdefault("gpu", torch.cuda.get_device_name(0))
    except Exception:  # noqa: BLE001
        pass
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         tokenize=False, add_generation_prompt=True)


def engine_facts(llm) -> dict:
    """What the engine actually runs with (read back from its config)."""
    facts = {}
    getters = {
        "attention_backend": lambda c: str(c.attention_config.backend),
        "v2_model_runner": lambda c: bool(c.use_v2_model_runner),
        "async_scheduling": lambda c: c.scheduler_config.async_scheduling,
        "cudagraph_mode": lambda c: str(c.compilation_config.cudagraph_mode),
        "compile_mode": lambda c: str(c.compilation_config.mode),
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


def start_llm(args, backend: str, rocketkv: dict | None, extra: dict | None = None):
    """Start an engine; ``extra`` holds more ``vllm.LLM`` keyword arguments."""
    from vllm import LLM

    kw = dict(model=args.model, attention_backend=backend, max_model_len=MAX_MODEL_LEN,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=0)
    if rocketkv is not None:
        kw["additional_config"] = {"rocketkv": rocketkv}
    if extra:
        kw.update(extra)
    log(f"LLM({kw})")
    t0 = time.time()
    llm = LLM(**kw)
    facts = engine_facts(llm)
    facts["init_s"] = round(time.time() - t0, 1)
    log(f"engine up in {facts['init_s']} s: {facts}")
    return llm, facts


def stop_llm(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001
        log(f"shutdown: {type(exc).__name__}: {exc}")
    del llm
    gc.collect()
    time.sleep(2)


def generate(llm, prompts, max_tokens, logprobs=None):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs)
    t0 = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.time() - t0
    res = []
    for o in outs:
        c = o.outputs[0]
        item = {"token_ids": list(c.token_ids), "text": c.text}
        if logprobs:
            # per step: the chosen token's logprob and the best two (id, logprob)
            item["logprobs"] = []
            for tok, step in zip(c.token_ids, c.logprobs):
                top = sorted(((t, lp.logprob) for t, lp in step.items()),
                             key=lambda x: -x[1])[:2]
                item["logprobs"].append({"lp": step[tok].logprob, "top": top})
        res.append(item)
    return res, round(dt, 2)


def compare(ref: list, ours: list, tie_gap: float) -> dict:
    rows, status = [], "PASS"
    for i, (a, b) in enumerate(zip(ref, ours)):
        ta, tb = a["token_ids"], b["token_ids"]
        same = 0
        for x, y in zip(ta, tb):
            if x != y:
                break
            same += 1
        lp_diff = max((abs(sa["lp"] - sb["lp"]) for sa, sb in
                       zip(a["logprobs"][:same], b["logprobs"][:same])), default=0.0)
        row = {"prompt": i, "tokens": len(ta), "common_prefix": same,
               "max_logprob_diff_on_prefix": round(lp_diff, 5)}
        if ta != tb:
            top = a["logprobs"][same]["top"] if same < len(a["logprobs"]) else []
            gap = top[0][1] - top[1][1] if len(top) == 2 else None
            row.update(ref_top2_at_divergence=top, ref_gap=gap,
                       ref_text=a["text"], rocketkv_text=b["text"])
            if gap is not None and gap < tie_gap:
                row["verdict"] = "near tie"
                status = "PASS_NEAR_TIE" if status == "PASS" else status
            else:
                row["verdict"] = "DIVERGED"
                status = "FAIL"
        rows.append(row)
    return {"status": status, "tie_gap": tie_gap, "prompts": rows}


def cmd_engines(args) -> int:
    from transformers import AutoTokenizer

    from rocketkv_eval.needle import build_needle_prompt, is_correct

    tok = AutoTokenizer.from_pretrained(args.model)
    eq_prompts = [
        chat(tok, "What is the capital of France? Answer in one sentence."),
        chat(tok, "Write a short poem about the sea."),
        build_needle_prompt(tok, 1500, 0.5, seed=1).prompt,
        build_needle_prompt(tok, 700, 0.2, seed=2).prompt,
    ]
    cases = [build_needle_prompt(tok, n, d, seed=i) for i, (n, d) in enumerate(NEEDLE_CASES)]
    needle_prompts = [c.prompt for c in cases]
    result = {"engines": {}}
    failed = False

    llm, facts = start_llm(args, "FLASH_ATTN", None)
    ref_eq, facts["eq_generate_s"] = generate(llm, eq_prompts, 32, logprobs=2)
    ref_needle, facts["needle_generate_s"] = generate(llm, needle_prompts, 16)
    stop_llm(llm)
    result["engines"]["FLASH_ATTN"] = facts
    merge_out(args.out, "engines", result)

    llm, facts = start_llm(args, "ROCKETKV", {"prompt_budget": 4096})
    ours_eq, facts["eq_generate_s"] = generate(llm, eq_prompts, 32, logprobs=2)
    stop_llm(llm)
    result["engines"]["ROCKETKV prompt_budget=4096"] = facts
    eq = compare(ref_eq, ours_eq, args.tie_gap)
    result["uncompressed_vs_flash_attn"] = eq
    log(f"uncompressed ROCKETKV vs FLASH_ATTN: {eq['status']} "
        f"{[(r['common_prefix'], r['tokens']) for r in eq['prompts']]}")
    failed |= eq["status"] == "FAIL"
    merge_out(args.out, "engines", result)

    llm, facts = start_llm(args, "ROCKETKV", {"token_budget": 256})
    # top-2 logprobs so step 5 can apply the tie rule (greedy tokens are unaffected)
    ours_needle, facts["needle_generate_s"] = generate(llm, needle_prompts, 16, logprobs=2)
    full_facts = facts
    stop_llm(llm)
    result["engines"]["ROCKETKV token_budget=256"] = facts
    dense_ok = [is_correct(r["text"], c) for r, c in zip(ref_needle, cases)]
    our_ok = [is_correct(r["text"], c) for r, c in zip(ours_needle, cases)]
    needle = {
        "status": "PASS" if sum(our_ok) >= sum(dense_ok) - 1 else "FAIL",
        "flash_attn_found": sum(dense_ok), "rocketkv_found": sum(our_ok),
        "cases": [{"tokens": c.num_tokens, "depth": c.depth, "answer": c.answer,
                   "flash_attn": [ok, r["text"]], "rocketkv": [ok2, r2["text"]]}
                  for c, ok, r, ok2, r2 in zip(cases, dense_ok, ref_needle, our_ok,
                                               ours_needle)],
    }
    result["needle_token_budget_256"] = needle
    log(f"needle at token_budget 256: ROCKETKV {sum(our_ok)}/9, FLASH_ATTN "
        f"{sum(dense_ok)}/9 -> {needle['status']}")
    failed |= needle["status"] == "FAIL"
    merge_out(args.out, "engines", result)

    llm, facts = start_llm(args, "ROCKETKV", {"token_budget": 256, "kt_dtype": "fp8_e4m3"})
    fp8_needle, facts["needle_generate_s"] = generate(llm, needle_prompts, 16)
    stop_llm(llm)
    result["engines"]["ROCKETKV token_budget=256 kt_dtype=fp8_e4m3"] = facts
    fp8_ok = [is_correct(r["text"], c) for r, c in zip(fp8_needle, cases)]
    result["needle_token_budget_256_fp8_kt"] = {
        "status": "REPORT", "rocketkv_fp8_kt_found": sum(fp8_ok),
        "rocketkv_found": sum(our_ok), "flash_attn_found": sum(dense_ok),
        "same_text_as_bf16_kt": sum(a["text"] == b["text"]
                                    for a, b in zip(fp8_needle, ours_needle)),
    }
    log(f"needle at token_budget 256 with fp8 KT: {sum(fp8_ok)}/9 "
        f"(bf16 KT {sum(our_ok)}/9)")
    merge_out(args.out, "engines", result)

    # 5. step 3's engine with attention eager (piecewise graphs only) vs step 3
    # (vLLM's default: FULL CUDA graphs for uniform decode steps)
    llm, facts = start_llm(args, "ROCKETKV", {"token_budget": 256},
                           extra={"compilation_config": {"cudagraph_mode": "PIECEWISE"}})
    pw_needle, facts["needle_generate_s"] = generate(llm, needle_prompts, 16, logprobs=2)
    stop_llm(llm)
    result["engines"]["ROCKETKV token_budget=256 cudagraph_mode=PIECEWISE"] = facts
    graph = compare(ours_needle, pw_needle, args.tie_gap)
    graph["reference"] = ("ROCKETKV token_budget=256 with vLLM's default cudagraph_mode "
                          "(ref_text); rocketkv_text: the same with PIECEWISE")
    graph["engine_facts"] = {"default": full_facts, "piecewise": facts}
    graph["rocketkv_piecewise_found"] = sum(is_correct(r["text"], c)
                                           for r, c in zip(pw_needle, cases))
    graph["rocketkv_found"] = sum(our_ok)
    result["rocketkv_full_graph_vs_piecewise"] = graph
    log(f"ROCKETKV default ({full_facts.get('cudagraph_mode')}) vs PIECEWISE "
        f"({facts.get('cudagraph_mode')}): {graph['status']} "
        f"{[(r['common_prefix'], r['tokens']) for r in graph['prompts']]}")
    failed |= graph["status"] == "FAIL"
    merge_out(args.out, "engines", result)
    return 1 if failed else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(proc, timeout=30) -> None:
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


def cmd_serve(args) -> int:
    import urllib.request

    from rocketkv_eval.needle import build_needle_prompt

    port = _free_port()
    vllm_cmd = [shutil.which("vllm")] if shutil.which("vllm") else \
        [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    cmd = vllm_cmd + [
        "serve", args.model, "--attention-backend", "ROCKETKV",
        "--additional-config", json.dumps({"rocketkv": {"token_budget": 256}}),
        "--max-model-len", str(MAX_MODEL_LEN),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--host", "127.0.0.1", "--port", str(port),
    ]
    log(" ".join(cmd))
    logf = open(args.log, "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                            start_new_session=True)
    if args.pid_file:  # the server has its own session: let the caller clean up too
        with open(args.pid_file, "w") as f:
            f.write(f"{proc.pid}\n")
    # a timeout's SIGTERM must still stop the server (finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    res = {"command": " ".join(cmd), "status": "FAIL"}
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
                    raise RuntimeError(f"not ready after {args.ready_timeout} s")
                time.sleep(1)
        res["ready_s"] = round(time.time() - t0, 1)
        log(f"server ready in {res['ready_s']} s")
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        r = client.chat.completions.create(
            model=args.model, max_tokens=16, temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        answer = r.choices[0].message.content or ""
        res["chat_answer"] = answer
        log(f"chat answer: {answer!r}")
        from transformers import AutoTokenizer

        case = build_needle_prompt(AutoTokenizer.from_pretrained(args.model), 3000, 0.5,
                                   seed=3)
        long = client.completions.create(model=args.model, prompt=case.prompt,
                                         max_tokens=16, temperature=0)
        res["long_prompt_tokens"] = long.usage.prompt_tokens
        res["long_answer"] = long.choices[0].text
        res["long_found_needle"] = case.answer.lower() in long.choices[0].text.lower()
        log(f"long completion ({long.usage.prompt_tokens} tokens, compressed): "
            f"{long.choices[0].text!r} (needle {case.answer!r})")
        res["status"] = "PASS" if "paris" in answer.lower() else "FAIL"
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"[:500]
        log(f"serve FAILED: {res['error']}")
    finally:
        _kill_group(proc)
        logf.close()
    text = open(args.log, errors="replace").read()
    res["rocketkv_settings_logged"] = "ROCKETKV settings" in text
    if not res["rocketkv_settings_logged"]:
        res["status"] = "FAIL"
    keys = ("ROCKETKV settings", "Using V2 Model Runner", "CUDAGraphMode", "Error")
    for line in text.splitlines():
        if any(k in line for k in keys):
            log("server: " + line.strip()[:300])
    log(f"serve: {res['status']}")
    merge_out(args.out, "serve", res)
    return 0 if res["status"] == "PASS" else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("engines", "serve"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--out", default=None, help="JSON file the results are merged into")
        p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
        if name == "engines":
            p.add_argument("--tie-gap", type=float, default=0.1,
                           help="nats: a divergence where the reference's top-2 "
                                "logprobs are closer than this is a near tie")
        else:
            p.add_argument("--log", default="serve.log")
            p.add_argument("--pid-file", default=None,
                           help="write the server's pid (= its process group) here")
            p.add_argument("--ready-timeout", type=float, default=180)
    args = ap.parse_args(argv)
    return cmd_engines(args) if args.cmd == "engines" else cmd_serve(args)


if __name__ == "__main__":
    sys.exit(main())
