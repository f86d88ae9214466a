"""The bounded load test (scripts/load_test.py, rocketkv_eval.load_test), small:
a real ROCKETKV OpenAI server, 8 streamed completions from 4 concurrent
clients, half of them prompts longer than its budget. (The harness runs a
dense server the same way; scripts/load_test.py compares the two.)
"""

from __future__ import annotations

import json

import pytest

from rocketkv_eval import load_test

pytestmark = pytest.mark.engine


def _load_test_module():
    return load_test


def test_prompt_mix_is_seeded_and_exact(tokenizer):
    mod = _load_test_module()
    args = mod.parse_args(
        [
            "--requests",
            "6",
            "--long-tokens",
            "1200",
            "--long-fraction",
            "0.5",
            "--max-model-len",
            "2048",
        ]
    )
    a = mod.build_prompts(tokenizer, args)
    b = mod.build_prompts(tokenizer, args)
    assert [p.token_ids for p in a] == [p.token_ids for p in b]
    assert sum(p.kind == "long" for p in a) == 3
    assert len({tuple(p.token_ids) for p in a}) == 6  # all distinct
    for p in a:
        n = len(p.token_ids)
        assert (1150 < n < 1250) if p.kind == "long" else (80 < n < 120), n


def test_parse_metrics_sums_labelled_samples():
    mod = _load_test_module()
    text = (
        '# HELP x\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        'rocketkv:prompts_compressed_total{engine="0"} 4\n'
    )
    got = mod.parse_metrics(text)
    assert got["vllm:num_requests_running"] == 5.0
    assert got["rocketkv:prompts_compressed_total"] == 4.0


def test_small_load_on_a_rocketkv_server(model_path, tmp_path):
    mod = _load_test_module()
    out = tmp_path / "load.json"
    code = mod.main(
        [
            "--backends",
            "rocketkv",  # the harness is the same for dense (bench_e2e compares them)
            "--rocketkv",
            '{"prompt_budget": 256}',
            "--model",
            model_path,
            "--concurrency",
            "4",
            "--requests",
            "8",
            "--long-tokens",
            "1200",
            "--max-tokens",
            "16",
            "--max-model-len",
            "2048",
            "--dtype",
            "float32",
            "--request-timeout",
            "300",
            "--prestart",
            "--log-dir",
            str(tmp_path / "logs"),
            "--json",
            str(out),
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["lost"] == 0
    n_long = doc["prompts"]["long"]
    assert n_long == 4
    for backend in ("rocketkv",):
        s = doc["results"][backend]["summary"]
        assert s["lost"] == 0 and s["errors"] == 0
        assert s["completed"] == 8
        assert s["output_tokens"] == 8 * 16  # EOS ignored: max_tokens each
        assert set(s["finish_reasons"]) == {"length"}
        assert s["ttft_p50_s"] is not None and s["itl_p50_s"] is not None
        assert 1 <= s["peak_running"] <= 4
    rkv = doc["results"]["rocketkv"]["summary"]["rocketkv"]
    assert rkv["prompts_compressed_total"] == n_long
    assert rkv["kv_blocks_freed_total"] > 0
    for r in doc["results"]["rocketkv"]["per_request"]:
        assert r["status"] == "completed" and r["completion_tokens"] == 16
