"""Head sizes beyond 64 and 128, end to end on CPU: a tiny random-weight
Llama with head dim 96 (``rocketkv_eval.tiny_model``; its tokens mean
nothing but are deterministic)."""

import random

import pytest
from conftest import make_llm, shutdown

pytestmark = pytest.mark.engine

HEAD_DIM = 96


@pytest.fixture(scope="module")
def tiny_model():
    from rocketkv_eval.tiny_model import prepare_tiny_model

    return prepare_tiny_model(HEAD_DIM)


def _tokens(llm, prompts, max_tokens=12):
    """Greedy tokens and each token's logprob, per prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [
        (
            list(o.outputs[0].token_ids),
            [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
        )
        for o in outs
    ]


def _run(model, backend, rocketkv=None, prompts=()):
    llm = make_llm(model, backend, rocketkv, block_size=32)
    try:
        return _tokens(llm, prompts)
    finally:
        shutdown(llm)


def test_head_dim_96_end_to_end(tiny_model):
    """Uncompressed, ROCKETKV gives vLLM CPU_ATTN's tokens and logprobs;
    compressed, the C++ Stage 2 and the Triton kernels give the batched
    PyTorch path's."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (1200, 200, 2100)]
    dense = _run(tiny_model, "CPU_ATTN", prompts=prompts)
    uncompressed = _run(tiny_model, "ROCKETKV", {"prompt_budget": 4096}, prompts)
    native = _run(tiny_model, "ROCKETKV", {"prompt_budget": 256}, prompts)
    reference = _run(tiny_model, "ROCKETKV", {"prompt_budget": 256, "kernel": "torch"}, prompts)
    triton = _run(
        tiny_model, "ROCKETKV", {"prompt_budget": 256, "kernel": "triton"}, prompts
    )  # interpreted on CPU

    def close(a, b, tol):
        return a[0] == b[0] and a[1] == pytest.approx(b[1], abs=tol)

    assert all(close(u, d, 1e-4) for u, d in zip(uncompressed, dense))
    assert all(close(n, r, 1e-4) for n, r in zip(native, reference))
    assert all(close(t, r, 1e-4) for t, r in zip(triton, reference))
    assert close(native[1], dense[1], 1e-4)  # 200 tokens: not compressed
    # Compression changed what the long prompts attend to.
    assert not close(native[0], dense[0], 1e-4) and not close(native[2], dense[2], 1e-4)
