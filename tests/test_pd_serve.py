"""Disaggregated prefill and decode as a user runs it (issue 60, item 2):
two ``vllm serve`` processes with vLLM's NixlConnector (UCX over loopback,
``kv_buffer_device`` cpu) and ``python -m rocketkv_vllm.pd_proxy`` in front,
an OpenAI client talking to the proxy. The tiny random Llama (conftest
``tiny``): the oracle is the prefill server asked directly, without
transfer params (greedy, fp32), and the decode server's own counters say
its prompt came over the wire.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
from test_serve import Server, _free_port, metric_value

pytestmark = pytest.mark.engine

ROCKETKV = {"prompt_budget": 96}
NIXL = json.dumps(
    {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
)


def _server(model: str) -> Server:
    # Each engine's NIXL side channel on a port of its own.
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port())}
    return Server(model, rocketkv=ROCKETKV, extra=["--kv-transfer-config", NIXL], env=env)


class ProxyProcess:
    def __init__(self, prefill: Server, decode: Server):
        self.port = _free_port()
        cmd = [sys.executable, "-m", "rocketkv_vllm.pd_proxy", "--port", str(self.port)]
        cmd += ["--prefill", prefill.url, "--decode", decode.url]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise AssertionError("the proxy did not become ready")

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=600)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def pd(tiny):
    prefill, decode = _server(tiny), _server(tiny)
    proxy = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        proxy = ProxyProcess(prefill, decode)
        yield prefill, decode, proxy
    finally:
        if proxy is not None:
            proxy.stop()
        prefill.stop()
        decode.stop()


def _pulled(server: Server) -> float:
    """Prompt tokens a server took from a KV transfer (vLLM's counter)."""
    name = "vllm:prompt_tokens_by_source_total"
    return metric_value(server.metrics(), name, source="external_kv_transfer")


def _ids(tokenizer, n: int, offset: int = 0) -> list[int]:
    text = "The harbour master wrote to the council about ships, storms and tolls. " * 40
    return tokenizer(text).input_ids[offset : offset + n]


def _assert_same_completion(prefill: Server, proxy: ProxyProcess, prompt: list[int]) -> None:
    """The proxy's completion, plain and streamed, is the prefill server's own."""
    kw = dict(model=prefill.model, prompt=prompt, max_tokens=8, temperature=0)
    want = prefill.client().completions.create(**kw).choices[0].text
    got = proxy.client().completions.create(**kw).choices[0].text
    streamed = "".join(
        c.choices[0].text for c in proxy.client().completions.create(stream=True, **kw)
    )
    assert got == want and streamed == want


def test_completions_through_the_proxy_equal_one_engine(pd, tokenizer):
    """A prompt within the budget (the dense path through the connector),
    plain and streamed, and a chat completion: the decode server's text is
    the prefill server's own, and its prompt tokens came from the transfer."""
    prefill, decode, proxy = pd
    prompt = _ids(tokenizer, 80)
    before = _pulled(decode)
    _assert_same_completion(prefill, proxy, prompt)

    chat = [{"role": "user", "content": "Name three colours of the sea."}]
    ckw = dict(model=prefill.model, messages=chat, max_tokens=8, temperature=0)
    want_chat = prefill.client().chat.completions.create(**ckw).choices[0].message.content
    got_chat = proxy.client().chat.completions.create(**ckw).choices[0].message.content
    assert got_chat == want_chat

    after = _pulled(decode)
    # Three requests of whole blocks pulled (the last token is recomputed).
    assert after - before >= 2 * (len(prompt) // 32 * 32)


def test_a_compressed_prompt_through_the_proxy_equals_one_engine(pd, tokenizer):
    """A prompt past the budget: the prefill server compresses it and offers
    its kept blocks, the decode server pulls them and decodes; the text is
    the prefill server's own for the same request, plain and streamed."""
    prefill, decode, proxy = pd
    before = _pulled(decode)
    _assert_same_completion(prefill, proxy, _ids(tokenizer, 300, 5))
    assert _pulled(decode) > before


def test_what_the_proxy_cannot_split_is_a_400_naming_the_field(pd):
    import openai

    prefill, _, proxy = pd
    client = proxy.client()
    kw = dict(model=prefill.model, prompt="Hello", max_tokens=4, temperature=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(n=2, **kw)
    assert "n and best_of must be 1" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(extra_body={"kv_transfer_params": {}}, **kw)
    assert "kv_transfer_params" in str(err.value)
