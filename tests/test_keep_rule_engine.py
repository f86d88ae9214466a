"""The Stage 1 baselines (``rocketkv.keep_rule`` "streaming", "h2o") in the
real engine on the embedded SmolLM2: prompts in several prefill chunks, one
with its own budget (``rocketkv_token_budget``), kept positions recorded
(test aid ``record_kept_positions``) and held to the algorithm's functions."""

import pytest
import torch
from conftest import ids_and_logprobs, make_llm, same_completion, shutdown

from rocketkv_eval.needle import build_needle_prompt

pytestmark = pytest.mark.engine

SETTINGS = {"prompt_budget": 96, "page_size": 4, "topk": 256, "force_current_page": False}
OWN_BUDGET = 160  # the second request's rocketkv_token_budget
CHUNK = 256  # max_num_batched_tokens: each prompt in 2-3 chunks


def _run(llm, prompts):
    from vllm import SamplingParams

    outs = llm.generate(
        prompts,
        [
            SamplingParams(
                temperature=0.0,
                max_tokens=6,
                logprobs=1,
                extra_args=None if i == 0 else {"rocketkv_token_budget": OWN_BUDGET},
            )
            for i in range(len(prompts))
        ],
        use_tqdm=False,
    )
    return [ids_and_logprobs(o) for o in outs]


def _engine(model_path, rule, **kw):
    return make_llm(
        model_path,
        "ROCKETKV",
        dict(SETTINGS, keep_rule=rule),
        testing={"poison_evicted_blocks": True, "record_kept_positions": True},
        max_num_batched_tokens=CHUNK,
        max_num_seqs=2,
        enable_prefix_caching=False,
        **kw,
    )


def _facts(llm):
    from rocketkv_vllm.config import settings_for
    from rocketkv_vllm.state import worker_state

    config = llm.llm_engine.vllm_config
    state = worker_state(config)
    return dict(
        settings=settings_for(config),
        kept=list(state.kept_positions),
        scores=list(state.kept_h2o_scores),
        counters=state.counters.as_dict(),
        kv_heads=config.model_config.get_total_num_kv_heads(),
        group=config.model_config.get_num_attention_heads(config.parallel_config)
        // config.model_config.get_total_num_kv_heads(),
        layers=config.model_config.get_num_layers(config.parallel_config),
    )


@pytest.fixture(scope="module")
def runs(model_path, tokenizer):
    from rocketkv_vllm.algorithm import streaming_keep_positions
    from rocketkv_vllm.ops import base

    prompts = [
        build_needle_prompt(tokenizer, 620, 0.3, seed=41).prompt,
        build_needle_prompt(tokenizer, 530, 0.6, seed=42).prompt,
    ]
    result = {}
    with pytest.raises(Exception, match="keep_rule='h2o'.*enable_prefix_caching"):
        make_llm(model_path, "ROCKETKV", dict(SETTINGS, keep_rule="h2o"))
    for rule in ("streaming", "h2o"):
        llm = _engine(model_path, rule)
        result[rule] = _run(llm, prompts)
        result[f"{rule}-facts"] = _facts(llm)
        shutdown(llm)
    # The SnapKV path with StreamingLLM's positions in place of SnapKV's
    # choice: compaction, KT pages and decode as snapkv runs them.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            base,
            "keep_positions_from_scores",
            lambda scores, n, budget, kernel_size, protect_from: streaming_keep_positions(
                n, scores.shape[0], budget, protect_from=protect_from, device=scores.device
            ).contiguous(),
        )
        llm = _engine(model_path, "snapkv")
        result["snapkv-with-streaming-positions"] = _run(llm, prompts)
        shutdown(llm)
    return result


def _prompts_kept(facts):
    """{prompt length: [kept [Hkv, P] per layer]} and the plans' budgets."""
    from rocketkv_vllm.plan import plan_request

    by_len = {}
    for n, kept in facts["kept"]:
        by_len.setdefault(n, []).append(kept)
    assert len(by_len) == 2
    budgets = {}
    for i, n in enumerate(sorted(by_len, reverse=True)):  # the first prompt is longer
        own = None if i == 0 else OWN_BUDGET
        budgets[n] = plan_request(facts["settings"], n, own).prompt_budget
    return by_len, budgets


@pytest.mark.parametrize("rule", ["streaming", "h2o"])
def test_prompts_are_compressed_to_their_budgets(runs, rule):
    facts = runs[f"{rule}-facts"]
    by_len, budgets = _prompts_kept(facts)
    assert budgets[max(budgets)] == 96 and budgets[min(budgets)] != 96  # own budget used
    for n, kept in by_len.items():
        assert len(kept) == facts["layers"]
        for k in kept:
            assert k.shape == (facts["kv_heads"], budgets[n])
    counters = facts["counters"]
    # counted once per prompt (by the builder), per KV head
    assert counters["prompts_compressed"] == 2
    assert counters["prompt_tokens_evicted"] == sum(n - p for n, p in budgets.items())
    assert counters["stage1_short_windows"] == 0
    assert counters["stage1_partial_h2o_scores"] == 0
    for ids, _ in runs[rule]:
        assert len(ids) == 6


def test_streaming_keeps_the_sinks_and_the_most_recent(runs):
    from rocketkv_vllm.algorithm import streaming_keep_positions

    facts = runs["streaming-facts"]
    by_len, budgets = _prompts_kept(facts)
    s = facts["settings"]
    for n, kept in by_len.items():
        tail_start = n // s.block_size * s.block_size
        want = streaming_keep_positions(
            n, facts["kv_heads"], budgets[n], protect_from=min(n - s.window_size, tail_start)
        )
        for k in kept:
            assert torch.equal(k, want)
    assert not facts["scores"]  # no H2O scores accumulated


def test_streaming_gives_the_snapkv_path_with_its_positions(runs):
    """Tokens and logprobs equal the snapkv engine whose choice was replaced
    by StreamingLLM's positions: the rule changes only the choice."""
    for a, b in zip(runs["streaming"], runs["snapkv-with-streaming-positions"]):
        assert same_completion(a, b)


def test_h2o_keeps_by_the_attention_of_every_prompt_query(runs):
    from rocketkv_vllm.algorithm import h2o_keep_positions

    facts = runs["h2o-facts"]
    by_len, budgets = _prompts_kept(facts)
    s = facts["settings"]
    scores = facts["scores"]
    assert len(scores) == len(facts["kept"])
    for (n, kept), sc in zip(facts["kept"], scores):
        assert sc.shape == (facts["kv_heads"], n)
        # Every prompt query's softmax row (per query head of the GQA group)
        # sums to 1: a skipped chunk or query would leave less.
        torch.testing.assert_close(
            sc.sum(dim=-1),
            torch.full((facts["kv_heads"],), float(n * facts["group"])),
            rtol=1e-4,
            atol=0,
        )
        tail_start = n // s.block_size * s.block_size
        want = h2o_keep_positions(sc, budgets[n], s.window_size, tail_start)
        assert torch.equal(kept, want)
    # The heads choose differently (scores, not a fixed pattern).
    assert any(not torch.equal(k[0], k[-1]) for _, k in facts["kept"])
