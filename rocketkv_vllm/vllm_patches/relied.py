"""The relied-on table: every vLLM internal ROCKETKV relies on without
wrapping it, as data (``RELIED_ON``).

Private attributes and methods the package reads or calls, the methods of
vLLM classes it overrides (a rename in vLLM would make vLLM silently stop
calling the override), the host tier's runtime class swap and its
replacement of a coordinator method, the names our subclasses add to vLLM's
instances. ``check.relied_problems`` checks them on the installed vLLM at a
ROCKETKV engine's start; ``bump_report`` reads them against another vLLM's
source tree. No vLLM import here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Relied:
    """One vLLM internal the package relies on, checked by ``check.relied_problem``.

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
_V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
_MANAGER = "rocketkv_vllm.kv_cache.RocketKVManager"
_HOST = "rocketkv_vllm.host_tier.scheduler.RocketKVHostScheduler"
_HOST_CONNECTOR = "rocketkv_vllm.host_tier.connector.HostTierConnector"
_HOST_WORKER = "rocketkv_vllm.host_tier.cpu_worker.HostCopyWorker"
_ASYNC_WORKER = "rocketkv_vllm.host_tier.async_cpu_worker.AsyncHostCopyWorker"
_CUDA_WORKER = "rocketkv_vllm.host_tier.cuda_worker.HostTierCudaWorker"
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
_PULL_SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler"
_SCHED = "SimpleCPUOffloadScheduler"

RELIED_ON: tuple[Relied, ...] = (
    # -- plugin registration (plugin, kv_cache, host_tier) --
    Relied(
        "vllm.v1.attention.backends.registry",
        "AttentionBackendEnum",
        "_member_map_",
        "attr",
        "ROCKETKV's name is added to the enum's name lookup",
        "rocketkv_vllm.vllm_patches.startup.alias_backend_name",
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
        Relied(
            module, owner, name, "attr", why, "rocketkv_vllm.vllm_patches.frontend._frontend_init"
        )
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
        "rocketkv_vllm.vllm_patches.scheduler._coordinator_cache_blocks",
    ),
    Relied(
        "vllm.v1.core.single_type_kv_cache_manager",
        "SingleTypeKVCacheManager",
        "enable_caching",
        "attr",
        "vLLM's cache_blocks loop skips a group whose flag is off (run once per side)",
        "rocketkv_vllm.vllm_patches.scheduler._coordinator_cache_blocks",
    ),
    # -- a chunk withdrawn by a preemption in its own step (kv_cache.blocks_never_computed) --
    Relied(
        "vllm.v1.core.kv_cache_coordinator",
        "KVCacheCoordinator",
        "get_blocks",
        "method",
        "a request's blocks per KV cache group, in token order",
        "rocketkv_vllm.kv_cache.blocks_never_computed",
        ("self", "request_id"),
    ),
    Relied(
        "vllm.v1.core.block_pool",
        "BlockPool",
        "evict_blocks",
        "method",
        "take blocks out of the prefix cache whatever their reference count",
        "rocketkv_vllm.vllm_patches.scheduler._preempt_request",
        ("self", "block_ids"),
    ),
    Relied(
        "vllm.v1.core.kv_cache_utils",
        "KVCacheBlock",
        "block_hash",
        "attr",
        "a block in the prefix cache has a hash",
        "rocketkv_vllm.kv_cache.blocks_never_computed",
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
        "allocate_external_computed_blocks",
        (
            "self",
            "request_id",
            "num_local_computed_tokens",
            "num_external_computed_tokens",
            "record_for_zeroing",
        ),
        _MANAGER,
        "blocks for a pulled compressed prompt's kept blocks only (pd)",
    ),
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
            "_remote",
            "remote_plan",
        ),
    ),
    Relied(_KV, _FAM, "new_block_ids", "attr", "report a pull's blocks for zeroing", _MANAGER),
    # -- disaggregated prefill and decode (pd, vllm_patches.nixl) --
    Relied(
        _PULL_SCHEDULER,
        "NixlPullConnectorScheduler",
        "_reqs_need_recv",
        "attr",
        "the local blocks a pull reads into: a compressed prompt's kept ones",
        "rocketkv_vllm.pd.receive_kept_blocks",
    ),
    Relied(
        _PULL_SCHEDULER,
        "NixlPullConnectorScheduler",
        "_reqs_need_send",
        "attr",
        "a compressed request whose one token stopped it is not held for a pull",
        "rocketkv_vllm.vllm_patches.nixl",
    ),
    Relied(
        _PULL_SCHEDULER,
        "NixlPullConnectorScheduler",
        "_reqs_not_processed",
        "attr",
        "... and its worker told so, as vLLM tells it of an aborted one",
        "rocketkv_vllm.vllm_patches.nixl",
    ),
    Relied(
        _PULL_SCHEDULER,
        "NixlPullConnectorScheduler",
        "vllm_config",
        "attr",
        "the engine's ROCKETKV settings",
        "rocketkv_vllm.pd.receive_kept_blocks",
    ),
    Relied(
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector",
        "NixlConnector",
        "connector_scheduler",
        "attr",
        "the decode side's first tokens to emit",
        "rocketkv_vllm.pd.emit_first_tokens",
    ),
    Relied(
        "vllm.v1.request",
        "Request",
        "append_output_token_ids",
        "method",
        "the prefill engine's first token is a pulled request's first output",
        "rocketkv_vllm.pd.receive_kept_blocks",
        ("self", "token_ids"),
    ),
    Relied(
        "vllm.v1.core.sched.scheduler",
        "Scheduler",
        "requests",
        "attr",
        "drop the first tokens of requests aborted before their first step",
        "rocketkv_vllm.pd.emit_first_tokens",
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
            "_stage1_store_wait",
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
            ("_store_event_to_blocks", "stores in flight, waited for before Stage 1"),
            ("_abandoned_store_event_to_blocks", "stores in flight after a cache reset"),
        )
    ),
    # -- the async copy mode (host_tier.scheduler metadata, async_cpu_worker) --
    *_absent(
        "vllm.v1.simple_kv_offload.metadata",
        "SimpleCPUOffloadMetadata",
        "rocketkv_vllm.host_tier.scheduler.RocketKVHostMetadata",
        ("wait_store_event",),
    ),
    *(
        _override(_OFFLOAD_WORKER, "SimpleCPUOffloadWorker", name, params, _ASYNC_WORKER)
        for name, params in (
            ("bind_connector_metadata", ("self", "metadata")),
            ("_poll_stream_events", ("self", "is_store")),
            ("_flush_and_sync_all", ("self",)),
        )
    ),
    Relied(
        _OFFLOAD_WORKER,
        "SimpleCPUOffloadWorker",
        "__class__",
        "swap",
        "HostTierCudaWorker.adopt turns vLLM's CUDA worker into HostTierCudaWorker "
        "(worker.__class__ = cls)",
        _CUDA_WORKER,
    ),
    # (_store_hwm, _poll_stream_events: listed above, for the CPU workers.)
    Relied(
        _OFFLOAD_WORKER,
        "SimpleCPUOffloadWorker",
        "_store_events",
        "attr",
        "the CUDA events recorded after each store, waited on before Stage 1",
        _CUDA_WORKER,
    ),
    # ("waits": listed below, for the async worker, which adds it too.)
    *_absent(_OFFLOAD_WORKER, "SimpleCPUOffloadWorker", _CUDA_WORKER, ("_recorded_store_event",)),
    *_absent(
        _OFFLOAD_WORKER,
        "SimpleCPUOffloadWorker",
        _ASYNC_WORKER,
        (
            "settings",
            "waits",
            "wait_for_stores",
            "_rng",
            "_step",
            "_copies",
            "_last_due",
            "_queue",
            "_thread",
            "_issue",
            "_submit_due",
            "_finish",
            "_start_thread",
            "_copy_loop",
        ),
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
        "rocketkv_vllm.vllm_patches.model_runner._v2_gather_batch_req_state",
    ),
    Relied(
        _V2_RUNNER,
        "BatchReqState",
        "decode_graph_eligible",
        "attr",
        "keep a step off FULL CUDA graphs",
        "rocketkv_vllm.vllm_patches.model_runner._v2_gather_batch_req_state",
    ),
    # -- metrics (metrics): vLLM calls these; ROCKETKV builds the logger --
    Relied(
        "vllm.v1.engine.output_processor",
        "OutputProcessor",
        "request_states",
        "attr",
        "the frontend's state of a request just added",
        "rocketkv_vllm.vllm_patches.frontend._output_add_request",
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
