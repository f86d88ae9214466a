"""One ROCKETKV engine run for ``test_model_runner_v2.py``, in its own process:

    python tests/model_runner_child.py {v1,v2,v2-async} {preempt,triton,torch,hybrid,abort} OUT.json

``v2`` runs vLLM's Model Runner V2 (NVIDIA's default) with its Triton
kernels interpreted, ``v2-async`` adds async scheduling (NVIDIA's other
default), ``v1`` runs the V1 runner of vLLM's CPU build, as every other
engine test does (``rocketkv_eval.runners``). The runner is chosen before
vLLM is imported, hence a process of its own.

Scenarios (each writes the completions, their prefix-cache hits, the
preemptions, ROCKETKV's counters, the runner's module and the scheduler's
class to OUT.json):

* ``preempt``: the tiny Llama, six requests through three request slots (slots are
  taken again by later requests), a per-request budget of 1024 and one of 0
  beside the engine's, a document asked twice (prefix caching), chunks
  shared between requests, given-back blocks poisoned, selections reused
  (``reselect_every`` 2), and a cache tight enough that a compressed
  request is preempted while it decodes and recomputed later.
* ``triton``: a tiny 2-layer Llama with SmolLM2's head geometry, Stage 2
  in the Triton kernels (interpreted), decode steps laid out as FULL CUDA
  graphs replay them (``force_graph_layout``), ``reselect_every`` 3.
* ``torch``: the same requests with the PyTorch Stage 2, steps laid out
  as vLLM's CPU build runs them (the oracle of ``triton``).
* ``hybrid``: a tiny random Gemma 3 (sliding-window layers in vLLM's
  backend), random-token prompts (a document asked three times), prefix
  caching on, given-back blocks poisoned.
* ``abort``: the tiny Llama with two request slots, prompts whose first chunk ends
  inside their observation window, aborted there (one of ``n`` 2) while
  others are mid-window and new ones arrive (``run_aborts``).
"""

from __future__ import annotations

import json
import sys

from conftest import chat_prompt, ids_and_logprobs  # this file's folder is on sys.path

from rocketkv_eval.runners import use_runner

# The scenarios' models have this many output rows: vLLM's V2 sampler and its
# logprobs run in Triton kernels, interpreted here, whose cost grows with the
# vocabulary (SmolLM2's 49,152: four fifths of a V2 run). Prompts are token
# ids, folded below it (``_small``); the scenarios are about scheduling and
# compare logprobs, so only their lengths and repeats matter.
SMALL_VOCAB = 2048


def prepare_models() -> None:
    """Build the scenarios' models once, before children that load them
    start side by side."""
    from rocketkv_eval.tiny_model import prepare_tiny_gemma3, prepare_tiny_model

    prepare_tiny_model(64, num_heads=3, num_kv_heads=1, vocab_size=SMALL_VOCAB)
    prepare_tiny_gemma3(sliding_window=64, query_pre_attn_scalar=48, vocab_size=SMALL_VOCAB)


def _small(tok, prompt):
    """A prompt (text, or token ids) as token ids below ``SMALL_VOCAB``."""
    from vllm.inputs import TokensPrompt

    ids = tok(prompt).input_ids if isinstance(prompt, str) else prompt
    return TokensPrompt(prompt_token_ids=[t % SMALL_VOCAB for t in ids])


def _preempt_scenario():
    from transformers import AutoTokenizer

    from rocketkv_eval.capacity import kv_bytes_for_tokens
    from rocketkv_eval.needle import build_needle_prompt
    from rocketkv_eval.tiny_model import prepare_tiny_model

    # SmolLM2's tokenizer and head geometry, 2 random layers: the scenario is
    # about scheduling (the cache is sized from the model's config, so it
    # holds the same blocks), and the outputs are compared by logprobs.
    model = prepare_tiny_model(64, num_heads=3, num_kv_heads=1, vocab_size=SMALL_VOCAB)
    tok = AutoTokenizer.from_pretrained(model)
    doc = build_needle_prompt(tok, 1000, 0.4, seed=21).prompt
    # (prompt, own budget, new tokens). Request 0's prefill runs 256 tokens a
    # step beside request 1's; request 1 compresses and decodes, then
    # request 0's growing prompt takes the cache and vLLM preempts the
    # newest running request: 1 (and the chat, 2).
    requests = [
        (build_needle_prompt(tok, 2300, 0.7, seed=22).prompt, None, 12),
        (doc, None, 24),
        (chat_prompt(tok, "Name three colours."), None, 24),
        (build_needle_prompt(tok, 900, 0.5, seed=23).prompt, 0, 12),
        (doc, None, 12),
        (build_needle_prompt(tok, 1400, 0.6, seed=24).prompt, 1024, 12),
    ]
    # 77 blocks of 32 tokens with the KT pages: request 0 alone needs 72.
    engine_kw = dict(
        model=model,
        max_model_len=2400,
        block_size=32,
        kv_cache_memory_bytes=kv_bytes_for_tokens(model, 3100, 4),
        max_num_seqs=3,
        max_num_batched_tokens=512,
        long_prefill_token_threshold=256,
    )
    rocketkv = {"token_budget": 128, "page_size": 4, "reselect_every": 2}
    return engine_kw, rocketkv, [(_small(tok, p), b, n) for p, b, n in requests]


def _triton_scenario(kernel: str):
    from transformers import AutoTokenizer

    from rocketkv_eval.model import prepare_default_model
    from rocketkv_eval.needle import build_needle_prompt
    from rocketkv_eval.tiny_model import prepare_tiny_model

    tok = AutoTokenizer.from_pretrained(prepare_default_model())
    requests = [
        (build_needle_prompt(tok, 600, 0.5, seed=11).prompt, None, 5),
        (chat_prompt(tok, "Name three colours."), None, 5),
    ]
    requests = [(_small(tok, p), b, n) for p, b, n in requests]
    engine_kw = dict(
        model=prepare_tiny_model(64, num_heads=3, num_kv_heads=1, vocab_size=SMALL_VOCAB),
        max_model_len=8192,
        kv_cache_memory_bytes=1 << 28,
        max_num_seqs=4,  # V2 samples its warm-up rows in interpreted kernels
    )
    rocketkv = {"prompt_budget": 128, "topk": 32, "reselect_every": 3, "kernel": kernel}
    return engine_kw, rocketkv, requests


def _hybrid_scenario():
    import random

    from rocketkv_eval.tiny_model import prepare_tiny_gemma3

    rng = random.Random(7)

    def ids(n):
        return [rng.randrange(100, 40000) for _ in range(n)]

    doc = ids(700)
    prompts = [doc + ids(40), ids(900), doc + ids(60), ids(50), ids(1200), doc + ids(30)]
    requests = [(_small(None, p), None, 12) for p in prompts]
    engine_kw = dict(
        model=prepare_tiny_gemma3(
            sliding_window=64, query_pre_attn_scalar=48, vocab_size=SMALL_VOCAB
        ),
        max_model_len=2048,
        block_size=32,
        kv_cache_memory_bytes=1 << 27,
        max_num_seqs=3,
        max_num_batched_tokens=256,
    )
    return engine_kw, {"prompt_budget": 256, "window_size": 160}, requests


def run(runner: str, scenario: str) -> dict:
    use_runner(runner)
    from vllm import LLM, SamplingParams

    from rocketkv_vllm.state import existing_worker_state

    if scenario == "preempt":
        engine_kw, rocketkv, requests = _preempt_scenario()
        testing = {"poison_evicted_blocks": True}
    elif scenario in ("triton", "torch"):
        engine_kw, rocketkv, requests = _triton_scenario(scenario)
        testing = {"force_graph_layout": scenario == "triton"}
    elif scenario == "hybrid":
        engine_kw, rocketkv, requests = _hybrid_scenario()
        testing = {"poison_evicted_blocks": True}
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    llm = LLM(
        attention_backend="ROCKETKV",
        enforce_eager=True,
        dtype="float32",
        seed=0,
        additional_config={"rocketkv": rocketkv, "rocketkv_testing": testing},
        **engine_kw,
    )
    engine = llm.llm_engine
    model_runner = engine.model_executor.driver_worker.worker.model_runner
    scheduler = engine.engine_core.engine_core.scheduler
    preemptions = []
    preempt = scheduler._preempt_request

    def record_preemption(request, *args, **kwargs):
        preemptions.append(
            [
                request.request_id.rsplit("-", 1)[0],
                request.num_computed_tokens,
                request.num_prompt_tokens,
            ]
        )
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = record_preemption
    for i, (prompt, budget, new_tokens) in enumerate(requests):
        params = SamplingParams(
            temperature=0.0,
            max_tokens=new_tokens,
            ignore_eos=True,
            logprobs=1,
            extra_args=None if budget is None else {"rocketkv_token_budget": budget},
        )
        engine.add_request(str(i), prompt, params)
    done, cached = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = ids_and_logprobs(out)
                cached[out.request_id] = out.num_cached_tokens or 0
    state = existing_worker_state(engine.vllm_config)
    counters = state.counters
    result = {
        "runner": type(model_runner).__module__,
        "scheduler": type(scheduler).__name__,
        "outputs": [done[str(i)] for i in range(len(requests))],
        "cached_tokens": [cached[str(i)] for i in range(len(requests))],
        "preemptions": preemptions,
        "prompts_compressed": counters.prompts_compressed,
        "decode_tokens_compressed": counters.decode_tokens_compressed,
        "decode_selections_reused": counters.decode_selections_reused,
        "graph_layout": state.graph_guard is not None,
    }
    engine.engine_core.shutdown()
    return result


# (step, what, request, prompt length, n): requests added and aborted by
# step. Every prompt's first chunk (256 tokens) ends inside its 32-token
# window, so each holds window queries across steps; with two slots an
# aborted request's buffers sat beside live ones (issue 57).
ABORT_EVENTS = [
    (0, "add", "A", 280, 1),
    (0, "add", "B", 280, 2),
    (1, "abort", "B", 0, 0),
    (1, "add", "C", 280, 1),
    (3, "add", "D", 270, 1),
    (4, "abort", "D", 0, 0),
    (4, "add", "E", 275, 1),
]
ABORTED = {"B", "D"}


def run_aborts(runner: str) -> dict:
    """The ``abort`` scenario: the survivors' completions, then each
    survivor's again alone (the oracle, same engine, prefix caching off),
    the free blocks at the start and end, and the window buffers left."""
    use_runner(runner)
    import random

    from vllm import LLM, SamplingParams

    from rocketkv_eval.tiny_model import prepare_tiny_model
    from rocketkv_vllm.state import existing_worker_state

    # The tiny random Llama with SmolLM2's head geometry: the oracle is the
    # same engine, compared by logprobs.
    llm = LLM(
        model=prepare_tiny_model(64, num_heads=3, num_kv_heads=1, vocab_size=SMALL_VOCAB),
        attention_backend="ROCKETKV",
        enforce_eager=True,
        dtype="float32",
        seed=0,
        max_model_len=1024,
        max_num_seqs=2,
        max_num_batched_tokens=512,
        long_prefill_token_threshold=256,
        kv_cache_memory_bytes=1 << 27,
        enable_prefix_caching=False,
        additional_config={
            "rocketkv": {"prompt_budget": 64, "topk": 32},
            "rocketkv_testing": {"poison_evicted_blocks": True},
        },
    )
    engine = llm.llm_engine
    pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    free_at_start = pool.get_num_free_blocks()
    rng = random.Random(5)
    prompts = {}
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)

    def add(name, length, n):
        prompts[name] = _small(None, [rng.randrange(100, 40000) for _ in range(length)])
        # n > 1 samples at temperature 1 (aborted before it samples: V2's
        # top-k kernel does not run under Triton's interpreter)
        params = greedy if n == 1 else SamplingParams(n=n, temperature=1.0, max_tokens=8)
        engine.add_request(name, prompts[name], params)

    done, step = {}, 0
    events = list(ABORT_EVENTS)
    while events or engine.has_unfinished_requests():
        while events and events[0][0] == step:
            _, what, name, length, n = events.pop(0)
            if what == "add":
                add(name, length, n)
            else:
                engine.abort_request([name])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = ids_and_logprobs(out)
        step += 1
    state = existing_worker_state(engine.vllm_config)
    left = len(state.window_queries)
    lone = {}
    for name in sorted(done):
        engine.add_request(name, prompts[name], greedy)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    lone[out.request_id] = ids_and_logprobs(out)
    result = {
        "finished": sorted(done),
        "outputs": [done[n] for n in sorted(done)],
        "lone": [lone[n] for n in sorted(done)],
        "free_blocks": [free_at_start, pool.get_num_free_blocks()],
        "window_buffers_left": left,
        "short_windows": state.counters.stage1_short_windows,
        "prompts_compressed": state.counters.prompts_compressed,
    }
    engine.engine_core.shutdown()
    return result


if __name__ == "__main__":
    from triton_interpreter import speed_up

    speed_up()  # V2's sampler kernels are interpreted here too
    runner, scenario, out = sys.argv[1:4]
    result = run_aborts(runner) if scenario == "abort" else run(runner, scenario)
    with open(out, "w") as f:
        json.dump(result, f)
