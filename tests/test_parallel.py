"""Tensor, pipeline and data parallelism on vLLM's CPU build, against one
process.

The engines run a tiny random Llama with SmolLM2's attention (9 query and 3
KV heads of 64, its tokenizer) in 2 layers: every oracle here is another
engine, compared by tokens and logprobs. The tensor-parallel sizes that
divide both head counts are 1 and 3; with TP 3 each rank holds one KV head
(and its KT pages) and runs Stage 1 and Stage 2 on it alone. With PP 2 each rank holds
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
from conftest import ids_and_logprobs, make_llm, same_completion, shutdown

from rocketkv_vllm.config import parse_config, resolve_settings
from rocketkv_vllm.engine import DEFAULT_CPU_BLOCK_SIZE
from rocketkv_vllm.plan import plan_request

pytestmark = pytest.mark.engine

ROCKETKV = {"token_budget": 128, "max_new_tokens": 16}
MAX_MODEL_LEN = 1100
# The model: 2 layers, 3 KV heads, head dim 64, fp32, and the split's page
# of 2 tokens, whose KT pages add half the K/V bytes: 73,728 bytes per block
# and layer, so 52 blocks of 2 layers (one process), of 1 layer (a PP 2
# rank) or of 2 layers with one KV head (a TP 3 rank).
LAYERS = 2
PAGE_SIZE = 2
BLOCK_LAYER_BYTES = DEFAULT_CPU_BLOCK_SIZE * 3 * 64 * 4 * (2 + 2 // PAGE_SIZE)
BLOCKS = 52
# TP and PP add partial results in another order: fp32 rounding.
LOGPROB_TOL = 1e-3


def engine_kw(**kw):
    rank_share = kw.get("pipeline_parallel_size", 1) * kw.get("tensor_parallel_size", 1)
    return dict(
        max_model_len=MAX_MODEL_LEN,
        dtype="float32",  # bf16 has no native kernels on AVX2-only CI machines
        kv_cache_memory_bytes=BLOCKS * LAYERS * BLOCK_LAYER_BYTES // rank_share,  # per rank
        max_num_batched_tokens=512,  # prompts in chunks, batches of mixed steps
        **kw,
    )


@pytest.fixture(scope="module")
def model_9x3():
    from rocketkv_eval.tiny_model import prepare_tiny_model

    return prepare_tiny_model(64, num_heads=9, num_kv_heads=3, num_layers=LAYERS)


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
    from vllm import SamplingParams
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
        params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [
            ids_and_logprobs(o) for o in outs
        ], llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def one_process(model_9x3, samples):
    """The reference: one in-process worker (eager)."""
    outs, num_blocks = run(model_9x3, samples, enforce_eager=True)
    assert num_blocks == BLOCKS
    return outs


def assert_same(got, want):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert same_completion(g, w, abs=LOGPROB_TOL), i


def test_tensor_parallel_3_matches_one_process(model_9x3, samples, one_process, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|0")
    outs, _ = run(
        model_9x3,
        samples,
        enforce_eager=True,
        tensor_parallel_size=3,
        spawn=True,  # vLLM's own worker processes, one per rank
    )
    assert_same(outs, one_process)


def test_pipeline_parallel_2_matches_one_process(model_9x3, samples, one_process, monkeypatch):
    """vLLM 0.32's CPU runner needs its warm-up for PP (every backend: eager
    fails on the second rank), so this engine traces the model with
    torch.compile's eager backend: the same operations as the reference."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    outs, _ = run(
        model_9x3,
        samples,
        pipeline_parallel_size=2,
        enforce_eager=False,
        compilation_config={"mode": 1, "backend": "eager"},
        spawn=True,
    )
    assert_same(outs, one_process)


def test_data_parallel_2_server_matches_one_process(model_9x3, tokenizer, samples, one_process):
    """``vllm serve -dp 2`` as the console script runs it: two engine cores,
    each with its own scheduler and worker, behind two API servers (vLLM's
    default: one per engine), so Prometheus runs in multiprocess mode.
    Requests sent at once give one process's tokens, and the rocketkv:*
    counters, summed over the API servers, carry each engine's own label and
    add up to the requests."""
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import Server, metric_samples

    srv = Server(
        model_9x3,
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
    assert texts == [tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in one_process]
    compressed = {
        labels["engine"]: value
        for labels, value in metric_samples(metrics, "rocketkv:prompts_compressed_total")
    }
    assert set(compressed) == {"0", "1"} and sum(compressed.values()) == len(samples)
