"""``scripts/bench_e2e.py --model-config``: a model from its config.json alone
(vLLM's ``load_format="dummy"``: random weights, no tokenizer), so the
end-to-end benchmark can run a Llama-3.1-8B-shaped engine where the weights
cannot travel. Here a tiny Llama of the same architecture on CPU: dense and
ROCKETKV engines really run, every request generates exactly the asked
tokens, ROCKETKV compresses each prompt, and the report says the weights
were dummy."""

from __future__ import annotations

import json

import pytest

from rocketkv_eval import e2e


def test_model_configs_name_the_llama_3_1_8b_shape():
    with open(f"{e2e.MODEL_CONFIGS}/llama-3.1-8b.json") as f:
        cfg = json.load(f)
    shape = {k: cfg[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")}
    assert shape == {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
    assert cfg["num_hidden_layers"] == 32 and cfg["max_position_embeddings"] == 131072
    with pytest.raises(SystemExit, match="known names: .*llama-3.1-8b"):
        e2e.model_config_dir("no-such-model")


def test_random_prompts_have_exact_lengths_and_are_seeded():
    a = e2e.random_prompts(5000, 3, 257)
    assert [len(p) for p in a] == [257] * 3
    assert a == e2e.random_prompts(5000, 3, 257)
    assert all(1000 <= t < 4000 for p in a for t in p)


@pytest.mark.engine
def test_dummy_weights_engines_run_dense_and_rocketkv(tmp_path):
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 2,
        "vocab_size": 4096,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    cfg_path = tmp_path / "tiny-llama.json"
    cfg_path.write_text(json.dumps(config))
    out = tmp_path / "e2e.json"
    rc = e2e.main(
        [
            "--model-config",
            str(cfg_path),
            "--workloads",
            "700x2,520x1",
            "--new-tokens",
            "8",
            "--dtype",
            "float32",
            "--methods",
            "dense,token_budget=128",
            "--kv-cache-gib",
            "0.25",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["weights"].startswith("dummy")
    assert report["workloads"] == [
        {"prompts": 2, "prompt_tokens": 700},
        {"prompts": 1, "prompt_tokens": 520},
    ]
    # one engine per method, each workload a row: dense 700x2, 520x1, then ROCKETKV's
    rows = report["rows"]
    assert [(r["backend"] == "ROCKETKV", r["prompts"], r["prompt_tokens"]) for r in rows] == [
        (False, 2, 700),
        (False, 1, 520),
        (True, 2, 700),
        (True, 1, 520),
    ]
    # at budget 128 every prompt is compressed, counted per workload
    assert [r["prompts_compressed"] for r in rows[2:]] == [2, 1]
    for row in rows:
        assert row["per_user_decode_tok_s"] > 0
        assert len(row["blocks_per_request_after_prefill"]) == row["prompts"]
    for ours in rows[2:]:  # each compared with the dense row of its own workload
        assert ours["per_user_decode_speedup_vs_dense"] > 0
        assert ours["prefill_vs_dense"] > 0
