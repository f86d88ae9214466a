"""gpt-oss-style models (attention sinks, alternating sliding-window and full
layers) under ROCKETKV.

A tiny random gpt-oss (4 layers alternating a 64-token window and full
attention, 4 query / 2 KV heads, learned sinks per head) runs the same
requests on in-process engines, fp32, greedy:

- ``sinks30``: every full layer's sinks set to 30, far above any logit, so
  those layers' attention output is nearly zero whatever tokens they read.
  ROCKETKV's compressed requests then give dense tokens and logprobs if and
  only if Stage 2 applies the sinks (without them the full layers attend
  over the kept pages with full weight);
- ``spread``: sinks ~ N(0, 3) (some heads' sinks dominate, some never
  matter): ROCKETKV with prefix caching, poisoned given-back blocks and the
  C++ Stage 2 equals ROCKETKV with caching off, nothing given back and the
  PyTorch Stage 2; uncompressed rows equal CPU_ATTN's.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_llm

pytestmark = pytest.mark.engine

SETTINGS = {"prompt_budget": 256, "window_size": 64}
MAX_TOKENS = 12
FULL_LAYERS = ["model.layers.1.attn.attn", "model.layers.3.attn.attn"]


def _prompts() -> dict[str, tuple[list[int], dict]]:
    rng = random.Random(3)

    def ids(n):
        return [rng.randrange(100, 40000) for _ in range(n)]

    return {
        "long-a": (ids(900), {}),
        "long-b": (ids(700), {}),
        "dense-row": (ids(900), {"rocketkv_token_budget": 0}),
        "short": (ids(100), {}),
    }


def _run(model: str, backend: str, caching: bool, rocketkv=None, testing=None) -> dict:
    from vllm import SamplingParams
    from vllm.config import get_layers_from_vllm_config
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.layers.attention import Attention

    from rocketkv_vllm.state import worker_state

    llm = make_llm(
        model,
        backend,
        rocketkv,
        testing,
        max_model_len=2048,
        kv_cache_memory_bytes=1 << 27,
        max_num_batched_tokens=256,
        block_size=32,
        enable_prefix_caching=caching,
    )
    try:
        prompts = _prompts()
        params = [
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, extra_args=x or None)
            for _, x in prompts.values()
        ]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p, _ in prompts.values()], params, use_tqdm=False
        )
        config = llm.llm_engine.vllm_config
        result = {
            "tokens": {},
            "logprobs": {},
            "impls": {
                name: (type(layer.impl).__name__, layer.impl.sinks is not None)
                for name, layer in get_layers_from_vllm_config(config, Attention).items()
            },
            "kept": [n for n, _ in worker_state(config).kept_positions],
        }
        for rid, out in zip(prompts, outs):
            completion = out.outputs[0]
            result["tokens"][rid] = list(completion.token_ids)
            result["logprobs"][rid] = torch.tensor(
                [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
            )
        return result
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm


@pytest.fixture(scope="module")
def runs() -> dict:
    from rocketkv_eval.tiny_model import prepare_tiny_gpt_oss

    sinks30 = prepare_tiny_gpt_oss(sliding_window=64, full_layer_sink=30)
    spread = prepare_tiny_gpt_oss(sliding_window=64)
    aids = {"poison_evicted_blocks": True, "record_kept_positions": True}
    off = dict(SETTINGS, kernel="torch", free_evicted_blocks=False)
    return {
        "sinks30-on": _run(sinks30, "ROCKETKV", True, SETTINGS, aids),
        "sinks30-dense": _run(sinks30, "CPU_ATTN", True),
        "spread-on": _run(spread, "ROCKETKV", True, SETTINGS, aids),
        "spread-off": _run(spread, "ROCKETKV", False, off),
        "spread-dense": _run(spread, "CPU_ATTN", True),
    }


def _same(a: dict, b: dict, rid: str, atol: float = 1e-4) -> None:
    assert a["tokens"][rid] == b["tokens"][rid], rid
    torch.testing.assert_close(a["logprobs"][rid], b["logprobs"][rid], rtol=0, atol=atol)


def test_full_layers_run_in_rocketkv_with_their_sinks(runs):
    impls = runs["spread-on"]["impls"]
    assert {n for n, (impl, _) in impls.items() if impl == "RocketKVImpl"} == set(FULL_LAYERS)
    assert all(has_sinks for _, has_sinks in impls.values())
    # Both long prompts were compressed in both full layers (the budget-0
    # row and the short prompt were not).
    assert sorted(runs["spread-on"]["kept"]) == [700, 700, 900, 900]
    assert sorted(runs["sinks30-on"]["kept"]) == [700, 700, 900, 900]


def test_compressed_requests_apply_the_sinks(runs):
    """Full layers whose sinks take all the mass: compressed == dense."""
    on, dense = runs["sinks30-on"], runs["sinks30-dense"]
    for rid in _prompts():
        _same(on, dense, rid)


def test_uncompressed_rows_give_dense_tokens_and_logprobs(runs):
    on, dense = runs["spread-on"], runs["spread-dense"]
    for rid in ("dense-row", "short"):
        _same(on, dense, rid)


def test_compressed_outputs_equal_those_with_caching_off_and_the_pytorch_path(runs):
    on, off, dense = runs["spread-on"], runs["spread-off"], runs["spread-dense"]
    for rid in _prompts():
        _same(on, off, rid, atol=1e-5)
    # With sinks that leave the full layers' attention its weight,
    # compression changes the long requests' outputs.
    assert any(on["tokens"][r] != dense["tokens"][r] for r in ("long-a", "long-b"))
