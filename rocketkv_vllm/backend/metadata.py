"""ROCKETKV's attention metadata and its builder.

A step's metadata is the native backend's metadata for the whole batch plus
what ROCKETKV adds for the rows of compressed requests:

- window rows: prompt chunks holding observation-window queries (kept for
  the chunk with the prompt's end; keep_rule snapkv only); score rows: every
  earlier prompt chunk (keep_rule h2o: its scores accumulate, ``backend.h2o``);
- Stage 1 rows: the chunk holding a compressed prompt's last token;
- Stage 2 rows: decode tokens (``decode``), and tokens after a prompt's end
  inside a multi-token chunk (``recompute``: output recomputed after a
  preemption), one at a time.

The native backend sees rows wholly after a compressed prompt with a
``q_len``-token context, so it does next to no work for them; their output
is overwritten by Stage 2. On NVIDIA, one-token decode steps that may replay
a FULL CUDA graph are laid out as the graph was captured (``graphs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.utils.platform_utils import is_pin_memory_available
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)

from rocketkv_vllm.backend import graphs
from rocketkv_vllm.backend.native import native_for_config, native_for_layers
from rocketkv_vllm.backend.reuse import SelectionReuse
from rocketkv_vllm.backend.stages import stage2_for, uses_triton
from rocketkv_vllm.config import settings_for, test_aids_for
from rocketkv_vllm.kernels.rows import DecodeRows
from rocketkv_vllm.ops.base import SCRATCH_BYTES, HsaRows, scratch_bytes_per_row
from rocketkv_vllm.plan import PlanCache, RequestPlan, pages_selected, view_pages
from rocketkv_vllm.state import PromptLengths, worker_state

logger = init_logger(f"vllm.{__name__}")


@dataclass
class PromptChunkRow:
    """A compressed request's prompt chunk that ROCKETKV acts on: one holding
    some observation-window queries (kept for later), or the one holding the
    prompt's last token (Stage 1)."""

    q_start: int
    q_end: int
    context_len: int
    block_row: torch.Tensor
    plan: RequestPlan
    key: int | str  # the request's window-query buffer (stable while it runs)


@dataclass
class RocketKVMetadata:
    native: object  # the native backend's metadata for the whole batch
    num_actual_tokens: int
    window_rows: list[PromptChunkRow] = field(default_factory=list)
    # keep_rule h2o: every prompt chunk before the last (``backend.h2o``)
    score_rows: list[PromptChunkRow] = field(default_factory=list)
    stage1_rows: list[PromptChunkRow] = field(default_factory=list)
    # Tokens after a prompt's end inside a multi-token chunk, in order.
    recompute: list[HsaRows] = field(default_factory=list)
    decode: HsaRows | None = None

    @property
    def adds_work(self) -> bool:
        return bool(
            self.window_rows
            or self.score_rows
            or self.stage1_rows
            or self.recompute
            or self.decode is not None
        )


# The per-row Stage 2 columns, int32, one host-to-device copy per step.
_HSA_COLUMNS = (
    "row",
    "token",
    "num_compact",
    "tail_start",
    "seq_len",
    "topk",
    "topr",
    "num_select",
    "sel_slot",
    "reuse",
)
_NUM_SELECT = _HSA_COLUMNS.index("num_select")
_SEL_SLOT = _HSA_COLUMNS.index("sel_slot")


def _decode_rows(
    c: dict[str, torch.Tensor], block_table: torch.Tensor, max_pages: int, max_select: int
) -> DecodeRows:
    """The kernels' rows from the device columns (``_HSA_COLUMNS``)."""
    return DecodeRows(
        block_table=block_table,
        num_compact=c["num_compact"],
        tail_start=c["tail_start"],
        seq_lens=c["seq_len"],
        topk=c["topk"],
        topr=c["topr"],
        max_pages=max_pages,
        max_select=max_select,
        sel_slot=c["sel_slot"],
        reuse=c["reuse"],
    )


@dataclass
class _Step:
    """One build()'s rows as host arrays (first ``num_reqs`` rows)."""

    qsl: np.ndarray  # query start offsets, num_reqs + 1
    q_lens: np.ndarray
    seq_lens: np.ndarray
    context_lens: np.ndarray
    prompt_lens: np.ndarray
    plans: list[RequestPlan]
    compress: np.ndarray  # rows of compressed requests with tokens this step
    after: np.ndarray  # ... wholly after the prompt
    decode: np.ndarray  # ... one decode token


class RocketKVMetadataBuilder(AttentionMetadataBuilder[RocketKVMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec) -> AttentionCGSupport:
        """FULL graphs for one-token decode steps with the Triton kernels on
        CUDA (``graphs``); never elsewhere (the CPU build has none)."""
        from vllm.platforms import current_platform

        if not (uses_triton(settings_for(vllm_config)) and current_platform.is_cuda_alike()):
            return AttentionCGSupport.NEVER
        # Asked before the layers are known: the lesser of both native choices.
        natives = [native_for_config(vllm_config, sink).backend for sink in (False, True)]
        return min(
            *(
                n.get_builder_cls().get_cudagraph_support(vllm_config, kv_cache_spec)
                for n in natives
            ),
            AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
            key=lambda level: level.value,
        )

    def __init__(self, kv_cache_spec, layer_names, vllm_config: VllmConfig, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.settings = settings_for(vllm_config)
        native = native_for_layers(vllm_config, layer_names)
        self.native = native.backend.get_builder_cls()(
            kv_cache_spec, layer_names, vllm_config, device
        )
        self.reorder_batch_threshold = self.native.reorder_batch_threshold
        self.stage2 = stage2_for(self.settings, native.kv_layout)
        self.state = worker_state(vllm_config)
        self.prompt_lengths = PromptLengths(self.state.requests)
        self.plans = PlanCache(self.settings)
        # Host staging for the per-step Stage 2 columns comes from torch's
        # caching pinned allocator, which does not hand a buffer out again
        # before its non-blocking copy has run.
        self._pin = is_pin_memory_available() and torch.device(device).type == "cuda"
        self._graph_ready = False
        self.graph: graphs.DecodeGraphShape | None = None
        self.graph_buffers: graphs.GraphBuffers | None = None
        # Stage 2's scratch, made once at the first Stage 2 step (after the
        # graph decision) and handed to every step: no per-step allocation
        self._workspace_ready = False
        self.workspace = None
        self._shape: graphs.DecodeGraphShape | None = None
        # Which decode rows reuse their page selection (reselect_every > 1)
        self.reuse: SelectionReuse | None = None
        if self.settings.reselect_every > 1:
            self.reuse = SelectionReuse(
                self.settings.reselect_every,
                self.settings.page_size,
                vllm_config.scheduler_config.max_num_seqs,
                graphs.selection_width(self.settings, vllm_config.model_config.max_model_len),
            )

    # -- the step -----------------------------------------------------------

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> RocketKVMetadata:
        cm = common_attn_metadata
        native_cm = cm
        md = RocketKVMetadata(native=None, num_actual_tokens=cm.num_actual_tokens)
        graph = self._graph_for(cm)
        prompt_lens = None if cm.num_reqs == 0 else self.prompt_lengths.get(cm, self._num_reqs(cm))
        if prompt_lens is None:
            # Dummy / capture batches carry no requests: all dense.
            if graph is not None:
                return self._graph_step(
                    md,
                    common_prefix_len,
                    cm,
                    native_cm,
                    fast_build,
                    np.zeros(0, np.int64),
                    np.zeros((len(_HSA_COLUMNS), 0), np.int32),
                )
            md.native = self.native.build(common_prefix_len, native_cm, fast_build)
            return md

        step = self._step(cm, prompt_lens)
        rows = np.flatnonzero(step.decode)
        selection = self._selection_reuse(cm, step, rows)
        if graph is not None and not (step.compress & ~step.decode).any():
            # (A prompt chunk, where Stage 1 runs in Python, or a selection
            # larger than the captured one: the runner hooks keep such a step
            # off FULL graphs (GraphGuard.needs_eager); it runs eagerly.)
            columns = self._columns(rows, rows, step.seq_lens[rows], step.plans, selection)
            if not rows.size or graph.takes(int(columns[_NUM_SELECT].max())):
                return self._graph_step(
                    md, common_prefix_len, cm, native_cm, fast_build, rows, columns
                )
        if not step.compress.any():
            md.native = self.native.build(common_prefix_len, native_cm, fast_build)
            return md
        self._prompt_rows(md, cm, step)
        if rows.size:
            md.decode = self._hsa_rows(
                rows,
                step.qsl[rows],
                step.seq_lens[rows],
                step.plans,
                cm.block_table_tensor,
                selection,
            )
            self.state.counters.decode_tokens_compressed += int(rows.size)
        neutral = np.flatnonzero(step.after)
        if neutral.size:
            # Rows wholly after a compressed prompt: the native call attends
            # over a q_len-token context only (output overwritten here).
            # One pinned copy: rows and their lengths.
            rows_lens = self._staged(np.stack([neutral, step.q_lens[neutral]]).astype(np.int64))
            idx, lens = rows_lens.to(cm.seq_lens.device, non_blocking=True)
            seq = cm.seq_lens.clone()
            seq[idx] = lens.to(seq.dtype)
            native_cm = native_cm.replace(
                seq_lens=seq,
                seq_lens_cpu_upper_bound=self._upper_bound_with(
                    cm, neutral, torch.from_numpy(step.q_lens[neutral])
                ),
            )
        md.native = self.native.build(common_prefix_len, native_cm, fast_build)
        return md

    @staticmethod
    def _num_reqs(cm: CommonAttentionMetadata) -> int:
        # Under Model Runner V2 a FULL graph's batch is padded past the
        # requests (req_idx): the padding rows are never compressed.
        return cm.num_reqs if cm.req_idx is None else min(cm.num_reqs, len(cm.req_idx))

    def _step(self, cm: CommonAttentionMetadata, prompt_lens: np.ndarray) -> _Step:
        num_reqs = len(prompt_lens)
        qsl = cm.query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int64)
        q_lens = np.diff(qsl)
        seq_src = (
            cm.seq_lens_cpu_upper_bound if cm.seq_lens_cpu_upper_bound is not None else cm.seq_lens
        )
        seq_lens = seq_src[:num_reqs].cpu().numpy().astype(np.int64)
        context_lens = seq_lens - q_lens
        budgets = self.state.requests.budgets_for_rows(cm)[:num_reqs]
        plans = [self.plans(n, b) for n, b in zip(prompt_lens.tolist(), budgets)]
        compress = np.array([p.compress for p in plans], dtype=bool) & (q_lens > 0)
        after = compress & (context_lens >= prompt_lens)
        return _Step(
            qsl,
            q_lens,
            seq_lens,
            context_lens,
            prompt_lens,
            plans,
            compress,
            after,
            after & (q_lens == 1),
        )

    def _prompt_rows(self, md: RocketKVMetadata, cm: CommonAttentionMetadata, step: _Step) -> None:
        """Window and Stage 1 rows of prompt chunks, and one Stage 2 row per
        token after a prompt's end in a multi-token chunk."""
        w, rule = self.settings.window_size, self.settings.keep_rule
        block_table = cm.block_table_tensor
        counters = self.state.counters
        for i in np.flatnonzero(step.compress & ~step.decode).tolist():
            plan, n = step.plans[i], int(step.prompt_lens[i])
            q_start, q_end = int(step.qsl[i]), int(step.qsl[i + 1])
            context_len = int(step.context_lens[i])
            if not step.after[i]:
                row = PromptChunkRow(
                    q_start, q_end, context_len, block_table[i], plan, self._window_key(cm, i)
                )
                if step.seq_lens[i] < n:
                    if rule == "h2o":  # every prompt query scores (when it evicts)
                        if plan.prompt_budget < n:
                            md.score_rows.append(row)
                    elif rule == "snapkv" and step.seq_lens[i] > n - w:
                        md.window_rows.append(row)
                    continue
                md.stage1_rows.append(row)
                counters.prompts_compressed += 1
                counters.prompt_tokens_evicted += n - plan.prompt_budget
            for t in range(q_start + max(0, n - context_len), q_end):
                md.recompute.append(
                    self._hsa_rows(
                        np.array([i]),
                        np.array([t]),
                        np.array([step.seq_lens[i] - (q_end - 1 - t)]),
                        step.plans,
                        block_table,
                    )
                )

    @staticmethod
    def _upper_bound_with(cm: CommonAttentionMetadata, rows: np.ndarray, lens):
        if cm.seq_lens_cpu_upper_bound is None:
            return None
        upper = cm.seq_lens_cpu_upper_bound.clone()
        upper[torch.from_numpy(rows)] = torch.as_tensor(lens, dtype=upper.dtype)
        return upper

    def _selection_reuse(
        self, cm: CommonAttentionMetadata, step: _Step, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(sel_slot, reuse) of the decode ``rows`` (``backend.reuse``), None
        without reuse; the step's other compressed rows forget their
        requests' stored selections."""
        if self.reuse is None:
            return None
        for i in np.flatnonzero(step.compress & ~step.decode).tolist():
            self.reuse.forget(self._request_key(cm, i))
        ps, extra = self.settings.page_size, int(self.settings.force_current_page)
        slots, reuse = self.reuse.plan(
            [self._request_key(cm, i) for i in rows.tolist()],
            step.seq_lens[rows],
            np.array([step.plans[i].pages_selected(ps) + extra for i in rows], dtype=np.int64),
        )
        self.state.counters.decode_selections_reused += int(reuse.sum())
        return slots, reuse

    def _request_key(self, cm: CommonAttentionMetadata, i: int):
        """Row i's request, unique for its lifetime (V2: its slot and the
        slot's generation; V1: its id), or None when not known."""
        requests = self.state.requests
        if cm.req_idx is not None:
            slot = int(cm.req_idx[i])
            return (slot, requests.v2_generation.get(slot, 0))
        row_ids = requests.row_ids
        return row_ids[i] if i < len(row_ids) else None

    def _window_key(self, cm: CommonAttentionMetadata, i: int) -> int | str:
        # V2: the request's slot; V1: its id (the runner hook's row order).
        # Not a block id: with prefix caching requests may share blocks.
        if cm.req_idx is not None:
            return int(cm.req_idx[i])
        row_ids = self.state.requests.row_ids
        if i < len(row_ids) and row_ids[i] is not None:
            return row_ids[i]
        return f"row{i}"

    # -- Stage 2 rows -------------------------------------------------------

    def _columns(
        self,
        rows: np.ndarray,
        tokens: np.ndarray,
        seq_lens: np.ndarray,
        plans: list[RequestPlan],
        selection: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """The Stage 2 columns (_HSA_COLUMNS) of these batch rows, int32;
        selection: their (sel_slot, reuse), else no slot."""
        chosen = [plans[i] for i in rows]
        topk = np.array([p.topk for p in chosen], dtype=np.int64)
        if selection is None:
            selection = (np.full(len(rows), -1), np.zeros(len(rows)))
        columns = {
            "row": rows,
            "token": tokens,
            "num_compact": np.array([p.num_compact for p in chosen], dtype=np.int64),
            "tail_start": np.array([p.tail_start for p in chosen], dtype=np.int64),
            "seq_len": seq_lens,
            "topk": topk,
            "topr": np.array([p.topr for p in chosen], dtype=np.int64),
            "num_select": pages_selected(topk, self.settings.page_size),
            "sel_slot": selection[0],
            "reuse": selection[1],
        }
        return np.stack([columns[name] for name in _HSA_COLUMNS]).astype(np.int32)

    def _staged(self, columns: np.ndarray) -> torch.Tensor:
        staging = torch.from_numpy(columns)
        return staging.pin_memory() if self._pin else staging

    def _hsa_rows(
        self,
        rows: np.ndarray,
        tokens: np.ndarray,
        seq_lens: np.ndarray,
        plans: list[RequestPlan],
        block_table: torch.Tensor,
        selection: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> HsaRows:
        """Stage 2 rows: batch rows, each one's token index in the step and
        seq_len including that token, and their (sel_slot, reuse). One
        host-to-device copy."""
        columns = self._columns(rows, tokens, seq_lens, plans, selection)
        c = self._device_columns(columns, block_table.device)
        host = dict(zip(_HSA_COLUMNS, columns.astype(np.int64)))
        max_select = int(host["num_select"].max())
        if self.stage2.fixed_shapes:
            max_pages, max_select = graphs.eager_bounds(self._engine_shape(), max_select)
        else:
            max_pages = int(
                view_pages(
                    host["num_compact"],
                    host["tail_start"],
                    host["seq_len"],
                    self.settings.page_size,
                ).max()
            )
        hsa = HsaRows(
            tokens=c["token"].long(),
            decode_rows=_decode_rows(c, block_table[c["row"].long()], max_pages, max_select),
            num_select=c["num_select"],
            workspace=self._workspace(),
        )
        self.stage2.prepare(hsa)
        return hsa

    def _device_columns(self, columns: np.ndarray, device) -> dict[str, torch.Tensor]:
        """The columns on the device, one copy, each column's start 16-byte
        aligned whatever the row count (Triton specializes a kernel on the
        alignment of its pointers: ``backend.warmup``)."""
        n = columns.shape[1]
        padded = np.zeros((columns.shape[0], graphs.aligned_rows(n)), dtype=np.int32)
        padded[:, :n] = columns
        col = self._staged(padded).to(device, non_blocking=True)
        return {name: col[i, :n] for i, name in enumerate(_HSA_COLUMNS)}

    def _engine_shape(self) -> graphs.DecodeGraphShape:
        if self._shape is None:
            self._shape = graphs.shape_for(
                self.settings, self.vllm_config.model_config.max_model_len, 1
            )
        return self._shape

    def _workspace(self):
        """Stage 2's workspace (``Stage2.make_workspace``), made at the
        first Stage 2 step for the FULL graph's launch shape and for the
        eager steps' (their row chunks of ``SCRATCH_BYTES``, at the engine's
        shape: ``graphs.eager_bounds``)."""
        if self._workspace_ready:
            return self.workspace
        self._workspace_ready = True
        spec, config = self.kv_cache_spec, self.vllm_config
        num_q_heads = config.model_config.get_num_attention_heads(config.parallel_config)
        # the engine's largest view and selection (a request's own budget may
        # select more: such a step allocates its scratch)
        widest = self._engine_shape()
        max_pages, max_select = widest.max_pages, widest.max_select
        per_row = scratch_bytes_per_row(num_q_heads, spec.num_kv_heads, max_pages)
        rows = min(config.scheduler_config.max_num_seqs, max(1, SCRATCH_BYTES // per_row))
        shapes = [(rows, max_pages, max_select)]
        if self.graph is not None:
            g = self.graph
            shapes.insert(0, (g.rows, g.max_pages, g.max_select))
        self.workspace = self.stage2.make_workspace(
            self.device, num_q_heads, spec.num_kv_heads, spec.head_size, shapes
        )
        if self.workspace is not None:
            logger.info_once(
                "ROCKETKV: Stage 2 workspace of %.1f MiB (no allocation per step).",
                self.workspace.nbytes / 2**20,
            )
        return self.workspace

    # -- FULL CUDA graph layout ----------------------------------------------

    def _graph_for(self, cm: CommonAttentionMetadata):
        """The FULL-graph shape when this step may replay a graph (one token
        per row, a captured batch size), else None. Decided at the first
        build, when vLLM's graph mode is final; the persistent buffers are
        made then."""
        if not self._graph_ready:
            self._graph_ready = True
            self.graph = graphs.decode_graph_shape(
                self.vllm_config,
                self.settings,
                uses_triton(self.settings),
                test_aids_for(self.vllm_config),
            )
            if self.graph is not None:
                rows = self.graph.rows
                self.graph_buffers = graphs.GraphBuffers(rows, len(_HSA_COLUMNS), self.device)
                self.state.graph_guard = graphs.GraphGuard(self.graph, self.settings.page_size)
                logger.info_once(
                    "ROCKETKV: decode steps replay FULL CUDA graphs (Stage 2 "
                    "shaped for %d rows, %d view pages, %d selected pages).",
                    rows,
                    self.graph.max_pages,
                    self.graph.max_select,
                )
        g = self.graph
        if g is None or cm.max_query_len != 1 or not 0 < cm.num_reqs <= g.rows:
            return None
        return g

    def _graph_step(
        self,
        md: RocketKVMetadata,
        common_prefix_len: int,
        cm: CommonAttentionMetadata,
        native_cm,
        fast_build: bool,
        rows: np.ndarray,
        columns: np.ndarray,
    ) -> RocketKVMetadata:
        """A one-token-per-row step laid out as its FULL graph was captured:
        Stage 2 over every batch row, the compressed ``rows`` (their
        ``_columns``) active, all per-step values in the persistent buffers."""
        batch = cm.num_reqs
        every_row = np.zeros((len(_HSA_COLUMNS), batch), dtype=np.int32)
        every_row[_SEL_SLOT] = -1
        every_row[:, rows] = columns
        self.state.counters.decode_tokens_compressed += int(rows.size)
        buffers = self.graph_buffers
        col = buffers.columns[:, :batch]
        col.copy_(self._staged(every_row), non_blocking=True)
        c = dict(zip(_HSA_COLUMNS, col))
        # The native call sees compressed rows with a one-token context.
        native_seq = buffers.native_seq_lens[:batch]
        native_seq.copy_(cm.seq_lens[:batch])
        native_seq.masked_fill_(c["seq_len"] > 0, 1)
        native_cm = native_cm.replace(
            seq_lens=native_seq, seq_lens_cpu_upper_bound=self._upper_bound_with(cm, rows, 1)
        )
        md.native = self.native.build(common_prefix_len, native_cm, fast_build)
        g = self.graph
        md.decode = HsaRows(
            tokens=buffers.tokens[:batch],
            decode_rows=_decode_rows(c, cm.block_table_tensor[:batch], g.max_pages, g.max_select),
            num_select=c["num_select"],
            in_place=True,
            workspace=self._workspace(),
        )
        return md
