"""The host tier's rules at the scheduler, with fake requests and a fake forward.

vLLM's real ``Scheduler`` (ROCKETKV's block manager, the host-tier connector's
scheduler half) and the connector's real worker half (the synchronous copy
worker) on a one-layer KV cache of a few blocks, no model. The fake forward
writes into every slot it computes a value that names the slot's token
prefix: the *dense* K/V. It writes what ROCKETKV writes that is not dense K/V
as markers: a compressed request's compaction targets in its Stage 1 step,
and its generated tokens. So every host block can be checked against the
prefix its hash names, after every step: only dense K/V of hashed blocks
reaches the host. Hits are checked against the window cap, and both pools
against leaks.
"""

from __future__ import annotations

import random
import zlib

import pytest
import torch

BS = 16
NUM_BLOCKS = 64  # device pool: fewer than the documents need
LAYER = "model.layers.0.self_attn.attn"
COMPACTED, GENERATED = -1.0, -2.0  # what the fake forward writes that is not dense


def dense_value(prefix: list[int]) -> float:
    """The fake K/V of a slot: a function of its token prefix only."""
    return float(zlib.crc32(str(prefix).encode()) % 100_003)


class FakeEngine:
    """vLLM's scheduler and the host tier's worker half around a fake forward."""

    def __init__(
        self,
        model_path: str,
        host_gib: float,
        num_blocks: int = NUM_BLOCKS,
        batched_tokens: int = 128,
        max_num_seqs: int = 4,
        rocketkv: dict | None = None,
        copy: dict | None = None,
    ):
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )
        from vllm.v1.structured_output import StructuredOutputManager

        from rocketkv_vllm.config import settings_for
        from rocketkv_vllm.host_tier.connector import HostTierConnector
        from rocketkv_vllm.kv_cache import make_rocketkv_spec, rocketkv_manager
        from rocketkv_vllm.plugin import register

        register()
        config = EngineArgs(
            model=model_path,
            attention_backend="ROCKETKV",
            block_size=BS,
            max_model_len=1024,
            max_num_batched_tokens=batched_tokens,
            max_num_seqs=max_num_seqs,
            kv_offloading_size=host_gib,
            dtype="float32",
            enforce_eager=True,
            additional_config={"rocketkv": rocketkv or {"prompt_budget": 64}},  # window 32
            # The host tier's copy mode (test_host_tier_async: "async").
            kv_transfer_config=KVTransferConfig(kv_connector_extra_config=dict(copy or {})),
        ).create_engine_config()
        config.cache_config.num_gpu_blocks = num_blocks
        self.settings = settings_for(config)
        base = FullAttentionSpec(block_size=BS, num_kv_heads=3, head_size=64, dtype=torch.float32)
        spec = make_rocketkv_spec(base, self.settings)
        page = spec.page_size_bytes
        kv_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(num_blocks * page, [LAYER], num_blocks * page, page)],
            kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)],
        )
        self.scheduler = Scheduler(
            config, kv_config, StructuredOutputManager(config), block_size=BS
        )
        self.host = self.scheduler.connector.scheduler_manager
        self.rocketkv = rocketkv_manager(self.scheduler.kv_cache_manager)
        self.worker = HostTierConnector(config, KVConnectorRole.WORKER, kv_config)
        storage = torch.zeros(num_blocks * page, dtype=torch.int8)
        self.worker.register_kv_caches({LAYER: storage})
        # Slot s of block b is kv[b, s] (the first BS floats of each page).
        self.kv = storage.view(torch.float32).view(num_blocks, -1)
        self.host_kv = self.worker.worker_handler.cpu_kv_caches[LAYER]
        self.hasher = self.scheduler_hasher(config)
        self.requests: dict[str, object] = {}
        self.hit: dict[str, tuple[int, int]] = {}  # id -> (local, host) tokens
        self.tokens_of_hash: dict[object, list[int]] = {}
        self.checked: set[object] = set()  # host blocks checked, by hash
        self.device_checked = 0  # hashed device blocks checked, over all steps
        self.dense_block: dict[object, list[float]] = {}  # hash -> its dense values
        self.free_at_start = self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        lookup = self.host.get_num_new_matched_tokens

        def record_hit(request, num_computed_tokens):  # the last lookup: (local, host)
            found, load_async = lookup(request, num_computed_tokens)
            self.hit[request.request_id] = (num_computed_tokens, found)
            return found, load_async

        self.host.get_num_new_matched_tokens = record_hit

    @staticmethod
    def scheduler_hasher(config):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        return get_request_block_hasher(BS, hash_fn)

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 24) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(req_id, prompt, params, None, block_hasher=self.hasher)
        self.requests[req_id] = request
        self.scheduler.add_request(request)

    def plan(self, request):
        return self.rocketkv.plan_of_request(request)

    def plan_for(self, num_prompt_tokens: int):
        return self.rocketkv.plans(num_prompt_tokens)

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        # The block copies the scheduler asked for (copy-on-write of prefix
        # hits, preserved compaction targets) run before the step, as the
        # model runner runs them.
        for src, dst in out.kv_cache_block_copies or ():
            self.kv[dst] = self.kv[src]
        self.worker.handle_preemptions(out.kv_connector_metadata)  # as the runner does
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)
        sampled = {}
        for req_id, n in out.num_scheduled_tokens.items():
            sampled[req_id] = self.forward(self.requests[req_id], n)
        self.worker.wait_for_save()
        _, recving = self.worker.get_finished(out.finished_req_ids)
        connector_out = KVConnectorOutput(
            finished_recving=recving,
            kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
        )
        self.worker.clear_connector_metadata()
        ids = list(out.num_scheduled_tokens)
        self.scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[sampled[r] for r in ids],
                kv_connector_output=connector_out,
            ),
        )
        for request in self.requests.values():
            for j, block_hash in enumerate(request.block_hashes):
                self.tokens_of_hash[block_hash] = request.all_token_ids[: (j + 1) * BS]
        self.check_host_blocks()
        self.check_device_blocks()

    def forward(self, request, n: int) -> list[int]:
        """Write the step's slots; Stage 1 compacts at the prompt's end."""
        (row,) = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)
        # schedule() has advanced num_computed_tokens past this step's tokens.
        start, prompt = request.num_computed_tokens - n, request.num_prompt_tokens
        tokens = request.all_token_ids
        plan = self.plan(request)
        if start < prompt:
            # A prefill step reads the K/V of every earlier slot: dense
            # (computed, copied from a device hit or loaded from the host).
            got = [self.kv[row[pos // BS], pos % BS].item() for pos in range(start)]
            want = [dense_value(tokens[: pos + 1]) for pos in range(start)]
            bad = [pos for pos in range(start) if got[pos] != want[pos]]
            assert not bad, (request.request_id, "reads non-dense K/V at", bad[:4])
        for pos in range(start, start + n):
            value = dense_value(tokens[: pos + 1])
            if pos >= prompt and plan.compress:
                value = GENERATED  # attends to the compressed view: not dense
            self.kv[row[pos // BS], pos % BS] = value
        if start < prompt <= start + n and plan.compress:
            for j in range(plan.compact_blocks(BS)):
                self.kv[row[j], :BS] = COMPACTED
        return [7] if start + n >= prompt else []

    def dense_of(self, block_hash) -> list[float]:
        """The dense K/V of the block a hash (with its group id) names."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        key = get_block_hash(block_hash)
        if key not in self.dense_block:
            tokens = self.tokens_of_hash[key]
            start = len(tokens) - BS
            self.dense_block[key] = [dense_value(tokens[: start + s + 1]) for s in range(BS)]
        return self.dense_block[key]

    def check_host_blocks(self) -> None:
        """Every block the host holds is dense K/V of the prefix its hash names."""
        for block in self.host.cpu_block_pool.blocks:
            if block.block_hash is None:
                continue
            got = self.host_kv[block.block_id].view(torch.float32)[:BS].tolist()
            assert got == self.dense_of(block.block_hash), ("host", block.block_id, got[:4])
            self.checked.add(block.block_hash)

    def check_device_blocks(self) -> None:
        """Every block the device's prefix cache holds is dense K/V of the
        prefix its hash names."""
        for block in self.scheduler.kv_cache_manager.block_pool.blocks:
            if block.block_hash is None or block.is_null:
                continue
            got = self.kv[block.block_id, :BS].tolist()
            assert got == self.dense_of(block.block_hash), ("device", block.block_id, got[:4])
            self.device_checked += 1

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def engine(model_path):
    engine = FakeEngine(model_path, host_gib=0.01)
    docs = _prompts(3, [300, 260, 330, 280, 40])  # the last one is not compressed
    for i, doc in enumerate(docs):
        engine.add(f"doc-{i}", doc)
        engine.run()
    engine.add("again-0", docs[0])  # the device has evicted it
    engine.add("follow-1", docs[1] + [9] * 50)
    engine.add("again-4", docs[4])
    engine.run()
    engine.docs = docs
    return engine


def test_only_dense_kv_of_hashed_blocks_reaches_the_host(engine):
    assert len(engine.checked) > 40  # checked after every step by check_host_blocks


def test_host_hits_start_at_block_zero_and_stop_before_the_window(engine):
    window = engine.settings.window_size
    # (request, prompt length, the document's full blocks the host holds)
    for req_id, prompt_len, held in (("again-0", 300, 300 // BS), ("follow-1", 310, 260 // BS)):
        local, host = engine.hit[req_id]
        assert local == 0 and host > 0, req_id  # from the host, from block 0
        cap = (prompt_len - window) // BS * BS
        assert local + host == min(held * BS, cap), req_id
    assert engine.hit["again-0"][1] == 256  # the cap: the host holds 288
    local, host = engine.hit["again-4"]
    assert local + host == 40 // BS * BS  # not compressed: every full block


def test_nothing_leaks(engine):
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == engine.free_at_start
    assert sum(b.ref_cnt for b in engine.host.cpu_block_pool.blocks) == 0


# -- many requests at once: preemptions, a host smaller than the documents ----

BLOCK_BYTES = 16 * 3 * 2 * 64 * 4 * 5 // 4  # one layer's K/V block plus its KT pages


@pytest.fixture(scope="module")
def crowded(model_path):
    """Eight documents at once through a device pool for about two, then
    all of them asked again at once, with a host tier for about 60 blocks:
    preemptions on the device, LRU evictions on the host, compaction targets
    the full host pool cannot take."""
    engine = FakeEngine(model_path, host_gib=60 * BLOCK_BYTES / (1 << 30), num_blocks=34)
    docs = _prompts(5, [250 + 30 * i for i in range(8)])
    for i, doc in enumerate(docs):
        engine.add(f"doc-{i}", doc, max_tokens=120)  # long answers: preemptions
    engine.run()
    for i in reversed(range(8)):  # the last documents first: the host holds them
        engine.add(f"again-{i}", docs[i] + [11] * 20)
    engine.run()
    return engine


def test_crowded_host_holds_only_dense_kv_and_every_request_completes(crowded):
    """check_host_blocks ran after every step; every request produced all its
    tokens; the scenario did preempt and did fill the host."""
    requests = crowded.requests.values()
    assert all(r.num_output_tokens == r.max_tokens for r in requests)
    assert sum(r.num_preemptions for r in requests) > 0
    account = crowded.rocketkv.prefix_account
    assert account.host_target_blocks_dropped > 0 or account.host_blocks_stored > 60
    assert len(crowded.checked) > 60


def test_crowded_hits_stay_below_the_window(crowded):
    window = crowded.settings.window_size
    for request in crowded.requests.values():
        local, host = crowded.hit[request.request_id]
        assert local + host <= (request.num_prompt_tokens - window) // BS * BS
    assert sum(crowded.hit[f"again-{i}"][1] for i in range(8)) > 0  # some from the host


def test_crowded_nothing_leaks(crowded):
    pool = crowded.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == crowded.free_at_start
    assert sum(b.ref_cnt for b in crowded.host.cpu_block_pool.blocks) == 0


def test_crowded_host_chains_have_no_holes(model_path):
    """With a host for every document, each one's full prompt blocks all
    reach it although the device reuses given-back blocks at once (vLLM
    would store those one step late; a block reused by then is a hole that
    ends every later hit there). Long chunks: most blocks are completed in
    the Stage 1 step itself."""
    engine = FakeEngine(
        model_path, host_gib=400 * BLOCK_BYTES / (1 << 30), num_blocks=34, batched_tokens=512
    )
    docs = _prompts(5, [250 + 30 * i for i in range(8)])
    for i, doc in enumerate(docs):
        engine.add(f"doc-{i}", doc, max_tokens=120)
    engine.run()
    host = engine.host.cpu_block_pool
    for i, doc in enumerate(docs):
        hashes = engine.requests[f"doc-{i}"].block_hashes[: len(doc) // BS]
        missing = [j for j, h in enumerate(hashes) if not host.get_cached_block(h, [0])]
        assert missing == [], (i, missing)


def test_unused_host_tokens_count_once_per_admission(model_path):
    """A request whose blocks do not fit waits, and is looked up again every
    step; the host tokens its cap leaves unused
    (``rocketkv:host_tokens_recomputed``) count once, when it is admitted."""
    engine = FakeEngine(model_path, host_gib=0.01, num_blocks=34)
    docs = _prompts(3, [300, 260, 330, 280])
    for i, doc in enumerate(docs):  # the device evicts the first ones
        engine.add(f"doc-{i}", doc)
        engine.run()
    engine.add("long-answer", _prompts(4, [40])[0], max_tokens=420)  # 29 blocks at the end
    for _ in range(320):
        engine.step()
    engine.add("again-0", docs[0])  # its host hit needs 16 blocks: it waits
    lookups = 0
    while engine.requests["again-0"].num_computed_tokens == 0:
        engine.step()
        lookups += 1
    engine.run()
    assert lookups > 10
    window = engine.settings.window_size
    cap = (300 - window) // BS * BS
    assert engine.hit["again-0"] == (0, cap)
    assert engine.rocketkv.prefix_account.host_tokens_recomputed == 300 // BS * BS - cap == 32


def test_a_tiny_host_pool_is_never_overcommitted(model_path):
    """Eight documents at once, a host pool of 8 blocks: in one step, one
    prompt's given-back blocks and another's compaction targets compete for
    it; what does not fit is not stored (vLLM's pool raises, killing the
    engine, when asked for more blocks than it has free)."""
    engine = FakeEngine(model_path, host_gib=8 * BLOCK_BYTES / (1 << 30), num_blocks=60)
    docs = _prompts(0, [200 + 37 * i for i in range(8)])
    for i, doc in enumerate(docs):
        engine.add(f"doc-{i}", doc, max_tokens=30)
    engine.run()  # every host block checked after every step
    assert all(r.num_output_tokens == 30 for r in engine.requests.values())
    assert engine.rocketkv.prefix_account.host_target_blocks_dropped > 0
    assert sum(b.ref_cnt for b in engine.host.cpu_block_pool.blocks) == 0


# -- every prompt length around the kept-token boundary ----------------------


def _boundary_lengths(engine, lo: int, hi: int) -> tuple[list[int], list[int]]:
    """Prompt lengths in [lo, hi) whose compaction targets end exactly at the
    prompt's end (the last target is written in the Stage 1 step itself),
    with their neighbours and the multiples of the block size between."""
    triggers = [
        n
        for n in range(lo, hi)
        if engine.plan_for(n).compress and engine.plan_for(n).compact_blocks(BS) * BS == n
    ]
    near = {m for n in triggers for m in (n - BS - 1, n - 1, n, n + 1, n + BS, n + BS + 1)}
    multiples = set(range(lo // BS * BS + BS, hi, 3 * BS))
    return triggers, sorted(m for m in near | multiples if lo <= m < hi)


@pytest.mark.parametrize(
    "rocketkv,batched_tokens,copy",
    [
        ({"prompt_budget": 70}, 128, None),  # one chunk
        ({"prompt_budget": 70}, 48, None),  # chunked: earlier targets written before
        ({"prompt_budget": 100, "window_size": 40}, 512, None),
        ({"token_budget": 128, "window_size": 32, "max_new_tokens": 16}, 128, None),  # per length
        # Chunked, copies completing 0-3 steps late (test_host_tier_async): the
        # Stage 1 step waits for its targets' stores.
        ({"prompt_budget": 70}, 48, {"copy_mode": "async", "async_seed": 1}),
    ],
)
def test_every_cached_block_is_dense_around_the_kept_token_boundary(
    model_path, rocketkv, batched_tokens, copy
):
    """Each prompt length is asked, then asked again with the device cache
    reset, so the second one is served from the host. After every step every
    block the device and the host hold under a hash is dense K/V of its
    prefix (check_host_blocks, check_device_blocks), and every prefill step
    reads only dense K/V (forward). The lengths whose targets end at the
    prompt's end stored compacted K/V on the host under dense hashes before
    the Stage 1 step was kept out of the target stores."""
    engine = FakeEngine(
        model_path, host_gib=0.01, batched_tokens=batched_tokens, rocketkv=rocketkv, copy=copy
    )
    triggers, lengths = _boundary_lengths(engine, 48, 420)
    assert triggers, "no prompt length reaches the boundary case"
    for n in lengths:
        (doc,) = _prompts(n, [n])
        engine.add(f"doc-{n}", doc, max_tokens=4)
        engine.run()
        assert engine.scheduler.reset_prefix_cache()
        engine.add(f"again-{n}", doc, max_tokens=4)
        engine.run()
    # The second asks were served from the host (but for the boundary
    # lengths, whose targets are not stored), and the checks saw blocks.
    served = [n for n in lengths if engine.hit[f"again-{n}"][1] > 0]
    assert len(served) > len(lengths) // 2, served
    assert len(engine.checked) > 20 and engine.device_checked > 100
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == engine.free_at_start


def test_a_host_pool_of_only_the_null_block_is_refused(model_path):
    """vLLM sizes its host pool to at least one block, the null block, and
    then stores nothing, silently; the host-tier connector refuses it at
    startup, naming the setting."""
    with pytest.raises(ValueError, match=r"kv_offloading_size=.*null block"):
        FakeEngine(model_path, host_gib=1.5 * BLOCK_BYTES / (1 << 30))
