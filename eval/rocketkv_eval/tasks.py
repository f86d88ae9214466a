"""Synthetic long-context tasks in the style of RULER, and their scoring.

Pure Python (a Hugging Face tokenizer is the only thing passed in; no vLLM
import). Every sample is seeded and built offline, sized with the model's own
tokenizer to an exact number of prompt tokens.

Tasks (the facts follow RULER's synthetic tasks; the code is ours):

- ``niah_single``: one needle "One of the special magic numbers for <key> is:
  <7-digit number>." in a haystack; the needle depth runs 0..100% over the
  samples of a cell (sample i of n sits at depth i / (n - 1)).
- ``niah_multikey``: the asked needle plus 3 distractor needles with other
  keys (and other numbers) at random depths.
- ``niah_multivalue``: 4 needles with the same key and different numbers; all
  4 numbers must be returned.
- ``niah_multiquery``: 4 needles with different keys; all 4 keys are asked and
  all 4 numbers must be returned.
- ``vt``: variable tracking. One chain ``VAR ABCDE = 12345.``, ``VAR FGHIJ =
  ABCDE.``, ... (4 hops, 5 names) spread through the haystack; the answer is
  every name that holds the value.

Prompts follow RULER: an instruction, the haystack, the question, then an
answer prefix that the model continues ("The special magic number for <key>
mentioned in the provided text is"). With a chat template (default when the
tokenizer has one) the answer prefix opens the assistant turn.

Haystacks: ``noise`` (RULER's repeated "The grass is green. The sky is
blue. ..." block) or ``text`` (the varied everyday sentences of
``rocketkv_eval.needle``). Defaults per task are in ``DEFAULT_HAYSTACK``;
they were chosen so that dense SmolLM2-135M-Instruct scores well (it is tiny;
the wording and haystack matter a lot more than for an 8B model).

Scoring is RULER's ``string_match_all``: per sample, 100 x the fraction of
references found (case-insensitive substring) in the output.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rocketkv_eval.needle import _sentence as _text_sentence

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt")

# Tokens to generate per task (SmolLM2's tokenizer spells digits one by one:
# a 7-digit number is 8 tokens with its leading space).
DEFAULT_MAX_TOKENS = {
    "niah_single": 16,
    "niah_multikey": 16,
    "niah_multivalue": 48,
    "niah_multiquery": 48,
    "vt": 32,
}
DEFAULT_HAYSTACK = {
    "niah_single": "noise",
    "niah_multikey": "text",
    "niah_multivalue": "noise",
    "niah_multiquery": "noise",
    "vt": "noise",
}
HAYSTACKS = ("noise", "text")

_NOISE = [
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
]

# Key words: adjective-noun pairs, clear of the filler vocabulary.
KEY_ADJS = [
    "brave",
    "silent",
    "golden",
    "rapid",
    "gentle",
    "clever",
    "hollow",
    "frozen",
    "lucky",
    "humble",
    "fierce",
    "silver",
    "hidden",
    "proud",
    "shiny",
    "wild",
    "calm",
    "bold",
    "tiny",
    "giant",
]
KEY_NOUNS = [
    "falcon",
    "dragon",
    "tiger",
    "rocket",
    "castle",
    "pirate",
    "wizard",
    "anchor",
    "compass",
    "lantern",
    "violin",
    "dolphin",
    "panther",
    "engine",
    "glacier",
    "meteor",
    "cactus",
    "walrus",
    "beacon",
    "puzzle",
]
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

NIAH_INTRO = (
    "Some special magic numbers are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the numbers afterwards."
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text."


@dataclass
class Sample:
    task: str
    length: int  # requested prompt length in tokens (== len(token_ids))
    index: int  # sample index within its (task, length) cell
    prompt: str  # final text (chat template and answer prefix applied)
    references: list[str]  # every one must appear in the output
    depth: float  # position of the (first) asked needle, 0..1 of the haystack
    max_tokens: int  # default generation length for the task
    token_ids: list[int] = field(default_factory=list, repr=False)


# ---------------------------------------------------------------- scoring
def score(output: str, references: Sequence[str]) -> float:
    """RULER string_match_all: 100 x fraction of references found."""
    if not references:
        raise ValueError("a sample needs at least one reference")
    out = output.lower()
    return 100.0 * sum(r.lower() in out for r in references) / len(references)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    m = sum(values) / len(values)
    return m, (sum((v - m) ** 2 for v in values) / len(values)) ** 0.5


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------- building
def _rng(seed: int, task: str, length: int, index: int) -> random.Random:
    return random.Random(f"{seed}/{task}/{length}/{index}")


def _key(rng: random.Random, used: set[str]) -> str:
    while True:
        k = f"{rng.choice(KEY_ADJS)}-{rng.choice(KEY_NOUNS)}"
        if k not in used:
            used.add(k)
            return k


def _number(rng: random.Random, digits: int, used: set[str]) -> str:
    while True:
        v = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        if v not in used:
            used.add(v)
            return v


def _var(rng: random.Random, used: set[str]) -> str:
    while True:
        v = "".join(rng.choice(_LETTERS) for _ in range(5))
        if v not in used:
            used.add(v)
            return v


class _Filler:
    """An endless, seeded stream of filler sentences."""

    def __init__(self, kind: str, rng: random.Random):
        if kind not in HAYSTACKS:
            raise ValueError(f"haystack must be one of {HAYSTACKS}, got {kind!r}")
        self.kind, self.rng, self.items = kind, rng, []

    def get(self, n: int) -> list[str]:
        while len(self.items) < n:
            if self.kind == "noise":
                self.items.append(_NOISE[len(self.items) % len(_NOISE)])
            else:
                self.items.append(_text_sentence(self.rng))
        return self.items[:n]


def _haystack(units: list[str], needles: list[tuple[float, str]], pad: str, pad_front: bool) -> str:
    """Filler units with each needle at round(depth * len(units)) units in.

    Needles are paragraphs of their own; filler comes in paragraphs of 6
    sentences (``noise`` all in one run, as RULER writes it... but split at
    the needles). ``pad`` (a partial sentence) goes at the front or back.
    """
    k = len(units)
    at: dict[int, list[str]] = {}
    for depth, text in needles:
        at.setdefault(round(depth * k), []).append(text)
    paras: list[str] = []
    run: list[str] = []

    def flush():
        for i in range(0, len(run), 6):
            paras.append(" ".join(run[i : i + 6]))
        run.clear()

    for i in range(k + 1):
        if i in at:
            flush()
            paras.extend(at[i])
        if i < k:
            run.append(units[i])
    flush()
    if pad:
        if pad_front:
            paras.insert(0, pad)
        else:
            paras.append(pad)
    return "\n\n".join(paras)


def _fit(
    tokenizer: Any,
    render: Callable[[str], str],
    filler: _Filler,
    needles: list[tuple[float, str]],
    target: int,
) -> tuple[str, list[int]]:
    """Exactly ``target`` tokens: most whole filler units, then word padding."""

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    mean_depth = sum(d for d, _ in needles) / len(needles)
    pad_front = mean_depth > 0.5  # pad on the side away from the needles

    def build(k: int, pad: str) -> tuple[str, list[int]]:
        text = render(_haystack(filler.get(k), needles, pad, pad_front))
        return text, encode(text)

    base = len(build(0, "")[1])
    if base > target:
        raise ValueError(f"length {target} is below this task's {base}-token minimum")
    per_unit = max(1.0, len(build(8, "")[1]) - base) / 8
    lo, hi = 0, int((target - base) / per_unit * 1.5) + 16
    while len(build(hi, "")[1]) <= target:
        hi *= 2
    while hi - lo > 1:  # largest k with length <= target
        mid = (lo + hi) // 2
        if len(build(mid, "")[1]) <= target:
            lo = mid
        else:
            hi = mid
    for k in range(lo, max(-1, lo - 4), -1):
        words = " ".join(filler.get(k + 8)[k:]).split()
        prev = ""
        for j in range(len(words) + 1):
            pad = " ".join(words[:j])
            text, ids = build(k, pad)
            if len(ids) == target:
                return text, ids
            if len(ids) > target:
                for extra in (".", ",", " a", " the", "-"):
                    text, ids = build(k, prev + extra if prev else extra.strip())
                    if len(ids) == target:
                        return text, ids
                break
            prev = pad
    raise RuntimeError(f"could not size a prompt to exactly {target} tokens")


def _renderer(
    tokenizer: Any, intro: str, question: str, answer_prefix: str, chat: bool
) -> Callable[[str], str]:
    def render(haystack: str) -> str:
        user = f"{intro}\n\n{haystack}\n\n{question}"
        if chat:
            head = tokenizer.apply_chat_template(
                [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
            )
            return head + answer_prefix
        return f"{user}\n{answer_prefix}"

    return render


def _join(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def make_sample(
    task: str,
    tokenizer: Any,
    length: int,
    index: int = 0,
    num_samples: int = 1,
    seed: int = 0,
    haystack: str | None = None,
    chat: bool | None = None,
) -> Sample:
    """One sample of ``task`` with a prompt of exactly ``length`` tokens."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: choose from {TASKS}")
    rng = _rng(seed, task, length, index)
    kind = haystack or DEFAULT_HAYSTACK[task]
    filler = _Filler(kind, random.Random(rng.random()))
    if chat is None:
        chat = getattr(tokenizer, "chat_template", None) is not None
    used: set[str] = set()

    if task == "vt":
        value = _number(rng, 5, used)
        names = [_var(rng, used) for _ in range(5)]
        stmts = [f"VAR {names[0]} = {value}."] + [
            f"VAR {names[i]} = {names[i - 1]}." for i in range(1, 5)
        ]
        depths = sorted(rng.uniform(0.0, 1.0) for _ in stmts)
        needles = list(zip(depths, stmts))
        question = (
            f"Question: Find all variables that are assigned the value {value} in the text above."
        )
        # RULER's answer prefix ends "they are: "; SmolLM2-135M then wrote filler
        # (0/6 at 2k tokens). Opening the list with "VAR" (no trailing space,
        # which BPE models rarely continue from) made it list names (40%).
        prefix = (
            f"Answer: According to the chain(s) of variable assignment in the "
            f"text above, 5 variables are assigned the value {value}, they are: VAR"
        )
        render = _renderer(tokenizer, VT_INTRO, question, prefix, chat)
        refs, depth = names, depths[0]
    else:
        if task == "niah_single":
            depth = index / (num_samples - 1) if num_samples > 1 else 0.5
            keys = [_key(rng, used)]
            values = [_number(rng, 7, used)]
            needles = [(depth, NEEDLE.format(key=keys[0], value=values[0]))]
            asked, refs = keys, values
        elif task == "niah_multikey":
            keys = [_key(rng, used) for _ in range(4)]
            values = [_number(rng, 7, used) for _ in range(4)]
            depths = [rng.uniform(0.0, 1.0) for _ in range(4)]
            needles = [(d, NEEDLE.format(key=k, value=v)) for d, k, v in zip(depths, keys, values)]
            asked, refs = keys[:1], values[:1]
        elif task == "niah_multivalue":
            keys = [_key(rng, used)]
            values = [_number(rng, 7, used) for _ in range(4)]
            depths = [rng.uniform(0.0, 1.0) for _ in range(4)]
            needles = [(d, NEEDLE.format(key=keys[0], value=v)) for d, v in zip(depths, values)]
            asked, refs = keys, values
        else:  # niah_multiquery
            keys = [_key(rng, used) for _ in range(4)]
            values = [_number(rng, 7, used) for _ in range(4)]
            depths = [rng.uniform(0.0, 1.0) for _ in range(4)]
            needles = [(d, NEEDLE.format(key=k, value=v)) for d, k, v in zip(depths, keys, values)]
            asked, refs = keys, values
        depth = needles[0][0]
        rng.shuffle(needles)  # needle order in the list is irrelevant; keep it seeded
        many = task in ("niah_multivalue", "niah_multiquery")
        noun = "numbers" if many else "number"
        if many:
            question = (
                f"What are all the special magic numbers for {_join(asked)} "
                f"mentioned in the provided text?"
            )
        else:
            question = (
                f"What is the special magic number for {asked[0]} mentioned in the provided text?"
            )
        prefix = (
            f"The special magic {noun} for {_join(asked)} mentioned in the "
            f"provided text {'are' if many else 'is'}"
        )
        # SmolLM2-135M, dense, 2k tokens, 6 samples: with RULER's bare "are" it
        # wrote filler more often than numbers (multivalue 13%, multiquery 25%);
        # starting the list lifts both (71% with ":\n1.", 63% with ":\n<key>:").
        if task == "niah_multivalue":
            prefix += ":\n1."
        elif task == "niah_multiquery":
            prefix += f":\n{asked[0]}:"
        render = _renderer(tokenizer, NIAH_INTRO, question, prefix, chat)

    prompt, ids = _fit(tokenizer, render, filler, needles, length)
    return Sample(
        task=task,
        length=length,
        index=index,
        prompt=prompt,
        references=list(refs),
        depth=float(depth),
        max_tokens=DEFAULT_MAX_TOKENS[task],
        token_ids=ids,
    )


def make_samples(
    task: str,
    tokenizer: Any,
    length: int,
    num_samples: int,
    seed: int = 0,
    haystack: str | None = None,
    chat: bool | None = None,
) -> list[Sample]:
    return [
        make_sample(task, tokenizer, length, i, num_samples, seed, haystack, chat)
        for i in range(num_samples)
    ]
