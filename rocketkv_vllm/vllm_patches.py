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

A second table, ``RELIED_ON``, lists every other vLLM internal the package
relies on without wrapping it: private attributes and methods it reads or
calls, the methods of vLLM classes it overrides (a rename in vLLM would make
vLLM silently stop calling the override), the host tier's runtime class swap
and its replacement of a coordinator method. ``require()`` checks them all
once per process (``relied_problems``) and refuses a ROCKETKV engine naming
every one that fails; engines with other backends never run the check.

``plugin.register`` records a failure of any of its steps here too
(``record_failure``) and never raises, so a broken ROCKETKV stops only
ROCKETKV engines.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import types
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
        from rocketkv_vllm.engine import (
            configure_engine,
            is_rocketkv_engine,
            warn_ignored_settings,
        )

        if is_rocketkv_engine(vllm_config):
            require()
            configure_engine(vllm_config)
        warn_ignored_settings(vllm_config)  # rocketkv settings on another backend

    return check_and_update_config


def _get_attn_backend_cls(original):
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        from rocketkv_vllm.engine import is_rocketkv, validated_backend_path

        if is_rocketkv(selected_backend):
            require()  # also here: the check_and_update_config wrapper may be missing
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


# Set on the output processor of a ROCKETKV engine whose metrics are on
# (``_frontend_init``): only there do the two output wrappers do any work.
_RECORDING = "_rocketkv_recording"


def _frontend_init(original):
    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        from rocketkv_vllm.engine import is_rocketkv_engine

        if self.logger_manager is None or not is_rocketkv_engine(vllm_config):
            return  # stats off, or another backend: vLLM's engine, untouched
        from rocketkv_vllm.metrics import add_stat_logger

        recording = add_stat_logger(vllm_config, self.logger_manager)
        setattr(self.output_processor, _RECORDING, recording)

    return __init__


def _output_add_request(original):
    def add_request(self, request, *args, **kwargs):
        original(self, request, *args, **kwargs)
        if not getattr(self, _RECORDING, False):
            return
        from rocketkv_vllm.metrics import remember_request

        remember_request(self.request_states.get(request.request_id), request)

    return add_request


def _update_stats_from_output(original):
    def _update_stats_from_output(
        self, req_state, engine_core_output, engine_core_timestamp, iteration_stats
    ):
        if not getattr(self, _RECORDING, False):
            return original(
                self, req_state, engine_core_output, engine_core_timestamp, iteration_stats
            )
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


def _coordinator_cache_blocks(original):
    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        from rocketkv_vllm.kv_cache import RocketKVManager

        managers = self.single_type_managers
        rocketkv = next((m for m in managers if isinstance(m, RocketKVManager)), None)
        if rocketkv is None or len(managers) == 1:
            return original(self, request, num_computed_tokens)
        dense = rocketkv.dense_prefix_tokens(request)
        if num_computed_tokens <= dense:
            return original(self, request, num_computed_tokens)
        # vLLM's own loop twice: the other groups (a hybrid model's sliding
        # windows) hash only the dense prefix, ROCKETKV's group keeps its rules.
        others = [m for m in managers if m is not rocketkv and m.enable_caching]
        if rocketkv.enable_caching:
            for m in others:
                m.enable_caching = False
            try:
                original(self, request, num_computed_tokens)
            finally:
                for m in others:
                    m.enable_caching = True
        rocketkv_caching, rocketkv.enable_caching = rocketkv.enable_caching, False
        try:
            original(self, request, dense)
        finally:
            rocketkv.enable_caching = rocketkv_caching

    return cache_blocks


def _update_from_output(original):
    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = original(self, scheduler_output, model_runner_output)
        from rocketkv_vllm.kv_cache import attach_account

        # Here, not in make_stats: these stats go to the frontend, while
        # vLLM's crash dump also calls make_stats and would take the gains.
        attach_account(outputs, self.kv_cache_manager)  # never raises
        return outputs

    return update_from_output


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
        check_kv_cache_spec(spec, self.vllm_config)
        return spec

    return get_kv_cache_spec


def _compile_or_warm_up_model(original):
    @functools.wraps(original)
    def compile_or_warm_up_model(self):
        from rocketkv_vllm.engine import is_rocketkv_engine

        if is_rocketkv_engine(self.vllm_config):
            from rocketkv_vllm.backend.warmup import warm_up_worker

            warm_up_worker(self.vllm_config)
        return original(self)

    return compile_or_warm_up_model


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
    *(
        Patch(
            module,
            owner,
            "__init__",
            ("self", "vllm_config", "executor_class", "log_stats"),
            _frontend_init,
            "a ROCKETKV engine with stats on: ROCKETKV's stat logger first among its "
            "loggers (it takes the scheduler's account out of the stats before any "
            "other sees them), and its output processor records for it (metrics)",
            exact=False,
        )
        for module, owner in (
            ("vllm.v1.engine.async_llm", "AsyncLLM"),
            ("vllm.v1.engine.llm_engine", "LLMEngine"),
        )
    ),
    Patch(
        "vllm.v1.engine.output_processor",
        "OutputProcessor",
        "add_request",
        ("self", "request"),
        _output_add_request,
        "remember each request's own budget for the metrics (ROCKETKV engines "
        "whose metrics are on)",
        exact=False,
    ),
    Patch(
        "vllm.v1.engine.output_processor",
        "OutputProcessor",
        "_update_stats_from_output",
        ("self", "req_state", "engine_core_output", "engine_core_timestamp", "iteration_stats"),
        _update_stats_from_output,
        "one fact per request output for the rocketkv:* metrics (ROCKETKV engines "
        "whose metrics are on; metrics)",
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
        "vllm.v1.core.kv_cache_coordinator",
        "KVCacheCoordinator",
        "cache_blocks",
        ("self", "request", "num_computed_tokens"),
        _coordinator_cache_blocks,
        "a hybrid model's other KV cache groups hash a compressed request's "
        "dense prefix only: its tail and generated tokens came through the "
        "compressed layers (kv_cache.RocketKVManager.dense_prefix_tokens)",
    ),
    Patch(
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
        "update_from_output",
        ("self", "scheduler_output", "model_runner_output"),
        _update_from_output,
        "carry the scheduler's prefix-cache account inside the scheduler stats "
        "of its step's outputs to the frontend's rocketkv:* metrics (kv_cache, "
        "metrics)",
    ),
    Patch(
        "vllm.v1.worker.gpu_worker",
        "Worker",
        "compile_or_warm_up_model",
        ("self",),
        _compile_or_warm_up_model,
        "compile Stage 1's Triton kernels at engine start, before vLLM's warm-up "
        "and graph capture, not on the first long prompt (backend.warmup)",
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

# -- what ROCKETKV relies on without wrapping it --------------------------------


@dataclass(frozen=True)
class Relied:
    """One vLLM internal the package relies on, checked by ``relied_problem``.

    kind:
    - "attr": the owner has it: a class attribute or method
      (``inspect.getattr_static``), an annotation in the class or a base, or
      (an instance attribute set at run time, which the class cannot show)
      an assignment ``self.<name> = ...`` / ``self.<name>: ... =`` in the
      source of a method of the class or a base: a text search, so it proves
      the name is still written, not what it holds;
    - "method": the owner defines a callable of that name whose parameters
      are ``params`` (or start with them: ``exact=False``);
    - "override": ``used_by`` (our subclass) overrides it: the vLLM class
      still defines it, with the parameters our override was written for,
      so vLLM still calls ours;
    - "swap": an instance of the owner may become an instance of a subclass
      that adds attributes (``obj.__class__ = Subclass``): tried on a bare
      instance;
    - "replace": the owner's method may be replaced on an instance (its
      instances have a ``__dict__``), has ``params``, and ``caller``'s source
      calls it through the instance (a text search for ``.<name>(``);
    - "absent": a name our subclass adds (a method, or state it keeps on
      vLLM's instance) that the vLLM class does not have (as "attr" finds
      names): were vLLM to add it, one would silently clobber the other.
    """

    module: str
    owner: str  # a class in the module, or "" (the module itself)
    name: str
    kind: str
    why: str
    used_by: str  # where in rocketkv_vllm (for "override": our subclass)
    params: tuple[str, ...] | None = None
    exact: bool = True
    platform: str | None = None  # "cpu": checked on vLLM's CPU build only
    caller: str | None = None  # "replace": module.Class.method that calls it

    @property
    def target(self) -> str:
        return ".".join(p for p in (self.module, self.owner, self.name) if p)


_KV = "vllm.v1.core.single_type_kv_cache_manager"
_OFFLOAD = "vllm.v1.simple_kv_offload.manager"
_OFFLOAD_WORKER = "vllm.v1.simple_kv_offload.worker"
_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector"
_BACKEND = "vllm.v1.attention.backend"
_MANAGER = "rocketkv_vllm.kv_cache.RocketKVManager"
_HOST = "rocketkv_vllm.host_tier.scheduler.RocketKVHostScheduler"
_HOST_CONNECTOR = "rocketkv_vllm.host_tier.connector.HostTierConnector"
_HOST_WORKER = "rocketkv_vllm.host_tier.cpu_worker.HostCopyWorker"
_ROCKET_BACKEND = "rocketkv_vllm.backend.RocketKVBackend"
_IMPL = "rocketkv_vllm.backend.impl.RocketKVImpl"
_BUILDER = "rocketkv_vllm.backend.metadata.RocketKVMetadataBuilder"
_STATS = "rocketkv_vllm.metrics.RocketKVStatLogger"


def _override(module, owner, name, params, used_by, why="", **kw) -> Relied:
    why = why or f"{used_by.rsplit('.', 1)[1]}.{name} overrides it"
    return Relied(module, owner, name, "override", why, used_by, tuple(params), **kw)


def _absent(module, owner, used_by, names) -> tuple[Relied, ...]:
    """The names our subclass ``used_by`` adds on vLLM's ``owner``."""
    why = f"{used_by.rsplit('.', 1)[1]}'s own name"
    return tuple(Relied(module, owner, name, "absent", why, used_by) for name in names)


_FAM = "FullAttentionManager"
_SCHED = "SimpleCPUOffloadScheduler"

RELIED_ON: tuple[Relied, ...] = (
    # -- plugin registration (plugin, kv_cache, host_tier) --
    Relied(
        "vllm.v1.attention.backends.registry",
        "AttentionBackendEnum",
        "_member_map_",
        "attr",
        "ROCKETKV's name is added to the enum's name lookup",
        "rocketkv_vllm.vllm_patches.alias_backend_name",
    ),
    Relied(
        "vllm.v1.kv_cache_spec_registry",
        "KVCacheSpecRegistry",
        "_ensure_registered",
        "method",
        "fill the registry with vLLM's own specs before adding ROCKETKV's",
        "rocketkv_vllm.kv_cache.register_kv_cache_spec",
        ("cls",),
        exact=False,
    ),
    Relied(
        "vllm.distributed.kv_transfer.kv_connector.factory",
        "KVConnectorFactory",
        "_registry",
        "attr",
        "register the host-tier connector once per process",
        "rocketkv_vllm.host_tier.register_connector",
    ),
    # -- Stage 1's warm-up at engine start (backend.warmup) --
    Relied(
        "vllm.config.compilation",
        "CompilationConfig",
        "static_forward_context",
        "attr",
        "find the worker's attention layers to warm Stage 1 up on",
        "rocketkv_vllm.backend.warmup.warm_up_worker",
    ),
    Relied(
        "vllm.model_executor.layers.attention.attention",
        "Attention",
        "kv_cache",
        "attr",
        "the layer's bound KV cache the warm-up compacts a dummy prompt in",
        "rocketkv_vllm.backend.warmup.warm_up_worker",
    ),
    Relied(
        "vllm.model_executor.layers.attention.attention",
        "Attention",
        "impl",
        "attr",
        "the layer's ROCKETKV impl (its Stage 1, settings, layout)",
        "rocketkv_vllm.backend.warmup.warm_up_worker",
    ),
    # -- the account in vLLM's scheduler stats (kv_cache, metrics) --
    Relied(
        "vllm.v1.metrics.stats",
        "SchedulerStats",
        "num_kv_fetch_reqs_by_stage",
        "attr",
        "the scheduler's prefix-cache account travels in this dict (rocketkv:* keys)",
        "rocketkv_vllm.kv_cache.attach_account",
    ),
    Relied(
        "vllm.v1.engine",
        "EngineCoreOutputs",
        "scheduler_stats",
        "attr",
        "the step's scheduler stats, among its outputs",
        "rocketkv_vllm.kv_cache.attach_account",
    ),
    # -- ROCKETKV's stat logger, first in a ROCKETKV engine's (metrics) --
    *(
        Relied(module, owner, name, "attr", why, "rocketkv_vllm.vllm_patches._frontend_init")
        for module, owner in (
            ("vllm.v1.engine.async_llm", "AsyncLLM"),
            ("vllm.v1.engine.llm_engine", "LLMEngine"),
        )
        for name, why in (
            ("logger_manager", "the engine's stat loggers (None: stats off)"),
            ("output_processor", "marked to record the facts ROCKETKV's logger counts"),
        )
    ),
    *(
        Relied(
            "vllm.v1.metrics.loggers",
            "StatLoggerManager",
            name,
            "attr",
            why,
            "rocketkv_vllm.metrics.add_stat_logger",
        )
        for name, why in (
            ("stat_loggers", "called in list order: ROCKETKV's goes first"),
            ("engine_indexes", "the engines ROCKETKV's logger counts"),
        )
    ),
    # -- hybrid models: the other groups hash the dense prefix only --
    Relied(
        "vllm.v1.core.kv_cache_coordinator",
        "KVCacheCoordinator",
        "single_type_managers",
        "attr",
        "find ROCKETKV's manager among a hybrid model's groups",
        "rocketkv_vllm.vllm_patches._coordinator_cache_blocks",
    ),
    Relied(
        "vllm.v1.core.single_type_kv_cache_manager",
        "SingleTypeKVCacheManager",
        "enable_caching",
        "attr",
        "vLLM's cache_blocks loop skips a group whose flag is off (run once per side)",
        "rocketkv_vllm.vllm_patches._coordinator_cache_blocks",
    ),
    # -- ROCKETKV's block manager (kv_cache) --
    _override(_KV, _FAM, "__init__", ("self", "kv_cache_spec"), _MANAGER, exact=False),
    _override(
        _KV,
        _FAM,
        "remove_skipped_blocks",
        ("self", "request_id", "processed_computed_tokens", "num_prompt_tokens"),
        _MANAGER,
        "give back a compressed prompt's blocks after its Stage 1 step",
    ),
    _override(_KV, _FAM, "new_step_starts", ("self",), _MANAGER),
    _override(
        _KV,
        _FAM,
        "get_num_blocks_to_allocate",
        (
            "self",
            "request_id",
            "num_tokens",
            "new_computed_blocks",
            "total_computed_tokens",
            "num_local_computed_tokens",
            "num_tokens_main_model",
            "apply_admission_cap",
            "prefill_end",
        ),
        _MANAGER,
        "count the private copies of hit compaction targets",
    ),
    _override(
        _KV,
        _FAM,
        "add_local_computed_blocks",
        (
            "self",
            "request_id",
            "new_computed_blocks",
            "num_local_computed_tokens",
            "num_external_computed_tokens",
        ),
        _MANAGER,
        "copy hit compaction targets (copy-on-write) at admission",
    ),
    _override(_KV, _FAM, "free", ("self", "request_id"), _MANAGER),
    _override(
        _KV,
        _FAM,
        "cache_blocks",
        ("self", "request", "num_tokens", "retention_interval", "replay_boundaries"),
        _MANAGER,
        "hash only a compressed prompt's dense blocks",
    ),
    _override(
        _KV,
        _FAM,
        "take_pending_cow_copies",
        ("self",),
        _MANAGER,
        "copy compaction targets into the prefix cache before Stage 1",
    ),
    _override(_KV, _FAM, "pop_blocks_for_free", ("self", "request_id"), _MANAGER),
    Relied(
        _KV,
        _FAM,
        "_remove_blocks_in_range",
        "method",
        "give back a compressed prompt's middle blocks",
        _MANAGER,
        ("self", "request_id", "first_block", "last_block"),
    ),
    Relied(
        _KV,
        _FAM,
        "_apply_cow",
        "method",
        "private copy of a hit compaction target",
        _MANAGER,
        ("self", "request_id", "block_idx", "source_block", "cow_block"),
    ),
    Relied(_KV, _FAM, "_pending_cow_copies", "attr", "queue target copies", _MANAGER),
    Relied(_KV, _FAM, "_record_new_block_ids", "attr", "report copies' blocks", _MANAGER),
    Relied(_KV, _FAM, "_null_block", "attr", "placeholder in cache_full_blocks", _MANAGER),
    *_absent(
        _KV,
        _FAM,
        _MANAGER,
        (
            "settings",
            "plans",
            "prefix_account",
            "account_sent",
            "track",
            "plan_of",
            "plan_of_request",
            "capped_hit",
            "chunk_tokens",
            "dense_prefix_tokens",
            "_requests",
            "_to_preserve",
            "_hashed_this_step",
            "_chunk_ends",
            "_unused_hit",
            "_private_copies",
            "_preserve_targets",
        ),
    ),
    # -- the host tier's scheduler half (host_tier.scheduler) --
    Relied(
        _OFFLOAD,
        _SCHED,
        "__class__",
        "swap",
        "RocketKVHostScheduler.adopt turns the scheduler vLLM's connector built "
        "into RocketKVHostScheduler (manager.__class__ = cls)",
        _HOST,
    ),
    Relied(
        "vllm.v1.core.kv_cache_coordinator",
        "KVCacheCoordinator",
        "find_longest_cache_hit",
        "replace",
        "RocketKVHostScheduler.adopt replaces it on the host pool's coordinator "
        "(host hits within the window cap); also called by the get_computed_blocks "
        "wrapper",
        _HOST,
        ("self", "block_hashes", "max_cache_hit_length"),
        caller=f"{_OFFLOAD}.{_SCHED}.get_num_new_matched_tokens",
    ),
    _override(
        _OFFLOAD,
        _SCHED,
        "get_num_new_matched_tokens",
        ("self", "request", "num_computed_tokens"),
        _HOST,
        "cap host hits before a compressed prompt's window",
    ),
    _override(
        _OFFLOAD,
        _SCHED,
        "update_state_after_alloc",
        ("self", "request", "blocks", "num_external_tokens"),
        _HOST,
    ),
    _override(_OFFLOAD, _SCHED, "request_finished", ("self", "request", "block_ids"), _HOST),
    _override(
        _OFFLOAD,
        _SCHED,
        "build_connector_meta",
        ("self", "scheduler_output"),
        _HOST,
        "store compaction targets and given-back blocks",
    ),
    _override(
        _OFFLOAD,
        _SCHED,
        "_process_store_completion",
        ("self", "gpu_block_ids", "cpu_block_ids", "block_meta"),
        _HOST,
        "insert stored compaction targets under their dense hashes",
    ),
    _override(_OFFLOAD, _SCHED, "update_connector_output", ("self", "connector_output"), _HOST),
    _override(_OFFLOAD, _SCHED, "_release_transfer_refs", ("self", "transfer"), _HOST),
    *_absent(
        _OFFLOAD,
        _SCHED,
        _HOST,
        (
            "rocketkv",
            "block_bytes",
            "adopt",
            "bind_rocketkv",
            "_target_hashes",
            "_hit_limit",
            "_unused_host_hit",
            "_find_longest_cache_hit",
            "_find_hit_within_limit",
            "_queue_compressed_prompt_stores",
        ),
    ),
    Relied(
        _OFFLOAD,
        _SCHED,
        "_free_pending_cpu_hit",
        "method",
        "drop a host hit the window cap removes",
        _HOST,
        ("self", "pending"),
    ),
    *(
        Relied(_OFFLOAD, _SCHED, name, "attr", why, _HOST)
        for name, why in (
            ("_pending_cpu_hits", "drop a host hit the window cap removes"),
            ("_reqs_to_store", "requests whose blocks vLLM stores"),
            ("_in_flight_store_gpu_blocks", "blocks being stored"),
            ("_gpu_block_pool", "the device block pool"),
            ("cpu_block_pool", "the host block pool"),
            ("cpu_coordinator", "the host pool's coordinator (its lookup replaced)"),
            ("_pending_finished_stores", "queue stores of targets and given-back blocks"),
            ("_interval_load_blocks_completed", "count host blocks loaded"),
            ("enable_kv_cache_events", "store metadata for KV events"),
            ("cpu_kv_cache_config", "a host block's bytes"),
        )
    ),
    Relied(
        _OFFLOAD,
        "TransferMeta",
        "__init__",
        "method",
        "queue a store (positional fields)",
        _HOST,
        ("self", "gpu_block_ids", "cpu_block_ids", "block_meta"),
    ),
    Relied(
        "vllm.v1.core.block_pool",
        "BlockPool",
        "_insert_block_hash",
        "method",
        "a stored compaction target enters the host cache under its dense hash",
        _HOST,
        ("self", "block_hash_with_group_id", "block", "num_tokens"),
    ),
    Relied(
        _OFFLOAD,
        _SCHED,
        "_derive_cpu_config",
        "method",
        "the host pool's size, as the scheduler half computes it",
        _HOST_WORKER,
        ("gpu_config", "cpu_capacity_bytes"),
    ),
    # -- the host-tier connector and worker (host_tier.connector, cpu_worker) --
    _override(
        _CONNECTOR,
        "SimpleCPUOffloadConnector",
        "__init__",
        ("self", "vllm_config", "role", "kv_cache_config"),
        _HOST_CONNECTOR,
    ),
    _override(
        _CONNECTOR,
        "SimpleCPUOffloadConnector",
        "bind_kv_cache_manager",
        ("self", "kv_cache_manager"),
        _HOST_CONNECTOR,
    ),
    Relied(
        _CONNECTOR,
        "SimpleCPUOffloadConnector",
        "scheduler_manager",
        "attr",
        "the scheduler half to adopt",
        _HOST_CONNECTOR,
    ),
    Relied(
        _CONNECTOR,
        "SimpleCPUOffloadConnector",
        "worker_handler",
        "attr",
        "the worker half to replace on CPU",
        _HOST_CONNECTOR,
    ),
    Relied(
        _OFFLOAD_WORKER,
        "SimpleCPUOffloadWorker",
        "__init__",
        "method",
        "the host copy worker is built with vLLM's worker's arguments",
        _HOST_CONNECTOR,
        ("self", "vllm_config", "kv_cache_config", "cpu_capacity_bytes", "kv_offload_backend"),
        exact=False,
    ),
    *(
        _override(_OFFLOAD_WORKER, "SimpleCPUOffloadWorker", name, params, _HOST_WORKER)
        for name, params in (
            ("register_kv_caches", ("self", "kv_caches")),
            ("start_load_kv", ("self",)),
            ("wait_for_save", ("self",)),
        )
    ),
    *(
        Relied(_OFFLOAD_WORKER, "SimpleCPUOffloadWorker", name, "attr", why, _HOST_WORKER)
        for name, why in (
            ("_connector_metadata", "the step's transfers"),
            ("_load_hwm", "loads done"),
            ("_store_hwm", "stores done"),
            ("disk_mode", "refuse disk mode on CPU"),
            ("disk_path", "passed on to the host copy worker"),
            ("cpu_capacity_bytes", "the host pool's size"),
        )
    ),
    # -- the backend (backend) --
    Relied(
        _BACKEND,
        "AttentionBackend",
        "forward_includes_kv_cache_update",
        "attr",
        "the native backend writes the KV cache in do_kv_cache_update",
        _ROCKET_BACKEND,
    ),
    *(
        _override(_BACKEND, "AttentionBackend", name, params, _ROCKET_BACKEND)
        for name, params in (
            ("get_name", ()),
            ("get_impl_cls", ()),
            ("get_builder_cls", ()),
            ("get_supported_kernel_block_sizes", ("kv_cache_spec",)),
            ("get_supported_head_sizes", ("cls",)),
            ("supported_kv_cache_layouts", ("cls",)),
            ("supports_sink", ("cls",)),
            ("supports_kv_connector", ("cls",)),
            ("customize_spec", ("cls", "spec")),
        )
    ),
    _override(
        _BACKEND,
        "AttentionImpl",
        "__init__",
        (
            "self",
            "num_heads",
            "head_size",
            "scale",
            "num_kv_heads",
            "alibi_slopes",
            "sliding_window",
            "kv_cache_dtype",
            "logits_soft_cap",
            "attn_type",
            "kv_sharing_target_layer_name",
        ),
        _IMPL,
        "vLLM builds the impl (and ROCKETKV the native one) with these arguments",
        exact=False,
    ),
    _override(
        _BACKEND,
        "AttentionImpl",
        "forward",
        (
            "self",
            "layer",
            "query",
            "key",
            "value",
            "kv_cache",
            "attn_metadata",
            "output",
            "output_scale",
            "output_block_scale",
        ),
        _IMPL,
    ),
    Relied(
        "vllm.v1.attention.backends.cpu_attn",
        "CPUAttentionBackendImpl",
        "do_kv_cache_update",
        "method",
        "RocketKVImpl.do_kv_cache_update delegates to the native impl's",
        _IMPL,
        ("self", "layer", "key", "value", "kv_cache", "slot_mapping"),
        platform="cpu",
    ),
    Relied(
        "vllm.v1.attention.backends.cpu_attn",
        "",
        "_get_attn_isa",
        "method",
        "which CPU_ATTN kernels (and KV layout) the native backend uses",
        "rocketkv_vllm.backend.native.native_backend",
        ("dtype", "block_size", "head_size", "kv_cache_dtype"),
        platform="cpu",
    ),
    Relied(
        "vllm._custom_ops",
        "",
        "cpu_attn_reshape_and_cache",
        "method",
        "find CPU_ATTN's KV layout by letting its cache write store known values",
        "rocketkv_vllm.backend.native.cpu_kv_layout",
        (
            "key",
            "value",
            "key_cache",
            "value_cache",
            "slot_mapping",
            "isa",
            "k_scale",
            "v_scale",
            "kv_cache_dtype",
        ),
        platform="cpu",
    ),
    *(
        Relied(_BACKEND, "AttentionLayer", name, "attr", why, used_by)
        for name, why, used_by in (
            ("_q_scale", "quantize the native call's query", "rocketkv_vllm.backend.native"),
            ("_k_scale_float", "the fp8 cache's K scale", "rocketkv_vllm.fp8_kv"),
            ("_v_scale_float", "the fp8 cache's V scale", "rocketkv_vllm.fp8_kv"),
        )
    ),
    Relied(
        _BACKEND,
        "AttentionMetadataBuilder",
        "_cudagraph_support",
        "attr",
        "RocketKVMetadataBuilder sets its CUDA graph support",
        _BUILDER,
    ),
    Relied(
        _BACKEND,
        "AttentionMetadataBuilder",
        "reorder_batch_threshold",
        "attr",
        "the native builder's, taken over",
        _BUILDER,
    ),
    _override(
        _BACKEND,
        "AttentionMetadataBuilder",
        "__init__",
        ("self", "kv_cache_spec", "layer_names", "vllm_config", "device"),
        _BUILDER,
    ),
    _override(
        _BACKEND,
        "AttentionMetadataBuilder",
        "build",
        ("self", "common_prefix_len", "common_attn_metadata", "fast_build"),
        _BUILDER,
    ),
    _override(
        _BACKEND,
        "AttentionMetadataBuilder",
        "get_cudagraph_support",
        ("cls", "vllm_config", "kv_cache_spec"),
        _BUILDER,
    ),
    Relied(
        "vllm.v1.attention.selector",
        "AttentionSelectorConfig",
        "_asdict",
        "method",
        "vLLM's backend validation gets the selector's fields",
        "rocketkv_vllm.engine.validated_backend_path",
        ("self",),
    ),
    Relied(
        _V2_RUNNER,
        "BatchReqState",
        "_replace",
        "method",
        "keep a step off FULL CUDA graphs",
        "rocketkv_vllm.vllm_patches._v2_gather_batch_req_state",
    ),
    Relied(
        _V2_RUNNER,
        "BatchReqState",
        "decode_graph_eligible",
        "attr",
        "keep a step off FULL CUDA graphs",
        "rocketkv_vllm.vllm_patches._v2_gather_batch_req_state",
    ),
    # -- metrics (metrics): vLLM calls these; ROCKETKV builds the logger --
    Relied(
        "vllm.v1.engine.output_processor",
        "OutputProcessor",
        "request_states",
        "attr",
        "the frontend's state of a request just added",
        "rocketkv_vllm.vllm_patches._output_add_request",
    ),
    *(
        _override("vllm.v1.metrics.loggers", "AggregateStatLoggerBase", name, params, _STATS)
        for name, params in (
            (
                "record",
                ("self", "scheduler_stats", "iteration_stats", "mm_cache_stats", "engine_idx"),
            ),
            ("log_engine_initialized", ("self",)),
        )
    ),
    Relied(
        "prometheus_client.registry",
        "CollectorRegistry",
        "_collector_to_names",
        "attr",
        "find ROCKETKV's metrics to unregister",
        "rocketkv_vllm.metrics.unregister_rocketkv_metrics",
    ),
    Relied(
        "prometheus_client.metrics",
        "MetricWrapperBase",
        "_name",
        "attr",
        "a metric's name",
        "rocketkv_vllm.metrics.unregister_rocketkv_metrics",
    ),
    # -- torch (engine) --
    *(
        Relied(
            "torch.cpu",
            "",
            name,
            "method",
            "refuse an fp8 cache on a CPU without AVX-512 or AMX",
            "rocketkv_vllm.engine.cache_dtype_refusals",
            (),
            platform="cpu",
        )
        for name in ("_is_avx512_supported", "_is_amx_tile_supported")
    ),
)


def _resolve(module: str, owner: str):
    mod = importlib.import_module(module)
    return getattr(mod, owner) if owner else mod


def _methods_source(klass) -> str:
    """The source of every function defined in ``klass`` itself."""
    parts = []
    for attr in vars(klass).values():
        func = getattr(attr, "__func__", attr)
        func = getattr(func, "fget", func)  # a property's getter
        if isinstance(func, types.FunctionType):
            try:
                parts.append(inspect.getsource(func))
            except (OSError, TypeError):
                pass
    return "\n".join(parts)


def _has_attr(owner, name: str) -> bool:
    if isinstance(owner, types.ModuleType):
        return hasattr(owner, name)
    try:
        inspect.getattr_static(owner, name)
        return True
    except AttributeError:
        pass
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(?::[^=]+?)?=(?!=)")
    for klass in owner.__mro__:
        if klass is object:
            continue
        if name in vars(klass).get("__annotations__", {}):
            return True
        if assigned.search(_methods_source(klass)):
            return True
    return False


def _params_problem(func, params: tuple[str, ...], exact: bool) -> str | None:
    try:
        actual = list(inspect.signature(func).parameters)
    except (TypeError, ValueError) as e:
        return f"no signature ({e})"
    expected = list(params)
    if exact and actual != expected:
        return f"expected parameters {expected}, found {actual}"
    if not exact and actual[: len(expected)] != expected:
        return f"expected parameters starting {expected}, found {actual}"
    return None


def _callable(owner, name: str):
    if isinstance(owner, types.ModuleType):
        attr = getattr(owner, name)
    else:
        attr = inspect.getattr_static(owner, name)
    func = attr.__func__ if isinstance(attr, classmethod | staticmethod) else attr
    return func if callable(func) else None


def relied_problem(entry: Relied) -> str | None:
    """Why the installed vLLM lacks what ``entry`` relies on, or None."""
    try:
        owner = _resolve(entry.module, entry.owner)
        if entry.kind == "attr":
            return None if _has_attr(owner, entry.name) else "not found"
        if entry.kind == "absent":
            if _has_attr(owner, entry.name):
                return "vLLM's class has it now: ours and vLLM's would clobber each other"
            return None
        if entry.kind == "swap":
            probe = type("_SwapProbe", (owner,), {})
            obj = object.__new__(owner)
            obj.__class__ = probe
            obj._rocketkv_probe = True  # the subclass adds attributes
            return None
        func = _callable(owner, entry.name)
        if func is None:
            return "not callable"
        if entry.params is not None:
            problem = _params_problem(func, entry.params, entry.exact)
            if problem is not None:
                return problem
        if entry.kind == "replace":
            if not owner.__dictoffset__:
                return "its instances have no __dict__ (the method cannot be replaced)"
            module, cls, method = entry.caller.rsplit(".", 2)
            caller = _callable(_resolve(module, cls), method)
            if f".{entry.name}(" not in inspect.getsource(caller):
                return f"{entry.caller} no longer calls it through the instance"
        return None
    except Exception as e:  # noqa: BLE001 -- any failure is a refusal, named
        return f"{type(e).__name__}: {e}"


def relied_problems() -> dict[str, str]:
    """Every ``RELIED_ON`` entry the installed vLLM fails, by target."""
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    problems = {}
    for entry in RELIED_ON:
        if entry.platform == "cpu" and not cpu:
            continue
        problem = relied_problem(entry)
        if problem is not None:
            problems[entry.target] = f"{problem} (relied on by {entry.used_by}: {entry.why})"
    return problems


_failures: dict[str, str] = {}  # target or register step -> why it failed
_relied_checked = False  # relied_problems() added to _failures (once per process)


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
    for patch in PATCHES:
        try:
            _install_one(patch)
        except Exception as e:  # noqa: BLE001 -- recorded, refused at startup
            _failures[patch.target] = f"{type(e).__name__}: {e}"


def record_failure(what: str, why: str) -> None:
    """Remember what failed (a step of ``plugin.register``): ROCKETKV engines
    then refuse to start, naming it (``require``)."""
    _failures[what] = why


def require() -> None:
    """Raise, naming each, if any patch could not be installed, any step of
    ``plugin.register`` failed, or any ``RELIED_ON`` entry fails on the
    installed vLLM (a ROCKETKV engine needs all). The ``RELIED_ON`` check runs
    once per process, on the first call."""
    global _relied_checked
    if not _relied_checked:
        _failures.update(relied_problems())
        _relied_checked = True
    if _failures:
        import vllm

        lines = "; ".join(f"{target}: {why}" for target, why in _failures.items())
        raise RuntimeError(
            f"ROCKETKV cannot run on vLLM {vllm.__version__}: it relies on vLLM "
            f"internals that are not what it was written for, or its plugin failed "
            f"to register ({lines}). This ROCKETKV release supports vLLM 0.32."
        )


def installed(patch: Patch) -> bool:
    return bool(getattr(_function(_owner(patch), patch.name), _MARK, False))
