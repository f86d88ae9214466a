"""Shared fixtures: the embedded SmolLM2 model and vLLM engines on CPU."""

import contextlib
import gc
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
        return LLM(model=model_path, attention_backend=backend, **args)


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def greedy(llm, prompts, max_tokens=24):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]


def cpu_attn_decode(q, kv, row, n, isa, cache_dtype="auto", k_scale=1.0, v_scale=1.0):
    """vLLM CPU_ATTN's own attention kernel for one query token at position
    n - 1 of one request (block row ``row``) over a ROCKETKV-shaped cache
    ``kv`` [num_blocks, Hkv, bs, 2d] (its forward hands the kernel each
    head's block as [2 * bs, d] halves). Returns [1, Hq, d]."""
    import torch
    from vllm import _custom_ops as ops

    num_blocks, hkv, bs, width = kv.shape
    d = width // 2
    out = torch.empty_like(q)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    seq = torch.tensor([n], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1,
        num_heads=q.shape[1],
        num_kv_heads=hkv,
        head_dim=d,
        seq_lens=seq,
        dtype=q.dtype,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
        kv_cache_dtype=cache_dtype,
    )
    rows = kv.view(num_blocks, hkv, 2 * bs, d)
    ops.cpu_attention_with_kv_cache(
        query=q,
        key_cache=rows[:, :, :bs],
        value_cache=rows[:, :, bs:],
        output=out,
        query_start_loc=qsl,
        seq_lens=seq,
        scale=d**-0.5,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=row[None].int(),
        softcap=0,
        scheduler_metadata=meta,
        s_aux=None,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=cache_dtype,
    )
    return out


def pytest_configure(config):
    # Triton decides interpreter mode when a kernel module is imported: set it
    # before any test imports one (CPU machines have no Triton backend).
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
