"""Tensor, pipeline and data parallelism on vLLM's CPU build, against one
process.

SmolLM2-135M has 9 query and 3 KV heads, so the tensor-parallel sizes that
divide both are 1 and 3; with TP 3 each rank holds one KV head (and its KT
pages) and runs Stage 1 and Stage 2 on it alone. With PP 2 each rank holds
half the layers and compresses them, and the scheduler keeps two batches
in flight: a later step runs on the first rank while an earlier one, maybe
a compacting one, still runs on the second.
With DP 2 one API server feeds two engine cores.
Several CPU workers on a 2-core machine need an explicit thread binding
(vLLM's automatic one wants a NUMA node per rank).

Every engine runs the same requests in a cache of 52 blocks per layer,
fewer than the ~132 the four prompts' dense blocks need: later prompts wait
for the blocks earlier ones give back, which are poisoned before they go
back.
"""

import pytest
from conftest import greedy, make_llm, shutdown

from rocketkv_vllm.config import parse_config, resolve_settings
from rocketkv_vllm.engine import DEFAULT_CPU_BLOCK_SIZE
from rocketkv_vllm.plan import plan_request

pytestmark = pytest.mark.engine

ROCKETKV = {"token_budget": 128, "max_new_tokens": 16}
MAX_MODEL_LEN = 1100
# SmolLM2: 30 layers, 3 KV heads, head dim 64, fp32, and the split's page of
# 2 tokens, whose KT pages add half the K/V bytes: 73,728 bytes per block
# and layer, so 52 blocks of 30 layers (one process), of 15 layers (a PP 2
# rank) or of 30 layers with one KV head (a TP 3 rank).
PAGE_SIZE = 2
BLOCK_LAYER_BYTES = DEFAULT_CPU_BLOCK_SIZE * 3 * 64 * 4 * (2 + 2 // PAGE_SIZE)
BLOCKS = 52


def engine_kw(**kw):
    rank_share = kw.get("pipeline_parallel_size", 1) * kw.get("tensor_parallel_size", 1)
    return dict(
        max_model_len=MAX_MODEL_LEN,
        dtype="float32",  # bf16 has no native kernels on AVX2-only CI machines
        kv_cache_memory_bytes=BLOCKS * 30 * BLOCK_LAYER_BYTES // rank_share,  # per rank
        max_num_batched_tokens=512,  # prompts in chunks, batches of mixed steps
        **kw,
    )


@pytest.fixture(scope="module")
def samples(tokenizer):
    from rocketkv_eval import tasks as eval_tasks

    samples = eval_tasks.make_samples("niah_single", tokenizer, 1024, 4)
    settings = resolve_settings(parse_config(ROCKETKV), DEFAULT_CPU_BLOCK_SIZE, 64, MAX_MODEL_LEN)
    assert settings.page_size == PAGE_SIZE
    assert all(plan_request(settings, len(s.token_ids)).compress for s in samples)
    # Dense, the four prompts need more blocks than the cache has.
    assert sum(-(-len(s.token_ids) // DEFAULT_CPU_BLOCK_SIZE) for s in samples) > 2 * BLOCKS
    return samples


def run(model_path, samples, **kw):
    from vllm.inputs import TokensPrompt

    llm = make_llm(
        model_path,
        "ROCKETKV",
        ROCKETKV,
        testing={"poison_evicted_blocks": True},
        **engine_kw(**kw),
    )
    try:
        prompts = [TokensPrompt(prompt_token_ids=s.token_ids) for s in samples]
        ids, text = greedy(llm, prompts, max_tokens=16)
        return ids, text, llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def one_process(model_path, samples):
    """The reference: one in-process worker (eager)."""
    ids, text, num_blocks = run(model_path, samples, enforce_eager=True)
    from rocketkv_eval import tasks as eval_tasks

    assert num_blocks == BLOCKS

    # The needle is found, so an equality is not between two broken runs.
    assert any(eval_tasks.score(t, s.references) == 100.0 for t, s in zip(text, samples))
    return [list(t) for t in ids]


def test_tensor_parallel_3_matches_one_process(model_path, samples, one_process, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|0")
    ids, _, _ = run(
        model_path,
        samples,
        enforce_eager=True,
        tensor_parallel_size=3,
        spawn=True,  # vLLM's own worker processes, one per rank
    )
    assert [list(t) for t in ids] == one_process


def test_pipeline_parallel_2_matches_one_process(model_path, samples, one_process, monkeypatch):
    """vLLM 0.32's CPU runner needs its warm-up for PP (every backend: eager
    fails on the second rank), so this engine traces the model with
    torch.compile's eager backend: the same operations as the reference."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    ids, _, _ = run(
        model_path,
        samples,
        pipeline_parallel_size=2,
        enforce_eager=False,
        compilation_config={"mode": 1, "backend": "eager"},
        spawn=True,
    )
    assert [list(t) for t in ids] == one_process


def test_data_parallel_2_server_matches_one_process(model_path, tokenizer, samples, one_process):
    """``vllm serve -dp 2`` as the console script runs it: two engine cores,
    each with its own scheduler and worker, behind two API servers (vLLM's
    default: one per engine), so Prometheus runs in multiprocess mode.
    Requests sent at once give one process's tokens, and the rocketkv:*
    counters, summed over the API servers, carry each engine's own label and
    add up to the requests."""
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import Server, metric_samples

    srv = Server(
        model_path,
        rocketkv=ROCKETKV,
        extra=[
            "-dp",
            "2",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-batched-tokens",
            "512",
        ],
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per engine's worker
        cli=True,
    )
    try:
        srv.wait_ready()
        client = srv.client()

        def complete(sample):
            out = client.completions.create(
                model=srv.model, prompt=sample.token_ids, max_tokens=16, temperature=0
            )
            return out.choices[0].text

        with ThreadPoolExecutor(len(samples)) as pool:
            texts = list(pool.map(complete, samples))
        metrics = srv.metrics()
    finally:
        log = srv.stop()
    assert "Defaulting api_server_count to data_parallel_size (2)" in log
    assert texts == [tokenizer.decode(ids, skip_special_tokens=True) for ids in one_process]
    compressed = {
        labels["engine"]: value
        for labels, value in metric_samples(metrics, "rocketkv:prompts_compressed_total")
    }
    assert set(compressed) == {"0", "1"} and sum(compressed.values()) == len(samples)
