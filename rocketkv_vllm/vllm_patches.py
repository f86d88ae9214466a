"""Every change ROCKETKV makes to vLLM, in one table.

vLLM gives attention backends no say in request admission, scheduling or
the model runners, and no way to learn each request's prompt length or own
budget. ROCKETKV therefore wraps a few vLLM methods. Each wrapper:

- calls the original and adds only what ROCKETKV needs, delegating the work
  to the module named in the entry (``engine``, ``state``, ``kv_cache``,
  ``metrics``, ``backend.graphs``);
- passes everything through untouched for engines with another backend
  (one exception, for every engine on vLLM's CPU build: ``--kv-offloading-size``
  selects the host-tier connector, ``host_tier``);
- is installed once per process by ``install()`` (from ``plugin.register``),
  after checking the wrapped method's parameters against the ones it was
  written for. A mismatch (another vLLM version) installs nothing for that
  entry and makes every ROCKETKV engine refuse to start with an error naming
  the method and the vLLM version (``require``); engines with other
  backends are not affected.

Besides the table, one name is added to vLLM's backend enum:
``AttentionBackendEnum["ROCKETKV"]`` is an alias of its ``CUSTOM`` member
(``alias_backend_name``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

_MARK = "__rocketkv_patch__"


@dataclass(frozen=True)
class Patch:
    module: str
    owner: str  # a class in the module, or "<platform>" (the current platform's)
    name: str
    params: tuple[str, ...]  # the original's parameters (names) the wrapper relies on
    wrap: Callable[[Callable], Callable]  # original -> replacement
    why: str
    classmethod: bool = False
    exact: bool = True  # params is the whole list, not just its start

    @property
    def target(self) -> str:
        return f"{self.module}.{self.owner}.{self.name}"


# -- wrappers -----------------------------------------------------------------
# Each takes the original function and returns its replacement.


def _check_and_update_config(original):
    def check_and_update_config(cls, vllm_config) -> None:
        original(cls, vllm_config)
        from rocketkv_vllm.engine import configure_engine, is_rocketkv_engine

        if is_rocketkv_engine(vllm_config):
            require()
            configure_engine(vllm_config)

    return check_and_update_config


def _get_attn_backend_cls(original):
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        from rocketkv_vllm.engine import is_rocketkv, validated_backend_path

        if is_rocketkv(selected_backend):
            if attn_selector_config.has_sliding_window:
                # Sliding-window layers of a hybrid model: vLLM's own choice.
                return original(cls, None, attn_selector_config, num_heads)
            return validated_backend_path(attn_selector_config)
        return original(cls, selected_backend, attn_selector_config, num_heads)

    return get_attn_backend_cls


def _process_inputs(original):
    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        from rocketkv_vllm.engine import is_rocketkv_engine, validate_request

        if is_rocketkv_engine(self.vllm_config):
            validate_request(self.vllm_config, params, kwargs.get("resumable", False))
        return original(self, request_id, prompt, params, *args, **kwargs)

    return process_inputs


def _output_add_request(original):
    def add_request(self, request, *args, **kwargs):
        original(self, request, *args, **kwargs)
        from rocketkv_vllm.metrics import remember_request

        remember_request(self.request_states.get(request.request_id), request)

    return add_request


def _update_stats_from_output(original):
    def _update_stats_from_output(
        self, req_state, engine_core_output, engine_core_timestamp, iteration_stats
    ):
        was_prefilling = req_state.is_prefilling
        original(self, req_state, engine_core_output, engine_core_timestamp, iteration_stats)
        from rocketkv_vllm.metrics import record_output

        record_output(req_state, engine_core_output, iteration_stats, was_prefilling)

    return _update_stats_from_output


def _get_computed_blocks(original):
    def get_computed_blocks(self, request):
        from rocketkv_vllm.kv_cache import rocketkv_manager

        manager = rocketkv_manager(self)
        if manager is None:
            return original(self, request)
        manager.track(request)
        blocks, num_hit, boundary = original(self, request)
        hits = blocks.blocks[manager.kv_cache_group_id] if blocks.blocks else ()
        capped = manager.capped_hit(request, num_hit, hits)
        if capped >= num_hit:
            return blocks, num_hit, boundary
        # vLLM's own lookup up to the cap: the hit every KV cache group accepts
        # (a sliding-window group needs its window's blocks before the hit).
        computed, num_hit, num_uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, capped
        )
        boundary = num_hit + num_uncached if num_uncached else 0
        return self.create_kv_cache_blocks(computed), num_hit, boundary

    return get_computed_blocks


def _reserve_prefill_lookahead(original):
    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        from rocketkv_vllm.kv_cache import rocketkv_manager

        num_new_tokens = original(self, request, num_computed_tokens, num_new_tokens)
        manager = rocketkv_manager(self.kv_cache_manager)
        if manager is None:
            return num_new_tokens
        return manager.chunk_tokens(request, num_computed_tokens, num_new_tokens)

    return _reserve_prefill_lookahead


def _make_stats(original):
    def make_stats(self, *args, **kwargs):
        stats = original(self, *args, **kwargs)
        from rocketkv_vllm.kv_cache import attach_account

        attach_account(stats, self.kv_cache_manager)  # never raises
        return stats

    return make_stats


def _v1_update_states(original):
    def _update_states(self, scheduler_output):
        from rocketkv_vllm.state import existing_worker_state

        state = existing_worker_state(self.vllm_config)
        if state is None:
            return original(self, scheduler_output)
        state.requests.v1_before_update(scheduler_output)
        result = original(self, scheduler_output)
        batch = self.input_batch
        state.requests.v1_after_update(batch.req_ids, batch.num_prompt_tokens_cpu_tensor)
        return result

    return _update_states


def _v1_dummy_run(original):
    @functools.wraps(original)
    def _dummy_run(self, *args, **kwargs):
        from rocketkv_vllm.state import existing_worker_state

        state = existing_worker_state(self.vllm_config)
        if state is None:
            return original(self, *args, **kwargs)
        state.requests.dummy = True
        try:
            return original(self, *args, **kwargs)
        finally:
            state.requests.dummy = False

    return _dummy_run


def _v2_add_requests(original):
    def add_requests(self, scheduler_output) -> None:
        original(self, scheduler_output)
        from rocketkv_vllm.state import existing_worker_state

        state = existing_worker_state(self.vllm_config)
        if state is not None:
            state.requests.v2_add(scheduler_output, self.req_states.req_id_to_index)

    return add_requests


def _v1_batch_execution(original):
    @functools.wraps(original)
    def _determine_batch_execution_and_padding(
        self,
        num_tokens,
        num_reqs,
        num_scheduled_tokens_np,
        max_num_scheduled_tokens,
        *args,
        **kwargs,
    ):
        from rocketkv_vllm.state import existing_worker_state

        state = existing_worker_state(self.vllm_config)
        guard = None if state is None else state.graph_guard
        if (
            guard is not None
            and kwargs.get("force_uniform_decode") is None
            and max_num_scheduled_tokens == 1
            and num_reqs > 0
        ):
            batch = self.input_batch
            prefilling = (
                batch.num_computed_tokens_cpu[:num_reqs] < batch.num_prompt_tokens[:num_reqs]
            )
            if guard.needs_eager(prefilling, state.requests.rows[:num_reqs]):
                kwargs["force_uniform_decode"] = False
        return original(
            self,
            num_tokens,
            num_reqs,
            num_scheduled_tokens_np,
            max_num_scheduled_tokens,
            *args,
            **kwargs,
        )

    return _determine_batch_execution_and_padding


def _v2_gather_batch_req_state(original):
    @functools.wraps(original)
    def gather_batch_req_state(self, scheduler_output, dummy_run):
        from rocketkv_vllm.state import existing_worker_state

        state, uniform_count = original(self, scheduler_output, dummy_run)
        worker = existing_worker_state(self.vllm_config)
        if worker is not None:
            worker.requests.dummy = bool(dummy_run)
        guard = None if worker is None else worker.graph_guard
        if guard is None or state is None or uniform_count is None:
            return state, uniform_count
        budgets = worker.requests.budgets_for_slots(state.idx_mapping_np.tolist())
        if guard.needs_eager(state.is_prefilling_np, budgets):
            return state._replace(decode_graph_eligible=False), None
        return state, uniform_count

    return gather_batch_req_state


def _get_kv_cache_spec(original):
    def get_kv_cache_spec(self):
        from vllm.config import set_current_vllm_config

        from rocketkv_vllm.engine import check_kv_cache_spec, is_rocketkv_engine

        if not is_rocketkv_engine(self.vllm_config):
            return original(self)
        # RocketKVBackend.customize_spec reads the engine's settings from it.
        with set_current_vllm_config(self.vllm_config):
            spec = original(self)
        check_kv_cache_spec(spec)
        return spec

    return get_kv_cache_spec


_V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
_V2_RUNNER = "vllm.v1.worker.gpu.model_runner"


def _post_init_kv_transfer_config(original):
    def _post_init_kv_transfer_config(self) -> None:
        original(self)
        from rocketkv_vllm.host_tier import select_host_tier_connector

        select_host_tier_connector(self)

    return _post_init_kv_transfer_config


PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.config.vllm",
        "VllmConfig",
        "_post_init_kv_transfer_config",
        ("self",),
        _post_init_kv_transfer_config,
        "--kv-offloading-size on vLLM's CPU build gets the host-tier connector "
        "(vLLM's offloading workers run only on CUDA/XPU)",
    ),
    Patch(
        "vllm.platforms",
        "<platform>",
        "check_and_update_config",
        ("cls", "vllm_config"),
        _check_and_update_config,
        "validate and adjust ROCKETKV engines at startup (engine.configure_engine)",
        classmethod=True,
    ),
    Patch(
        "vllm.platforms",
        "<platform>",
        "get_attn_backend_cls",
        ("cls", "selected_backend", "attn_selector_config", "num_heads"),
        _get_attn_backend_cls,
        "honour an explicit ROCKETKV choice on every platform (CPU would always "
        "pick CPU_ATTN), after vLLM's own backend checks naming ROCKETKV; a hybrid "
        "model's sliding-window layers get vLLM's own choice",
        classmethod=True,
    ),
    Patch(
        "vllm.v1.engine.input_processor",
        "InputProcessor",
        "process_inputs",
        ("self", "request_id", "prompt", "params", "supported_tasks"),
        _process_inputs,
        "refuse per request what ROCKETKV cannot serve (engine.validate_request)",
        exact=False,
    ),
    Patch(
        "vllm.v1.engine.output_processor",
        "OutputProcessor",
        "add_request",
        ("self", "request"),
        _output_add_request,
        "remember each request's own budget for the metrics",
        exact=False,
    ),
    Patch(
        "vllm.v1.engine.output_processor",
        "OutputProcessor",
        "_update_stats_from_output",
        ("self", "req_state", "engine_core_output", "engine_core_timestamp", "iteration_stats"),
        _update_stats_from_output,
        "one fact per request output for the rocketkv:* metrics (metrics)",
    ),
    Patch(
        "vllm.v1.core.kv_cache_manager",
        "KVCacheManager",
        "get_computed_blocks",
        ("self", "request"),
        _get_computed_blocks,
        "let ROCKETKV's block manager see each request it will allocate for, and "
        "keep a compressed prompt's window out of its prefix hit (kv_cache)",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
        "_reserve_prefill_lookahead",
        ("self", "request", "num_computed_tokens", "num_new_tokens"),
        _reserve_prefill_lookahead,
        "end a compressed prompt's chunk before its last one holds a compaction "
        "target, so the target reaches the prefix cache (kv_cache)",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
        "make_stats",
        ("self",),
        _make_stats,
        "carry the scheduler's prefix-cache account inside vLLM's own scheduler "
        "stats to the API server's rocketkv:* metrics (kv_cache, metrics)",
        exact=False,
    ),
    Patch(
        _V1_RUNNER,
        "GPUModelRunner",
        "_update_states",
        ("self", "scheduler_output"),
        _v1_update_states,
        "each batch row's prompt length and own budget (V1 runner, state)",
    ),
    Patch(
        _V1_RUNNER,
        "GPUModelRunner",
        "_dummy_run",
        ("self", "num_tokens"),
        _v1_dummy_run,
        "mark dummy runs, whose rows are no requests, all dense (V1 runner, state)",
        exact=False,
    ),
    Patch(
        _V2_RUNNER,
        "GPUModelRunner",
        "add_requests",
        ("self", "scheduler_output"),
        _v2_add_requests,
        "each request slot's own budget and prompt length (Model Runner V2, state)",
    ),
    Patch(
        _V1_RUNNER,
        "GPUModelRunner",
        "_determine_batch_execution_and_padding",
        ("self", "num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens"),
        _v1_batch_execution,
        "keep steps a FULL CUDA graph cannot run off FULL graphs (backend.graphs)",
        exact=False,
    ),
    Patch(
        _V2_RUNNER,
        "GPUModelRunner",
        "gather_batch_req_state",
        ("self", "scheduler_output", "dummy_run"),
        _v2_gather_batch_req_state,
        "mark dummy runs all dense (state); keep steps a FULL CUDA graph cannot run "
        "off FULL graphs (backend.graphs)",
    ),
    Patch(
        _V1_RUNNER,
        "GPUModelRunner",
        "get_kv_cache_spec",
        ("self",),
        _get_kv_cache_spec,
        "build ROCKETKV's KV cache spec with the engine's config current",
    ),
    Patch(
        _V2_RUNNER,
        "GPUModelRunner",
        "get_kv_cache_spec",
        ("self",),
        _get_kv_cache_spec,
        "build ROCKETKV's KV cache spec with the engine's config current",
    ),
)

# Parameters a wrapper uses beyond the leading ones in ``params``.
_ALSO = {
    ("InputProcessor", "process_inputs"): ("resumable",),
    ("GPUModelRunner", "_determine_batch_execution_and_padding"): ("force_uniform_decode",),
}

_failures: dict[str, str] = {}  # target -> why it was not installed


def _owner(patch: Patch):
    module = importlib.import_module(patch.module)
    if patch.owner == "<platform>":
        return type(module.current_platform)
    return getattr(module, patch.owner)


def _function(owner, name: str):
    attr = inspect.getattr_static(owner, name)
    return attr.__func__ if isinstance(attr, classmethod) else attr


def signature_problem(patch: Patch, func: Callable) -> str | None:
    """Why ``func`` is not the method this patch was written for, or None."""
    actual = list(inspect.signature(func).parameters)
    expected = list(patch.params)
    if patch.exact and actual != expected:
        return f"expected parameters {expected}, found {actual}"
    if not patch.exact and actual[: len(expected)] != expected:
        return f"expected parameters starting {expected}, found {actual}"
    missing = [p for p in _ALSO.get((patch.owner, patch.name), ()) if p not in actual]
    if missing:
        return f"expected parameters {missing} among {actual}"
    return None


def _install_one(patch: Patch) -> None:
    owner = _owner(patch)
    current = _function(owner, patch.name)
    if getattr(current, _MARK, False):
        return
    problem = signature_problem(patch, current)
    if problem is not None:
        _failures[patch.target] = problem
        return
    replacement = patch.wrap(current)
    setattr(replacement, _MARK, True)
    replacement.__wrapped__ = current
    setattr(owner, patch.name, classmethod(replacement) if patch.classmethod else replacement)


def alias_backend_name() -> None:
    """``AttentionBackendEnum["ROCKETKV"]`` -> its ``CUSTOM`` member, where
    vLLM registers ROCKETKV (``plugin``): vLLM parses ``--attention-backend``
    through the enum's name lookup."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rocketkv_vllm.engine import BACKEND_NAME

    AttentionBackendEnum._member_map_[BACKEND_NAME] = AttentionBackendEnum.CUSTOM


def install() -> None:
    """Install every patch once in this process (idempotent)."""
    alias_backend_name()
    for patch in PATCHES:
        try:
            _install_one(patch)
        except (ImportError, AttributeError) as e:
            _failures[patch.target] = f"{type(e).__name__}: {e}"


def require() -> None:
    """Raise if any patch could not be installed (a ROCKETKV engine needs all)."""
    if _failures:
        import vllm

        lines = "; ".join(f"{target}: {why}" for target, why in _failures.items())
        raise RuntimeError(
            f"ROCKETKV cannot run on vLLM {vllm.__version__}: it wraps vLLM methods "
            f"that are not what it was written for ({lines}). This ROCKETKV release "
            "supports vLLM 0.32."
        )


def installed(patch: Patch) -> bool:
    return bool(getattr(_function(_owner(patch), patch.name), _MARK, False))
