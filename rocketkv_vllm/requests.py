"""Per-request token budgets: a client may set RocketKV's budget for one
request, or switch compression off for it.

Offline: ``SamplingParams(extra_args={"rocketkv_token_budget": 512})``;
OpenAI server: ``"vllm_xargs": {"rocketkv_token_budget": 512}`` in the body.
``0`` serves the request uncompressed, as is every request that decodes
nothing (``planned_budget``). The value is checked when the request arrives
(a validation error naming the field, a 400 at the server: ``vllm_patches``),
and so is every other ``rocketkv*`` key: a misspelled one is refused with the
known keys, not ignored.

Every process plans a request with ``plan.plan_request(settings, prompt_len,
planned_budget(params))``: the scheduler from its ``Request``, each worker
from the sampling parameters of the new requests it is sent (``state``), the
API server's metrics from the request it tracks.
"""

from __future__ import annotations

from typing import Any

from rocketkv_vllm.config import MAX_INT, RocketKVConfigError

REQUEST_BUDGET_KEY = "rocketkv_token_budget"
REQUEST_KEYS = (REQUEST_BUDGET_KEY,)  # every extra_args key ROCKETKV reads
# Keys starting with this (any case) are ROCKETKV's: an unknown one is a
# typo, refused. Other keys belong to other plugins and are left alone.
KEY_PREFIX = "rocketkv"
BUDGET_RANGE = (16, MAX_INT)  # as rocketkv.token_budget


class RocketKVRequestError(RocketKVConfigError):
    """A request's own ROCKETKV input is malformed; ``field`` names it as the
    server's body does (``vllm_xargs...``), ``value`` is what was given."""

    def __init__(self, message: str, field: str, value: Any = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


def request_token_budget(extra_args: dict[str, Any] | None) -> int | None:
    """The budget a request asks for: None (the engine's settings), 0 (no
    compression) or a token budget. Raises ``RocketKVRequestError`` on
    anything else: ``extra_args`` not a dict, an unknown ``rocketkv*`` key,
    a budget out of range."""
    if extra_args is None:
        return None
    if not isinstance(extra_args, dict):
        raise RocketKVRequestError(
            f"vllm_xargs (SamplingParams.extra_args) must be an object of "
            f"key-value pairs, got {type(extra_args).__name__}",
            "vllm_xargs",
            extra_args,
        )
    for key in extra_args:
        if _ours(key) and key not in REQUEST_KEYS:
            raise RocketKVRequestError(
                f"vllm_xargs.{key} is not a ROCKETKV request argument; known: "
                f"{', '.join(REQUEST_KEYS)}",
                f"vllm_xargs.{key}",
                extra_args[key],
            )
    if REQUEST_BUDGET_KEY not in extra_args:
        return None
    value = extra_args[REQUEST_BUDGET_KEY]
    lo, hi = BUDGET_RANGE
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not (value == 0 or lo <= value <= hi)
    ):
        raise RocketKVRequestError(
            f"vllm_xargs.{REQUEST_BUDGET_KEY}={value!r} is invalid: allowed 0 "
            f"(this request uncompressed) or an integer in [{lo}, {hi}]",
            f"vllm_xargs.{REQUEST_BUDGET_KEY}",
            value,
        )
    return value


def _ours(key) -> bool:
    return isinstance(key, str) and key.lower().startswith(KEY_PREFIX)


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

    A prefill-side request of disaggregated prefill and decode
    (``kv_transfer_params.do_remote_decode``) also asks for one token, but
    decodes on another engine from the K/V this one leaves: it is planned
    with its own budget (``pd``).

    Otherwise the request's own budget. ``extra_args`` was checked when the
    request arrived; one that skipped the check and is malformed (an
    ``EngineCoreRequest`` handed to the engine directly skips vLLM's input
    processor) plans with the engine's settings everywhere rather than
    stopping the scheduler or a worker."""
    if params is None:
        return 0
    if getattr(params, "max_tokens", None) == 1 and not _decodes_elsewhere(params):
        return 0
    try:
        return params_token_budget(params)
    except RocketKVConfigError:
        return None


def _decodes_elsewhere(params) -> bool:
    extra = getattr(params, "extra_args", None)
    kv = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    return isinstance(kv, dict) and bool(kv.get("do_remote_decode"))
