"""Disaggregated prefill and decode over vLLM's NixlConnector (pull mode,
UCX over loopback, ``kv_buffer_device`` cpu), issue 60.

Two engines per pair on the tiny Llama of SmolLM2's head geometry
(``conftest.tiny``: every engine here is cheap, outputs are compared by
logprobs at 1e-4 in fp32): the prefill engine P in this process, the decode
engine D in vLLM's spawned processes (vLLM keeps one KV connector per
process: ``kv_transfer_state._KV_CONNECTOR_AGENT``, so two in-process
engines would share it). P gets ``max_tokens`` 1 and
``kv_transfer_params: {"do_remote_decode": True}``; D gets the params P
returned and pulls the blocks P offers. Oracles: a single engine of the same
backend, no connector (started first, shut down before the pair: an engine
core in this process caches vLLM's environment); P's blocks poisoned
before the pull (evicted ones: D's tokens unchanged; a kept one: changed);
P's free blocks counted, D's checked by vLLM's prefix-cache reset (which
succeeds only when no block is held). Each pair runs once per module
(module-scoped fixtures) and the tests read its record.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from conftest import ids_and_logprobs, make_llm, same_completion, shutdown

ROCKETKV_SETTINGS = {"prompt_budget": 96}  # window 32, page 4, block 32
MAX_TOKENS = 8
BLOCK = 32  # ROCKETKV's and CPU_ATTN's block size on vLLM's CPU build


def _nixl_config(engine_id: str, lease: int | None = None):
    """``lease``: the engine's ``kv_lease_duration`` (None: vLLM's 30 s)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role="kv_both",
        kv_buffer_device="cpu",
        engine_id=engine_id,
        kv_connector_extra_config={} if lease is None else {"kv_lease_duration": lease},
    )


def _fresh_env(port: int) -> None:
    """Each engine reads its side-channel port from the environment when it
    starts; an engine core that ran in this process cached vLLM's
    environment (``envs.enable_envs_cache``), so drop the cache first."""
    import vllm.envs as envs

    envs.disable_envs_cache()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)


def _sampling(max_tokens: int, budget: int | None = None, kv: dict | None = None, logprobs=1):
    from vllm import SamplingParams

    extra = {}
    if budget is not None:
        extra["rocketkv_token_budget"] = budget
    if kv is not None:
        extra["kv_transfer_params"] = kv
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, extra_args=extra or None, logprobs=logprobs
    )


def _prompts(tokenizer) -> dict[str, list[int]]:
    """Token prompts of mixed lengths (budget 96: 90 tokens stay dense)."""
    text = (
        "The archive holds letters from the harbour master to the town council, "
        "each about ships, storms, tolls and the lighthouse keeper's pay. "
    )
    ids = tokenizer(text * 40).input_ids
    return {
        "short": ids[:90],
        "c150": ids[5 : 5 + 150],
        "c230": ids[7 : 7 + 230],
        "c300": ids[9 : 9 + 300],
        "c600": ids[3 : 3 + 600],
        # each only ever poisoned: no prefix cache holds its blocks
        "evicted": ids[11 : 11 + 300],
        "kept": ids[13 : 13 + 300],
        "probe": ids[17 : 17 + 40],
    }


# name -> (prompt, own budget); the batch P and D serve together
ROCKETKV_CASES = {
    "short": ("short", None),  # within the budget: dense path
    "c150": ("c150", None),
    "c230": ("c230", None),
    "c300": ("c300", None),
    "c600": ("c600", None),
    "long0": ("c600", 0),  # own budget 0: dense path
    "c300b64": ("c300", 64),  # own budget: compressed with it
}


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def _free_blocks(llm) -> int:
    return _scheduler(llm).kv_cache_manager.block_pool.get_num_free_blocks()


def _caches(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.kv_caches


def _zero_blocks(llm, block_ids) -> None:
    """Zero every layer's K/V (and KT pages) of these blocks in an
    in-process engine's cache."""
    for cache in _caches(llm):
        cache[list(block_ids)] = 0


def _generate(llm, prompts, cases, params_for):
    names = list(cases)
    outs = llm.generate(
        [{"prompt_token_ids": prompts[cases[n][0]]} for n in names],
        [params_for(n) for n in names],
        use_tqdm=False,
    )
    return dict(zip(names, outs))


def _plan(prompt_len: int, budget):
    from rocketkv_vllm.config import RocketKVConfig, resolve_settings
    from rocketkv_vllm.plan import plan_request

    settings = resolve_settings(RocketKVConfig(**ROCKETKV_SETTINGS), BLOCK, 64, 8192)
    return plan_request(settings, prompt_len, budget)


def _start_pair(model, backend, rocketkv, lease: int | None = None):
    from vllm.utils.network_utils import get_open_port

    _fresh_env(get_open_port())
    prefill = make_llm(model, backend, rocketkv, kv_transfer_config=_nixl_config("P", lease))
    try:
        _fresh_env(get_open_port())
        decode = make_llm(
            model, backend, rocketkv, kv_transfer_config=_nixl_config("D", lease), spawn=True
        )
    except BaseException:
        shutdown(prefill)
        raise
    return prefill, decode


def _settle(prefill, prompts, start: int) -> int:
    """P frees the blocks it offered when D's notification reaches its
    worker, in one of P's steps: run small local requests until the free
    count is back (or give up after a few)."""
    for _ in range(20):
        if _free_blocks(prefill) == start:
            break
        prefill.generate(
            [{"prompt_token_ids": prompts["probe"]}], _sampling(2, logprobs=None), use_tqdm=False
        )
    return _free_blocks(prefill)


PREFILL = {"kv_transfer_params": {"do_remote_decode": True}}


def _stops_at_once(rec, max_tokens: int = MAX_TOKENS, extra: dict | None = None):
    """Sampling whose stop token ids hold the single engine's first token
    of prompt c230 (greedy), so that token ends the request."""
    from vllm import SamplingParams

    def params(_name):
        return SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            logprobs=1,
            stop_token_ids=[rec["single"]["c230"][0][0]],
            extra_args=extra or None,
        )

    return params


@pytest.fixture(scope="module")
def rocketkv_pd(tiny, tokenizer):
    """One ROCKETKV engine, then a ROCKETKV P/D pair, on the same batch."""
    prompts = _prompts(tokenizer)
    rec = {"single": {}, "pd": {}, "first": {}, "params": {}, "local": {}}
    llm = make_llm(tiny, "ROCKETKV", ROCKETKV_SETTINGS)
    try:
        cases = dict(ROCKETKV_CASES, evicted=("evicted", None), kept=("kept", None))
        outs = _generate(llm, prompts, cases, lambda n: _sampling(MAX_TOKENS, cases[n][1]))
        rec["single"] = {n: ids_and_logprobs(o) for n, o in outs.items()}
        (out,) = _generate(llm, prompts, {"stop": ("c230", None)}, _stops_at_once(rec)).values()
        rec["single"]["stop"] = ids_and_logprobs(out)
    finally:
        shutdown(llm)
    prefill, decode = _start_pair(tiny, "ROCKETKV", ROCKETKV_SETTINGS)
    try:
        start = _free_blocks(prefill)
        cases = ROCKETKV_CASES
        first = _generate(
            prefill,
            prompts,
            cases,
            lambda n: _sampling(1, cases[n][1], {"do_remote_decode": True}),
        )
        rec["params"] = {n: dict(o.kv_transfer_params) for n, o in first.items()}
        rec["first"] = {n: ids_and_logprobs(o) for n, o in first.items()}
        # Held for D: the blocks P offered, nothing else (the evicted range
        # of each compressed prompt given back in its Stage 1 step). Requests
        # of one prompt may share prefix-cached blocks: distinct ids count.
        offered = {i for p in rec["params"].values() for i in p["remote_block_ids"][0]}
        rec["held_after_prefill"] = start - _free_blocks(prefill)
        rec["offered"] = len(offered)
        outs = _generate(
            decode,
            prompts,
            cases,
            lambda n: _sampling(MAX_TOKENS, cases[n][1], rec["params"][n]),
        )
        rec["pd"] = {n: ids_and_logprobs(o) for n, o in outs.items()}
        rec["free_after"] = _settle(prefill, prompts, start)
        rec["start"] = start
        # Poisoned sources. Evicted: every block of P's cache but the kept
        # ones zeroed after P's step, before D pulls; kept: one kept block
        # (the first compaction target) zeroed.
        for name in ("evicted", "kept"):
            (res,) = prefill.generate(
                [{"prompt_token_ids": prompts[name]}],
                _sampling(1, None, {"do_remote_decode": True}),
                use_tqdm=False,
            )
            params = dict(res.kv_transfer_params)
            kept = params["remote_block_ids"][0]
            if name == "evicted":
                num_blocks = _caches(prefill)[0].shape[0]
                _zero_blocks(prefill, sorted(set(range(1, num_blocks)) - set(kept)))
            else:
                _zero_blocks(prefill, kept[:1])
            (out,) = decode.generate(
                [{"prompt_token_ids": prompts[name]}],
                _sampling(MAX_TOKENS, None, params),
                use_tqdm=False,
            )
            rec["pd"][name] = ids_and_logprobs(out)
            rec["params"][name] = params
        # A compressed prompt whose one token stops it (a stop token id, as
        # EOS would): P offers nothing, D serves the request whole.
        stop = {"stop": ("c230", None)}
        (res,) = _generate(prefill, prompts, stop, _stops_at_once(rec, 1, PREFILL)).values()
        rec["params"]["stop"] = res.kv_transfer_params
        kv = {"kv_transfer_params": res.kv_transfer_params} if res.kv_transfer_params else {}
        (out,) = _generate(decode, prompts, stop, _stops_at_once(rec, MAX_TOKENS, kv)).values()
        rec["pd"]["stop"] = ids_and_logprobs(out)
        rec["decode_all_free"] = decode.reset_prefix_cache()
    finally:
        shutdown(decode)
        shutdown(prefill)
    return rec


@pytest.fixture(scope="module")
def dense_pd(tiny, tokenizer):
    """vLLM's own backend (CPU_ATTN, the plugin loaded): one engine, then a
    P/D pair."""
    prompts = _prompts(tokenizer)
    cases = {"c230": ("c230", None), "poison": ("evicted", None)}
    rec = {}
    llm = make_llm(tiny, "CPU_ATTN")
    try:
        outs = _generate(llm, prompts, cases, lambda n: _sampling(MAX_TOKENS))
        rec["single"] = {n: ids_and_logprobs(o) for n, o in outs.items()}
    finally:
        shutdown(llm)
    prefill, decode = _start_pair(tiny, "CPU_ATTN", None)
    try:
        first = _generate(
            prefill, prompts, cases, lambda n: _sampling(1, None, {"do_remote_decode": True})
        )
        rec["params"] = {n: dict(o.kv_transfer_params) for n, o in first.items()}
        rec["block_size"] = prefill.llm_engine.vllm_config.cache_config.block_size
        _zero_blocks(prefill, rec["params"]["poison"]["remote_block_ids"][0])
        outs = _generate(
            decode, prompts, cases, lambda n: _sampling(MAX_TOKENS, None, rec["params"][n])
        )
        rec["pd"] = {n: ids_and_logprobs(o) for n, o in outs.items()}
    finally:
        shutdown(decode)
        shutdown(prefill)
    return rec


# -- no engine ------------------------------------------------------------


def test_nixl_ucx_moves_bytes_over_loopback():
    """The installed nixl (its UCX backend) reads a registered host buffer
    from another agent: what the connector's pull does, without vLLM."""
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(backends=["UCX"])
    a, b = nixl_agent("pd-test-a", cfg), nixl_agent("pd-test-b", cfg)
    src = torch.arange(4096, dtype=torch.float32)
    dst = torch.zeros(4096)
    a.register_memory(src)
    b.register_memory(dst)
    b.add_remote_agent(a.get_agent_metadata())
    handle = b.initialize_xfer("READ", b.get_xfer_descs(dst), a.get_xfer_descs(src), "pd-test-a")
    b.transfer(handle)
    for _ in range(100_000):
        state = b.check_xfer_state(handle)
        if state == "DONE":
            break
        assert state != "ERR"
    assert torch.equal(src, dst)


def _engine_config(model_path, backend="ROCKETKV", **kw):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(dtype="float32", max_model_len=4096, enforce_eager=True)
    args.update(kw)
    return EngineArgs(model=model_path, attention_backend=backend, **args).create_engine_config()


def test_rocketkv_accepts_nixl_pull_and_refuses_push(tiny):
    from rocketkv_vllm.plugin import register

    register()
    pull = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    config = _engine_config(tiny, kv_transfer_config=pull)
    assert config.kv_transfer_config.kv_connector == "NixlConnector"
    push = dict(pull, kv_connector="NixlPushConnector")
    with pytest.raises(Exception) as err:
        _engine_config(tiny, kv_transfer_config=push)
    assert "ROCKETKV" in str(err.value) and "NixlPushConnector" in str(err.value)


def test_pd_requests_are_checked_when_they_arrive(tiny):
    """The prefill side serves every plan (``max_tokens`` 1 does not make a
    request that decodes elsewhere dense: it is planned with its own budget,
    else the engine's). The decode side serves a dense plan, and a
    compressed one only with the compression state the prefill engine
    added that matches its own plan and settings; every mismatch is refused
    naming the field. Requests without transfer params are ordinary local
    requests."""
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    from rocketkv_vllm.config import settings_for
    from rocketkv_vllm.pd import (
        STATE_KEY,
        kept_block_indices,
        pd_budget,
        prefill_state,
        validate_pd_request,
    )
    from rocketkv_vllm.plan import plan_request
    from rocketkv_vllm.plugin import register
    from rocketkv_vllm.requests import planned_budget

    register()
    pull = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    config = _engine_config(
        tiny, kv_transfer_config=pull, additional_config={"rocketkv": ROCKETKV_SETTINGS}
    )
    processor = InputProcessor(config)
    long_prompt = {"prompt_token_ids": list(range(1, 601))}
    short_prompt = {"prompt_token_ids": list(range(1, 61))}
    settings = settings_for(config)

    def process(prompt, max_tokens, budget=None, kv=None):
        return processor.process_inputs(
            request_id="r",
            prompt=prompt,
            params=_sampling(max_tokens, budget, kv),
            supported_tasks=("generate",),
        )

    def state(n=600, budget=None, **changes):
        plan = plan_request(settings, n, budget)
        out = prefill_state(settings, plan, budget, 7, 30)
        out.update(changes)
        return out

    # Prefill side: every plan served, planned as it will decode.
    prefill = {"do_remote_decode": True}
    for budget in (None, 0, 64):
        process(long_prompt, 1, budget, prefill)
    assert pd_budget(_sampling(1, None, prefill), "prefill") is None
    assert planned_budget(_sampling(1, None, prefill)) is None  # not dense
    assert planned_budget(_sampling(1)) == 0  # scoring stays dense
    # Decode side.
    # a compressed 600-token prompt offers its kept blocks (budget 96: the
    # compaction targets and the tail)
    kept = len(kept_block_indices(plan_request(settings, 600, None), settings.block_size, 19))
    assert kept == 4
    remote = {"do_remote_prefill": True, "remote_block_ids": (list(range(1, kept + 1)),)}
    process(long_prompt, 16, 0, remote)  # own budget 0: dense
    process(short_prompt, 16, None, remote)  # within the budget
    process(long_prompt, 1, None, remote)  # decodes nothing: dense
    process(long_prompt, 16)  # no transfer: compressed locally
    process(long_prompt, 16, None, dict(remote, **{STATE_KEY: state()}))
    kept_64 = kept_block_indices(plan_request(settings, 600, 64), settings.block_size, 19)
    offer_64 = {"remote_block_ids": [list(range(1, len(kept_64) + 1))]}
    process(long_prompt, 16, 64, dict(remote, **offer_64, **{STATE_KEY: state(budget=64)}))
    process(long_prompt, 16, None, dict(remote, **{STATE_KEY: state(offered_at=time.time() - 20)}))
    offer_state = {STATE_KEY: state()}
    refused = {
        "no state": (dict(remote), None, "carry no kv_transfer_params.rocketkv"),
        "settings": (
            dict(
                remote,
                **{STATE_KEY: state(digest="x", settings=dict(state()["settings"], page_size=8))},
            ),
            None,
            "rocketkv.page_size 8 on the prefill engine, 4 here",
        ),
        "budget": (dict(remote, **{STATE_KEY: state(budget=64)}), None, "budget 64"),
        "dense here": (dict(remote, **{STATE_KEY: state()}), 0, "plans it dense"),
        "length": (dict(remote, **{STATE_KEY: state(n=599)}), None, "prompt_len 599"),
        "first token": (dict(remote, **{STATE_KEY: state(first_token=None)}), None, "first_token"),
        # P's 30 s lease, D's heartbeats every 5 s (its own 30 s lease): what
        # arrives more than 24 s after the offer may read reused blocks
        "late": (
            dict(remote, **{STATE_KEY: state(offered_at=time.time() - 25)}),
            None,
            "offered these blocks 25",
        ),
        "no lease": (dict(remote, **{STATE_KEY: state(lease_s=None)}), None, "lease_s is missing"),
        # what D allocates and pulls into: the kept blocks, one group
        "one block short": (
            dict(remote, remote_block_ids=[remote["remote_block_ids"][0][:-1]], **offer_state),
            None,
            "remote_block_ids: the offer of a compressed 600-token prompt names its 4 kept "
            "blocks, one list of block ids in one KV cache group; got 3 block ids",
        ),
        "two groups": (
            dict(remote, remote_block_ids=[[1], [2]], **offer_state),
            None,
            "got [[1], [2]]",
        ),
        "not ids": (
            dict(remote, remote_block_ids=[["1"] * kept], **offer_state),
            None,
            "got 4 block ids",
        ),
    }
    for name, (kv, budget, words) in refused.items():
        with pytest.raises(VLLMValidationError) as err:
            process(long_prompt, 16, budget, kv)
        assert "kv_transfer_params.do_remote_prefill" in str(err.value), name
        assert words in str(err.value), (name, str(err.value))
    # A failed pull cannot be recomputed on D (no blocks for the evicted K/V);
    # a dense D (the package loaded) cannot read compacted blocks.
    compressed = dict(remote, **{STATE_KEY: state()})
    for backend, extra, words in (
        ("ROCKETKV", {"kv_load_failure_policy": "recompute"}, "kv_load_failure_policy fail"),
        ("CPU_ATTN", {}, "attention backend cannot read its compacted blocks"),
    ):
        other = InputProcessor(
            _engine_config(
                tiny,
                backend,
                kv_transfer_config=dict(pull, **extra),
                additional_config={"rocketkv": ROCKETKV_SETTINGS},
            )
        )
        with pytest.raises(VLLMValidationError, match=words):
            other.process_inputs(
                request_id="r",
                prompt=long_prompt,
                params=_sampling(16, None, compressed),
                supported_tasks=("generate",),
            )
        other.process_inputs(  # the dense path is served
            request_id="r",
            prompt=long_prompt,
            params=_sampling(16, 0, remote),
            supported_tasks=("generate",),
        )
    # Both engines split the model alike (the prefill engine's sizes ride in
    # its params, as vLLM's NIXL scheduler writes them), dense requests too.
    process(long_prompt, 16, 0, dict(remote, tp_size=1, pp_size=1, dcp_size=1))
    for key, budget in (("tp_size", 0), ("pp_size", None), ("dcp_size", 0)):
        kv = dict(remote, **{key: 2}, **(offer_state if budget is None else {}))
        with pytest.raises(VLLMValidationError) as err:
            process(long_prompt, 16, budget, kv)
        assert f"kv_transfer_params.{key} 2 on the prefill engine, 1 here" in str(err.value)
        assert "same parallel layout" in str(err.value)
    # A prompt given as embeddings is planned by its length as ids are.
    embeds = SimpleNamespace(
        sampling_params=_sampling(16, None, remote),
        prompt_token_ids=None,
        prompt_embeds=torch.zeros(600, 8),
    )
    with pytest.raises(VLLMValidationError, match="600-token prompt"):
        validate_pd_request(config, embeds)
    embeds.prompt_embeds = torch.zeros(60, 8)  # within the budget
    validate_pd_request(config, embeds)


def test_decode_side_allocates_only_the_kept_blocks():
    """D's block manager (``RocketKVManager``, through vLLM's
    ``KVCacheManager``) gives a compressed prompt pulled from P blocks for
    its kept ones only (the null block in the evicted range), takes no
    prefix hit for it, hashes none of its blocks, and gets them all back;
    the same prompt without P's state is allocated in full."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.request import Request

    from rocketkv_vllm.config import RocketKVConfig, resolve_settings
    from rocketkv_vllm.kv_cache import make_rocketkv_spec, register_kv_cache_spec
    from rocketkv_vllm.pd import STATE_KEY, prefill_state
    from rocketkv_vllm.plugin import register

    register()
    register_kv_cache_spec()
    settings = resolve_settings(RocketKVConfig(**ROCKETKV_SETTINGS), BLOCK, 64, 8192)
    base = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
    spec = make_rocketkv_spec(base, settings)
    num_blocks, page = 64, spec.page_size_bytes
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(num_blocks * page, ["l0"], num_blocks * page, page)],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )
    manager = KVCacheManager(config, 8192, BLOCK, BLOCK, enable_caching=True)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)
    pool = manager.block_pool
    start = pool.get_num_free_blocks()
    n = 600
    plan = _plan(n, None)
    prompt = list(range(100, 100 + n))

    def pulled(rid, state, budget=None):
        kv = {"do_remote_prefill": True, "remote_block_ids": ([1],)}
        if state:
            kv[STATE_KEY] = prefill_state(settings, plan, None, 5, 30)
        extra = {"kv_transfer_params": kv}
        if budget is not None:
            extra["rocketkv_token_budget"] = budget
        params = SamplingParams(max_tokens=8, extra_args=extra)
        request = Request(rid, prompt, params, None, block_hasher=hasher)
        blocks, hit, _ = manager.get_computed_blocks(request)
        assert hit == 0
        manager.allocate_slots(request, 0, num_external_computed_tokens=n, delay_cache_blocks=True)
        return request

    # A dense copy of the prompt in the prefix cache (pulled with budget 0):
    # D's compressed request must not take it (its blocks arrive compacted).
    dense = pulled("dense", state=False, budget=0)
    assert start - pool.get_num_free_blocks() == -(-n // BLOCK)
    dense.num_computed_tokens = n
    manager.cache_blocks(dense, n)
    manager.free(dense)
    assert pool.get_num_free_blocks() == start
    manager.new_step_starts()
    local = Request("x", prompt, SamplingParams(max_tokens=8), None, block_hasher=hasher)
    assert manager.get_computed_blocks(local)[1] > 0  # a local request hits it

    request = pulled("c", state=True)
    (ids,) = manager.get_block_ids("c")
    held = start - pool.get_num_free_blocks()
    kept = plan.compact_blocks(BLOCK) + (-(-n // BLOCK) - plan.tail_start // BLOCK)
    assert held == kept == len([i for i in ids if i != 0])
    first, end = plan.freed_block_range(BLOCK)
    assert all(i == 0 for i in ids[first:end]) and len(ids) == -(-n // BLOCK)
    request.num_computed_tokens = n
    manager.cache_blocks(request, n)  # what vLLM does when the pull is done
    assert all(b.block_hash is None for b in manager.coordinator.get_blocks("c")[0])
    manager.free(request)
    assert pool.get_num_free_blocks() == start


# -- engines ------------------------------------------------------------------


@pytest.mark.engine
def test_dense_pd_with_the_package_installed_equals_one_engine(dense_pd):
    """Issue 60's reproduction: dense engines (CPU_ATTN, the plugin loaded)
    with NixlConnector; D's greedy tokens and logprobs equal a single
    engine's, and it decodes from the K/V it pulled (poisoned: changed)."""
    params = dense_pd["params"]["c230"]
    assert params["do_remote_prefill"] and params["remote_num_tokens"] == 230
    assert len(params["remote_block_ids"][0]) == -(-230 // dense_pd["block_size"])
    assert "rocketkv" not in params
    assert same_completion(dense_pd["pd"]["c230"], dense_pd["single"]["c230"])
    assert not same_completion(dense_pd["pd"]["poison"], dense_pd["single"]["poison"])


@pytest.mark.engine
def test_rocketkv_pd_equals_one_rocketkv_engine(rocketkv_pd):
    """ROCKETKV on both sides, one batch of mixed lengths: prompts within
    the budget and one with its own budget 0 (dense path), prompts that
    compress with the engine's budget or their own. D's greedy tokens and
    logprobs equal a single ROCKETKV engine's (P's one token is D's first,
    with its logprob)."""
    for name in ROCKETKV_CASES:
        pd, single = rocketkv_pd["pd"][name], rocketkv_pd["single"][name]
        assert same_completion(pd, single), (name, pd, single)
        assert rocketkv_pd["first"][name][0] == pd[0][:1], name


@pytest.mark.engine
def test_rocketkv_pd_moves_only_the_kept_blocks(rocketkv_pd):
    """P offers a compressed prompt's kept blocks only (its compaction
    targets and tail block, ``RequestPlan``), with the compression state D
    needs; a dense-path prompt's every block, without it. P holds only the
    offered blocks until D has pulled them, then none; D holds none once
    its requests finished."""
    for name, (prompt, budget) in ROCKETKV_CASES.items():
        params = rocketkv_pd["params"][name]
        n = int(prompt[1:]) if prompt != "short" else 90
        plan = _plan(n, budget)
        offered = params["remote_block_ids"][0]
        assert params["remote_num_tokens"] == n
        if not plan.compress:
            assert len(offered) == -(-n // BLOCK), name
            assert "rocketkv" not in params, name
            continue
        kept = plan.compact_blocks(BLOCK) + (-(-n // BLOCK) - plan.tail_start // BLOCK)
        assert len(offered) == kept < -(-n // BLOCK), name
        state = params["rocketkv"]
        assert state["prompt_len"] == n and state["budget"] == budget, name
        assert state["kept_tokens"] == plan.prompt_budget, name
        assert (state["block_size"], state["page_size"]) == (BLOCK, 4), name
        assert state["first_token"] == rocketkv_pd["first"][name][0][0], name
    assert rocketkv_pd["held_after_prefill"] == rocketkv_pd["offered"]
    assert rocketkv_pd["free_after"] == rocketkv_pd["start"]
    assert rocketkv_pd["decode_all_free"]


@pytest.mark.engine
def test_rocketkv_pd_decodes_from_the_kept_blocks_it_pulled(rocketkv_pd):
    """Every block of P's cache but a compressed prompt's kept ones zeroed
    before D pulls: D's tokens and logprobs unchanged. One kept block
    zeroed: they change (D decodes from what it pulled, not a recompute)."""
    single, pd = rocketkv_pd["single"], rocketkv_pd["pd"]
    assert len(rocketkv_pd["params"]["evicted"]["remote_block_ids"][0]) < 300 // BLOCK
    assert same_completion(pd["evicted"], single["evicted"])
    assert not same_completion(pd["kept"], single["kept"])


def test_a_compressed_request_whose_first_token_stops_it(rocketkv_pd):
    """P's one token is a stop token: P offers no blocks (D would only
    continue from that token), and D, given no params, serves the request
    whole: the single engine's output, which stops at that token."""
    rec = rocketkv_pd
    assert rec["single"]["stop"][0] == rec["single"]["c230"][0][:1]
    assert rec["params"]["stop"] is None
    assert same_completion(rec["pd"]["stop"], rec["single"]["stop"])
