"""Per-request token budgets: a client may set RocketKV's budget for one
request, or switch compression off for it.

Offline: ``SamplingParams(extra_args={"rocketkv_token_budget": 512})``;
OpenAI server: ``"vllm_xargs": {"rocketkv_token_budget": 512}`` in the body.
``0`` serves the request uncompressed. The value is checked when the request
arrives (a validation error, a 400 at the server: ``vllm_patches``).

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
    """The budget every process plans a request with. Values were checked
    when the request arrived; one that was not (a request handed to the
    engine core directly) plans with the engine's settings everywhere rather
    than stopping the scheduler or a worker."""
    try:
        return params_token_budget(params)
    except RocketKVConfigError:
        return None
