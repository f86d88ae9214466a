"""FULL CUDA graphs for ROCKETKV's decode steps.

vLLM captures one FULL graph per decode batch size (every row one token) and
replays it for any such batch of that size: the graph keeps the launch
shapes and tensor addresses of its capture, and only the builder runs for
the step. So on a step a FULL graph may replay, the builder lays Stage 2 out
the way the capture did (``metadata.RocketKVMetadataBuilder``):

- every batch row is a Stage 2 row; rows that are not compressed (and vLLM's
  padding rows) get seq_len 0, which the kernels skip without writing;
- the per-row columns and the native backend's seq_lens (1 on compressed
  rows) live in persistent device buffers, rewritten in place each step;
- the kernels are launched for ``DecodeGraphShape``: the most view pages any
  request can have (``max_model_len``) and the engine's largest selection.
  Their loops are bounded by each row's own page count, so the work follows
  the batch, not ``max_model_len``; the page-score scratch is sized by it.

Eager steps launch at the same shape (``eager_bounds``), so that the engine
start can compile every specialization they use (``backend.warmup``).

What a graph cannot do, the runner is kept from replaying one for
(``GraphGuard.needs_eager``, called by the runner hooks in
``vllm_patches``): a step holding a one-token prompt chunk (Stage 1 and the
observation-window queries run in Python at the prompt's end) or a request
whose own token budget selects more pages than the shape holds. Those steps
run piecewise, attention eager, with the ordinary layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rocketkv_vllm.budget import budget_pages_selected, kernel_budget, max_view_pages
from rocketkv_vllm.config import RocketKVSettings, TestAids


@dataclass(frozen=True)
class DecodeGraphShape:
    rows: int  # the largest decode batch a FULL graph is captured for
    max_pages: int  # >= any request's view pages
    max_select: int  # >= the pages of the engine's largest selection

    def takes(self, num_select: int) -> bool:
        return num_select <= self.max_select


def shape_for(settings: RocketKVSettings, max_model_len: int, rows: int) -> DecodeGraphShape:
    """Stage 2's launch shape for FULL CUDA graphs (``backend.graphs``): the
    most view pages any request can have, the engine's selection (the same
    for every prompt length; a per-request budget may select more)."""
    max_pages = max_view_pages(max_model_len, settings.page_size)
    budget = kernel_budget(
        settings, max_model_len, head_dim=settings.head_dim, block_size=settings.block_size
    )
    return DecodeGraphShape(rows, max_pages, min(budget.pages_selected, max_pages))


def selection_width(settings: RocketKVSettings, max_model_len: int) -> int:
    """Pages of the engine's largest selection, the forced page included:
    the width of a selection store (``backend.reuse``; a request whose own
    budget selects more never reuses)."""
    extra = 1 if settings.force_current_page else 0
    return shape_for(settings, max_model_len, 1).max_select + extra


def eager_bounds(shape: DecodeGraphShape, num_select: int) -> tuple[int, int]:
    """(max_pages, max_select) of an eager Stage 2 call with the Triton
    kernels: the engine's launch shape whatever the step's rows, or, when a
    request's own budget selects more than it holds, every view page. The
    kernels' specializations then depend on the batch size alone, so the
    warm-up can compile each one an eager step can launch
    (``backend.warmup.warm_up_stage2``); the loops are bounded by each row's
    own pages, so the work follows the rows, as in the FULL graphs."""
    if shape.takes(num_select):
        return shape.max_pages, shape.max_select
    return shape.max_pages, shape.max_pages


def aligned_rows(n: int) -> int:
    """Per-row int32 columns padded to this many entries start 16 bytes
    apart (Triton specializes on a pointer's 16-byte alignment)."""
    return -(-max(1, int(n)) // 4) * 4


class GraphBuffers:
    """The persistent device tensors a FULL decode graph reads, rewritten in
    place each step: the per-row Stage 2 columns, the native backend's
    seq_lens, the rows' token indices."""

    def __init__(self, rows: int, num_columns: int, device) -> None:
        self.columns = torch.zeros(num_columns, rows, dtype=torch.int32, device=device)
        self.native_seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.tokens = torch.arange(rows, device=device)


def decode_graph_shape(
    vllm_config, settings: RocketKVSettings, uses_triton: bool, aids: TestAids
) -> DecodeGraphShape | None:
    """The shape when this engine's decode steps may replay FULL CUDA
    graphs (the Triton kernels on CUDA, vLLM's graph mode with FULL decode
    graphs), or with the Triton kernels anywhere under the
    ``force_graph_layout`` test aid."""
    from vllm.config import CUDAGraphMode
    from vllm.platforms import current_platform

    compilation = vllm_config.compilation_config
    # FULL graphs exist for batches up to the largest capture size; larger
    # decode batches run eagerly, in the ordinary layout.
    rows = compilation.max_cudagraph_capture_size or vllm_config.scheduler_config.max_num_seqs
    if not uses_triton:
        return None
    if not aids.force_graph_layout:
        if not current_platform.is_cuda_alike():
            return None
        mode = compilation.cudagraph_mode
        if mode is None or mode.decode_mode() != CUDAGraphMode.FULL:
            return None
    return shape_for(settings, vllm_config.model_config.max_model_len, rows)


@dataclass(frozen=True)
class GraphGuard:
    """What the runner hooks check before vLLM may replay a FULL graph."""

    shape: DecodeGraphShape
    page_size: int

    def needs_eager(self, prefilling: np.ndarray, budgets: list[int | None]) -> bool:
        """Whether a one-token-per-row step must not replay a FULL graph: it
        holds a prompt chunk, or a request whose own budget selects more
        pages than the captured shape."""
        if bool(np.any(prefilling)):
            return True
        return any(
            b and not self.shape.takes(budget_pages_selected(b, self.page_size)) for b in budgets
        )
