"""vLLM's prefix caching with compression on (kv_cache's module docstring).

One in-process ROCKETKV engine with prefix caching runs every case below in
turn; the same cases run on an engine with prefix caching off (evicted
blocks poisoned) and, for the blocks the cache holds, on vLLM's dense
backend. fp32, greedy, on the tiny random Llama (conftest ``tiny``: every
oracle here is another engine). The oracles:

- the tokens and logprobs of every request equal those with prefix
  caching off;
- every sampled block the prefix cache holds has exactly the K/V that
  dense prefill of its token prefix writes (vLLM's CPU_ATTN, same prompt);
- hits happened where they should (vLLM's own per-request cached tokens),
  and no block leaked.

The reselection test asks a real question, so it runs SmolLM2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from conftest import ENGINE_KW

from rocketkv_eval.engines import external_id, in_process, scheduler
from rocketkv_eval.multiturn import (
    ANSWER_PREFIX,
    FACT,
    QUESTION,
    make_conversation,
    prompt_ids,
    question_ids,
    render,
)
from rocketkv_eval.needle import build_needle_prompt

pytestmark = pytest.mark.engine

SETTINGS = {"prompt_budget": 256}
BS = 32
MAX_TOKENS = 16
LAYERS = (0, 1)  # the tiny model's layers, whose cached K/V are compared with dense
LOGPROB_TOL = 1e-3  # caching on and off chunk prefills differently: summation order


@dataclass
class Out:
    tokens: list[list[int]]  # one list per sample (n > 1)
    logprobs: list[float]  # of the first sample's tokens
    text: str
    cached: int
    prompt: list[int]


@dataclass
class Run:
    outs: dict[str, Out] = field(default_factory=dict)
    # case 4: prefill state of B in the step where A's prompt ended
    b_prefilling_when_a_compacted: bool | None = None
    reset: bool | None = None  # what LLM.reset_prefix_cache() answered (case 7)
    account: object = None
    blocks: dict = field(default_factory=dict)  # (request id, block) -> K/V per layer
    free_at_start: int = 0
    free_at_end: int = 0
    kept: list = field(default_factory=list)


def _cases(tokenizer):
    """The requests of every case, in groups submitted together; a group
    starts when the one before it has finished."""
    needle = build_needle_prompt(tokenizer, 1000, 0.4, seed=5).token_ids
    doc = make_conversation(tokenizer, 900, 4, seed=11)
    shared = make_conversation(tokenizer, 850, 3, seed=12)
    extra = make_conversation(tokenizer, 1300, 1, seed=13).document
    mixed = make_conversation(tokenizer, 850, 2, seed=14)

    def ask(conv, fact, document=None):
        return question_ids(tokenizer, conv, fact, document)

    return [
        # 1. the same prompt twice
        [("same-1", needle, {})],
        [("same-2", needle, {})],
        # 2. one document, different questions
        [("doc-q0", ask(doc, 0), {})],
        [("doc-q1", ask(doc, 1), {})],
        # 4. a shared long prefix: warmed, then A compacts while B, with a
        # long continuation, is still prefilling in chunks
        [("warm", ask(shared, 0), {})],
        [("A", ask(shared, 1), {}), ("B", ask(shared, 2, f"{shared.document}\n\n{extra}"), {})],
        # 5. an uncompressed request (budget 0) beside a compressed one
        [("warm-mixed", ask(mixed, 0), {})],
        [
            ("dense-row", ask(mixed, 1), {"rocketkv_token_budget": 0}),
            ("compressed-row", ask(mixed, 0), {}),
        ],
        # 6. parallel sampling
        [("n2", ask(doc, 2), {"n": 2})],
        # 7. the cache reset (LLM.reset_prefix_cache, as RL trainers call it
        # after a weight update), then the prompt of case 1 once more
        RESET,
        [("after-reset", needle, {})],
    ]


RESET: list = []  # a group that resets the prefix cache instead


def _hashes(llm, ids):
    """The block hashes vLLM computes for a prompt (this engine's seed)."""
    hasher = llm.llm_engine.engine_core.engine_core.request_block_hasher
    fake = SimpleNamespace(
        block_hashes=[],
        num_tokens=len(ids),
        all_token_ids=ids,
        mm_features=[],
        lora_request=None,
        cache_salt=None,
        prompt_embeds=None,
    )
    return hasher(fake)


def _kv_caches(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.kv_caches


def _block_kv(llm, block_id: int) -> list[torch.Tensor]:
    from rocketkv_vllm.layout import split_kv

    out = []
    for layer in LAYERS:
        k, v = split_kv(_kv_caches(llm)[layer], "cpu_vec")
        out.append(torch.stack([k[block_id], v[block_id]]).clone())
    return out


def _run(llm, groups, chats, record_blocks: bool) -> Run:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    sched = scheduler(llm)
    pool = sched.kv_cache_manager.block_pool
    run = Run(free_at_start=pool.get_num_free_blocks())

    def params(extra):
        extra = dict(extra)
        n = extra.pop("n", 1)
        # n > 1 needs sampling: top-1 of it is greedy.
        return SamplingParams(
            temperature=0.0 if n == 1 else 1.0,
            top_k=1 if n > 1 else 0,
            max_tokens=MAX_TOKENS,
            n=n,
            logprobs=0,
            extra_args=extra or None,
        )

    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    def record(rid, prompt):
        """The K/V of every block the cache maps for this prompt, now (later
        requests may evict them)."""
        cached = pool.cached_block_hash_to_block
        for j, h in enumerate(_hashes(llm, prompt)):
            block = cached.get_one_block(make_block_hash_with_group_id(h, 0))
            if block is not None:
                run.blocks[(rid, j)] = _block_kv(llm, block.block_id)

    def finish(outs):
        for o in outs:
            if o.finished:
                run.outs[o.request_id] = Out(
                    [list(c.token_ids) for c in o.outputs],
                    [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                    o.outputs[0].text,
                    o.num_cached_tokens or 0,
                    list(o.prompt_token_ids),
                )
                if record_blocks:
                    record(o.request_id, list(o.prompt_token_ids))

    for group in groups:
        if group is RESET:
            run.reset = llm.reset_prefix_cache()
            continue
        for rid, ids, extra in group:
            engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params(extra))
        while engine.has_unfinished_requests():
            running = {external_id(r): r for r in sched.running}
            a, b = running.get("A"), running.get("B")
            finish(engine.step())
            if (
                a is not None
                and b is not None
                and run.b_prefilling_when_a_compacted is None
                and a.num_computed_tokens >= a.num_prompt_tokens
            ):
                run.b_prefilling_when_a_compacted = b.num_computed_tokens < b.num_prompt_tokens
    # 3. chats, each turn the whole conversation so far
    for name, turns, prompt in chats:
        answers: list[str] = []
        for turn in range(turns):
            rid = f"{name}-{turn}"
            engine.add_request(
                rid, TokensPrompt(prompt_token_ids=prompt(turn, answers)), params({})
            )
            while engine.has_unfinished_requests():
                finish(engine.step())
            answers.append(run.outs[rid].text)
    manager = sched.kv_cache_manager.coordinator.single_type_managers[0]
    run.account = getattr(manager, "prefix_account", None)
    run.free_at_end = pool.get_num_free_blocks()
    return run


def _engine(model_path, backend, caching: bool, rocketkv=None, testing=None):
    from vllm import LLM

    kw = dict(
        ENGINE_KW,
        max_model_len=4096,
        kv_cache_memory_bytes=1 << 29,
        max_num_batched_tokens=512,
        block_size=BS,
        enable_prefix_caching=caching,
    )
    extra = {}
    if rocketkv is not None:
        extra["rocketkv"] = rocketkv
    if testing:
        extra["rocketkv_testing"] = testing
    if extra:
        kw["additional_config"] = extra
    with in_process():
        return LLM(model=model_path, attention_backend=backend, **kw)


def _reselection_chat(tokenizer):
    """Turn 1 asks a passphrase; turn 2 a special magic number that turn 1's
    question gives no reason to keep (``test_later_turn_reselects...``)."""
    import random as _random

    from rocketkv_eval.needle import _SECRET_WORDS, _sentence

    rng = _random.Random(32)
    sentences = [_sentence(rng) for _ in range(110)]
    secret = "-".join(rng.sample(_SECRET_WORDS, 2))
    key, value = "brave-falcon", str(rng.randint(1_000_000, 9_999_999))
    sentences.insert(int(0.7 * len(sentences)), FACT.format(key=key, value=value))
    sentences.insert(int(0.3 * len(sentences)), f"The secret passphrase is {secret}.")
    first = [
        {
            "role": "user",
            "content": (
                "Below is a long text with a secret passphrase and some special magic numbers "
                "hidden in it. Read it carefully.\n\n"
                + " ".join(sentences)
                + "\n\nWhat is the secret passphrase? Answer with the passphrase only."
            ),
        }
    ]

    def prompt(turn, answers):
        if turn == 0:
            return render(tokenizer, first)
        return render(
            tokenizer,
            first
            + [
                {"role": "assistant", "content": answers[0]},
                {"role": "user", "content": QUESTION.format(key=key)},
            ],
            ANSWER_PREFIX.format(key=key),
        )

    return prompt, value


@pytest.fixture(scope="module")
def runs(tiny, tokenizer):
    groups = _cases(tokenizer)
    chat = make_conversation(tokenizer, 900, 4, seed=21)
    chats = [("chat", 4, lambda t, a: prompt_ids(tokenizer, chat, t, a))]
    result = {}
    for name, backend, caching, rocketkv, testing in (
        ("on", "ROCKETKV", True, SETTINGS, {"poison_evicted_blocks": True}),
        ("off", "ROCKETKV", False, SETTINGS, {"poison_evicted_blocks": True}),
        ("dense", "CPU_ATTN", True, None, None),
    ):
        llm = _engine(tiny, backend, caching, rocketkv, testing)
        try:
            result[name] = _run(llm, groups, chats, record_blocks=caching)
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
    return result


@pytest.fixture(scope="module")
def reselection(model_path, tokenizer):
    """SmolLM2 with prefix caching, the two-turn chat of the reselection
    test, the positions each Stage 1 kept recorded."""
    from rocketkv_vllm.state import worker_state

    reselect, _ = _reselection_chat(tokenizer)
    testing = {"poison_evicted_blocks": True, "record_kept_positions": True}
    llm = _engine(model_path, "ROCKETKV", True, SETTINGS, testing)
    try:
        run = _run(llm, [], [("mt", 2, reselect)], record_blocks=False)
        run.kept = list(worker_state(llm.llm_engine.vllm_config).kept_positions)
        return run
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


def test_outputs_equal_those_with_prefix_caching_off(runs):
    on, off = runs["on"], runs["off"]
    assert set(on.outs) == set(off.outs)
    for rid in on.outs:
        assert on.outs[rid].prompt == off.outs[rid].prompt, rid
        assert on.outs[rid].tokens == off.outs[rid].tokens, rid
        gap = max(abs(a - b) for a, b in zip(on.outs[rid].logprobs, off.outs[rid].logprobs))
        assert gap < LOGPROB_TOL, (rid, gap)
    assert all(o.cached == 0 for o in off.outs.values())


def test_later_requests_are_served_from_the_cache(runs):
    outs = runs["on"].outs
    n = len(outs["same-2"].prompt)
    # The same prompt again: all of it but the observation window (32) and
    # the block that holds the prompt's end.
    assert outs["same-1"].cached == 0
    assert n - 2 * BS - 32 <= outs["same-2"].cached <= n - 32
    assert outs["doc-q1"].cached >= 0.9 * (len(outs["doc-q0"].prompt) - 64)
    assert outs["A"].cached > 700 and outs["B"].cached > 700
    assert outs["dense-row"].cached > 700 and outs["compressed-row"].cached > 700
    later = [outs[f"chat-{t}"] for t in (1, 2, 3)]
    assert sum(o.cached for o in later) >= 0.75 * sum(len(o.prompt) for o in later)
    account = runs["on"].account
    assert account.private_copies > 0 and account.blocks_preserved > 0
    assert account.tokens_recomputed > 0  # the window of the repeated prompt


def test_a_reset_cache_serves_nothing_more_and_the_prompt_is_recomputed_alike(runs):
    """After everything above (preserved targets, given-back blocks still
    hashed, a host of cached prefixes), vLLM's reset succeeds with nothing
    running, the next request hits nothing, and its recomputed compression
    gives the first run's tokens (and caching-off's: the test above)."""
    on = runs["on"]
    assert on.reset is True
    assert on.outs["after-reset"].cached == 0
    assert on.outs["after-reset"].tokens == on.outs["same-1"].tokens


def test_a_request_compacts_while_another_still_prefills_the_shared_prefix(runs):
    assert runs["on"].b_prefilling_when_a_compacted is True


def test_cached_blocks_hold_what_dense_prefill_writes(runs):
    """Every block the cache maps for a prompt: ROCKETKV's engine and
    vLLM's dense backend hold the same K/V for it (its token prefix)."""
    on, dense = runs["on"], runs["dense"]

    def same_prefix(key):  # the chats' answers may differ between backends
        rid, j = key
        end = (j + 1) * BS
        return on.outs[rid].prompt[:end] == dense.outs[rid].prompt[:end]

    common = sorted(k for k in set(on.blocks) & set(dense.blocks) if same_prefix(k))
    # The targets of compressed prompts (their first blocks) reach the
    # cache through copies: they are among the blocks compared.
    assert ("same-1", 0) in on.blocks and ("chat-3", 0) in on.blocks
    assert len(common) > 100
    for key in common:
        for got, want in zip(on.blocks[key], dense.blocks[key]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=str(key))


def test_no_block_leaks(runs):
    for run in runs.values():
        assert run.free_at_end == run.free_at_start


def test_later_turn_reselects_what_an_earlier_turn_evicted(reselection, tokenizer):
    """RocketKV-MT for free: turn 1 asks a passphrase, and its compression
    keeps little of a magic number elsewhere in the text; turn 2 (the whole
    history, served from the cache) asks for that number: its Stage 1 scores
    the whole conversation again and keeps it, and the answer is right."""
    _, value = _reselection_chat(tokenizer)
    on = reselection
    first = on.outs["mt-0"].prompt
    number = tokenizer(" " + value, add_special_tokens=False)["input_ids"][1:]
    start = next(i for i in range(len(first)) if first[i : i + len(number)] == number)
    span = set(range(start, start + len(number)))

    def coverage(n):
        """Share of (layer, KV head) pairs of the Stage 1 of the n-token
        prompt that kept at least half of the number's tokens."""
        entries = [kept for num, kept in on.kept if num == n][-30:]
        assert len(entries) == 30  # one per layer
        keep = [
            sum(int(p) in span for p in row) >= len(span) / 2 for kept in entries for row in kept
        ]
        return sum(keep) / len(keep)

    turn1, turn2 = coverage(len(first)), coverage(len(on.outs["mt-1"].prompt))
    print("(layer, head) pairs keeping the number: turn 1", turn1, "turn 2", turn2)
    assert on.outs["mt-1"].cached > 0.9 * len(first)
    assert turn1 < 0.4 and turn2 > turn1 + 0.15
    assert value in on.outs["mt-1"].text, on.outs["mt-1"].text
