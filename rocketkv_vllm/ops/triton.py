"""RocketKV's steps with the Triton kernels (``rocketkv_vllm.kernels``).

Same layout and semantics as the PyTorch steps (``ops.pytorch``; oracle
``tests/reference/paged``), free of host synchronisation in decode. The KV
cache is passed as two views ``k_cache``, ``v_cache`` [num_blocks, Hkv, bs,
d] (all four strides arbitrary, so K may be stored transposed per head block
as in CPU_ATTN; ``layout.split_kv`` makes them from a vLLM cache), the KT
cache as ``kt_cache`` (``layout.kt_cache_view``):

* Stage 1's steps for one prompt (``TritonStage1``'s, the flow is
  ``ops.base.Stage1.compress``; the same signatures as ``ops.pytorch``'s):
  ``window_scores`` (2 Triton passes + a few torch ops merging partial
  softmax statistics),
  ``compact_kept_tokens`` (1 launch), ``write_kt_pages`` (1 launch per
  region). They happen not to synchronise with the host either.
* ``hsa_decode`` -- Stage 2, one decode token per row, all rows at once,
  built for latency: three launches, nothing else on the stream (with a
  ``DecodeWorkspace`` and a given ``out``: no allocation, no torch op).
  Launch sequence (grids from Python ints: ``plan_decode``):
    1. ``_score_kernel``         grid (B*Hkv, S1)  KT update of the newest
       page fused in (the split holding the row's last page refreshes it
       before scoring it), page logits + per-split softmax partials
       (``kernels.hsa_score``)
    2. ``_select_kernel``        grid (B*Hkv, S1)  probabilities on the fly
       (``kernels.page_select``)
       from the merged partials, local top-n per split, the row's last
       split merges the candidates (atomic counter) -> selected pages
       [f = 1 with force_current_page: the current page is an extra page,
        selected on top of min(max_select, max_pages)]
    3. ``_sparse_decode_kernel`` grid (B*Hkv, S2)  attention over the
       (``kernels.sparse_decode``) selected pages, split over pages; the row's last split merges the
       partials into ``out`` (atomic counter), sinks there
  With a selection store (``selections``: reuse across steps) the same
  three launches: a reusing row's scoring programs only refresh its KT
  page and its selection is a copy from the store; the other rows with a
  slot store what their merge chose.
  S1 ~ 4 programs per SM over the B*Hkv rows (capped by max_pages' 16-page
  tiles), S2 ~ 4 per SM too (each split >= 8 tokens of a full selection):
  at batch 1 (8 KV heads) both fill a 132-SM GPU (``decode_launches``
  reports the grids and the programs with work). Why this shape: the six
  launches it replaces (KT update, logits, probabilities, selection at one
  program per (row, head), attention, merge) cost ~70-94 us per layer on
  an H200 whatever the context: launch latency and serial dependent passes,
  not bytes. Fusing the KT update into the scoring costs one page of keys
  in one program; the probabilities need every split's partials, so they
  start the selection launch (each split merges a few hundred floats), and
  the selection and the split-K merge ride on the last-arriving program of
  each row instead of launches of their own. The counters live in the
  workspace and are reset by that program: CUDA-graph replays find them 0.
  No .item(), no data-dependent shapes: CUDA-graph capturable for fixed
  (B, max_pages, max_select). From compute capability 9.0 the three are
  launched with programmatic dependent launch (``_utils.uses_pdl``;
  ``ROCKETKV_PDL=0`` turns it off): each kernel's programs may start while
  the kernel before it drains, and wait for it (griddepcontrol.wait) before
  their first memory access, so a launch boundary costs less than a full
  drain and ramp-up.
* ``TritonStage1``, ``TritonStage2`` -- the stages the impl calls
  (``ops.base``'s interfaces): ``TritonStage2.decode`` takes ``HsaRows``
  whole and runs eager batches in row chunks of ``SCRATCH_BYTES``.

No vLLM import here: this module, ``kernels`` and their tests run with only
torch + triton.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rocketkv_vllm.kernels import hsa_score, page_select, sparse_decode
from rocketkv_vllm.kernels._utils import (
    cdiv,
    check_kv_cache,
    group_pad,
    kv_operand,
)
from rocketkv_vllm.kernels.compact import compact_kept_tokens, write_kt_pages
from rocketkv_vllm.kernels.hsa_score import ScorePlan, ScoreScratch, launch_score
from rocketkv_vllm.kernels.page_select import launch_select
from rocketkv_vllm.kernels.rows import DecodeRows
from rocketkv_vllm.kernels.sparse_decode import AttentionPlan, AttentionScratch
from rocketkv_vllm.kernels.window_scores import window_scores
from rocketkv_vllm.layout import split_kv
from rocketkv_vllm.ops import base
from rocketkv_vllm.ops.base import HsaRows, Stage1, Stage2, scratch_bytes_per_row

__all__ = [
    "DecodeRows",
    "DecodeWorkspace",
    "TritonStage1",
    "TritonStage2",
    "compact_kept_tokens",
    "decode_launches",
    "hsa_decode",
    "hsa_decode_checked",
    "plan_decode",
    "window_scores",
    "write_kt_pages",
]


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a decode layer: its grid, and how many of its
    programs have work for the rows it was planned for (None: not asked)."""

    kernel: str
    grid: tuple[int, ...]
    busy: int | None = None

    @property
    def programs(self) -> int:
        n = 1
        for g in self.grid:
            n *= g
        return n


@dataclass(frozen=True)
class DecodePlan:
    """Launch shapes of one ``hsa_decode`` call (Python ints only)."""

    score: ScorePlan
    attention: AttentionPlan
    num_q_heads: int
    head_dim: int

    def compile_key(self) -> tuple:
        """What decides the kernels' specializations (their constexprs and
        the integers they take are the plan's fields; the batch only sizes
        the grid): two plans with one key compile the same kernels."""
        return (
            dataclasses.replace(self.score, batch=0),
            dataclasses.replace(self.attention, batch=0),
            self.num_q_heads,
            self.head_dim,
        )

    def launches(self, row_pages: int | None = None, n_use: int | None = None) -> list[Launch]:
        """The launch sequence; with rows of row_pages view pages using
        n_use selected pages each, the programs that have work."""
        s, a = self.score, self.attention
        busy_s = None if row_pages is None else s.busy_programs(row_pages)
        busy_a = None if n_use is None else a.busy_programs(n_use)
        return [
            Launch("_score_kernel", s.grid, busy_s),
            Launch("_select_kernel", s.grid, busy_s),
            Launch("_sparse_decode_kernel", a.grid, busy_a),
        ]


def plan_decode(
    batch: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_pages: int,
    max_select: int,
    page_size: int,
    force_current_page: bool,
    dtype: torch.dtype,
    sms: int,
    attention_sms: int | None = None,
) -> DecodePlan:
    """The grids of ``hsa_decode`` for these shapes on a GPU with ``sms``
    SMs (dtype: what the attention dots run in)."""
    score = hsa_score.plan_score(
        batch, num_kv_heads, max_pages, max_select, force_current_page, sms
    )
    attention = sparse_decode.plan_attention(
        batch,
        num_kv_heads,
        score.n_sel,
        page_size,
        dtype,
        sms if attention_sms is None else attention_sms,
    )
    return DecodePlan(score, attention, int(num_q_heads), int(head_dim))


def decode_launches(
    batch: int,
    num_kv_heads: int,
    num_q_heads: int,
    context: int,
    page_size: int,
    topk: int,
    num_sms: int,
    *,
    head_dim: int = 128,
    prompt_budget: int | None = None,
    generated: int = 0,
    max_model_len: int | None = None,
    block_size: int = 16,
    force_current_page: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> list[Launch]:
    """Each launch of one decode layer (grid and programs with work) for
    ``batch`` rows of a ``context``-token prompt plus ``generated`` tokens,
    at the FULL CUDA graph's launch shape (``backend.graphs.shape_for``:
    max_pages = max_model_len / page_size + 1, max_select = topk /
    page_size; max_model_len defaults to context + generated). The rows'
    views: with ``prompt_budget`` below the context, the compressed view
    (prompt_budget tokens, the tail from the block-aligned tail_start, as
    ``plan.plan_request`` lays it out), else the whole context."""
    seq = context + generated
    mml = seq if max_model_len is None else int(max_model_len)
    max_pages = cdiv(mml, page_size) + 1
    n_select = max(topk // page_size, 1)
    max_select = min(n_select, max_pages)
    if prompt_budget is not None and context > prompt_budget:
        tail_start = context // block_size * block_size
        num_compact = prompt_budget - (context - tail_start)
        row_pages = cdiv(num_compact, page_size) + cdiv(seq - tail_start, page_size)
    else:
        row_pages = cdiv(seq, page_size)
    f = 1 if force_current_page else 0
    plan = plan_decode(
        batch,
        num_q_heads,
        num_kv_heads,
        head_dim,
        max_pages,
        max_select,
        page_size,
        force_current_page,
        dtype,
        num_sms,
    )
    return plan.launches(row_pages, min(n_select + f, row_pages, plan.score.n_sel))


class DecodeWorkspace:
    """Stage 2's scratch, allocated once (the metadata builder makes one for
    the largest decode batch) and shared by every layer and step: page
    logits, split partials, candidates, selected pages, attention partials
    and the zeroed per-(row, head) counters of the last-arriving merges
    (each launch leaves them 0). Serves any ``hsa_decode`` call with batch
    <= rows, max_pages <= max_pages, max_select <= max_select (or within
    one of the ``also`` shapes, (rows, max_pages, max_select) each) and the
    given head counts / size on a GPU with at most ``sms`` SMs; ``fits``
    says (a call it does not fit allocates its own scratch). One stream at
    a time: launches on two streams must not share one."""

    def __init__(
        self,
        device,
        rows: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_pages: int,
        max_select: int,
        force_current_page: bool = False,
        sms: int | None = None,
        also: tuple | list = (),
    ) -> None:
        device = torch.device(device)
        if sms is None:
            sms = max(hsa_score.num_sms(device), sparse_decode.num_sms(device))
        self.device = device
        self.sms = int(sms)
        self.num_q_heads, self.num_kv_heads = int(num_q_heads), int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.force = bool(force_current_page)
        shapes = [(rows, max_pages, max_select), *also]
        caps = [self._caps(*shape) for shape in shapes]
        self.caps = {k: max(c[k] for c in caps) for k in caps[0]}
        self.rows = max(max(1, int(s[0])) for s in shapes)
        self.max_pages = max(max(1, int(s[1])) for s in shapes)
        self.max_select = max(int(s[2]) for s in shapes)
        c = self.caps
        self._f32_offsets = _offsets(
            [
                ("logits", c["logits"]),
                ("part_m", c["part"]),
                ("part_l", c["part"]),
                ("probs", c["probs"]),
                ("o_part", c["o_part"]),
                ("lse_part", c["lse_part"]),
            ]
        )
        self._i32_offsets = _offsets(
            [("cand_bits", c["cand"]), ("cand_pages", c["cand"]), ("sel", c["sel"])]
        )
        self.f32 = torch.empty(
            max(1, self._f32_offsets["_end"]), dtype=torch.float32, device=device
        )
        self.i32 = torch.empty(max(1, self._i32_offsets["_end"]), dtype=torch.int32, device=device)
        self.counters = torch.zeros(max(1, c["counters"]), dtype=torch.int32, device=device)

    def _caps(self, rows: int, max_pages: int, max_select: int) -> dict[str, int]:
        """Elements per buffer for any call up to (rows, max_pages, max_select)."""
        rows, max_pages = max(1, int(rows)), max(1, int(max_pages))
        rows_h = rows * self.num_kv_heads
        # Split counts never exceed PROGRAMS_PER_SM * sms / (B*Hkv) rounded
        # up: B*Hkv*splits < PROGRAMS_PER_SM * sms + B*Hkv.
        programs = max(hsa_score.PROGRAMS_PER_SM, sparse_decode.PROGRAMS_PER_SM) * self.sms
        programs += rows_h
        group = self.num_q_heads // self.num_kv_heads
        n_sel = max(1, min(int(max_select) + 1, max_pages))  # forced page or not
        widest = hsa_score.plan_score(
            rows, self.num_kv_heads, max_pages, max_select, True, self.sms
        )
        return dict(
            logits=rows * self.num_q_heads * max_pages,
            part=programs * group_pad(group),
            probs=rows_h * max_pages if widest.long else 0,
            o_part=programs * group * self.head_dim,
            lse_part=programs * group,
            cand=programs * n_sel,
            sel=rows_h * n_sel,
            counters=rows_h,
        )

    @property
    def nbytes(self) -> int:
        return 4 * (self.f32.numel() + self.i32.numel() + self.counters.numel())

    def needs(self, plan: DecodePlan) -> dict[str, int]:
        s = ScoreScratch.sizes(plan.score, plan.num_q_heads)
        a = AttentionScratch.sizes(plan.attention, plan.num_q_heads, plan.head_dim)
        return dict(
            logits=s["logits"],
            part=s["part"],
            probs=s["probs"],
            o_part=a["o_part"],
            lse_part=a["lse_part"],
            cand=s["cand"],
            sel=s["sel"],
            counters=max(s["counters"], a["counters"]),
        )

    def fits(self, plan: DecodePlan) -> bool:
        return all(n <= self.caps[k] for k, n in self.needs(plan).items())

    def views(self, plan: DecodePlan) -> tuple[ScoreScratch, AttentionScratch]:
        """The buffers of one call (views: nothing allocated)."""
        assert self.fits(plan), f"the workspace ({self.caps}) is too small for {self.needs(plan)}"
        s = plan.score
        rows_h = s.batch * s.num_kv_heads
        f, i = self._f32_offsets, self._i32_offsets

        def f32(name, n):
            return self.f32[f[name] : f[name] + n]

        def i32(name, n):
            return self.i32[i[name] : i[name] + n]

        need = self.needs(plan)
        probs = None
        if need["probs"]:
            probs = f32("probs", need["probs"]).view(s.batch, s.num_kv_heads, s.max_pages)
        score = ScoreScratch(
            logits=f32("logits", max(1, need["logits"])),
            part_m=f32("part_m", need["part"]),
            part_l=f32("part_l", need["part"]),
            probs=probs,
            cand_bits=i32("cand_bits", need["cand"]),
            cand_pages=i32("cand_pages", need["cand"]),
            counters=self.counters[:rows_h],
            sel=i32("sel", need["sel"]).view(s.batch, s.num_kv_heads, s.n_sel),
        )
        attention = AttentionScratch(
            o_part=f32("o_part", max(1, need["o_part"])),
            lse_part=f32("lse_part", max(1, need["lse_part"])),
            counters=self.counters[:rows_h],
        )
        return score, attention


def _offsets(items) -> dict[str, int]:
    """Start of each named region in one flat buffer (64-byte aligned);
    '_end': the total."""
    out, pos = {}, 0
    for name, n in items:
        out[name] = pos
        pos += cdiv(max(0, int(n)), 16) * 16
    out["_end"] = pos
    return out


def hsa_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kt_cache: torch.Tensor,
    rows: DecodeRows,
    page_size: int,
    scale: float,
    force_current_page: bool = False,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    selections: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stage 2 for one decode token per row (its K/V already in the cache at
    slot seq_lens[b] - 1): KT update, page scoring, top-n pages, sparse
    attention, in three launches. Returns out [B, Hq, d].

    query [B, Hq, d] (last dim contiguous; cast to the cache dtype);
    k_cache, v_cache [num_blocks, Hkv, bs, d] views (all strides
    arbitrary, the channel dim's included: see ``kernels``);
    rows: the decode rows (``kernels.rows.DecodeRows``): block_table
    [B, max_blocks] int32 (last dim contiguous), [B] integer columns on the
    device; rows.max_pages >= every row's view page count
    ceil(num_compact/ps) + ceil((seq_len - tail_start)/ps); rows.max_select
    >= every row's max(topk // ps, 1) (with force_current_page the current
    page is selected on top of those: the buffers get max_select + 1
    entries here). Rows with seq_lens <= 0 are padding: nothing is written
    for them (a given ``out`` keeps its values there; an allocated one
    holds 0).
    sinks: optional [Hq] fp32 sink logits (``algorithm.sinks``), in the
    sparse attention's softmax only; the page scoring ranks the keys' own
    mass. workspace: the scratch to use (``DecodeWorkspace``; else
    allocated for this call).
    selections: the selection store int32 [S, Hkv, W] contiguous, read
    with rows.sel_slot ([B] int32, -1: none) and rows.reuse ([B] int32):
    ``Stage2.decode``'s contract (a reusing row attends
    selections[slot, h, :n_use], its KT page still updated, unless those
    entries are not all pages of its view: then that (row, KV head) selects
    anew; another row with a slot stores its n_use pages there, in
    ascending page order, where n_use <= W). None: the rows' slots are not
    read. The test switches are ``hsa_decode_checked``'s.
    """
    return _decode(
        query,
        k_cache,
        v_cache,
        kt_cache,
        rows,
        page_size,
        scale,
        force_current_page,
        out,
        sinks,
        workspace,
        selections,
    )


def hsa_decode_checked(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kt_cache: torch.Tensor,
    rows: DecodeRows,
    page_size: int,
    scale: float,
    force_current_page: bool = False,
    out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    *,
    update_kt: bool = True,
    select_impl: str = "auto",
    probs_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``hsa_decode`` (no selection store) with the tests' switches, kept
    out of the production entry: update_kt False skips the KT refresh;
    select_impl "torch" chooses with torch.topk on the probabilities (more
    launches, for checking; "auto" / "triton": the selection kernel);
    probs_out: a [B, Hkv, max_pages] fp32 tensor that receives the page
    probabilities (each row's own pages only)."""
    if select_impl not in ("auto", "triton", "torch"):
        raise ValueError(f"select_impl: 'auto', 'triton' or 'torch', not {select_impl!r}")
    return _decode(
        query,
        k_cache,
        v_cache,
        kt_cache,
        rows,
        page_size,
        scale,
        force_current_page,
        out,
        sinks,
        workspace,
        None,
        update_kt,
        select_impl == "torch",
        probs_out,
    )


def _decode(
    query,
    k_cache,
    v_cache,
    kt_cache,
    rows: DecodeRows,
    page_size: int,
    scale: float,
    force_current_page: bool,
    out,
    sinks,
    workspace,
    selections,
    update_kt: bool = True,
    torch_select: bool = False,
    probs_out: torch.Tensor | None = None,
) -> torch.Tensor:
    k_view, fp8, _ = kv_operand(k_cache)
    v_view, _, _ = kv_operand(v_cache)
    if query.stride(-1) != 1:
        query = query.contiguous()
    scores_q = query  # the scoring reads the query as given (fp32 inside)
    query, out, sinks, hkv, _, d, group = sparse_decode._prepare(
        query, k_view, v_view, out, sinks, fp8
    )
    rows.store_width(selections, hkv)  # checked before any launch
    batch, hq, _ = query.shape
    if batch == 0:
        return out
    rows = rows.flat()
    dev = query.device
    plan = plan_decode(
        batch,
        hq,
        hkv,
        d,
        rows.max_pages,
        rows.max_select,
        page_size,
        force_current_page,
        query.dtype,
        hsa_score.num_sms(dev),
        sparse_decode.num_sms(dev),
    )
    if workspace is not None and workspace.fits(plan):
        score_scratch, attn_scratch = workspace.views(plan)
    else:
        score_scratch = ScoreScratch.alloc(plan.score, hq, dev)
        attn_scratch = AttentionScratch.alloc(plan.attention, hq, d, dev)
    if probs_out is not None:
        assert probs_out.shape == (batch, hkv, plan.score.max_pages) and probs_out.is_contiguous()
        score_scratch.probs = probs_out
    elif torch_select and score_scratch.probs is None:
        score_scratch.probs = torch.empty(
            batch, hkv, plan.score.max_pages, device=dev, dtype=torch.float32
        )
    launch_score(
        plan.score,
        score_scratch,
        scores_q,
        kt_cache,
        rows,
        page_size,
        k_cache=k_cache if update_kt else None,
        selections=selections,
        force_current_page=force_current_page,
    )
    launch_select(
        plan.score,
        score_scratch,
        hq,
        rows,
        page_size,
        force_current_page,
        select=not torch_select,
        write_probs=probs_out is not None or torch_select,
        selections=selections,
    )
    if torch_select:
        sel = page_select.select_pages(
            score_scratch.probs,
            rows.max_select,
            rows.num_compact,
            rows.tail_start,
            rows.seq_lens,
            rows.topk,
            page_size,
            "torch",
            force_current_page,
        )
    else:
        sel = score_scratch.sel
    return sparse_decode.sparse_decode(
        query,
        k_cache,
        v_cache,
        rows,
        sel,
        page_size,
        scale,
        out=out,
        extra_pages=1 if force_current_page else 0,
        sinks=sinks,
        scratch=attn_scratch,
        plan=plan.attention,
    )


# ---- the stages (``ops.base``'s interfaces)


class TritonStage1(Stage1):
    name = "Triton kernels"
    window_scores = staticmethod(window_scores)
    compact_kept_tokens = staticmethod(compact_kept_tokens)
    write_kt_pages = staticmethod(write_kt_pages)


class TritonStage2(Stage2):
    name = "Triton kernels"
    fixed_shapes = True

    @staticmethod
    def eager_chunk(num_q_heads: int, num_kv_heads: int, max_pages: int, workspace=None) -> int:
        """Rows of one eager call: what ``SCRATCH_BYTES`` holds (and the
        workspace serves), a multiple of 16 past 16 so every chunk's row
        vectors start 16-byte aligned (``backend.warmup``)."""
        per_row = scratch_bytes_per_row(num_q_heads, num_kv_heads, max_pages)
        chunk = max(1, base.SCRATCH_BYTES // per_row)
        if workspace is not None:
            chunk = min(chunk, workspace.rows)
        return chunk if chunk < 16 else chunk // 16 * 16

    def decode(
        self, query, kv_cache, rows, scale, out=None, sinks=None, quant=None, selections=None
    ):
        if out is not None:  # FULL-graph layout: one call, shapes fixed at capture
            return self._decode(query, kv_cache, rows, scale, out, sinks, quant, selections)
        chunk = self.eager_chunk(
            query.shape[1], kv_cache.shape[1], rows.decode_rows.max_pages, rows.workspace
        )
        batch = query.shape[0]
        if batch <= chunk:
            return self._decode(query, kv_cache, rows, scale, None, sinks, quant, selections)
        parts = [
            self._decode(
                query[a : a + chunk],
                kv_cache,
                rows.slice(a, a + chunk),
                scale,
                None,
                sinks,
                quant,
                selections,
            )
            for a in range(0, batch, chunk)
        ]
        return torch.cat(parts)

    def eager_plan(
        self,
        batch: int,
        num_q_heads: int,
        query_dtype: torch.dtype,
        kv_cache: torch.Tensor,
        quant,
        max_pages: int,
        max_select: int,
    ) -> DecodePlan:
        """The plan an eager ``decode`` of ``batch`` rows launches
        (``hsa_decode``'s), for the warm-up to tell its specializations."""
        k_cache, _ = split_kv(kv_cache, self.kv_layout, quant)
        k_view, fp8, _ = kv_operand(k_cache)
        hkv, _, d = check_kv_cache(k_view)
        dev = k_view.device
        return plan_decode(
            batch,
            num_q_heads,
            hkv,
            d,
            max_pages,
            max_select,
            self.settings.page_size,
            self.settings.force_current_page,
            sparse_decode.compute_dtype(query_dtype, k_view, fp8),
            hsa_score.num_sms(dev),
            sparse_decode.num_sms(dev),
        )

    def _decode(self, query, kv_cache, rows: HsaRows, scale, out, sinks, quant, selections):
        s = self.settings
        k_cache, v_cache = split_kv(kv_cache, self.kv_layout, quant)
        return hsa_decode(
            query,
            k_cache,
            v_cache,
            self._kt(kv_cache),
            rows.decode_rows,
            s.page_size,
            scale,
            s.force_current_page,
            out=out,
            sinks=sinks,
            workspace=rows.workspace,
            selections=selections,
        )

    def make_workspace(self, device, num_q_heads, num_kv_heads, head_dim, shapes):
        """One ``DecodeWorkspace`` covering every shape (the FULL graph's,
        the eager steps'): page logits, split partials, candidates,
        selection, attention partials, merge counters."""
        (rows, max_pages, max_select), *others = shapes
        return DecodeWorkspace(
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
        nbytes = min(base.SCRATCH_BYTES, per_row * max_rows) if max_rows else 0
        if nbytes and device.type == "cuda":
            scratch = torch.empty(nbytes, dtype=torch.uint8, device=device)
            del scratch  # back to the allocator's cache, counted in the peak
