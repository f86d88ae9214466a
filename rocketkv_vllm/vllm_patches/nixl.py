"""Wrappers of vLLM's NIXL connector (disaggregated prefill and decode,
``rocketkv_vllm.pd``), with their rows of ``PATCHES``."""

from __future__ import annotations

from rocketkv_vllm.vllm_patches.check import Patch

_BASE_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
_PULL_SCHEDULER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler"


def _register_kv_caches(original):
    def register_kv_caches(self, kv_caches):
        from rocketkv_vllm.engine import is_rocketkv_engine

        if is_rocketkv_engine(self.vllm_config):
            from rocketkv_vllm.pd import whole_block_rows

            kv_caches = whole_block_rows(kv_caches)
        return original(self, kv_caches)

    return register_kv_caches


def _request_finished(original):
    def request_finished(self, request, block_ids):
        delay_free, params = original(self, request, block_ids)
        if params is not None and delay_free:
            from rocketkv_vllm.engine import is_rocketkv_engine

            if is_rocketkv_engine(self.vllm_config):
                from rocketkv_vllm.pd import offer_kept_blocks

                if not offer_kept_blocks(self.vllm_config, request, params):
                    # Nothing to decode elsewhere: freed now, as vLLM frees
                    # a request it will not send (its abort path).
                    self._reqs_need_send.pop(request.request_id, None)
                    self._reqs_not_processed.add(request.request_id)
                    return False, None
        return delay_free, params

    return request_finished


def _update_state_after_alloc(original):
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        kv = request.kv_transfer_params
        pulls = bool(kv) and bool(kv.get("do_remote_prefill"))
        original(self, request, blocks, num_external_tokens)
        if pulls and num_external_tokens > 0:
            from rocketkv_vllm.engine import is_rocketkv_engine

            if is_rocketkv_engine(self.vllm_config):
                from rocketkv_vllm.pd import receive_kept_blocks

                receive_kept_blocks(self, request, blocks)

    return update_state_after_alloc


def _add_request(original):
    def add_request(self, request):
        from rocketkv_vllm.pd import first_token_to_add

        token = first_token_to_add(request)
        if token is not None:
            request.output_token_ids.append(token)
        return original(self, request)

    return add_request


PATCHES: tuple[Patch, ...] = (
    Patch(
        _BASE_WORKER,
        "NixlBaseConnectorWorker",
        "register_kv_caches",
        ("self", "kv_caches"),
        _register_kv_caches,
        "a ROCKETKV engine registers each layer's whole block rows (K/V and the KT "
        "pages in their padding) with NIXL: its K/V views skip the padding, which "
        "vLLM's region check cannot partition (pd.whole_block_rows)",
    ),
    Patch(
        _PULL_SCHEDULER,
        "NixlPullConnectorScheduler",
        "request_finished",
        ("self", "request", "block_ids"),
        _request_finished,
        "a ROCKETKV prefill engine offers a compressed prompt's kept blocks only and "
        "adds its compression state and first token to the params "
        "(pd.offer_kept_blocks)",
    ),
    Patch(
        _PULL_SCHEDULER,
        "NixlPullConnectorScheduler",
        "update_state_after_alloc",
        ("self", "request", "blocks", "num_external_tokens"),
        _update_state_after_alloc,
        "a ROCKETKV decode engine pulls a compressed prompt's kept blocks into the "
        "blocks it allocated for them and starts from the prefill engine's first "
        "token (pd.receive_kept_blocks)",
    ),
    Patch(
        "vllm.v1.worker.gpu_input_batch",
        "InputBatch",
        "add_request",
        ("self", "request"),
        _add_request,
        "a compressed prompt pulled from a prefill engine enters the V1 runner's "
        "batch with the prefill engine's first token as its first output "
        "(pd.first_token_to_add)",
    ),
)
