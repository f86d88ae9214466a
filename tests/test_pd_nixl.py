"""Disaggregated prefill and decode over vLLM's NixlConnector (pull mode,
UCX over loopback, ``kv_buffer_device`` cpu), issue 60's foundation.

Two engines per pair: the prefill engine in this process, the decode engine
in vLLM's spawned processes (vLLM keeps one KV connector per process:
``kv_transfer_state._KV_CONNECTOR_AGENT``, so two in-process engines would
share it). The prefill engine gets ``max_tokens`` 1 and
``kv_transfer_params: {"do_remote_decode": True}``; the decode engine gets
the params it returned and pulls the prompt's blocks. Oracles: a single
engine of the same backend, no connector (started first, shut down before
the pair: an engine core in this process caches vLLM's environment), and
the prefill engine's blocks poisoned before the pull (the decode must change:
it decodes from the pulled K/V, not from a local recompute).
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import make_llm, shutdown

ROCKETKV_SETTINGS = {"prompt_budget": 256}
MAX_TOKENS = 12


def _nixl_config(engine_id: str):
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role="kv_both",
        kv_buffer_device="cpu",
        engine_id=engine_id,
    )


def _fresh_env(port: int) -> None:
    """Each engine reads its side-channel port from the environment when it
    starts; an engine core that ran in this process cached vLLM's
    environment (``envs.enable_envs_cache``), so drop the cache first."""
    import vllm.envs as envs

    envs.disable_envs_cache()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)


def _sampling(max_tokens: int, budget: int | None = None, kv: dict | None = None, logprobs=None):
    from vllm import SamplingParams

    extra = {}
    if budget is not None:
        extra["rocketkv_token_budget"] = budget
    if kv is not None:
        extra["kv_transfer_params"] = kv
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, extra_args=extra or None, logprobs=logprobs
    )


def _prompts(tokenizer) -> dict[str, list[int]]:
    """Token prompts of mixed lengths (the plugin's budget 256)."""
    text = (
        "The archive holds letters from the harbour master to the town council, "
        "each about ships, storms, tolls and the lighthouse keeper's pay. "
    )
    ids = tokenizer(text * 40).input_ids
    return {
        "short": ids[:90],
        "mid": ids[7 : 7 + 230],
        "long": ids[3 : 3 + 600],
        "poison": ids[11 : 11 + 300],  # only ever poisoned: no cache holds it
    }


def _poison(llm, block_ids) -> None:
    """Zero every layer's K/V (and KT pages) of these blocks in an
    in-process engine's cache."""
    caches = llm.llm_engine.model_executor.driver_worker.worker.model_runner.kv_caches
    for cache in caches:
        cache[list(block_ids)] = 0


def _run_pair(model_path, tokenizer, backend, rocketkv, pd_cases, single_cases):
    """Single engine first (no connector), then the P/D pair. ``pd_cases``:
    name -> (prompt name, own budget, poison); returns single, P/D and
    P-local tokens by case name."""
    from vllm.utils.network_utils import get_open_port

    prompts = _prompts(tokenizer)
    out = {"single": {}, "pd": {}, "local": {}, "params": {}, "logprobs": {}}
    llm = make_llm(model_path, backend, rocketkv)
    try:
        for name, (prompt, budget) in single_cases.items():
            (res,) = llm.generate(
                [{"prompt_token_ids": prompts[prompt]}],
                _sampling(MAX_TOKENS, budget, logprobs=0),
                use_tqdm=False,
            )
            out["single"][name] = list(res.outputs[0].token_ids)
            out["logprobs"][name] = [
                step[t].logprob
                for step, t in zip(res.outputs[0].logprobs, res.outputs[0].token_ids)
            ]
    finally:
        shutdown(llm)
    _fresh_env(get_open_port())
    prefill = make_llm(model_path, backend, rocketkv, kv_transfer_config=_nixl_config("P"))
    decode = None
    try:
        _fresh_env(get_open_port())
        decode = make_llm(
            model_path, backend, rocketkv, kv_transfer_config=_nixl_config("D"), spawn=True
        )
        for name, (prompt, budget, poison) in pd_cases.items():
            (first,) = prefill.generate(
                [{"prompt_token_ids": prompts[prompt]}],
                _sampling(1, budget, {"do_remote_decode": True}),
                use_tqdm=False,
            )
            params = first.kv_transfer_params
            out["params"][name] = dict(params)
            if poison:
                _poison(prefill, params["remote_block_ids"][0])
            (res,) = decode.generate(
                [{"prompt_token_ids": prompts[prompt]}],
                _sampling(MAX_TOKENS, budget, params),
                use_tqdm=False,
            )
            out["pd"][name] = list(res.outputs[0].token_ids)
            if not poison:  # the prefill's one token is the decode's first
                assert res.outputs[0].token_ids[0] == first.outputs[0].token_ids[0], name
        # The prefill engine serves requests without transfer params as a
        # single engine does (compressed ones included).
        for name, (prompt, budget) in single_cases.items():
            if prompt == "poison":
                continue  # the prefill engine's cache of it is poisoned
            (res,) = prefill.generate(
                [{"prompt_token_ids": prompts[prompt]}],
                _sampling(MAX_TOKENS, budget),
                use_tqdm=False,
            )
            out["local"][name] = list(res.outputs[0].token_ids)
        out["refused"] = {}
        if backend == "ROCKETKV":
            from vllm.exceptions import VLLMValidationError

            for side, engine, kv in (
                ("prefill", prefill, {"do_remote_decode": True}),
                ("decode", decode, dict(out["params"]["short"], remote_num_tokens=600)),
            ):
                with pytest.raises(VLLMValidationError) as err:
                    engine.generate(
                        [{"prompt_token_ids": prompts["long"]}],
                        _sampling(1 if side == "prefill" else MAX_TOKENS, None, kv),
                        use_tqdm=False,
                    )
                out["refused"][side] = str(err.value)
    finally:
        if decode is not None:
            shutdown(decode)
        shutdown(prefill)
    return out


# -- no engine ------------------------------------------------------------


def test_nixl_ucx_moves_bytes_over_loopback():
    """The installed nixl (its UCX backend) reads a registered host buffer
    from another agent: what the connector's pull does, without vLLM."""
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(backends=["UCX"])
    a, b = nixl_agent("pd-test-a", cfg), nixl_agent("pd-test-b", cfg)
    src = torch.arange(4096, dtype=torch.float32)
    dst = torch.zeros(4096)
    a.register_memory(src)
    b.register_memory(dst)
    b.add_remote_agent(a.get_agent_metadata())
    handle = b.initialize_xfer("READ", b.get_xfer_descs(dst), a.get_xfer_descs(src), "pd-test-a")
    b.transfer(handle)
    for _ in range(100_000):
        state = b.check_xfer_state(handle)
        if state == "DONE":
            break
        assert state != "ERR"
    assert torch.equal(src, dst)


def _engine_config(model_path, **kw):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(dtype="float32", max_model_len=4096, enforce_eager=True)
    args.update(kw)
    return EngineArgs(model=model_path, attention_backend="ROCKETKV", **args).create_engine_config()


def test_rocketkv_accepts_nixl_pull_and_refuses_push(model_path):
    from rocketkv_vllm.plugin import register

    register()
    pull = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    config = _engine_config(model_path, kv_transfer_config=pull)
    assert config.kv_transfer_config.kv_connector == "NixlConnector"
    push = dict(pull, kv_connector="NixlPushConnector")
    with pytest.raises(Exception) as err:
        _engine_config(model_path, kv_transfer_config=push)
    assert "ROCKETKV" in str(err.value) and "NixlPushConnector" in str(err.value)


def test_pd_requests_that_would_compress_are_refused_by_name(model_path):
    """A ROCKETKV engine with NixlConnector serves P/D requests whose plan is
    dense and refuses, when they arrive, those that would compress, on the
    prefill side (``max_tokens`` 1 does not make a request that decodes
    elsewhere dense) and on the decode side. Requests without transfer
    params are ordinary local requests."""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    from rocketkv_vllm.plugin import register

    register()
    pull = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    config = _engine_config(
        model_path,
        kv_transfer_config=pull,
        additional_config={"rocketkv": ROCKETKV_SETTINGS},
    )
    processor = InputProcessor(config)
    long_prompt = {"prompt_token_ids": list(range(1, 601))}
    short_prompt = {"prompt_token_ids": list(range(1, 201))}
    remote = {"do_remote_prefill": True, "remote_block_ids": ([1],)}

    def process(prompt, max_tokens, budget=None, kv=None):
        return processor.process_inputs(
            request_id="r",
            prompt=prompt,
            params=_sampling(max_tokens, budget, kv),
            supported_tasks=("generate",),
        )

    for kv, max_tokens, key in (
        ({"do_remote_decode": True}, 1, "do_remote_decode"),
        (remote, 16, "do_remote_prefill"),
    ):
        with pytest.raises(VLLMValidationError) as err:
            process(long_prompt, max_tokens, kv=kv)
        assert f"kv_transfer_params.{key}" in str(err.value)
        assert "600-token prompt" in str(err.value)
        assert "rocketkv_token_budget" in str(err.value)
        process(long_prompt, max_tokens, budget=0, kv=kv)  # own budget 0: dense
        process(short_prompt, max_tokens, kv=kv)  # within the budget
        with pytest.raises(VLLMValidationError):
            process(long_prompt, max_tokens, budget=64, kv=kv)  # own budget, compressed
    process(long_prompt, 1, kv=remote)  # decodes nothing: dense
    process(long_prompt, 16)  # no transfer: compressed locally
    # A prompt given as embeddings is planned by its length as ids are.
    from types import SimpleNamespace

    import torch

    from rocketkv_vllm.pd import validate_pd_request

    embeds = SimpleNamespace(
        sampling_params=_sampling(16, None, remote),
        prompt_token_ids=None,
        prompt_embeds=torch.zeros(600, 8),
    )
    with pytest.raises(VLLMValidationError, match="600-token prompt"):
        validate_pd_request(config, embeds)
    embeds.prompt_embeds = torch.zeros(200, 8)  # within the budget
    validate_pd_request(config, embeds)


# -- engines ------------------------------------------------------------------


@pytest.mark.engine
def test_dense_pd_with_the_package_installed_equals_one_engine(model_path, tokenizer):
    """Issue 60's reproduction: dense engines (CPU_ATTN, the plugin loaded)
    with NixlConnector; the decode engine's greedy tokens equal a single
    engine's, and it decodes from the K/V it pulled."""
    cases = {"mid": ("mid", None, False), "poisoned": ("poison", None, True)}
    out = _run_pair(
        model_path,
        tokenizer,
        "CPU_ATTN",
        None,
        cases,
        {"mid": ("mid", None), "poison": ("poison", None)},
    )
    params = out["params"]["mid"]
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == 230
    assert len(params["remote_block_ids"][0]) > 1
    assert out["pd"]["mid"] == out["single"]["mid"]
    assert out["pd"]["poisoned"] != out["single"]["poison"]
    assert out["local"] == {k: v for k, v in out["single"].items() if k != "poison"}


@pytest.mark.engine
def test_rocketkv_pd_dense_path_equals_one_rocketkv_engine(model_path, tokenizer):
    """ROCKETKV on both sides (prompt budget 256): prompts within the budget
    and a long prompt with its own budget 0 go through NixlConnector and
    decode as one ROCKETKV engine does; the decode engine pulls every prompt
    block (poisoned ones change its tokens). A long prompt that would
    compress is refused on either side, naming the combination; the same
    prompt without transfer params is compressed locally as by one engine."""
    cases = {
        "short": ("short", None, False),
        "mid": ("mid", None, False),
        "long0": ("long", 0, False),
        "poisoned": ("poison", 0, True),
    }
    single = {"short": ("short", None), "mid": ("mid", None), "long0": ("long", 0)}
    single["poison"] = ("poison", 0)
    single["long"] = ("long", None)  # compressed, served locally
    out = _run_pair(model_path, tokenizer, "ROCKETKV", ROCKETKV_SETTINGS, cases, single)
    for name in ("short", "mid", "long0"):
        assert out["pd"][name] == out["single"][name], name
    assert out["params"]["long0"]["remote_num_tokens"] == 600
    assert len(out["params"]["long0"]["remote_block_ids"][0]) == -(-600 // 32)
    assert out["pd"]["poisoned"] != out["single"]["poison"]
    assert out["local"] == {k: v for k, v in out["single"].items() if k != "poison"}
    # Compressed for real (on this repetitive text its greedy tokens may
    # equal the dense ones; its logprobs do not).
    dense, compressed = out["logprobs"]["long0"], out["logprobs"]["long"]
    assert max(abs(a - b) for a, b in zip(dense, compressed)) > 1e-3
    for side, key in (("prefill", "do_remote_decode"), ("decode", "do_remote_prefill")):
        assert f"kv_transfer_params.{key}" in out["refused"][side]
