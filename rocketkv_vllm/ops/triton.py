"""RocketKV's steps with the Triton kernels (``rocketkv_vllm.kernels``).

Same layout and semantics as the PyTorch steps (``ops.pytorch``; oracle
``tests/reference/paged``), free of host synchronisation in decode. The KV cache is passed
as two views ``k_cache``, ``v_cache`` [num_blocks, Hkv, bs, d] (all four
strides arbitrary, so K may be stored transposed per head block as in
CPU_ATTN; ``layout.split_kv`` makes them from a vLLM cache), the KT cache as
``kt_cache`` (``layout.kt_cache_view``):

* Stage 1's steps for one prompt (called by ``backend.stages.Stage1``, the
  same signatures as ``ops.pytorch``'s): ``window_scores`` (2 Triton passes
  + a few torch ops merging partial softmax statistics),
  ``compact_kept_tokens`` (1 launch), ``write_kt_pages`` (1 launch per
  region). They happen not to synchronise with the host either.
* ``hsa_decode`` -- Stage 2, one decode token per row, all rows at once.
  Launch sequence (everything on the current stream, grids from Python ints):
    1. ``kt_update``            Triton, grid (B, Hkv)        [skipped if update_kt=False]
    2. ``_page_logits_kernel``  Triton, grid (B*Hkv, S1)     (+ 3 torch.empty scratch allocs)
    3. ``_page_probs_kernel``   Triton, grid (B*Hkv, S1)
    4. ``_select_pages_kernel`` Triton, grid (B*Hkv)         (+ 1 alloc)
       [f = 1 with force_current_page: the current page is an extra page,
        selected on top of min(max_select, max_pages)]
    5. ``_sparse_decode_kernel`` Triton, grid (B*Hkv, S2)    (+ 2 scratch allocs if S2 > 1)
    6. ``_merge_splits_kernel`` Triton, grid (B*Hq)          [only if S2 > 1]
  S1, S2: split counts from B, Hkv, max_pages / max_select and the SM count.
  No .item(), no data-dependent shapes: CUDA-graph capturable for fixed
  (B, max_pages, max_select).

No vLLM import here: this module, ``kernels`` and their tests run with only
torch + triton.
"""

from __future__ import annotations

import torch

from rocketkv_vllm.kernels.compact import compact_kept_tokens, write_kt_pages
from rocketkv_vllm.kernels.hsa_score import hsa_page_probs, select_pages
from rocketkv_vllm.kernels.kt_update import kt_update
from rocketkv_vllm.kernels.sparse_decode import sparse_decode
from rocketkv_vllm.kernels.window_scores import window_scores

__all__ = ["compact_kept_tokens", "hsa_decode", "window_scores", "write_kt_pages"]


def hsa_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kt_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_compact: torch.Tensor,
    tail_start: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: torch.Tensor,
    topr: torch.Tensor,
    page_size: int,
    scale: float,
    max_pages: int,
    max_select: int,
    force_current_page: bool = False,
    out: torch.Tensor | None = None,
    update_kt: bool = True,
    select_impl: str = "auto",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stage 2 for one decode token per row (its K/V already in the cache at
    slot seq_lens[b] - 1): KT update, page scoring, top-n pages, sparse
    attention. Returns out [B, Hq, d].

    query [B, Hq, d] (last dim contiguous; cast to the cache dtype);
    k_cache, v_cache [num_blocks, Hkv, bs, d] views (all strides
    arbitrary, the channel dim's included: see ``kernels``);
    block_table [B, max_blocks] int32 (last dim contiguous); num_compact,
    tail_start, seq_lens, topk, topr: [B] integer tensors on the device.
    max_pages (Python int) >= every row's view page count
    ceil(num_compact/ps) + ceil((seq_len - tail_start)/ps); max_select
    (Python int) >= every row's max(topk // ps, 1) (with force_current_page
    the current page is selected on top of those: the buffers get
    max_select + 1 entries here). Rows with seq_lens <= 0
    are padding: nothing is written for them (a given ``out`` keeps its
    values there; an allocated one holds 0).
    select_impl: "auto" / "triton" (the Triton select kernel) or "torch"
    (torch.topk). sinks: optional [Hq] fp32 sink logits (``algorithm.sinks``),
    in the sparse attention's softmax only (step 5 with one split, else step
    6); the page scoring ranks the keys' own mass.
    """
    if update_kt:
        kt_update(k_cache, kt_cache, block_table, seq_lens, page_size)
    probs = hsa_page_probs(
        query,
        kt_cache,
        block_table,
        num_compact,
        tail_start,
        seq_lens,
        topr,
        page_size,
        max_pages,
        force_current_page,
    )
    sel = select_pages(
        probs,
        max_select,
        num_compact,
        tail_start,
        seq_lens,
        topk,
        page_size,
        select_impl,
        force_current_page,
    )
    return sparse_decode(
        query,
        k_cache,
        v_cache,
        block_table,
        sel,
        num_compact,
        tail_start,
        seq_lens,
        topk,
        page_size,
        scale,
        out=out,
        extra_pages=1 if force_current_page else 0,
        sinks=sinks,
    )
