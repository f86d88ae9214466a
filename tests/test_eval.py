"""Accuracy evaluation: task generation, scoring, and one smoke run through vLLM."""

import importlib
import re

import pytest
from conftest import make_llm, shutdown

from rocketkv_eval import tasks as eval_tasks
from rocketkv_eval.tasks import NIAH_INTRO, TASKS, make_sample, make_samples, score


def _script():
    """``rocketkv_eval.accuracy`` (scripts/eval_accuracy.py), imported when a test
    needs it: on import it sets VLLM_ENABLE_V1_MULTIPROCESSING=0 and the offline
    variables."""
    return importlib.import_module("rocketkv_eval.accuracy")


# ------------------------------------------------------------- generation
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [300, 1000, 2049])
def test_exact_token_length(tokenizer, task, length):
    for s in make_samples(task, tokenizer, length, 3):
        assert len(s.token_ids) == length
        assert tokenizer.encode(s.prompt, add_special_tokens=False) == s.token_ids
        assert s.task == task and s.length == length
        for ref in s.references:  # every answer is in the text
            assert ref in s.prompt


@pytest.mark.parametrize("haystack", eval_tasks.HAYSTACKS)
def test_plain_prompt_and_haystacks(tokenizer, haystack):
    s = make_sample("niah_multikey", tokenizer, 700, haystack=haystack, chat=False)
    assert len(s.token_ids) == 700
    assert "<|im_start|>" not in s.prompt
    assert s.prompt.rstrip().endswith("mentioned in the provided text is")


def test_needle_at_requested_depth(tokenizer):
    n = 6
    samples = make_samples("niah_single", tokenizer, 2048, n)
    assert [s.depth for s in samples] == pytest.approx([i / (n - 1) for i in range(n)])
    for s in samples:
        start = s.prompt.index(NIAH_INTRO) + len(NIAH_INTRO)
        end = s.prompt.index("What is the special magic number")
        needle = s.prompt.index("One of the special magic numbers", start)
        where = (needle - start) / (end - start)
        assert abs(where - s.depth) < 0.03, (s.depth, where)
        assert s.prompt.count("One of the special magic numbers") == 1


def test_task_structure(tokenizer):
    mk = make_sample("niah_multikey", tokenizer, 1500)
    needles = re.findall(r"magic numbers for (\S+) is: (\d+)\.", mk.prompt)
    assert len(needles) == 4 and len({k for k, _ in needles}) == 4
    asked = re.search(r"What is the special magic number for (\S+) mentioned", mk.prompt)
    assert dict(needles)[asked.group(1)] == mk.references[0]

    mv = make_sample("niah_multivalue", tokenizer, 1500)
    needles = re.findall(r"magic numbers for (\S+) is: (\d+)\.", mv.prompt)
    assert len({k for k, _ in needles}) == 1
    assert sorted(v for _, v in needles) == sorted(mv.references)

    mq = make_sample("niah_multiquery", tokenizer, 1500)
    needles = dict(re.findall(r"magic numbers for (\S+) is: (\d+)\.", mq.prompt))
    question = mq.prompt[mq.prompt.index("What are all") :]
    assert all(k in question for k in needles)
    assert sorted(needles.values()) == sorted(mq.references)

    vt = make_sample("vt", tokenizer, 1500)
    chain = re.findall(r"VAR ([A-Z]{5}) = (\w+)\.", vt.prompt)
    assert [name for name, _ in chain] == vt.references
    assert chain[0][1].isdigit()
    assert all(chain[i][1] == chain[i - 1][0] for i in range(1, len(chain)))


def test_seeded(tokenizer):
    a = make_sample("niah_multiquery", tokenizer, 800, index=1, seed=3)
    b = make_sample("niah_multiquery", tokenizer, 800, index=1, seed=3)
    c = make_sample("niah_multiquery", tokenizer, 800, index=2, seed=3)
    assert a.prompt == b.prompt and a.references == b.references
    assert a.references != c.references


def test_too_short(tokenizer):
    with pytest.raises(ValueError, match="minimum"):
        make_sample("vt", tokenizer, 50)


# ----------------------------------------------------------------- scoring
def test_scoring():
    assert score(" 1234567.", ["1234567"]) == 100.0
    assert score("it is 7654321", ["1234567"]) == 0.0
    assert score("1234567, 2345678 and 9", ["1234567", "2345678", "3456789", "9999999"]) == 50.0
    assert score("They are: abcde, FGHIJ", ["ABCDE", "FGHIJ"]) == 100.0  # case-insensitive
    assert score("", ["1"]) == 0.0
    with pytest.raises(ValueError):
        score("x", [])
    assert eval_tasks.mean_std([100.0, 0.0]) == (50.0, 50.0)
    assert eval_tasks.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


def test_method_settings():
    mod = _script()
    assert mod.method_settings("dense", None, 64) is None
    snap = mod.method_settings("snapkv", 128, 63)
    assert snap["prompt_budget"] == 128 and snap["topk"] % 4 == 0
    assert snap["topk"] >= 128 + 63 and snap["force_current_page"] is False
    assert mod.method_settings("quest", 256, 64) == {
        "evict": False,
        "page_size": 16,
        "topk": 256,
        "force_current_page": True,
    }
    assert mod.method_settings("oracle", 256, 64)["page_size"] == 1
    assert mod.method_settings("rocketkv", 256, 64)["token_budget"] == 256
    # The Stage 1 baselines: snapkv's budget semantics with their keep rule.
    from rocketkv_vllm.config import parse_config

    for rule in ("streaming", "h2o"):
        assert rule in mod.METHODS and rule not in mod.DEFAULT_METHODS
        settings = mod.method_settings(rule, 128, 63)
        assert settings == dict(snap, keep_rule=rule)
        assert parse_config(settings).keep_rule == rule
        assert mod.kept_tokens(rule, settings, 2048) == 128
    assert "keep_rule" not in snap


def test_agreement_from_outputs():
    mod = _script()
    out = lambda toks: [{"tokens": t} for t in toks]  # noqa: E731
    report = {
        "rows": [
            {"task": "vt", "length": 10, "method": "dense", "budget": None},
            {"task": "vt", "length": 10, "method": "snapkv", "budget": 4},
        ],
        "outputs": {
            "vt/10/dense/None": out([[1, 2, 3], [4, 5]]),
            "vt/10/snapkv/4": out([[1, 2, 3], [4, 6]]),
        },
    }
    mod.finalize(report)
    assert report["rows"][1]["agreement"] == 0.5
    assert report["rows"][1]["first_divergence_mean"] == 2.0  # (3 + 1) / 2


def test_mcnemar_exact_p():
    from rocketkv_eval.compare import mcnemar_p

    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(0, 3) == 0.25  # 2 x (1/2)^3
    assert mcnemar_p(6, 3) == mcnemar_p(3, 6) == 2 * (1 + 9 + 36 + 84) / 2**9
    assert mcnemar_p(5, 5) == 1.0  # capped: both tails overlap


def test_compare_pools_seeds_and_pairs_samples():
    from rocketkv_eval.compare import compare, pooled_scores

    def report(seed, dense, snap, rocket):
        cells = {"vt/10/dense/None": dense, "vt/10/snapkv/4": snap, "vt/10/rocketkv/4": rocket}
        return {
            "settings": {"seed": seed},
            "outputs": {k: [{"score": s} for s in v] for k, v in cells.items()},
        }

    a = report(0, [100, 0, 100], [100, 100, 0], [0, 100, 100])
    b = report(1, [100, 100], [0, 0], [100, 0])
    pooled = pooled_scores([a, b])
    assert pooled["vt/10/rocketkv/4"] == [0, 100, 100, 100, 0]
    (row,) = compare(pooled, "snapkv")[:1]
    # rocketkv 0,1,1,1,0 against snapkv 1,1,0,0,0: only rocketkv on 2, only snapkv on 1
    assert (row["method"], row["passed"], row["ref_passed"]) == ("rocketkv", 3, 2)
    assert (row["only_method"], row["only_ref"]) == (2, 1)
    vs_dense = {r["method"]: r for r in compare(pooled, "dense")}
    assert vs_dense["rocketkv"]["ref_passed"] == 4 and vs_dense["rocketkv"]["budget"] == 4
    with pytest.raises(ValueError, match="--seed 0"):
        pooled_scores([a, a])


# ------------------------------------------------------------------- smoke
# A decode step that sees only its own 4-token page (and a 64-token prompt
# after eviction) cannot copy a 7-digit number from 1k tokens back.
BROKEN = {
    "prompt_budget": 64,
    "window_size": 32,
    "page_size": 4,
    "topk": 4,
    "topr": 1,
    "force_current_page": True,
}


@pytest.mark.engine
def test_smoke_dense_high_broken_low(model_path, tokenizer):
    mod = _script()
    samples = make_samples("niah_single", tokenizer, 1024, 4)
    accuracy = {}
    for name, backend, cfg in (("dense", None, None), ("broken", "ROCKETKV", BROKEN)):
        llm = make_llm(model_path, backend, cfg, max_model_len=1024 + 16, max_num_seqs=4)
        try:
            res = mod.run_cell(llm, samples, 12)
        finally:
            shutdown(llm)
        accuracy[name] = eval_tasks.mean_std([r["score"] for r in res])[0]
        assert all(r["references"] == s.references for r, s in zip(res, samples))
    print("smoke accuracy", accuracy)
    assert accuracy["dense"] >= 75, accuracy
    assert accuracy["broken"] <= 25, accuracy
