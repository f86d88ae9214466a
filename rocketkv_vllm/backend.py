"""The ROCKETKV attention backend: backend class, metadata, builder, impl.

Per request and step (see ``config.plan_request`` for the per-request plan):
- prompt not longer than its budget: exact dense attention, always;
- prefill chunks before the prompt's end: dense attention; queries that fall
  into the observation window are kept for Stage 1;
- the chunk holding the last prompt token: dense attention for the prompt
  part, then Stage 1 (select, compact onto the first blocks, build KT pages)
  in this same step, since the scheduler hands the freed blocks to other
  requests from the next step on;
- later tokens (decode, or recomputed output tokens after a preemption):
  Stage 2 (HSA) over the compacted tokens plus the tail, one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from rocketkv_vllm import paged
from rocketkv_vllm.config import RequestPlan, RocketKVSettings, max_topk, plan_request
from rocketkv_vllm.engine_config import (
    process_settings,
    settings_from_vllm_config,
    uses_triton,
)
from rocketkv_vllm.kv_cache import make_rocketkv_spec

# Under the "vllm" logger so records show with vLLM's own formatting.
logger = init_logger(f"vllm.{__name__}")


class RocketKVBackend(AttentionBackend):
    # vLLM's own selection machinery knows this backend as CUSTOM (see plugin).
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float16, torch.bfloat16, torch.float32,
    ]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[RocketKVImpl]:
        return RocketKVImpl

    @staticmethod
    def get_builder_cls() -> type[RocketKVMetadataBuilder]:
        return RocketKVMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [64, 128]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_rswa(cls) -> bool:
        # We receive per-request prompt lengths through vLLM's R-SWA field;
        # real R-SWA models are refused at startup (engine_config).
        return True

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        return make_rocketkv_spec(spec, process_settings())


@dataclass
class RowPlan:
    """One request's part of a step."""

    row: int  # index into the block table
    q_start: int
    q_end: int
    context_len: int  # tokens already in the cache before this step
    seq_len: int
    plan: RequestPlan


@dataclass
class DecodeBatch:
    """Single-token rows decoded together: one token per row, row order."""

    rows: list[RowPlan]
    tokens: torch.Tensor  # [B] index of each row's token in the step
    block_table: torch.Tensor  # [B, max_blocks]
    seq_lens: torch.Tensor  # [B] including the new token
    num_compact: torch.Tensor  # [B] (compressed batch only)
    tail_start: torch.Tensor
    topk: torch.Tensor
    topr: torch.Tensor


@dataclass
class RocketKVMetadata:
    num_actual_tokens: int
    max_seq_len: int
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    positions: torch.Tensor  # [num_actual_tokens] logical position of each token
    rows: list[RowPlan] = field(default_factory=list)  # not in a batch below
    hsa_batch: DecodeBatch | None = None  # compressed requests, decoding
    dense_batch: DecodeBatch | None = None  # uncompressed requests, decoding


def _is_decode(r: RowPlan) -> bool:
    return r.q_end - r.q_start == 1 and r.context_len >= r.plan.num_prompt_tokens


class RocketKVMetadataBuilder(AttentionMetadataBuilder[RocketKVMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config: VllmConfig, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.settings: RocketKVSettings = settings_from_vllm_config(vllm_config)
        self._plans: dict[int, RequestPlan] = {}

    def _plan(self, num_prompt_tokens: int) -> RequestPlan:
        plan = self._plans.get(num_prompt_tokens)
        if plan is None:
            plan = plan_request(self.settings, num_prompt_tokens)
            self._plans[num_prompt_tokens] = plan
        return plan

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> RocketKVMetadata:
        cm = common_attn_metadata
        if cm.rswa_prefix_lens is None:
            raise RuntimeError(
                "ROCKETKV needs per-request prompt lengths, but vLLM passed none: "
                "was the engine configured through the rocketkv_vllm plugin?"
            )
        num_reqs = cm.num_reqs
        qsl = cm.query_start_loc_cpu[: num_reqs + 1].tolist()
        seq_lens = (
            cm.seq_lens_cpu_upper_bound
            if cm.seq_lens_cpu_upper_bound is not None
            else cm.seq_lens
        )[:num_reqs].tolist()
        prompt_lens = cm.rswa_prefix_lens[:num_reqs].tolist()
        rows = []
        for i in range(num_reqs):
            q_start, q_end = qsl[i], qsl[i + 1]
            if q_end == q_start:
                continue  # padding row
            rows.append(RowPlan(
                row=i,
                q_start=q_start,
                q_end=q_end,
                context_len=seq_lens[i] - (q_end - q_start),
                seq_len=seq_lens[i],
                plan=self._plan(int(prompt_lens[i])),
            ))
        device = cm.block_table_tensor.device
        positions = torch.empty(cm.num_actual_tokens, dtype=torch.long)
        for r in rows:
            positions[r.q_start : r.q_end] = torch.arange(r.context_len, r.seq_len)
        hsa_rows = [r for r in rows if _is_decode(r) and r.plan.compress]
        dense_rows = [r for r in rows if _is_decode(r) and not r.plan.compress]
        return RocketKVMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            max_seq_len=cm.max_seq_len,
            slot_mapping=cm.slot_mapping,
            block_table=cm.block_table_tensor,
            positions=positions.to(device),
            rows=[r for r in rows if not _is_decode(r)],
            hsa_batch=self._batch(hsa_rows, cm.block_table_tensor),
            dense_batch=self._batch(dense_rows, cm.block_table_tensor),
        )

    @staticmethod
    def _batch(rows: list[RowPlan], block_table: torch.Tensor) -> DecodeBatch | None:
        if not rows:
            return None
        device = block_table.device

        def col(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(device)

        return DecodeBatch(
            rows=rows,
            tokens=col([r.q_start for r in rows]).long(),
            block_table=block_table[col([r.row for r in rows]).long()],
            seq_lens=col([r.seq_len for r in rows]),
            num_compact=col([r.plan.num_compact for r in rows]),
            tail_start=col([r.plan.tail_start for r in rows]),
            topk=col([r.plan.topk for r in rows]),
            topr=col([r.plan.topr for r in rows]),
        )


class RocketKVImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes is not None,
            "sliding_window": sliding_window is not None,
            "logits_soft_cap": bool(logits_soft_cap),
            "attention sinks": sinks is not None,
            "KV sharing across layers": kv_sharing_target_layer_name is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
        }
        bad = [name for name, used in unsupported.items() if used]
        if bad:
            raise NotImplementedError(f"ROCKETKV does not support: {', '.join(bad)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        vllm_config = get_current_vllm_config()
        self.settings = s = settings_from_vllm_config(vllm_config)
        self.use_triton = uses_triton(s)
        self._ops = paged
        if self.use_triton:
            from rocketkv_vllm import triton_ops

            self._ops = triton_ops
        # Fixed per engine so the decode launch shapes never depend on data.
        self.max_pages = cdiv(vllm_config.model_config.max_model_len, s.page_size) + 1
        self.max_select = max(max_topk(s) // s.page_size, 1)
        # Window queries of a prompt whose window spans several prefill
        # chunks, keyed by the request's first block id (stable while the
        # request holds its blocks), until the chunk with the prompt's end.
        self._window_queries: dict[int, torch.Tensor] = {}

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: RocketKVMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("ROCKETKV does not fuse output quantization")
        if attn_metadata is None:  # profiling run
            return output
        s = self.settings
        n = attn_metadata.num_actual_tokens
        query = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        key = key[:n].view(n, self.num_kv_heads, self.head_size)
        value = value[:n].view(n, self.num_kv_heads, self.head_size)
        kt_cache = paged.kt_cache_view(kv_cache, s.page_size)
        paged.write_kv(kv_cache, key, value, attn_metadata.slot_mapping[:n])

        for r in attn_metadata.rows:
            self._prefill_row(r, attn_metadata, query, out, kv_cache, kt_cache)
        if attn_metadata.hsa_batch is not None:
            self._decode_compressed(attn_metadata.hsa_batch, query, out, kv_cache,
                                    kt_cache)
        if attn_metadata.dense_batch is not None:
            self._decode_dense(attn_metadata.dense_batch, attn_metadata.max_seq_len,
                               query, out, kv_cache)
        return output

    def _prefill_row(self, r: RowPlan, md, query, out, kv_cache, kt_cache) -> None:
        """A request with several new tokens, or any token of a prompt."""
        s = self.settings
        block_row = md.block_table[r.row]
        positions = md.positions[r.q_start : r.q_end]
        q = query[r.q_start : r.q_end]
        plan = r.plan
        n_prompt = plan.num_prompt_tokens
        if not plan.compress or r.seq_len < n_prompt:
            # Dense: short prompts always, long prompts until their end.
            out[r.q_start : r.q_end] = paged.dense_attention(
                q, positions, kv_cache, block_row, r.seq_len, self.scale
            )
            if plan.compress:
                self._keep_window_queries(q, positions, block_row, n_prompt)
            return
        num_dense = max(0, n_prompt - r.context_len)
        if num_dense > 0:
            # This chunk ends the prompt: dense for the prompt part, then
            # Stage 1 before any later token of the chunk attends.
            out[r.q_start : r.q_start + num_dense] = paged.dense_attention(
                q[:num_dense], positions[:num_dense], kv_cache, block_row,
                n_prompt, self.scale,
            )
            window = self._window_for(q[:num_dense], positions[:num_dense],
                                      block_row, n_prompt)
            self._ops.snapkv_compress(
                kv_cache, kt_cache, block_row, window, n_prompt,
                plan.prompt_budget, plan.tail_start, s.kernel_size,
                s.page_size, self.scale,
            )
            if s.poison_evicted_blocks:
                self._poison_evicted(kv_cache, kt_cache, block_row, plan)
        # Tokens after the prompt (recomputed after a preemption): one at a
        # time, each seeing only its past, as in decoding.
        for i in range(num_dense, r.q_end - r.q_start):
            out[r.q_start + i] = self._hsa_one(
                q[i], kv_cache, kt_cache, block_row, plan, int(positions[i]) + 1)

    def _hsa_one(self, q, kv_cache, kt_cache, block_row, plan, seq_len):
        s = self.settings
        if not self.use_triton:
            return paged.hsa_decode(
                q, kv_cache, kt_cache, block_row, plan.num_compact, plan.tail_start,
                seq_len, plan.topk, plan.topr, s.page_size, self.scale,
                s.force_current_page,
            )
        row = RowPlan(0, 0, 1, seq_len - 1, seq_len, plan)
        batch = RocketKVMetadataBuilder._batch([row], block_row[None])
        return self._hsa_batch(q[None], batch, kv_cache, kt_cache)[0]

    def _hsa_batch(self, q, batch: DecodeBatch, kv_cache, kt_cache):
        from rocketkv_vllm import triton_ops

        s = self.settings
        return triton_ops.hsa_decode_batch(
            q, kv_cache, kt_cache, batch.block_table, batch.num_compact,
            batch.tail_start, batch.seq_lens, batch.topk, batch.topr, s.page_size,
            self.scale, self.max_pages, self.max_select, s.force_current_page,
        )

    def _decode_compressed(self, batch: DecodeBatch, query, out, kv_cache, kt_cache):
        if self.use_triton:
            q = query[batch.tokens]
            out[batch.tokens] = self._hsa_batch(q, batch, kv_cache, kt_cache)
            return
        for r, block_row in zip(batch.rows, batch.block_table):
            out[r.q_start] = self._hsa_one(
                query[r.q_start], kv_cache, kt_cache, block_row, r.plan, r.seq_len)

    def _decode_dense(self, batch: DecodeBatch, max_seq_len, query, out, kv_cache):
        if self.use_triton:
            from rocketkv_vllm import triton_ops

            out[batch.tokens] = triton_ops.dense_decode(
                query[batch.tokens], kv_cache, batch.block_table, batch.seq_lens,
                self.scale, max_seq_len,
            )
            return
        for r, block_row in zip(batch.rows, batch.block_table):
            pos = torch.tensor([r.seq_len - 1], device=query.device)
            out[r.q_start : r.q_end] = paged.dense_attention(
                query[r.q_start : r.q_end], pos, kv_cache, block_row, r.seq_len,
                self.scale,
            )

    def _poison_evicted(self, kv_cache, kt_cache, block_row, plan) -> None:
        """Test aid: NaN-fill the blocks the scheduler is about to take back,
        so any later read of them shows up as NaN in the output."""
        start, end = plan.freed_block_range(self.settings.block_size)
        blocks = block_row[start:end].long()
        kv_cache[blocks] = float("nan")
        kt_cache[blocks] = float("nan")

    def _window_start(self, n_prompt: int) -> int:
        return n_prompt - self.settings.window_size

    def _keep_window_queries(self, q, positions, block_row, n_prompt) -> None:
        """Remember this chunk's queries that fall in the prompt's window."""
        start = self._window_start(n_prompt)
        in_window = positions >= start
        if not bool(in_window.any()):
            return
        key = int(block_row[0])
        buf = self._window_queries.get(key)
        if buf is None or buf.shape[0] != self.settings.window_size:
            buf = q.new_zeros(self.settings.window_size, *q.shape[1:])
            self._window_queries[key] = buf
        buf[positions[in_window] - start] = q[in_window]

    def _window_for(self, q, positions, block_row, n_prompt) -> torch.Tensor:
        """The w window queries: earlier chunks' from the buffer, this chunk's."""
        start = self._window_start(n_prompt)
        first_here = int(positions[0])
        here = q[positions >= start]
        if first_here <= start:
            return here
        earlier = self._window_queries.pop(int(block_row[0]), None)
        if earlier is None:
            raise RuntimeError(
                "ROCKETKV lost the observation-window queries of a request whose "
                "window spans several prefill chunks"
            )
        return torch.cat([earlier[: first_here - start], here])
