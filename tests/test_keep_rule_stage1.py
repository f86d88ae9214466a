"""The keep rules wired into Stage 1 (``rocketkv.keep_rule``): ``Stage1.compress``
with each rule against the algorithm's positions applied to a paged cache,
and the H2O score store fed chunk by chunk against ``h2o_scores`` of the
whole prompt."""

from types import SimpleNamespace

import pytest
import torch
from reference import paged
from test_paged import _make_request

from rocketkv_vllm.algorithm import (
    h2o_keep_positions,
    h2o_scores,
    snapkv_keep_positions,
    streaming_keep_positions,
)
from rocketkv_vllm.backend import h2o as h2o_store
from rocketkv_vllm.config import RocketKVConfigError, parse_config
from rocketkv_vllm.ops.pytorch import TorchStage1, compact_kept_tokens, write_kt_pages


def _apply(kc, vc, kt, row, kept, n, budget, tail_start, ps):
    """The expected cache: ``kept`` compacted, the view's KT pages written
    (``reference/paged.snapkv_compress``'s steps after its choice)."""
    num_compact = budget - (n - tail_start)
    compact_kept_tokens(kc, vc, row, kept[:, :num_compact])
    write_kt_pages(kc, kt, row, 0, num_compact, ps)
    write_kt_pages(kc, kt, row, tail_start, n, ps)


@pytest.mark.parametrize("rule", ["snapkv", "streaming", "h2o"])
@pytest.mark.parametrize(
    "n,hkv,g,bs,ps,layout",
    [(700, 2, 3, 16, 4, "token"), (513, 1, 1, 32, 8, "head_rows"), (640, 3, 2, 32, 2, "token")],
)
def test_compress_with_each_rule_keeps_the_algorithms_positions(rule, n, hkv, g, bs, ps, layout):
    d, w, budget = 64, 32, 150
    scale = d**-0.5
    kc, vc, kt, row, keys, values = _make_request(n, hkv, d, bs, ps, seed=n, layout=layout)
    ekc, evc, ekt, erow, _, _ = _make_request(n, hkv, d, bs, ps, seed=n, layout=layout)
    gen = torch.Generator().manual_seed(1)
    queries = torch.randn(n, hkv * g, d, generator=gen)
    q_win = queries[n - w :]
    tail_start = n // bs * bs
    protect_from = min(n - w, tail_start)
    scores = None
    if rule == "snapkv":
        expected = snapkv_keep_positions(q_win, keys, scale, budget, 63, protect_from)
    elif rule == "streaming":
        expected = streaming_keep_positions(n, hkv, budget, protect_from=protect_from)
        q_win = None  # streaming needs no window queries
    else:
        scores = h2o_scores(queries, keys, scale)
        expected = h2o_keep_positions(scores, budget, recent=w, protect_from=tail_start)
        q_win = None
    kept = TorchStage1().compress(
        kc,
        vc,
        kt,
        row,
        q_win,
        n,
        budget,
        tail_start,
        63,
        ps,
        scale,
        keep_rule=rule,
        h2o_scores=scores,
        window_size=w,
    )
    assert kept.shape == (hkv, budget)
    assert torch.equal(kept, expected)
    _apply(ekc, evc, ekt, erow, expected.contiguous(), n, budget, tail_start, ps)
    for got, want in ((kc, ekc), (vc, evc), (kt, ekt)):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    # The compacted slots hold the kept tokens (the cache above is the oracle's).
    num_compact = budget - (n - tail_start)
    got_k, got_v = paged.gather_kv(kc, vc, row, torch.arange(num_compact))
    for h in range(hkv):
        assert torch.equal(got_k[:, h], keys[expected[h, :num_compact], h])
        assert torch.equal(got_v[:, h], values[expected[h, :num_compact], h])


def test_streaming_and_h2o_choices_differ_from_snapkv():
    """The three rules choose differently on random keys (a fallback of one
    rule to another would fail the test above only through this)."""
    n, hkv, g, d, bs, ps, w, budget = 600, 2, 3, 64, 16, 4, 32, 120
    _, _, _, _, keys, _ = _make_request(n, hkv, d, bs, ps, seed=3)
    queries = torch.randn(n, hkv * g, d, generator=torch.Generator().manual_seed(2))
    tail = n // bs * bs
    snap = snapkv_keep_positions(queries[n - w :], keys, d**-0.5, budget, 63, min(n - w, tail))
    stream = streaming_keep_positions(n, hkv, budget, protect_from=min(n - w, tail))
    h2o = h2o_keep_positions(h2o_scores(queries, keys, d**-0.5), budget, w, tail)
    assert not torch.equal(snap, stream) and not torch.equal(snap, h2o)
    assert not torch.equal(stream, h2o)


# ---------------------------------------------------------------- the H2O store


def _row(q_start, q_end, context_len, block_row, n, key="r0"):
    plan = SimpleNamespace(num_prompt_tokens=n)
    return SimpleNamespace(
        q_start=q_start,
        q_end=q_end,
        context_len=context_len,
        block_row=block_row,
        plan=plan,
        key=key,
    )


def _feed(store, layer, kc, row, queries, n, chunks, scale, sinks=None, extra=0):
    """Feed the prompt's queries chunk by chunk, each chunk placed after
    ``q_start`` other tokens of its step; the last chunk also holds ``extra``
    tokens past the prompt (recomputed after a preemption). Returns take()'s."""
    bounds = [0, *chunks, n]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        last = i == len(bounds) - 2
        q_start = 3 + i  # other rows' tokens before this one
        past = extra if last else 0
        step = torch.randn(q_start + b - a + past + 2, *queries.shape[1:])
        step[q_start : q_start + b - a] = queries[a:b]
        r = _row(q_start, q_start + b - a + past, a, row, n)
        if last:
            return store.take(layer, r, step, kc, scale, sinks)
        store.add(layer, r, step, kc, scale, sinks)


@pytest.mark.parametrize(
    "chunks,max_logits,extra",
    [((), None, 0), ((100, 356), None, 0), ((1, 2, 300), 5000, 3), ((511,), 1, 0)],
)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_h2o_store_chunk_by_chunk_equals_the_whole_prompt(
    chunks, max_logits, extra, with_sinks, monkeypatch
):
    n, hkv, g, d, bs, ps = 512, 2, 3, 32, 16, 4
    if max_logits is not None:  # split the chunks' queries further
        monkeypatch.setattr(h2o_store, "MAX_LOGITS", max_logits)
    kc, _, _, row, keys, _ = _make_request(n, hkv, d, bs, ps, seed=5)
    queries = torch.randn(n, hkv * g, d, generator=torch.Generator().manual_seed(4))
    sinks = torch.randn(hkv * g) if with_sinks else None
    store = h2o_store.H2OScores()
    scale = d**-0.5
    layers = ("layer0", "layer1")
    got = {}
    for layer in layers:
        got[layer] = _feed(store, layer, kc, row, queries, n, chunks, scale, sinks, extra)
    want = h2o_scores(queries, keys, scale, sinks)
    for layer in layers:
        scores, whole = got[layer]
        assert whole
        torch.testing.assert_close(scores, want, rtol=1e-5, atol=1e-5)
    assert len(store) == 0  # taken: nothing left behind


def test_h2o_store_lost_buffer_is_reported_not_raised():
    n, hkv, g, d, bs, ps = 300, 1, 2, 32, 16, 4
    kc, _, _, row, keys, _ = _make_request(n, hkv, d, bs, ps, seed=6)
    queries = torch.randn(n, hkv * g, d)
    store = h2o_store.H2OScores()
    step = queries.clone()
    store.add("l", _row(0, 100, 0, row, n), step[:100], kc, 0.1)
    store.add("l", _row(0, 100, 100, row, n, key="other"), step[100:200], kc, 0.1)
    assert len(store) == 2
    store.forget(["r0"])  # the request left (finished, aborted, preempted)
    assert len(store) == 1
    # Its chunks arrive again from the middle (never expected): served, reported.
    store.add("l", _row(0, 100, 100, row, n), step[100:200], kc, 0.1)
    scores, whole = store.take("l", _row(0, 100, 200, row, n), step[200:300], kc, 0.1)
    assert not whole and scores.shape == (hkv, n)
    assert torch.isfinite(scores).all()
    # A skipped chunk is reported too.
    store.add("l", _row(0, 100, 0, row, n, key="gap"), step[:100], kc, 0.1)
    _, whole = store.take("l", _row(0, 100, 200, row, n, key="gap"), step[200:300], kc, 0.1)
    assert not whole


# ---------------------------------------------------------------- settings


def test_keep_rule_setting():
    assert parse_config({}).keep_rule == "snapkv"
    for rule in ("snapkv", "streaming", "h2o"):
        assert parse_config({"keep_rule": rule}).keep_rule == rule
    for bad in ("SnapKV", "quest", "", None, 1):
        with pytest.raises(RocketKVConfigError) as err:
            parse_config({"keep_rule": bad})
        msg = str(err.value)
        assert "rocketkv.keep_rule" in msg
        assert "['snapkv', 'streaming', 'h2o']" in msg
