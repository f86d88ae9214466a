"""The host tier under asynchronous copies (issue 61): the ordering rules as
pure functions, the ``async`` copy worker's timing with vLLM's own metadata
and completion path, and the host-tier scheduler scenarios
(``test_host_tier_scheduler.FakeEngine``: vLLM's real scheduler and the
connector's real worker half around a fake forward, every block any tier holds
under a hash checked against the dense K/V of its prefix after every step)
with copies that complete 0-3 steps after their issue; and the NVIDIA path
with vLLM's platform faked as CUDA (not refused, the connector selected for
ROCKETKV engines, vLLM's CUDA worker adopted and its compute stream made to
wait for a Stage 1 step's store, with fake streams, events and copy thread).

The rules each of these tests holds (docs/design.md, "Host tier under
asynchronous copies"): (a) a store reads a block before Stage 1 writes into it
(the Stage 1 step waits for the block's pending store); (b) a load is
reported, so its request scheduled, only once copied; (c) a store is
reported, so its blocks released and its host block made a hit, only once
copied.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_host_tier_scheduler import BLOCK_BYTES, FakeEngine, _prompts

from rocketkv_vllm.host_tier.ordering import (
    CopySettings,
    copy_settings,
    due_step,
    stage1_write_blocks,
    stores_to_wait,
)
from rocketkv_vllm.plan import RequestPlan

# -- the rules as pure functions ----------------------------------------------


def test_copy_settings_name_the_field_and_what_it_allows():
    assert copy_settings({}, 7) == CopySettings("sync")
    assert copy_settings({"copy_mode": "async"}, 7) == CopySettings("async", 3, 7)
    assert copy_settings({"copy_mode": "async"}, None).seed == 0
    got = copy_settings({"copy_mode": "async", "async_max_delay_steps": 0, "async_seed": 5}, 7)
    assert got == CopySettings("async", 0, 5)
    bad = [
        ({"copy_mode": "later"}, r"copy_mode='later'.*allowed: 'sync', 'async'"),
        ({"async_seed": 1}, r"async_seed is read with copy_mode='async' only"),
        ({"copy_mode": "async", "async_max_delay_steps": -1}, r"async_max_delay_steps=-1.*0 to 64"),
        ({"copy_mode": "async", "async_max_delay_steps": "3"}, r"async_max_delay_steps='3'"),
        ({"copy_mode": "async", "async_seed": 1.5}, r"async_seed=1.5.*an integer"),
    ]
    for extra, message in bad:
        with pytest.raises(ValueError, match=message):
            copy_settings(extra, 0)


def _plan(n, budget, num_compact, tail_start):
    return RequestPlan(
        n, budget < n or num_compact == tail_start, budget, 8, 4, num_compact, tail_start
    )


def test_stage1_writes_the_targets_and_the_tail_or_every_kt_page():
    # 300 tokens, 64 kept: 52 compacted into blocks 0-3, the tail block 18 from 288.
    assert stage1_write_blocks(_plan(300, 64, 64 - 12, 288), 16) == [0, 1, 2, 3, 18]
    # Eviction off (identity): every prompt block's KT pages.
    assert stage1_write_blocks(_plan(300, 300, 288, 288), 16) == list(range(19))
    uncompressed = RequestPlan(40, False, 40, 8, 4, 0, 32)
    assert stage1_write_blocks(uncompressed, 16) == []


def test_a_stage1_step_waits_for_the_latest_store_of_a_block_it_writes():
    pending = {3: [10, 11], 4: [20], 5: [30, 31]}
    assert stores_to_wait([11, 99], pending) == 3
    assert stores_to_wait([31, 11], pending) == 5  # one stream: 5 finishes 3 and 4 too
    assert stores_to_wait([99], pending) == -1
    assert stores_to_wait([], pending) == -1


def test_a_streams_copies_complete_in_issue_order():
    assert due_step(5, 0, 4) == 5
    assert due_step(5, 1, 8) == 8  # the copy issued before it completes later
    assert due_step(5, 3, 6) == 8


# -- the worker: seeded delays, reported through vLLM's completion path -------

NUM_DEVICE, NUM_HOST, ROW = 32, 64, 8  # blocks; int8 bytes per block row


def _worker(max_delay: int = 3, seed: int = 0):
    from rocketkv_vllm.host_tier.async_cpu_worker import AsyncHostCopyWorker

    worker = AsyncHostCopyWorker(None, None, 0, settings=CopySettings("async", max_delay, seed))
    gen = torch.Generator().manual_seed(seed)
    worker.gpu_kv_caches = {
        "l": torch.randint(-128, 127, (NUM_DEVICE, ROW), generator=gen, dtype=torch.int8)
    }
    worker.cpu_kv_caches = {
        "l": torch.randint(-128, 127, (NUM_HOST, ROW), generator=gen, dtype=torch.int8)
    }
    return worker


def _drive(worker, steps: int, rng: random.Random, waits: dict[int, int] | None = None):
    """``steps`` steps of vLLM's worker calls; each may issue a load (host
    block 48+k -> device block 16+k) and a store (device block e % 16 ->
    host block e), each event's blocks its own. After each step, checks that
    every transfer reported done has its bytes at the destination and that
    every transfer not reported has not touched it. Returns each event's
    (issue step, report step), by ("load" | "store", event)."""
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

    from rocketkv_vllm.host_tier.scheduler import RocketKVHostMetadata

    device, host = worker.gpu_kv_caches["l"], worker.cpu_kv_caches["l"]
    source = {"load": host.clone(), "store": device.clone()}
    before = {"load": device.clone(), "store": host.clone()}
    loads = stores = 0
    pending_loads: dict[int, list[str]] = {}
    issued, reported = {}, {}
    for step in range(1, steps + 1):
        meta = SimpleCPUOffloadMetadata()
        if (waits or {}).get(step) is not None:
            meta = RocketKVHostMetadata(wait_store_event=waits[step])
        if loads < 16 and rng.random() < 0.5:
            meta.load_event, meta.load_cpu_blocks, meta.load_gpu_blocks = (
                loads,
                [48 + loads],
                [16 + loads],
            )
            pending_loads[loads] = [f"req-{loads}"]
            issued["load", loads] = step
            loads += 1
        if stores < 40 and rng.random() < 0.8:
            meta.store_event, meta.store_gpu_blocks, meta.store_cpu_blocks = (
                stores,
                [stores % 16],
                [stores],
            )
            issued["store", stores] = step
            stores += 1
        meta.load_event_to_reqs = {e: list(r) for e, r in pending_loads.items()}
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv()
        worker.wait_for_save()
        _, recving = worker.get_finished(set())
        done = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        for req in recving or ():
            event = int(req.split("-")[1])
            assert ("load", event) not in reported
            reported["load", event] = step
            pending_loads.pop(event)
        for event in done.completed_store_events if done else ():
            assert ("store", event) not in reported
            reported["store", event] = step
        for kind, event in issued:
            dst = (16 + event, device) if kind == "load" else (event, host)
            src = 48 + event if kind == "load" else event % 16
            row = dst[1][dst[0]]
            if (kind, event) in reported:
                assert torch.equal(row, source[kind][src]), (kind, event, step)
            else:  # never copied before it is reported
                assert torch.equal(row, before[kind][dst[0]]), (kind, event, step)
    return {key: (issued[key], reported.get(key)) for key in issued}


def test_each_copy_completes_0_to_3_steps_after_its_issue_and_is_reported_only_when_done():
    times = _drive(_worker(max_delay=3, seed=1), 60, random.Random(4))
    assert all(done is not None for _, done in times.values())  # drained within 60 steps
    delays = [done - issued for issued, done in times.values()]
    assert set(delays) == {0, 1, 2, 3}
    for kind in ("load", "store"):  # a stream reports in issue order
        order = [times[k][1] for k in sorted(k for k in times if k[0] == kind)]
        assert order == sorted(order)
    # Seeded: the same seed, the same steps; another seed, others.
    assert _drive(_worker(seed=1), 60, random.Random(4)) == times
    assert _drive(_worker(seed=2), 60, random.Random(4)) != times
    # No delay: the synchronous worker's timing.
    sync = _drive(_worker(max_delay=0), 60, random.Random(4))
    assert all(done == issued for issued, done in sync.values())


def test_a_waited_store_completes_before_the_steps_forward():
    """RocketKVHostMetadata.wait_store_event: the store named and every one
    issued before it are copied in bind_connector_metadata (before the
    forward) and reported in that step."""
    plain = _drive(_worker(seed=3), 12, random.Random(5))
    late = [
        e for (kind, e), (i, d) in plain.items() if kind == "store" and (d is None or d - i >= 2)
    ]
    assert late
    event = late[0]
    issued = plain["store", event][0]
    worker = _worker(seed=3)
    waited = _drive(worker, 12, random.Random(5), waits={issued + 1: event})
    assert worker.waits == [(issued + 1, event)]
    for e in range(event + 1):
        assert waited["store", e][1] <= issued + 1
    assert waited["store", event][1] == issued + 1


def test_a_preemption_step_completes_everything_in_flight():
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

    worker = _worker(seed=3)
    _drive(worker, 6, random.Random(5))
    assert any(worker._copies.values())  # in flight
    worker.handle_preemptions(SimpleCPUOffloadMetadata(need_flush=True))
    assert all(c.done.is_set() for copies in worker._copies.values() for c in copies)


def test_the_cuda_worker_makes_the_compute_stream_wait_for_the_named_store(monkeypatch):
    """The NVIDIA path of rule (a), interpreted on CPU with a fake stream:
    the compute stream waits on the event recorded after the named store (or
    a later one: stream order), once the copy thread has recorded it; not at
    all for a store known complete."""
    import threading

    from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

    from rocketkv_vllm.host_tier import cuda_worker
    from rocketkv_vllm.host_tier.scheduler import RocketKVHostMetadata

    waited = []

    class Stream:
        def wait_event(self, event):
            waited.append(event)

    monkeypatch.setattr(cuda_worker.torch.cuda, "current_stream", Stream)
    worker = cuda_worker.HostTierCudaWorker.adopt(SimpleCPUOffloadWorker(None, None, 0))
    worker._store_events = [(1, "after-1"), (3, "after-3")]
    worker.bind_connector_metadata(RocketKVHostMetadata(wait_store_event=2))
    assert waited == ["after-3"]
    worker._store_hwm = 5
    worker.bind_connector_metadata(RocketKVHostMetadata(wait_store_event=4))
    worker.bind_connector_metadata(RocketKVHostMetadata())
    assert waited == ["after-3"]
    recorded = threading.Timer(0.05, lambda: worker._store_events.append((7, "after-7")))
    recorded.start()
    worker.bind_connector_metadata(RocketKVHostMetadata(wait_store_event=7))
    assert waited == ["after-3", "after-7"]


def test_the_cuda_worker_stops_a_step_whose_store_is_never_recorded(monkeypatch):
    """No wait forever: a copy thread that died, or a store not recorded in
    time, is an error naming the store (compacting without the wait would
    cache compacted K/V under a dense hash)."""
    import threading
    from types import SimpleNamespace

    from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

    from rocketkv_vllm.host_tier import cuda_worker
    from rocketkv_vllm.host_tier.scheduler import RocketKVHostMetadata

    monkeypatch.setattr(cuda_worker.torch.cuda, "current_stream", lambda: None)
    worker = cuda_worker.HostTierCudaWorker.adopt(SimpleCPUOffloadWorker(None, None, 0))
    dead = threading.Thread(target=lambda: None)
    dead.start()
    dead.join()
    worker._backend = SimpleNamespace(_thread=dead)
    with pytest.raises(RuntimeError, match="store 2 was never recorded: vLLM's copy thread"):
        worker.bind_connector_metadata(RocketKVHostMetadata(wait_store_event=2))
    worker._backend = None
    worker._store_events = [(1, "after-1")]
    monkeypatch.setattr(cuda_worker, "RECORD_TIMEOUT_S", 0.05)
    with pytest.raises(RuntimeError, match=r"store 2 not recorded .* up to 1\)"):
        worker.bind_connector_metadata(RocketKVHostMetadata(wait_store_event=2))


# -- the NVIDIA path, with vLLM's platform faked as CUDA ----------------------


class _Platform:
    """vLLM's ``current_platform`` as far as the host tier asks it."""

    def __init__(self, device_name: str) -> None:
        self.device_name = device_name

    def is_cpu(self) -> bool:
        return self.device_name == "cpu"

    def is_cuda(self) -> bool:
        return self.device_name == "cuda"


def _host_tier_config(model_path, **kw):
    """A ROCKETKV engine's VllmConfig with ``--kv-offloading-size`` (built on
    vLLM's CPU build: its connector is the host tier's)."""
    from vllm.engine.arg_utils import EngineArgs

    from rocketkv_vllm.plugin import register

    register()
    args = dict(dtype="float32", max_model_len=1024, enforce_eager=True, kv_offloading_size=0.01)
    args.update(kw)
    return EngineArgs(model=model_path, attention_backend="ROCKETKV", **args).create_engine_config()


def test_on_nvidia_rocketkv_engines_get_the_host_tier_and_are_not_refused(model_path, monkeypatch):
    """With vLLM's platform CUDA: ``--kv-offloading-size`` names vLLM's
    offloading connector, which a ROCKETKV engine trades for the host tier's
    (a dense engine keeps vLLM's); the host tier is not refused there, every
    other refusal stands, and platforms other than CPU and CUDA are refused
    by name."""
    from types import SimpleNamespace

    import vllm.platforms

    from rocketkv_vllm.host_tier import (
        CONNECTOR_NAME,
        rocketkv_refusals,
        select_host_tier_connector,
    )

    config = _host_tier_config(model_path)
    monkeypatch.setattr(vllm.platforms, "current_platform", _Platform("cuda"))

    def selected(connector: str, rocketkv: bool) -> str:
        cfg = SimpleNamespace(
            cache_config=SimpleNamespace(kv_offloading_size=1.0, kv_offloading_backend="native"),
            kv_transfer_config=SimpleNamespace(kv_connector=connector),
        )
        select_host_tier_connector(cfg, rocketkv)
        return cfg.kv_transfer_config.kv_connector

    for vllms in ("OffloadingConnector", "SimpleCPUOffloadConnector"):
        assert selected(vllms, rocketkv=True) == CONNECTOR_NAME
        assert selected(vllms, rocketkv=False) == vllms
    assert rocketkv_refusals(config) == []
    monkeypatch.setattr(config.cache_config, "enable_prefix_caching", False)
    assert any("prefix caching" in r for r in rocketkv_refusals(config))
    monkeypatch.setattr(config.cache_config, "enable_prefix_caching", True)
    monkeypatch.setattr(vllm.platforms, "current_platform", _Platform("xpu"))
    assert selected("OffloadingConnector", rocketkv=True) == "OffloadingConnector"
    (reason,) = rocketkv_refusals(config)
    assert "'xpu'" in reason and "offloading" in reason


class _Event:
    """A CUDA event: ``record`` names what the stream ran before it."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        self.done = False  # what the device would answer (query)

    def query(self) -> bool:
        return self.done

    def record(self, stream) -> None:
        self.name = self.name or f"{stream.name}-done"

    def wait(self, stream) -> None:  # torch.cuda.Stream.wait_event calls it
        stream.log.append(("wait", stream.name, self.name))


class _Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_event(self, event) -> None:
        event.wait(self)


class _CopyBackend:
    """vLLM's ``DmaCopyBackend`` as the worker sees it: ``launch_copy`` queues
    the copy to a thread, which records the copy's event into the worker's
    list after the copy (here late: ``lag_s``)."""

    def __init__(self, log: list, lag_s: float) -> None:
        import queue
        import threading

        self.log, self.lag_s = log, lag_s
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True).start()

    def launch_copy(self, src, dst, is_store, event_idx, events_list, wait_event=None):
        self.queue.put((is_store, event_idx, events_list))

    def _loop(self) -> None:
        import time

        while True:
            is_store, event_idx, events_list = self.queue.get()
            time.sleep(self.lag_s)
            kind = "store" if is_store else "load"
            self.log.append(("copy", kind, event_idx))
            events_list.append((event_idx, _Event(f"{kind}-{event_idx}")))


def test_on_nvidia_the_connector_wraps_vllms_worker_and_stage1_waits_for_the_store(
    model_path, monkeypatch
):
    """The connector's worker half on CUDA is vLLM's CUDA worker adopted by
    ``HostTierCudaWorker``; driven in vLLM's worker order (bind, forward,
    loads, stores, completions) over a copy thread that records each
    store's event late, the step whose metadata names a pending store makes
    the compute stream wait on that store's event before its forward (rule
    (a)); the other steps add no wait."""
    import vllm.platforms
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadMetadata

    from rocketkv_vllm.host_tier.connector import HostTierConnector
    from rocketkv_vllm.host_tier.cuda_worker import HostTierCudaWorker
    from rocketkv_vllm.host_tier.scheduler import RocketKVHostMetadata

    config = _host_tier_config(model_path)
    monkeypatch.setattr(vllm.platforms, "current_platform", _Platform("cuda"))
    connector = HostTierConnector(config, KVConnectorRole.WORKER, None)
    worker = connector.worker_handler
    assert type(worker) is HostTierCudaWorker

    log: list = []
    compute = _Stream("compute", log)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: compute)
    monkeypatch.setattr(torch, "Event", _Event)  # vLLM's compute-done event before a store
    worker._backend = _CopyBackend(log, lag_s=0.05)

    def step(n: int, meta):
        connector.bind_connector_metadata(meta)
        log.append(("forward", n))
        connector.start_load_kv(None)
        connector.wait_for_save()
        connector.get_finished(set())
        connector.clear_connector_metadata()
        return connector.build_connector_worker_meta()

    # step 1 completes a target and stores it (event 0); step 2, its
    # prompt's Stage 1 step, compacts into it; step 3 names nothing.
    store = SimpleCPUOffloadMetadata(store_event=0, store_gpu_blocks=[3], store_cpu_blocks=[0])
    assert step(1, store) is None
    assert step(2, RocketKVHostMetadata(wait_store_event=0)) is None  # on the device still
    worker._store_events[0][1].done = True
    done = step(3, RocketKVHostMetadata())
    assert done is not None and done.completed_store_events == {0: 1}  # vLLM's report
    waits = [entry for entry in log if entry[0] == "wait"]
    assert waits == [("wait", "compute", "store-0")], log
    assert log.index(("copy", "store", 0)) < log.index(waits[0]) < log.index(("forward", 2))
    assert worker.waits == [0]


# -- the scheduler scenarios under asynchronous copies ------------------------

ASYNC = {"copy_mode": "async", "async_max_delay_steps": 3, "async_seed": 0}


@pytest.fixture(scope="module")
def async_engine(model_path):
    """test_host_tier_scheduler's ``engine`` scenario with async copies:
    documents one at a time, then asked again and followed up from the host."""
    engine = FakeEngine(model_path, host_gib=0.01, copy=ASYNC)
    docs = _prompts(3, [300, 260, 330, 280, 40])
    for i, doc in enumerate(docs):
        engine.add(f"doc-{i}", doc)
        engine.run()
    engine.add("again-0", docs[0])
    engine.add("follow-1", docs[1] + [9] * 50)
    engine.add("again-4", docs[4])
    engine.run()
    return engine


def test_async_copies_keep_every_cached_block_dense(async_engine):
    """check_host_blocks / check_device_blocks after every step and the
    forward's check that a prefill reads only dense K/V held; the copies
    were late, and the Stage 1 steps waited for their targets' stores."""
    engine = async_engine
    worker = engine.worker.worker_handler
    assert type(worker).__name__ == "AsyncHostCopyWorker"
    assert len(engine.checked) > 40
    assert worker.waits  # rule (a) was needed
    window = engine.settings.window_size
    # (request, prompt length, the document's full blocks the host holds)
    for req_id, prompt_len, held in (("again-0", 300, 300 // 16), ("follow-1", 310, 260 // 16)):
        local, host = engine.hit[req_id]
        assert local == 0 and host == min(held * 16, (prompt_len - window) // 16 * 16), req_id


def test_async_copies_leak_nothing(async_engine):
    pool = async_engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == async_engine.free_at_start
    assert sum(b.ref_cnt for b in async_engine.host.cpu_block_pool.blocks) == 0


def test_async_copies_with_preemptions_and_a_full_host(model_path):
    """test_host_tier_scheduler's crowded scenario (eight documents at once
    through a device pool for about two, a host for about 60 blocks) with
    async copies: preemptions while copies are in flight, every request
    completes, every block any tier holds under a hash stays dense."""
    engine = FakeEngine(
        model_path,
        host_gib=60 * BLOCK_BYTES / (1 << 30),
        num_blocks=34,
        copy=ASYNC | {"async_seed": 2},
    )
    docs = _prompts(5, [250 + 30 * i for i in range(8)])
    for i, doc in enumerate(docs):
        engine.add(f"doc-{i}", doc, max_tokens=120)
    engine.run()
    for i in reversed(range(8)):
        engine.add(f"again-{i}", docs[i] + [11] * 20)
    engine.run()
    requests = engine.requests.values()
    assert all(r.num_output_tokens == r.max_tokens for r in requests)
    assert sum(r.num_preemptions for r in requests) > 0
    assert sum(engine.hit[f"again-{i}"][1] for i in range(8)) > 0
    assert len(engine.checked) > 60
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == engine.free_at_start
    assert sum(b.ref_cnt for b in engine.host.cpu_block_pool.blocks) == 0


def test_async_copies_with_aborts_while_copies_are_in_flight(model_path):
    """Requests aborted while their host load is in flight (waiting for it),
    in the middle of their prefill (its blocks' stores in flight) and right
    after their Stage 1 step (the given-back blocks' stores in flight): the
    other requests complete, every block any tier holds under a hash stays
    dense after every step, and both pools get every block back (rule (c):
    vLLM keeps the blocks of a transfer until it is reported)."""
    from vllm.v1.request import RequestStatus

    engine = FakeEngine(model_path, host_gib=0.01, num_blocks=48, copy=ASYNC | {"async_seed": 3})
    docs = _prompts(7, [300, 260, 330, 280])
    for i, doc in enumerate(docs):  # the device evicts the first ones
        engine.add(f"doc-{i}", doc, max_tokens=16)
        engine.run()
    for i, doc in enumerate(docs):
        engine.add(f"again-{i}", doc + [5] * 10, max_tokens=16)
        engine.add(f"new-{i}", _prompts(20 + i, [200 + 20 * i])[0], max_tokens=16)
    aborted: dict[str, str] = {}  # phase -> request id

    def phase(request) -> str | None:
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return "loading"
        if request.status != RequestStatus.RUNNING:
            return None
        if 0 < request.num_computed_tokens < request.num_prompt_tokens:
            return "prefill"
        return "after-stage1" if request.num_output_tokens == 1 else None

    for _ in range(2000):
        if not engine.scheduler.has_requests():
            break
        engine.step()
        for req_id, request in engine.requests.items():
            now = None if request.is_finished() else phase(request)
            if now is not None and now not in aborted:
                aborted[now] = req_id
                engine.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
    assert not engine.scheduler.has_requests()
    assert set(aborted) == {"loading", "prefill", "after-stage1"}, aborted
    done = [r for r in engine.requests.values() if r.request_id not in aborted.values()]
    assert all(r.num_output_tokens == r.max_tokens for r in done)
    assert len(engine.checked) > 40
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == engine.free_at_start
    assert sum(b.ref_cnt for b in engine.host.cpu_block_pool.blocks) == 0
