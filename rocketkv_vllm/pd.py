"""Disaggregated prefill and decode (vLLM's NixlConnector, pull mode) with
ROCKETKV engines: what runs today, what is refused (docs/design.md,
"Disaggregated prefill and decode").

A request whose plan does not compress (a prompt within its budget, an own
``rocketkv_token_budget`` of 0) runs dense end to end: the prefill engine
offers every prompt block and the decode engine pulls them all. A request
whose plan compresses runs Stage 1 on the prefill engine (in its prompt's
last step, though it asks for one token), which offers only the kept blocks
(``kept_block_indices``), gives the others back at once and adds the
compression state (``prefill_state``: the plan's inputs, the settings both
engines must agree on, the first token) to the params; the decode engine
allocates and pulls only the kept blocks, skips Stage 1 and decodes with
Stage 2 from the prefill engine's first token (``vllm_patches.nixl``).
What the decode engine cannot continue exactly is refused when it arrives,
naming the field (``decode_refusal``).
"""

from __future__ import annotations

import time

# vLLM 0.32's NIXL connectors (``KVConnectorFactory`` names): the pull
# connector, and its old name; push mode (decode writes) is not supported.
NIXL_PULL_CONNECTORS = ("NixlConnector", "NixlPullConnector")
NIXL_PUSH_CONNECTORS = ("NixlPushConnector",)

# The kv_transfer_params keys that put a request on one side of a transfer:
# a prefill-side request decodes remotely, a decode-side one was prefilled
# remotely (vLLM's pull scheduler reads them; ``request_finished`` swaps them
# in the params it hands back).
PREFILL_SIDE = "do_remote_decode"
DECODE_SIDE = "do_remote_prefill"


def nixl_refusals(vllm_config) -> list[str]:
    """What a ROCKETKV engine cannot run of a NIXL connector config, each
    named; [] for NIXL pull mode on vLLM's CPU build (or no NIXL at all)."""
    from vllm.platforms import current_platform

    transfer = vllm_config.kv_transfer_config
    name = None if transfer is None else transfer.kv_connector
    if name in NIXL_PUSH_CONNECTORS:
        return [
            f"KV connector {name} (NIXL push mode; use NixlConnector, pull mode, for "
            "disaggregated prefill and decode)"
        ]
    if name not in NIXL_PULL_CONNECTORS:
        return []
    if not current_platform.is_cpu():
        return [
            f"KV connector {name} outside vLLM's CPU build for now (not yet run on a GPU: "
            "the KT pages in each block's padding travel with a device-to-device pull "
            "untested)"
        ]
    return []


def is_nixl_engine(vllm_config) -> bool:
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    return transfer is not None and transfer.kv_connector in NIXL_PULL_CONNECTORS


def transfer_side(params) -> str | None:
    """``"prefill"``, ``"decode"`` or None: which side of a P/D transfer a
    request's ``kv_transfer_params`` put it on (SamplingParams.extra_args)."""
    extra = getattr(params, "extra_args", None)
    kv = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    if not isinstance(kv, dict):
        return None
    if kv.get(PREFILL_SIDE):
        return "prefill"
    if kv.get(DECODE_SIDE):
        return "decode"
    return None


def pd_budget(params, side: str) -> int | None:
    """The budget a P/D request's decode will be planned with. The decode
    side plans as any request does (``requests.planned_budget``). The
    prefill side sees ``max_tokens`` 1 (its one token is the prompt's own),
    which alone would plan it dense, but the request decodes elsewhere: its
    own budget, else the engine's, decides."""
    from rocketkv_vllm.requests import params_token_budget, planned_budget

    return params_token_budget(params) if side == "prefill" else planned_budget(params)


def pd_refusal(vllm_config, params, num_prompt_tokens: int) -> str | None:
    """Why a ROCKETKV engine refuses this request (None: served), from its
    SamplingParams and prompt length. The prefill side serves every plan
    (a compressing one runs Stage 1 and offers the kept blocks); the decode
    side refuses a request it cannot continue as the prefill engine
    compressed it (``decode_refusal``), and, under Model Runner V2, every
    compressed one (its first token, the prefill engine's, is handed to the
    V1 runner's input batch only)."""
    side = transfer_side(params)
    if side != "decode":
        return None
    kv = params.extra_args["kv_transfer_params"]
    reason = parallel_layout_refusal(vllm_config, kv)
    if reason is not None:
        return reason
    from rocketkv_vllm.config import settings_for
    from rocketkv_vllm.plan import plan_request

    settings = settings_for(vllm_config)
    budget = pd_budget(params, side)
    plan = plan_request(settings, num_prompt_tokens, budget)
    state = decode_state(kv)
    reason = decode_refusal(settings, state, plan, budget, lease_s(vllm_config))
    if reason is None and state is not None:
        reason = offered_blocks_refusal(settings, plan, kv)
    transfer = vllm_config.kv_transfer_config
    policy = getattr(transfer, "kv_load_failure_policy", "fail")
    if reason is None and state is not None and policy != "fail":
        reason = (
            f"ROCKETKV cannot recompute a compressed request prefilled on another engine "
            f"(kv_transfer_params.{DECODE_SIDE}) after a failed pull: this engine has no "
            f"blocks for its evicted K/V. Run the decode engine with "
            f"kv_transfer_config.kv_load_failure_policy fail (not {policy!r})"
        )
    if reason is None and state is not None and vllm_config.use_v2_model_runner:
        reason = (
            f"ROCKETKV does not yet decode a compressed request prefilled on another "
            f"engine (kv_transfer_params.{DECODE_SIDE}) under Model Runner V2: run the "
            f"decode engine with VLLM_USE_V2_MODEL_RUNNER=0"
        )
    return reason


def parallel_layout_refusal(vllm_config, kv_transfer_params: dict) -> str | None:
    """Why a ROCKETKV decode engine cannot pull from the prefill engine that
    wrote these params (None: it can): the two must split the model alike.
    NIXL registers ROCKETKV's caches as whole block rows (``whole_block_rows``:
    K, V and the KT pages in the padding), and vLLM's reads across different
    tensor-parallel sizes cut each remote block by heads, which those rows
    do not expose. Dense requests too: their blocks have the same rows."""
    parallel = vllm_config.parallel_config
    dcp = parallel.decode_context_parallel_size
    ours = {
        # vLLM's NIXL scheduler offers max(TP, DCP) as its transfer TP size
        "tp_size": max(parallel.tensor_parallel_size, dcp),
        "dcp_size": dcp,
        "pp_size": parallel.pipeline_parallel_size,
    }
    named = [
        f"kv_transfer_params.{key} {kv_transfer_params.get(key, 1)!r} on the prefill engine, "
        f"{here} here"
        for key, here in ours.items()
        if kv_transfer_params.get(key, 1) != here
    ]
    if not named:
        return None
    return (
        "ROCKETKV pulls only between engines of the same parallel layout (its blocks carry "
        "KT pages that vLLM's cross-size reads do not place): "
        + "; ".join(named)
        + f" (kv_transfer_params.{DECODE_SIDE}). Run both engines with the same "
        "tensor-, pipeline- and decode-context-parallel sizes"
    )


# The compression state the prefill engine adds to the params it hands the
# decode engine (``kv_transfer_params[STATE_KEY]``): what the decode engine
# checks against its own plan and settings, and the first token.
STATE_KEY = "rocketkv"
# The settings a compressed request's view and Stage 2 depend on: both
# engines must agree on them (``settings_digest``). Left out: ``preset``
# (resolved into the others), ``kernel`` (which implementation computes the
# same thing), ``free_evicted_blocks`` (when each engine frees its blocks).
AGREED_SETTINGS = (
    "token_budget",
    "prompt_budget",
    "window_size",
    "kernel_size",
    "keep_rule",
    "stage1_lead_layer",
    "page_size",
    "topk",
    "topr",
    "max_new_tokens",
    "force_current_page",
    "evict",
    "kt_dtype",
    "reselect_every",
    "block_size",
    "head_dim",
)


def agreed_settings(settings) -> dict:
    return {name: getattr(settings, name) for name in AGREED_SETTINGS}


def settings_digest(settings) -> str:
    import hashlib
    import json

    text = json.dumps(agreed_settings(settings), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def kept_block_indices(plan, block_size: int, num_blocks: int) -> list[int]:
    """The logical blocks of a compressed prompt that hold what its decode
    reads after Stage 1: the compaction targets (the kept tokens before the
    tail, compacted into the first blocks) and the tail block; the blocks in
    ``freed_block_range`` between them hold evicted K/V only."""
    start, end = plan.freed_block_range(block_size)
    return [j for j in range(num_blocks) if not start <= j < end]


# vLLM's default ``kv_lease_duration`` (kv_connector_extra_config): how long
# a prefill engine keeps blocks it offered that no decode engine has claimed
LEASE_DEFAULT_S = 30
# Slack on top of the decode engine's first heartbeat: its input processing
# before the scheduler sees the request, and the two hosts' clocks
LEASE_SLACK_S = 1.0


def lease_s(vllm_config) -> float:
    """This engine's ``kv_lease_duration``: on a prefill engine how long it
    holds an offer; on a decode engine its heartbeats come every sixth of
    it (vLLM's NIXL scheduler)."""
    transfer = vllm_config.kv_transfer_config
    if transfer is None:
        return LEASE_DEFAULT_S
    return float(transfer.get_from_extra_config("kv_lease_duration", LEASE_DEFAULT_S))


def prefill_state(settings, plan, budget, first_token: int | None, lease: float) -> dict:
    """The compression state of a compressed P/D request, for the decode
    engine (``kv_transfer_params[STATE_KEY]``). ``offered_at`` (wall clock,
    now) and ``lease``: until when the prefill engine holds the kept blocks
    for a decode engine that has not claimed them."""
    return {
        "prompt_len": plan.num_prompt_tokens,
        "budget": budget,  # the budget the prefill engine planned with
        "kept_tokens": plan.kept_tokens(),
        "page_size": settings.page_size,
        "kt_dtype": settings.kt_dtype,
        "block_size": settings.block_size,
        "digest": settings_digest(settings),
        "settings": agreed_settings(settings),
        "first_token": first_token,
        "offered_at": time.time(),
        "lease_s": lease,
    }


def decode_state(kv_transfer_params) -> dict | None:
    """The prefill engine's compression state of a decode-side request (its
    params as the prefill engine returned them), or None."""
    if not isinstance(kv_transfer_params, dict) or kv_transfer_params.get(PREFILL_SIDE):
        return None
    state = kv_transfer_params.get(STATE_KEY)
    return state if isinstance(state, dict) else None


def decode_refusal(settings, state: dict | None, plan, budget, lease: float) -> str | None:
    """Why the decode engine cannot continue a request the prefill engine
    compressed (None: it can): the plans or settings of the two engines
    differ, one side compressed and the other did not, or the prefill
    engine's hold on the kept blocks may have lapsed before this engine's
    first heartbeat (``lease``: this engine's ``kv_lease_duration``)."""
    key = f"kv_transfer_params.{DECODE_SIDE}"
    if state is None:
        if not plan.compress:
            return None
        return (
            f"ROCKETKV cannot decode a {plan.num_prompt_tokens}-token prompt that would "
            f"compress ({key}) from dense K/V: its kv_transfer_params carry no "
            f"kv_transfer_params.{STATE_KEY} (the prefill engine did not compress it: "
            f"not a ROCKETKV engine, or it planned the request dense). Send it with "
            f'vllm_xargs {{"rocketkv_token_budget": 0}} to both engines, or prefill it '
            f"on a ROCKETKV engine"
        )
    ours = agreed_settings(settings)
    theirs = state.get("settings")
    if state.get("digest") != settings_digest(settings) or not isinstance(theirs, dict):
        named = [
            f"rocketkv.{k} {theirs.get(k)!r} on the prefill engine, {v!r} here"
            for k, v in ours.items()
            if isinstance(theirs, dict) and theirs.get(k) != v
        ]
        return (
            f"ROCKETKV settings differ between the prefill and the decode engine "
            f"({key}): "
            + ("; ".join(named) if named else "settings digest differs")
            + ". Both engines must run the same ROCKETKV settings"
        )
    if type(state.get("first_token")) is not int:
        return (
            f"kv_transfer_params.{STATE_KEY}.first_token is missing ({key}): the decode "
            f"engine continues a compressed prompt from the prefill engine's token; send "
            f"the params the prefill engine returned"
        )
    offered_at, held = state.get("offered_at"), state.get("lease_s")
    if not all(isinstance(v, (int, float)) for v in (offered_at, held)):
        return (
            f"kv_transfer_params.{STATE_KEY}.offered_at / lease_s is missing ({key}): send "
            f"the params the prefill engine returned"
        )
    # vLLM's pull reads the prefill engine's blocks without asking it: past
    # its lease they may hold another request's K/V. This engine's heartbeats
    # renew the lease once its scheduler has the request, every sixth of its
    # own lease; refuse what arrives too late for the first one.
    age = time.time() - offered_at
    if age > held - lease / 6 - LEASE_SLACK_S:
        return (
            f"kv_transfer_params.{STATE_KEY}.offered_at: the prefill engine offered these "
            f"blocks {age:.1f} s ago and holds them for kv_lease_duration {held:g} s "
            f"({key}); this decode engine's first heartbeat (every {lease / 6:g} s) could "
            f"come too late, and the blocks may hold another request's K/V. Send the "
            f"prefill engine's answer on at once, or raise its kv_lease_duration"
        )
    if state.get("prompt_len") != plan.num_prompt_tokens:
        return (
            f"kv_transfer_params.{STATE_KEY}.prompt_len {state.get('prompt_len')} differs "
            f"from this request's {plan.num_prompt_tokens}-token prompt ({key}): send the "
            f"decode engine the prompt the prefill engine compressed"
        )
    if not plan.compress or state.get("budget") != budget:
        return (
            f"vllm_xargs.rocketkv_token_budget differs between the engines ({key}): the "
            f"prefill engine compressed the prompt with budget {state.get('budget')!r} "
            f"(None: the engine's), this request plans "
            + ("it dense" if not plan.compress else f"budget {budget!r}")
            + "; send both engines the same rocketkv_token_budget (and max_tokens > 1 "
            "to the decode engine)"
        )
    return None


def offered_blocks_refusal(settings, plan, kv_transfer_params: dict) -> str | None:
    """Why a compressed offer's ``remote_block_ids`` cannot be pulled (None:
    it can): they must name the kept blocks of the prompt the prefill engine
    compressed (``kept_block_indices``, one KV cache group), the blocks this
    engine allocates for it. Checked when the request arrives: any other
    count would stop this engine's scheduler (``receive_kept_blocks``)."""
    from rocketkv_vllm.plan import cdiv

    num_blocks = cdiv(plan.num_prompt_tokens, settings.block_size)
    want = len(kept_block_indices(plan, settings.block_size, num_blocks))
    groups = kv_transfer_params.get("remote_block_ids")
    ids = groups[0] if isinstance(groups, (list, tuple)) and len(groups) == 1 else None
    if (
        isinstance(ids, (list, tuple))
        and len(ids) == want
        and all(type(i) is int and i >= 0 for i in ids)
    ):
        return None
    got = f"{len(ids)} block ids" if isinstance(ids, (list, tuple)) else repr(groups)[:80]
    return (
        f"kv_transfer_params.remote_block_ids: the offer of a compressed "
        f"{plan.num_prompt_tokens}-token prompt names its {want} kept blocks, one list of "
        f"block ids in one KV cache group; got {got} (kv_transfer_params.{DECODE_SIDE}). "
        f"Send the params the prefill engine returned"
    )


def validate_pd_request(vllm_config, engine_request) -> None:
    """Refuse (vLLM's validation error, HTTP 400) a P/D request whose plan
    compresses; called with the ``EngineCoreRequest`` vLLM's input processor
    made (``vllm_patches.frontend``), before the engine core sees it."""
    params = getattr(engine_request, "sampling_params", None)
    if params is None or transfer_side(params) is None:
        return
    from vllm.utils import length_from_prompt_token_ids_or_embeds

    num_prompt_tokens = length_from_prompt_token_ids_or_embeds(
        engine_request.prompt_token_ids, engine_request.prompt_embeds
    )  # prompt embeddings are compressed like ids
    reason = pd_refusal(vllm_config, params, num_prompt_tokens)
    if reason is not None:
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(reason, parameter="kv_transfer_params")


def refuse_compressed_on_dense(vllm_config, engine_request) -> None:
    """A NIXL engine with another attention backend (the package loaded)
    refuses a request carrying a ROCKETKV prefill engine's compression
    state: the blocks it would pull hold compacted K/V only ROCKETKV reads."""
    if not is_nixl_engine(vllm_config):
        return
    params = getattr(engine_request, "sampling_params", None)
    extra = getattr(params, "extra_args", None)
    kv = extra.get("kv_transfer_params") if isinstance(extra, dict) else None
    if decode_state(kv) is None:
        return
    from vllm.exceptions import VLLMValidationError

    raise VLLMValidationError(
        f"kv_transfer_params.{STATE_KEY}: a ROCKETKV prefill engine compressed this prompt "
        f"(kv_transfer_params.{DECODE_SIDE}); this decode engine's attention backend cannot "
        f"read its compacted blocks. Decode it on a ROCKETKV engine with the same settings, "
        f'or send it to the prefill engine with vllm_xargs {{"rocketkv_token_budget": 0}}',
        parameter="kv_transfer_params",
    )


def whole_block_rows(kv_caches: dict) -> dict:
    """Each layer's cache as an int8 ``[num_blocks, row_bytes]`` view of its
    whole block rows (``vllm_patches.nixl``: what NIXL registers). ROCKETKV's
    K/V view of a block stops before the KT pages in the block's padding, so
    its bytes are not a whole number of block rows, which vLLM's NIXL worker
    needs to partition its regions; the row view moves the KT pages with the
    block. A view already spanning its rows is kept."""
    import torch

    out = {}
    for name, cache in kv_caches.items():
        if not isinstance(cache, torch.Tensor) or cache.ndim < 2:
            out[name] = cache
            continue
        size = cache.element_size()
        row = cache.stride(0) * size
        if cache[0].nbytes == row:
            out[name] = cache
            continue
        raw = torch.empty(0, dtype=torch.int8, device=cache.device).set_(cache.untyped_storage())
        out[name] = raw.as_strided((cache.shape[0], row), (row, 1), cache.storage_offset() * size)
    return out


# -- the compressed transfer (``vllm_patches.nixl``) ----------------------------


def offer_kept_blocks(vllm_config, request, params: dict) -> bool:
    """Prefill side, vLLM's ``request_finished`` params of a request whose
    plan compresses (its Stage 1 ran in its prompt's last step, the step it
    finished in; ``RocketKVManager.remove_skipped_blocks`` gave back the
    evicted range just before): ``remote_block_ids`` cut to the kept blocks,
    and the compression state added. False: offer nothing. A compressed
    request whose one token stopped it (EOS, a stop token id) has nothing
    to decode; the decode engine, which would only continue from that token,
    gets no params and serves the request whole, as a single engine would
    (its first token stops it there too)."""
    from vllm.v1.request import RequestStatus

    from rocketkv_vllm.config import settings_for
    from rocketkv_vllm.plan import plan_request

    kv = request.kv_transfer_params
    if not kv or not kv.get(PREFILL_SIDE):
        return True
    settings = settings_for(vllm_config)
    budget = pd_budget(request.sampling_params, "prefill")
    plan = plan_request(settings, request.num_prompt_tokens, budget)
    if not plan.compress or request.num_computed_tokens < plan.num_prompt_tokens:
        return True
    if request.status == RequestStatus.FINISHED_STOPPED:
        return False
    groups = params.get("remote_block_ids")
    if not groups or len(groups) != 1:
        return True  # one KV cache group (ROCKETKV's engines hold one)
    ids = list(groups[0])
    kept = [ids[j] for j in kept_block_indices(plan, settings.block_size, len(ids))]
    params["remote_block_ids"] = type(groups)([kept]) if isinstance(groups, tuple) else [kept]
    outputs = request.output_token_ids
    params[STATE_KEY] = prefill_state(
        settings, plan, budget, outputs[0] if outputs else None, lease_s(vllm_config)
    )
    return True


def receive_kept_blocks(connector_scheduler, request, blocks) -> None:
    """Decode side, after vLLM's ``update_state_after_alloc`` queued the pull
    of a request the prefill engine compressed (``RocketKVManager`` gave it
    blocks for the kept ones only, the null block in between): the local
    blocks of the pull are the kept ones, in the order the prefill engine
    offered them; the prefill engine's first token is the request's first
    output (the decode starts after it, as a single engine's after its
    Stage 1 step), and goes to the client with the first decoded token
    (``emit_first_tokens``)."""
    state = decode_state(request.kv_transfer_params)
    entry = connector_scheduler._reqs_need_recv.get(request.request_id)
    if state is None or entry is None:
        return
    from rocketkv_vllm.config import settings_for
    from rocketkv_vllm.plan import plan_request
    from rocketkv_vllm.requests import planned_budget

    settings = settings_for(connector_scheduler.vllm_config)
    plan = plan_request(
        settings, request.num_prompt_tokens, planned_budget(request.sampling_params)
    )
    if not plan.compress:
        return
    group = blocks.blocks[0]
    keep = kept_block_indices(plan, settings.block_size, len(group))
    local = [group[j].block_id for j in keep if not group[j].is_null]
    remote = request.kv_transfer_params["remote_block_ids"][0]
    if len(local) != len(keep) or len(local) != len(remote):
        raise RuntimeError(
            f"ROCKETKV P/D request {request.request_id}: {len(remote)} kept blocks offered, "
            f"{len(local)} allocated for {len(keep)} (plan {plan})"
        )
    req, _, computed, awaiting = entry
    connector_scheduler._reqs_need_recv[request.request_id] = (req, ([*local],), computed, awaiting)
    request.append_output_token_ids(state["first_token"])
    pending = getattr(connector_scheduler, "rocketkv_first_tokens", None)
    if pending is None:
        pending = connector_scheduler.rocketkv_first_tokens = {}
    pending[request.request_id] = state


def first_token_to_add(request_state) -> int | None:
    """Worker side (V1 input batch): the prefill engine's first token of a
    compressed request entering the batch with its whole prompt computed
    (pulled), which the decode step reads as its input; else None."""
    if request_state.output_token_ids or request_state.prompt_token_ids is None:
        return None
    params = request_state.sampling_params
    extra = getattr(params, "extra_args", None)
    if not isinstance(extra, dict):
        return None
    state = decode_state(extra.get("kv_transfer_params"))
    n = len(request_state.prompt_token_ids)
    if state is None or request_state.num_computed_tokens != n or state.get("prompt_len") != n:
        return None
    return state.get("first_token")


def emit_first_tokens(scheduler, outputs) -> None:
    """Scheduler side, after ``update_from_output``. Decode side: the first
    output of a request the prefill engine compressed starts with the
    prefill engine's token (and its logprobs, if it sent them). Prefill
    side: a compressed request's first-token logprobs join its state."""
    connector = getattr(scheduler, "connector", None)
    nixl = getattr(connector, "connector_scheduler", None)
    if nixl is None:
        return
    from vllm.v1.engine import FinishReason

    pending = getattr(nixl, "rocketkv_first_tokens", None)
    for eco in outputs.values():
        for out in eco.outputs:
            kv = out.kv_transfer_params
            if kv is not None and isinstance(kv.get(STATE_KEY), dict) and out.new_logprobs:
                lp = out.new_logprobs
                kv[STATE_KEY]["first_logprobs"] = [
                    lp.logprob_token_ids[0].tolist(),
                    lp.logprobs[0].tolist(),
                    int(lp.sampled_token_ranks[0]),
                ]
            if not pending:
                continue
            state = pending.pop(out.request_id, None)
            if state is None or out.finish_reason == FinishReason.ERROR:
                # A failed pull ends the request with vLLM's error and no
                # token (kv_load_failure_policy fail): the prefill engine's
                # token is not sent alone with it.
                continue
            out.new_token_ids = [state["first_token"], *out.new_token_ids]
            if out.new_logprobs is not None:
                out.new_logprobs = _with_first_logprobs(out.new_logprobs, state)
    if pending:
        for rid in [r for r in pending if r not in scheduler.requests]:
            del pending[rid]  # aborted before its first step


def _with_first_logprobs(lp, state: dict):
    """``lp`` (one request's LogprobsLists) with a first row for the
    prefill engine's token: the prefill engine's own row when it sent one of
    the same width, else the token alone with an unknown (NaN) logprob."""
    import numpy as np

    width = lp.logprob_token_ids.shape[1]
    sent = state.get("first_logprobs")
    if sent is not None and len(sent[0]) == width:
        ids, values, rank = np.array([sent[0]]), np.array([sent[1]]), sent[2]
    else:
        ids = np.full((1, width), state["first_token"])
        values, rank = np.full((1, width), np.nan), 0
    return type(lp)(
        np.concatenate([ids.astype(lp.logprob_token_ids.dtype), lp.logprob_token_ids]),
        np.concatenate([values.astype(lp.logprobs.dtype), lp.logprobs]),
        np.concatenate(
            [np.array([rank], dtype=lp.sampled_token_ranks.dtype), lp.sampled_token_ranks]
        ),
        None,
    )
