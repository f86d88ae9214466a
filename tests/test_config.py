"""Settings: validation messages, presets, the SPEC budget split, request plans."""

import math

import pytest

from rocketkv_vllm.budget import split_token_budget
from rocketkv_vllm.config import RocketKVConfigError, list_presets, parse_config, resolve_settings
from rocketkv_vllm.plan import plan_request


@pytest.mark.parametrize(
    "raw,field",
    [
        ({"window_size": 0}, "rocketkv.window_size"),
        ({"kernel_size": 64}, "rocketkv.kernel_size"),
        ({"page_size": 3}, "rocketkv.page_size"),
        ({"topk": "many"}, "rocketkv.topk"),
        ({"token_budget": 8}, "rocketkv.token_budget"),
        ({"kernel": "cuda"}, "rocketkv.kernel"),
        ({"kt_dtype": "fp8"}, "rocketkv.kt_dtype"),
        ({"kt_dtype": None}, "rocketkv.kt_dtype"),
        ({"preset": "no-such-preset"}, "rocketkv.preset"),
        ({"force_current_page": "yes"}, "rocketkv.force_current_page"),
        ({"prompt_budget": True}, "rocketkv.prompt_budget"),
        ({"evict": "no"}, "rocketkv.evict"),
        ({"evict": None}, "rocketkv.evict"),
        # token_budget derives these: an explicit one next to it is refused
        ({"token_budget": 256, "topk": 64}, "rocketkv.topk"),
        ({"token_budget": 256, "topr": 32}, "rocketkv.topr"),
        ({"token_budget": 256, "prompt_budget": 1024}, "rocketkv.prompt_budget"),
        ({"preset": "budget-256", "topk": 64}, "rocketkv.topk"),
        ({"preset": "trtllm", "token_budget": 512}, "rocketkv.prompt_budget"),
    ],
)
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
    # whole pages are selected: a topk remainder would be dropped
    with pytest.raises(RocketKVConfigError, match=r"rocketkv.topk=100 .*multiple of page_size=8"):
        resolve_settings(parse_config({"page_size": 8, "topk": 100}), 16, 64, 8192)
    with pytest.raises(RocketKVConfigError, match="rocketkv.topk=2 .*page_size=4"):
        resolve_settings(parse_config({"topk": 2}), 16, 64, 8192)
    # the in-place last block (up to block_size - 1 tokens) must fit the window
    with pytest.raises(RocketKVConfigError, match=r"rocketkv.window_size=32 .*\[63, 4096\]"):
        resolve_settings(parse_config({}), 64, 64, 8192)
    resolve_settings(parse_config({"window_size": 63, "prompt_budget": 256}), 64, 64, 8192)
    resolve_settings(parse_config({"window_size": 15}), 16, 64, 8192)
    with pytest.raises(RocketKVConfigError, match="rocketkv.window_size"):
        resolve_settings(parse_config({"window_size": 14}), 16, 64, 8192)
    # without eviction there is no window to respect
    resolve_settings(parse_config({"evict": False, "window_size": 8}), 64, 64, 8192)
    # a request's view pages must fit the selection kernel's counts
    # (kernels.hsa_score.MAX_SELECT_ROW): 2**23 tokens need pages of 8
    with pytest.raises(RocketKVConfigError, match=r"rocketkv.page_size=4 .*\[8, 16\]"):
        resolve_settings(parse_config({"page_size": 4}), 16, 64, 1 << 23)
    resolve_settings(parse_config({"page_size": 8}), 16, 64, 1 << 23)
    resolve_settings(parse_config({"page_size": 1}), 16, 64, (1 << 21) - 2)
    with pytest.raises(RocketKVConfigError, match=r"rocketkv.page_size=1 .*\[2, 16\]"):
        resolve_settings(parse_config({"page_size": 1}), 16, 64, (1 << 21) - 1)


def test_every_preset_parses_and_resolves():
    for name in list_presets():
        settings = resolve_settings(parse_config({"preset": name}), 16, 64, 8192)
        plan = plan_request(settings, 6000)
        assert plan.compress and plan.topk % settings.page_size == 0


def test_presets_load_and_user_values_override():
    assert {"budget-256", "budget-1024", "budget-2048", "trtllm"} <= set(list_presets())
    trt = parse_config({"preset": "trtllm"})
    assert (
        trt.prompt_budget,
        trt.window_size,
        trt.kernel_size,
        trt.page_size,
        trt.topk,
        trt.topr,
    ) == (2048, 32, 63, 4, 256, None)
    cfg = parse_config({"preset": "budget-1024", "window_size": 16})
    assert cfg.token_budget == 1024 and cfg.window_size == 16
    # An explicit prompt budget replaces a preset's automatic split.
    cfg = parse_config({"preset": "budget-1024", "prompt_budget": 512})
    assert cfg.token_budget is None and cfg.prompt_budget == 512


# Golden values from the reference's own code (NVlabs/RocketKV, commit
# 63637c8), evaluated by hand / in a scratch Python session, not with ours:
#   pipeline/inf_stream_llm/infllm_utils.py lines 143-156 (compress()):
#     c = max(1, S / B) with S = max_seq_len = prompt + max_new_tokens
#     (line 208), r = min(0.2 + 0.06 log2 c, 0.8),
#     cap = max(int(S / c**r), min(2 * max_new, S)), prompt_budget = cap -
#     max_new, topk = int(B // 2), compression_ratio = max(1, cap / B);
#   pipeline/inf_stream_llm/inf_llm/attention/rocket.py lines 218-219:
#     chunk_size = ceil(sqrt(ratio)), or 1 if that exceeds the ratio;
#   gpt-fast/rocket.py line 132: r = min(d, max(1, round(d * chunk / ratio))).
#     (inf_llm's rocket.py line 247 truncates instead: int(d * chunk /
#     ratio); it differs from round in the last case below, 97 vs 98.)
# Worked example, B=256, N=6000, max_new=256, d=64: S=6256, c=24.4375,
# alpha=0.47666, c**alpha=4.5879, cap=int(1363.6)=1363, prompt_budget=1107,
# ratio=5.3242, chunk=ceil(2.307)=3, r=round(36.06)=36.
SPLIT_GOLDEN = [
    # (B, N, max_new, d) -> (prompt_budget, topk, page_size, topr)
    ((256, 6000, 256, 64), (1107, 128, 3, 36)),
    ((1024, 32000, 256, 128), (5518, 512, 3, 68)),
    ((512, 131072, 1024, 128), (1991, 256, 3, 65)),
    ((4096, 1000, 100, 64), (1000, 2048, 1, 64)),  # c = 1: nothing evicted
    ((2048, 8000, 512, 128), (4858, 1024, 2, 98)),  # inf_llm's int(): 97
]


@pytest.mark.parametrize("args,golden", SPLIT_GOLDEN)
def test_split_matches_reference_golden_values(args, golden):
    s = split_token_budget(*args)
    assert (s.prompt_budget, s.topk, s.page_size, s.topr) == golden


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


def test_no_eviction_plan_keeps_everything_and_frees_nothing():
    settings = resolve_settings(
        parse_config({"evict": False, "page_size": 16, "topk": 256}), 16, 64, 8192
    )
    assert settings.evict is False
    for n in (1000, 1024, 4001):
        plan = plan_request(settings, n)
        assert plan.compress and plan.prompt_budget == n
        assert plan.num_compact == plan.tail_start == n // 16 * 16
        start, end = plan.freed_block_range(16)
        assert start == end  # empty range: no block given back
    # sparse decode only pays off when the prompt exceeds the selection
    assert not plan_request(settings, 256).compress
    assert plan_request(settings, 257).compress
    small = resolve_settings(
        parse_config({"evict": False, "page_size": 4, "topk": 16}), 16, 64, 8192
    )
    assert not plan_request(small, 32).compress  # not beyond the window (32)
    assert plan_request(small, 33).compress
    # page size 1 (exact scores) and a topk beyond any view are accepted
    resolve_settings(parse_config({"evict": False, "page_size": 1, "topk": 128}), 16, 64, 8192)
    huge = resolve_settings(parse_config({"prompt_budget": 256, "topk": 1 << 20}), 16, 64, 8192)
    assert plan_request(huge, 4000).compress


@pytest.mark.parametrize("value", [True, "512", 15, -1, 1.5, (1 << 24) + 1, None])
def test_bad_request_budget_names_the_field_and_range(value):
    from types import SimpleNamespace

    from rocketkv_vllm.requests import planned_budget, request_token_budget

    args = {"rocketkv_token_budget": value}
    with pytest.raises(RocketKVConfigError) as err:
        request_token_budget(args)
    assert "vllm_xargs.rocketkv_token_budget" in str(err.value)
    assert "0 (this request uncompressed) or an integer in [16, 16777216]" in str(err.value)
    # One that skipped the check on arrival: the engine's settings, everywhere.
    assert planned_budget(SimpleNamespace(extra_args=args)) is None


@pytest.mark.parametrize("extra_args", [5, "rocketkv_token_budget", ["rocketkv_token_budget"]])
def test_extra_args_not_a_dict_is_refused_naming_the_field(extra_args):
    """Issue 57, finding 5: a request that skipped the server's schema
    (offline, or an EngineCoreRequest handed in directly) gets the
    validation error, not a TypeError; in the scheduler and the workers it
    plans with the engine's settings and never raises."""
    from types import SimpleNamespace

    from rocketkv_vllm.requests import RocketKVRequestError, planned_budget, request_token_budget

    with pytest.raises(RocketKVRequestError) as err:
        request_token_budget(extra_args)
    assert err.value.field == "vllm_xargs" and "vllm_xargs" in str(err.value)
    assert isinstance(err.value, RocketKVConfigError)  # a ValueError: a 400
    assert planned_budget(SimpleNamespace(extra_args=extra_args)) is None


@pytest.mark.parametrize("key", ["rocketkv_tokens_budget", "RocketKV_token_budget", "rocketkv"])
def test_an_unknown_rocketkv_key_is_refused_naming_the_known_ones(key):
    """Issue 57, finding 5: a misspelled key was ignored (the request ran
    at the engine's budget). Only keys starting with ``rocketkv`` are
    ours: other plugins' keys are left alone."""
    from types import SimpleNamespace

    from rocketkv_vllm.requests import RocketKVRequestError, planned_budget, request_token_budget

    args = {key: 512, "rocketkv_token_budget": 1024}
    with pytest.raises(RocketKVRequestError) as err:
        request_token_budget(args)
    assert err.value.field == f"vllm_xargs.{key}"
    assert f"vllm_xargs.{key} is not a ROCKETKV request argument" in str(err.value)
    assert "known: rocketkv_token_budget" in str(err.value)
    assert planned_budget(SimpleNamespace(extra_args=args)) is None
    others = {"kv_transfer_params": {"x": 1}, "my_plugin_rocketkv": 3, 7: "seven"}
    assert request_token_budget({**others, "rocketkv_token_budget": 1024}) == 1024


def test_request_budget_plans_like_an_engine_with_that_budget():
    from rocketkv_vllm.requests import request_token_budget

    assert request_token_budget(None) is None
    assert request_token_budget({"other": 1}) is None
    assert request_token_budget({"rocketkv_token_budget": 0}) == 0
    assert request_token_budget({"rocketkv_token_budget": 1024}) == 1024
    engines = [
        resolve_settings(parse_config(raw), 32, 64, 8192)
        for raw in (
            {"token_budget": 256, "page_size": 4},
            {"prompt_budget": 512, "topk": 64, "page_size": 4},
        )
    ]
    want = resolve_settings(parse_config({"token_budget": 1024, "page_size": 4}), 32, 64, 8192)
    for settings in engines:
        for n in (700, 3000, 6000):
            assert plan_request(settings, n, 1024) == plan_request(want, n)
            off = plan_request(settings, n, 0)
            assert not off.compress and off.freed_block_range(32) == (0, 0)
            assert plan_request(settings, n, None) == plan_request(settings, n)
    assert plan_request(engines[0], 3000, 1024) != plan_request(engines[0], 3000)


def test_a_request_that_decodes_nothing_is_planned_uncompressed():
    """max_tokens 1 (its token comes from the prompt's forward) and pooling
    (no sampling parameters) plan with budget 0 in every process, whatever
    budget the request asks for; a request that decodes keeps its own."""
    from vllm import SamplingParams

    from rocketkv_vllm.requests import planned_budget

    own = {"rocketkv_token_budget": 512}
    assert planned_budget(None) == 0
    assert planned_budget(SamplingParams(max_tokens=1)) == 0
    assert planned_budget(SamplingParams(max_tokens=1, n=3, extra_args=own)) == 0
    assert planned_budget(SamplingParams(max_tokens=2)) is None
    assert planned_budget(SamplingParams(max_tokens=2, extra_args=own)) == 512
    assert planned_budget(SamplingParams(max_tokens=None)) is None  # vLLM fills it in later
    settings = resolve_settings(parse_config({"token_budget": 256}), 32, 64, 8192)
    assert not plan_request(settings, 6000, planned_budget(SamplingParams(max_tokens=1))).compress
    assert plan_request(settings, 6000, planned_budget(SamplingParams(max_tokens=2))).compress


def test_readme_configuration_table_is_the_knobs_metadata():
    """The README's table is generated from RocketKVConfig's field metadata:
    a knob added, renamed or re-documented without it fails here."""
    from pathlib import Path

    from rocketkv_vllm.config import config_table

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = readme.index("<!-- config-table")
    table = readme[readme.index("\n", start) + 1 : readme.index("<!-- /config-table -->")]
    assert table.strip() == config_table()


def test_test_aids_are_not_user_settings():
    from rocketkv_vllm.config import RocketKVConfig, TestAids, parse_test_aids

    knobs = {f for f in RocketKVConfig.__dataclass_fields__}
    assert not knobs & set(TestAids.__dataclass_fields__)
    with pytest.raises(RocketKVConfigError, match="unknown rocketkv setting"):
        parse_config({"poison_evicted_blocks": True})
    assert parse_test_aids({"poison_evicted_blocks": True}).poison_evicted_blocks
    with pytest.raises(RocketKVConfigError, match="rocketkv_testing.poison"):
        parse_test_aids({"poison": True})


@pytest.mark.parametrize("key", ["rocketKV", "rocket_kv", "RocketKV", "rocket-kv"])
def test_a_near_miss_of_the_config_key_is_refused(key):
    from types import SimpleNamespace

    from rocketkv_vllm.config import raw_config

    with pytest.raises(RocketKVConfigError, match=f"'{key}'.*did you mean 'rocketkv'"):
        raw_config(SimpleNamespace(additional_config={key: {"token_budget": 256}}))
    assert raw_config(
        SimpleNamespace(additional_config={"rocketkv": {"token_budget": 256}, "other_plugin": {}})
    ) == {"token_budget": 256}


@pytest.mark.parametrize(
    "content,reason",
    [
        (b"token_budget: [1, 2\n", "is not YAML at line 2"),
        (b"token_budget: !!python/object:os.system 1\n", "uses a YAML tag at line 1"),
        (b"\xff\xfe\x00\x01binary", "binary"),
        (b"- 1\n- 2\n", "a mapping"),
    ],
)
def test_a_bad_preset_file_names_the_field_and_the_reason(tmp_path, content, reason):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(RocketKVConfigError) as err:
        parse_config({"preset": str(path)})
    message = str(err.value)
    assert "rocketkv.preset" in message and reason in message
    assert "os.system" not in message and "[1, 2" not in message  # never the content


def _engine_settings(rocketkv):
    from types import SimpleNamespace

    from rocketkv_vllm.config import settings_for

    model = SimpleNamespace(get_head_size=lambda: 64, max_model_len=8192)
    return settings_for(
        SimpleNamespace(
            additional_config={"rocketkv": rocketkv},
            model_config=model,
            cache_config=SimpleNamespace(block_size=16),
        )
    )


@pytest.mark.parametrize("value", [object(), {256, 512}, b"256", (256,), [256], {"b": 256}])
def test_non_json_setting_values_name_the_field_and_range(value):
    """``LLM(additional_config=...)`` takes any Python object: one that is
    not a JSON scalar gets the config error, with the value as given."""
    with pytest.raises(RocketKVConfigError) as err:
        _engine_settings({"token_budget": value})
    message = str(err.value)
    assert f"rocketkv.token_budget={value!r} is invalid" in message
    assert "allowed an integer in [16, 16777216] or null" in message
    with pytest.raises(RocketKVConfigError, match=r"rocketkv.kernel=b'torch' .*one of"):
        _engine_settings({"kernel": b"torch"})
    # non-string keys are unknown settings, listed next to the allowed ones
    with pytest.raises(RocketKVConfigError, match=r"unknown rocketkv setting\(s\) \[1, 'x'\]"):
        _engine_settings({1: 256, "x": 1})
    assert _engine_settings({"token_budget": 256}).token_budget == 256
