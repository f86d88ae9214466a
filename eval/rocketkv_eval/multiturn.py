"""Multi-turn conversations over long documents, with known answers.

A conversation is one document (filler text of about L tokens with one
RULER-style fact per turn, a key's 7-digit number, hidden at spread depths)
and T questions, each asking one fact. Turn t's prompt is the whole conversation so far, as an
OpenAI-style chat client sends it: the document and the first question, the
model's own earlier answers, the next question. So later turns repeat
everything earlier turns sent, which is what vLLM's prefix cache serves.

``run_conversations`` drives an in-process engine (``engines.in_process``):
every conversation starts at once, each next turn is submitted when the
previous one finishes, and per request it records what the engine reports
(time to first token from vLLM's own timestamps, prompt tokens served from
the prefix cache, KV blocks held after the prefill).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from rocketkv_eval.engines import external_id, held_blocks, scheduler
from rocketkv_eval.needle import _sentence
from rocketkv_eval.tasks import KEY_ADJS, KEY_NOUNS

# RULER-style needles (the small default model retrieves these reliably):
# one 7-digit number per key (the first twelve of the tasks' key words),
# asked with an answer prefix to continue.
_KEY_ADJS = KEY_ADJS[:12]
_KEY_NOUNS = KEY_NOUNS[:12]
FACT = "One of the special magic numbers for {key} is: {value}."
INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure "
    "to memorize it. I will quiz you about the numbers afterwards."
)
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = "The special magic number for {key} mentioned in the provided text is"


@dataclass(frozen=True)
class Fact:
    key: str
    value: str
    depth: float  # position in the document, 0..1

    @property
    def sentence(self) -> str:
        return FACT.format(key=self.key, value=self.value)


@dataclass
class Conversation:
    document: str
    facts: list[Fact]  # turn t asks facts[t]

    def messages(self, turn: int, answers: list[str]) -> list[dict[str, str]]:
        """The chat as sent for ``turn`` (0-based), the model's answers to
        the earlier turns included (each after its answer prefix). The
        prompt continues with this turn's answer prefix (``prompt_ids``)."""
        msgs = [
            {
                "role": "user",
                "content": f"{INTRO}\n\n{self.document}\n\n"
                + QUESTION.format(key=self.facts[0].key),
            }
        ]
        for t in range(1, turn + 1):
            msgs.append({"role": "assistant", "content": self.prefix(t - 1) + answers[t - 1]})
            msgs.append({"role": "user", "content": QUESTION.format(key=self.facts[t].key)})
        return msgs

    def prefix(self, turn: int) -> str:
        return ANSWER_PREFIX.format(key=self.facts[turn].key)

    def correct(self, turn: int, text: str) -> bool:
        return self.facts[turn].value in text


def make_conversation(tokenizer, doc_tokens: int, turns: int, seed: int) -> Conversation:
    """A document of about ``doc_tokens`` tokens with ``turns`` facts."""
    rng = random.Random(seed)
    keys = [f"{a}-{n}" for a, n in zip(rng.sample(_KEY_ADJS, turns), rng.sample(_KEY_NOUNS, turns))]
    facts = []
    for i, key in enumerate(keys):
        depth = (i + 0.5) / turns  # spread over the document
        facts.append(Fact(key, str(rng.randint(1_000_000, 9_999_999)), depth))
    sentences: list[str] = []
    while len(tokenizer(" ".join(sentences))["input_ids"]) < doc_tokens:
        sentences.extend(_sentence(rng) for _ in range(40))
    # Trim to the target, then place the facts at their depths.
    lo, hi = 0, len(sentences)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tokenizer(" ".join(sentences[:mid]))["input_ids"]) <= doc_tokens:
            lo = mid
        else:
            hi = mid - 1
    sentences = sentences[:lo]
    for fact in sorted(facts, key=lambda f: -f.depth):
        sentences.insert(round(fact.depth * len(sentences)), fact.sentence)
    return Conversation(" ".join(sentences), facts)


def render(tokenizer, messages: list[dict[str, str]], answer_prefix: str = "") -> list[int]:
    """Token ids of a chat (generation prompt added), then ``answer_prefix``."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text + answer_prefix, add_special_tokens=False))


def prompt_ids(tokenizer, conversation: Conversation, turn: int, answers: list[str]) -> list[int]:
    """Token ids of ``turn``'s prompt: the chat so far, then the answer prefix."""
    return render(tokenizer, conversation.messages(turn, answers), conversation.prefix(turn))


def question_ids(
    tokenizer, conversation: Conversation, fact: int, document: str | None = None
) -> list[int]:
    """A one-turn prompt asking one fact of the conversation's document (or
    of ``document``, which holds it)."""
    doc = conversation.document if document is None else document
    key = conversation.facts[fact].key
    return render(
        tokenizer,
        [{"role": "user", "content": f"{INTRO}\n\n{doc}\n\n" + QUESTION.format(key=key)}],
        ANSWER_PREFIX.format(key=key),
    )


@dataclass
class TurnResult:
    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int  # served from vLLM's prefix cache
    ttft_s: float  # first token - queued, engine core timestamps
    wall_s: float  # submitted -> finished, this process's clock
    blocks_after_prefill: int | None
    text: str
    correct: bool


@dataclass
class RunResult:
    turns: list[TurnResult] = field(default_factory=list)
    wall_s: float = 0.0
    peak_running: int = 0
    preemptions: int = 0
    # KV blocks of the pool (null block excluded) and the time-weighted mean
    # of the free ones: prefix-cache entries live only in free blocks, so
    # this bounds how much of the conversations' prefixes can stay cached.
    pool_blocks: int = 0
    free_blocks_mean: float = 0.0

    def later(self) -> list[TurnResult]:
        return [t for t in self.turns if t.turn > 0]


def run_conversations(
    llm,
    tokenizer,
    conversations: list[Conversation],
    turns: int,
    max_tokens: int,
    progress: Any = None,
    request_kwargs: dict | None = None,
) -> RunResult:
    """Every conversation at once; each next turn submitted when the
    previous one finished (greedy decoding)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    sched = scheduler(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **(request_kwargs or {}))
    answers: list[list[str]] = [[] for _ in conversations]
    submitted: dict[str, tuple[int, int, int, float]] = {}
    result = RunResult()
    preempt = sched._preempt_request

    def counting_preempt(*args, **kwargs):
        result.preemptions += 1
        return preempt(*args, **kwargs)

    sched._preempt_request = counting_preempt

    def submit(c: int, t: int) -> None:
        ids = prompt_ids(tokenizer, conversations[c], t, answers[c])
        rid = f"c{c}t{t}"
        submitted[rid] = (c, t, len(ids), time.perf_counter())
        engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), params)

    pool = sched.kv_cache_manager.block_pool
    result.pool_blocks = pool.num_gpu_blocks - 1
    free_block_seconds = 0.0
    start = time.perf_counter()
    for c in range(len(conversations)):
        submit(c, 0)
    blocks: dict[str, int] = {}
    try:
        while engine.has_unfinished_requests():
            step_start = time.perf_counter()
            outputs = engine.step()
            free_block_seconds += pool.get_num_free_blocks() * (time.perf_counter() - step_start)
            result.peak_running = max(result.peak_running, len(sched.running))
            for r in sched.running:
                rid = external_id(r)
                if rid not in blocks and r.num_computed_tokens > r.num_prompt_tokens:
                    blocks[rid] = held_blocks(sched, r.request_id)
            for out in outputs:
                if not out.finished:
                    continue
                c, t, n, sent = submitted[out.request_id]
                text = out.outputs[0].text
                m = out.metrics
                result.turns.append(
                    TurnResult(
                        c,
                        t,
                        n,
                        out.num_cached_tokens or 0,
                        m.first_token_ts - m.queued_ts if m is not None else float("nan"),
                        time.perf_counter() - sent,
                        blocks.get(out.request_id),
                        text,
                        conversations[c].correct(t, text),
                    )
                )
                answers[c].append(text)
                if progress is not None:
                    progress.update(1)
                if t + 1 < turns:
                    submit(c, t + 1)
    finally:
        sched._preempt_request = preempt
    result.wall_s = time.perf_counter() - start
    result.free_blocks_mean = free_block_seconds / result.wall_s
    result.turns.sort(key=lambda r: (r.conversation, r.turn))
    return result
