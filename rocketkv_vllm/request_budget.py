"""Per-request token budgets: a client may set RocketKV's budget for one
request, or switch compression off for it.

Offline: ``SamplingParams(extra_args={"rocketkv_token_budget": 512})``;
OpenAI server: ``"vllm_xargs": {"rocketkv_token_budget": 512}`` in the body.
``0`` serves the request uncompressed. The value is checked when the request
arrives (``plugin._validate_requests``: a 400 at the server).

A request's plan is ``config.plan_request(settings, prompt_len, budget)`` in
every process, so each process that acts on a plan must know the request's
budget:

- the scheduler (its block manager frees the evicted blocks): the request
  objects it holds (``scheduler_budget``);
- each worker (its attention builder runs Stage 1 / Stage 2): the requests'
  sampling parameters that the scheduler sends with every new request,
  remembered per batch row by hooks on vLLM's two model runners
  (``WORKER_BUDGETS``);
- the API server's metrics: ``metrics`` reads them from the request.

Hooks are installed lazily, by ROCKETKV's own scheduler-side manager and
attention builder, so engines with other backends are untouched.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import numpy as np

from rocketkv_vllm.config import RocketKVConfigError, token_budget_range

REQUEST_BUDGET_KEY = "rocketkv_token_budget"
_HOOKED = "_rocketkv_budget_hook"


def request_token_budget(extra_args: dict[str, Any] | None) -> int | None:
    """The budget a request asks for: None (the engine's settings), 0 (no
    compression) or a token budget; raises on anything else."""
    if not extra_args or REQUEST_BUDGET_KEY not in extra_args:
        return None
    value = extra_args[REQUEST_BUDGET_KEY]
    lo, hi = token_budget_range()
    if (isinstance(value, bool) or not isinstance(value, int)
            or not (value == 0 or lo <= value <= hi)):
        raise RocketKVConfigError(
            f"vllm_xargs.{REQUEST_BUDGET_KEY}={value!r} is invalid: allowed 0 "
            f"(this request uncompressed) or an integer in [{lo}, {hi}]")
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


# Scheduler process: running requests that carry a budget, by request id.
# Weak: an entry leaves with the scheduler's Request object.
_scheduled: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def scheduler_budget(request_id: str) -> int | None:
    request = _scheduled.get(request_id)
    return None if request is None else planned_budget(request.sampling_params)


def install_scheduler_hook() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, _HOOKED, False):
        return
    original = Scheduler.add_request

    def add_request(self, request) -> None:
        if planned_budget(request.sampling_params) is not None:
            _scheduled[request.request_id] = request
        original(self, request)

    Scheduler.add_request = add_request
    setattr(Scheduler, _HOOKED, True)


class WorkerBudgets:
    """Each batch row's budget, in a worker process.

    Model Runner V2 gives each row's slot in its request table
    (``CommonAttentionMetadata.req_idx``): budgets are kept per slot, set when
    a request takes the slot. The V1 runner reorders its persistent batch in
    ``_update_states``: the rows' budgets are read off its order right after.
    """

    def __init__(self) -> None:
        self.by_request: dict[str, int] = {}  # V1: requests with a budget
        self.rows: list[int | None] = []  # V1: this step's rows
        self.by_slot: dict[int, int | None] = {}  # V2

    def for_rows(self, cm) -> list[int | None]:
        n = cm.num_reqs
        if cm.req_idx is not None:
            slots = np.asarray(cm.req_idx[:n]).tolist()
            return [self.by_slot.get(s) for s in slots]
        rows = self.rows[:n]
        return rows + [None] * (n - len(rows))


WORKER_BUDGETS = WorkerBudgets()


def _hook_v1_runner(runner_cls) -> None:
    original = runner_cls._update_states

    def _update_states(self, scheduler_output):
        budgets = WORKER_BUDGETS
        for req_id in scheduler_output.finished_req_ids:
            budgets.by_request.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            budget = planned_budget(new.sampling_params)
            if budget is None:
                budgets.by_request.pop(new.req_id, None)
            else:
                budgets.by_request[new.req_id] = budget
        result = original(self, scheduler_output)
        by_request = budgets.by_request
        budgets.rows = ([by_request.get(r) for r in self.input_batch.req_ids]
                        if by_request else [])
        return result

    runner_cls._update_states = _update_states


def _hook_v2_runner(runner_cls) -> None:
    original = runner_cls.add_requests

    def add_requests(self, scheduler_output) -> None:
        original(self, scheduler_output)
        index = self.req_states.req_id_to_index
        for new in scheduler_output.scheduled_new_reqs:
            slot = index.get(new.req_id)
            if slot is not None:
                WORKER_BUDGETS.by_slot[slot] = planned_budget(new.sampling_params)

    runner_cls.add_requests = add_requests


def hook_model_runners(hook_v1, hook_v2, marker: str) -> None:
    """Apply a hook to whichever of vLLM's model runners (V1, Model Runner
    V2) this process has loaded, once per runner class (``marker``)."""
    for module_name, hook in (("vllm.v1.worker.gpu_model_runner", hook_v1),
                              ("vllm.v1.worker.gpu.model_runner", hook_v2)):
        module = sys.modules.get(module_name)
        runner_cls = getattr(module, "GPUModelRunner", None)
        if runner_cls is not None and not getattr(runner_cls, marker, False):
            hook(runner_cls)
            setattr(runner_cls, marker, True)


def install_runner_hooks() -> None:
    hook_model_runners(_hook_v1_runner, _hook_v2_runner, _HOOKED)
