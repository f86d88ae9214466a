"""Patches of vLLM's worker and model runners (V1 and Model Runner V2): each
request's budget and prompt length where the builder looks (``state``),
dummy runs marked, steps a FULL CUDA graph cannot run kept off FULL graphs
(``backend.graphs``), ROCKETKV's KV cache spec built with the engine's
config current, Stage 1's kernels compiled at engine start."""

from __future__ import annotations

import functools

from rocketkv_vllm.vllm_patches.check import Patch

_V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
_V2_RUNNER = "vllm.v1.worker.gpu.model_runner"


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


PATCHES: tuple[Patch, ...] = (
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
        also=("force_uniform_decode",),
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
