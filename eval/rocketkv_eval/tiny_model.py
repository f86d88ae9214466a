"""A tiny random-weight Llama with a chosen head dim, for engine tests of
head sizes the default model does not have (its weights are random: the
tokens mean nothing, but they are deterministic, so backends can be
compared token for token). Uses the default model's tokenizer; built
offline into the model cache, once per head dim."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from rocketkv_eval.model import default_cache_dir, prepare_default_model

_DONE = ".rocketkv-tiny-complete"


def _save(model, tokenizer, out: Path, meta: dict) -> str:
    """Write the model and tokenizer to ``out`` whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE).write_text(json.dumps(meta))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def prepare_tiny_model(
    head_dim: int,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    num_layers: int = 2,
    seed: int = 0,
    vocab_size: int | None = None,
) -> str:
    """A directory vLLM loads: a Llama of ``num_layers`` layers whose
    attention has ``num_heads`` query heads of ``head_dim`` channels.
    ``vocab_size``: fewer output rows than the tokenizer's (prompts must then
    be token ids below it): vLLM's V2 sampler, interpreted on CPU, costs in
    proportion to the vocabulary."""
    name = f"tiny-llama-d{head_dim}-h{num_heads}-kv{num_kv_heads}-l{num_layers}-s{seed}"
    if vocab_size is not None:
        name += f"-v{vocab_size}"
    out = default_cache_dir().parent / name
    if (out / _DONE).is_file():
        return str(out)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(source)
    hidden = 64 * num_heads
    config = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    return _save(model, tokenizer, out, {"head_dim": head_dim, "seed": seed})


def prepare_tiny_gemma3(
    head_dim: int = 64,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    sliding_window: int = 64,
    query_pre_attn_scalar: int = 48,
    seed: int = 0,
    vocab_size: int | None = None,
) -> str:
    """A tiny random-weight Gemma 3 text model with the hybrid layout of the
    real ones: 6 layers, each third full attention, the others a sliding
    window of ``sliding_window`` tokens; a ``query_pre_attn_scalar`` other
    than the head dim so a wrong attention scale changes the tokens."""
    name = (
        f"tiny-gemma3-d{head_dim}-h{num_heads}-kv{num_kv_heads}-w{sliding_window}"
        f"-q{query_pre_attn_scalar}-s{seed}"
    )
    if vocab_size is not None:  # as prepare_tiny_model's
        name += f"-v{vocab_size}"
    out = default_cache_dir().parent / name
    if (out / _DONE).is_file():
        return str(out)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    source = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(source)
    hidden = 64 * num_heads
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"] * 2
    config = Gemma3TextConfig(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        sliding_window=sliding_window,
        query_pre_attn_scalar=query_pre_attn_scalar,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        architectures=["Gemma3ForCausalLM"],
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).to(torch.float32)
    # Random init leaves the RMSNorm weights at zero (Gemma scales by 1 + w):
    # spread them so every layer's norms matter. A large untied output layer
    # gives peaked logits (greedy tokens are no near-ties) that do not just
    # repeat the input token.
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.normal_(0.0, 0.2)
        model.lm_head.weight.normal_(0.0, 0.5)
    return _save(model, tokenizer, out, {"name": name, "seed": seed})


def prepare_tiny_gpt_oss(
    sliding_window: int = 64, full_layer_sink: float | None = None, seed: int = 0
) -> str:
    """A tiny random-weight gpt-oss (bf16 experts, no quantization): 4
    layers alternating sliding-window and full attention, 4 query heads and
    2 KV heads of 64 channels, learned attention sinks spread around zero
    (some heads' sinks dominate short contexts, some never matter).
    ``full_layer_sink``: every full-attention layer's sinks set to it (a
    large one makes their attention output vanish, whichever tokens it
    reads: an oracle for "the sinks are applied")."""
    sink_tag = "" if full_layer_sink is None else f"-fs{full_layer_sink:g}"
    name = f"tiny-gpt-oss-w{sliding_window}{sink_tag}-s{seed}"
    out = default_cache_dir().parent / name
    if (out / _DONE).is_file():
        return str(out)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer, GptOssConfig, GptOssForCausalLM

    source = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = GptOssConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=sliding_window,
        max_position_embeddings=8192,
        # vLLM's gpt-oss reads YaRN's parameters; factor 1 leaves RoPE as is.
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 1.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        architectures=["GptOssForCausalLM"],
    )
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("sinks"):
                param.normal_(0.0, 3.0)
                layer = int(param_name.split(".layers.")[1].split(".")[0])
                if full_layer_sink is not None and config.layer_types[layer] == "full_attention":
                    param.fill_(full_layer_sink)
            elif "norm" in param_name:
                param.normal_(1.0, 0.2)
        model.lm_head.weight.normal_(0.0, 0.5)
    return _save(model, tokenizer, out, {"name": name, "seed": seed})
