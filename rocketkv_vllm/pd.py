"""Disaggregated prefill and decode (vLLM's NixlConnector, pull mode) with
ROCKETKV engines: what runs today, what is refused (docs/design.md,
"Disaggregated prefill and decode").

Today a P/D request runs dense end to end: the prefill engine offers every
prompt block and the decode engine pulls them all. That is exactly right for
a request whose plan does not compress (a prompt within its budget, an own
``rocketkv_token_budget`` of 0), and those go through. A request whose plan
would compress is refused when it arrives, on either side, naming the
combination: neither the compacted transfer nor Stage 1 on the decode side
(whose observation window never ran there) is built yet, and serving it
dense instead would silently give up the compression it asked for.
"""

from __future__ import annotations

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
    SamplingParams and prompt length: a P/D request whose plan compresses."""
    side = transfer_side(params)
    if side is None:
        return None
    from rocketkv_vllm.config import settings_for
    from rocketkv_vllm.plan import plan_request

    settings = settings_for(vllm_config)
    budget = pd_budget(params, side)
    plan = plan_request(settings, num_prompt_tokens, budget)
    if not plan.compress:
        return None
    key = PREFILL_SIDE if side == "prefill" else DECODE_SIDE
    shown = settings.prompt_budget if budget is None else f"{budget} (its own)"
    if budget is None and settings.token_budget is not None:
        shown = f"{settings.token_budget} (token_budget)"
    return (
        f"ROCKETKV does not yet compress a request whose prefill and decode run on "
        f"different engines (kv_transfer_params.{key}): its {num_prompt_tokens}-token "
        f"prompt is longer than its budget {shown}. Send it with "
        f'vllm_xargs {{"rocketkv_token_budget": 0}} (dense, through the same '
        f"connector), or to an engine without a KV connector"
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
