"""FULL CUDA graphs for ROCKETKV's decode steps.

vLLM captures one FULL graph per decode batch size (every row one token) and
replays it for any such batch of that size: the graph keeps the launch
shapes and tensor addresses of its capture, and only the builder runs for
the step. So on a step a FULL graph may replay, the builder lays Stage 2 out
the way the capture did (``backend.RocketKVMetadataBuilder``):

- every batch row is a Stage 2 row; rows that are not compressed (and vLLM's
  padding rows) get seq_len 0, which the kernels skip without writing;
- the per-row columns and the native backend's seq_lens (1 on compressed
  rows) live in persistent device buffers, rewritten in place each step;
- the kernels are launched for ``DecodeGraphShape``: the most view pages any
  request can have (``max_model_len``) and the engine's largest selection.
  Their loops are bounded by each row's own page count, so the work follows
  the batch, not ``max_model_len``; the page-score scratch is sized by it.

What a graph cannot do, the runner is kept from replaying one for
(``install_hooks``): a step holding a one-token prompt chunk (Stage 1 and
the observation-window queries run in Python at the prompt's end) or a
request whose own token budget selects more pages than the shape holds.
Those steps run piecewise, attention eager, with the ordinary layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from rocketkv_vllm.config import RocketKVSettings, max_topk

_HOOKED = "_rocketkv_graph_hook"


@dataclass(frozen=True)
class DecodeGraphShape:
    rows: int  # the largest decode batch a FULL graph is captured for
    max_pages: int  # >= any request's view pages
    max_select: int  # >= the pages of the engine's largest selection

    def takes(self, num_select: int) -> bool:
        return num_select <= self.max_select


def num_select(topk: int, page_size: int) -> int:
    """Pages a plan with this ``topk`` selects (before a forced current page)."""
    return max(topk // page_size, 1)


def shape_for(settings: RocketKVSettings, max_model_len: int, rows: int) -> DecodeGraphShape:
    ps = settings.page_size
    # ceil(num_compact / ps) + ceil((seq_len - tail_start) / ps), their sum
    # at most max_model_len tokens
    max_pages = -(-max_model_len // ps) + 1
    return DecodeGraphShape(rows, max_pages,
                            min(num_select(max_topk(settings), ps), max_pages))


def decode_graph_shape(vllm_config, settings: RocketKVSettings,
                       uses_triton: bool) -> DecodeGraphShape | None:
    """The shape when this engine's decode steps may replay FULL CUDA
    graphs (the Triton kernels on CUDA, vLLM's graph mode with FULL decode
    graphs), or with the Triton kernels anywhere under the
    ``force_graph_layout`` test aid."""
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    compilation = vllm_config.compilation_config
    rows = max(vllm_config.scheduler_config.max_num_seqs,
               compilation.max_cudagraph_capture_size or 0)
    if not uses_triton:
        return None
    if not settings.force_graph_layout:
        if not current_platform.is_cuda_alike():
            return None
        mode = compilation.cudagraph_mode
        if mode is None or mode.decode_mode() != CUDAGraphMode.FULL:
            return None
    return shape_for(settings, vllm_config.model_config.max_model_len, rows)


@dataclass
class _Guard:
    shape: DecodeGraphShape
    page_size: int


# The worker's graph shape, set by its ROCKETKV builder (one engine per
# worker process); the runner hooks do nothing while it is None.
GUARD: _Guard | None = None


def enable(shape: DecodeGraphShape, settings: RocketKVSettings) -> None:
    global GUARD
    GUARD = _Guard(shape, settings.page_size)
    install_hooks()


def needs_eager(prefilling: np.ndarray, budgets: list[int | None]) -> bool:
    """Whether a one-token-per-row step must not replay a FULL graph: it
    holds a prompt chunk, or a request whose own budget selects more pages
    than the captured shape. (A plan of a per-request budget B selects
    max(B // 2 // page_size, 1) pages: ``config.plan_request``.)"""
    guard = GUARD
    if guard is None:
        return False
    if bool(np.any(prefilling)):
        return True
    return any(b and not guard.shape.takes(num_select(b // 2, guard.page_size))
               for b in budgets)


def _hook_v1_runner(runner_cls) -> None:
    original = runner_cls._determine_batch_execution_and_padding

    @functools.wraps(original)
    def _determine_batch_execution_and_padding(self, num_tokens, num_reqs,
                                               num_scheduled_tokens_np,
                                               max_num_scheduled_tokens, *args, **kwargs):
        from rocketkv_vllm.request_budget import WORKER_BUDGETS

        if (GUARD is not None and kwargs.get("force_uniform_decode") is None
                and max_num_scheduled_tokens == 1 and num_reqs > 0):
            batch = self.input_batch
            prefilling = (batch.num_computed_tokens_cpu[:num_reqs]
                          < batch.num_prompt_tokens[:num_reqs])
            if needs_eager(prefilling, WORKER_BUDGETS.rows[:num_reqs]):
                kwargs["force_uniform_decode"] = False
        return original(self, num_tokens, num_reqs, num_scheduled_tokens_np,
                        max_num_scheduled_tokens, *args, **kwargs)

    runner_cls._determine_batch_execution_and_padding = _determine_batch_execution_and_padding


def _hook_v2_runner(runner_cls) -> None:
    original = runner_cls.gather_batch_req_state

    @functools.wraps(original)
    def gather_batch_req_state(self, scheduler_output, dummy_run):
        from rocketkv_vllm.request_budget import WORKER_BUDGETS

        state, uniform_count = original(self, scheduler_output, dummy_run)
        if GUARD is None or state is None or uniform_count is None:
            return state, uniform_count
        slots = state.idx_mapping_np.tolist()
        budgets = [WORKER_BUDGETS.by_slot.get(s) for s in slots]
        if needs_eager(state.is_prefilling_np, budgets):
            return state._replace(decode_graph_eligible=False), None
        return state, uniform_count

    runner_cls.gather_batch_req_state = gather_batch_req_state


def install_hooks() -> None:
    from rocketkv_vllm.request_budget import hook_model_runners

    hook_model_runners(_hook_v1_runner, _hook_v2_runner, _HOOKED)
