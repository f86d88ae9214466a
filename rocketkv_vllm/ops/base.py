"""The two stages' interfaces and the rows Stage 2 reads, free of vLLM.

``Stage1`` (SnapKV compaction of one prompt at the end of its prefill) and
``Stage2`` (HSA decode over a batch of ``HsaRows``) are the classes the
impl calls: ``stage1.compress(...)`` per prompt, ``stage2.decode(...)`` per
step. Each implementation lives beside the launchers it calls:
``ops.triton`` (``TritonStage1``, ``TritonStage2``), ``ops.cpu``
(``CpuStage2``), ``ops.pytorch`` (``TorchStage1``, ``TorchStage2``);
``backend.stages`` chooses one of each per engine.

No vLLM import here (nor in any module of ``ops``): the stages and their
tests run with only torch + triton (triton imported by ``kernels.rows``,
whose ``DecodeRows`` sits beside the kernels' own row helpers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rocketkv_vllm.algorithm.h2o import h2o_keep_positions
from rocketkv_vllm.algorithm.snapkv import keep_positions_from_scores
from rocketkv_vllm.algorithm.streaming import streaming_keep_positions
from rocketkv_vllm.fp8_kv import KVQuant
from rocketkv_vllm.kernels.rows import DecodeRows
from rocketkv_vllm.layout import kt_cache_view

if TYPE_CHECKING:
    from rocketkv_vllm.config import RocketKVSettings


class Stage1:
    """Stage 1 compaction of one prompt on the paged cache: window scores,
    kept positions, the per-head compaction, the KT pages of the view. The
    three steps are an implementation's (its module's functions of the same
    names); the choice of kept positions is the algorithm's own
    (``algorithm.snapkv``, or a baseline's: ``algorithm.streaming``,
    ``algorithm.h2o``)."""

    name = ""

    def window_scores(self, q_window, k_cache, block_row, n, scale, sinks=None):
        raise NotImplementedError

    def compact_kept_tokens(self, k_cache, v_cache, block_row, kept):
        raise NotImplementedError

    def write_kt_pages(self, k_cache, kt_cache, block_row, lo, hi, page_size):
        raise NotImplementedError

    def compress(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kt_cache: torch.Tensor,
        block_row: torch.Tensor,
        q_window: torch.Tensor | None,
        num_prompt_tokens: int,
        prompt_budget: int,
        tail_start: int,
        kernel_size: int,
        page_size: int,
        scale: float,
        sinks: torch.Tensor | None = None,
        keep_rule: str = "snapkv",
        h2o_scores: torch.Tensor | None = None,
        window_size: int | None = None,
    ) -> torch.Tensor:
        """Choose, compact, build KT for one request (its oracle:
        ``tests/reference/paged.snapkv_compress``, same arguments; sinks: the layer's [Hq]
        fp32 sink logits, in the window scores' softmax): ``choose_kept``, then
        ``apply_kept``. Returns the kept positions [Hkv, prompt_budget]; with
        prompt_budget >= the prompt every position is kept and only the KT
        pages are written. Ties among pooled scores may be broken differently
        by the Triton kernels than by torch's CPU topk, so kept sets can
        differ on plateaus."""
        kept = self.choose_kept(
            k_cache,
            block_row,
            q_window,
            num_prompt_tokens,
            prompt_budget,
            tail_start,
            kernel_size,
            scale,
            sinks=sinks,
            keep_rule=keep_rule,
            h2o_scores=h2o_scores,
            window_size=window_size,
        )
        self.apply_kept(
            k_cache,
            v_cache,
            kt_cache,
            block_row,
            kept,
            num_prompt_tokens,
            prompt_budget,
            tail_start,
            page_size,
        )
        return kept

    def choose_kept(
        self,
        k_cache: torch.Tensor,
        block_row: torch.Tensor,
        q_window: torch.Tensor | None,
        num_prompt_tokens: int,
        prompt_budget: int,
        tail_start: int,
        kernel_size: int,
        scale: float,
        sinks: torch.Tensor | None = None,
        keep_rule: str = "snapkv",
        h2o_scores: torch.Tensor | None = None,
        window_size: int | None = None,
    ) -> torch.Tensor:
        """The kept positions [Hkv, prompt_budget] of one request (all N
        when prompt_budget >= N: ``rocketkv.evict`` false).

        keep_rule (``rocketkv.keep_rule``, docs/keep-rules.md) swaps only the
        choice: ``"snapkv"`` scores the prompt with ``q_window``;
        ``"streaming"`` needs no scores (``q_window`` may be None);
        ``"h2o"`` takes the request's accumulated ``h2o_scores`` [Hkv, >= N]
        (``backend.h2o``). Without ``q_window``, ``window_size`` is the
        observation window the choice protects (the last tokens, always kept)."""
        n = int(num_prompt_tokens)
        if prompt_budget >= n:  # identity
            return torch.arange(n, device=k_cache.device).expand(k_cache.shape[1], n)
        window = q_window.shape[0] if q_window is not None else int(window_size)
        protect_from = min(n - window, tail_start)
        if keep_rule == "snapkv":
            scores = self.window_scores(q_window, k_cache, block_row, n, scale, sinks=sinks)
            return keep_positions_from_scores(
                scores, n, prompt_budget, kernel_size, protect_from=protect_from
            )
        if keep_rule == "streaming":
            return streaming_keep_positions(
                n,
                k_cache.shape[1],
                prompt_budget,
                protect_from=protect_from,
                device=k_cache.device,
            ).contiguous()
        if keep_rule == "h2o":
            return h2o_keep_positions(
                h2o_scores[:, :n], prompt_budget, recent=window, protect_from=protect_from
            )
        raise ValueError(f"unknown keep rule {keep_rule!r}")

    def apply_kept(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kt_cache: torch.Tensor,
        block_row: torch.Tensor,
        kept: torch.Tensor,
        num_prompt_tokens: int,
        prompt_budget: int,
        tail_start: int,
        page_size: int,
    ) -> None:
        """Compact ``kept`` [Hkv, prompt_budget] (sorted positions, the tail
        [tail_start, N) last) onto the prompt's blocks and write the KT pages
        of the view; with prompt_budget >= N only the KT pages. The impl
        applies every layer's Stage 1 this way, a later layer's choice to the
        layers before it under ``rocketkv.stage1_lead_layer``."""
        n = int(num_prompt_tokens)
        if prompt_budget >= n:
            self.write_kt_pages(k_cache, kt_cache, block_row, 0, n, page_size)
            return
        num_compact = prompt_budget - (n - tail_start)
        self.compact_kept_tokens(k_cache, v_cache, block_row, kept[:, :num_compact])
        self.write_kt_pages(k_cache, kt_cache, block_row, 0, num_compact, page_size)
        self.write_kt_pages(k_cache, kt_cache, block_row, tail_start, n, page_size)


@dataclass
class HsaRows:
    """Stage 2 rows of a step, one token each, the same for every layer:
    the rows' kernel columns and bounds as one ``DecodeRows`` (passed whole
    to every implementation's ``hsa_decode``), and what only the step needs."""

    tokens: torch.Tensor  # [B] index of each row's token in the step
    # block_table, num_compact, tail_start, seq_lens, topk, topr, the bounds
    # max_pages and max_select, and the selection-store columns (sel_slot,
    # reuse: ``rocketkv.reselect_every`` > 1, ``backend.reuse``)
    decode_rows: DecodeRows
    num_select: torch.Tensor  # pages to select: plan.pages_selected(topk)
    # FULL CUDA graph layout (backend.graphs): row b is the step's token b,
    # rows with seq_len 0 are not compressed, the result goes straight into
    # the output (those rows keep the native backend's)
    in_place: bool = False
    prepared: Any = None  # what the implementation derived once per step
    # Stage 2's preallocated scratch (``Stage2.make_workspace``: the builder
    # makes one and hands it to every step; None: the call allocates)
    workspace: Any = None

    def slice(self, a: int, b: int) -> HsaRows:
        """Rows [a, b) with the same bounds and workspace (not prepared)."""
        return HsaRows(
            tokens=self.tokens[a:b],
            decode_rows=self.decode_rows.slice(a, b),
            num_select=self.num_select[a:b],
            workspace=self.workspace,
        )


class Stage2:
    """Stage 2 for one decode token per row (its K/V already in the cache):
    KT update, page choice, sparse attention."""

    name = ""
    # Triton only: eager calls launch at the engine's shape
    # (``backend.graphs.eager_bounds``), not the step's own maxima, so that
    # every kernel specialization is compiled at engine start.
    fixed_shapes = False

    def __init__(self, settings: RocketKVSettings, kv_layout: str) -> None:
        self.settings = settings
        self.kv_layout = kv_layout

    def prepare(self, rows: HsaRows) -> None:
        """Once per step, in the builder (shared by all layers)."""

    def reserve_scratch(
        self,
        device: torch.device,
        max_rows: int,
        num_q_heads: int,
        num_kv_heads: int,
        max_pages: int,
    ) -> None:
        """During vLLM's memory profiling: take the scratch a step may need."""

    def make_workspace(
        self,
        device: torch.device,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        shapes: list[tuple[int, int, int]],
    ) -> Any:
        """Once per engine, in the builder: the scratch every step's
        ``decode`` reuses (``HsaRows.workspace``), for launches up to each
        (rows, max_pages, max_select) of ``shapes``; None where the
        implementation needs none."""
        return None

    def decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        rows: HsaRows,
        scale: float,
        out: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        quant: KVQuant | None = None,
        selections: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [B, Hq, d] -> [B, Hq, d]; with ``out`` (the FULL-graph
        layout) rows with seq_len 0 are left as they are. sinks: the layer's
        [Hq] fp32 sink logits (``algorithm.sinks``), or None; quant: the
        layer's fp8 format and scales when the cache holds fp8 codes.

        selections: the layer's selection store, int32 [S, Hkv, W] (None:
        no reuse, today's launches). Row b with ``rows.decode_rows.reuse[b]``
        nonzero attends the n_use pages at selections[sel_slot[b], h, :n_use]
        instead of scoring and choosing (its KT page is still updated); a
        row with reuse 0 and sel_slot >= 0 writes the n_use pages it chose
        there. n_use is the row's selection size (``pages_selected`` + the
        forced page); the caller (``backend.reuse``) guarantees n_use <= W
        and that a reused entry was written for the same request and view
        page. Every implementation checks the part it reads, per (row, KV
        head): where n_use > W or an entry lies outside [0, the row's view
        pages), that (row, head) does not reuse but chooses and writes its
        pages as a row with reuse 0 does (never a raise, never such a page
        read). The entries' order is the implementation's own."""
        raise NotImplementedError

    def _kt(self, kv_cache):
        return kt_cache_view(kv_cache, self.settings.page_size, self.settings.kt_dtype)


# Scratch (page logits and probabilities, fp32) an eager Stage 2 call may
# take at once; larger batches run in row chunks. vLLM's memory profiling
# sees it: ROCKETKV takes it during the profiling run (``reserve_scratch``).
# The builder's workspace (``make_workspace``) holds this much for eager
# steps, or what the FULL graph's shape needs (made during the capture
# warm-up runs, as the graph-pool scratch was before).
SCRATCH_BYTES = 256 << 20


def scratch_bytes_per_row(num_q_heads: int, num_kv_heads: int, max_pages: int) -> int:
    """Bytes of Stage 2 scratch per decode row: fp32 logits per query head and
    probabilities per KV head for every page (``kernels.hsa_score``,
    ``kernels.page_select``), plus as
    much again per KV head for the split partials and the selection."""
    return 4 * (num_q_heads + 2 * num_kv_heads) * max_pages
