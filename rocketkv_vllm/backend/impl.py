"""ROCKETKV's attention impl: vLLM's own backend for everything dense, then
Stage 1 and Stage 2 for the rows the metadata names.

Dense work (the KV write, every prompt token, uncompressed decodes) runs in
vLLM's native attention impl on the same KV cache with its own metadata.
Then, per layer: the observation-window queries of prompt chunks are kept
(keep_rule h2o: their attention scores accumulate instead), Stage 1
compacts each prompt that ended in this step, and Stage 2 replaces the
output of every decode token of a compressed request.
"""

from __future__ import annotations

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import AttentionImpl, AttentionLayer, AttentionType

from rocketkv_vllm.backend.graphs import selection_width
from rocketkv_vllm.backend.h2o import H2OScores
from rocketkv_vllm.backend.metadata import PromptChunkRow, RocketKVMetadata
from rocketkv_vllm.backend.native import NativeQuery, native_for_config
from rocketkv_vllm.backend.stages import stage1_for, stage2_for
from rocketkv_vllm.backend.window import WindowQueries
from rocketkv_vllm.budget import max_view_pages
from rocketkv_vllm.config import settings_for, test_aids_for
from rocketkv_vllm.fp8_kv import LARGE_CODE, kv_quant_for
from rocketkv_vllm.layout import kt_cache_view, split_kv
from rocketkv_vllm.ops.base import HsaRows
from rocketkv_vllm.state import worker_state

logger = init_logger(f"vllm.{__name__}")


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
        # What a model's layer asks that ROCKETKV's stages do not compute
        # (most models that ask are refused earlier, from their config:
        # engine.unsupported_model_reasons).
        unsupported = {
            "ALiBi position biases": alibi_slopes is not None,
            "a sliding window on a compressed layer": sliding_window is not None,
            f"attention logit soft-capping ({logits_soft_cap})": bool(logits_soft_cap),
            "KV sharing across layers": kv_sharing_target_layer_name is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
        }
        bad = [name for name, used in unsupported.items() if used]
        if bad:
            raise NotImplementedError(
                f"ROCKETKV attention backend does not support: {', '.join(bad)}; serve "
                "this model with vLLM's own backend"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        vllm_config = get_current_vllm_config()
        self.settings = settings_for(vllm_config)
        aids = test_aids_for(vllm_config)
        self.poison_evicted_blocks = aids.poison_evicted_blocks
        self.kept_log = (
            worker_state(vllm_config).kept_positions if aids.record_kept_positions else None
        )
        # Given-back blocks stay valid prefix-cache entries: then only their
        # KT pages (which no reader of the cache uses) are poisoned.
        self.prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
        state = worker_state(vllm_config)
        self.counters = state.counters
        if state.window_queries is None:
            state.window_queries = WindowQueries(self.settings.window_size)
            state.requests.on_leave.append(state.window_queries.forget)
        self.window_queries = state.window_queries
        self.h2o_scores: H2OScores | None = None
        if self.settings.keep_rule == "h2o":
            if state.h2o_scores is None:
                state.h2o_scores = H2OScores()
                state.requests.on_leave.append(state.h2o_scores.forget)
            self.h2o_scores = state.h2o_scores
        self.kept_h2o_log = state.kept_h2o_scores if aids.record_kept_positions else None
        # rocketkv.stage1_lead_layer: whether this layer follows the lead's
        # choice (known at the first forward, from the layer's name).
        self.stage1_followers = state.stage1_followers
        self.follows_lead: bool | None = None
        # The model's sink logits (a parameter the weight loader fills after
        # this); Stage 1 and 2 read them in fp32, converted once (``_sinks``).
        self.sinks = sinks
        self._sinks_fp32: torch.Tensor | None = None
        choice = native_for_config(vllm_config, has_sink=sinks is not None)
        self.kv_layout = choice.kv_layout
        self.native = choice.backend.get_impl_cls()(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            sinks=sinks,
        )
        self.native_query = NativeQuery(
            self.native, kv_cache_dtype, num_heads, num_kv_heads, head_size
        )
        self.stage2 = stage2_for(self.settings, self.kv_layout)
        self.stage1 = stage1_for(self.settings)
        # The largest eager Stage 2 call: every running request, each with the
        # most view pages (the Triton kernels' fixed eager shape).
        self.max_rows = vllm_config.scheduler_config.max_num_seqs
        self.max_pages = max_view_pages(
            vllm_config.model_config.max_model_len, self.settings.page_size
        )
        # The layer's selection store (reselect_every > 1, ``backend.reuse``):
        # a slot per running request, and a spare last one.
        self.selections: torch.Tensor | None = None
        if self.settings.reselect_every > 1:
            self.selections = torch.full(
                (
                    vllm_config.scheduler_config.max_num_seqs + 1,
                    num_kv_heads,
                    selection_width(self.settings, vllm_config.model_config.max_model_len),
                ),
                -1,
                dtype=torch.int32,
                device=vllm_config.device_config.device,
            )

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        self.native.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

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
        if attn_metadata is None:  # profiling run: count Stage 2's scratch in
            self.stage2.reserve_scratch(
                query.device, self.max_rows, self.num_heads, self.num_kv_heads, self.max_pages
            )
            return output
        md = attn_metadata
        native_query = self.native_query(layer, query)
        self.native.forward(layer, native_query, key, value, kv_cache, md.native, output)
        if not md.adds_work:
            return output
        if self.follows_lead is None:
            lead = self.settings.stage1_lead_layer
            self.follows_lead = lead > 0 and extract_layer_index(layer.layer_name) < lead
        n = md.num_actual_tokens
        query = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        quant = kv_quant_for(self.kv_cache_dtype, layer)
        if self.follows_lead:  # no scores of its own: the lead's choice comes later
            for r in md.stage1_rows:
                self.stage1_followers.setdefault(r.key, []).append((self, r, kv_cache, quant))
        else:
            for r in md.window_rows:
                self.window_queries.keep(self, r, query)
            if md.score_rows:
                k_cache, _ = split_kv(kv_cache, self.kv_layout, quant)
                for r in md.score_rows:
                    self.h2o_scores.add(self, r, query, k_cache, self.scale, self._sinks())
            for r in md.stage1_rows:
                kept = self._stage1(r, query, kv_cache, quant)
                for follower, f_row, f_cache, f_quant in self.stage1_followers.pop(r.key, ()):
                    follower._apply_kept(f_row, kept, f_cache, f_quant)
        for rows in md.recompute:
            self._stage2(rows, query, out, kv_cache, quant)
        if md.decode is not None:
            self._stage2(md.decode, query, out, kv_cache, quant)
        return output

    def _stage1(self, r: PromptChunkRow, query, kv_cache, quant) -> torch.Tensor:
        s, plan = self.settings, r.plan
        k_cache, _ = split_kv(kv_cache, self.kv_layout, quant)
        window = scores = None
        if s.keep_rule == "snapkv":
            window, whole = self.window_queries.take(self, r, query)
            if not whole:
                self.counters.stage1_short_windows += 1
                logger.warning_once(
                    "ROCKETKV: a prompt's earlier observation-window queries were gone at "
                    "its Stage 1; it was scored with its last chunk's window queries only"
                )
        elif s.keep_rule == "h2o" and plan.prompt_budget < plan.num_prompt_tokens:
            scores, whole = self.h2o_scores.take(self, r, query, k_cache, self.scale, self._sinks())
            if not whole:
                self.counters.stage1_partial_h2o_scores += 1
                logger.warning_once(
                    "ROCKETKV: a prompt's H2O scores missed some of its prefill chunks "
                    "at its Stage 1; it kept by the chunks they hold"
                )
        with self.counters.stage1_timer(query.device):
            kept = self.stage1.choose_kept(
                k_cache,
                r.block_row,
                window,
                plan.num_prompt_tokens,
                plan.prompt_budget,
                plan.tail_start,
                s.kernel_size,
                self.scale,
                sinks=self._sinks(),
                keep_rule=s.keep_rule,
                h2o_scores=scores,
                window_size=s.window_size,
            )
        self._apply_kept(r, kept, kv_cache, quant)
        if self.kept_h2o_log is not None and scores is not None:
            self.kept_h2o_log.append(scores.cpu())
        return kept

    def _apply_kept(self, r: PromptChunkRow, kept, kv_cache, quant) -> None:
        """Compact ``kept`` onto this layer's cache and write its KT pages: a
        layer's own choice (``_stage1``), or under ``stage1_lead_layer`` the
        lead's, called from the lead's forward in the same step, before any
        later read of these blocks."""
        s, plan = self.settings, r.plan
        k_cache, v_cache = split_kv(kv_cache, self.kv_layout, quant)
        kt_cache = kt_cache_view(kv_cache, s.page_size, s.kt_dtype)
        with self.counters.stage1_timer(kv_cache.device):
            self.stage1.apply_kept(
                k_cache,
                v_cache,
                kt_cache,
                r.block_row,
                kept,
                plan.num_prompt_tokens,
                plan.prompt_budget,
                plan.tail_start,
                s.page_size,
            )
        if self.kept_log is not None:
            self.kept_log.append((plan.num_prompt_tokens, kept.cpu()))
        if self.poison_evicted_blocks:
            self._poison_evicted(kv_cache, r.block_row, plan, quant)

    def _sinks(self) -> torch.Tensor | None:
        """The sink logits in fp32 (first converted in the warm-up runs that
        precede any CUDA graph capture, so captures read a fixed tensor)."""
        if self.sinks is not None and self._sinks_fp32 is None:
            self._sinks_fp32 = self.sinks.detach().float().contiguous()
        return self._sinks_fp32

    def _stage2(self, rows: HsaRows, query, out, kv_cache, quant) -> None:
        sinks = self._sinks()
        if rows.in_place:  # FULL-graph layout (Triton only): row b is token b
            batch = rows.tokens.shape[0]
            self.stage2.decode(
                query[:batch],
                kv_cache,
                rows,
                self.scale,
                out=out[:batch],
                sinks=sinks,
                quant=quant,
                selections=self.selections,
            )
            return
        result = self.stage2.decode(
            query[rows.tokens],
            kv_cache,
            rows,
            self.scale,
            sinks=sinks,
            quant=quant,
            selections=self.selections,
        )
        out[rows.tokens] = result.to(out.dtype)

    def _poison_evicted(self, kv_cache, block_row, plan, quant) -> None:
        """Test aid: fill the blocks the scheduler is about to take back with
        huge keys/values (and NaN KT pages), so any later read of them by
        ROCKETKV changes the output. Finite, because vLLM's kernels read (and
        mask) the unwritten slots of a request's last block, which may be
        such a reused block. With prefix caching their K/V stay: they are the
        dense prefix-cache entries other requests may hit."""
        s = self.settings
        start, end = plan.freed_block_range(s.block_size)
        blocks = block_row[start:end].long()
        if not self.prefix_caching:
            kv_cache[blocks] = 3.0e4 if quant is None else LARGE_CODE[quant.fp8_dtype]
        kt = kt_cache_view(kv_cache, s.page_size, s.kt_dtype)
        kt[blocks] = 0xFF if kt.dtype == torch.uint8 else float("nan")  # NaN either way
