"""Hybrid sliding-window models (Gemma 3) under ROCKETKV.

ROCKETKV compresses the full-attention layers; the sliding-window layers
run in vLLM's own backend (CPU_ATTN here) with vLLM's SlidingWindowManager.
A tiny random Gemma 3 (6 layers, each third full attention, a 64-token
window, ``query_pre_attn_scalar`` 48 against head dim 64) runs the same
requests on three in-process engines, fp32, greedy:

- ``on``: ROCKETKV, prefix caching on, given-back blocks poisoned;
- ``off``: ROCKETKV, prefix caching off, nothing given back, the PyTorch
  Stage 2 (``on`` runs the C++ one);
- ``dense``: vLLM's CPU_ATTN for every layer, prefix caching on.

The observation window (160 tokens) keeps a compressed prompt's prefix hit
more than a sliding window below the hit vLLM found, so the hit every
group accepts is not a truncation of it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from conftest import make_llm

from rocketkv_eval.engines import scheduler

pytestmark = pytest.mark.engine

BS = 32
SLIDING_WINDOW = 64
SETTINGS = {"prompt_budget": 256, "window_size": 160}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_gemma3() -> str:
    from rocketkv_eval.tiny_model import prepare_tiny_gemma3

    return prepare_tiny_gemma3(sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=48)


def _groups():
    """Requests in groups; a group starts when the one before has ended. A
    prompt may be a function of the run so far (a chat's next turn: the
    last turn's prompt and answer, then the new message)."""
    rng = random.Random(7)

    def ids(n):
        return [rng.randrange(100, 40000) for _ in range(n)]

    doc = ids(700)
    return [
        [("doc-q0", doc + ids(40), {})],
        [
            ("doc-q1", doc + ids(40), {}),
            ("doc-q2", doc + ids(60), {}),
            ("dense-row", ids(900), {"rocketkv_token_budget": 0}),
            ("short", ids(120), {}),
        ],
        # A three-turn chat. Turn 1 (700 tokens) ends 28 tokens into its
        # tail block, which its answer fills; turn 3's hit (capped at 736)
        # reaches past that block, so its sliding-window groups read the
        # block under turn 1's hash: it must hold dense K/V, which turn 1's
        # (computed through the compressed layers) does not.
        [("chat-1", ids(700), {})],
        [("chat-2", _next_turn("chat-1", ids(60)), {})],
        [("chat-3", _next_turn("chat-2", ids(120)), {})],
    ]


def _next_turn(previous: str, message: list[int]):
    return lambda run: run.prompts[previous] + run.tokens[previous] + message


@dataclass
class Run:
    tokens: dict = field(default_factory=dict)
    logprobs: dict = field(default_factory=dict)
    cached: dict = field(default_factory=dict)
    prompts: dict = field(default_factory=dict)
    blocks: dict = field(default_factory=dict)  # (rid, block, layer) -> K/V
    free_at_start: int = 0
    free_at_end: int = 0
    groups: list = field(default_factory=list)  # (spec type, manager type, layers)
    impls: dict = field(default_factory=dict)  # layer -> (impl type, scale)
    rswa_window: object = None


def _layers(llm):
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    return get_layers_from_vllm_config(llm.llm_engine.vllm_config, Attention)


def _layer_kv(layer) -> torch.Tensor:
    kv = layer.kv_cache
    return kv[0] if isinstance(kv, list) else kv


def _record_blocks(llm, run: Run, rid: str, prompt: list[int]) -> None:
    """The K/V, per layer, of every block the prefix cache maps for these
    tokens (a prompt and its answer) in each layer's group."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from rocketkv_vllm.backend.native import native_for_config
    from rocketkv_vllm.layout import split_kv

    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    layout = native_for_config(llm.llm_engine.vllm_config).kv_layout
    fake = SimpleNamespace(
        block_hashes=[],
        num_tokens=len(prompt),
        all_token_ids=prompt,
        mm_features=[],
        lora_request=None,
        cache_salt=None,
        prompt_embeds=None,
    )
    hashes = core.request_block_hasher(fake)
    layers = _layers(llm)
    for gid, group in enumerate(core.scheduler.kv_cache_config.kv_cache_groups):
        for j, h in enumerate(hashes):
            block = pool.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(h, gid)
            )
            if block is None:
                continue
            for name in group.layer_names:
                k, v = split_kv(_layer_kv(layers[name]), layout)
                run.blocks[(rid, j, name)] = torch.stack([k[block.block_id], v[block.block_id]])
                run.blocks[(rid, j, name)] = run.blocks[(rid, j, name)].clone()


def _run(llm, record_blocks: bool, chat_from: Run | None = None) -> Run:
    """``chat_from``: the run whose answers make the chat's next turns (so
    every engine gets the same prompts)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sched = scheduler(llm)
    manager = sched.kv_cache_manager
    pool = manager.block_pool
    run = Run(free_at_start=pool.get_num_free_blocks())
    config = llm.llm_engine.vllm_config
    run.rswa_window = config.model_config.rswa_window
    for group, single in zip(
        sched.kv_cache_config.kv_cache_groups, manager.coordinator.single_type_managers
    ):
        run.groups.append(
            (type(group.kv_cache_spec).__name__, type(single).__name__, tuple(group.layer_names))
        )
    run.impls = {
        name: (type(layer.impl).__name__, layer.impl.scale) for name, layer in _layers(llm).items()
    }
    for group in _groups():
        group = [(rid, p(chat_from or run) if callable(p) else p, x) for rid, p, x in group]
        prompts = [TokensPrompt(prompt_token_ids=p) for _, p, _ in group]
        params = [
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, extra_args=x or None)
            for _, _, x in group
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for (rid, prompt, _), out in zip(group, outs):
            completion = out.outputs[0]
            run.tokens[rid] = list(completion.token_ids)
            run.logprobs[rid] = [
                lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)
            ]
            run.cached[rid] = out.num_cached_tokens or 0
            run.prompts[rid] = prompt
            if record_blocks:
                _record_blocks(llm, run, rid, prompt + run.tokens[rid])
    run.free_at_end = pool.get_num_free_blocks()
    return run


def _engine(model, backend, caching, rocketkv=None, testing=None, **kw):
    return make_llm(
        model,
        backend,
        rocketkv,
        testing,
        max_model_len=2048,
        kv_cache_memory_bytes=1 << 27,
        max_num_batched_tokens=256,
        block_size=BS,
        enable_prefix_caching=caching,
        **kw,
    )


@pytest.fixture(scope="module")
def runs(tiny_gemma3):
    result = {}
    for name, backend, caching, rocketkv, testing in (
        ("on", "ROCKETKV", True, SETTINGS, {"poison_evicted_blocks": True}),
        (
            "off",
            "ROCKETKV",
            False,
            dict(SETTINGS, kernel="torch", free_evicted_blocks=False),
            None,
        ),
        ("dense", "CPU_ATTN", True, None, None),
    ):
        llm = _engine(tiny_gemma3, backend, caching, rocketkv, testing)
        try:
            result[name] = _run(llm, record_blocks=caching, chat_from=result.get("on"))
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
    return result


def test_sliding_layers_run_natively_and_full_layers_in_rocketkv(runs):
    """Layers, KV cache groups and block managers as designed: the sliding
    window layers keep vLLM's own backend and manager; no R-SWA window is
    set on the model (TRITON_ATTN and FA4 would then drop the sliding
    windows on NVIDIA)."""
    on = runs["on"]
    kinds = {
        (spec, manager)
        for spec, manager, _ in on.groups  # 2 sliding groups + 1 full group
    }
    assert kinds == {
        ("SlidingWindowSpec", "SlidingWindowManager"),
        ("RocketKVAttentionSpec", "RocketKVManager"),
    }
    for spec, _, layers in on.groups:
        impl = "RocketKVImpl" if spec == "RocketKVAttentionSpec" else "CPUAttentionBackendImpl"
        assert {on.impls[name][0] for name in layers} == {impl}, layers
    assert sorted(n for n, (impl, _) in on.impls.items() if impl == "RocketKVImpl") == [
        "model.layers.2.self_attn.attn",
        "model.layers.5.self_attn.attn",
    ]
    assert on.rswa_window is None
    # Gemma 3's scale (query_pre_attn_scalar ** -0.5, not head_dim ** -0.5)
    # reaches every layer, ROCKETKV's included.
    assert [scale for _, scale in on.impls.values()] == [pytest.approx(48**-0.5)] * 6


def test_uncompressed_rows_give_dense_tokens_and_logprobs(runs):
    on, dense = runs["on"], runs["dense"]
    for rid in ("dense-row", "short"):
        assert on.tokens[rid] == dense.tokens[rid], rid
        torch.testing.assert_close(
            torch.tensor(on.logprobs[rid]), torch.tensor(dense.logprobs[rid]), rtol=0, atol=1e-4
        )


def test_compressed_outputs_equal_those_with_caching_off_and_nothing_freed(runs):
    """``on`` (cache hits capped more than a window below vLLM's hit,
    given-back blocks poisoned, C++ Stage 2) equals ``off`` (no cache,
    nothing given back, PyTorch Stage 2)."""
    on, off = runs["on"], runs["off"]
    for rid in on.tokens:
        assert on.tokens[rid] == off.tokens[rid], rid
    assert all(n == 0 for n in off.cached.values())
    # The compressed prompts decode differently from dense (they are
    # compressed), the hits were capped below the window, and were taken.
    assert on.tokens["doc-q0"] != runs["dense"].tokens["doc-q0"]
    for rid in ("doc-q1", "doc-q2"):
        n = len(on.prompts[rid])
        hit = on.cached[rid]
        assert 0 < hit <= n - SETTINGS["window_size"], (rid, hit)
        # vLLM's own hit would be the whole shared document (672 tokens):
        # the cap is more than a sliding window below it.
        assert hit < 672 - SLIDING_WINDOW


def test_a_chat_turn_reads_only_dense_blocks_of_the_turns_before(runs):
    """Turn 3's hit reaches past turn 1's tail block (filled by turn 1's
    answer) and equals caching off (the test above); no block holding a
    compressed request's generated tokens is in any group's cache."""
    on = runs["on"]
    assert on.cached["chat-3"] == 736 and len(on.prompts["chat-3"]) - 160 >= 736
    assert on.tokens["chat-3"] == runs["off"].tokens["chat-3"]
    for rid in ("chat-1", "chat-2", "chat-3"):
        n = len(on.prompts[rid])
        cached = {j for (r, j, _) in on.blocks if r == rid}
        assert cached and max(cached) < n // BS, (rid, sorted(cached)[-3:])
    # Turn 1's tail block, full with its answer: in none of ROCKETKV's
    # groups under turn 1's tokens, and (dense, computed as part of turn 2's
    # prompt) in the sliding groups under turn 2's.
    block, sliding = 700 // BS, "model.layers.0.self_attn.attn"
    assert not any(r == "chat-1" and j == block for (r, j, _) in on.blocks)
    assert ("chat-2", block, sliding) in on.blocks


def test_cached_blocks_of_every_group_hold_dense_kv(runs):
    """Sliding-window blocks and the full-attention blocks the cache maps
    hold exactly what dense prefill writes, after compaction ran."""
    on, dense = runs["on"], runs["dense"]
    common = sorted(set(on.blocks) & set(dense.blocks))
    sliding = [
        k
        for k in common
        if k[2] not in ("model.layers.2.self_attn.attn", "model.layers.5.self_attn.attn")
    ]
    full = [k for k in common if k not in sliding]
    assert len(sliding) > 40 and len(full) > 20
    # The compaction targets (first blocks) of a compressed prompt reach
    # the cache through copies.
    assert ("doc-q0", 0, "model.layers.2.self_attn.attn") in on.blocks
    for key in common:
        torch.testing.assert_close(
            on.blocks[key], dense.blocks[key], rtol=1e-4, atol=1e-4, msg=str(key)
        )


def test_no_block_leaks(runs):
    for run in runs.values():
        assert run.free_at_end == run.free_at_start


def test_the_hybrid_kv_cache_manager_turned_off_is_refused(tiny_gemma3):
    """Without vLLM's hybrid KV cache manager every layer shares one block
    table of full-attention blocks: Stage 1 could give none back, and a
    prefix hit was not capped below the observation window (the engine
    died at the next turn). Refused when the KV cache spec is built."""
    with pytest.raises(Exception) as err:
        _engine(tiny_gemma3, "ROCKETKV", True, SETTINGS, disable_hybrid_kv_cache_manager=True)
    assert "hybrid KV cache manager turned off" in str(err.value)
    assert "RocketKVAttentionSpec, SlidingWindowSpec" in str(err.value)


def test_a_model_without_full_attention_layers_is_refused(tiny_gemma3, tmp_path):
    """Every layer sliding-window: nothing for ROCKETKV to compress; refused
    when the engine builds its KV cache spec, naming the layer kinds."""
    import json
    import shutil
    from pathlib import Path

    for f in Path(tiny_gemma3).iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["layer_types"] = ["sliding_attention"] * len(config["layer_types"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception) as err:
        _engine(str(tmp_path), "ROCKETKV", True, SETTINGS)
    assert "this model has none" in str(err.value)
    assert "SlidingWindowSpec" in str(err.value)
