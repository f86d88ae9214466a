"""The metadata builder as both of vLLM's model runners call it.

The CPU build runs the V1 model runner (prompt lengths in a host tensor);
NVIDIA defaults to Model Runner V2, which passes each row's request slot
(``req_idx``). Prompt lengths reach the builder through the runner hooks
(``vllm_patches``): V1's input-batch tensor, V2's record per slot, and a
mark on dummy runs. These tests build ``CommonAttentionMetadata`` as each
runner does, leave what its hooks leave, and check what the builder plans
and that the decode rows it builds give the per-request oracle's Stage 2
output.
"""

import numpy as np
import pytest
import torch
from reference import paged

from rocketkv_vllm.layout import kt_cache_view, split_kv
from rocketkv_vllm.plan import plan_request

BS = 16
HKV, G, D = 3, 3, 64


def _make_builder(model_path, rocketkv: dict, max_model_len: int, testing=None, **engine_kw):
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from rocketkv_vllm import plugin
    from rocketkv_vllm.backend import RocketKVBackend
    from rocketkv_vllm.backend.metadata import RocketKVMetadataBuilder

    plugin.register()
    extra = {"rocketkv": rocketkv}
    if testing:
        extra["rocketkv_testing"] = testing
    cfg = EngineArgs(
        model=model_path,
        attention_backend="ROCKETKV",
        dtype="float32",
        max_model_len=max_model_len,
        enforce_eager=True,
        additional_config=extra,
        **engine_kw,
    ).create_engine_config()
    with set_current_vllm_config(cfg):
        spec = RocketKVBackend.customize_spec(
            FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
        )
        return RocketKVMetadataBuilder(
            spec, ["model.layers.0.self_attn.attn"], cfg, torch.device("cpu")
        )


@pytest.fixture(scope="module")
def builder(model_path):
    return _make_builder(model_path, {"token_budget": 256}, 8192)


def _cm(builder, rows, block_table, runner="v2", req_idx=None):
    """rows: (context_len, q_len, prompt_len) per request. ``runner``: what
    the runner hooks (vllm_patches) leave for the builder before it builds:
    "v1" the V1 input batch's prompt lengths in row order, "v2" nothing
    (the lengths were recorded when the requests took their slots,
    ``_v2_new_requests``), "dummy" a dummy run (profiling, capture)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    requests = builder.state.requests
    requests.dummy = runner == "dummy"
    if runner == "v1":
        lens = torch.tensor([p for _, _, p in rows] + [-7], dtype=torch.int32)
        requests.v1_prompt_lens = lens  # a row past the batch: never read
    q_lens = [q for _, q, _ in rows]
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32)
    seq = torch.tensor([c + q for c, q, _ in rows], dtype=torch.int32)
    n = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl,
        seq_lens=seq,
        seq_lens_cpu_upper_bound=seq.clone(),
        num_reqs=len(rows),
        num_actual_tokens=n,
        max_query_len=max(q_lens),
        max_seq_len=int(seq.max()),
        block_table_tensor=block_table[: len(rows)],
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        req_idx=None if req_idx is None else np.array(req_idx, dtype=np.int32),
    )


def _block_table(num_reqs):
    return torch.arange(num_reqs * 512, dtype=torch.int32).view(num_reqs, 512) + 1


def test_capture_and_dummy_batches_without_prompt_lengths_are_dense(builder):
    # V2's make_dummy / capture: prompt lengths None, no request slots.
    md = builder.build(
        0, _cm(builder, [(3000, 1, 3000), (0, 8, 8)], _block_table(2), runner="dummy")
    )
    assert md.native is not None
    assert md.decode is None and not md.stage1_rows and not md.recompute


def _v2_new_requests(builder, slots_and_lengths, budgets=None):
    """What Model Runner V2's add_requests hook records (vllm_patches):
    each new request's slot, prompt length and own budget."""
    from types import SimpleNamespace

    new, index = [], {}
    for i, (slot, n) in enumerate(slots_and_lengths):
        budget = None if budgets is None else budgets[i]
        args = None if budget is None else {"rocketkv_token_budget": budget}
        new.append(
            SimpleNamespace(
                req_id=f"q{slot}", prompt_len=n, sampling_params=SimpleNamespace(extra_args=args)
            )
        )
        index[f"q{slot}"] = slot
    builder.state.requests.v2_add(SimpleNamespace(scheduled_new_reqs=new), index)


def test_v2_prompt_lengths_come_from_the_slots(builder):
    """Under Model Runner V2 the lengths come from the new requests the
    runner is sent (recorded per slot by its add_requests hook), so no step
    waits for the device, also with prefix caching (a new request's first
    chunk may start past a cache hit)."""
    s = builder.settings
    table = _block_table(3)
    unknown = builder.prompt_lengths.unknown_slots
    # Step 1: a compressed request decoding, a short one decoding, a long
    # prompt's first chunk (all three slots new to the builder).
    _v2_new_requests(builder, [(5, 3000), (2, 100), (7, 5000)])
    md = builder.build(
        0, _cm(builder, [(3000, 1, 3000), (119, 1, 100), (0, 512, 5000)], table, req_idx=[5, 2, 7])
    )
    plan = plan_request(s, 3000)
    assert plan.compress and not plan_request(s, 100).compress
    assert md.decode is not None
    assert md.decode.tokens.tolist() == [0]
    assert md.decode.decode_rows.seq_lens.tolist() == [3001]
    assert md.decode.decode_rows.num_compact.tolist() == [plan.num_compact]
    assert md.decode.decode_rows.tail_start.tolist() == [plan.tail_start]
    assert md.decode.decode_rows.topk.tolist() == [plan.topk]
    assert md.decode.decode_rows.topr.tolist() == [plan.topr]
    assert torch.equal(md.decode.decode_rows.block_table, table[[0]])
    assert not md.stage1_rows and not md.window_rows

    # Step 2: same requests, no new one.
    md = builder.build(
        0, _cm(builder, [(3001, 1, 0), (120, 1, 0), (512, 512, 0)], table, req_idx=[5, 2, 7])
    )
    assert md.decode.decode_rows.seq_lens.tolist() == [3002]

    # Step 3: the long prompt's last chunk (Stage 1 and its window), and
    # slot 5 reused by a new short request whose first chunk starts after a
    # prefix-cache hit of 32 tokens: planned afresh.
    _v2_new_requests(builder, [(5, 72)])
    md = builder.build(
        0, _cm(builder, [(32, 40, 0), (121, 1, 100), (4608, 392, 5000)], table, req_idx=[5, 2, 7])
    )
    assert md.decode is None
    assert [(r.q_start, r.q_end, r.context_len) for r in md.stage1_rows] == [(41, 433, 4608)]
    assert md.stage1_rows[0].key == 7
    assert md.stage1_rows[0].plan == plan_request(s, 5000)
    assert builder.prompt_lengths.unknown_slots == unknown

    # A slot no hook recorded (not expected) is a request too short to
    # compress, and counted.
    md = builder.build(0, _cm(builder, [(3000, 1, 3000)], table, req_idx=[40]))
    assert md.decode is None and md.native is not None
    assert builder.prompt_lengths.unknown_slots == unknown + 1


def test_v1_prompt_lengths_on_the_host(builder):
    md = builder.build(
        0, _cm(builder, [(3000, 1, 3000), (700, 3, 700)], _block_table(2), runner="v1")
    )
    plan = plan_request(builder.settings, 700)
    # Three tokens wholly after a compressed prompt (recomputed after a
    # preemption): one Stage 2 row each, in order, growing seq_len.
    assert plan.compress
    assert [r.tokens.tolist() for r in md.recompute] == [[1], [2], [3]]
    assert [r.decode_rows.seq_lens.tolist() for r in md.recompute] == [[701], [702], [703]]
    assert md.decode.tokens.tolist() == [0]


def _compressed_requests(s, prompts: dict[int, int], table, gen, budgets=None):
    """A CPU_ATTN-layout cache (NaN everywhere unwritten) holding, for each
    batch row: prompt length in ``prompts``, the prompt compressed by the
    oracle's Stage 1 (at the row's own budget in ``budgets``, if any) plus
    one new token. Fills those rows of ``table``. Returns (kv, k, v, kt)."""
    budgets = budgets or {}
    num_blocks = 1 + sum(-(-(n + 4) // BS) for n in prompts.values())
    pages = BS // s.page_size
    block_elems = HKV * BS * 2 * D + HKV * pages * 2 * D
    storage = torch.full((num_blocks * block_elems,), float("nan"))
    kv = torch.as_strided(
        storage, (num_blocks, HKV, BS, 2 * D), (block_elems, BS * 2 * D, 2 * D, 1)
    )
    k, v = split_kv(kv, "cpu_vec")
    kt = kt_cache_view(kv, s.page_size)
    first = 1
    for i, n in prompts.items():
        nb = -(-(n + 4) // BS)
        table[i, :nb] = torch.arange(first, first + nb)
        first += nb
        slots = torch.arange(n + 1)
        row = table[i].long()
        paged.write_kv(
            k,
            v,
            torch.randn(n + 1, HKV, D, generator=gen),
            torch.randn(n + 1, HKV, D, generator=gen),
            row[slots // BS] * BS + slots % BS,
        )
        plan = plan_request(s, n, budgets.get(i))
        assert plan.compress
        q_win = torch.randn(s.window_size, HKV * G, D, generator=gen)
        paged.snapkv_compress(
            k,
            v,
            kt,
            row,
            q_win,
            n,
            plan.prompt_budget,
            plan.tail_start,
            s.kernel_size,
            s.page_size,
            D**-0.5,
        )
    return kv, k, v, kt


def _check_against_oracle(
    s, got, query, k, v, oracle_kt, table, prompts: dict[int, int], budgets=None
):
    """Each row in ``prompts`` (row: prompt length) decoding its first new
    token (at its own budget in ``budgets``, if any): the per-request
    oracle's Stage 2 output."""
    budgets = budgets or {}
    for i, n in prompts.items():
        plan = plan_request(s, n, budgets.get(i))
        want = paged.hsa_decode(
            query[i],
            k,
            v,
            oracle_kt,
            table[i].long(),
            plan.num_compact,
            plan.tail_start,
            n + 1,
            plan.topk,
            plan.topr,
            s.page_size,
            D**-0.5,
            s.force_current_page,
        )
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-5)


def test_decode_rows_drive_stage2_like_the_oracle(builder):
    """The builder's decode rows through the engine's Stage 2 give the
    per-request oracle's output."""
    s = builder.settings
    prompts = [3000, 1800, 700]
    gen = torch.Generator().manual_seed(0)
    table = torch.zeros(len(prompts), 512, dtype=torch.int32)
    kv, k, v, kt = _compressed_requests(s, dict(enumerate(prompts)), table, gen)
    _v2_new_requests(builder, [(10 + i, n) for i, n in enumerate(prompts)])
    md = builder.build(0, _cm(builder, [(n, 1, n) for n in prompts], table, req_idx=[10, 11, 12]))
    rows = md.decode
    query = torch.randn(len(prompts), HKV * G, D, generator=gen)
    oracle_kt = kt.clone()
    # The engine's Stage 2 on CPU (the C++ kernel where it builds, else
    # batched PyTorch), through the interface the impl calls.
    assert builder.stage2.kv_layout == "cpu_vec"
    got = builder.stage2.decode(query, kv, rows, D**-0.5)
    _check_against_oracle(s, got, query, k, v, oracle_kt, table, dict(enumerate(prompts)))


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_rows_follow_their_requests_budgets(builder, runner):
    """Per-request budgets (``requests``) as each model runner's hook
    leaves them: V2 per request slot, V1 per row of this step. A row with
    budget 0 stays dense, one with its own budget gets that budget's plan,
    the others the engine's; the selection buffers fit the largest."""
    s = builder.settings
    requests = builder.state.requests
    rows = [(3000, 1, 3000), (3000, 1, 3000), (3000, 1, 3000), (2000, 1, 2000)]
    budgets = [0, 2048, None, 64]
    try:
        if runner == "v2":
            _v2_new_requests(builder, [(30 + i, n) for i, (_, _, n) in enumerate(rows)], budgets)
            cm = _cm(builder, rows, _block_table(4), req_idx=[30, 31, 32, 33])
        else:
            requests.rows = budgets[:3]  # a row past the list: no budget
            cm = _cm(builder, rows, _block_table(4), runner="v1")
        md = builder.build(0, cm)
    finally:
        requests.by_slot.clear()
        requests.rows = []
    plans = [plan_request(s, n, b) for (_, _, n), b in zip(rows, budgets)]
    if runner == "v1":
        plans[3] = plan_request(s, 2000)
    assert not plans[0].compress
    assert plans[1].topk > plans[2].topk and plans[1].num_compact > plans[2].num_compact
    assert md.decode.tokens.tolist() == [1, 2, 3]
    assert md.decode.decode_rows.topk.tolist() == [p.topk for p in plans[1:]]
    assert md.decode.decode_rows.num_compact.tolist() == [p.num_compact for p in plans[1:]]
    assert md.decode.decode_rows.topr.tolist() == [p.topr for p in plans[1:]]
    assert md.decode.decode_rows.max_select >= max(p.topk // s.page_size for p in plans[1:])


class _EngineConfig:
    """Stands in for an engine's VllmConfig (the key of its worker state)."""


def test_model_runner_hooks_record_budgets_per_slot_and_row():
    """The hooks (vllm_patches) wrap vLLM internals, checked by signature,
    and leave each request's budget and prompt length where the builder
    looks: V2 by the slot its request table gives it, V1 by row after the
    persistent batch is reordered; dummy runs are marked. Engines with
    another backend are left alone."""
    from types import SimpleNamespace

    from rocketkv_vllm import vllm_patches
    from rocketkv_vllm.state import PromptLengths, worker_state
    from rocketkv_vllm.vllm_patches.model_runner import (
        _v1_dummy_run,
        _v1_update_states,
        _v2_add_requests,
        _v2_gather_batch_req_state,
    )

    for name in ("add_requests", "_update_states", "_dummy_run", "gather_batch_req_state"):
        [patch] = [
            p for p in vllm_patches.PATCHES if p.owner == "GPUModelRunner" and p.name == name
        ]
        assert vllm_patches.installed(patch)  # and its signature matched

    def new(req_id, budget, n=10):
        args = None if budget is None else {"rocketkv_token_budget": budget}
        return SimpleNamespace(
            req_id=req_id, prompt_len=n, sampling_params=SimpleNamespace(extra_args=args)
        )

    ours, other = _EngineConfig(), _EngineConfig()  # two engines' configs
    state = worker_state(ours)

    class V2Runner:  # what add_requests does to the request table
        def __init__(self, vllm_config):
            self.vllm_config = vllm_config
            self.req_states = SimpleNamespace(req_id_to_index={})

        def add_requests(self, out):
            for r in out.scheduled_new_reqs:
                self.req_states.req_id_to_index[r.req_id] = 2 + len(self.req_states.req_id_to_index)

        def gather_batch_req_state(self, out, dummy_run):
            return None, None

    class V1Runner:  # _update_states ends with the batch in its final order
        def __init__(self, vllm_config):
            self.vllm_config = vllm_config
            lens = torch.zeros(8, dtype=torch.int32)
            self.input_batch = SimpleNamespace(req_ids=[], num_prompt_tokens_cpu_tensor=lens)
            self.prompt_len = {}

        def _update_states(self, out):
            batch = self.input_batch
            ids = [r for r in batch.req_ids if r not in out.finished_req_ids]
            ids += [r.req_id for r in out.scheduled_new_reqs]
            self.prompt_len.update({r.req_id: r.prompt_len for r in out.scheduled_new_reqs})
            batch.req_ids = sorted(ids)
            for row, r in enumerate(batch.req_ids):
                batch.num_prompt_tokens_cpu_tensor[row] = self.prompt_len[r]

        def _dummy_run(self, num_tokens):
            return state.requests.dummy

    V2Runner.add_requests = _v2_add_requests(V2Runner.add_requests)
    V1Runner._update_states = _v1_update_states(V1Runner._update_states)
    V1Runner._dummy_run = _v1_dummy_run(V1Runner._dummy_run)
    V2Runner.gather_batch_req_state = _v2_gather_batch_req_state(V2Runner.gather_batch_req_state)
    lengths = PromptLengths(state.requests)

    runner = V2Runner(ours)
    runner.add_requests(
        SimpleNamespace(scheduled_new_reqs=[new("a", 0, 100), new("b", None), new("c", 512, 300)])
    )
    cm = SimpleNamespace(num_reqs=3, req_idx=np.array([4, 2, 3]))
    assert state.requests.budgets_for_rows(cm) == [512, 0, None]
    assert state.requests.prompt_lens_for_slots(np.array([4, 2, 9])).tolist() == [300, 100, -1]
    V2Runner(other).add_requests(SimpleNamespace(scheduled_new_reqs=[new("d", 64)]))

    assert lengths.get(cm, 3).tolist() == [300, 100, 10]
    runner.gather_batch_req_state(None, True)  # a V2 dummy run: all dense
    assert lengths.get(cm, 3) is None
    runner.gather_batch_req_state(None, False)
    assert lengths.get(cm, 3).tolist() == [300, 100, 10]

    runner = V1Runner(ours)
    runner._update_states(
        SimpleNamespace(
            finished_req_ids=set(),
            preempted_req_ids=set(),
            scheduled_new_reqs=[new("z", 64, 700), new("y", None, 20)],
        )
    )
    v1 = SimpleNamespace(num_reqs=2, req_idx=None)
    assert state.requests.budgets_for_rows(v1) == [None, 64]
    assert lengths.get(v1, 2).tolist() == [20, 700]
    runner._update_states(
        SimpleNamespace(
            finished_req_ids={"z"}, preempted_req_ids=None, scheduled_new_reqs=[new("x", 0)]
        )
    )
    assert state.requests.budgets_for_rows(v1) == [0, None]
    assert lengths.get(v1, 2).tolist() == [10, 20]
    # A dummy run is marked while it runs, and only then.
    assert runner._dummy_run(8) is True
    assert not state.requests.dummy and lengths.get(v1, 2) is not None
    assert "z" not in state.requests.by_request
    from rocketkv_vllm.state import existing_worker_state

    assert existing_worker_state(other) is None  # another engine: untouched


# --------------------------------------------------------------------------
# FULL CUDA graphs for decode (backend.graphs): a graph replays the launch
# and tensors of its capture; only build() runs for the step.


@pytest.fixture(scope="module")
def graph_builder(model_path):
    """A builder that lays decode steps out for FULL graphs (forced here:
    the CPU build captures none) with the Triton kernels."""
    return _make_builder(
        model_path,
        {"token_budget": 256, "kernel": "triton"},
        4096,
        testing={"force_graph_layout": True},
    )


def _graph_tensors(rows):
    columns = ("block_table", "num_compact", "tail_start", "seq_lens", "topk", "topr")
    return {"tokens": rows.tokens} | {n: getattr(rows.decode_rows, n) for n in columns}


def test_graph_step_replays_its_capture(graph_builder):
    """Capture a 4-row decode batch (V2: no prompt lengths), then build a
    real step padded to it (3 requests, one padding row) and run Stage 2
    with the CAPTURE's metadata object, as the replayed graph does: the
    compressed rows get the oracle's output, the others keep the native
    output, and every tensor Stage 2 reads is the one captured."""
    from rocketkv_vllm.ops import triton as triton_ops

    b = graph_builder
    s = b.settings
    assert b.get_cudagraph_support(b.vllm_config, b.kv_cache_spec).name == "NEVER"  # CPU
    table = torch.zeros(4, 512, dtype=torch.int32)
    capture = b.build(0, _cm(b, [(5, 1, 0)] * 4, table, runner="dummy"))
    assert b.graph is not None and capture.decode is not None
    assert capture.decode.in_place and capture.decode.decode_rows.seq_lens.tolist() == [0] * 4
    assert capture.decode.decode_rows.max_pages == b.graph.max_pages
    assert b.graph.max_pages == -(-4096 // s.page_size) + 1
    assert b.graph.max_select == max(256 // 2 // s.page_size, 1)

    gen = torch.Generator().manual_seed(3)
    _, k, v, kt = _compressed_requests(s, {0: 1800, 2: 700}, table, gen)
    # rows: compressed, short (dense), compressed, V2 padding (no request)
    _v2_new_requests(b, [(4, 1800), (9, 90), (6, 700)])
    cm = _cm(b, [(1800, 1, 1800), (90, 1, 90), (700, 1, 700), (0, 1, 0)], table, req_idx=[4, 9, 6])
    cm.seq_lens[3] = 0
    cm.seq_lens_cpu_upper_bound[3] = 0
    step = b.build(0, cm)
    assert step.decode.in_place
    assert step.decode.decode_rows.seq_lens.tolist() == [1801, 0, 701, 0]
    for name, t in _graph_tensors(step.decode).items():
        assert t.data_ptr() == _graph_tensors(capture.decode)[name].data_ptr(), name
    assert b.graph_buffers.native_seq_lens[:4].tolist() == [1, 91, 1, 0]

    query = torch.randn(4, HKV * G, D, generator=gen)
    native = torch.randn(4, HKV * G, D, generator=gen)  # the native backend's output
    out = native.clone()
    oracle_kt = kt.clone()
    rows = capture.decode  # what the graph was captured with
    triton_ops.hsa_decode(
        query[: rows.tokens.shape[0]],
        k,
        v,
        kt,
        rows.decode_rows,
        s.page_size,
        D**-0.5,
        s.force_current_page,
        out=out,
    )
    _check_against_oracle(s, out, query, k, v, oracle_kt, table, {0: 1800, 2: 700})
    assert torch.equal(out[1], native[1]) and torch.equal(out[3], native[3])


def test_graph_layout_leaves_prompt_steps_and_large_selections_eager(graph_builder):
    """What a graph cannot run stays in the ordinary layout, and the runner
    hooks keep vLLM from replaying a graph for it: a one-token prompt chunk
    (here the prompt's last token: Stage 1) and a request whose own budget
    selects more pages than the graph holds."""
    b = graph_builder
    s = b.settings
    table = _block_table(2)
    b.build(0, _cm(b, [(5, 1, 0)] * 2, table, runner="dummy"))  # sets the guard
    guard = b.state.graph_guard
    _v2_new_requests(b, [(1, 3000), (2, 3000)])
    md = b.build(0, _cm(b, [(3000, 1, 3000), (2999, 1, 3000)], table, req_idx=[1, 2]))
    assert len(md.stage1_rows) == 1 and not md.decode.in_place
    assert guard.needs_eager(np.array([False, True]), [None, None])

    big = 8 * 256  # selects 4x the pages of the engine's budget
    _v2_new_requests(b, [(1, 3000), (2, 3000)], [big, None])
    md = b.build(0, _cm(b, [(3000, 1, 3000), (3000, 1, 3000)], table, req_idx=[1, 2]))
    assert not md.decode.in_place
    assert md.decode.decode_rows.topk.tolist() == [
        plan_request(s, 3000, big).topk,
        plan_request(s, 3000).topk,
    ]
    assert guard.needs_eager(np.array([False, False]), [big, None])
    assert not guard.needs_eager(np.array([False, False]), [256, 0, None])
    _v2_new_requests(b, [(1, 3000), (2, 3000)])
    md = b.build(0, _cm(b, [(3000, 1, 3000), (3000, 1, 3000)], table, req_idx=[1, 2]))
    assert md.decode.in_place


def test_graph_hooks_wrap_the_runners_dispatch_inputs():
    """The hooks wrap the two vLLM internals that decide whether a step is a
    uniform decode (checked by signature at install and by the fields they
    use)."""
    import vllm.v1.worker.gpu.model_runner as v2

    from rocketkv_vllm import vllm_patches

    for name in ("_determine_batch_execution_and_padding", "gather_batch_req_state"):
        [patch] = [
            p for p in vllm_patches.PATCHES if p.owner == "GPUModelRunner" and p.name == name
        ]
        assert vllm_patches.installed(patch)
    assert {"is_prefilling_np", "idx_mapping_np", "decode_graph_eligible"} <= set(
        v2.BatchReqState._fields
    )


def test_graph_hooks_keep_prompt_chunks_and_large_selections_off_full_graphs():
    """The hooks' effect on stand-ins with the wrapped methods' signatures:
    with a graph shape in force, a one-token step holding a prompt chunk or
    a request with a larger budget than the graph holds is not a uniform
    decode (vLLM then runs it piecewise); otherwise nothing changes."""
    from collections import namedtuple
    from types import SimpleNamespace

    from rocketkv_vllm.backend.graphs import DecodeGraphShape, GraphGuard
    from rocketkv_vllm.state import worker_state
    from rocketkv_vllm.vllm_patches.model_runner import (
        _v1_batch_execution,
        _v2_gather_batch_req_state,
    )

    config = _EngineConfig()
    state = worker_state(config)

    class V1Runner:
        def __init__(self, computed, prompts):
            self.vllm_config = config
            self.input_batch = SimpleNamespace(
                num_computed_tokens_cpu=np.array(computed), num_prompt_tokens=np.array(prompts)
            )

        def _determine_batch_execution_and_padding(
            self,
            num_tokens,
            num_reqs,
            num_scheduled_tokens_np,
            max_num_scheduled_tokens,
            use_cascade_attn=False,
            force_uniform_decode=None,
        ):
            return force_uniform_decode

    State = namedtuple("State", "idx_mapping_np is_prefilling_np decode_graph_eligible")

    class V2Runner:
        def __init__(self, state):
            self.vllm_config = config
            self.state = state

        def gather_batch_req_state(self, scheduler_output, dummy_run):
            return self.state, 1

    V1Runner._determine_batch_execution_and_padding = _v1_batch_execution(
        V1Runner._determine_batch_execution_and_padding
    )
    V2Runner.gather_batch_req_state = _v2_gather_batch_req_state(V2Runner.gather_batch_req_state)

    def v1(computed, prompts, max_q=1):
        return V1Runner(computed, prompts)._determine_batch_execution_and_padding(
            num_tokens=len(computed),
            num_reqs=len(computed),
            num_scheduled_tokens_np=np.ones(len(computed), dtype=np.int32),
            max_num_scheduled_tokens=max_q,
        )

    def v2(prefilling, slots=(0, 1)):
        state = State(np.array(slots), np.array(prefilling), True)
        return V2Runner(state).gather_batch_req_state(None, False)

    assert v1([10, 99], [10, 100]) is None  # no graph shape: untouched
    state.graph_guard = GraphGuard(
        DecodeGraphShape(rows=8, max_pages=1025, max_select=32), page_size=4
    )
    assert v1([10, 50], [10, 40]) is None  # decodes only
    assert v1([10, 99], [10, 100]) is False  # the prompt's last token
    assert v1([10, 99], [10, 100], max_q=2) is None  # not a decode step anyway
    got, count = v2([False, False])
    assert count == 1 and got.decode_graph_eligible is True
    got, count = v2([False, True])
    assert count is None and got.decode_graph_eligible is False
    state.requests.by_slot.update({0: 4 * 2 * 32, 1: None})  # 32 pages: fits
    state.requests.rows = [4 * 2 * 32, None]
    assert v2([False, False])[1] == 1 and v1([10, 50], [10, 40]) is None
    state.requests.by_slot[0] = state.requests.rows[0] = 4 * 2 * 33  # 33 pages
    assert v2([False, False])[1] is None and v1([10, 50], [10, 40]) is False


def test_eager_triton_stage2_runs_large_batches_in_row_chunks(model_path, monkeypatch):
    """An eager Stage 2 call keeps its scratch under SCRATCH_BYTES by running
    the batch in row chunks: the same output as one call, the oracle's."""
    from rocketkv_vllm.ops import base
    from rocketkv_vllm.ops.triton import TritonStage2

    b = _make_builder(model_path, {"token_budget": 256, "kernel": "triton"}, 8192)
    assert isinstance(b.stage2, TritonStage2)
    s = b.settings
    prompts = [3000, 1800, 700]
    gen = torch.Generator().manual_seed(5)
    table = torch.zeros(len(prompts), 512, dtype=torch.int32)
    kv, k, v, kt = _compressed_requests(s, dict(enumerate(prompts)), table, gen)
    md = b.build(0, _cm(b, [(n, 1, n) for n in prompts], table, runner="v1"))
    query = torch.randn(len(prompts), HKV * G, D, generator=gen)
    oracle_kt = kt.clone()
    kt_before = kt.clone()
    whole = b.stage2.decode(query, kv, md.decode, D**-0.5)
    kt.copy_(kt_before)  # the KT update of the newest tokens runs again
    per_row = base.scratch_bytes_per_row(HKV * G, HKV, md.decode.decode_rows.max_pages)
    monkeypatch.setattr(base, "SCRATCH_BYTES", per_row)  # one row a call
    calls = []
    monkeypatch.setattr(
        b.stage2,
        "_decode",
        lambda *a, _f=b.stage2._decode: (calls.append(a[0].shape[0]), _f(*a))[1],
    )
    chunked = b.stage2.decode(query, kv, md.decode, D**-0.5)
    # (split counts follow the batch: fp32 sums in another order)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    assert calls == [1, 1, 1]
    _check_against_oracle(s, chunked, query, k, v, oracle_kt, table, dict(enumerate(prompts)))


def test_eager_triton_stage2_launches_at_the_engine_shape_like_the_oracle(model_path):
    """Eager Triton steps launch at the engine's shape (``graphs.eager_bounds``:
    the same for every step, so the warm-up compiles them all), or with every
    page selectable when a request's own budget selects more; either way each
    row still gets the per-request oracle's output."""
    from rocketkv_vllm.backend import graphs

    b = _make_builder(model_path, {"token_budget": 256, "kernel": "triton"}, 8192)
    s = b.settings
    shape = graphs.shape_for(s, 8192, 1)
    prompts = {0: 3000, 1: 1800, 2: 700}
    for slots, budgets in (((20, 21, 22), {}), ((23, 24, 25), {1: 1024})):
        gen = torch.Generator().manual_seed(slots[0])
        table = torch.zeros(len(prompts), 512, dtype=torch.int32)
        kv, k, v, kt = _compressed_requests(s, prompts, table, gen, budgets)
        own = [budgets.get(i) for i in prompts]
        _v2_new_requests(b, list(zip(slots, prompts.values())), own)
        md = b.build(0, _cm(b, [(n, 1, n) for n in prompts.values()], table, req_idx=slots))
        rows = md.decode
        wide = bool(budgets)
        assert rows.decode_rows.max_pages == shape.max_pages
        assert rows.decode_rows.max_select == (shape.max_pages if wide else shape.max_select)
        query = torch.randn(len(prompts), HKV * G, D, generator=gen)
        oracle_kt = kt.clone()
        got = b.stage2.decode(query, kv, rows, D**-0.5)
        _check_against_oracle(s, got, query, k, v, oracle_kt, table, prompts, budgets)


# -- selection reuse (rocketkv.reselect_every) --------------------------------


@pytest.fixture(scope="module", params=["auto", "torch"])
def reuse_builder(model_path, request):
    """reselect_every 2 with the engine's CPU Stage 2: the C++ kernel
    ("auto") or batched PyTorch."""
    cfg = {"token_budget": 256, "reselect_every": 2, "kernel": request.param}
    return _make_builder(model_path, cfg, 8192, block_size=BS)


def _store(b):
    from rocketkv_vllm.backend.graphs import selection_width

    width = selection_width(b.settings, b.vllm_config.model_config.max_model_len)
    slots = b.vllm_config.scheduler_config.max_num_seqs + 1
    return torch.full((slots, HKV, width), -1, dtype=torch.int32)


def _write_token(s, k, v, table, row, pos, gen):
    """K/V of one more token of ``row`` at logical slot ``pos``."""
    r = table[row].long()
    paged.write_kv(
        k,
        v,
        torch.randn(1, HKV, D, generator=gen),
        torch.randn(1, HKV, D, generator=gen),
        r[pos // BS : pos // BS + 1] * BS + pos % BS,
    )


def test_reused_selection_attends_the_pages_chosen_at_the_last_reselect(reuse_builder):
    """reselect_every 2 through the builder and the engine's CPU Stage 2
    (V2 slots): the token opening a page selects and stores; the next one
    reuses; the one after reselects. Each step's output is the per-request
    oracle's, the reuse step's with the pages chosen a step earlier (which a
    fresh choice would not give: checked), and its KT page still updated."""
    b = reuse_builder
    s = b.settings
    assert s.page_size % 2 == 0 and s.reselect_every == 2
    prompts = {0: 1600, 1: 2400}  # both multiples of the page size
    gen = torch.Generator().manual_seed(5)
    table = torch.zeros(2, 512, dtype=torch.int32)
    kv, k, v, kt = _compressed_requests(s, prompts, table, gen)
    oracle_kt = kt.clone()
    store = _store(b)
    _v2_new_requests(b, [(20, 1600), (21, 2400)])
    plans = {i: plan_request(s, n) for i, n in prompts.items()}
    chosen = {}
    reused_before = b.state.counters.decode_selections_reused
    for step, want_reuse in enumerate([0, 1, 0]):
        if step:
            for i, n in prompts.items():
                _write_token(s, k, v, table, i, n + step, gen)
        cm = _cm(b, [(n + step, 1, n) for n in prompts.values()], table, req_idx=[20, 21])
        rows = b.build(0, cm).decode
        assert rows.decode_rows.reuse.tolist() == [want_reuse] * 2, step
        slots = rows.decode_rows.sel_slot.tolist()
        assert len(set(slots)) == 2 and min(slots) >= 0
        query = torch.randn(2, HKV * G, D, generator=gen)
        got = b.stage2.decode(query, kv, rows, D**-0.5, selections=store)
        for i, n in prompts.items():
            p = plans[i]
            args = (k, v, oracle_kt, table[i].long(), p.num_compact, p.tail_start, n + step + 1)
            args += (p.topk, p.topr, s.page_size, D**-0.5, s.force_current_page)
            want, sel = paged.hsa_decode(
                query[i],
                *args,
                selected=chosen.get(i) if want_reuse else None,
                return_selected=True,
            )
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-5)
            if want_reuse:
                _, fresh = paged.hsa_decode(query[i], *args, return_selected=True)
                assert not torch.equal(fresh, sel), "a fresh choice would pass too"
            chosen[i] = sel
    # the KT pages, the reuse step's included (NaN: never written)
    torch.testing.assert_close(kt, oracle_kt, rtol=0, atol=0, equal_nan=True)
    assert b.state.counters.decode_selections_reused == reused_before + 2


def test_reuse_follows_requests_not_rows(reuse_builder):
    """Which rows reuse: V1 rows keyed by request id across a reorder, a
    V2 slot taken by a new request, a skipped token, a prompt chunk, and a
    selection wider than the store (a request's own larger budget)."""
    b = reuse_builder
    ps = b.settings.page_size
    n = 4 * ps * 100  # a page starts at n: the first decode token opens one
    requests = b.state.requests
    table = _block_table(3)

    def v1_step(ids, contexts, q_lens=None):
        requests.row_ids = ids
        q_lens = q_lens or [1] * len(ids)
        rows = [(c, q, n) for c, q in zip(contexts, q_lens)]
        decode = b.build(0, _cm(b, rows, table, runner="v1")).decode
        if decode is None:
            return None
        return decode.decode_rows.sel_slot.tolist(), decode.decode_rows.reuse.tolist()

    try:
        slots, reuse = v1_step(["a", "b"], [n, n])
        assert reuse == [0, 0]
        # rows swapped: each request keeps its slot and reuses
        assert v1_step(["b", "a"], [n + 1, n + 1]) == (slots[::-1], [1, 1])
        assert v1_step(["a", "b"], [n + 2, n + 2])[1] == [0, 0]  # offset 2: reselect
        # a's tokens recomputed in a chunk (after a preemption): forgotten,
        # so its next token reselects; b jumps ahead 3 tokens: reselects
        assert v1_step(["a"], [n], q_lens=[3]) is None
        assert v1_step(["a", "b"], [n + 3, n + 5])[1] == [0, 0]
        assert v1_step(["a", "b"], [n + 4, n + 6])[1] == [0, 0]  # a opens a page
        assert v1_step(["a", "b"], [n + 5, n + 7])[1] == [1, 1]
    finally:
        requests.row_ids = []
    # V2: a new request in a slot its predecessor left at a continuing length
    _v2_new_requests(b, [(40, n)])
    assert b.build(
        0, _cm(b, [(n + 4, 1, n)], table, req_idx=[40])
    ).decode.decode_rows.reuse.tolist() == [0]
    _v2_new_requests(b, [(40, n)])
    for context, reuse in [(n + 5, 0), (n + 6, 0), (n + 7, 1)]:
        rows = b.build(0, _cm(b, [(context, 1, n)], table, req_idx=[40])).decode
        assert rows.decode_rows.reuse.tolist() == [reuse], context
    # a budget selecting more than the store holds: no slot, never reuses
    big = 30 * BS * ps  # a prompt its 2048 budget compresses
    _v2_new_requests(b, [(41, big)], budgets=[2048])
    for context in (big, big + 1):
        rows = b.build(0, _cm(b, [(context, 1, big)], table, req_idx=[41])).decode
        assert (rows.decode_rows.sel_slot.tolist(), rows.decode_rows.reuse.tolist()) == ([-1], [0])


def test_selection_slots_go_to_the_request_unused_longest():
    """More requests than slots: a new one takes the slot used longest ago
    (never one of its own step's), and the request that lost it selects
    afresh when it returns."""
    from rocketkv_vllm.backend.reuse import SelectionReuse

    r = SelectionReuse(every=4, page_size=4, num_slots=2, width=8)
    use = np.array([3, 3])

    def step(keys, seqs, num_use=use):
        slots, reuse = r.plan(keys, np.array(seqs), num_use)
        return slots.tolist(), reuse.tolist()

    assert step(["x", "y"], [9, 9]) == ([0, 1], [0, 0])  # position 8 opens a page
    assert step(["x", "y"], [10, 10]) == ([0, 1], [1, 1])
    assert step(["x", "z"], [11, 5]) == ([0, 1], [1, 0])  # z takes y's slot
    assert step(["y", "z"], [11, 6]) == ([0, 1], [0, 1])  # y takes x's
    assert step(["x"], [12], np.array([9])) == ([-1], [0])  # wider than the store


@pytest.mark.parametrize("rule", ["snapkv", "streaming", "h2o"])
def test_keep_rule_chooses_which_prompt_chunks_carry_rows(model_path, rule):
    """snapkv keeps the window queries of earlier chunks (window rows), h2o
    accumulates every earlier chunk's scores (score rows), streaming needs
    neither; the prompt's last chunk is Stage 1's under every rule."""
    b = _make_builder(
        model_path, {"token_budget": 256, "keep_rule": rule}, 8192, enable_prefix_caching=False
    )
    table = _block_table(1)
    _v2_new_requests(b, [(3, 1000)])
    chunks = [(0, 512), (512, 476), (988, 12)]  # the window (968..999) spans the last two
    seen = []
    for context, q in chunks:
        md = b.build(0, _cm(b, [(context, q, 0)], table, req_idx=[3]))
        seen.append((len(md.window_rows), len(md.score_rows), len(md.stage1_rows)))
    want = {
        "snapkv": [(0, 0, 0), (1, 0, 0), (0, 0, 1)],
        "streaming": [(0, 0, 0), (0, 0, 0), (0, 0, 1)],
        "h2o": [(0, 1, 0), (0, 1, 0), (0, 0, 1)],
    }[rule]
    assert seen == want
