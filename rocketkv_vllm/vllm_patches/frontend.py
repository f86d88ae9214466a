"""Patches of vLLM's frontend: per-request refusals in the input processor,
and the facts ROCKETKV's ``rocketkv:*`` metrics count (the engine's stat
loggers, its output processor)."""

from __future__ import annotations

import functools

from rocketkv_vllm.vllm_patches.check import Patch


def _process_inputs(original):
    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        from rocketkv_vllm.engine import is_rocketkv_engine, validate_request

        if not is_rocketkv_engine(self.vllm_config):
            request = original(self, request_id, prompt, params, *args, **kwargs)
            if getattr(self.vllm_config, "kv_transfer_config", None) is not None:
                from rocketkv_vllm.pd import refuse_compressed_on_dense

                refuse_compressed_on_dense(self.vllm_config, request)
            return request
        validate_request(self.vllm_config, params, kwargs.get("resumable", False))
        request = original(self, request_id, prompt, params, *args, **kwargs)
        from rocketkv_vllm.pd import is_nixl_engine, validate_pd_request

        if is_nixl_engine(self.vllm_config):
            validate_pd_request(self.vllm_config, request)  # needs the prompt's tokens
        return request

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


PATCHES: tuple[Patch, ...] = (
    Patch(
        "vllm.v1.engine.input_processor",
        "InputProcessor",
        "process_inputs",
        ("self", "request_id", "prompt", "params", "supported_tasks"),
        _process_inputs,
        "refuse per request what ROCKETKV cannot serve (engine.validate_request; "
        "a P/D request that would compress: pd.validate_pd_request)",
        exact=False,
        also=("resumable",),
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
)
