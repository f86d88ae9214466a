"""The host tier (vLLM's KV offloading) on vLLM's CPU build.

Unit level: the worker's block regions address every layer's page of a
block in both placements vLLM uses, and a store then a load moves exactly
those bytes. Engine level: a dense engine started with vLLM's own flag
(``kv_offloading_size``) keeps a document's blocks on the host after the
device pool has evicted them, and a later request served from the host gives
the tokens and logprobs it gave when it computed everything itself. A
ROCKETKV engine with evicted blocks poisoned serves later requests from the
host at its window cap with caching-off's outputs, and every block it put on
the host equals the dense engine's block for the same prefix: with the host
tier's synchronous copies and with copies that complete 0-3 steps after their
issue, as on NVIDIA (``ASYNC_COPIES``).
"""

from __future__ import annotations

import random
from dataclasses import asdict

import pytest
import torch
from conftest import make_llm, shutdown

from rocketkv_vllm.host_tier.cpu_worker import block_regions, copy_blocks


def _config(num_blocks: int, tensors) -> object:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=[])


def _layer_pages(storage: torch.Tensor, tensor, layer: int, block: int, page: int):
    start = tensor.offset + layer * tensor.layer_stride + block * tensor.block_stride
    return storage[start : start + page]


@pytest.mark.parametrize("outermost", ["layer", "block"])
def test_block_regions_cover_every_layers_page(outermost):
    from vllm.v1.kv_cache_interface import KVCacheTensor

    num_blocks, page, layers = 6, 40, ["l0", "l1", "l2"]
    size = num_blocks * page * len(layers)
    if outermost == "layer":
        tensor = KVCacheTensor(size, layers, layer_stride=num_blocks * page, block_stride=page)
    else:
        tensor = KVCacheTensor(size, layers, layer_stride=page, block_stride=page * len(layers))
    storage = torch.randint(-128, 127, (size,), dtype=torch.int8)
    kv_caches = {name: storage.view(torch.float32) for name in layers}  # views of one allocation
    regions = block_regions(_config(num_blocks, [tensor]), kv_caches)

    covered = sum(r.shape[1] for r in regions.values())
    assert covered == page * len(layers)  # each block's bytes once, no more
    for block in range(num_blocks):
        row = torch.cat([r[block] for r in regions.values()])
        pages = torch.cat(
            [_layer_pages(storage, tensor, i, block, page) for i in range(len(layers))]
        )
        assert torch.equal(row, pages)


def test_store_then_load_moves_exactly_the_named_blocks():
    from vllm.v1.kv_cache_interface import KVCacheTensor

    num_blocks, page, layers = 5, 16, ["a", "b"]
    tensor = KVCacheTensor(
        num_blocks * page * 2, layers, layer_stride=num_blocks * page, block_stride=page
    )
    storage = torch.randint(-128, 127, (num_blocks * page * 2,), dtype=torch.int8)
    device = block_regions(_config(num_blocks, [tensor]), {n: storage for n in layers})
    host = {n: torch.zeros(3, r.shape[1], dtype=torch.int8) for n, r in device.items()}
    before = {n: r.clone() for n, r in device.items()}

    copy_blocks(device, host, [4, 1], [0, 2])  # store device 4 -> host 0, 1 -> 2
    copy_blocks(host, device, [2, 0], [0, 3])  # load host 2 -> device 0, 0 -> 3
    for name in layers:
        assert torch.equal(host[name][0], before[name][4])
        assert torch.equal(host[name][2], before[name][1])
        assert not host[name][1].any()
        assert torch.equal(device[name][0], before[name][1])
        assert torch.equal(device[name][3], before[name][4])
        for untouched in (1, 2, 4):
            assert torch.equal(device[name][untouched], before[name][untouched])


def test_offloading_flag_selects_the_host_tier_on_cpu(model_path):
    from vllm.engine.arg_utils import EngineArgs

    from rocketkv_vllm.host_tier import CONNECTOR_NAME

    def config(**kw):
        return EngineArgs(
            model=model_path, attention_backend="CPU_ATTN", max_model_len=2048, **kw
        ).create_engine_config()

    transfer = config(kv_offloading_size=0.5).kv_transfer_config
    assert transfer.kv_connector == CONNECTOR_NAME
    assert transfer.kv_connector_extra_config["cpu_bytes_to_use"] == 0.5 * (1 << 30)
    assert config().kv_transfer_config is None


# The engine tests run the tiny random Llama (conftest ``tiny``: every oracle
# here is another engine run): fp32, 2 layers x 1 KV head x 64 x (K, V) x 4
# bytes per token.
LAYERS = 2
BYTES_PER_TOKEN = LAYERS * 1 * 64 * 2 * 4
BLOCK = 32


def _documents():
    rng = random.Random(11)
    return [[rng.randrange(100, 40000) for _ in range(2000)] + [5, 6, 7] for _ in range(4)]


def host_pages(llm, docs) -> dict[tuple[int, int], torch.Tensor]:
    """The bytes (every layer's K and V page, as fp32) of each document block
    the engine's host tier holds, by (document, block index). Blocks are
    found under the hashes vLLM gives the document's tokens."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.request import Request

    core = llm.llm_engine.engine_core.engine_core
    host = core.scheduler.connector.scheduler_manager.cpu_block_pool
    buffers = get_kv_transfer_group().worker_handler.cpu_kv_caches  # this process's worker
    pages = {}
    for d, tokens in enumerate(docs):
        request = Request(
            f"hashes-{d}",
            tokens,
            SamplingParams(max_tokens=1),
            None,
            block_hasher=core.request_block_hasher,
        )
        for j, block_hash in enumerate(request.block_hashes):
            (block,) = host.get_cached_block(block_hash, [0]) or (None,)
            if block is not None:
                row = torch.cat([b[block.block_id] for b in buffers.values()])
                pages[d, j] = row.view(torch.float32).clone()
    return pages


@pytest.fixture(scope="module")
def dense_run(tiny):
    """Four 2,000-token documents through a dense engine whose device pool
    holds ~3k tokens, so the first one's blocks are evicted and reused by the
    others (their K/V overwrites them); then the first document again."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rocketkv_eval.engines import scheduler
    from rocketkv_vllm.host_tier.connector import HostTierConnector

    docs = _documents()
    llm = make_llm(
        tiny,
        "CPU_ATTN",
        max_model_len=2100,
        block_size=BLOCK,
        kv_cache_memory_bytes=BYTES_PER_TOKEN * 3200,
        max_num_batched_tokens=1024,
        kv_offloading_size=0.5,
        disable_log_stats=False,
    )
    try:
        sched = scheduler(llm)
        assert isinstance(sched.connector, HostTierConnector)
        device_blocks = sched.kv_cache_manager.block_pool.get_num_free_blocks()
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)

        def run(tokens):
            out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
            return out[0]

        first = [run(d) for d in docs]
        again = run(docs[0])
        return {
            "docs": docs,
            "first": first,
            "again": again,
            "cached": {
                m.labels["source"]: m.value
                for m in llm.get_metrics()
                if m.name == "vllm:prompt_tokens_cached_by_source"
            },
            "device_blocks": device_blocks,
            "device_free_at_end": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
            "pages": host_pages(llm, docs),
        }
    finally:
        shutdown(llm)


@pytest.mark.engine
def test_evicted_document_comes_back_from_the_host(dense_run):
    """The first document asked again is served from the host: its prefix
    is loaded into freshly allocated, stale blocks, and any block not loaded
    or loaded wrong changes the logprobs."""
    run = dense_run
    docs, first, again = run["docs"], run["first"], run["again"]
    assert run["device_blocks"] * BLOCK < sum(len(d) for d in docs)  # the first is evicted
    assert all(o.num_cached_tokens == 0 for o in first)
    full_blocks = len(docs[0]) // BLOCK * BLOCK
    assert again.num_cached_tokens == full_blocks
    assert run["cached"]["host"] == full_blocks and run["cached"]["device"] == 0

    want, got = first[0].outputs[0], again.outputs[0]
    assert got.token_ids == want.token_ids
    for w, g, tok in zip(want.logprobs, got.logprobs, want.token_ids):
        assert abs(w[tok].logprob - g[tok].logprob) < 1e-4
    assert run["device_free_at_end"] == run["device_blocks"]
    # Every full block of every document went to the host.
    assert set(run["pages"]) == {(d, j) for d in range(4) for j in range(len(docs[d]) // BLOCK)}


# -- ROCKETKV with the host tier ----------------------------------------------

ROCKETKV = {"prompt_budget": 256}  # window_size 32: hits stop 32+ tokens before the end
POISON = {"poison_evicted_blocks": True}


def _asks(docs):
    return {
        "same-prompt": docs[0],  # the host holds more of it than the window cap allows
        "follow-up": docs[1] + [30001] * 40 + [8, 9, 10],
    }


def _spy_on_vllms_loggers(llm) -> list[dict]:
    """The scheduler stats' KV-fetch dicts as the offline engine's vLLM
    loggers get them (its LoggingStatLogger prints a "KV fetch" line for any
    entry there), wherever ROCKETKV's logger stands among them."""
    seen = []
    for stat_logger in llm.llm_engine.logger_manager.stat_loggers:
        if not type(stat_logger).__module__.startswith("vllm."):
            continue

        def record(scheduler_stats, *args, _record=stat_logger.record, **kwargs):
            if scheduler_stats is not None:
                seen.append(dict(scheduler_stats.num_kv_fetch_reqs_by_stage))
            return _record(scheduler_stats, *args, **kwargs)

        stat_logger.record = record
    return seen


def _exported(name: str) -> float | None:
    """This process's Prometheus sample ``name`` (the offline engine's)."""
    from prometheus_client import REGISTRY

    return next((s.value for m in REGISTRY.collect() for s in m.samples if s.name == name), None)


# The host tier's copies complete 0-3 steps after their issue, as on NVIDIA
# (host_tier.async_cpu_worker; docs/design.md, "Host tier under asynchronous copies").
ASYNC_COPIES = {"copy_mode": "async", "async_max_delay_steps": 3, "async_seed": 0}


def _drain(llm) -> None:
    """Step the engine until no copy is in flight (vLLM's scheduler keeps
    stepping while stores are pending; ``generate`` returns before)."""
    core = llm.llm_engine.engine_core.engine_core
    for _ in range(100):
        if not core.scheduler.has_requests():
            return
        core.step()
    raise AssertionError("host-tier copies still in flight after 100 steps")


def _rocketkv_run(model_path, host: bool, copies: dict | None = None) -> dict:
    """Four compressed documents through a device pool that holds one dense
    prefill, then two later requests on the first two documents.
    Given-back blocks poisoned; ``host=False``: prefix caching off;
    ``copies``: the host tier's copy mode (``ASYNC_COPIES``)."""
    from vllm import SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from rocketkv_eval.engines import scheduler
    from rocketkv_vllm.kv_cache import rocketkv_manager

    kw = dict(kv_offloading_size=1.0) if host else dict(enable_prefix_caching=False)
    if copies:
        kw["kv_transfer_config"] = KVTransferConfig(kv_connector_extra_config=dict(copies))
    llm = make_llm(
        model_path,
        "ROCKETKV",
        rocketkv=ROCKETKV,
        testing=POISON,
        max_model_len=2100,
        block_size=BLOCK,
        kv_cache_memory_bytes=BYTES_PER_TOKEN * 3200,
        max_num_batched_tokens=1024,
        disable_log_stats=False,
        **kw,
    )
    try:
        vllm_loggers_saw = _spy_on_vllms_loggers(llm)
        sched = scheduler(llm)
        pool = sched.kv_cache_manager.block_pool
        free_at_start = pool.get_num_free_blocks()
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
        docs = _documents()
        prompts = {f"doc-{i}": d for i, d in enumerate(docs)} | _asks(docs)
        outs = {}
        for name, tokens in prompts.items():  # one at a time: a fixed order of evictions
            (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
            outs[name] = out
        _drain(llm)
        cached = {
            m.labels["source"]: m.value
            for m in llm.get_metrics()
            if m.name == "vllm:prompt_tokens_cached_by_source"
        }
        host_pool = sched.connector.scheduler_manager.cpu_block_pool if host else None
        return {
            "prompts": prompts,
            "outs": outs,
            "cached": cached,
            "device_blocks": free_at_start,
            "device_free_at_end": pool.get_num_free_blocks(),
            "host_in_use": None if host_pool is None else sum(b.ref_cnt for b in host_pool.blocks),
            "pages": host_pages(llm, docs) if host else None,
            "account": asdict(rocketkv_manager(sched.kv_cache_manager).prefix_account),
            "vllm_loggers_saw": vllm_loggers_saw,
            "exported_host_blocks_stored": _exported("rocketkv:host_blocks_stored_total"),
            # Store events the async worker finished before a Stage 1 forward.
            "waits": list(getattr(get_kv_transfer_group().worker_handler, "waits", []))
            if host
            else None,
        }
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def rocketkv_runs(tiny):
    """The host tier with synchronous copies ("host") and with async ones
    ("async"), and prefix caching off ("off")."""
    return {
        "host": _rocketkv_run(tiny, True),
        "async": _rocketkv_run(tiny, True, ASYNC_COPIES),
        "off": _rocketkv_run(tiny, False),
    }


HOST_COPIES = pytest.mark.parametrize("copies", ["host", "async"])


@pytest.mark.engine
@HOST_COPIES
def test_rocketkv_later_requests_are_served_from_the_host(copies, rocketkv_runs):
    run = rocketkv_runs[copies]
    assert run["device_blocks"] * BLOCK < 2 * 2003  # the documents cannot stay on the device
    outs, prompts = run["outs"], run["prompts"]
    assert all(outs[f"doc-{i}"].num_cached_tokens == 0 for i in range(4))
    for name in _asks(_documents()):
        # Everything but the prompt's last window_size (32) tokens, in whole blocks.
        cap = (len(prompts[name]) - 32) // BLOCK * BLOCK
        assert outs[name].num_cached_tokens == cap, name
    # The identical prompt: the host holds 62 blocks of it, the cap takes 61.
    assert outs["same-prompt"].num_cached_tokens == 61 * BLOCK
    asked = sum(outs[n].num_cached_tokens for n in _asks(_documents()))
    assert run["cached"]["host"] == asked and run["cached"]["device"] == 0


@pytest.mark.engine
@HOST_COPIES
def test_rocketkv_with_the_host_tier_equals_caching_off(copies, rocketkv_runs):
    """Host-loaded targets are compacted like computed ones, host-loaded
    middle blocks re-scored by Stage 1: the same tokens and logprobs."""
    on, off = rocketkv_runs[copies]["outs"], rocketkv_runs["off"]["outs"]
    for name, want in off.items():
        got = on[name].outputs[0]
        assert got.token_ids == want.outputs[0].token_ids, name
        for w, g, tok in zip(want.outputs[0].logprobs, got.logprobs, got.token_ids):
            assert abs(w[tok].logprob - g[tok].logprob) < 1e-4, name


@pytest.mark.engine
@HOST_COPIES
def test_rocketkv_host_blocks_hold_dense_kv(copies, rocketkv_runs, dense_run):
    """What a compressed engine puts on the host is the dense K/V of its
    token prefix: each host block equals the dense CPU_ATTN engine's block
    for the same document and position (compaction targets included, which
    Stage 1 overwrites on the device right after they are stored)."""
    pages, dense = rocketkv_runs[copies]["pages"], dense_run["pages"]
    if copies == "async":  # the targets' stores were still pending at some Stage 1
        assert rocketkv_runs[copies]["waits"]
    docs = _documents()
    # The whole chain of every document from block 0 (targets first).
    assert set(pages) == {(d, j) for d in range(4) for j in range(len(docs[d]) // BLOCK)}
    for key, got in pages.items():
        want = dense[key].view(LAYERS, -1)
        # Each layer's page: the K/V block in CPU_ATTN's layout, then KT pages.
        got = got.view(LAYERS, -1)[:, : want.shape[1]]
        assert torch.isfinite(got).all(), key
        torch.testing.assert_close(
            got, want, rtol=1e-4, atol=1e-4, msg=lambda m, key=key: f"{key}: {m}"
        )


@pytest.mark.engine
@HOST_COPIES
def test_rocketkv_host_tier_account(copies, rocketkv_runs):
    """The counters behind rocketkv:host_* (metrics): what was stored,
    loaded and left unused, against what the test's requests imply."""
    run = rocketkv_runs[copies]
    account, docs = run["account"], _documents()
    full = [len(d) // BLOCK for d in docs]  # 62 full blocks per document
    # Every document's full blocks, and the follow-up's one new full block.
    assert account["host_blocks_stored"] == sum(full) + 1
    # Targets: the blocks the kept tokens are compacted into, per document.
    assert account["host_target_blocks_stored"] == 4 * (256 // BLOCK)
    assert account["host_target_blocks_dropped"] == 0
    assert account["host_blocks_loaded"] * BLOCK == run["cached"]["host"]
    # The same prompt: the host's 62nd block lies in the window.
    assert account["host_tokens_recomputed"] == BLOCK
    assert account["tokens_recomputed"] == 0  # nothing left on the device
    block_bytes = account["host_bytes_stored"] // account["host_blocks_stored"]
    assert block_bytes * 4 == BYTES_PER_TOKEN * BLOCK * 5  # K/V plus KT pages (1.25x)
    assert account["host_bytes_loaded"] == account["host_blocks_loaded"] * block_bytes


@pytest.mark.engine
def test_the_account_reaches_rocketkvs_logger_only(rocketkv_runs):
    """Issue 57, finding 4: the offline LLM with stats on (as the project's
    benchmarks run). The account rides in vLLM's scheduler stats; ROCKETKV's
    logger, first in line, takes it out: vLLM's loggers get none of it (no
    "KV fetch" line), the rocketkv:* counter gets all of it."""
    run = rocketkv_runs["host"]
    saw = run["vllm_loggers_saw"]
    assert saw and run["account"]["host_blocks_stored"] > 0
    assert [d for d in saw if any(str(k).startswith("rocketkv") for k in d)] == []
    assert run["exported_host_blocks_stored"] == run["account"]["host_blocks_stored"]


@pytest.mark.engine
@HOST_COPIES
def test_rocketkv_host_tier_leaks_nothing(copies, rocketkv_runs):
    run = rocketkv_runs[copies]
    assert run["device_free_at_end"] == run["device_blocks"]
    assert run["host_in_use"] == 0


# -- the budget-1024 preset at prompt lengths whose targets end at the end ----

BOUNDARY_LENGTHS = (832, 960)  # 832: the last target is the prompt's last block


def _boundary_run(model_path, host: bool) -> dict:
    """Each prompt asked twice under the shipped ``budget-1024`` preset;
    with the host tier the device's prefix cache is reset between, so the
    second ask takes what the host holds into stale device blocks (given-back
    blocks poisoned). ``host=False``: prefix caching off."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rocketkv_eval.engines import scheduler
    from rocketkv_vllm.kv_cache import rocketkv_manager

    kw = dict(kv_offloading_size=1.0) if host else dict(enable_prefix_caching=False)
    llm = make_llm(
        model_path,
        "ROCKETKV",
        rocketkv={"preset": "budget-1024"},
        testing=POISON,
        max_model_len=1024,
        block_size=BLOCK,
        max_num_batched_tokens=1024,
        **kw,
    )
    try:
        manager = rocketkv_manager(scheduler(llm).kv_cache_manager)
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
        rng = random.Random(23)
        run = {"plans": {}, "outs": {}}
        for n in BOUNDARY_LENGTHS:
            prompt = TokensPrompt(prompt_token_ids=[rng.randrange(100, 40000) for _ in range(n)])
            run["plans"][n] = manager.plans(n)
            for ask in ("first", "again"):
                (out,) = llm.generate([prompt], params, use_tqdm=False)
                run["outs"][n, ask] = out
                if host:
                    assert llm.reset_prefix_cache()
        return run
    finally:
        shutdown(llm)


@pytest.mark.engine
def test_budget_preset_at_the_kept_token_boundary_equals_caching_off(tiny):
    """At 832 tokens budget-1024's compaction targets end at the prompt's
    end, so the last one is written in the Stage 1 step: the host once stored
    the compacted targets under their dense hashes there, and the second ask
    computed on them (logprobs off by 2.65). Now every answer, the second
    one with whatever the host holds loaded, equals caching off. (Caching on
    ends the first chunk at the targets' end, caching off prefills in one:
    logprobs differ by up to 6e-4 from the summation order alone.)"""
    host, off = _boundary_run(tiny, True), _boundary_run(tiny, False)
    plan = host["plans"][832]
    assert plan.compress and plan.compact_blocks(BLOCK) * BLOCK == 832  # the boundary case
    assert host["outs"][960, "again"].num_cached_tokens > 0  # served from the host
    for key, out in host["outs"].items():
        want, got = off["outs"][key].outputs[0], out.outputs[0]
        assert got.token_ids == want.token_ids, key
        for w, g, tok in zip(want.logprobs, got.logprobs, got.token_ids):
            assert abs(w[tok].logprob - g[tok].logprob) < 5e-3, key
