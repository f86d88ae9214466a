"""The ROCKETKV attention backend: backend class, metadata, builder, impl.

Everything dense runs in vLLM's own attention implementation for the
platform (CPU_ATTN on CPU; FLASH_ATTN, else TRITON_ATTN on NVIDIA), on the
same KV cache tensor with that backend's own metadata: the KV write, every
prompt token (chunked prefill included) and the decode of requests that are
not compressed. ROCKETKV adds only what RocketKV changes:

- Stage 1, in the step whose chunk holds a compressed prompt's last token,
  after the native attention of that chunk: select, compact onto the first
  blocks, build KT pages. The scheduler hands the freed blocks to other
  requests from the next step on, so it cannot wait.
- Stage 2 (HSA) for every decode token of a compressed request, batched over
  the step's rows (Triton kernels on NVIDIA, the C++ kernel of ``cpu_ops``
  on CPU, ``batched`` PyTorch as the fallback and reference). The
  native call sees such rows with a one-token context, so it does next to
  no work for them, and their output is overwritten.

Tokens after a compressed prompt that arrive in a multi-token chunk (output
tokens recomputed after a preemption) go through Stage 2 one at a time.

On NVIDIA, one-token decode steps replay FULL CUDA graphs: such a step is
laid out as the graph was captured (``decode_graphs``; ``_graph_step``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.logger import init_logger
from vllm.utils.platform_utils import is_pin_memory_available
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

from rocketkv_vllm import batched, decode_graphs, paged, request_budget, stats
from rocketkv_vllm.config import (
    PlanCache,
    RequestPlan,
    RocketKVSettings,
    pow2_at_least,
)
from rocketkv_vllm.engine_config import (
    process_settings,
    settings_from_vllm_config,
    uses_triton,
)
from rocketkv_vllm.kv_cache import make_rocketkv_spec

# Under the "vllm" logger so records show with vLLM's own formatting.
logger = init_logger(f"vllm.{__name__}")


@dataclass(frozen=True)
class NativeChoice:
    backend: type[AttentionBackend]
    kv_layout: str  # where K and V sit in a block (paged.split_kv)


def cpu_kv_layout(isa: str, dtype: torch.dtype, head_size: int, block_size: int) -> str:
    """Where CPU_ATTN's kernels for this ISA put K and V in a block, found by
    letting vLLM's own cache write store known values (into each head's
    [2 * block_size, d] halves, as CPU_ATTN's forward passes them) and
    reading them back through our views."""
    from vllm import _custom_ops as ops

    heads, blocks = 2, 2
    candidates = ("cpu_amx",) if isa == "amx" else ("cpu_vec", "head_rows")
    for layout in candidates:
        kv_cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype)
        rows = kv_cache.view(blocks, heads, 2 * block_size, head_size)
        gen = torch.Generator().manual_seed(0)
        key = torch.randn(3, heads, head_size, generator=gen).to(dtype)
        value = torch.randn(3, heads, head_size, generator=gen).to(dtype)
        slots = torch.tensor([1, block_size + 2, 2 * block_size - 1])
        ops.cpu_attn_reshape_and_cache(key, value, rows[:, :, :block_size],
                                       rows[:, :, block_size:], slots, isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        k_cache, v_cache = paged.split_kv(kv_cache, layout)
        blk, off = slots // block_size, slots % block_size
        if (torch.equal(k_cache[blk, :, off], key)
                and torch.equal(v_cache[blk, :, off], value)):
            return layout
    raise NotImplementedError(
        f"ROCKETKV cannot read vLLM CPU_ATTN's KV cache layout for the '{isa}' "
        f"kernels (dtype {dtype}, block size {block_size}); supported on CPU: the "
        "vec, vec16 and amx kernels")


@functools.cache
def native_backend(head_size: int, dtype: torch.dtype, block_size: int) -> NativeChoice:
    """vLLM's own attention backend that ROCKETKV runs dense attention with."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import (
            CPUAttentionBackend,
            _get_attn_isa,
        )

        isa = _get_attn_isa(dtype, block_size, head_size, "auto")
        layout = cpu_kv_layout(isa, dtype, head_size, block_size)
        choice = NativeChoice(CPUAttentionBackend, layout)
    else:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        capability = current_platform.get_device_capability()
        if (FlashAttentionBackend.supports_head_size(head_size)
                and FlashAttentionBackend.supports_dtype(dtype)
                and capability is not None
                and FlashAttentionBackend.supports_compute_capability(capability)):
            choice = NativeChoice(FlashAttentionBackend, "token")
        else:
            from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

            choice = NativeChoice(TritonAttentionBackend, "token")
    logger.info_once("ROCKETKV: dense attention runs in vLLM's %s backend "
                     "(KV layout %s).", choice.backend.get_name(), choice.kv_layout)
    return choice


def native_for_config(vllm_config: VllmConfig) -> NativeChoice:
    model_config = vllm_config.model_config
    return native_backend(model_config.get_head_size(), model_config.dtype,
                          vllm_config.cache_config.block_size)


@functools.cache
def native_cpu_stage2(kernel: str, kv_layout: str) -> bool:
    """Stage 2 on CPU by the C++ kernel (``cpu_ops``) rather than batched
    PyTorch: with kernel 'auto' on CPU_ATTN's layouts, when it builds here."""
    from rocketkv_vllm import cpu_ops

    if kernel != "auto" or kv_layout not in cpu_ops.LAYOUT_CODES:
        return False
    error = cpu_ops.build_error()
    if error is not None:
        logger.warning("ROCKETKV: the native CPU Stage 2 kernel is unavailable (%s); "
                       "decoding with the slower PyTorch path.", error)
        return False
    logger.info_once("ROCKETKV: Stage 2 runs in the native CPU kernel.")
    return True


class RocketKVBackend(AttentionBackend):
    # vLLM's own selection machinery knows this backend as CUSTOM (see plugin).
    # The native backend writes the KV cache in do_kv_cache_update.
    forward_includes_kv_cache_update: bool = False
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
        # CPU_ATTN's vec16 kernels take 16-token blocks, vec and AMX 32.
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [64, 128]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # KT pages sit in each block's padding behind a head-major interior.
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
class HsaRows:
    """Stage 2 rows of a step: one token per row, same for every layer."""

    tokens: torch.Tensor  # [B] index of each row's token in the step
    block_table: torch.Tensor  # [B, max_blocks]
    num_compact: torch.Tensor  # [B] int32
    tail_start: torch.Tensor
    seq_lens: torch.Tensor  # including the token
    topk: torch.Tensor
    topr: torch.Tensor
    num_select: torch.Tensor  # pages to select: max(topk // page_size, 1)
    max_pages: int  # >= every row's view page count
    max_select: int  # >= every num_select
    pages: batched.ViewPages | None  # PyTorch path only
    # FULL CUDA graph layout (decode_graphs): row b is the step's token b,
    # rows with seq_len 0 are not compressed, the result goes straight into
    # the output (those rows keep the native backend's)
    in_place: bool = False


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
    key: int  # the request's window-query buffer (stable while it runs)


@dataclass
class RocketKVMetadata:
    native: object  # the native backend's metadata for the whole batch
    num_actual_tokens: int
    window_rows: list[PromptChunkRow] = field(default_factory=list)
    stage1_rows: list[PromptChunkRow] = field(default_factory=list)
    # Tokens after a prompt's end inside a multi-token chunk, in order.
    recompute: list[HsaRows] = field(default_factory=list)
    decode: HsaRows | None = None


class PromptLengths:
    """Each batch row's prompt length, on the host, without waiting for the
    device on ordinary steps.

    vLLM hands the lengths over in ``rswa_prefix_lens`` (see engine_config):
    a host tensor under the V1 model runner, a device tensor under Model
    Runner V2, which also gives each row's slot in its request table
    (``req_idx``). So under V2 lengths are remembered per slot and read from
    the device only in a step where a slot holds a request not seen before
    (its first chunk has no computed tokens: prefix caching is off); such a
    step runs a prompt chunk anyway.
    """

    def __init__(self) -> None:
        self._by_slot = np.full(0, -1, dtype=np.int64)
        self.device_reads = 0  # tests: how often the device was waited for

    def get(self, cm: CommonAttentionMetadata, context_lens: np.ndarray) -> np.ndarray:
        """Lengths of the first len(context_lens) rows (a FULL CUDA graph's
        padding rows after them have none)."""
        num_reqs = context_lens.shape[0]
        src = cm.rswa_prefix_lens[:num_reqs]
        if cm.req_idx is None:
            # V1 model runner: a host tensor.
            return src.cpu().numpy().astype(np.int64)
        slots = np.asarray(cm.req_idx[:num_reqs], dtype=np.int64)
        if slots.size and slots.max() >= self._by_slot.size:
            grown = np.full(max(2 * self._by_slot.size, int(slots.max()) + 1), -1,
                            dtype=np.int64)
            grown[: self._by_slot.size] = self._by_slot
            self._by_slot = grown
        stale = (context_lens == 0) | (self._by_slot[slots] < 0)
        if stale.any():
            self.device_reads += 1
            self._by_slot[slots[stale]] = src.cpu().numpy()[stale]
        return self._by_slot[slots]


class RocketKVMetadataBuilder(AttentionMetadataBuilder[RocketKVMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig,
                              kv_cache_spec) -> AttentionCGSupport:
        """FULL graphs for one-token decode steps with the Triton kernels on
        CUDA (``decode_graphs``); never elsewhere (the CPU build has none)."""
        from vllm.platforms import current_platform

        settings = settings_from_vllm_config(vllm_config)
        if not (uses_triton(settings) and current_platform.is_cuda_alike()):
            return AttentionCGSupport.NEVER
        native = native_for_config(vllm_config).backend.get_builder_cls()
        return min(native.get_cudagraph_support(vllm_config, kv_cache_spec),
                   AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE,
                   key=lambda level: level.value)

    def __init__(self, kv_cache_spec, layer_names, vllm_config: VllmConfig, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.settings: RocketKVSettings = settings_from_vllm_config(vllm_config)
        native = native_for_config(vllm_config)
        self.native = native.backend.get_builder_cls()(
            kv_cache_spec, layer_names, vllm_config, device)
        self.reorder_batch_threshold = self.native.reorder_batch_threshold
        self.use_triton = uses_triton(self.settings)
        self.use_native_cpu = (not self.use_triton and native_cpu_stage2(
            self.settings.kernel, native.kv_layout))
        self.prompt_lengths = PromptLengths()
        self.plans = PlanCache(self.settings)
        request_budget.install_runner_hooks()
        # Host staging for the per-step Stage 2 columns comes from torch's
        # caching pinned allocator, which does not hand a buffer out again
        # before its non-blocking copy has run.
        self._pin = is_pin_memory_available() and torch.device(device).type == "cuda"
        self._graph_ready = False
        self.graph: decode_graphs.DecodeGraphShape | None = None

    def _graph_for(self, cm: CommonAttentionMetadata):
        """The FULL-graph shape when this step may replay a graph (one token
        per row, a captured batch size), else None. Decided at the first
        build, when vLLM's graph mode is final; the persistent buffers are
        made then."""
        if not self._graph_ready:
            self._graph_ready = True
            self.graph = decode_graphs.decode_graph_shape(
                self.vllm_config, self.settings, self.use_triton)
            if self.graph is not None:
                rows = self.graph.rows
                self._graph_columns = torch.zeros(len(_HSA_COLUMNS), rows,
                                                  dtype=torch.int32, device=self.device)
                self._graph_native_seq_lens = torch.zeros(rows, dtype=torch.int32,
                                                          device=self.device)
                self._graph_tokens = torch.arange(rows, device=self.device)
                decode_graphs.enable(self.graph, self.settings)
                logger.info_once(
                    "ROCKETKV: decode steps replay FULL CUDA graphs (Stage 2 "
                    "shaped for %d rows, %d view pages, %d selected pages).",
                    rows, self.graph.max_pages, self.graph.max_select)
        g = self.graph
        if g is None or cm.max_query_len != 1 or not 0 < cm.num_reqs <= g.rows:
            return None
        return g

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> RocketKVMetadata:
        cm = common_attn_metadata
        # The R-SWA field carries prompt lengths to us only; the native
        # backend must not apply the marker window.
        native_cm = cm.replace(rswa_prefix_lens=None)
        md = RocketKVMetadata(native=None, num_actual_tokens=cm.num_actual_tokens)
        graph = self._graph_for(cm)
        if cm.rswa_prefix_lens is None or cm.num_reqs == 0:
            # Dummy / capture batches carry no prompt lengths: all dense.
            if graph is not None:
                return self._graph_step(md, common_prefix_len, cm, native_cm, fast_build,
                                        np.zeros(0, np.int64),
                                        np.zeros((len(_HSA_COLUMNS), 0), np.int32))
            md.native = self.native.build(common_prefix_len, native_cm, fast_build)
            return md

        # Under Model Runner V2 a FULL graph's batch is padded past the
        # requests (req_idx): the padding rows are never compressed.
        num_reqs = cm.num_reqs if cm.req_idx is None else min(cm.num_reqs,
                                                              len(cm.req_idx))
        w = self.settings.window_size
        qsl = cm.query_start_loc_cpu[: num_reqs + 1].numpy().astype(np.int64)
        q_lens = np.diff(qsl)
        seq_src = (cm.seq_lens_cpu_upper_bound
                   if cm.seq_lens_cpu_upper_bound is not None else cm.seq_lens)
        seq_lens = seq_src[:num_reqs].cpu().numpy().astype(np.int64)
        context_lens = seq_lens - q_lens
        prompt_lens = self.prompt_lengths.get(cm, context_lens)
        budgets = request_budget.WORKER_BUDGETS.for_rows(cm)[:num_reqs]
        plans = [self.plans(n, b) for n, b in zip(prompt_lens.tolist(), budgets)]
        compress = np.array([p.compress for p in plans], dtype=bool) & (q_lens > 0)
        after = compress & (context_lens >= prompt_lens)  # wholly after the prompt
        decode = after & (q_lens == 1)
        if graph is not None and not (compress & ~decode).any():
            # (A prompt chunk, where Stage 1 runs in Python, or a selection
            # larger than the captured one: the runner hooks keep such a step
            # off FULL graphs (decode_graphs.needs_eager); it runs eagerly.)
            rows = np.flatnonzero(decode)
            columns = self._columns(rows, rows, seq_lens[rows], plans)
            if not rows.size or graph.takes(int(columns[_NUM_SELECT].max())):
                return self._graph_step(md, common_prefix_len, cm, native_cm,
                                        fast_build, rows, columns)
        if not compress.any():
            md.native = self.native.build(common_prefix_len, native_cm, fast_build)
            return md

        block_table = cm.block_table_tensor
        for i in np.flatnonzero(compress & ~decode).tolist():
            plan, n = plans[i], int(prompt_lens[i])
            q_start, q_end = int(qsl[i]), int(qsl[i + 1])
            context_len = int(context_lens[i])
            if not after[i]:
                row = PromptChunkRow(q_start, q_end, context_len, block_table[i], plan,
                                     self._window_key(cm, i))
                if seq_lens[i] < n:
                    if seq_lens[i] > n - w:
                        md.window_rows.append(row)
                    continue
                md.stage1_rows.append(row)
                stats.COUNTERS.prompts_compressed += 1
                stats.COUNTERS.prompt_tokens_evicted += n - plan.prompt_budget
            # Tokens after the prompt's end in a multi-token chunk (output
            # recomputed after a preemption): one Stage 2 row each, in order.
            for t in range(q_start + max(0, n - context_len), q_end):
                md.recompute.append(self._hsa_rows(
                    np.array([i]), np.array([t]),
                    np.array([seq_lens[i] - (q_end - 1 - t)]), plans, block_table))
        rows = np.flatnonzero(decode)
        if rows.size:
            md.decode = self._hsa_rows(rows, qsl[rows], seq_lens[rows], plans,
                                       block_table)
            stats.COUNTERS.decode_tokens_compressed += int(rows.size)
        neutral = np.flatnonzero(after)
        if neutral.size:
            # Rows wholly after a compressed prompt: the native call attends
            # over a q_len-token context only (output overwritten here).
            idx = torch.from_numpy(neutral)
            lens = torch.from_numpy(q_lens[neutral]).to(cm.seq_lens.dtype)
            seq = cm.seq_lens.clone()
            seq[idx.to(seq.device)] = lens.to(seq.device, non_blocking=True)
            native_cm = native_cm.replace(
                seq_lens=seq, seq_lens_cpu_upper_bound=self._upper_bound_with(
                    cm, neutral, lens))
        md.native = self.native.build(common_prefix_len, native_cm, fast_build)
        return md

    @staticmethod
    def _upper_bound_with(cm: CommonAttentionMetadata, rows: np.ndarray, lens):
        if cm.seq_lens_cpu_upper_bound is None:
            return None
        upper = cm.seq_lens_cpu_upper_bound.clone()
        upper[torch.from_numpy(rows)] = lens
        return upper

    def _graph_step(self, md: RocketKVMetadata, common_prefix_len: int,
                    cm: CommonAttentionMetadata, native_cm, fast_build: bool,
                    rows: np.ndarray, columns: np.ndarray) -> RocketKVMetadata:
        """A one-token-per-row step laid out as its FULL graph was captured
        (``decode_graphs``): Stage 2 over every batch row, the compressed
        ``rows`` (their ``_columns``) active, all per-step values in the
        persistent buffers."""
        batch = cm.num_reqs
        every_row = np.zeros((len(_HSA_COLUMNS), batch), dtype=np.int32)
        every_row[:, rows] = columns
        stats.COUNTERS.decode_tokens_compressed += int(rows.size)
        staging = torch.from_numpy(every_row)
        if self._pin:
            staging = staging.pin_memory()
        col = self._graph_columns[:, :batch]
        col.copy_(staging, non_blocking=True)
        c = dict(zip(_HSA_COLUMNS, col))
        # The native call sees compressed rows with a one-token context.
        native_seq = self._graph_native_seq_lens[:batch]
        native_seq.copy_(cm.seq_lens[:batch])
        native_seq.masked_fill_(c["seq_len"] > 0, 1)
        native_cm = native_cm.replace(
            seq_lens=native_seq,
            seq_lens_cpu_upper_bound=self._upper_bound_with(cm, rows, 1))
        md.native = self.native.build(common_prefix_len, native_cm, fast_build)
        g = self.graph
        md.decode = HsaRows(
            tokens=self._graph_tokens[:batch],
            block_table=cm.block_table_tensor[:batch],
            num_compact=c["num_compact"], tail_start=c["tail_start"],
            seq_lens=c["seq_len"], topk=c["topk"], topr=c["topr"],
            num_select=c["num_select"], max_pages=g.max_pages,
            max_select=g.max_select, pages=None, in_place=True,
        )
        return md

    @staticmethod
    def _window_key(cm: CommonAttentionMetadata, i: int) -> int:
        # V2: the request's slot; V1 (host block table): its first block.
        if cm.req_idx is not None:
            return int(cm.req_idx[i])
        return int(cm.block_table_tensor[i, 0])

    def _columns(self, rows: np.ndarray, tokens: np.ndarray, seq_lens: np.ndarray,
                 plans: list[RequestPlan]) -> np.ndarray:
        """The Stage 2 columns (_HSA_COLUMNS) of these batch rows, int32."""
        ps = self.settings.page_size
        chosen = [plans[i] for i in rows]
        topk = np.array([p.topk for p in chosen], dtype=np.int64)
        columns = {
            "row": rows, "token": tokens,
            "num_compact": np.array([p.num_compact for p in chosen], dtype=np.int64),
            "tail_start": np.array([p.tail_start for p in chosen], dtype=np.int64),
            "seq_len": seq_lens, "topk": topk,
            "topr": np.array([p.topr for p in chosen], dtype=np.int64),
            "num_select": np.maximum(topk // ps, 1),
        }
        return np.stack([columns[name] for name in _HSA_COLUMNS]).astype(np.int32)

    def _hsa_rows(self, rows: np.ndarray, tokens: np.ndarray, seq_lens: np.ndarray,
                  plans: list[RequestPlan], block_table: torch.Tensor) -> HsaRows:
        """Stage 2 rows: batch rows, each one's token index in the step and
        seq_len including that token. One host-to-device copy."""
        s = self.settings
        columns = self._columns(rows, tokens, seq_lens, plans)
        staging = torch.from_numpy(columns)
        if self._pin:
            staging = staging.pin_memory()
        col = staging.to(block_table.device, non_blocking=True)
        host = dict(zip(_HSA_COLUMNS, columns.astype(np.int64)))
        view_pages = (-(-host["num_compact"] // s.page_size)
                      - (-(host["seq_len"] - host["tail_start"]) // s.page_size))
        max_pages = int(view_pages.max())
        max_select = int(host["num_select"].max())
        if self.use_triton:
            # Fewer distinct launch shapes (kernel specializations).
            max_pages = pow2_at_least(max_pages)
            max_select = pow2_at_least(max_select)
        c = dict(zip(_HSA_COLUMNS, col))
        hsa = HsaRows(
            tokens=c["token"].long(),
            block_table=block_table[c["row"].long()],
            num_compact=c["num_compact"],
            tail_start=c["tail_start"],
            seq_lens=c["seq_len"],
            topk=c["topk"],
            topr=c["topr"],
            num_select=c["num_select"],
            max_pages=max_pages,
            max_select=max_select,
            pages=None,
        )
        if not (self.use_triton or self.use_native_cpu):
            hsa.pages = batched.view_pages(
                hsa.block_table, hsa.num_compact, hsa.tail_start, hsa.seq_lens,
                s.page_size, s.block_size, hsa.max_pages)
        return hsa


_HSA_COLUMNS = ("row", "token", "num_compact", "tail_start", "seq_len", "topk",
                "topr", "num_select")
_NUM_SELECT = _HSA_COLUMNS.index("num_select")


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
        choice = native_for_config(vllm_config)
        self.kv_layout = choice.kv_layout
        self.native = choice.backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
            kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
        )
        self.use_triton = uses_triton(s)
        if self.use_triton and self.kv_layout == "cpu_amx":
            raise ValueError(
                "rocketkv.kernel='triton' is invalid with CPU_ATTN's AMX cache layout "
                "(bf16, block_size a multiple of 32): allowed 'auto' or 'torch', or "
                "block_size 16")
        self.use_native_cpu = not self.use_triton and native_cpu_stage2(
            s.kernel, self.kv_layout)
        self._ops = paged
        if self.use_triton:
            from rocketkv_vllm import triton_ops

            self._ops = triton_ops
        # Window queries of a prompt whose window spans several prefill
        # chunks, keyed by the request's first block id (stable while the
        # request holds its blocks), until the chunk with the prompt's end.
        # At most one buffer per running request: the oldest written go
        # first (requests aborted mid-prompt never reach Stage 1).
        self._window_queries: dict[int, torch.Tensor] = {}
        self._max_window_buffers = vllm_config.scheduler_config.max_num_seqs

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
        if attn_metadata is None:  # profiling run
            return output
        md = attn_metadata
        self.native.forward(layer, query, key, value, kv_cache, md.native, output)
        if not (md.window_rows or md.stage1_rows or md.recompute or md.decode is not None):
            return output
        s = self.settings
        n = md.num_actual_tokens
        query = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        k_cache, v_cache = paged.split_kv(kv_cache, self.kv_layout)
        kt_cache = paged.kt_cache_view(kv_cache, s.page_size, s.kt_dtype)
        for r in md.window_rows:
            self._keep_window_queries(r, query)
        for r in md.stage1_rows:
            plan = r.plan
            with stats.stage1_timer(query.device):
                self._ops.snapkv_compress(
                    k_cache, v_cache, kt_cache, r.block_row,
                    self._window_for(r, query), plan.num_prompt_tokens,
                    plan.prompt_budget, plan.tail_start, s.kernel_size,
                    s.page_size, self.scale,
                )
            if s.poison_evicted_blocks:
                self._poison_evicted(kv_cache, r.block_row, plan)
        for rows in md.recompute:
            self._hsa(rows, query, out, kv_cache, k_cache, v_cache, kt_cache)
        if md.decode is not None:
            self._hsa(md.decode, query, out, kv_cache, k_cache, v_cache, kt_cache)
        return output

    def _hsa(self, rows: HsaRows, query, out, kv_cache, k_cache, v_cache,
             kt_cache) -> None:
        s = self.settings
        if rows.in_place:  # FULL-graph layout (Triton only): row b is token b
            batch = rows.tokens.shape[0]
            q, dest = query[:batch], out[:batch]
        else:
            q, dest = query[rows.tokens], None
        if self.use_triton:
            from rocketkv_vllm import triton_ops

            result = triton_ops.hsa_decode_batch(
                q, k_cache, v_cache, kt_cache, rows.block_table, rows.num_compact,
                rows.tail_start, rows.seq_lens, rows.topk, rows.topr, s.page_size,
                self.scale, rows.max_pages, rows.max_select, s.force_current_page,
                out=dest,
            )
        elif self.use_native_cpu:
            from rocketkv_vllm import cpu_ops

            result = cpu_ops.hsa_decode_batch(
                q, kv_cache, kt_cache, self.kv_layout, rows.block_table,
                rows.num_compact, rows.tail_start, rows.seq_lens, rows.topr,
                rows.num_select, s.page_size, self.scale, s.force_current_page,
            )
        else:
            result = batched.hsa_decode_batch(
                q, k_cache, v_cache, kt_cache, rows.block_table, rows.seq_lens,
                rows.pages, rows.topr, rows.num_select, rows.max_select,
                s.page_size, self.scale, s.force_current_page,
            )
        if not rows.in_place:
            out[rows.tokens] = result.to(out.dtype)

    def _poison_evicted(self, kv_cache, block_row, plan) -> None:
        """Test aid: fill the blocks the scheduler is about to take back with
        huge keys/values (and NaN KT pages), so any later read of them by
        ROCKETKV changes the output. Finite, because vLLM's kernels read (and
        mask) the unwritten slots of a request's last block, which may be
        such a reused block."""
        start, end = plan.freed_block_range(self.settings.block_size)
        blocks = block_row[start:end].long()
        kv_cache[blocks] = 3.0e4
        kt = paged.kt_cache_view(kv_cache, self.settings.page_size, self.settings.kt_dtype)
        kt[blocks] = 0xFF if kt.dtype == torch.uint8 else float("nan")  # NaN either way

    def _window_queries_here(self, r: PromptChunkRow, query):
        """(window offset of the first, queries) of this chunk's window part."""
        n = r.plan.num_prompt_tokens
        window_start = n - self.settings.window_size
        end = min(r.q_end, r.q_start + n - r.context_len)
        first = max(r.q_start, r.q_start + window_start - r.context_len)
        return r.context_len + first - r.q_start - window_start, query[first:end]

    def _keep_window_queries(self, r: PromptChunkRow, query) -> None:
        """Remember this chunk's queries that fall in the prompt's window."""
        offset, q = self._window_queries_here(r, query)
        buf = self._window_queries.pop(r.key, None)
        if buf is None:
            buf = q.new_zeros(self.settings.window_size, *q.shape[1:])
        self._window_queries[r.key] = buf  # newest last
        while len(self._window_queries) > self._max_window_buffers:
            del self._window_queries[next(iter(self._window_queries))]
        buf[offset : offset + q.shape[0]] = q

    def _window_for(self, r: PromptChunkRow, query) -> torch.Tensor:
        """The w window queries: earlier chunks' from the buffer, this chunk's."""
        offset, here = self._window_queries_here(r, query)
        if offset == 0:
            return here
        earlier = self._window_queries.pop(r.key, None)
        if earlier is None:
            raise RuntimeError(
                "ROCKETKV lost the observation-window queries of a request whose "
                "window spans several prefill chunks"
            )
        return torch.cat([earlier[:offset], here])
