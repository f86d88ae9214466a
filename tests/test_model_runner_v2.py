"""ROCKETKV under vLLM's Model Runner V2, the runner vLLM uses on NVIDIA GPUs.

Every other engine test runs vLLM's CPU build with its V1 runner; V2 keeps
its requests in slots (``CommonAttentionMetadata.req_idx``), sends resumed
requests as new ones and marks dummy runs elsewhere, and ROCKETKV follows
it through its own hooks (``vllm_patches``: ``add_requests``,
``gather_batch_req_state``; ``state.WorkerRequests``). Each engine runs in
a process of its own (``model_runner_child.py``: V2 needs Triton's
interpreter set up before vLLM is imported), and the V1 runner's outputs
are the oracle: same requests, same scheduler, so the same steps.

NVIDIA's defaults pair V2 with async scheduling (``AsyncScheduler``: the
next step is scheduled while one runs, so freeing, caching and preemption
see steps in flight), which vLLM's CPU platform turns off; ``v2-async``
children turn it back on. Where no request is preempted its steps compute
what the V1 runner's do.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import same_completion

pytestmark = [
    pytest.mark.engine,
    # On a GPU vLLM runs V2 natively (tests/test_gpu.py); the children set
    # up the CPU build's interpreted V2.
    pytest.mark.skipif(torch.cuda.is_available(), reason="reaches V2 on vLLM's CPU build"),
]

CHILD = Path(__file__).with_name("model_runner_child.py")
V1_RUNNER = "vllm.v1.worker.cpu_model_runner"
V2_RUNNER = "vllm.v1.worker.cpu.model_runner"


@pytest.fixture(scope="module", autouse=True)
def _models():
    from model_runner_child import prepare_models

    prepare_models()


def _run_engines(tmp_path, *engines: tuple[str, str]) -> list[dict]:
    """Engines given as (runner, scenario), all at once, each in its own
    process and, on a machine of two cores or more, on a core of its own
    where there are enough (one thread each: the same outputs as one after
    the other)."""
    runs = []
    for i, (runner, scenario) in enumerate(engines):
        out = tmp_path / f"{runner}-{scenario}.json"
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=str(i % (os.cpu_count() or 1)))
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), runner, scenario, str(out)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        runs.append((proc, out))
    results = []
    for proc, out in runs:
        _, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-4000:]
        results.append(json.loads(out.read_text()))
    return results


def _same_outputs(got, want, abs):
    """Each request's (token ids, logprobs), written as JSON lists."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert same_completion(g, w, abs=abs), i


def _preempted_while_decoding(run: dict) -> dict[str, int]:
    """Request index -> tokens it had generated when first preempted."""
    first = {}
    for request, done, prompt in run["preemptions"]:
        if done > prompt:
            first.setdefault(request, done - prompt)
    return first


def test_preempted_compressed_request_and_reused_slots_match_v1(tmp_path):
    """Six requests through three slots, own budgets of 1024 and 0 beside the
    engine's, a document asked twice, selections reused, given-back blocks
    poisoned, and a compressed request preempted while it decodes: V2 gives
    V1's tokens, logprobs and ROCKETKV counts; V2 with async scheduling
    gives them too, but where it preempts a few steps apart (below)."""
    v1, v2, v2_async = _run_engines(
        tmp_path, ("v1", "preempt"), ("v2", "preempt"), ("v2-async", "preempt")
    )
    assert (v1["runner"], v2["runner"]) == (V1_RUNNER, V2_RUNNER)
    assert (v2["scheduler"], v2_async["scheduler"]) == ("Scheduler", "AsyncScheduler")
    # The scenario does what it is for: request 1 (a compressed prompt of
    # ~1,000 tokens) was preempted after its prompt, while decoding.
    v1_resumed = _preempted_while_decoding(v1)
    assert "1" in v1_resumed
    assert v1["decode_selections_reused"] > 0
    # 0, 1 twice (recomputed after its preemption), 4 and 5; not 2 (short) or 3 (budget 0).
    assert v1["prompts_compressed"] == 5
    assert v1["cached_tokens"][4] > 0  # the document asked again
    _same_outputs(v2["outputs"], v1["outputs"], abs=1e-4)
    for key in (
        "cached_tokens",
        "preemptions",
        "prompts_compressed",
        "decode_tokens_compressed",
        "decode_selections_reused",
    ):
        assert v2[key] == v1[key], key

    # Under async scheduling the cache runs short a few steps apart, so the
    # compressed request 1 is preempted too, with other tokens generated. A
    # resumed request selects its pages anew (selections are reused every
    # second step here), so after the earlier of the two preemptions its
    # logprobs may differ (by up to 0.03) though its tokens do not. Every
    # other request's match, and so do the counts.
    async_resumed = _preempted_while_decoding(v2_async)
    assert "1" in async_resumed
    for i, (got, want) in enumerate(zip(v2_async["outputs"], v1["outputs"])):
        assert got[0] == want[0], i
        same_until = min(
            v1_resumed.get(str(i), len(want[0])), async_resumed.get(str(i), len(want[0]))
        )
        assert same_completion(
            [got[0][:same_until], got[1][:same_until]],
            [want[0][:same_until], want[1][:same_until]],
            abs=1e-4,
        ), i
    for key in ("cached_tokens", "prompts_compressed", "decode_tokens_compressed"):
        assert v2_async[key] == v1[key], key
    assert v2_async["decode_selections_reused"] > 0


def test_triton_stage2_in_graph_layout_matches_torch_path(tmp_path):
    """The Triton Stage 2 (interpreted) with decode steps laid out for FULL
    CUDA graphs and selections reused, under V2 with async scheduling,
    NVIDIA's defaults as far as a CPU reaches them: the PyTorch Stage 2's
    tokens on the V1 runner (a tiny random model: 1e-3 on the logprobs, as
    test_engine's V1 case)."""
    torch_v1, triton_v2 = _run_engines(tmp_path, ("v1", "torch"), ("v2-async", "triton"))
    assert (triton_v2["runner"], triton_v2["scheduler"]) == (V2_RUNNER, "AsyncScheduler")
    assert (torch_v1["graph_layout"], triton_v2["graph_layout"]) == (False, True)
    assert triton_v2["decode_selections_reused"] > 0
    _same_outputs(triton_v2["outputs"], torch_v1["outputs"], abs=1e-3)
    assert triton_v2["decode_tokens_compressed"] == torch_v1["decode_tokens_compressed"]


def test_hybrid_model_matches_v1(tmp_path):
    """A tiny random Gemma 3 (sliding-window layers in vLLM's backend, one
    KV cache group each kind): a document asked three times beside other
    compressed and short prompts, prefix caching on, given-back blocks
    poisoned; V2 with async scheduling gives V1's tokens, logprobs and
    counts."""
    v1, v2 = _run_engines(tmp_path, ("v1", "hybrid"), ("v2-async", "hybrid"))
    assert (v2["runner"], v2["scheduler"]) == (V2_RUNNER, "AsyncScheduler")
    assert v1["prompts_compressed"] == 5  # all but the 50-token prompt
    assert v1["cached_tokens"][2] > 0 and v1["cached_tokens"][5] > 0  # the document again
    _same_outputs(v2["outputs"], v1["outputs"], abs=1e-4)
    assert v2["cached_tokens"] == v1["cached_tokens"]
    assert v2["decode_tokens_compressed"] == v1["decode_tokens_compressed"]


def test_aborts_mid_window_cost_only_the_aborted_requests(tmp_path):
    """Issue 57's finding 1 and its variants on both runners: two request
    slots, prompts aborted (one of ``n`` 2) while their observation window
    spans prefill chunks, beside requests mid-window and new ones. Every
    request not aborted finishes with its lone run's tokens, the engine
    serves on (the lone runs), no window buffer outlives its request (V1:
    none left; V2 keys by slot, at most one per slot) and every block comes
    back. Before the fix the V1 engine died at step 2."""
    runs = _run_engines(tmp_path, ("v1", "abort"), ("v2-async", "abort"))
    for run, buffers_left in zip(runs, (0, 2)):
        assert run["finished"] == ["A", "C", "E"]
        _same_outputs(run["outputs"], run["lone"], abs=1e-3)
        assert run["free_blocks"][1] == run["free_blocks"][0]
        assert run["window_buffers_left"] <= buffers_left
        assert run["short_windows"] == 0
        # the three survivors, each in the storm and alone
        assert run["prompts_compressed"] == 6
    _same_outputs(runs[1]["outputs"], runs[0]["outputs"], abs=1e-3)
