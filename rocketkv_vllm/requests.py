"""Per-request token budgets: a client may set RocketKV's budget for one
request, or switch compression off for it.

Offline: ``SamplingParams(extra_args={"rocketkv_token_budget": 512})``;
OpenAI server: ``"vllm_xargs": {"rocketkv_token_budget": 512}`` in the body.
``0`` serves the request uncompressed, as is every request that decodes
nothing (``planned_budget``). The value is checked when the request arrives
(a validation error, a 400 at the server: ``vllm_patches``).

Every process plans a request with ``plan.plan_request(settings, prompt_len,
planned_budget(params))``: the scheduler from its ``Request``, each worker
from the sampling parameters of the new requests it is sent (``state``), the
API server's metrics from the request it tracks.
"""

from __future__ import annotations

from typing import Any

from rocketkv_vllm.config import MAX_INT, RocketKVConfigError

REQUEST_BUDGET_KEY = "rocketkv_token_budget"
BUDGET_RANGE = (16, MAX_INT)  # as rocketkv.token_budget


def request_token_budget(extra_args: dict[str, Any] | None) -> int | None:
    """The budget a request asks for: None (the engine's settings), 0 (no
    compression) or a token budget; raises on anything else."""
    if not extra_args or REQUEST_BUDGET_KEY not in extra_args:
        return None
    value = extra_args[REQUEST_BUDGET_KEY]
    lo, hi = BUDGET_RANGE
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not (value == 0 or lo <= value <= hi)
    ):
        raise RocketKVConfigError(
            f"vllm_xargs.{REQUEST_BUDGET_KEY}={value!r} is invalid: allowed 0 "
            f"(this request uncompressed) or an integer in [{lo}, {hi}]"
        )
    return value


def params_token_budget(params) -> int | None:
    """``request_token_budget`` of a SamplingParams (None for pooling)."""
    return request_token_budget(getattr(params, "extra_args", None))


def planned_budget(params) -> int | None:
    """The budget every process plans a request with (``params``: its
    SamplingParams, None for a pooling request).

    0 (uncompressed) for a request that decodes nothing after its prompt:
    pooling, and ``max_tokens`` 1 (scoring, classification, each step of
    vLLM's beam search), whose one token comes from the prompt's own
    forward. Compressing it would only cost Stage 1 and, with prefix
    caching, the recomputed window of a compressed prompt; the blocks it
    would give back are freed with the request in the same step. Every
    process sees the same ``max_tokens`` (vLLM fills in a missing one
    before the request leaves the frontend).

    Otherwise the request's own budget; values were checked when the
    request arrived, and one that was not (a request handed to the engine
    core directly) plans with the engine's settings everywhere rather than
    stopping the scheduler or a worker."""
    if params is None or getattr(params, "max_tokens", None) == 1:
        return 0
    try:
        return params_token_budget(params)
    except RocketKVConfigError:
        return None
