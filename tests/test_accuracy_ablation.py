"""The accuracy harness's ablation methods and confidence intervals (issue 40):
pure functions, no engine."""

import importlib
import json

import pytest

from rocketkv_vllm.config import parse_config, resolve_settings
from rocketkv_vllm.plan import plan_request

B, L, T = 256, 8192, 16  # budget, prompt length, niah_single's generation


def _acc():
    return importlib.import_module("rocketkv_eval.accuracy")


def _all(head_dim):
    mod = _acc()
    return {m: mod.method_settings(m, B, T, head_dim=head_dim, length=L) for m in mod.ABLATIONS}


# Split at B=256, L=8192: prompt budget 1432, page 4, top-k 128; top-r the
# head dim; SPEC's cut: 176 of 256 (Gemma 3 270M) or 48 of 64 (SmolLM2).
EXPECTED = {
    256: {
        "rocketkv_explicit": {"prompt_budget": 1432, "page_size": 4, "topk": 128, "topr": 256},
        "rocketkv_topr_spec": {"prompt_budget": 1432, "page_size": 4, "topk": 128, "topr": 176},
        "rocketkv_topk_x2": {"prompt_budget": 1432, "page_size": 4, "topk": 256, "topr": 256},
        "rocketkv_ps8": {"prompt_budget": 1432, "page_size": 8, "topk": 128, "topr": 256},
        "rocketkv_ps2": {"prompt_budget": 1432, "page_size": 2, "topk": 128, "topr": 256},
        "rocketkv_stage1_only": {
            "prompt_budget": 1432,
            "page_size": 4,
            "topk": 1456,
            "topr": 256,
            "force_current_page": False,
        },
        "rocketkv_stage2_only": {
            "evict": False,
            "page_size": 4,
            "topk": 128,
            "topr": 256,
            "force_current_page": True,
        },
    },
    64: {
        "rocketkv_explicit": {"prompt_budget": 1432, "page_size": 4, "topk": 128, "topr": 64},
        "rocketkv_topr_spec": {"prompt_budget": 1432, "page_size": 4, "topk": 128, "topr": 48},
        "rocketkv_topk_x2": {"prompt_budget": 1432, "page_size": 4, "topk": 256, "topr": 64},
        "rocketkv_ps8": {"prompt_budget": 1432, "page_size": 8, "topk": 128, "topr": 64},
        "rocketkv_ps2": {"prompt_budget": 1432, "page_size": 2, "topk": 128, "topr": 64},
        "rocketkv_stage1_only": {
            "prompt_budget": 1432,
            "page_size": 4,
            "topk": 1456,
            "topr": 64,
            "force_current_page": False,
        },
        "rocketkv_stage2_only": {
            "evict": False,
            "page_size": 4,
            "topk": 128,
            "topr": 64,
            "force_current_page": True,
        },
    },
}


@pytest.mark.parametrize("head_dim", [256, 64], ids=["gemma3-270m", "smollm2"])
def test_ablation_settings_pinned(head_dim):
    got = _all(head_dim)
    assert got == EXPECTED[head_dim]
    for settings in got.values():
        parse_config(settings)  # every one is a valid explicit config


@pytest.mark.parametrize("head_dim", [256, 64], ids=["gemma3-270m", "smollm2"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_explicit_equals_rocketkv_plan(head_dim, block_size):
    """``rocketkv_explicit`` runs exactly the numbers ``rocketkv`` plans."""
    mod = _acc()
    auto = resolve_settings(
        parse_config(mod.method_settings("rocketkv", B, T)), block_size, head_dim, L + T
    )
    plan = plan_request(auto, L)
    explicit = resolve_settings(
        parse_config(mod.method_settings("rocketkv_explicit", B, T, head_dim=head_dim, length=L)),
        block_size,
        head_dim,
        L + T,
    )
    mine = plan_request(explicit, L)
    assert explicit.page_size == auto.page_size
    assert explicit.force_current_page == auto.force_current_page and explicit.evict
    for field in ("compress", "prompt_budget", "topk", "topr", "num_compact", "tail_start"):
        assert getattr(mine, field) == getattr(plan, field), field


def test_kept_tokens():
    mod = _acc()
    assert mod.kept_tokens("dense", None, L) == L
    assert mod.kept_tokens("rocketkv", mod.method_settings("rocketkv", B, T), L) == 1432
    assert mod.kept_tokens("snapkv", mod.method_settings("snapkv", B, T), L) == B
    assert mod.kept_tokens("quest", mod.method_settings("quest", B, T), L) == L
    s = _all(256)
    assert mod.kept_tokens("x", s["rocketkv_stage2_only"], L) == L
    assert mod.kept_tokens("x", s["rocketkv_stage1_only"], L) == 1432


def test_ablations_need_one_length():
    mod = _acc()
    with pytest.raises(ValueError, match="head dim and the prompt length"):
        mod.method_settings("rocketkv_topr_spec", B, T)
    with pytest.raises(SystemExit, match="single --lengths"):
        mod.main(["--methods", "rocketkv_topr_spec", "--lengths", "4096,8192"])


def test_model_head_dim(tmp_path):
    mod = _acc()
    (tmp_path / "config.json").write_text(json.dumps({"head_dim": 256, "hidden_size": 640}))
    assert mod.model_head_dim(str(tmp_path)) == 256
    (tmp_path / "config.json").write_text(
        json.dumps({"hidden_size": 576, "num_attention_heads": 9})
    )
    assert mod.model_head_dim(str(tmp_path)) == 64


def test_confidence_interval():
    ci = _acc().confidence_interval
    assert ci([]) is None
    # Wilson, 5 of 8: 0.3057-0.8632; 8 of 8: 0.6756-1
    assert ci([100] * 5 + [0] * 3) == (30.57, 86.32)
    assert ci([100] * 8) == (67.56, 100.0)
    assert ci([0] * 32) == (0.0, 10.72)
    # fractional scores: normal interval on the mean, sample sd
    assert ci([50, 100, 0, 50]) == (9.99, 90.01)  # 50 +- 1.96 x 40.82 / 2
    assert ci([50.0, 50.0]) == (50.0, 50.0)


def test_finalize_adds_interval_to_old_rows():
    mod = _acc()
    report = {
        "rows": [{"task": "vt", "length": 10, "method": "snapkv", "budget": 4, "accuracy": 50}],
        "outputs": {
            "vt/10/snapkv/4": [{"tokens": [1], "score": 100.0}, {"tokens": [2], "score": 0}]
        },
    }
    mod.finalize(report)
    assert report["rows"][0]["ci_low"] == 9.45 and report["rows"][0]["ci_high"] == 90.55
