"""The scheduler's prefix-cache account reaches the API server's counters
inside vLLM's own SchedulerStats (issue 36, findings 2-4).

Each engine core's scheduler adds its account to the stats vLLM's
``Scheduler.make_stats`` builds for a step's outputs (the
``Scheduler.update_from_output`` wrapper, ``vllm_patches``,
``kv_cache.attach_account``); vLLM sends them to the API server (msgspec);
the stat logger takes the account out (``kv_cache.take_account``) under
vLLM's ``engine_idx``. Here the real make_stats runs on a stand-in scheduler
around a real ROCKETKV block manager, the wrapper adds the account, and the
stats go through vLLM's engine-core encoder and decoder.
Nothing touches a file: the engine writes and the server reads no folder that
another user could own, link or fill with a FIFO or bad JSON.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace

import pytest

from rocketkv_vllm.config import parse_config, resolve_settings

REPO = Path(__file__).resolve().parents[1]
BS = 16


def _manager(**account):
    """A real ROCKETKV block manager, its account set to ``account``."""
    import torch
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from rocketkv_vllm.kv_cache import RocketKVManager, make_rocketkv_spec

    base = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    settings = resolve_settings(parse_config({"token_budget": 256}), BS, 64, 4096)
    spec = make_rocketkv_spec(base, settings)
    manager = RocketKVManager(
        spec,
        block_pool=BlockPool(8, enable_caching=True, hash_block_size=BS),
        enable_caching=True,
        kv_cache_group_id=0,
        scheduler_block_size=BS,
    )
    for name, value in account.items():
        setattr(manager.prefix_account, name, value)
    return manager


def _scheduler(manager, dp_index=0):
    """What vLLM's ``Scheduler.make_stats`` reads of its scheduler. Under data
    parallelism every engine core's ``data_parallel_rank`` is 0 (vLLM resets
    it for dense models); ``data_parallel_index`` is the engine's."""
    from vllm.v1.metrics.stats import KV_FETCH_STAGES, PrefixCacheStats

    kv_cache_manager = SimpleNamespace(
        coordinator=SimpleNamespace(single_type_managers=[manager]),
        make_prefix_cache_stats=PrefixCacheStats,
        usage=0.25,
    )
    return SimpleNamespace(
        log_stats=True,
        kv_cache_manager=kv_cache_manager,
        connector=None,
        connector_prefix_cache_stats=None,
        kv_metrics_collector=None,
        get_request_counts=lambda: (3, 2),
        deferred_waiting=[],
        _kv_fetch_counts={KV_FETCH_STAGES[1]: 1},
        vllm_config=SimpleNamespace(
            parallel_config=SimpleNamespace(data_parallel_rank=0, data_parallel_index=dp_index)
        ),
    )


def _make_stats(scheduler):
    """The stats one step's outputs carry: vLLM's make_stats puts them on
    the first outputs, ROCKETKV's update_from_output wrapper adds the
    account."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutputs

    from rocketkv_vllm.plugin import register
    from rocketkv_vllm.vllm_patches.scheduler import _update_from_output

    register()

    def update_from_output(self, scheduler_output, model_runner_output):
        return {0: EngineCoreOutputs(scheduler_stats=Scheduler.make_stats(self))}

    outputs = _update_from_output(update_from_output)(scheduler, None, None)
    return outputs[0].scheduler_stats


def _to_api_server(stats, engine_index):
    """An engine core's outputs as the API server decodes them."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    out = EngineCoreOutputs(engine_index=engine_index, scheduler_stats=stats)
    back = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(out))
    return back.scheduler_stats, back.engine_index


def _stat_logger(engines=(0,), host_tier=True):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rocketkv_vllm.host_tier import CONNECTOR_NAME
    from rocketkv_vllm.metrics import RocketKVStatLogger, unregister_rocketkv_metrics
    from rocketkv_vllm.plugin import register

    register()
    unregister_rocketkv_metrics()
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector=CONNECTOR_NAME) if host_tier else None,
        attention_config=SimpleNamespace(backend=AttentionBackendEnum.CUSTOM),
        additional_config={"rocketkv": {"token_budget": 256}},
        cache_config=SimpleNamespace(block_size=BS),
        model_config=SimpleNamespace(
            served_model_name="m", max_model_len=4096, get_head_size=lambda: 64
        ),
        instance_id="test-account",
    )
    return RocketKVStatLogger(config, list(engines))


def _sample(name, engine=0):
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, {"model_name": "m", "engine": str(engine)})


@pytest.fixture
def logged(monkeypatch):
    """The warnings ROCKETKV's account code logs (each kind once)."""
    from rocketkv_vllm import kv_cache

    logged = []
    monkeypatch.setattr(kv_cache, "_warned", set())
    monkeypatch.setattr(
        kv_cache.logger, "warning", lambda msg, *args: logged.append(msg % args), raising=False
    )
    yield logged
    from rocketkv_vllm.metrics import unregister_rocketkv_metrics

    unregister_rocketkv_metrics()


@pytest.fixture
def shared_tmp(monkeypatch):
    """A /tmp-like folder (world-writable, sticky) as the temp dir."""
    folder = Path(tempfile.mkdtemp(prefix="rocketkv-shared-tmp-"))
    folder.chmod(0o1777)
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.delenv("ROCKETKV_ACCOUNT_DIR", raising=False)
    yield folder
    subprocess.run(["rm", "-rf", str(folder)], check=False)


def test_the_account_rides_in_vllms_scheduler_stats(logged, shared_tmp):
    """make_stats -> vLLM's encoder -> decoder -> stat logger: every account
    counter moves by its total, once however often stats are made;
    vLLM's own stats are untouched and the account is gone from them before
    vLLM's loggers (next in line) see them; no file is written."""
    from vllm.v1.metrics.stats import KV_FETCH_STAGES

    from rocketkv_vllm.metrics import ACCOUNT_COUNTERS

    account = {name: 10 * (i + 1) for i, name in enumerate(ACCOUNT_COUNTERS)}
    scheduler = _scheduler(_manager(**account, private_copies=5))
    stat_logger = _stat_logger()
    for _ in range(2):
        stats, engine_idx = _to_api_server(_make_stats(scheduler), 0)
        assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (
            3,
            2,
            0.25,
        )
        stat_logger.record(stats, None, engine_idx=engine_idx)
        assert stats.num_kv_fetch_reqs_by_stage == {KV_FETCH_STAGES[1]: 1}
    assert scheduler._kv_fetch_counts == {KV_FETCH_STAGES[1]: 1}  # the scheduler's own
    for field, (name, _) in ACCOUNT_COUNTERS.items():
        assert _sample(name + "_total") == account[field], field
    # The account grows: the next stats carry the gain.
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    manager.prefix_account.tokens_recomputed += 7
    stat_logger.record(*_to_api_server(_make_stats(scheduler), 0)[:1], None, engine_idx=0)
    assert _sample("rocketkv:prefix_tokens_recomputed_total") == account["tokens_recomputed"] + 7
    assert list(shared_tmp.iterdir()) == [] and logged == []


def test_vllms_crash_dump_neither_sees_nor_takes_the_account(logged, shared_tmp):
    """Issue 57, finding 4: vLLM's crash dump (``dump_engine_exception``)
    calls ``Scheduler.make_stats`` itself. Its stats carry nothing of the
    account and take none of it: the next step's outputs carry it all."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from rocketkv_vllm.plugin import register

    register()
    scheduler = _scheduler(_manager(tokens_recomputed=32))
    dumped = Scheduler.make_stats(scheduler)
    assert dumped.num_kv_fetch_reqs_by_stage == scheduler._kv_fetch_counts
    sent = _make_stats(scheduler).num_kv_fetch_reqs_by_stage
    assert sent == {**scheduler._kv_fetch_counts, "rocketkv:tokens_recomputed": 32}
    assert logged == []


def test_api_servers_that_get_an_engines_stats_in_turn_add_up_to_its_account(logged, shared_tmp):
    """vLLM sends each stats object to one API server, the one of the first
    request in the step's outputs; ``vllm serve -dp N`` starts N servers, so
    one engine's stats reach them in turn, and Prometheus sums the servers'
    counters. Each server here is a fresh stat logger (its counters start at
    0, as in a process of its own) getting one of three stats: the stats
    carry what the account gained, so the servers' counters add up to it."""
    scheduler = _scheduler(_manager(tokens_recomputed=32))
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    per_server = []
    for gain in (0, 7, 5):
        manager.prefix_account.tokens_recomputed += gain
        stats, engine_idx = _to_api_server(_make_stats(scheduler), 0)
        _stat_logger().record(stats, None, engine_idx=engine_idx)
        per_server.append(_sample("rocketkv:prefix_tokens_recomputed_total"))
    assert per_server == [32, 7, 5]
    assert sum(per_server) == manager.prefix_account.tokens_recomputed == 44
    assert logged == []


def test_two_data_parallel_engines_are_counted_apart(logged, shared_tmp):
    """Two DP engine cores (data_parallel_rank 0 both, data_parallel_index 0
    and 1): each one's account lands on its own engine label."""
    stat_logger = _stat_logger(engines=(0, 1))
    for dp_index, tokens in ((0, 32), (1, 64)):
        scheduler = _scheduler(_manager(tokens_recomputed=tokens), dp_index=dp_index)
        # vLLM names each engine core's outputs by its DP index (engine_index).
        stats, engine_idx = _to_api_server(_make_stats(scheduler), dp_index)
        stat_logger.record(stats, None, engine_idx=engine_idx)
    name = "rocketkv:prefix_tokens_recomputed_total"
    assert (_sample(name, 0), _sample(name, 1)) == (32, 64)
    assert logged == []


class _Broken:
    def __getattr__(self, name):
        raise OSError(f"cannot read {name}")


def test_a_failing_account_never_stops_make_stats(logged, shared_tmp):
    """Whatever goes wrong with the account, vLLM's stats still go out
    (without it), and the error is logged once."""
    manager = _manager(tokens_recomputed=32)
    manager.prefix_account = _Broken()
    scheduler = _scheduler(manager)
    for _ in range(3):
        stats = _make_stats(scheduler)
        assert stats is not None and stats.num_running_reqs == 3
        assert stats.num_kv_fetch_reqs_by_stage == scheduler._kv_fetch_counts
    assert len(logged) == 1 and "OSError" in logged[0], logged


def test_malformed_account_entries_are_dropped_and_logged_once(logged, shared_tmp):
    """Entries that are not a known field with a non-negative int (only an
    in-process engine could send them: msgspec types the dict) move no
    counter, raise nothing and are logged once."""
    stat_logger = _stat_logger(host_tier=False)
    bad = [
        {"rocketkv:tokens_recomputed": "32"},
        {"rocketkv:tokens_recomputed": -5},
        {"rocketkv:tokens_recomputed": True},
        {"rocketkv:tokens_recomputed": [1]},
        {"rocketkv:no_such_field": 3},
    ]
    for entries in bad:
        stat_logger.record(
            SimpleNamespace(num_kv_fetch_reqs_by_stage=dict(entries)), None, engine_idx=0
        )
    stat_logger.record(SimpleNamespace(num_kv_fetch_reqs_by_stage=None), None, engine_idx=0)
    stat_logger.record(SimpleNamespace(), None, engine_idx=0)
    assert _sample("rocketkv:prefix_tokens_recomputed_total") == 0
    assert len(logged) == 1 and "malformed" in logged[0], logged


def _process_start(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def test_a_planted_symlink_and_fifo_are_never_touched(logged, shared_tmp):
    """Finding 3: another local user's link where the account folder and
    the engine's account files (and temp files) were named, and a FIFO
    where the API server read them. The engine writes through no link (the
    victim file keeps its content) and the stat logger opens no file (a FIFO
    would block it: the record runs under a timeout)."""
    victim = shared_tmp / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    (shared_tmp / "rocketkv-accounts").symlink_to(victim, target_is_directory=True)
    me, parent = os.getpid(), os.getppid()
    for engine in (0, 1):
        # The engine core named its file by its parent, the API server ...
        writer = f"{parent}-{_process_start(parent)}-engine{engine}"
        for name in (f"{writer}.json", f"{writer}.{me}.tmp"):
            (victim / name).symlink_to(victim / "precious")
        # ... and the API server by itself.
        os.mkfifo(victim / f"{me}-{_process_start(me)}-engine{engine}.json")
    before = sorted(p.name for p in victim.iterdir())

    stats = _make_stats(_scheduler(_manager(tokens_recomputed=32)))
    stat_logger = _stat_logger(engines=(0, 1))
    done = threading.Event()

    def record():
        stat_logger.record(stats, None, engine_idx=0)
        done.set()

    threading.Thread(target=record, daemon=True).start()
    blocked = not done.wait(10)
    if blocked:  # let the reader go: open the FIFO's other end
        fifo = victim / f"{me}-{_process_start(me)}-engine0.json"
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        done.wait(10)
    assert not blocked, "the stat logger blocked on a FIFO"
    assert (victim / "precious").read_text() == "keep me"
    assert sorted(p.name for p in victim.iterdir()) == before
    assert sorted(p.name for p in shared_tmp.iterdir()) == ["rocketkv-accounts", "victim"]
    assert _sample("rocketkv:prefix_tokens_recomputed_total") == 32
    assert logged == []


OTHER_USER_ENGINE = """
import sys, tempfile
tempfile.tempdir = sys.argv[1]
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/tests"]
from test_account import _make_stats, _manager, _scheduler
stats = _make_stats(_scheduler(_manager(tokens_recomputed=32)))
assert stats.num_kv_fetch_reqs_by_stage["rocketkv:tokens_recomputed"] == 32
print("OK")
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to act as another user",
)
def test_a_second_users_engine_survives_another_users_folder(shared_tmp):
    """Finding 2: user A's account folder (0700, A's own) is left in the
    shared temp dir; user B's scheduler makes its stats as usual and writes
    nothing. B is this test's root without the capabilities that override
    file permissions (setpriv), in a subprocess: to it the folder is
    another user's, as it is to a second ordinary user."""
    folder = shared_tmp / "rocketkv-accounts"
    folder.mkdir(mode=0o700)
    os.chown(folder, 12345, 12345)
    env = {**os.environ, "TMPDIR": str(shared_tmp)}
    env.pop("ROCKETKV_ACCOUNT_DIR", None)
    drop = "-dac_override,-dac_read_search,-fowner"
    run = subprocess.run(
        ["setpriv", "--inh-caps=-all", f"--bounding-set={drop}", "--"]
        + [sys.executable, "-c", OTHER_USER_ENGINE, str(shared_tmp), str(REPO)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-3000:]
    assert list(folder.iterdir()) == []


def test_account_fields_all_travel():
    """Every field of the account is carried (the stat logger knows them)."""
    from rocketkv_vllm.kv_cache import ACCOUNT_FIELDS, PrefixCacheAccount
    from rocketkv_vllm.metrics import ACCOUNT_COUNTERS

    assert ACCOUNT_FIELDS == tuple(f.name for f in fields(PrefixCacheAccount))
    assert set(ACCOUNT_COUNTERS) <= set(ACCOUNT_FIELDS)
