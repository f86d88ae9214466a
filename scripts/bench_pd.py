"""Disaggregated prefill and decode over NIXL, measured (issue 60, item 4):
dense P/D (vLLM's own backend on both engines) against ROCKETKV P/D.

For each method a prefill engine P (this process) and a decode engine D
(vLLM's spawned processes: one KV connector per process) joined by
NixlConnector (pull, UCX, ``kv_buffer_device`` cpu). P prefills every
prompt with ``max_tokens`` 1 and ``do_remote_decode``; D gets them all at
once with P's params. Reported per method:

- blocks P offered per request (``remote_block_ids``) and bytes D pulled
  (NIXL's own count: vLLM's ``vllm:nixl_bytes_transferred`` histogram sum);
- D's most requests running at once (``vllm:num_requests_running``, polled),
  its KV cache holding ``--fit-dense`` dense requests' tokens;
- D's time to first token per request (vLLM's request metrics), and wall.

    .venv/bin/python scripts/bench_pd.py --prompt-tokens 8000 --requests 8 \\
        --token-budget 256 --fit-dense 2 --json results/pd-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))


def _model(name: str) -> str:
    if name == "tiny":
        from rocketkv_eval.tiny_model import prepare_tiny_model

        return prepare_tiny_model(64, num_heads=3, num_kv_heads=1)
    from rocketkv_eval.model import prepare_model

    return str(prepare_model(name))


def _engine(model, backend, rocketkv, engine_id, spawn, args, kv_bytes):
    import vllm.envs as envs
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.utils.network_utils import get_open_port

    envs.disable_envs_cache()  # each engine reads its side-channel port at start
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(get_open_port())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spawn else "0"
    extra = {"rocketkv": rocketkv} if rocketkv else {}
    return LLM(
        model=model,
        attention_backend=backend,
        additional_config=extra,
        dtype=args.dtype,
        enforce_eager=True,
        seed=0,
        max_model_len=args.prompt_tokens + args.new_tokens + 64,
        max_num_seqs=args.requests,
        kv_cache_memory_bytes=kv_bytes,
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_both",
            kv_buffer_device="cpu",
            engine_id=engine_id,
            # P prefills every request before D gets any: P must hold the
            # offered blocks past vLLM's 30 s lease (a long prefill batch
            # outlasts it, and D would then pull blocks P freed)
            kv_connector_extra_config={"kv_lease_duration": 3600},
        ),
    )


def _metric(llm, name):
    for m in llm.get_metrics():
        if m.name == name:
            return m
    return None


def run_method(method: str, model: str, prompts, args) -> dict:
    from vllm import SamplingParams

    from rocketkv_eval.capacity import kv_bytes_for_tokens

    backend = "ROCKETKV" if method == "rocketkv" else "CPU_ATTN"
    rocketkv = {"token_budget": args.token_budget} if method == "rocketkv" else None
    dtype_bytes = 4 if args.dtype == "float32" else 2
    per_request = args.prompt_tokens + args.new_tokens
    # The same bytes for both: ROCKETKV's blocks also carry KT pages, so it
    # has fewer of them.
    # (+128: a request's last block, at CPU_ATTN's largest block size)
    d_bytes = kv_bytes_for_tokens(model, args.fit_dense * (per_request + 128), dtype_bytes)
    p_bytes = kv_bytes_for_tokens(model, (args.requests + 1) * per_request, dtype_bytes)
    prefill = _engine(model, backend, rocketkv, f"P-{method}", False, args, p_bytes)
    decode = _engine(model, backend, rocketkv, f"D-{method}", True, args, d_bytes)
    try:
        t0 = time.perf_counter()
        first = prefill.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(
                temperature=0.0,
                max_tokens=1,
                extra_args={"kv_transfer_params": {"do_remote_decode": True}},
            ),
            use_tqdm=False,
        )
        prefill_s = time.perf_counter() - t0
        params = [dict(o.kv_transfer_params) for o in first]
        offered = [len(p["remote_block_ids"][0]) for p in params]

        peak, stop = [0], threading.Event()

        def poll():
            while not stop.is_set():
                m = _metric(decode, "vllm:num_requests_running")
                if m is not None:
                    peak[0] = max(peak[0], int(m.value))
                time.sleep(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        t0 = time.perf_counter()
        outs = decode.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [
                SamplingParams(
                    temperature=0.0,
                    max_tokens=args.new_tokens,
                    ignore_eos=True,
                    extra_args={"kv_transfer_params": kv},
                )
                for kv in params
            ],
            use_tqdm=False,
        )
        decode_s = time.perf_counter() - t0
        stop.set()
        poller.join()
        pulled = _metric(decode, "vllm:nixl_bytes_transferred")
        ttft = [getattr(o.metrics, "first_token_latency", None) for o in outs]
        return {
            "method": method,
            "blocks_offered_per_request": offered,
            "nixl_bytes_pulled": None if pulled is None else pulled.sum,
            "nixl_transfers": None if pulled is None else pulled.count,
            "decode_most_running": peak[0],
            "decode_kv_cache_blocks": decode.llm_engine.vllm_config.cache_config.num_gpu_blocks,
            "decode_ttft_s": ttft,
            "prefill_wall_s": round(prefill_s, 2),
            "decode_wall_s": round(decode_s, 2),
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
        }
    finally:
        decode.llm_engine.engine_core.shutdown()
        prefill.llm_engine.engine_core.shutdown()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a prepared model or 'tiny'")
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--token-budget", type=int, default=256)
    parser.add_argument("--fit-dense", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--methods", default="dense,rocketkv")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = _model(args.model)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.requests)
    ]
    results = {}
    for method in args.methods.split(","):
        res = run_method(method, model, prompts, args)
        results[method] = res
        shown = {k: v for k, v in res.items() if k != "tokens"}
        print(json.dumps(shown), flush=True)
    if {"dense", "rocketkv"} <= set(results):
        d, r = results["dense"], results["rocketkv"]
        if d["nixl_bytes_pulled"] and r["nixl_bytes_pulled"]:
            ratio = d["nixl_bytes_pulled"] / r["nixl_bytes_pulled"]
            print(f"bytes pulled: dense / rocketkv = {ratio:.2f}x")
        most = (d["decode_most_running"], r["decode_most_running"])
        print(f"decoding at once: dense {most[0]}, rocketkv {most[1]}")
    if args.json:
        doc = {"command": " ".join(sys.argv), "args": vars(args) | {"json": str(args.json)}}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc | {"results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
