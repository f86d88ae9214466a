"""Tensor parallelism on vLLM's CPU build: KV heads split across ranks.

SmolLM2-135M has 9 query and 3 KV heads, so the sizes that divide both are 1
and 3; with TP 3 each rank holds one KV head (and its KT pages) and runs
Stage 1 and Stage 2 on it alone. Three CPU workers on a 2-core machine need
an explicit thread binding (vLLM's automatic one wants a NUMA node per rank).
"""

import pytest
from conftest import greedy, make_llm, shutdown

from rocketkv_vllm.config import parse_config, resolve_settings
from rocketkv_vllm.engine import DEFAULT_CPU_BLOCK_SIZE
from rocketkv_vllm.plan import plan_request

pytestmark = pytest.mark.engine

ROCKETKV = {"token_budget": 128, "max_new_tokens": 16}


def test_tensor_parallel_3_matches_one_process(model_path, tokenizer, monkeypatch):
    from vllm.inputs import TokensPrompt

    from rocketkv_eval import tasks as eval_tasks

    samples = eval_tasks.make_samples("niah_single", tokenizer, 1024, 2)
    prompts = [TokensPrompt(prompt_token_ids=s.token_ids) for s in samples]
    head_dim = 64  # SmolLM2-135M
    settings = resolve_settings(parse_config(ROCKETKV), DEFAULT_CPU_BLOCK_SIZE, head_dim, 1100)
    assert all(plan_request(settings, len(s.token_ids)).compress for s in samples)

    outputs = {}
    for tp in (1, 3):
        if tp > 1:
            monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|0")
        llm = make_llm(
            model_path,
            "ROCKETKV",
            ROCKETKV,
            tensor_parallel_size=tp,
            max_model_len=1100,
            dtype="float32",  # bf16 has no native kernels on AVX2-only CI machines
            kv_cache_memory_bytes=1 << 29,
            spawn=tp > 1,  # vLLM's own worker processes, one per rank
        )
        try:
            outputs[tp] = greedy(llm, prompts, max_tokens=16)
        finally:
            shutdown(llm)
    ids1, text1 = outputs[1]
    ids3, _ = outputs[3]
    assert [list(t) for t in ids3] == [list(t) for t in ids1]
    # The needle is found, so the equality is not between two broken runs.
    assert any(eval_tasks.score(t, s.references) == 100.0 for t, s in zip(text1, samples))
