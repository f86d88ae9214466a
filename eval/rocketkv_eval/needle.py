"""Needle-in-a-haystack prompt builder (pure Python, no vLLM import).

The haystack is deterministic filler made of varied everyday sentences, so the
needle is not trivially the only "different" line and long-range retrieval is
actually exercised. The needle sits at a sentence boundary at a depth fraction.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_PLACES = [
    "market",
    "library",
    "park",
    "bakery",
    "harbor",
    "museum",
    "garden",
    "station",
    "school",
    "village square",
    "river bank",
    "old mill",
    "post office",
    "town hall",
    "train platform",
    "cafe",
]
_THINGS = [
    "a basket of apples",
    "an old map",
    "a wool scarf",
    "fresh bread",
    "a blue umbrella",
    "a pair of boots",
    "some garden tools",
    "a book about birds",
    "a jar of honey",
    "a wooden chair",
    "a kite",
    "a bag of flour",
    "a small lamp",
    "a bunch of tulips",
]
_VERBS = [
    "bought",
    "carried",
    "found",
    "repaired",
    "painted",
    "borrowed",
    "cleaned",
    "sold",
    "wrapped",
    "delivered",
]
_TIMES = [
    "in the morning",
    "after lunch",
    "on Sunday",
    "before dinner",
    "late in the evening",
    "during the holidays",
    "every spring",
    "on a rainy afternoon",
    "at dawn",
    "last autumn",
]
_ADJS = [
    "quiet",
    "busy",
    "sunny",
    "narrow",
    "crowded",
    "peaceful",
    "windy",
    "colorful",
    "tidy",
    "noisy",
    "cozy",
    "wide",
]
_ANIMALS = [
    "cats",
    "ducks",
    "sparrows",
    "dogs",
    "goats",
    "pigeons",
    "horses",
    "rabbits",
    "geese",
    "squirrels",
]
_FOODS = [
    "soup",
    "rice",
    "pasta",
    "salad",
    "pancakes",
    "porridge",
    "fish",
    "cheese",
    "berries",
    "tea",
]
_WEATHER = ["cold", "warm", "cloudy", "dry", "foggy", "mild", "stormy", "hot"]
# No personal names: with names in the filler the 135M model often answered
# with a name instead of the passphrase (dense 8/12 -> 10/12 without them).
_TEMPLATES = [
    "The {place} was {adj} {time}.",
    "Many people like to eat {food} when the weather is {weather}.",
    "Near the {place}, a group of {animals} rested in the shade.",
    "The road to the {place} is {adj} and lined with trees.",
    "Nobody expected the {place} to be so {adj} {time}.",
    "Someone {verb} {thing} at the {place} {time}.",
    "In the {weather} season the {animals} gather near the {place}.",
    "A shop near the {place} sells {thing} and {food}.",
    "The children {verb} {thing} near the {place} {time}.",
    "The {place} is usually {adj} when the weather is {weather}.",
]

# Needle secret = two different words joined by "-" (e.g. "amber-wolf").
# Dense SmolLM2-135M retrieved word-word secrets more reliably than
# word-number ones (42/48 vs 56/72 over 1k-7k tokens): with digits it often
# dropped the word or answered a stock "1234567890". The words are single
# tokens for its tokenizer both with and without a leading space (it often
# answers in quotes, and mangles words that split there, e.g. "onyx" -> "yx")
# and stay clear of the filler's vocabulary (seasons, weather, places).
_SECRET_WORDS = [
    "amber",
    "orange",
    "purple",
    "ocean",
    "forest",
    "wolf",
    "lion",
    "music",
    "window",
    "paper",
    "table",
]
NEEDLE_TEMPLATE = "The secret passphrase is {secret}."
INTRO = "Below is a long text. Somewhere in it there is a secret passphrase. Read it carefully."
QUESTION = "What is the secret passphrase? Answer with the passphrase only."


@dataclass
class NeedleCase:
    prompt: str  # final text after the chat template (generation prompt added)
    num_tokens: int  # token count of ``prompt`` per the tokenizer
    answer: str  # the secret passphrase, e.g. "amber-wolf"
    depth: float  # needle position as a fraction of the haystack
    token_ids: list[int] = field(default_factory=list, repr=False)


def _make_secret(rng: random.Random) -> str:
    return "-".join(rng.sample(_SECRET_WORDS, 2))


def _sentence(rng: random.Random) -> str:
    return rng.choice(_TEMPLATES).format(
        verb=rng.choice(_VERBS),
        thing=rng.choice(_THINGS),
        place=rng.choice(_PLACES),
        time=rng.choice(_TIMES),
        adj=rng.choice(_ADJS),
        animals=rng.choice(_ANIMALS),
        food=rng.choice(_FOODS),
        weather=rng.choice(_WEATHER),
    )


def _haystack(filler: Sequence[str], n: int, needle: str, depth: float) -> str:
    k = round(depth * n)  # needle index: a sentence boundary by construction

    def paras(sents: Sequence[str]) -> list[str]:
        # Short paragraphs read more like a document than one wall of text.
        return [" ".join(sents[i : i + 6]) for i in range(0, len(sents), 6)]

    # The needle gets its own paragraph: mid-paragraph needles were retrieved
    # noticeably less reliably by the 135M model under dense attention.
    return "\n\n".join([*paras(filler[:k]), needle, *paras(filler[k:n])])


def _render(tokenizer: Any, haystack: str) -> tuple[str, list[int]]:
    user = f"{INTRO}\n\n{haystack}\n\n{QUESTION}"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
    )
    # The template already holds the special tokens; don't add a second BOS.
    return prompt, list(tokenizer.encode(prompt, add_special_tokens=False))


def build_needle_prompt(
    tokenizer: Any, target_tokens: int, depth: float, seed: int = 0
) -> NeedleCase:
    """Chat prompt of about ``target_tokens`` tokens (within ~2%) with a needle.

    ``tokenizer`` is a Hugging Face tokenizer with a chat template (vLLM's
    ``LLM.get_tokenizer()`` works too). Same seed -> same secret and filler.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    secret = _make_secret(rng)
    needle = NEEDLE_TEMPLATE.format(secret=secret)

    base_len = len(_render(tokenizer, needle)[1])  # prompt with no filler
    if target_tokens < base_len:
        raise ValueError(
            f"target_tokens={target_tokens} is below the {base_len}-token minimum prompt"
        )

    filler: list[str] = []
    lens: list[int] = []  # cumulative token estimate per sentence
    budget = target_tokens - base_len
    while not lens or lens[-1] < budget * 1.1 + 50:
        filler.append(_sentence(rng))
        n_tok = len(tokenizer.encode(" " + filler[-1], add_special_tokens=False))
        lens.append((lens[-1] if lens else 0) + n_tok)

    # Start from the additive estimate, then correct on the real count
    # (tokens merge across sentence/paragraph joins, so it is not exact).
    n = max(0, sum(1 for c in lens if c <= budget))
    tol = max(1, int(0.02 * target_tokens))
    best: tuple[int, str, list[int]] | None = None
    for _ in range(8):
        prompt, ids = _render(tokenizer, _haystack(filler, n, needle, depth))
        err = len(ids) - target_tokens
        if best is None or abs(err) < abs(best[0]):
            best = (err, prompt, ids)
        if abs(err) <= tol // 2:
            break
        avg = max(1.0, lens[-1] / len(lens))
        step = int(round(err / avg)) or (1 if err > 0 else -1)
        n = min(len(filler), max(0, n - step))
        while n >= len(filler) - 1:  # ran out of pre-generated filler
            filler.append(_sentence(rng))
            lens.append(lens[-1] + int(avg))
    assert best is not None
    _, prompt, ids = best
    return NeedleCase(prompt=prompt, num_tokens=len(ids), answer=secret, depth=depth, token_ids=ids)


def is_correct(answer_text: str, case: NeedleCase) -> bool:
    return case.answer.lower() in answer_text.lower()
