"""The budget split: the numbers an engine and its requests run with, from
one function (``budget.kernel_budget``) that the settings, the plan and the
CUDA-graph shapes only call."""

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest

from rocketkv_vllm.backend.graphs import GraphGuard, shape_for
from rocketkv_vllm.budget import (
    KernelBudget,
    kernel_budget,
    prompt_budget_floor,
    split_token_budget,
)
from rocketkv_vllm.config import (
    RocketKVConfigError,
    list_presets,
    parse_config,
    resolve_settings,
)
from rocketkv_vllm.plan import plan_request, view_pages

# The arithmetic as it stood in budget.py, config.py, plan.py and graphs.py
# at 2cf03ed, before it became one function: the oracle of the grid below,
# with one deliberate change since (issue 40): under a token budget, top-r is
# the head dim instead of the split's channel cut in 16-channel lanes.


def _old_split(token_budget, n, max_new, head_dim):
    total = n + max_new
    c = max(1.0, total / token_budget)
    alpha = min(0.2 + 0.06 * math.log2(c), 0.8)
    cap = max(int(total / c**alpha), min(2 * max_new, total))
    c2 = max(1.0, cap / token_budget)
    page_size = math.ceil(math.sqrt(c2))
    if page_size > c2:
        page_size = 1
    topr = min(max(round(head_dim * page_size / c2), 1), head_dim)
    return cap - max_new, token_budget // 2, page_size, topr


def _old_pow2_at_least(x):
    return 1 << max(0, math.ceil(math.log2(max(1.0, x))))


def _old_page_size(raw, block_size, head_dim, max_model_len):
    if raw.get("page_size") is not None:
        return raw["page_size"]
    if raw.get("token_budget") is not None:
        max_new = raw.get("max_new_tokens", 256)
        n = max(1, max_model_len - max_new)
        split = _old_split(raw["token_budget"], n, max_new, head_dim)
        return min(block_size, _old_pow2_at_least(split[2]))
    return min(4, block_size)


def _old_pages_selected(topk, page_size):
    return max(int(topk) // page_size, 1)


def _topk_tokens(token_budget):
    """Top-k under a token budget: half of it, but at least 128 tokens or the
    whole budget (issue 40: 64 tokens lost needles on SmolLM2 at 6k)."""
    return token_budget // 2 if token_budget >= 256 else min(token_budget, 128)


def _old_numbers(settings, n):
    """(prompt_budget, topk, topr) of ``plan_request`` for an engine's own budget."""
    s = settings
    if s.token_budget is None:
        return s.prompt_budget, s.topk, s.topr
    pb, topk, _, _ = _old_split(s.token_budget, n, s.max_new_tokens, s.head_dim)
    prompt_budget = max(pb, s.window_size + s.block_size)
    topk = _old_pages_selected(_topk_tokens(s.token_budget), s.page_size) * s.page_size
    return prompt_budget, topk, s.head_dim


def _old_max_select(settings, max_model_len):
    s = settings
    max_pages = -(-max_model_len // s.page_size) + 1
    if s.token_budget is None:
        topk = s.topk
    else:
        topk = _old_pages_selected(_topk_tokens(s.token_budget), s.page_size) * s.page_size
    return min(_old_pages_selected(topk, s.page_size), max_pages)


GRID_RAW = [
    {"token_budget": b, "max_new_tokens": m, **extra}
    for b, m, extra in itertools.product(
        (16, 17, 100, 256, 300, 1000, 1024, 2048, 4096, 65536),
        (1, 64, 256, 1000),
        ({}, {"page_size": 1}, {"page_size": 8}, {"window_size": 100}, {"evict": False}),
    )
] + [
    {"prompt_budget": 2048, "page_size": 4, "topk": 256, "topr": None},
    {"prompt_budget": 100, "topk": 64, "topr": 48},
    {"prompt_budget": 512, "page_size": 16, "topk": 16, "evict": False},
]


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_numbers_match_the_formulas_they_replaced(head_dim):
    """Page size, prompt budget (with its floor), top-k in whole pages, top-r
    (the head dim), the graph's selection: the same as before, on a grid
    of budgets, generation lengths, block sizes, model lengths, prompts."""
    lengths = (0, 1, 15, 16, 17, 100, 257, 1000, 4000, 6000, 32000, 131072)
    for raw, block_size, max_model_len in itertools.product(
        GRID_RAW, (16, 32), (1024, 8192, 131072)
    ):
        try:
            settings = resolve_settings(parse_config(raw), block_size, head_dim, max_model_len)
        except RocketKVConfigError:
            continue
        assert settings.page_size == _old_page_size(raw, block_size, head_dim, max_model_len)
        assert settings.topr == (head_dim if raw.get("topr") is None else raw["topr"])
        shape = shape_for(settings, max_model_len, 8)
        assert shape.max_select == _old_max_select(settings, max_model_len), raw
        for n in lengths:
            plan = plan_request(settings, n)
            got = (plan.prompt_budget, plan.topk, plan.topr)
            want = _old_numbers(settings, n)
            if not settings.evict:
                want = (n,) + want[1:]  # Stage 2 only: every prompt token kept
            assert got == want, (raw, block_size, max_model_len, n)


def test_request_budgets_match_the_formulas_they_replaced():
    """A request's own budget: its plan, and whether a FULL graph takes it."""
    for head_dim, page_size in itertools.product((64, 128, 256), (1, 2, 4, 8, 16)):
        settings = resolve_settings(parse_config({"page_size": page_size}), 16, head_dim, 8192)
        shape = shape_for(settings, 8192, 8)
        guard = GraphGuard(shape, page_size)
        for b in (16, 17, 31, 32, 100, 256, 1000, 1024, 4096, 100000):
            for n in (100, 3000, 100000):
                plan = plan_request(settings, n, b)
                want = _old_numbers(type(settings)(**{**settings.as_dict(), "token_budget": b}), n)
                assert (plan.prompt_budget, plan.topk, plan.topr) == want
            old_select = _old_pages_selected(_topk_tokens(b), page_size)
            assert guard.needs_eager(np.zeros(1, bool), [b]) == (old_select > shape.max_select)


# What every preset runs with at block size 16, pinned: (preset, max_model_len)
# -> ((page size, the graph's selected pages, top-k), prompt budgets of prompts
# of 1000, 6000 and max_model_len - 256 tokens, their top-r for each head dim
# of HEAD_DIMS: the head dim itself, under a token budget too since issue 40).
# Page size, top-k and prompt budget do not depend on the head dim.
HEAD_DIMS = (64, 80, 96, 128, 256)
PINNED = {
    ("budget-1024", 8192): (
        (2, 256, 512),
        (945, 3024, 3461),
        ((64, 64, 64), (80, 80, 80), (96, 96, 96), (128, 128, 128), (256, 256, 256)),
    ),
    ("budget-1024", 131072): (
        (4, 128, 512),
        (945, 3024, 6216),
        ((64, 64, 64), (80, 80, 80), (96, 96, 96), (128, 128, 128), (256, 256, 256)),
    ),
    ("budget-2048", 8192): (
        (2, 512, 1024),
        (1000, 4235, 5000),
        ((64, 64, 64), (80, 80, 80), (96, 96, 96), (128, 128, 128), (256, 256, 256)),
    ),
    ("budget-2048", 131072): (
        (4, 256, 1024),
        (1000, 4235, 12509),
        ((64, 64, 64), (80, 80, 80), (96, 96, 96), (128, 128, 128), (256, 256, 256)),
    ),
    ("budget-256", 8192): (
        (4, 32, 128),
        (478, 1107, 1192),
        ((64, 64, 64), (80, 80, 80), (96, 96, 96), (128, 128, 128), (256, 256, 256)),
    ),
    ("budget-256", 131072): (
        (4, 32, 128),
        (478, 1107, 1040),
        ((64, 64, 64), (80, 80, 80), (96, 96, 96), (128, 128, 128), (256, 256, 256)),
    ),
    ("trtllm", 8192): (
        (4, 64, 256),
        (2048, 2048, 2048),
        ((64, 64, 64), (80, 80, 80), (96, 96, 96), (128, 128, 128), (256, 256, 256)),
    ),
    ("trtllm", 131072): (
        (4, 64, 256),
        (2048, 2048, 2048),
        ((64, 64, 64), (80, 80, 80), (96, 96, 96), (128, 128, 128), (256, 256, 256)),
    ),
}


def _engine(preset, head_dim, max_model_len):
    return resolve_settings(parse_config({"preset": preset}), 16, head_dim, max_model_len)


def test_every_preset_is_pinned():
    assert {p for p, _ in PINNED} == set(list_presets())


@pytest.mark.parametrize("key", sorted(PINNED))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_preset_numbers_are_pinned(key, head_dim):
    preset, max_model_len = key
    (page_size, max_select, topk), prompt_budgets, toprs = PINNED[key]
    toprs = dict(zip(HEAD_DIMS, toprs))
    settings = _engine(preset, head_dim, max_model_len)
    assert settings.page_size == page_size
    assert shape_for(settings, max_model_len, 8).max_select == max_select
    for n, prompt_budget, topr in zip(
        (1000, 6000, max_model_len - 256), prompt_budgets, toprs[head_dim]
    ):
        want = KernelBudget(page_size, prompt_budget, topk, topr)
        assert kernel_budget(settings, n, head_dim=head_dim, block_size=16) == want
        plan = plan_request(settings, n)
        assert (plan.prompt_budget, plan.topk, plan.topr) == (prompt_budget, topk, topr)


@pytest.mark.parametrize("preset", list_presets())
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_graph_shape_and_plans_agree(preset, head_dim):
    """The FULL-graph launch shape holds every plan of the engine: its view
    pages, and exactly the pages each compressed plan selects; a request's
    own budget needs an eager step exactly when its plan selects more."""
    for max_model_len in (4096, 8192, 32768, 131072):
        settings = _engine(preset, head_dim, max_model_len)
        ps = settings.page_size
        shape = shape_for(settings, max_model_len, 8)
        guard = GraphGuard(shape, ps)
        decoding = np.zeros(1, bool)
        lengths = sorted({1, 100, 1000, 3000, 6000, max_model_len // 2, max_model_len - 1})
        selected = set()
        for n in lengths:
            plan = plan_request(settings, n)
            assert view_pages(plan.num_compact, plan.tail_start, max_model_len, ps) <= (
                shape.max_pages
            )
            if plan.compress:
                selected.add(plan.pages_selected(ps))
            for b in (16, 100, 256, 1024, 2048, 4096, 65536):
                own = plan_request(settings, n, b)
                assert guard.needs_eager(decoding, [b]) == (
                    own.pages_selected(ps) > shape.max_select
                )
        assert selected == {shape.max_select}


def test_topk_and_page_size_do_not_depend_on_the_prompt():
    """So one graph shape serves every prompt, and the engine's page size
    (asked for its longest prompt) serves each request."""
    for preset, head_dim in itertools.product(list_presets(), HEAD_DIMS):
        settings = _engine(preset, head_dim, 32768)
        cfg = parse_config({"preset": preset})
        cfg = replace(cfg, topr=cfg.topr or head_dim)
        budgets = [
            kernel_budget(settings, n, head_dim=head_dim, block_size=16)
            for n in (0, 1, 50, 1000, 32768, 1 << 20)
        ]
        assert len({(b.page_size, b.topk) for b in budgets}) == 1
        engine = kernel_budget(cfg, 32768 - 256, head_dim=head_dim, block_size=16)
        assert engine.page_size == settings.page_size


def test_prompt_budget_floor_and_topr_is_the_head_dim():
    settings = _engine("budget-256", 128, 8192)
    floor = prompt_budget_floor(settings.window_size, settings.block_size)
    assert floor == settings.min_prompt_budget == 48
    # A prompt this short would keep a single token by the split alone.
    assert split_token_budget(256, 1, 256, 128).prompt_budget == 1
    assert kernel_budget(settings, 1, head_dim=128, block_size=16).prompt_budget == floor
    for n in range(0, 200000, 997):
        topr = kernel_budget(settings, n, head_dim=128, block_size=16).topr
        assert topr == 128  # every channel (issue 40), not SPEC's cut
    assert split_token_budget(256, 8192, 16, 256).topr < 256  # the cut SPEC's split would make


def test_topk_is_half_the_budget_but_at_least_128_tokens():
    """Issue 40: top-k 64 (half of B = 128) found 10 of 32 needles on SmolLM2
    at 6k where 128 found dense's 15. The floor never exceeds B itself, and
    the prompt budget (the memory Stage 1 frees) does not move with it."""
    want = {16: 16, 64: 64, 100: 100, 128: 128, 200: 128, 256: 128, 512: 256, 2048: 1024}
    for budget, topk in want.items():
        knobs = parse_config({"token_budget": budget, "max_new_tokens": 16})
        kb = kernel_budget(knobs, 6144, head_dim=64, block_size=16)
        assert kb.topk == topk // kb.page_size * kb.page_size, budget
        assert kb.prompt_budget == max(
            split_token_budget(budget, 6144, 16, 64).prompt_budget,
            prompt_budget_floor(knobs.window_size, 16),
        )
