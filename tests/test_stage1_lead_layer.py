"""``rocketkv.stage1_lead_layer`` in the real engine on the embedded SmolLM2:
the layers before the lead keep the positions the lead layer chose.

Oracle: the same engine without the knob, run twice. The first run records
every layer's own choice (test aid ``record_kept_positions``); the second
hands layers below the lead the recorded lead's positions through the
ordinary per-layer compaction (``ops.base.keep_positions_from_scores``
replaced), so neither the followers' deferral nor ``Stage1.apply_kept``
from the lead's forward is shared with the oracle. Evicted blocks poisoned,
prefix caching off, prompts in several prefill chunks."""

import pytest
import torch
from conftest import ids_and_logprobs, make_llm, shutdown

from rocketkv_eval.needle import build_needle_prompt

pytestmark = pytest.mark.engine

SETTINGS = {"prompt_budget": 96, "page_size": 4, "topk": 64, "force_current_page": True}
LEAD = 11
CHUNK = 256  # max_num_batched_tokens: each prompt in 2-3 chunks
TESTING = {"poison_evicted_blocks": True, "record_kept_positions": True}


def _engine(model_path, **rocketkv):
    return make_llm(
        model_path,
        "ROCKETKV",
        dict(SETTINGS, **rocketkv),
        testing=TESTING,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=2,
        enable_prefix_caching=False,
    )


def _run(llm, prompts):
    from vllm import SamplingParams

    from rocketkv_vllm.state import worker_state

    kept = worker_state(llm.llm_engine.vllm_config).kept_positions
    kept.clear()
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    by_len = {}
    for n, k in kept:
        by_len.setdefault(n, []).append(k)
    return [ids_and_logprobs(o) for o in outs], by_len


@pytest.fixture(scope="module")
def runs(model_path, tokenizer):
    from vllm.model_executor.models.utils import extract_layer_index

    from rocketkv_vllm.backend.impl import RocketKVImpl
    from rocketkv_vllm.ops import base

    prompts = [
        build_needle_prompt(tokenizer, 620, 0.3, seed=51).prompt,
        build_needle_prompt(tokenizer, 530, 0.6, seed=52).prompt,
    ]
    result = {}
    llm = _engine(model_path, stage1_lead_layer=LEAD)
    result["lead"] = _run(llm, prompts)
    shutdown(llm)

    llm = _engine(model_path)
    result["own"] = _run(llm, prompts)
    own_kept = result["own"][1]
    layer = {"index": 0}
    forward, choose = RocketKVImpl.forward, base.keep_positions_from_scores

    def noting_layer(self, attn_layer, *args, **kwargs):
        layer["index"] = extract_layer_index(attn_layer.layer_name)
        return forward(self, attn_layer, *args, **kwargs)

    def lead_positions(scores, n, *args, **kwargs):
        kept = choose(scores, n, *args, **kwargs)
        if layer["index"] < LEAD:
            return own_kept[n][LEAD].to(kept.device)
        return kept

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RocketKVImpl, "forward", noting_layer)
        mp.setattr(base, "keep_positions_from_scores", lead_positions)
        result["oracle"] = _run(llm, prompts)
    result["layers"] = llm.llm_engine.vllm_config.model_config.get_num_layers(
        llm.llm_engine.vllm_config.parallel_config
    )
    shutdown(llm)
    return result


def test_the_layers_before_the_lead_keep_its_positions(runs):
    _, lead_kept = runs["lead"]
    _, own_kept = runs["own"]
    assert len(lead_kept) == 2
    for n, kept in lead_kept.items():
        # Recorded as Stage 1 runs: the lead's own choice, then its followers'
        # (from the lead's forward), then the later layers'.
        assert len(kept) == runs["layers"]
        lead, followers = kept[0], kept[1 : 1 + LEAD]
        later = [lead, *kept[1 + LEAD :]]
        assert len(later) == len(own_kept[n][LEAD:])
        for k, want in zip(later, own_kept[n][LEAD:]):
            assert torch.equal(k, want)  # from the lead on: their own choice
        for k in followers:
            assert torch.equal(k, lead)
        # the knob changes what early layers keep (else this test shows nothing)
        assert any(not torch.equal(k, lead) for k in own_kept[n][:LEAD])


def test_tokens_equal_the_per_layer_compaction_of_the_leads_positions(runs):
    outputs, _ = runs["lead"]
    oracle, _ = runs["oracle"]
    for (ids, logprobs), (want_ids, want_logprobs) in zip(outputs, oracle):
        assert ids == want_ids
        assert logprobs == pytest.approx(want_logprobs, abs=1e-6)


def test_a_lead_past_the_last_compressed_layer_is_refused_at_startup(model_path):
    refusal = r"rocketkv.stage1_lead_layer=30 is invalid: allowed an integer in \[0, 29\]"
    with pytest.raises(ValueError, match=refusal):
        _engine(model_path, stage1_lead_layer=30)
