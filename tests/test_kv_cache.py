"""Evicted blocks go back to vLLM's pool: accounting, no reads after, no leaks."""

import math
import random

import pytest
import torch
from conftest import same_completion

from rocketkv_eval import capacity
from rocketkv_vllm.config import parse_config, resolve_settings
from rocketkv_vllm.kv_cache import RocketKVAttentionSpec, make_rocketkv_spec


def _bench():
    return capacity


def test_spec_counts_kt_pages_in_every_block():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    settings = resolve_settings(parse_config({"page_size": 4}), 16, 64, 8192)
    base = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    spec = make_rocketkv_spec(base, settings)
    assert isinstance(spec, RocketKVAttentionSpec)
    kv = 16 * 3 * 2 * 64 * 2
    kt = 3 * (16 // 4) * 2 * 64 * 2
    assert base.page_size_bytes == kv
    assert spec.page_size_bytes == kv + kt  # KT = 1/page_size of the K+V bytes
    merged = RocketKVAttentionSpec.merge([spec, spec])
    assert merged == spec
    # fp8 KT rows: 2 * 64 one-byte codes + a 16-byte scale slot per page.
    fp8 = resolve_settings(parse_config({"page_size": 4, "kt_dtype": "fp8_e4m3"}), 16, 64, 8192)
    spec8 = make_rocketkv_spec(base, fp8)
    assert spec8.page_size_bytes == kv + 3 * (16 // 4) * (2 * 64 + 16)


def _random_prompts(n, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for length in lengths]


FREED_PROMPTS = _random_prompts(6, [1500, 1800, 2100, 300, 1650, 2400])
FREED_CFG = {"prompt_budget": 256}


@pytest.fixture(scope="module")
def never_frees(tiny):
    """The oracle of both cases below: an ample cache that gives nothing back
    (prefix caching off; with it on the tokens are the same, as
    test_prefix_caching asserts)."""
    return _bench().run_capacity(
        tiny,
        "ROCKETKV",
        FREED_PROMPTS,
        1 << 30,
        dict(FREED_CFG, free_evicted_blocks=False),
        max_tokens=20,
        logprobs=True,
        max_model_len=4096,
        dtype="float32",
        engine_kw={"enable_prefix_caching": False},
    )


@pytest.mark.engine
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_freed_blocks_are_never_read_and_nothing_leaks(tiny, prefix_caching, never_frees):
    """Freed blocks are poisoned before they go back (with prefix caching
    their KT pages only: their K/V stay valid cache entries), then reused by
    other requests under a tight cache (with preemptions); outputs must
    equal a run that never frees, and every block must come back."""
    bench = _bench()
    prompts, cfg, ample = FREED_PROMPTS, FREED_CFG, never_frees
    caching = {"enable_prefix_caching": prefix_caching}
    # Room for ~4200 tokens with KT pages (5300 without; the engine needs one
    # max_model_len request);
    # the six prompts need about 9700.
    tight_bytes = bench.kv_bytes_for_tokens(tiny, 5300, 4)
    tight = bench.run_capacity(
        tiny,
        "ROCKETKV",
        prompts,
        tight_bytes,
        cfg,
        testing={"poison_evicted_blocks": True},
        max_tokens=20,
        logprobs=True,
        max_model_len=4096,
        dtype="float32",
        engine_kw=caching,
    )
    assert tight.finished == ample.finished == len(prompts)
    assert tight.outputs.keys() == ample.outputs.keys()
    for rid, want in ample.outputs.items():
        assert same_completion(tight.outputs[rid], want), rid
    # The tight cache only fits everything because blocks were given back.
    total_dense_blocks = sum(math.ceil((len(p) + 20) / 32) for p in prompts)
    assert tight.num_blocks < total_dense_blocks
    for held, p in zip(tight.blocks_after_prefill, prompts):
        assert abs(held - bench.expected_blocks(256, len(p), 32)) <= 1


@pytest.mark.engine
def test_aborts_and_preemptions_leak_no_blocks(tiny, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    bench = _bench()
    # ~2400 tokens of cache (with KT pages) for requests needing ~9000.
    llm = LLM(
        model=tiny,
        attention_backend="ROCKETKV",
        max_model_len=2304,
        enforce_eager=True,
        dtype="float32",
        block_size=32,
        kv_cache_memory_bytes=bench.kv_bytes_for_tokens(tiny, 3000, 4),
        max_num_batched_tokens=512,
        max_num_seqs=8,
        additional_config={"rocketkv": {"prompt_budget": 256}},
    )
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    start_free = pool.get_num_free_blocks()
    preemptions = []
    original = sched._preempt_request
    sched._preempt_request = lambda *a, **k: (preemptions.append(1), original(*a, **k))[1]

    # Two short uncompressed requests with long outputs outgrow the cache,
    # so requests get preempted and recomputed; r2 is aborted mid-prefill
    # and r0 mid-decode.
    lengths = [1900, 1200, 2200, 200, 220, 1700]
    max_tokens = [60, 100, 50, 1050, 1050, 300]
    prompts = _random_prompts(6, lengths, seed=3)
    for i, (toks, n_out) in enumerate(zip(prompts, max_tokens)):
        params = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=toks), params)
    aborted_mid_prefill = aborted_mid_decode = False
    finished = set()
    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        by_id = {bench.external_id(r): r for r in sched.running}
        if (
            not aborted_mid_prefill
            and "r2" in by_id
            and 0 < by_id["r2"].num_computed_tokens < by_id["r2"].num_prompt_tokens
        ):
            engine.abort_request(["r2"])
            aborted_mid_prefill = True
        if not aborted_mid_decode and "r0" in by_id and by_id["r0"].num_output_tokens >= 5:
            engine.abort_request(["r0"])
            aborted_mid_decode = True
    assert not engine.has_unfinished_requests()
    assert aborted_mid_prefill and aborted_mid_decode
    assert finished >= {"r1", "r3", "r4", "r5"}
    assert preemptions, "the cache was meant to be tight enough to preempt"
    assert pool.get_num_free_blocks() == start_free
    engine.engine_core.shutdown()
