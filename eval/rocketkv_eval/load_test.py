"""Bounded load test of the OpenAI server: vLLM's own attention backend vs ROCKETKV.

For each backend in ``--backends`` one server (``python -m
vllm.entrypoints.openai.api_server``, i.e. ``vllm serve``) is started on a
free loopback port with the same flags except the attention backend:

- ``dense``: vLLM's default backend (no ``--attention-backend``);
- ``rocketkv``: ``--attention-backend ROCKETKV --additional-config
  '{"rocketkv": <--rocketkv JSON>}'``.

Both: the embedded SmolLM2-135M (``rocketkv_eval.model.prepare_default_model``,
or ``--model``), ``--max-model-len``, ``--dtype``, prefix caching off, eager
mode, the same KV cache size. Once ``/health`` answers (and one short warm-up
request, not counted, has finished), ``--concurrency`` clients share a fixed
list of ``--requests`` streamed text completions: a seeded mix of short prompts
(``--short-tokens``) and long ones (``--long-tokens``, a ``--long-fraction`` of
them), each a distinct needle-in-a-haystack chat prompt sent as token ids
(exact lengths), ``--max-tokens`` new tokens, temperature 0, EOS ignored unless
``--no-ignore-eos`` (so both backends generate the same number of tokens). No
per-request ``seed``: vLLM's CPU build crashes on seeded chunked prefills.
Every request is the same on both servers.

Per request: time to first token (first streamed chunk with a token),
inter-token latencies (gaps between streamed chunks; one chunk per engine step),
completion tokens (the server's usage), finish_reason, error. Per backend:
output tokens/s and requests/s over the wall time of the load (first request
sent to last answer), TTFT/ITL p50/p90/p99, errors, the peak of vLLM's
``vllm:num_requests_running`` gauge (``/metrics`` polled every ``--poll``
seconds), and ROCKETKV's ``rocketkv:*`` counters (increase over the load).

Every request must end in a complete answer (finish_reason ``length`` or
``stop`` with > 0 tokens) or an explicit HTTP error from the server (counted
under errors). Anything else (a timeout after ``--request-timeout`` s, a stream
that ends without a finish_reason, a dropped connection) is *lost*, and the
exit code is 1. Servers are stopped (SIGINT, then SIGKILL of their process
group) whatever happens; their logs go to ``--log-dir`` (default: a temporary
directory, printed when a server fails).

    python scripts/load_test.py                                  # 2 x 32 requests
    python scripts/load_test.py --requests 16 --json results/load-cpu.json
    python scripts/load_test.py --backends rocketkv --rocketkv '{"preset": "budget-1024"}'

Loopback only; no network access needed (the model is built locally).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

BACKENDS = ("dense", "rocketkv")
COMPLETE = ("length", "stop")


# --------------------------------------------------------------------------
# Arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--backends",
        default="dense,rocketkv",
        help="comma-separated, from: dense, rocketkv (default: %(default)s)",
    )
    p.add_argument(
        "--rocketkv",
        default='{"token_budget": 256}',
        help="ROCKETKV settings, JSON (default: %(default)s)",
    )
    p.add_argument(
        "--model", default=None, help="model directory (default: the embedded SmolLM2-135M)"
    )
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--short-tokens", type=int, default=100)
    p.add_argument("--long-tokens", type=int, default=3000)
    p.add_argument("--long-fraction", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: generate max-tokens)",
    )
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the prompt mix and of the servers (not sent per request)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds a request may take before it counts as lost",
    )
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--poll", type=float, default=0.2, help="seconds between /metrics polls")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra argument for both servers (repeat; e.g. --server-arg=--max-num-seqs=16)",
    )
    p.add_argument(
        "--prestart",
        action="store_true",
        help="start all servers at once (faster; the loads still run one "
        "after another, the other servers idle)",
    )
    p.add_argument("--log-dir", default=None, help="keep server logs here")
    p.add_argument("--json", default=None, metavar="PATH", help="write results here")
    p.add_argument("--note", default=None, help="free text stored in the JSON")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad or not args.backends:
        p.error(f"--backends: unknown {bad}; choose from {', '.join(BACKENDS)}")
    try:
        args.rocketkv = json.loads(args.rocketkv)
    except json.JSONDecodeError as e:
        p.error(f"--rocketkv is not JSON: {e}")
    if not isinstance(args.rocketkv, dict):
        p.error("--rocketkv must be a JSON object")
    if args.requests < 1 or args.concurrency < 1:
        p.error("--requests and --concurrency must be >= 1")
    if not 0.0 <= args.long_fraction <= 1.0:
        p.error("--long-fraction must be in [0, 1]")
    if args.long_tokens + args.max_tokens > args.max_model_len:
        p.error("--long-tokens + --max-tokens exceeds --max-model-len")
    return args


# --------------------------------------------------------------------------
# Prompts


@dataclass
class Prompt:
    kind: str  # "short" or "long"
    token_ids: list[int]


def build_prompts(tokenizer, args) -> list[Prompt]:
    """A seeded, shuffled mix; every prompt distinct (own filler and needle)."""
    from rocketkv_eval.needle import build_needle_prompt

    rng = random.Random(args.seed)
    n_long = round(args.requests * args.long_fraction)
    kinds = ["long"] * n_long + ["short"] * (args.requests - n_long)
    rng.shuffle(kinds)
    prompts = []
    for i, kind in enumerate(kinds):
        target = args.long_tokens if kind == "long" else args.short_tokens
        case = build_needle_prompt(tokenizer, target, rng.random(), seed=args.seed * 100003 + i)
        prompts.append(Prompt(kind, case.token_ids))
    return prompts


# --------------------------------------------------------------------------
# Server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(backend: str, model: str, port: int, args) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(args.max_model_len),
        "--dtype",
        args.dtype,
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--kv-cache-memory-bytes",
        str(args.kv_cache_memory_bytes),
        "--seed",
        str(args.seed),
    ]
    if backend == "rocketkv":
        cmd += [
            "--attention-backend",
            "ROCKETKV",
            "--additional-config",
            json.dumps({"rocketkv": args.rocketkv}),
        ]
    return cmd + list(args.server_arg)


class Server:
    """One ``vllm serve`` subprocess in its own process group; output to a file."""

    def __init__(self, backend: str, cmd: list[str], port: int, log_dir: str):
        self.backend = backend
        self.cmd = cmd
        self.port = port
        self.log_path = os.path.join(log_dir, f"server-{backend}.log")
        self._log = open(self.log_path, "w")
        self.started = time.time()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-n:]

    def wait_ready(self, timeout: float) -> float:
        """Seconds from the start until /health answered."""
        t0 = self.started
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.backend} server exited with code "
                    f"{self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return time.time() - t0
            except OSError:
                time.sleep(1)
        raise RuntimeError(
            f"{self.backend} server not ready after {timeout:.0f} s:\n" + self.log_tail()
        )

    def stop(self, grace: float = 60.0) -> int | None:
        """SIGINT, then SIGKILL of the whole group (engine core included)."""
        try:
            if self.proc.poll() is None:
                try:
                    self.proc.send_signal(signal.SIGINT)
                    self.proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
            try:  # whatever is left of the group (e.g. an orphaned engine core)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if self.proc.poll() is None:
                self.proc.wait(timeout=30)
        finally:
            self._log.close()
        return self.proc.returncode


# --------------------------------------------------------------------------
# Metrics


_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name (labels dropped): sum over samples}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


ROCKETKV_REPORTED = (
    "rocketkv:prompts_compressed_total",
    "rocketkv:prompt_tokens_evicted_total",
    "rocketkv:kv_blocks_freed_total",
    "rocketkv:kept_fraction_sum",
    "rocketkv:kept_fraction_count",
    "rocketkv:decode_tokens_attended_sum",
    "rocketkv:decode_tokens_attended_count",
    "rocketkv:decode_context_tokens_total",
)


def rocketkv_counters(before: dict, after: dict) -> dict:
    """Increase of each rocketkv:* counter over the load, plus two ratios."""
    if not any(k.startswith("rocketkv:") for k in after):
        return {}
    out = {k.split(":", 1)[1]: after.get(k, 0.0) - before.get(k, 0.0) for k in ROCKETKV_REPORTED}
    if out["kept_fraction_count"]:
        out["mean_kept_fraction"] = out["kept_fraction_sum"] / out["kept_fraction_count"]
    if out["decode_context_tokens_total"]:
        out["decode_fraction_read"] = (
            out["decode_tokens_attended_sum"] / out["decode_context_tokens_total"]
        )
    return out


# --------------------------------------------------------------------------
# Load


@dataclass
class Result:
    index: int
    kind: str
    prompt_tokens: int
    status: str = "lost"  # "completed", "error" (explicit HTTP error) or "lost"
    finish_reason: str | None = None
    completion_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    error: str | None = None


async def one_request(client, model: str, i: int, prompt: Prompt, args) -> Result:
    import openai

    res = Result(i, prompt.kind, len(prompt.token_ids))
    chunks_at: list[float] = []
    t0 = time.perf_counter()

    async def consume():
        stream = await client.completions.create(
            model=model,
            prompt=prompt.token_ids,
            max_tokens=args.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": args.ignore_eos},
        )
        async for chunk in stream:
            now = time.perf_counter()
            for choice in chunk.choices:
                if choice.text:
                    chunks_at.append(now)
                if choice.finish_reason is not None:
                    res.finish_reason = choice.finish_reason
            if chunk.usage is not None:
                res.completion_tokens = chunk.usage.completion_tokens

    try:
        await asyncio.wait_for(consume(), timeout=args.request_timeout)
    except asyncio.TimeoutError:
        res.error = f"timeout after {args.request_timeout:.0f} s"
    except openai.APIStatusError as e:  # the server answered with an HTTP error
        res.status, res.error = "error", f"HTTP {e.status_code}: {str(e)[:300]}"
    except Exception as e:  # connection dropped, bad stream, ...: lost
        res.error = f"{type(e).__name__}: {str(e)[:300]}"
    res.latency = time.perf_counter() - t0
    if chunks_at:
        res.ttft = chunks_at[0] - t0
        res.itl = [b - a for a, b in zip(chunks_at, chunks_at[1:])]
    if res.status != "error" and res.error is None:
        if res.finish_reason in COMPLETE and res.completion_tokens > 0:
            res.status = "completed"
        else:
            res.error = (
                f"incomplete: finish_reason={res.finish_reason!r}, {res.completion_tokens} tokens"
            )
    return res


async def poll_running(url: str, period: float, stop: asyncio.Event, samples: list):
    import httpx

    async with httpx.AsyncClient(timeout=5) as http:
        while not stop.is_set():
            try:
                r = await http.get(url + "/metrics")
                samples.append(parse_metrics(r.text).get("vllm:num_requests_running", 0.0))
            except Exception:
                pass
            try:
                await asyncio.wait_for(stop.wait(), timeout=period)
            except asyncio.TimeoutError:
                pass


async def get_metrics(url: str) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        return parse_metrics((await http.get(url + "/metrics")).text)


async def run_load(server: Server, model: str, prompts: list[Prompt], args) -> dict:
    import openai

    client = openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=args.request_timeout
    )
    # Warm-up (not counted): lazy initialisation, kernel builds, first step.
    warm = await one_request(
        client,
        model,
        -1,
        Prompt(
            "short",
            prompts[0].token_ids[:32] if prompts[0].kind == "short" else prompts[0].token_ids[-32:],
        ),
        argparse.Namespace(**{**vars(args), "max_tokens": 4}),
    )
    if warm.status != "completed":
        raise RuntimeError(f"{server.backend}: warm-up request failed: {warm.error}")
    before = await get_metrics(server.url)

    stop = asyncio.Event()
    running: list[float] = []
    poller = asyncio.create_task(poll_running(server.url, args.poll, stop, running))
    queue: asyncio.Queue = asyncio.Queue()
    for i, p in enumerate(prompts):
        queue.put_nowait((i, p))
    results: list[Result] = []

    async def worker():
        while True:
            try:
                i, p = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await one_request(client, model, i, p, args))

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    finally:
        wall = time.perf_counter() - t0
        stop.set()
        await poller
    # Scheduler stats are published per engine step; the last poll may miss
    # the final step but never a peak.
    after = await get_metrics(server.url)
    await client.close()
    results.sort(key=lambda r: r.index)
    return summarize(server.backend, results, wall, running, before, after)


# --------------------------------------------------------------------------
# Summary and report


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


def summarize(backend, results: list[Result], wall, running, before, after) -> dict:
    done = [r for r in results if r.status == "completed"]
    ttft = [r.ttft for r in done if r.ttft is not None]
    itl = [x for r in done for x in r.itl]
    out_tokens = sum(r.completion_tokens for r in done)
    summary = {
        "requests": len(results),
        "completed": len(done),
        "errors": sum(r.status == "error" for r in results),
        "lost": sum(r.status == "lost" for r in results),
        "long_prompts": sum(r.kind == "long" for r in results),
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tokens_per_s": out_tokens / wall if wall else None,
        "requests_per_s": len(done) / wall if wall else None,
        "peak_running": max(running) if running else None,
        "metrics_polls": len(running),
    }
    for name, vals in (("ttft", ttft), ("itl", itl)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_s"] = pct(vals, q)
    for kind in ("short", "long"):
        k = [r.ttft for r in done if r.kind == kind and r.ttft is not None]
        summary[f"ttft_{kind}_p50_s"] = pct(k, 50)
    summary["finish_reasons"] = {}
    for r in results:
        key = r.finish_reason or "none"
        summary["finish_reasons"][key] = summary["finish_reasons"].get(key, 0) + 1
    summary["rocketkv"] = rocketkv_counters(before, after)
    summary["vllm"] = {
        k.split(":", 1)[1]: after.get(k, 0.0) - before.get(k, 0.0)
        for k in (
            "vllm:num_preemptions_total",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
        )
    }
    per_request = []
    for r in results:
        d = asdict(r)
        itl_r = d.pop("itl")
        d["itl_mean_s"] = sum(itl_r) / len(itl_r) if itl_r else None
        d["itl_max_s"] = max(itl_r) if itl_r else None
        per_request.append(d)
    return {"backend": backend, "summary": summary, "per_request": per_request}


ROWS = [
    ("requests", "requests", "{:.0f}"),
    ("completed", "completed", "{:.0f}"),
    ("errors (HTTP)", "errors", "{:.0f}"),
    ("lost", "lost", "{:.0f}"),
    ("wall s", "wall_s", "{:.1f}"),
    ("output tok/s", "output_tokens_per_s", "{:.1f}"),
    ("requests/s", "requests_per_s", "{:.3f}"),
    ("TTFT p50 s", "ttft_p50_s", "{:.2f}"),
    ("TTFT p90 s", "ttft_p90_s", "{:.2f}"),
    ("TTFT p99 s", "ttft_p99_s", "{:.2f}"),
    ("TTFT p50 short s", "ttft_short_p50_s", "{:.2f}"),
    ("TTFT p50 long s", "ttft_long_p50_s", "{:.2f}"),
    ("ITL p50 ms", "itl_p50_s", "ms"),
    ("ITL p90 ms", "itl_p90_s", "ms"),
    ("ITL p99 ms", "itl_p99_s", "ms"),
    ("peak running", "peak_running", "{:.0f}"),
]
RKV_ROWS = [
    ("prompts compressed", "prompts_compressed_total", "{:.0f}"),
    ("prompt tokens evicted", "prompt_tokens_evicted_total", "{:.0f}"),
    ("KV blocks freed", "kv_blocks_freed_total", "{:.0f}"),
    ("mean kept fraction", "mean_kept_fraction", "{:.3f}"),
    ("decode fraction read", "decode_fraction_read", "{:.3f}"),
]


def _fmt(value, fmt) -> str:
    if value is None:
        return "-"
    if fmt == "ms":
        return f"{value * 1000:.1f}"
    return fmt.format(value)


def table(results: dict) -> str:
    names = list(results)
    rows = [["", *names]]
    for label, key, fmt in ROWS:
        rows.append([label, *(_fmt(results[n]["summary"].get(key), fmt) for n in names)])
    if any(results[n]["summary"]["rocketkv"] for n in names):
        for label, key, fmt in RKV_ROWS:
            rows.append(
                [label, *(_fmt(results[n]["summary"]["rocketkv"].get(key), fmt) for n in names)]
            )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths))
        )
        for r in rows
    )


# --------------------------------------------------------------------------
# Main


def start_server(backend: str, model: str, args, log_dir: str) -> Server:
    port = free_port()
    cmd = server_command(backend, model, port, args)
    print(f"[{backend}] starting: {shlex.join(cmd)}", flush=True)
    return Server(backend, cmd, port, log_dir)


def run_backend(server: Server, model: str, prompts, args) -> dict:
    backend = server.backend
    try:
        startup = server.wait_ready(args.startup_timeout)
        print(
            f"[{backend}] ready after {startup:.0f} s; {len(prompts)} requests, "
            f"{args.concurrency} clients",
            flush=True,
        )
        out = asyncio.run(run_load(server, model, prompts, args))
        out["startup_s"] = startup
        out["server_command"] = shlex.join(server.cmd)
        s = out["summary"]
        print(
            f"[{backend}] {s['completed']} completed, {s['errors']} errors, "
            f"{s['lost']} lost in {s['wall_s']:.1f} s",
            flush=True,
        )
        for r in out["per_request"]:
            if r["status"] != "completed":
                print(
                    f"[{backend}]   request {r['index']} ({r['kind']}): "
                    f"{r['status']}: {r['error']}",
                    flush=True,
                )
        return out
    except BaseException:
        print(
            f"[{backend}] server log tail ({server.log_path}):\n{server.log_tail()}",
            file=sys.stderr,
            flush=True,
        )
        raise
    finally:
        code = server.stop()
        print(f"[{backend}] server stopped (exit code {code})", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    if args.model is None:
        from rocketkv_eval.model import prepare_default_model

        args.model = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = build_prompts(tokenizer, args)
    n_long = sum(p.kind == "long" for p in prompts)
    print(
        f"{len(prompts)} prompts: {n_long} long (~{args.long_tokens} tokens), "
        f"{len(prompts) - n_long} short (~{args.short_tokens} tokens); "
        f"{args.max_tokens} new tokens each",
        flush=True,
    )

    log_dir = args.log_dir or tempfile.mkdtemp(prefix="load-test-")
    os.makedirs(log_dir, exist_ok=True)
    # SIGTERM -> KeyboardInterrupt, so `finally` stops the servers.
    old = signal.signal(signal.SIGTERM, signal.default_int_handler) if threading_main() else None
    results: dict[str, dict] = {}
    servers: dict[str, Server] = {}
    try:
        if args.prestart:
            for backend in args.backends:
                servers[backend] = start_server(backend, args.model, args, log_dir)
        for backend in args.backends:
            if backend not in servers:
                servers[backend] = start_server(backend, args.model, args, log_dir)
            results[backend] = run_backend(servers[backend], args.model, prompts, args)
    finally:
        for server in servers.values():  # those not reached (an earlier failure)
            if server.proc.poll() is None:
                server.stop()
        if old is not None:
            signal.signal(signal.SIGTERM, old)

    print()
    print(table(results))
    lost = sum(r["summary"]["lost"] for r in results.values())
    if args.json:
        doc = {
            "command": shlex.join(
                [
                    os.path.relpath(sys.argv[0]) if argv is None else "scripts/load_test.py",
                    *(sys.argv[1:] if argv is None else argv),
                ]
            ),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {
                "processor": platform.processor() or platform.machine(),
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "vllm": _vllm_version(),
            "note": args.note,
            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "note")},
            "prompts": {
                "long": n_long,
                "short": len(prompts) - n_long,
                "tokens": [len(p.token_ids) for p in prompts],
            },
            "results": results,
            "lost": lost,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    if lost:
        print(f"FAILED: {lost} request(s) neither completed nor got an HTTP error", file=sys.stderr)
        return 1
    return 0


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _vllm_version() -> str | None:
    try:
        import vllm

        return vllm.__version__
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
