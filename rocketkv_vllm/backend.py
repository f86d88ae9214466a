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

from rocketkv_vllm import ops
from rocketkv_vllm.config import RequestPlan, RocketKVSettings, plan_request
from rocketkv_vllm.engine_config import process_settings, settings_from_vllm_config
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
class RocketKVMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    positions: torch.Tensor  # [num_actual_tokens] logical position of each token
    rows: list[RowPlan] = field(default_factory=list)


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
        positions = torch.empty(cm.num_actual_tokens, dtype=torch.long)
        for r in rows:
            positions[r.q_start : r.q_end] = torch.arange(r.context_len, r.seq_len)
        return RocketKVMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            slot_mapping=cm.slot_mapping,
            block_table=cm.block_table_tensor,
            positions=positions.to(cm.block_table_tensor.device),
            rows=rows,
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
        self.settings = settings_from_vllm_config(get_current_vllm_config())
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
        kt_cache = ops.kt_cache_view(kv_cache, s.page_size)
        ops.write_kv(kv_cache, key, value, attn_metadata.slot_mapping[:n])

        for r in attn_metadata.rows:
            block_row = attn_metadata.block_table[r.row]
            positions = attn_metadata.positions[r.q_start : r.q_end]
            q = query[r.q_start : r.q_end]
            plan = r.plan
            n_prompt = plan.num_prompt_tokens
            if not plan.compress or r.seq_len < n_prompt:
                # Dense: short prompts always, long prompts until their end.
                out[r.q_start : r.q_end] = ops.dense_attention(
                    q, positions, kv_cache, block_row, r.seq_len, self.scale
                )
                if plan.compress:
                    self._keep_window_queries(q, positions, block_row, n_prompt)
                continue
            num_dense = max(0, n_prompt - r.context_len)
            if num_dense > 0:
                # This chunk ends the prompt: dense for the prompt part, then
                # Stage 1 before any later token of the chunk attends.
                out[r.q_start : r.q_start + num_dense] = ops.dense_attention(
                    q[:num_dense], positions[:num_dense], kv_cache, block_row,
                    n_prompt, self.scale,
                )
                window = self._window_for(q[:num_dense], positions[:num_dense],
                                          block_row, n_prompt)
                ops.snapkv_compress(
                    kv_cache, kt_cache, block_row, window, n_prompt,
                    plan.prompt_budget, plan.tail_start, s.kernel_size,
                    s.page_size, self.scale,
                )
            for i in range(num_dense, r.q_end - r.q_start):
                out[r.q_start + i] = ops.hsa_decode(
                    q[i], kv_cache, kt_cache, block_row, plan.num_compact,
                    plan.tail_start, int(positions[i]) + 1, plan.topk, plan.topr,
                    s.page_size, self.scale, s.force_current_page,
                )
        return output

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
