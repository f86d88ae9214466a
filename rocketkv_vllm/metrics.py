"""ROCKETKV metrics on the server's Prometheus ``/metrics``, next to ``vllm:*``.

A stat logger that ``add_stat_logger`` puts first among the loggers of a
ROCKETKV engine whose stats are on (``vllm_patches``: ``AsyncLLM``, i.e. the
OpenAI server's API-server process, and the offline ``LLM``'s engine with
``disable_log_stats=False``). Any other engine gets nothing: no logger, no
per-output work, ``--disable-log-stats`` as vLLM reads it. The metrics are
exported where the ``rocketkv_metrics`` general plugin is loaded
(``plugin.register_metrics``; on by default); without it the logger only
takes the scheduler's account out of the stats.

Every ROCKETKV decision about a request is a pure function of the engine's
settings, the request's prompt length and the budget the request may set
(``plan.plan_request``, ``requests``), the same
function the scheduler (block freeing) and the backend (Stage 1 / Stage 2)
use. So the counters are derived here, in the frontend, from the outputs vLLM
already streams back for every request: no counter lives in a worker, and the
names and values are the same whatever the process layout (tensor / data
parallel, Ray, several API servers with Prometheus multiprocess mode). The
one exception is what only the scheduler knows, how much of a prefix-cache
hit ROCKETKV did not use, and the host tier's stores and loads: its account
(``kv_cache.PrefixCacheAccount``) rides in vLLM's own SchedulerStats, which
every engine core sends to one API server with its outputs, as what it
gained since the stats before (so several API servers' counters add up), and
reaches this logger with vLLM's ``engine_idx`` (the engine's data-parallel
index) wherever the engine runs. No file: a shared folder could stop an engine or
the server and was open to other local users. Reading it never raises; a
malformed entry is dropped and logged once.

What is exported (labels ``model_name``, ``engine``, as vLLM's own metrics):

- ``rocketkv:prompts_compressed_total`` prompts longer than their budget,
  counted when their prefill completes (Stage 1 ran in that step);
- ``rocketkv:prompt_tokens_evicted_total`` prompt tokens evicted, per KV head;
- ``rocketkv:kv_blocks_freed_total`` KV cache blocks given back to vLLM's
  block pool (0 with ``free_evicted_blocks: false``);
- ``rocketkv:kept_fraction`` histogram of kept / prompt tokens per compressed
  prompt;
- ``rocketkv:decode_tokens_attended`` histogram, one sample per decode step of
  a compressed request: tokens per KV head Stage 2 attends (its selected
  pages, counted as whole pages but never more than the request's view);
  ``_count`` is the number of such steps;
- ``rocketkv:decode_context_tokens_total`` the same steps' full context
  length (what dense attention would read), for the ratio
  ``decode_tokens_attended_sum / decode_context_tokens_total``;
- ``rocketkv:prefix_tokens_recomputed_total`` prompt tokens vLLM's prefix
  cache held that ROCKETKV recomputed: a compressed prompt's last
  ``window_size`` tokens, whose queries Stage 1 needs;
- ``rocketkv:config_info`` the engine's resolved settings as labels (value 1).

Every compressed prompt also gets one debug-level log line
(``VLLM_LOGGING_LEVEL=DEBUG``).

Parallel sampling (``n > 1``) runs n engine requests, each compressed on its
own, so each counts. A request preempted and recomputed is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from vllm.logger import init_logger
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from rocketkv_vllm.config import RocketKVSettings, settings_for
from rocketkv_vllm.engine import is_rocketkv_engine, metrics_wanted
from rocketkv_vllm.host_tier import has_host_tier
from rocketkv_vllm.kv_cache import take_account
from rocketkv_vllm.plan import PlanCache, RequestPlan, view_pages
from rocketkv_vllm.requests import planned_budget

# Under the "vllm" logger so records show with vLLM's own formatting/level.
logger = init_logger(f"vllm.{__name__}")

METRIC_PREFIX = "rocketkv:"
KEPT_FRACTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
ATTENDED_BUCKETS = tuple(float(1 << i) for i in range(4, 18))  # 16 .. 131072

# The scheduler's account (``kv_cache.PrefixCacheAccount``) field behind
# each counter: (name, documentation).
ACCOUNT_COUNTERS = {
    "tokens_recomputed": (
        "rocketkv:prefix_tokens_recomputed",
        "Prompt tokens vLLM's prefix cache held that ROCKETKV recomputed: a "
        "compressed prompt's last window_size tokens, whose queries Stage 1 "
        "needs (beside vllm:prefix_cache_hits).",
    ),
    "host_tokens_recomputed": (
        "rocketkv:host_tokens_recomputed",
        "Prompt tokens the host tier held that ROCKETKV recomputed (the window "
        "of a compressed prompt).",
    ),
    "host_blocks_stored": (
        "rocketkv:host_blocks_stored",
        "KV blocks copied to the host tier, compaction targets included.",
    ),
    "host_bytes_stored": ("rocketkv:host_bytes_stored", "Bytes copied to the host tier."),
    "host_target_blocks_stored": (
        "rocketkv:host_target_blocks_stored",
        "Compaction targets stored on the host under their dense hashes "
        "before Stage 1 compacted them.",
    ),
    "host_target_blocks_dropped": (
        "rocketkv:host_target_blocks_dropped",
        "Compaction targets not stored because the host pool was full (the "
        "host chain of that prompt stops there).",
    ),
    "host_blocks_loaded": (
        "rocketkv:host_blocks_loaded",
        "KV blocks loaded from the host tier into device blocks (host hits).",
    ),
    "host_bytes_loaded": ("rocketkv:host_bytes_loaded", "Bytes loaded from the host tier."),
}

# Attribute of vLLM's IterationStats where the output hook leaves what each
# request output of the iteration was (see record_output).
_OUTPUTS_ATTR = "_rocketkv_outputs"
# Attribute of the frontend's RequestState holding the request's own budget.
_BUDGET_ATTR = "_rocketkv_token_budget"


@dataclass(frozen=True)
class RequestOutputFact:
    """One engine output of one request, as seen by the frontend."""

    request_id: str
    num_prompt_tokens: int
    was_prefilling: bool  # the output that ends the prefill
    num_new_tokens: int
    num_generated: int  # the request's generated tokens, this output included
    token_budget: int | None = None  # the request's own (requests)


@dataclass(frozen=True)
class PromptAccount:
    """What Stage 1 does to one compressed prompt."""

    num_prompt_tokens: int
    kept_tokens: int  # per KV head
    evicted_tokens: int  # per KV head
    blocks_freed: int

    @property
    def kept_fraction(self) -> float:
        return self.kept_tokens / self.num_prompt_tokens


def account_prompt(settings: RocketKVSettings, plan: RequestPlan) -> PromptAccount:
    """Tokens kept / evicted per KV head and blocks freed for a compressed plan."""
    assert plan.compress
    kept = plan.prompt_budget
    start, end = plan.freed_block_range(settings.block_size)
    freed = end - start if settings.free_evicted_blocks else 0
    return PromptAccount(plan.num_prompt_tokens, kept, plan.num_prompt_tokens - kept, max(freed, 0))


def decode_tokens_attended(settings: RocketKVSettings, plan: RequestPlan, seq_len: int) -> int:
    """Tokens per KV head Stage 2 attends in a decode step whose context
    (the step's own token included) is ``seq_len`` tokens long.

    The step's view is the compacted prompt plus everything from the tail
    block on; Stage 2 selects ``plan.pages_selected`` of its pages, plus the
    current page with ``force_current_page``, at most every page. Selected
    pages count as whole pages, capped at the view's token count.
    """
    ps = settings.page_size
    view_tokens = plan.num_compact + seq_len - plan.tail_start
    pages = view_pages(plan.num_compact, plan.tail_start, seq_len, ps)
    select = plan.pages_selected(ps) + (1 if settings.force_current_page else 0)
    return min(min(select, pages) * ps, view_tokens)


def remember_request(req_state, request) -> None:
    """The request's own budget, on the frontend's RequestState (called by
    the ``OutputProcessor.add_request`` wrapper, ``vllm_patches``)."""
    if req_state is not None:
        setattr(req_state, _BUDGET_ATTR, planned_budget(request.sampling_params))


def record_output(req_state, engine_core_output, iteration_stats, was_prefilling: bool) -> None:
    """Record, on the iteration's IterationStats, one fact per request output
    with its request's prompt length, generated-token count and budget
    (called by the ``OutputProcessor._update_stats_from_output`` wrapper).

    vLLM's IterationStats keeps only batch totals of prompt tokens, and its
    per-request FinishedRequestStats are not made for aborted requests (a
    client that disconnects), whose prompt may well have been compressed.
    """
    if iteration_stats is None or req_state.stats is None:
        return
    num_new = len(engine_core_output.new_token_ids)
    if num_new == 0:
        return
    outputs = iteration_stats.__dict__.setdefault(_OUTPUTS_ATTR, [])
    outputs.append(
        RequestOutputFact(
            req_state.request_id,
            req_state.prompt_len,
            was_prefilling,
            num_new,
            req_state.stats.num_generation_tokens,
            getattr(req_state, _BUDGET_ATTR, None),
        )
    )


def add_stat_logger(vllm_config, logger_manager) -> bool:
    """Put ROCKETKV's stat logger first in a ROCKETKV engine's vLLM
    ``StatLoggerManager``, which calls its loggers in list order: it takes
    the scheduler's account out of the stats before vLLM's loggers and a
    user's see them. Returns whether it exports (the output processor then
    records what it counts)."""
    export = metrics_wanted()
    stat_logger = RocketKVStatLogger(vllm_config, logger_manager.engine_indexes, export)
    logger_manager.stat_loggers.insert(0, stat_logger)
    stat_logger.log_engine_initialized()  # vLLM has logged the others'
    return export


def unregister_rocketkv_metrics(registry=REGISTRY) -> None:
    for collector in list(registry._collector_to_names):
        if getattr(collector, "_name", "").startswith(METRIC_PREFIX):
            registry.unregister(collector)


class RocketKVStatLogger(AggregateStatLoggerBase):
    """Prometheus metrics for ROCKETKV engines (``export``); inert for any
    other engine. Takes the account out of the stats either way."""

    def __init__(self, vllm_config, engine_indexes: list[int] | None = None, export=True):
        self.engine_indexes = list(engine_indexes or [0])
        self.export = export
        self.enabled = export and is_rocketkv_engine(vllm_config)
        if not self.enabled:
            return
        self.settings = settings_for(vllm_config)
        self.plans = PlanCache(self.settings)
        model_name = vllm_config.model_config.served_model_name
        labelnames = ["model_name", "engine"]
        labels = {i: [model_name, str(i)] for i in self.engine_indexes}

        unregister_rocketkv_metrics()

        def per_engine(metric):
            return {i: metric.labels(*labels[i]) for i in self.engine_indexes}

        self.prompts_compressed = per_engine(
            Counter(
                name="rocketkv:prompts_compressed",
                documentation="Prompts compressed by ROCKETKV (longer than their "
                "budget), counted when their prefill completes.",
                labelnames=labelnames,
            )
        )
        self.tokens_evicted = per_engine(
            Counter(
                name="rocketkv:prompt_tokens_evicted",
                documentation="Prompt tokens evicted by ROCKETKV's Stage 1, per KV head.",
                labelnames=labelnames,
            )
        )
        self.blocks_freed = per_engine(
            Counter(
                name="rocketkv:kv_blocks_freed",
                documentation="KV cache blocks ROCKETKV gave back to vLLM's block "
                "pool after compressing prompts.",
                labelnames=labelnames,
            )
        )
        self.kept_fraction = per_engine(
            Histogram(
                name="rocketkv:kept_fraction",
                documentation="Kept / prompt tokens (per KV head) of each compressed prompt.",
                labelnames=labelnames,
                buckets=KEPT_FRACTION_BUCKETS,
            )
        )
        self.attended = per_engine(
            Histogram(
                name="rocketkv:decode_tokens_attended",
                documentation="Tokens per KV head attended by ROCKETKV's sparse decode "
                "(Stage 2), one sample per decode step of a compressed "
                "request (selected pages counted whole).",
                labelnames=labelnames,
                buckets=ATTENDED_BUCKETS,
            )
        )
        self.context = per_engine(
            Counter(
                name="rocketkv:decode_context_tokens",
                documentation="Context length (tokens) of the decode steps counted in "
                "rocketkv:decode_tokens_attended: what dense attention "
                "would read.",
                labelnames=labelnames,
            )
        )
        # Counters fed by the scheduler's account (one per field), the host
        # tier's only where the engine has one.
        fields = dict(ACCOUNT_COUNTERS)
        if not has_host_tier(vllm_config):
            fields = {f: c for f, c in fields.items() if not f.startswith("host_")}
        self.account_counters = {
            field: per_engine(Counter(name=name, documentation=doc, labelnames=labelnames))
            for field, (name, doc) in fields.items()
        }
        info = self.settings.as_dict()
        info_gauge = Gauge(
            name="rocketkv:config_info",
            documentation="ROCKETKV settings of the engine (value 1).",
            labelnames=labelnames + sorted(info),
            multiprocess_mode="mostrecent",
        )
        for i in self.engine_indexes:
            info_gauge.labels(*labels[i], *(str(info[k]) for k in sorted(info))).set(1)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        # Taken out whatever follows: the loggers next in line (vLLM's, a
        # user's) must not see the entries.
        account = {} if scheduler_stats is None else take_account(scheduler_stats)
        if not self.enabled:
            return
        if account and engine_idx in self.prompts_compressed:
            self._record_account(engine_idx, account)
        if iteration_stats is None:
            return
        outputs = iteration_stats.__dict__.get(_OUTPUTS_ATTR)
        if not outputs or engine_idx not in self.prompts_compressed:
            return
        for out in outputs:
            plan = self.plans(out.num_prompt_tokens, out.token_budget)
            if not plan.compress:
                continue
            if out.was_prefilling:
                self._record_prompt(out, plan, engine_idx)
            # Generated tokens with index >= 2 come from decode steps (the
            # first one is sampled by the prefill step).
            first = out.num_generated - out.num_new_tokens + 1
            for g in range(max(first, 2), out.num_generated + 1):
                seq_len = out.num_prompt_tokens + g - 1
                self.attended[engine_idx].observe(
                    decode_tokens_attended(self.settings, plan, seq_len)
                )
                self.context[engine_idx].inc(seq_len)

    def _record_account(self, engine_idx: int, account: dict[str, int]) -> None:
        """The scheduler's prefix-cache account (``kv_cache``), carried by
        its stats as what each field gained since its stats before."""
        for field, counters in self.account_counters.items():
            if account.get(field):
                counters[engine_idx].inc(account[field])

    def _record_prompt(self, out: RequestOutputFact, plan: RequestPlan, engine_idx: int) -> None:
        acc = account_prompt(self.settings, plan)
        self.prompts_compressed[engine_idx].inc()
        self.tokens_evicted[engine_idx].inc(acc.evicted_tokens)
        self.blocks_freed[engine_idx].inc(acc.blocks_freed)
        self.kept_fraction[engine_idx].observe(acc.kept_fraction)
        logger.debug(
            "ROCKETKV compressed request %s (engine %d): %d prompt tokens -> %d "
            "kept per KV head (%.1f%%), %d KV blocks freed, decode top-k %d "
            "top-r %d",
            out.request_id,
            engine_idx,
            acc.num_prompt_tokens,
            acc.kept_tokens,
            100.0 * acc.kept_fraction,
            acc.blocks_freed,
            plan.topk,
            plan.topr,
        )

    def log_engine_initialized(self):
        if self.enabled:
            logger.info(
                "ROCKETKV metrics: rocketkv:* counters on /metrics (engines %s).",
                self.engine_indexes,
            )
        elif not self.export:
            logger.info("ROCKETKV metrics off (the rocketkv_metrics plugin is not loaded).")
