"""Stage 1 and Stage 2, each behind one interface, chosen once per engine.

Stage 1 (SnapKV compaction of one prompt at the end of its prefill) has two
implementations: the Triton kernels (``ops.triton``, NVIDIA) and PyTorch
(``ops.pytorch``); ``stage1_for`` picks one. Stage 2 (HSA decode over a
batch of rows) has three: the Triton kernels, the C++ kernel on CPU
(``ops.cpu``) and batched PyTorch (``ops.pytorch``, the CPU fallback);
``stage2_for`` picks one. The impl calls both the same way:
``stage1.compress(...)`` per prompt, ``stage2.decode(...)`` per step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from vllm.logger import init_logger

from rocketkv_vllm.algorithm.snapkv import keep_positions_from_scores
from rocketkv_vllm.config import RocketKVSettings
from rocketkv_vllm.fp8_kv import KVQuant
from rocketkv_vllm.layout import kt_cache_view, split_kv
from rocketkv_vllm.ops import pytorch as torch_ops

logger = init_logger(f"vllm.{__name__}")


class Stage1:
    """SnapKV compaction of one prompt on the paged cache: window scores,
    kept positions, the per-head compaction, the KT pages of the view. The
    steps come from ``ops`` (a module of ``rocketkv_vllm.ops``); the choice
    of kept positions is the algorithm's own (``algorithm.snapkv``)."""

    name = ""

    @property
    def ops(self):
        raise NotImplementedError

    def compress(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kt_cache: torch.Tensor,
        block_row: torch.Tensor,
        q_window: torch.Tensor,
        num_prompt_tokens: int,
        prompt_budget: int,
        tail_start: int,
        kernel_size: int,
        page_size: int,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Choose, compact, build KT for one request (its oracle:
        ``paged.snapkv_compress``, same arguments; sinks: the layer's [Hq]
        fp32 sink logits, in the window scores' softmax). Returns the kept
        positions [Hkv, prompt_budget]; with prompt_budget >= the prompt
        every position is kept and only the KT pages are written. Ties among
        pooled scores may be broken differently by the Triton kernels than by
        torch's CPU topk, so kept sets can differ on plateaus."""
        ops = self.ops
        n = int(num_prompt_tokens)
        if prompt_budget >= n:  # rocketkv.evict=false: identity, KT pages only
            ops.write_kt_pages(k_cache, kt_cache, block_row, 0, n, page_size)
            return torch.arange(n, device=k_cache.device).expand(k_cache.shape[1], n)
        scores = ops.window_scores(q_window, k_cache, block_row, n, scale, sinks=sinks)
        kept = keep_positions_from_scores(
            scores,
            n,
            prompt_budget,
            kernel_size,
            protect_from=min(n - q_window.shape[0], tail_start),
        )
        num_compact = prompt_budget - (n - tail_start)
        ops.compact_kept_tokens(k_cache, v_cache, block_row, kept[:, :num_compact])
        ops.write_kt_pages(k_cache, kt_cache, block_row, 0, num_compact, page_size)
        ops.write_kt_pages(k_cache, kt_cache, block_row, tail_start, n, page_size)
        return kept


class TritonStage1(Stage1):
    name = "Triton kernels"

    @property
    def ops(self):
        from rocketkv_vllm.ops import triton as triton_ops

        return triton_ops


class TorchStage1(Stage1):
    name = "PyTorch path"

    @property
    def ops(self):
        return torch_ops


@functools.cache
def stage1_for(settings: RocketKVSettings) -> Stage1:
    """The engine's Stage 1: the Triton kernels with Triton's Stage 2, else
    PyTorch."""
    impl: Stage1 = TritonStage1() if uses_triton(settings) else TorchStage1()
    logger.info_once("ROCKETKV: Stage 1 runs in the %s.", impl.name)
    return impl


@dataclass
class HsaRows:
    """Stage 2 rows of a step, one token each, the same for every layer:
    each row's plan columns as device tensors."""

    tokens: torch.Tensor  # [B] index of each row's token in the step
    block_table: torch.Tensor  # [B, max_blocks]
    num_compact: torch.Tensor  # [B] int32
    tail_start: torch.Tensor
    seq_lens: torch.Tensor  # including the token
    topk: torch.Tensor
    topr: torch.Tensor
    num_select: torch.Tensor  # pages to select: plan.pages_selected(topk)
    max_pages: int  # >= every row's view page count
    max_select: int  # >= every num_select
    # FULL CUDA graph layout (backend.graphs): row b is the step's token b,
    # rows with seq_len 0 are not compressed, the result goes straight into
    # the output (those rows keep the native backend's)
    in_place: bool = False
    prepared: Any = None  # what the implementation derived once per step
    # Stage 2's preallocated scratch (``Stage2.make_workspace``: the builder
    # makes one and hands it to every step; None: the call allocates)
    workspace: Any = None


class Stage2:
    """Stage 2 for one decode token per row (its K/V already in the cache):
    KT update, page choice, sparse attention."""

    name = ""
    # Triton only: fewer distinct launch shapes (kernel specializations).
    pow2_shapes = False

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
    ) -> torch.Tensor:
        """query [B, Hq, d] -> [B, Hq, d]; with ``out`` (the FULL-graph
        layout) rows with seq_len 0 are left as they are. sinks: the layer's
        [Hq] fp32 sink logits (``algorithm.sinks``), or None; quant: the
        layer's fp8 format and scales when the cache holds fp8 codes."""
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
    probabilities per KV head for every page (``kernels.hsa_score``), plus as
    much again per KV head for the split partials and the selection."""
    return 4 * (num_q_heads + 2 * num_kv_heads) * max_pages


class TritonStage2(Stage2):
    name = "Triton kernels"
    pow2_shapes = True

    def decode(self, query, kv_cache, rows, scale, out=None, sinks=None, quant=None):
        if out is not None:  # FULL-graph layout: one call, shapes fixed at capture
            return self._decode(query, kv_cache, rows, scale, out, sinks, quant)
        per_row = scratch_bytes_per_row(query.shape[1], kv_cache.shape[1], rows.max_pages)
        chunk = max(1, SCRATCH_BYTES // per_row)
        if rows.workspace is not None:  # chunks the workspace serves
            chunk = min(chunk, rows.workspace.rows)
        batch = query.shape[0]
        if batch <= chunk:
            return self._decode(query, kv_cache, rows, scale, None, sinks, quant)
        parts = [
            self._decode(
                query[a : a + chunk],
                kv_cache,
                _row_slice(rows, a, a + chunk),
                scale,
                None,
                sinks,
                quant,
            )
            for a in range(0, batch, chunk)
        ]
        return torch.cat(parts)

    def _decode(self, query, kv_cache, rows, scale, out, sinks, quant):
        from rocketkv_vllm.ops import triton as triton_ops

        s = self.settings
        k_cache, v_cache = split_kv(kv_cache, self.kv_layout, quant)
        return triton_ops.hsa_decode(
            query,
            k_cache,
            v_cache,
            self._kt(kv_cache),
            rows.block_table,
            rows.num_compact,
            rows.tail_start,
            rows.seq_lens,
            rows.topk,
            rows.topr,
            s.page_size,
            scale,
            rows.max_pages,
            rows.max_select,
            s.force_current_page,
            out=out,
            sinks=sinks,
            workspace=rows.workspace,
        )

    def make_workspace(self, device, num_q_heads, num_kv_heads, head_dim, shapes):
        """One ``ops.triton.DecodeWorkspace`` covering every shape (the
        FULL graph's, the eager steps'): page logits, split partials,
        candidates, selection, attention partials, merge counters."""
        from rocketkv_vllm.ops import triton as triton_ops

        (rows, max_pages, max_select), *others = shapes
        return triton_ops.DecodeWorkspace(
            device,
            rows,
            num_q_heads,
            num_kv_heads,
            head_dim,
            max_pages,
            max_select,
            self.settings.force_current_page,
            also=others,
        )

    def reserve_scratch(
        self,
        device: torch.device,
        max_rows: int,
        num_q_heads: int,
        num_kv_heads: int,
        max_pages: int,
    ) -> None:
        """Take (and give back to torch's caching allocator) the most scratch
        an eager step can use, so vLLM's memory profiling counts it."""
        per_row = scratch_bytes_per_row(num_q_heads, num_kv_heads, max_pages)
        nbytes = min(SCRATCH_BYTES, per_row * max_rows) if max_rows else 0
        if nbytes and device.type == "cuda":
            scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
            del scratch  # back to the allocator's cache, counted in the peak


def _row_slice(rows: HsaRows, a: int, b: int) -> HsaRows:
    return HsaRows(
        tokens=rows.tokens[a:b],
        block_table=rows.block_table[a:b],
        num_compact=rows.num_compact[a:b],
        tail_start=rows.tail_start[a:b],
        seq_lens=rows.seq_lens[a:b],
        topk=rows.topk[a:b],
        topr=rows.topr[a:b],
        num_select=rows.num_select[a:b],
        max_pages=rows.max_pages,
        max_select=rows.max_select,
        workspace=rows.workspace,
    )


class CpuStage2(Stage2):
    name = "native CPU kernel"

    def decode(self, query, kv_cache, rows, scale, out=None, sinks=None, quant=None):
        from rocketkv_vllm.ops import cpu as cpu_ops

        assert out is None, "the FULL-graph layout runs the Triton kernels only"
        s = self.settings
        return cpu_ops.hsa_decode(
            query,
            kv_cache,
            self._kt(kv_cache),
            self.kv_layout,
            rows.block_table,
            rows.num_compact,
            rows.tail_start,
            rows.seq_lens,
            rows.topr,
            rows.num_select,
            s.page_size,
            scale,
            s.force_current_page,
            sinks=sinks,
            quant=quant,
        )


class TorchStage2(Stage2):
    name = "batched PyTorch path"

    def prepare(self, rows):
        s = self.settings
        rows.prepared = torch_ops.view_pages(
            rows.block_table,
            rows.num_compact,
            rows.tail_start,
            rows.seq_lens,
            s.page_size,
            s.block_size,
            rows.max_pages,
        )

    def decode(self, query, kv_cache, rows, scale, out=None, sinks=None, quant=None):
        assert out is None, "the FULL-graph layout runs the Triton kernels only"
        s = self.settings
        k_cache, v_cache = split_kv(kv_cache, self.kv_layout, quant)
        return torch_ops.hsa_decode(
            query,
            k_cache,
            v_cache,
            self._kt(kv_cache),
            rows.block_table,
            rows.seq_lens,
            rows.prepared,
            rows.topr,
            rows.num_select,
            rows.max_select,
            s.page_size,
            scale,
            s.force_current_page,
            sinks=sinks,
        )


def uses_triton(settings: RocketKVSettings) -> bool:
    """Triton kernels on NVIDIA GPUs (or anywhere when forced), else CPU."""
    if settings.kernel != "auto":
        return settings.kernel == "triton"
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


@functools.cache
def stage2_for(settings: RocketKVSettings, kv_layout: str) -> Stage2:
    """The engine's Stage 2: Triton where it runs, on CPU the C++ kernel for
    CPU_ATTN's layouts with kernel 'auto' (if it builds here), else PyTorch.
    Every implementation reads fp8 caches."""
    from rocketkv_vllm.ops import cpu as cpu_ops

    if uses_triton(settings):
        if kv_layout == "cpu_amx":
            raise ValueError(
                "rocketkv.kernel='triton' is invalid with CPU_ATTN's AMX cache layout "
                "(bf16, block_size a multiple of 32): allowed 'auto' or 'torch', or "
                "block_size 16"
            )
        impl: Stage2 = TritonStage2(settings, kv_layout)
    elif settings.kernel == "auto" and kv_layout in cpu_ops.LAYOUT_CODES:
        error = cpu_ops.build_error()
        if error is None:
            impl = CpuStage2(settings, kv_layout)
        else:
            logger.warning(
                "ROCKETKV: the native CPU Stage 2 kernel is unavailable "
                "(%s); decoding with the slower PyTorch path.",
                error,
            )
            impl = TorchStage2(settings, kv_layout)
    else:
        impl = TorchStage2(settings, kv_layout)
    logger.info_once("ROCKETKV: Stage 2 runs in the %s.", impl.name)
    return impl
