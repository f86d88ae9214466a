"""Small helpers for benchmarks and tests that drive an in-process engine."""

from __future__ import annotations

import contextlib
import os

_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextlib.contextmanager
def in_process():
    """Build engines whose engine core (scheduler) runs in this process, so
    the caller can read vLLM's scheduler directly; restores the setting."""
    saved = os.environ.get(_MULTIPROCESSING)
    os.environ[_MULTIPROCESSING] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(_MULTIPROCESSING, None)
        else:
            os.environ[_MULTIPROCESSING] = saved


def scheduler(llm):
    """vLLM's scheduler of an in-process ``LLM``."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def external_id(request) -> str:
    """The caller's request id (vLLM appends "-<8 random chars>" internally)."""
    return request.request_id.rsplit("-", 1)[0]


def held_blocks(sched, req_id: str) -> int:
    """KV blocks a request holds now, in every KV cache group (a hybrid
    model's sliding-window groups included; the null block not counted)."""
    managers = sched.kv_cache_manager.coordinator.single_type_managers
    return sum(1 for m in managers for b in m.req_to_blocks.get(req_id, []) if not b.is_null)
