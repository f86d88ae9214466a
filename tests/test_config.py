"""Settings: validation messages, presets, the SPEC budget split, request plans."""

import math

import pytest

from rocketkv_vllm.config import (
    RocketKVConfigError,
    list_presets,
    parse_config,
    plan_request,
    resolve_settings,
    split_token_budget,
)


@pytest.mark.parametrize("raw,field", [
    ({"window_size": 0}, "rocketkv.window_size"),
    ({"kernel_size": 64}, "rocketkv.kernel_size"),
    ({"page_size": 3}, "rocketkv.page_size"),
    ({"topk": "many"}, "rocketkv.topk"),
    ({"token_budget": 8}, "rocketkv.token_budget"),
    ({"kernel": "cuda"}, "rocketkv.kernel"),
    ({"preset": "no-such-preset"}, "rocketkv.preset"),
    ({"force_current_page": "yes"}, "rocketkv.force_current_page"),
    ({"prompt_budget": True}, "rocketkv.prompt_budget"),
])
def test_bad_values_name_the_field_and_range(raw, field):
    with pytest.raises(RocketKVConfigError) as err:
        parse_config(raw)
    assert field in str(err.value) and "allowed" in str(err.value)


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(RocketKVConfigError, match="unknown rocketkv setting.*budget"):
        parse_config({"budget": 256})


def test_range_checks_that_need_the_engine():
    with pytest.raises(RocketKVConfigError, match="rocketkv.prompt_budget"):
        resolve_settings(parse_config({"prompt_budget": 40}), 16, 64, 8192)
    with pytest.raises(RocketKVConfigError, match="rocketkv.topr.*64"):
        resolve_settings(parse_config({"topr": 65}), 16, 64, 8192)
    with pytest.raises(RocketKVConfigError, match="rocketkv.page_size"):
        resolve_settings(parse_config({"page_size": 32}), 16, 64, 8192)


def test_presets_load_and_user_values_override():
    assert {"budget-256", "budget-1024", "budget-2048", "trtllm"} <= set(list_presets())
    trt = parse_config({"preset": "trtllm"})
    assert (trt.prompt_budget, trt.window_size, trt.kernel_size, trt.page_size,
            trt.topk, trt.topr) == (2048, 32, 63, 4, 256, None)
    cfg = parse_config({"preset": "budget-1024", "window_size": 16})
    assert cfg.token_budget == 1024 and cfg.window_size == 16
    # An explicit prompt budget replaces a preset's automatic split.
    cfg = parse_config({"preset": "budget-1024", "prompt_budget": 512})
    assert cfg.token_budget is None and cfg.prompt_budget == 512


def test_split_follows_the_spec_formulas():
    # Hand-computed: B=256, N=6000, max_new=256, d=64.
    s = split_token_budget(256, 6000, 256, 64)
    total = 6256
    c = total / 256
    alpha = 0.2 + 0.06 * math.log2(c)
    cap = max(int(total / c**alpha), 512)
    c2 = cap / 256
    assert s.prompt_budget == cap - 256
    assert s.topk == 128
    assert s.page_size == math.ceil(math.sqrt(c2))
    assert s.topr == round(64 * s.page_size / c2)
    # Short requests are not compressed at all.
    assert split_token_budget(4096, 1000, 100, 64).prompt_budget >= 1000


def test_plan_keeps_budget_and_frees_the_middle():
    settings = resolve_settings(parse_config({"prompt_budget": 512}), 16, 64, 8192)
    plan = plan_request(settings, 6010)
    assert plan.compress and plan.tail_start == 6000
    assert plan.num_compact + (6010 - plan.tail_start) == 512
    start, end = plan.freed_block_range(16)
    assert start == math.ceil(plan.num_compact / 16) and end == 375
    held = start + 1  # compacted blocks + the tail block
    assert abs(held - math.ceil(512 / 16)) <= 1
    short = plan_request(settings, 512)
    assert not short.compress and short.freed_block_range(16) == (0, 0)


def test_token_budget_plans_stay_in_range():
    settings = resolve_settings(parse_config({"token_budget": 256}), 16, 64, 8192)
    assert settings.page_size & (settings.page_size - 1) == 0
    for n in (300, 1000, 4000, 8000):
        plan = plan_request(settings, n)
        assert plan.prompt_budget >= settings.window_size + settings.block_size
        assert 16 <= plan.topr <= 64 and plan.topr % 16 == 0
        assert plan.topk % settings.page_size == 0
        if plan.compress:
            assert 0 < plan.num_compact < plan.tail_start
