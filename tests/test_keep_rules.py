"""Stage 1 baselines (StreamingLLM, H2O) against dense derivations written
out here: explicit position lists, the full causal attention matrix."""

import pytest
import torch

from rocketkv_vllm.algorithm import (
    h2o_accumulate,
    h2o_keep_positions,
    h2o_scores,
    streaming_keep_positions,
)

# ---------------------------------------------------------------- StreamingLLM


def _expected_streaming(n, budget, num_sinks, protect_from=None):
    """The kept positions of one head, position by position."""
    if budget >= n:
        return list(range(n))
    protected = n - (n if protect_from is None else protect_from)
    sinks = max(0, min(num_sinks, budget - protected))
    recent = budget - sinks
    return [p for p in range(n) if p < sinks or p >= n - recent]


@pytest.mark.parametrize("num_sinks", [0, 1, 4, 7])
@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5, 8, 18, 19, 20, 21, 40])
def test_streaming_keeps_sinks_and_recent(budget, num_sinks):
    n, hkv = 20, 3
    kept = streaming_keep_positions(n, hkv, budget, num_sinks)
    expected = _expected_streaming(n, budget, num_sinks)
    assert kept.dtype == torch.int64 and kept.shape == (hkv, min(budget, n))
    for h in range(hkv):  # every KV head keeps the same positions
        assert kept[h].tolist() == expected
    if budget < n:
        assert kept[0, : min(budget, num_sinks)].tolist() == list(range(min(budget, num_sinks)))


def test_streaming_defaults_to_four_sinks():
    kept = streaming_keep_positions(100, 2, 10)
    assert kept[0].tolist() == [0, 1, 2, 3] + list(range(94, 100))
    # budget == length - 1: only position num_sinks is dropped
    assert 4 not in streaming_keep_positions(100, 1, 99)[0].tolist()
    assert streaming_keep_positions(100, 1, 99)[0].tolist() == [0, 1, 2, 3] + list(range(5, 100))


@pytest.mark.parametrize("protect_from", [95, 92, 90, 97])
@pytest.mark.parametrize("budget", [5, 8, 10])
def test_streaming_protected_tail_takes_room_from_the_sinks(budget, protect_from):
    n = 100
    if n - protect_from > budget:
        with pytest.raises(AssertionError):
            streaming_keep_positions(n, 1, budget, 4, protect_from)
        return
    kept = streaming_keep_positions(n, 1, budget, 4, protect_from)[0].tolist()
    assert kept == _expected_streaming(n, budget, 4, protect_from)
    assert len(kept) == budget and set(range(protect_from, n)) <= set(kept)


# ------------------------------------------------------------------------ H2O


def _dense_h2o_scores(q, k, scale, sinks=None):
    """[Hkv, N] float64: for each query head the full N x N causal attention
    matrix (torch.softmax over a masked logit matrix, the sink as one more
    column that is then dropped), its column sums added to its KV head."""
    n, hq, _ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    out = torch.zeros(hkv, n, dtype=torch.float64)
    for h in range(hq):
        kvh = h // g  # query heads h = kvh * g .. kvh * g + g - 1 share KV head kvh
        logits = (q[:, h].double() @ k[:, kvh].double().T) * scale
        logits = logits.masked_fill(~causal, float("-inf"))
        if sinks is not None:
            sink_col = torch.full((n, 1), float(sinks[h]), dtype=torch.float64)
            logits = torch.cat([logits, sink_col], dim=1)
        attn = torch.softmax(logits, dim=1)[:, :n]
        for i in range(n):  # row i: query i never sees a later key
            assert float(attn[i, i + 1 :].abs().sum()) == 0.0
        out[kvh] += attn.sum(dim=0)
    return out


TOL = {"rtol": 1e-4, "atol": 1e-5}  # fp32 sums against the float64 derivation
H2O_SHAPES = [  # (N, Hkv, G, d)
    (37, 1, 1, 16),
    (50, 2, 2, 32),  # GQA: 2 query heads per KV head
    (64, 3, 3, 64),
    (29, 1, 4, 16),
]


def _prompt(n, hkv, g, d, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, hkv * g, d, generator=gen) * 2).to(dtype)
    k = torch.randn(n, hkv, d, generator=gen).to(dtype)
    sinks = torch.randn(hkv * g, generator=gen) + 2
    return q, k, sinks


@pytest.mark.parametrize("n,hkv,g,d", H2O_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_h2o_scores_are_the_dense_column_sums(n, hkv, g, d, dtype, with_sinks):
    q, k, sinks = _prompt(n, hkv, g, d, dtype, seed=n)
    sinks = sinks if with_sinks else None
    scale = d**-0.5
    got = h2o_scores(q, k, scale, sinks)
    assert got.dtype == torch.float32 and got.shape == (hkv, n)
    torch.testing.assert_close(got.double(), _dense_h2o_scores(q, k, scale, sinks), **TOL)
    if not with_sinks:  # each softmax row sums to 1: N rows per query head
        torch.testing.assert_close(
            got.sum(1).double(), torch.full((hkv,), float(g * n)).double(), **TOL
        )


def test_h2o_sums_over_the_gqa_group():
    """2 query heads per KV head: the KV head's row is the two heads' own
    rows (each as a one-head model) added."""
    n, d = 40, 32
    q, k, _ = _prompt(n, 2, 2, d, seed=5)
    got = h2o_scores(q, k, d**-0.5)
    for kvh in range(2):
        alone = [
            _dense_h2o_scores(q[:, [h]], k[:, [kvh]], d**-0.5)[0] for h in (2 * kvh, 2 * kvh + 1)
        ]
        torch.testing.assert_close(got[kvh].double(), alone[0] + alone[1], **TOL)


def _chunk_bounds(n, sizes):
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, min(n, start + size)))
        start += size
        if start >= n:
            break
    if start < n:
        bounds.append((start, n))
    return bounds


@pytest.mark.parametrize("n,hkv,g,d", H2O_SHAPES)
@pytest.mark.parametrize("sizes", [[10**6], [5, 17, 1, 3], [1] * 100, [2, 9]])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_h2o_chunked_accumulator_equals_the_whole(n, hkv, g, d, sizes, with_sinks):
    q, k, sinks = _prompt(n, hkv, g, d, seed=n + 1)
    sinks = sinks if with_sinks else None
    scale = d**-0.5
    acc = torch.zeros(hkv, n, dtype=torch.float32)
    for start, end in _chunk_bounds(n, sizes):
        before = acc.clone()
        out = h2o_accumulate(acc, q[start:end], k[:end], scale, sinks)
        assert out is acc  # in place: the engine keeps one buffer per request and layer
        assert torch.equal(acc[:, end:], before[:, end:]), "keys not seen yet stay untouched"
    torch.testing.assert_close(acc.double(), _dense_h2o_scores(q, k, scale, sinks), **TOL)
    torch.testing.assert_close(acc, h2o_scores(q, k, scale, sinks), **TOL)


def _expected_h2o_keep(scores_row, budget, recent, protect_from=None):
    """One head, in plain Python: the protected tail plus the best of the
    rest, ordered by (higher score, earlier position)."""
    n = len(scores_row)
    if budget >= n:
        return list(range(n))
    start = max(0, n - recent)
    if protect_from is not None:
        start = min(start, protect_from)
    candidates = sorted(range(start), key=lambda p: (-scores_row[p], p))
    return sorted(candidates[: budget - (n - start)]) + list(range(start, n))


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("budget", [8, 9, 20, 59, 60, 61, 100])
@pytest.mark.parametrize("protect_from", [None, 52, 55])
def test_h2o_keep_positions(ties, budget, protect_from):
    n, hkv, recent = 60, 3, 8
    gen = torch.Generator().manual_seed(budget)
    if ties:  # plateaus: only a few distinct values, the tie rule decides
        scores = torch.randint(0, 3, (hkv, n), generator=gen).float()
    else:
        scores = torch.rand(hkv, n, generator=gen)
    start = min(n - recent, n if protect_from is None else protect_from)
    if budget < n - start:
        with pytest.raises(AssertionError):
            h2o_keep_positions(scores, budget, recent, protect_from)
        return
    kept = h2o_keep_positions(scores, budget, recent, protect_from)
    assert kept.dtype == torch.int64 and kept.shape == (hkv, min(budget, n))
    for h in range(hkv):
        row = kept[h].tolist()
        assert row == sorted(set(row)), "sorted ascending, no duplicates"
        assert set(range(n - recent, n)) <= set(row), "the recent window is always kept"
        assert row == _expected_h2o_keep(scores[h].tolist(), budget, recent, protect_from)


def test_h2o_end_to_end_keeps_the_heavy_hitters():
    """A key every query attends to strongly is kept, far from the window."""
    n, d = 80, 16
    q, k, _ = _prompt(n, 1, 2, d, seed=9)
    u = torch.zeros(d)
    u[0] = 1.0
    q += 3 * u  # every query leans towards u ...
    k[10] = 3 * u  # ... and key 10 lies along it: a heavy hitter
    scores = h2o_scores(q, k, d**-0.5)
    kept = h2o_keep_positions(scores, 16, recent=8)
    assert kept.shape == (1, 16) and 10 in kept[0].tolist()
    assert kept[0].tolist() == _expected_h2o_keep(scores[0].tolist(), 16, 8)
    assert kept[0, -8:].tolist() == list(range(72, 80))
