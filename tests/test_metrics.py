"""ROCKETKV metrics on the OpenAI server's Prometheus /metrics.

The unit tests drive the stat logger with hand-made iteration stats; the
server test starts a real ROCKETKV server and checks that the rocketkv:*
counters equal what ``config.plan_request`` predicts for the prompt lengths
the server reports.
"""

import ast
import gc
import math
import time
from types import SimpleNamespace

import pytest

from rocketkv_vllm.config import RocketKVSettings, parse_config, resolve_settings
from rocketkv_vllm.plan import plan_request

ROCKETKV = {"token_budget": 256}


def _fake_vllm_config(backend, rocketkv=ROCKETKV, block_size=16, kv_connector=None):
    return SimpleNamespace(
        kv_transfer_config=None
        if kv_connector is None
        else SimpleNamespace(kv_connector=kv_connector),
        attention_config=SimpleNamespace(backend=backend),
        additional_config={"rocketkv": rocketkv},
        cache_config=SimpleNamespace(block_size=block_size),
        model_config=SimpleNamespace(
            served_model_name="m", max_model_len=4096, get_head_size=lambda: 64
        ),
        instance_id="test-metrics",
    )


def _sample(name, labels=None):
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels or {"model_name": "m", "engine": "0"})


def _attended(plan, seq_len, page, force_current_page=True):
    """Stage 2's tokens per KV head, written out independently: the view is
    the compacted prompt plus the tail from its block on, in pages."""
    compact_pages = math.ceil(plan.num_compact / page)
    tail_pages = math.ceil((seq_len - plan.tail_start) / page)
    pages = min(plan.topk // page + force_current_page, compact_pages + tail_pages)
    return min(pages * page, plan.num_compact + seq_len - plan.tail_start)


def test_backend_and_metrics_are_two_plugins_and_no_stat_logger_plugin():
    """Issue 57, finding 3: ``VLLM_PLUGINS=rocketkv`` keeps the backend and
    drops the metrics; no ``vllm.stat_logger_plugins`` entry, which vLLM
    adds to every AsyncLLM (turning its stats on), dense ones included."""
    from importlib.metadata import entry_points

    from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories

    general = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert general["rocketkv"] == "rocketkv_vllm.plugin:register"
    assert general["rocketkv_metrics"] == "rocketkv_vllm.plugin:register_metrics"
    ours = [e for e in entry_points(group="vllm.stat_logger_plugins") if "rocketkv" in e.value]
    assert ours == [] and load_stat_logger_plugin_factories() == []


def _async_llm(config, monkeypatch, **kw):
    """vLLM's AsyncLLM for a real engine config, built as ``vllm serve``
    builds it (``from_vllm_config``, ``disable_log_stats`` from the flag),
    its engine-core client a stand-in: no engine starts."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import EngineCoreClient

    client = SimpleNamespace(engine_ranks_managed=[0], shutdown=lambda *a, **k: None)
    monkeypatch.setattr(EngineCoreClient, "make_async_mp_client", lambda *a, **k: client)
    return AsyncLLM.from_vllm_config(config, **kw)


def _one_output(engine) -> None:
    """One request through the frontend's output processor: added, then
    one output with its iteration stats."""
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.metrics.stats import IterationStats

    request = engine.input_processor.process_inputs(
        "r", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4), ("generate",)
    )
    engine.input_processor.assign_request_id(request)
    engine.output_processor.add_request(request, None)
    output = EngineCoreOutput(request_id=request.request_id, new_token_ids=[5])
    engine.output_processor.process_outputs([output], time.monotonic(), IterationStats())


def test_a_dense_engine_is_vllms_own(model_path, monkeypatch):
    """Issue 57, finding 3: installed, the package changes nothing for an
    engine with another backend: ``--disable-log-stats`` turns its stats off,
    no logger is added and its output processor does no ROCKETKV work per
    output. A ROCKETKV engine beside it: ROCKETKV's logger first, its
    outputs recorded (and ``--disable-log-stats`` honoured as well)."""
    from vllm.engine.arg_utils import EngineArgs

    from rocketkv_vllm import metrics

    calls = []
    monkeypatch.setattr(metrics, "remember_request", lambda *a: calls.append("request"))
    monkeypatch.setattr(metrics, "record_output", lambda *a: calls.append("output"))
    args = dict(model=model_path, dtype="float32", max_model_len=4096, enforce_eager=True)
    configs = {
        backend: EngineArgs(attention_backend=backend, **args).create_engine_config()
        for backend in ("CPU_ATTN", "ROCKETKV")
    }
    for backend, config in configs.items():
        off = _async_llm(config, monkeypatch, disable_log_stats=True)
        assert not off.log_stats and off.logger_manager is None, backend
        off.shutdown()
    dense = _async_llm(configs["CPU_ATTN"], monkeypatch)
    kinds = [type(x).__name__ for x in dense.logger_manager.stat_loggers]
    assert "RocketKVStatLogger" not in kinds, kinds
    _one_output(dense)
    dense.shutdown()
    assert calls == []
    rocketkv = _async_llm(configs["ROCKETKV"], monkeypatch)
    assert isinstance(rocketkv.logger_manager.stat_loggers[0], metrics.RocketKVStatLogger)
    _one_output(rocketkv)
    rocketkv.shutdown()
    assert calls == ["request", "output"]
    del off, dense, rocketkv
    gc.collect()  # their __del__ now, not at interpreter exit
    metrics.unregister_rocketkv_metrics()


def test_stat_logger_is_inert_for_other_backends():
    from prometheus_client import REGISTRY
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rocketkv_vllm.metrics import RocketKVStatLogger, unregister_rocketkv_metrics
    from rocketkv_vllm.plugin import register

    register()
    unregister_rocketkv_metrics()
    for backend in (None, AttentionBackendEnum.CPU_ATTN):
        stat_logger = RocketKVStatLogger(_fake_vllm_config(backend), [0])
        assert not stat_logger.enabled
        stat_logger.record(None, SimpleNamespace(), engine_idx=0)
        stat_logger.log_engine_initialized()
    names = [n for names in REGISTRY._collector_to_names.values() for n in names]
    assert not [n for n in names if n.startswith("rocketkv:")]


def test_stat_logger_counts_what_the_plan_predicts():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rocketkv_vllm.metrics import (
        RequestOutputFact,
        RocketKVStatLogger,
        decode_tokens_attended,
    )
    from rocketkv_vllm.plugin import register

    register()
    stat_logger = RocketKVStatLogger(_fake_vllm_config(AttentionBackendEnum.CUSTOM), [0, 1])
    assert stat_logger.enabled
    settings = resolve_settings(parse_config(ROCKETKV), 16, 64, 4096)
    assert stat_logger.settings == settings
    long_n, short_n = 3000, 100
    plan = plan_request(settings, long_n)
    assert plan.compress and not plan_request(settings, short_n).compress

    def step(*facts):
        stats = SimpleNamespace()
        stats._rocketkv_outputs = list(facts)
        stat_logger.record(None, stats, engine_idx=0)

    # Prefill outputs (first token), then 3 decode steps for each request.
    step(RequestOutputFact("a", long_n, True, 1, 1), RequestOutputFact("b", short_n, True, 1, 1))
    for g in (2, 3, 4):
        step(
            RequestOutputFact("a", long_n, False, 1, g),
            RequestOutputFact("b", short_n, False, 1, g),
        )
    stat_logger.record(None, None, engine_idx=0)  # scheduler-only update

    start, end = plan.freed_block_range(16)
    assert end > start
    assert _sample("rocketkv:prompts_compressed_total") == 1
    assert _sample("rocketkv:prompt_tokens_evicted_total") == long_n - plan.prompt_budget
    assert _sample("rocketkv:kv_blocks_freed_total") == end - start
    assert _sample("rocketkv:kept_fraction_count") == 1
    assert _sample("rocketkv:kept_fraction_sum") == pytest.approx(plan.prompt_budget / long_n)
    want = [_attended(plan, long_n + g - 1, settings.page_size) for g in (2, 3, 4)]
    assert _sample("rocketkv:decode_tokens_attended_count") == 3
    assert _sample("rocketkv:decode_tokens_attended_sum") == sum(want)
    assert _sample("rocketkv:decode_context_tokens_total") == sum(long_n + g - 1 for g in (2, 3, 4))
    assert _sample("rocketkv:prompts_compressed_total", {"model_name": "m", "engine": "1"}) == 0
    info = _sample(
        "rocketkv:config_info",
        {"model_name": "m", "engine": "0", **{k: str(v) for k, v in settings.as_dict().items()}},
    )
    assert info == 1
    # Every page selected while the view is small; capped by the view.
    small = plan_request(settings, 300)
    assert decode_tokens_attended(settings, small, 301) == _attended(small, 301, settings.page_size)


def test_stat_logger_follows_each_requests_own_budget():
    """A request's own budget (``vllm_xargs``) reaches the counters: 0 counts
    nothing, 1024 counts that budget's plan, none the engine's."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rocketkv_vllm.metrics import RequestOutputFact, RocketKVStatLogger
    from rocketkv_vllm.plugin import register

    register()
    stat_logger = RocketKVStatLogger(_fake_vllm_config(AttentionBackendEnum.CUSTOM), [0])
    settings = stat_logger.settings
    n = 3000
    stats = SimpleNamespace(
        _rocketkv_outputs=[
            RequestOutputFact("off", n, True, 1, 1, token_budget=0),
            RequestOutputFact("own", n, True, 1, 1, token_budget=1024),
            RequestOutputFact("engine", n, True, 1, 1),
        ]
    )
    stat_logger.record(None, stats, engine_idx=0)
    own, engine = plan_request(settings, n, 1024), plan_request(settings, n)
    assert own.prompt_budget > engine.prompt_budget
    assert _sample("rocketkv:prompts_compressed_total") == 2
    assert _sample("rocketkv:prompt_tokens_evicted_total") == (
        2 * n - own.prompt_budget - engine.prompt_budget
    )


def test_frontend_plans_a_one_token_request_uncompressed():
    """The API server's counters plan each request with the budget the
    scheduler and workers use (``requests.planned_budget``): a max_tokens=1
    request, whatever budget it asks for, counts as uncompressed."""
    from vllm import SamplingParams

    from rocketkv_vllm.metrics import _BUDGET_ATTR, remember_request

    own = {"rocketkv_token_budget": 1024}
    for max_tokens, want in ((1, 0), (2, 1024)):
        state = SimpleNamespace()
        params = SamplingParams(max_tokens=max_tokens, extra_args=own)
        remember_request(state, SimpleNamespace(sampling_params=params))
        assert getattr(state, _BUDGET_ATTR) == want


# ---------------------------------------------------------------------------
# A real server.


def _engine_settings(log: str) -> RocketKVSettings:
    """The settings the engine logged at startup ("ROCKETKV settings: {...}")."""
    start = log.index("ROCKETKV settings: {") + len("ROCKETKV settings: ")
    end = log.index("}", start) + 1
    return RocketKVSettings(**ast.literal_eval(log[start:end]))


@pytest.fixture(scope="module")
def metrics_server(tiny):
    """A server of the tiny random Llama: what is checked here is counted,
    not read."""
    from test_serve import Server

    # With a host tier (vLLM's --kv-offloading-size): its counters come from
    # the scheduler's account too.
    srv = Server(
        tiny,
        rocketkv=ROCKETKV,
        extra=["--kv-offloading-size", "0.5"],
        # vLLM's stats log line every second: the account must not show in it.
        env={"VLLM_LOGGING_LEVEL": "DEBUG", "VLLM_LOG_STATS_INTERVAL": "1"},
    )
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.mark.engine
def test_server_exports_rocketkv_counters(metrics_server, tokenizer):
    from test_serve import metric_samples, metric_value

    srv = metrics_server
    client = srv.client()
    before = srv.metrics()
    assert metric_value(before, "rocketkv:prompts_compressed_total") == 0

    words = " ".join(f"item{i % 97}" for i in range(4000))
    long_ids = tokenizer(words)["input_ids"][:3000]
    outs = [
        client.completions.create(
            model=srv.model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        for prompt, max_tokens in ((long_ids, 6), ("The capital of France is", 4))
    ]
    usage = [(o.usage.prompt_tokens, o.usage.completion_tokens) for o in outs]
    assert usage[0] == (3000, 6) and usage[1][1] == 4

    settings = _engine_settings(srv.log())
    assert settings.token_budget == 256
    plans = [plan_request(settings, n) for n, _ in usage]
    assert plans[0].compress and not plans[1].compress
    plan = plans[0]
    start, end = plan.freed_block_range(settings.block_size)
    steps = [3000 + g - 1 for g in range(2, 7)]  # context of decode steps 2..6

    deadline = time.time() + 30  # the frontend may record after responding
    while True:
        text = srv.metrics()
        if (
            metric_value(text, "rocketkv:decode_tokens_attended_count") >= len(steps)
            or time.time() > deadline
        ):
            break
        time.sleep(0.5)
    assert metric_value(text, "rocketkv:prompts_compressed_total") == 1
    assert metric_value(text, "rocketkv:prompt_tokens_evicted_total") == (3000 - plan.prompt_budget)
    assert metric_value(text, "rocketkv:kv_blocks_freed_total") == end - start > 0
    assert metric_value(text, "rocketkv:kept_fraction_count") == 1
    assert metric_value(text, "rocketkv:kept_fraction_sum") == pytest.approx(
        plan.prompt_budget / 3000
    )
    assert metric_value(text, "rocketkv:decode_tokens_attended_count") == len(steps)
    assert metric_value(text, "rocketkv:decode_tokens_attended_sum") == sum(
        _attended(plan, s, settings.page_size) for s in steps
    )
    assert metric_value(text, "rocketkv:decode_context_tokens_total") == sum(steps)
    # The frontend's settings are the engine's.
    [(info, one)] = metric_samples(text, "rocketkv:config_info")
    assert one == 1 and info == {
        "model_name": srv.model,
        "engine": "0",
        **{k: str(v) for k, v in settings.as_dict().items()},
    }
    # Next to vLLM's own metrics, with the same labels.
    assert "vllm:num_requests_running{" in text
    for name in ("rocketkv:prompts_compressed_total", "vllm:prompt_tokens_total"):
        assert [labels for labels, _ in metric_samples(text, name)] == [
            {"model_name": srv.model, "engine": "0"}
        ]

    # The same prompt again: vLLM's prefix cache serves all of it but the
    # observation window and the block holding the prompt's end; ROCKETKV's
    # counter says how many cached tokens the window cost (the scheduler's
    # account, published with its stats).
    assert metric_value(text, "rocketkv:prefix_tokens_recomputed_total") == 0
    hits = metric_value(text, "vllm:prefix_cache_hits_total")
    again = client.completions.create(
        model=srv.model,
        prompt=long_ids,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert again.choices[0].text == outs[0].choices[0].text
    bs, w = settings.block_size, settings.window_size
    capped = (3000 - w) // bs * bs
    deadline = time.time() + 30
    while True:
        text = srv.metrics()
        if (
            metric_value(text, "rocketkv:prefix_tokens_recomputed_total") > 0
            or time.time() > deadline
        ):
            break
        time.sleep(0.5)
    assert metric_value(text, "vllm:prefix_cache_hits_total") - hits == capped
    assert metric_value(text, "rocketkv:prefix_tokens_recomputed_total") == (
        (3000 - 1) // bs * bs - capped
    )
    # The host tier holds the prompt's hashed blocks too: the ones past the
    # cap were found there and not used either; its compaction targets went
    # to the host before Stage 1, once (the second request finds them there).
    assert metric_value(text, "rocketkv:host_tokens_recomputed_total") == (
        (3000 - 1) // bs * bs - capped
    )
    assert metric_value(text, "rocketkv:host_blocks_stored_total") >= (3000 - 1) // bs
    assert metric_value(text, "rocketkv:host_target_blocks_stored_total") == plan.compact_blocks(bs)
    assert metric_value(text, "rocketkv:host_blocks_loaded_total") == 0  # all on the device


@pytest.mark.engine
def test_server_logs_each_compressed_prompt(metrics_server):
    log = metrics_server.stop()
    lines = [line for line in log.splitlines() if "ROCKETKV compressed request" in line]
    assert len(lines) == 2, log[-3000:]  # the long prompt, sent twice
    assert "3000 prompt tokens" in lines[0]
    assert "ROCKETKV metrics: rocketkv:* counters on /metrics" in log
    # The scheduler's account rode in vLLM's stats without an error, and the
    # stat logger took it out before vLLM's own logger read them.
    assert "prefix-cache account" not in log
    assert "Avg prompt throughput" in log and "KV fetch" not in log


@pytest.mark.engine
def test_a_users_stat_logger_sees_nothing_of_the_account(tiny):
    """Issue 57, finding 4: a stat logger a user hands to AsyncLLM comes
    before vLLM's own in line; ROCKETKV's goes first of all and takes the
    scheduler's account out, so the user's sees none of it while the
    rocketkv:* counter gets it (the same prompt twice: its window is
    recomputed from the prefix cache)."""
    import asyncio

    from conftest import ENGINE_KW
    from prometheus_client import REGISTRY
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase

    seen = []

    class UserLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index=0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                seen.append(dict(scheduler_stats.num_kv_fetch_reqs_by_stage))

        def log_engine_initialized(self):
            pass

    def exported():
        name = "rocketkv:prefix_tokens_recomputed_total"
        return next(s.value for m in REGISTRY.collect() for s in m.samples if s.name == name)

    async def run():
        args = AsyncEngineArgs(
            model=tiny,
            attention_backend="ROCKETKV",
            additional_config={"rocketkv": ROCKETKV},
            **ENGINE_KW,
        )
        engine = AsyncLLM.from_engine_args(args, stat_loggers=[UserLogger])
        try:
            prompt = {"prompt_token_ids": [(7 * i) % 5000 + 100 for i in range(600)]}
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            for i in range(2):
                async for _ in engine.generate(prompt, params, request_id=f"r{i}"):
                    pass
            return exported()
        finally:
            engine.shutdown()

    recomputed = asyncio.run(run())
    assert recomputed > 0 and seen
    assert [d for d in seen if any(str(k).startswith("rocketkv") for k in d)] == []


def _scheduler_account():
    """What ROCKETKV's block manager keeps of its account: the account, and
    what the scheduler's stats have carried of it."""
    from rocketkv_vllm.kv_cache import PrefixCacheAccount

    return SimpleNamespace(prefix_account=PrefixCacheAccount(), account_sent=PrefixCacheAccount())


def _stats_carrying(manager):
    """SchedulerStats as the scheduler makes them, with its account's gains."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats

    from rocketkv_vllm.kv_cache import attach_account

    stats = SchedulerStats()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("rocketkv_vllm.kv_cache.rocketkv_manager", lambda kv_cache_manager: manager)
        attach_account({0: EngineCoreOutputs(scheduler_stats=stats)}, None)
    return stats


def test_the_schedulers_prefix_cache_account_reaches_the_counter():
    """What only the scheduler knows (tokens of a prefix hit ROCKETKV did
    not use) travels in its account, inside vLLM's scheduler stats
    (``kv_cache.attach_account``; the round trip through vLLM's encoder:
    test_account) as what it gained since the stats before; the stat logger
    adds that."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rocketkv_vllm.metrics import RocketKVStatLogger, unregister_rocketkv_metrics
    from rocketkv_vllm.plugin import register

    register()
    unregister_rocketkv_metrics()
    config = _fake_vllm_config(AttentionBackendEnum.CUSTOM)
    stat_logger = RocketKVStatLogger(config, [0])
    name = "rocketkv:prefix_tokens_recomputed_total"
    manager = _scheduler_account()
    account = manager.prefix_account
    stat_logger.record(_stats_carrying(manager), None, engine_idx=0)  # nothing yet
    assert _sample(name) == 0
    account.tokens_recomputed = 32
    stat_logger.record(_stats_carrying(manager), None, engine_idx=0)
    stat_logger.record(_stats_carrying(manager), None, engine_idx=0)  # no gain: once
    assert _sample(name) == 32
    account.tokens_recomputed = 96
    stat_logger.record(None, None, engine_idx=0)  # no scheduler stats: nothing new
    assert _sample(name) == 32
    stat_logger.record(_stats_carrying(manager), None, engine_idx=0)
    assert _sample(name) == 96
    assert _sample("rocketkv:host_blocks_stored_total") is None  # no host tier, no counter
    unregister_rocketkv_metrics()


def test_the_host_tiers_account_reaches_its_counters():
    """With the host tier, its stores, loads, bytes and recomputed tokens
    (``host_tier.scheduler``) travel in the same account."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rocketkv_vllm.host_tier import CONNECTOR_NAME
    from rocketkv_vllm.metrics import (
        ACCOUNT_COUNTERS,
        RocketKVStatLogger,
        unregister_rocketkv_metrics,
    )
    from rocketkv_vllm.plugin import register

    register()
    unregister_rocketkv_metrics()
    config = _fake_vllm_config(AttentionBackendEnum.CUSTOM, kv_connector=CONNECTOR_NAME)
    stat_logger = RocketKVStatLogger(config, [0])
    manager = _scheduler_account()
    fields = [f for f in ACCOUNT_COUNTERS if f.startswith("host_")]
    assert len(fields) == 7
    for i, field in enumerate(fields):
        setattr(manager.prefix_account, field, 10 * (i + 1))
    stat_logger.record(_stats_carrying(manager), None, engine_idx=0)
    for i, field in enumerate(fields):
        assert _sample(ACCOUNT_COUNTERS[field][0] + "_total") == 10 * (i + 1), field
    unregister_rocketkv_metrics()
