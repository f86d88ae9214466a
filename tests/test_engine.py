"""ROCKETKV inside the real vLLM engine (CPU build) on the embedded SmolLM2.

Engines run in this process (``conftest.make_llm``), except the ROCKETKV
engine of ``test_uncompressed_matches_vllm_cpu_attention``, which vLLM
spawns as it does by default (engine core and worker processes), so loading
the backend in a spawned process stays covered here as well as by the
servers of test_serve.
"""

import pytest
from conftest import (
    chat_prompt,
    greedy,
    ids_and_logprobs,
    make_llm,
    same_completion,
    shutdown,
)

from rocketkv_eval.needle import build_needle_prompt, is_correct

pytestmark = pytest.mark.engine


def test_bad_config_fails_at_startup_naming_the_field(model_path):
    with pytest.raises(Exception) as err:
        make_llm(model_path, "ROCKETKV", {"kernel_size": 64})
    assert "rocketkv.kernel_size" in str(err.value)
    with pytest.raises(Exception) as err:
        make_llm(model_path, "ROCKETKV", {"prompt_budget": 20})
    assert "rocketkv.prompt_budget" in str(err.value)


def _greedy_with_logprobs(llm, prompts, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ids, logprobs = zip(*(ids_and_logprobs(o) for o in outs))
    return list(ids), list(logprobs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_uncompressed_matches_vllm_cpu_attention(tiny, tokenizer, dtype):
    """Budget >= prompt: vLLM's own CPU kernel runs every token, so tokens
    and their logprobs match CPU_ATTN's to 1e-4 (same block size: ROCKETKV's
    CPU default of 32, which is CPU_ATTN's AMX kernel for bf16 where the CPU
    has AMX, its vec kernel otherwise). The tiny model: the oracle is vLLM's
    own backend, and logprobs move with every attention row."""
    prompts = [
        chat_prompt(tokenizer, "What is the capital of France? Answer in one sentence."),
        chat_prompt(tokenizer, "Write a short poem about the sea."),
        build_needle_prompt(tokenizer, 700, 0.2, seed=2).prompt,
    ]
    if dtype == "float32":  # bf16 is emulated on AVX2 CPUs (CI's): the long prompt once
        prompts.append(build_needle_prompt(tokenizer, 1500, 0.5, seed=1).prompt)
    ref = make_llm(tiny, "CPU_ATTN", block_size=32, dtype=dtype)
    ref_ids, ref_lp = _greedy_with_logprobs(ref, prompts, 32)
    shutdown(ref)
    ours = make_llm(
        tiny, "ROCKETKV", {"prompt_budget": 4096}, dtype=dtype, spawn=dtype == "float32"
    )
    our_ids, our_lp = _greedy_with_logprobs(ours, prompts, 32)
    shutdown(ours)
    assert our_ids == ref_ids
    # bf16: two separately compiled engines differ in rounding (seen: 0.11 on
    # one step, same tokens); fp32 pins the logprobs.
    tol = 1e-4 if dtype == "float32" else 0.2
    for a, b in zip(our_lp, ref_lp):
        assert a == pytest.approx(b, abs=tol)


MIXED_CFG = {"prompt_budget": 320}


def _mixed_prompts(tokenizer):
    return [
        build_needle_prompt(tokenizer, 1000, 0.3, seed=21).prompt,
        chat_prompt(tokenizer, "Name three colours."),
        build_needle_prompt(tokenizer, 1600, 0.7, seed=22).prompt,
        chat_prompt(tokenizer, "What is two plus two?"),
        build_needle_prompt(tokenizer, 700, 0.5, seed=23).prompt,
    ]


@pytest.fixture(scope="module")
def mixed_alone(tiny, tokenizer):
    """Each request of the mixed batch alone in one chunk, prefix caching off."""
    alone = make_llm(
        tiny,
        "ROCKETKV",
        MIXED_CFG,
        max_num_seqs=1,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
    )
    out = _greedy_with_logprobs(alone, _mixed_prompts(tokenizer), 20)
    shutdown(alone)
    return out


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_mixed_batch_matches_one_request_at_a_time(tiny, tokenizer, mixed_alone, prefix_caching):
    """Short and long prompts together, chunks shared between requests (a
    long prompt ends inside a chunk that also carries other requests' tokens
    and decodes): the tokens and logprobs of each request alone in one chunk
    without prefix caching, with vLLM's prefix caching on (the prompts share
    their opening) and off."""
    mixed = make_llm(
        tiny,
        "ROCKETKV",
        MIXED_CFG,
        max_num_seqs=8,
        max_num_batched_tokens=384,
        enable_prefix_caching=prefix_caching,
    )
    got = _greedy_with_logprobs(mixed, _mixed_prompts(tokenizer), 20)
    shutdown(mixed)
    for i, (a, b) in enumerate(zip(zip(*got), zip(*mixed_alone))):
        assert same_completion(a, b), i


def test_per_request_budget_matches_an_engine_with_that_budget(tiny, tokenizer, monkeypatch):
    """One batch mixing requests with their own budget (``extra_args``), with
    budget 0 (uncompressed) and with none (the engine's): each gives the tokens
    and logprobs of an engine configured that way, and the scheduler gives
    back exactly the blocks of that request's plan. Evicted blocks are
    poisoned before they go back, so a backend reading any freed block would
    change the output."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # see the scheduler
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from rocketkv_vllm.config import parse_config, resolve_settings
    from rocketkv_vllm.plan import plan_request

    p1 = build_needle_prompt(tokenizer, 1000, 0.4, seed=31).prompt
    p2 = build_needle_prompt(tokenizer, 1700, 0.6, seed=32).prompt

    def params(budget):
        return SamplingParams(
            temperature=0.0,
            max_tokens=16,
            logprobs=1,
            extra_args=None if budget is None else {"rocketkv_token_budget": budget},
        )

    def run(llm, requests):
        """Results and, per request, how many of its blocks were given back
        once its first decode step ran."""
        engine = llm.llm_engine
        sched = engine.engine_core.engine_core.scheduler
        manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
        for i, (prompt, budget) in enumerate(requests):
            engine.add_request(str(i), prompt, params(budget))
        done, freed = {}, {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, ids_and_logprobs(o)) for o in engine.step() if o.finished)
            for r in sched.running:
                key = r.request_id.rsplit("-", 1)[0]
                if r.num_computed_tokens > r.num_prompt_tokens and key not in freed:
                    blocks = manager.req_to_blocks[r.request_id]
                    freed[key] = (r.num_prompt_tokens, sum(b.is_null for b in blocks))
        return [done[str(i)] for i in range(len(requests))], [
            freed[str(i)] for i in range(len(requests))
        ]

    cfg = {"token_budget": 128, "page_size": 4}
    llm = make_llm(tiny, "ROCKETKV", cfg, testing={"poison_evicted_blocks": True})
    requests = [(p1, 0), (p2, 1024), (p1, None), (p2, None)]
    mixed, freed = run(llm, requests)
    alone, _ = run(llm, [(p1, None), (p2, None)])
    with pytest.raises(VLLMValidationError, match="vllm_xargs.rocketkv_token_budget"):
        llm.generate(p1, params(8), use_tqdm=False)
    [again] = [ids_and_logprobs(o) for o in llm.generate(p1, params(0), use_tqdm=False)]
    shutdown(llm)
    wide = make_llm(tiny, "ROCKETKV", dict(cfg, token_budget=1024))
    [want_1024] = [ids_and_logprobs(o) for o in wide.generate(p2, params(None), use_tqdm=False)]
    shutdown(wide)
    dense = make_llm(tiny, "CPU_ATTN", block_size=32)
    [want_dense] = [ids_and_logprobs(o) for o in dense.generate(p1, params(None), use_tqdm=False)]
    shutdown(dense)

    assert same_completion(mixed[0], want_dense) and same_completion(again, want_dense)
    assert same_completion(mixed[1], want_1024)
    assert same_completion(mixed[2], alone[0]) and same_completion(mixed[3], alone[1])
    # The engine's own budget changes p2's logprobs: 1024 was not ignored.
    assert not same_completion(mixed[3], want_1024)
    settings = resolve_settings(parse_config(cfg), 32, 64, 8192)
    want_freed = []
    for (n, _), (_, budget) in zip(freed, requests):
        start, end = plan_request(settings, n, budget).freed_block_range(32)
        want_freed.append((n, end - start))
    assert freed == want_freed
    assert want_freed[0][1] == 0 and 0 < want_freed[1][1] < want_freed[3][1]


# Two depths at 2k and one 3k case: a sanity check of retrieval through
# the engine, not the accuracy claim (that is scripts/eval_accuracy.py's
# grid, >= 32 samples a cell, docs/results.md). The 4k cases this had cost
# ~5 minutes of fp32 prefill on a 2-core CI machine.
NEEDLE_CASES = [(2000, 0.1), (2000, 0.9), (3000, 0.5)]


def test_needle_retrieval_with_compression(model_path, tokenizer):
    """At token budget 256 the needle is found about as often as with dense."""
    cases = [build_needle_prompt(tokenizer, n, d, seed=i) for i, (n, d) in enumerate(NEEDLE_CASES)]
    prompts = [c.prompt for c in cases]
    dense = make_llm(model_path, "CPU_ATTN")
    _, dense_text = greedy(dense, prompts, max_tokens=16)
    shutdown(dense)
    ours = make_llm(model_path, "ROCKETKV", {"token_budget": 256})
    _, our_text = greedy(ours, prompts, max_tokens=16)
    shutdown(ours)
    dense_ok = [is_correct(t, c) for t, c in zip(dense_text, cases)]
    our_ok = [is_correct(t, c) for t, c in zip(our_text, cases)]
    report = [(c.num_tokens, c.depth, a, b) for c, a, b in zip(cases, dense_ok, our_ok)]
    print("needle (tokens, depth, dense, rocketkv):", report)
    assert sum(our_ok) >= sum(dense_ok) - 1, report


def _straddling_case(tokenizer, target, chunk, seed):
    """A needle prompt whose last chunk holds fewer tokens than the window."""
    for t in range(target, target + 400, 7):
        case = build_needle_prompt(tokenizer, t, 0.5, seed=seed)
        if 0 < case.num_tokens % chunk < 20:
            return case
    raise AssertionError("no prompt length with a split window found")


def test_chunked_prefill_gives_the_same_output(tiny, tokenizer):
    """Small chunks split the observation window across steps; same tokens
    and logprobs."""
    chunk = 256
    cases = [_straddling_case(tokenizer, n, chunk, seed=n) for n in (1300, 2100)]
    prompts = [c.prompt for c in cases]
    cfg = {"prompt_budget": 256}
    whole = make_llm(tiny, "ROCKETKV", cfg, max_num_batched_tokens=8192)
    want = _greedy_with_logprobs(whole, prompts, 24)
    shutdown(whole)
    # One request at a time, so chunk boundaries fall on multiples of `chunk`.
    chunked = make_llm(tiny, "ROCKETKV", cfg, max_num_batched_tokens=chunk, max_num_seqs=1)
    got = _greedy_with_logprobs(chunked, prompts, 24)
    shutdown(chunked)
    for i, (a, b) in enumerate(zip(zip(*got), zip(*want))):
        assert same_completion(a, b), i


@pytest.mark.parametrize(
    "kt_dtype,graph_layout,reselect_every", [("auto", True, 3), ("fp8_e4m3", False, 1)]
)
def test_triton_path_forced_on_matches_torch_path(
    tiny, tokenizer, kt_dtype, graph_layout, reselect_every
):
    """The Triton kernels (interpreted on CPU) inside the engine: same tokens
    as the PyTorch path, with compression, a mixed batch and a dense row.
    With ``force_graph_layout`` every decode step of both rows is laid out
    as a FULL CUDA graph replays it (backend.graphs): Stage 2 over both rows
    with launch shapes from max_model_len, the dense row left to the native
    backend, written in place; there each selection also serves up to 3
    steps (``reselect_every``, the selection stores of both paths). On a
    tiny random Llama with SmolLM2's head
    geometry (head dim 64, GQA 3:1), 2 layers: the interpreter runs every
    program of every launch, 30 layers of it would take ~10 minutes."""
    prompts = [
        build_needle_prompt(tokenizer, 600, 0.5, seed=11).prompt,
        chat_prompt(tokenizer, "Name three colours."),
    ]
    cfg = {"prompt_budget": 128, "topk": 32, "kt_dtype": kt_dtype}
    cfg["reselect_every"] = reselect_every
    from rocketkv_vllm.state import existing_worker_state

    results, guards = [], []
    for kernel, testing in (("torch", None), ("triton", {"force_graph_layout": graph_layout})):
        llm = make_llm(tiny, "ROCKETKV", dict(cfg, kernel=kernel), testing=testing)
        results.append(_greedy_with_logprobs(llm, prompts, 5))
        # The builder laid steps out for FULL graphs (its guard for the runner).
        state = existing_worker_state(llm.llm_engine.vllm_config)
        guards.append(state.graph_guard is not None)
        assert (state.counters.decode_selections_reused > 0) == (reselect_every > 1)
        shutdown(llm)
    assert guards == [False, graph_layout]
    (torch_ids, torch_lp), (triton_ids, triton_lp) = results
    assert triton_ids == torch_ids
    # Random weights make the tokens robust to attention errors; the
    # logprobs are not (fp32 on both paths).
    for a, b in zip(triton_lp, torch_lp):
        assert a == pytest.approx(b, abs=1e-3)


def _rocketkv_tokens(model_path, cfg, prompts, max_tokens, testing=None):
    """(greedy tokens and logprobs, KV blocks) of a fresh ROCKETKV engine."""
    llm = make_llm(model_path, "ROCKETKV", cfg, testing=testing)
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    out = _greedy_with_logprobs(llm, prompts, max_tokens)
    shutdown(llm)
    return list(zip(*out)), blocks


def test_fp8_kt_pages_give_the_same_tokens_in_both_cpu_paths(tiny, tokenizer):
    """kt_dtype fp8_e4m3 in the engine: the native CPU kernel and batched
    PyTorch (two implementations of the fp8 rows) choose the same pages, and
    the smaller KT rows leave room for more KV blocks. The two sum the page
    scores in another order (the native kernel's order follows the CPU's
    vector width), so a page at a near tie may go either way: seen once on
    an AVX-512 CPU, one step of 32 at 0.016 in its logprob, the tokens the
    same. A wrong fp8 row would move many steps."""
    prompts = [
        build_needle_prompt(tokenizer, 1400, 0.4, seed=41).prompt,
        build_needle_prompt(tokenizer, 2300, 0.6, seed=42).prompt,
    ]
    cfg = {"token_budget": 256, "kt_dtype": "fp8_e4m3"}
    native, fp8_blocks = _rocketkv_tokens(tiny, cfg, prompts, 16)
    reference, _ = _rocketkv_tokens(tiny, dict(cfg, kernel="torch"), prompts, 16)
    steps_apart = 0
    for i, (a, b) in enumerate(zip(native, reference)):
        assert a[0] == b[0], i
        assert a[1] == pytest.approx(b[1], abs=0.05), i
        steps_apart += sum(abs(x - y) > 1e-4 for x, y in zip(a[1], b[1]))
    assert steps_apart <= 1, steps_apart
    bf16_blocks = _rocketkv_tokens(tiny, {"token_budget": 256}, prompts[:1], 1)[1]
    assert fp8_blocks > bf16_blocks, (fp8_blocks, bf16_blocks)


def test_selection_reuse_follows_each_request_through_a_mixed_batch(tiny, tokenizer):
    """reselect_every 4 (each selection serves the rest of its page): one
    request at a time in batched PyTorch, and all together in the C++
    kernel with 2 selection slots for 3 requests (slots change hands), give
    the same tokens; alone, exactly the decode steps the rule names reuse
    (the first decode step of a request and a token opening a page select),
    and every layer's store holds what its kernel wrote."""
    from vllm import SamplingParams

    from rocketkv_vllm.config import settings_for
    from rocketkv_vllm.state import existing_worker_state

    prompts = [
        build_needle_prompt(tokenizer, 1000, 0.3, seed=51).prompt,
        build_needle_prompt(tokenizer, 1500, 0.6, seed=52).prompt,
        build_needle_prompt(tokenizer, 1200, 0.5, seed=53).prompt,
    ]
    cfg = {"token_budget": 256, "reselect_every": 4}
    new_tokens = 16
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
    results = []
    for kernel, max_num_seqs in (("torch", 1), ("auto", 2)):
        llm = make_llm(tiny, "ROCKETKV", dict(cfg, kernel=kernel), max_num_seqs=max_num_seqs)
        outs = llm.generate(prompts, params, use_tqdm=False)
        config = llm.llm_engine.vllm_config
        assert settings_for(config).page_size == 4
        counters = existing_worker_state(config).counters
        layers = config.compilation_config.static_forward_context.values()
        stores = [layer.impl.selections for layer in layers if hasattr(layer, "impl")]
        assert len(stores) == 2 and all((st >= 0).any() for st in stores)
        results.append((outs, counters.decode_selections_reused, counters.prompts_compressed))
        shutdown(llm)
    (alone, alone_reused, compressed), (mixed, _, _) = results
    assert compressed == len(prompts)
    for i, (a, b) in enumerate(zip(mixed, alone)):
        assert same_completion(ids_and_logprobs(a), ids_and_logprobs(b)), i
    # decode token positions p = L .. L + new_tokens - 2 of a prompt of L
    # tokens (the first output token comes from the prefill); p = L selects
    want = sum(
        sum(1 for p in range(n + 1, n + new_tokens - 1) if p % 4)
        for n in (len(o.prompt_token_ids) for o in alone)
    )
    assert alone_reused == want


def test_prompt_embeddings_give_the_tokens_of_their_ids(tiny, tokenizer):
    """``enable_prompt_embeds``: a prompt given as its embeddings is planned,
    compressed and decoded as the same prompt given as token ids (prefix
    caching on: the ids' blocks are cached first, and an embeddings prompt
    hashes apart; given-back blocks poisoned)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rocketkv_eval import tasks as eval_tasks
    from rocketkv_vllm.config import parse_config, resolve_settings
    from rocketkv_vllm.plan import plan_request

    cfg = {"token_budget": 128, "max_new_tokens": 16}
    samples = eval_tasks.make_samples("niah_single", tokenizer, 1024, 2)
    settings = resolve_settings(parse_config(cfg), 32, 64, 2048)
    assert all(plan_request(settings, len(s.token_ids)).compress for s in samples)
    embed = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    embed = embed.get_input_embeddings()
    with torch.no_grad():
        as_embeds = [{"prompt_embeds": embed(torch.tensor(s.token_ids))} for s in samples]
    as_ids = [{"prompt_token_ids": s.token_ids} for s in samples]
    llm = make_llm(
        tiny,
        "ROCKETKV",
        cfg,
        testing={"poison_evicted_blocks": True},
        enable_prompt_embeds=True,
        max_model_len=2048,
    )
    want_ids, want_logprobs = _greedy_with_logprobs(llm, as_ids, 16)
    ids, logprobs = _greedy_with_logprobs(llm, as_embeds, 16)
    shutdown(llm)
    assert ids == want_ids
    for got, want in zip(logprobs, want_logprobs):
        assert got == pytest.approx(want, abs=1e-4)


def test_pooling_runner_gives_dense_embeddings(tiny, tokenizer):
    """``runner="pooling"``: nothing decodes, so prompts longer than the
    budget are served uncompressed (``requests.planned_budget``: no Stage 1)
    and the embeddings are CPU_ATTN's."""
    import torch

    from rocketkv_eval import tasks as eval_tasks
    from rocketkv_vllm.state import worker_state

    prompts = [
        {"prompt_token_ids": s.token_ids}
        for s in eval_tasks.make_samples("niah_single", tokenizer, 1024, 2)
    ]
    embeddings = {}
    for backend, cfg in (("CPU_ATTN", None), ("ROCKETKV", {"token_budget": 128})):
        llm = make_llm(tiny, backend, cfg, runner="pooling", max_model_len=2048, block_size=32)
        outs = llm.embed(prompts, use_tqdm=False)
        embeddings[backend] = torch.tensor([o.outputs.embedding for o in outs])
        if cfg is not None:  # Stage 1 never ran
            counters = worker_state(llm.llm_engine.vllm_config).counters
            assert counters.prompts_compressed == 0
        shutdown(llm)
    torch.testing.assert_close(embeddings["ROCKETKV"], embeddings["CPU_ATTN"], atol=1e-5, rtol=1e-5)


def test_beam_search_and_prompt_logprobs_match_cpu_attention(tiny, tokenizer):
    """vLLM's beam search runs each step as max_tokens=1 requests over the
    beams' whole sequences: nothing decodes, so ROCKETKV serves them
    uncompressed in every process (``requests.planned_budget``) and the
    beams are CPU_ATTN's, each step's prompt a prefix-cache hit on the last
    step's blocks. A request of the same prompt that decodes is compressed,
    and its prompt logprobs (computed before Stage 1 compacts) are
    CPU_ATTN's. Given-back blocks are poisoned."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    from rocketkv_vllm.state import worker_state

    ids = tokenizer(build_needle_prompt(tokenizer, 1500, 0.5, seed=41).prompt).input_ids
    prompt = TokensPrompt(prompt_token_ids=ids)
    scored = SamplingParams(max_tokens=2, prompt_logprobs=0, temperature=0.0)
    beams, prompt_logprobs = {}, {}
    for backend, cfg in (("CPU_ATTN", None), ("ROCKETKV", {"token_budget": 128})):
        testing = {"poison_evicted_blocks": True} if cfg else None
        llm = make_llm(tiny, backend, cfg, testing=testing, block_size=32)
        [out] = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=6))
        beams[backend] = [(s.tokens[len(ids) :], s.cum_logprob) for s in out.sequences]
        if cfg:
            counters = worker_state(llm.llm_engine.vllm_config).counters
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
            # Workers: no Stage 1; scheduler: no window cap on the hits, no
            # copies of compaction targets.
            assert counters.prompts_compressed == 0
            assert manager.prefix_account == type(manager.prefix_account)()
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
            assert counters.prompts_compressed == 1
            assert manager.prefix_account.tokens_recomputed > 0
        [out] = llm.generate(prompt, scored, use_tqdm=False)
        # (vLLM reads no prefix-cache hit for a request with prompt logprobs.)
        prompt_logprobs[backend] = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], ids[1:])]
        if cfg:
            assert counters.prompts_compressed == 2
        shutdown(llm)
    want, got = beams["CPU_ATTN"], beams["ROCKETKV"]
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-4)
    assert len(prompt_logprobs["ROCKETKV"]) == len(ids) - 1
    assert prompt_logprobs["ROCKETKV"] == pytest.approx(prompt_logprobs["CPU_ATTN"], abs=1e-4)
