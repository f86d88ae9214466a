"""Shared fixtures: the embedded SmolLM2 model and vLLM engines on CPU."""

import contextlib
import gc
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Under pytest-xdist (`make test` runs two workers: CI has 2 cores) each worker
# keeps to one core, set before torch is imported: its in-process engines
# compute in one thread and the servers it spawns bind their worker to that
# core, so two engines run side by side instead of fighting over both cores.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
if _XDIST_WORKER:
    _cores = sorted(os.sched_getaffinity(0))
    _core = _cores[int(_XDIST_WORKER[2:]) % len(_cores)]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(_core))

# Small, fixed engine settings so tests fit a 2-core CI machine.
ENGINE_KW = dict(
    max_model_len=8192,
    enforce_eager=True,
    dtype="float32",
    kv_cache_memory_bytes=1 << 30,
    seed=0,
)


@pytest.fixture(scope="session")
def model_path() -> str:
    from rocketkv_eval.model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def tiny(model_path) -> str:
    """A tiny random Llama with SmolLM2's tokenizer and head geometry (head
    dim 64, GQA 3:1), 2 layers: for tests whose oracle is another engine
    run (ROCKETKV or vLLM's own backend), so they compare logprobs (which
    every attention row moves; random weights make tokens alone robust to
    attention errors) at a small fraction of SmolLM2's 30-layer prefill."""
    from rocketkv_eval.tiny_model import prepare_tiny_model

    return prepare_tiny_model(64, num_heads=3, num_kv_heads=1)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@contextlib.contextmanager
def _env(name: str, value: str | None):
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def make_llm(
    model_path: str,
    backend: str,
    rocketkv: dict | None = None,
    testing: dict | None = None,
    spawn: bool = False,
    **kw,
):
    """A real engine; ``testing``: ROCKETKV's test aids (config.TestAids).

    In this process by default: engine core and worker
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, under which vLLM's CPU platform
    keeps the one worker in process), the same engine, without two spawned
    processes that each import vLLM (on a 2-core CI machine ~40 s a start
    against ~5 s).
    ``spawn=True``: vLLM's default processes (engine core and worker
    spawned), as the servers in test_serve / test_metrics also run."""
    from vllm import LLM

    args = dict(ENGINE_KW)
    args.update(kw)
    extra = {}
    if rocketkv is not None:
        extra["rocketkv"] = rocketkv
    if testing:
        extra["rocketkv_testing"] = testing
    if extra:
        args["additional_config"] = extra
    with _env("VLLM_ENABLE_V1_MULTIPROCESSING", None if spawn else "0"):
        try:
            return LLM(model=model_path, attention_backend=backend, **args)
        except Exception:
            if not spawn:
                # A start refused after this process's worker set up vLLM's
                # distributed state (e.g. at the KV cache spec) leaves it
                # set up, and the next in-process engine would reuse it (an
                # MoE model then finds no expert-parallel group). A spawned
                # worker takes its state with it.
                from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

                cleanup_dist_env_and_memory()
            raise


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def chat_prompt(tokenizer, text: str) -> str:
    """``text`` as one user turn in the model's chat template."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def greedy(llm, prompts, max_tokens=24):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]


def ids_and_logprobs(out) -> tuple[list[int], list[float]]:
    """A RequestOutput's first completion: its token ids and the logprob of
    each (sampled with ``logprobs=1``)."""
    o = out.outputs[0]
    return list(o.token_ids), [step[t].logprob for step, t in zip(o.logprobs, o.token_ids)]


def same_completion(a, b, abs: float = 1e-4) -> bool:
    """Two ``ids_and_logprobs``: the same tokens, logprobs within ``abs``."""
    return a[0] == b[0] and a[1] == pytest.approx(b[1], abs=abs)


def cpu_attn_decode(q, kv, row, n, isa, cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    """vLLM CPU_ATTN's own attention kernel for one query token at position
    n - 1 of one request (block row ``row``) over a ROCKETKV-shaped cache
    ``kv`` [num_blocks, Hkv, bs, 2d]. Returns [1, Hq, d]."""
    import torch

    from rocketkv_eval.bench_hsa_cpu import cpu_attn_decoder

    seq = torch.tensor([n], dtype=torch.int32)
    return cpu_attn_decoder(q, kv, row[None].int(), seq, isa, cache_dtype, k_scale, v_scale)()


def pytest_configure(config):
    # Triton decides interpreter mode when a kernel module is imported: set it
    # before any test imports one (CPU machines have no Triton backend).
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from triton_interpreter import speed_up

    speed_up()


# The test files that take longest, longest first (`make test --durations`
# on a 2-core machine). pytest-xdist hands files to its workers in collection
# order (the Makefile's --no-loadscope-reorder; by default it puts the files
# with the fewest tests last, and those are the storms and spawned engines),
# so the two workers end together instead of one running a long file alone.
SLOWEST_FIRST = (
    # worker-seconds, estimated from 2-core runs of 2026-12-07 after the
    # engine tests moved to the tiny model (tests/test_pd_nixl.py ~500)
    "test_pd_nixl.py",
    "test_engine.py",
    "test_decode_launches.py",
    "test_model_runner_v2.py",
    "test_parallel.py",
    "test_gemma3_engine.py",
    "test_kernels.py",
    "test_warmup.py",
    "test_concurrency.py",
    "test_pd_serve.py",
    "test_pd_faults.py",
    "test_host_tier.py",
    "test_prefix_caching.py",
    "test_serve.py",
    "test_metrics.py",
    "test_head_sizes.py",
    "test_lora.py",
    "test_load.py",
    "test_compile_kernels.py",
    "test_eval.py",
    "test_kv_cache.py",
    "test_fault_campaign.py",
    "test_keep_rule_engine.py",
    "test_fp8_kv_engine.py",
    "test_hybrid.py",
    "test_gpt_oss.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole
