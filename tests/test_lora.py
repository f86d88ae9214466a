"""LoRA adapters on a ROCKETKV engine (vLLM's ``enable_lora``).

An adapter changes the queries, keys and values a layer computes, so it
changes what Stage 1 keeps and Stage 2 selects, and vLLM keys a prefix-cache
block by its adapter. An engine with prefix caching on and given-back blocks
poisoned serves a base request, then adapter requests on the same prompt;
the oracles are vLLM's CPU_ATTN with the adapter (uncompressed rows) and an
engine with prefix caching off (compressed rows). The tiny random Llama
(conftest ``tiny``): every oracle is another engine, compared by logprobs.
"""

import json

import pytest
from conftest import ids_and_logprobs, make_llm, same_completion, shutdown

pytestmark = pytest.mark.engine

ROCKETKV = {"token_budget": 128, "max_new_tokens": 16}
LORA = dict(enable_lora=True, max_lora_rank=8, max_model_len=2048, kv_cache_memory_bytes=1 << 29)


@pytest.fixture(scope="module")
def adapter(tiny, tmp_path_factory):
    """A random rank-8 adapter on every layer's q_proj and v_proj, written
    in PEFT's layout (no training: it only has to change the outputs)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    outputs = {"q_proj": cfg.hidden_size, "v_proj": cfg.num_key_value_heads * head_dim}
    gen = torch.Generator().manual_seed(0)
    weights = {}
    for i in range(cfg.num_hidden_layers):
        for name, out in outputs.items():
            key = f"base_model.model.model.layers.{i}.self_attn.{name}"
            weights[f"{key}.lora_A.weight"] = torch.randn(8, cfg.hidden_size, generator=gen) * 0.02
            weights[f"{key}.lora_B.weight"] = torch.randn(out, 8, generator=gen) * 0.02
    path = tmp_path_factory.mktemp("lora")
    save_file(weights, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": list(outputs),
        "base_model_name_or_path": tiny,
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def test_adapter_requests_after_a_base_request_on_their_prompt(tiny, tokenizer, adapter):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from rocketkv_eval import tasks as eval_tasks

    lora = LoRARequest("random", 1, adapter)
    p1, p2 = (
        TokensPrompt(prompt_token_ids=s.token_ids)
        for s in eval_tasks.make_samples("niah_single", tokenizer, 700, 2)
    )

    def params(budget=None):
        extra = None if budget is None else {"rocketkv_token_budget": budget}
        return SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, extra_args=extra)

    def results(llm, requests):
        prompts, sampling, loras = zip(*requests)
        outs = llm.generate(list(prompts), list(sampling), lora_request=list(loras), use_tqdm=False)
        return [ids_and_logprobs(o) for o in outs]

    # Base p1 first, so its blocks are in the prefix cache when the adapter's
    # p1 arrives: a hit across adapters would give the base model's K/V.
    # Adapter rows only in the batch: vLLM 0.32's CPU build gives a base row
    # batched beside an adapter row the adapter's logits (CPU_ATTN too).
    batch = [(p1, params(), lora), (p1, params(0), lora), (p2, params(), lora)]
    llm = make_llm(tiny, "ROCKETKV", ROCKETKV, testing={"poison_evicted_blocks": True}, **LORA)
    [base_p1] = results(llm, [(p1, params(), None)])
    mixed = results(llm, batch)
    shutdown(llm)
    no_cache = make_llm(tiny, "ROCKETKV", ROCKETKV, enable_prefix_caching=False, **LORA)
    want = results(no_cache, batch)
    shutdown(no_cache)
    dense = make_llm(tiny, "CPU_ATTN", block_size=32, **LORA)
    want_dense = results(dense, batch)
    shutdown(dense)

    assert all(same_completion(a, b) for a, b in zip(mixed, want))
    assert same_completion(mixed[1], want_dense[1])  # uncompressed, with the adapter
    # The adapter changed the outputs (so it was applied), and compression did.
    assert not same_completion(mixed[0], base_p1)
    assert not same_completion(mixed[0], mixed[1]) and not same_completion(mixed[2], want_dense[2])
