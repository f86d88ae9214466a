"""Stage 1 and Stage 2 pure functions against loop-by-loop re-derivations."""

import math

import pytest
import torch

from rocketkv_vllm.algorithm import (
    hsa_page_probs,
    hsa_select_pages,
    pool_scores,
    snapkv_keep_positions,
    sparse_attention,
    window_attention_scores,
)

SHAPES = [  # (N, w, Hkv, G, d)
    (97, 8, 1, 1, 64),
    (300, 32, 3, 3, 64),  # SmolLM2: 3 KV heads, groups of 3
    (257, 16, 2, 4, 128),
    (180, 32, 1, 8, 64),
]


def _slow_window_scores(q_win, keys, scale):
    w, hq, d = q_win.shape
    n, hkv, _ = keys.shape
    g = hq // hkv
    out = torch.zeros(hkv, n - w, dtype=torch.float64)
    for h in range(hq):
        kvh = h // g
        for i in range(w):
            pos = n - w + i
            logits = [
                float(q_win[i, h].double() @ keys[j, kvh].double()) * scale for j in range(pos + 1)
            ]
            m = max(logits)
            ex = [math.exp(x - m) for x in logits]
            z = sum(ex)
            for j in range(n - w):
                if j <= pos:
                    out[kvh, j] += ex[j] / z
    return out


def _slow_pool(scores, kernel):
    half = kernel // 2
    n = scores.shape[1]
    out = torch.empty_like(scores)
    for j in range(n):
        out[:, j] = scores[:, max(0, j - half) : min(n, j + half + 1)].max(dim=1).values
    return out


@pytest.mark.parametrize("n,w,hkv,g,d", SHAPES)
def test_window_scores_and_pool_match_loops(n, w, hkv, g, d):
    torch.manual_seed(n)
    q = torch.randn(w, hkv * g, d, dtype=torch.bfloat16)
    k = torch.randn(n, hkv, d, dtype=torch.bfloat16)
    scale = d**-0.5
    fast = window_attention_scores(q, k, scale)
    slow = _slow_window_scores(q, k, scale)
    torch.testing.assert_close(fast.double(), slow, rtol=1e-4, atol=1e-5)
    for kernel in (1, 7, 63):
        torch.testing.assert_close(pool_scores(fast, kernel), _slow_pool(fast, kernel))


@pytest.mark.parametrize("n,w,hkv,g,d", SHAPES)
@pytest.mark.parametrize("protect_extra", [0, 5])
def test_keep_positions_are_the_top_pooled_plus_protected(n, w, hkv, g, d, protect_extra):
    torch.manual_seed(7 + n)
    q = torch.randn(w, hkv * g, d)
    k = torch.randn(n, hkv, d)
    budget = w + protect_extra + 40
    protect_from = n - w - protect_extra
    kept = snapkv_keep_positions(q, k, d**-0.5, budget, 63, protect_from)
    assert kept.shape == (hkv, budget)
    pooled = _slow_pool(_slow_window_scores(q, k, d**-0.5), 63)
    for h in range(hkv):
        row = kept[h].tolist()
        assert row == sorted(set(row)), "sorted, no duplicates"
        assert row[-(n - protect_from) :] == list(range(protect_from, n))
        chosen = set(row) - set(range(protect_from, n))
        others = set(range(protect_from)) - chosen
        assert len(chosen) == budget - (n - protect_from)
        lowest_chosen = min(float(pooled[h, j]) for j in chosen)
        highest_other = max(float(pooled[h, j]) for j in others)
        assert lowest_chosen >= highest_other - 1e-6


def _slow_hsa(q, pmin, pmax, valid, topr, num_pages, tokens=None):
    """Per query head, per page, with Python loops (SPEC §1 Stage 2); the
    softmax denominator counts page p tokens[p] times (softmax over tokens)."""
    hq, d = q.shape
    p, hkv, _ = pmin.shape
    g = hq // hkv
    selected = torch.zeros(hkv, p, dtype=torch.bool)
    for kvh in range(hkv):
        qs = q[kvh * g : (kvh + 1) * g].double()
        mag = qs.abs().sum(0)
        chans = sorted(range(d), key=lambda c: -float(mag[c]))[:topr]
        sign = [float(qs[:, c].sum()) > 0 for c in chans]
        avg = torch.zeros(p, dtype=torch.float64)
        for gi in range(g):
            qg = qs[gi]
            tau = math.sqrt(d * sum(abs(float(qg[c])) for c in chans) / float(qg.abs().sum()))
            scores = []
            for page in range(p):
                if not valid[page]:
                    scores.append(float("-inf"))
                    continue
                s = sum(
                    float(qg[c]) * float((pmax if sg else pmin)[page, kvh, c])
                    for c, sg in zip(chans, sign)
                )
                scores.append(s / tau)
            m = max(scores)
            ex = [math.exp(x - m) if x != float("-inf") else 0.0 for x in scores]
            z = sum(e * (1 if tokens is None else int(tokens[j])) for j, e in enumerate(ex))
            avg += torch.tensor(ex, dtype=torch.float64) / z / g
        n_valid = int(valid.sum())
        if n_valid <= num_pages:
            selected[kvh] = valid
        else:
            order = sorted(range(p), key=lambda j: -float(avg[j]))[:num_pages]
            selected[kvh, order] = True
    return selected


@pytest.mark.parametrize(
    "hkv,g,d,topr", [(1, 1, 64, 64), (3, 3, 64, 16), (2, 4, 128, 32), (1, 8, 64, 7)]
)
def test_hsa_page_selection_matches_loops(hkv, g, d, topr):
    torch.manual_seed(hkv * 100 + g)
    p = 23
    keys = torch.randn(p, 4, hkv, d)
    pmin, pmax = keys.amin(1), keys.amax(1)
    valid = torch.ones(p, dtype=torch.bool)
    valid[5] = False
    q = torch.randn(hkv * g, d)
    tokens = torch.randint(1, 5, (p,))
    for num_pages in (1, 6, 30):
        fast = hsa_select_pages(q, pmin, pmax, valid, topr, num_pages)
        assert torch.equal(fast, _slow_hsa(q, pmin, pmax, valid, topr, num_pages))
        fast = hsa_select_pages(q, pmin, pmax, valid, topr, num_pages, None, tokens)
        assert torch.equal(fast, _slow_hsa(q, pmin, pmax, valid, topr, num_pages, tokens))


def test_hsa_forced_page_is_an_extra_page():
    torch.manual_seed(3)
    keys = torch.randn(16, 4, 2, 64)
    pmin, pmax = keys.amin(1), keys.amax(1)
    valid = torch.ones(16, dtype=torch.bool)
    q = torch.randn(6, 64)
    for num_pages in (1, 2):
        plain = hsa_select_pages(q, pmin, pmax, valid, 64, num_pages)
        never = (~plain).all(dim=0).nonzero()[0, 0]
        force = torch.zeros(16, dtype=torch.bool)
        force[never] = True
        forced = hsa_select_pages(q, pmin, pmax, valid, 64, num_pages, force)
        # the top num_pages stay; the forced page comes on top of them
        expected = plain.clone()
        expected[:, never] = True
        assert torch.equal(forced, expected)
        # a forced page that is already a top page: the next best joins
        top = plain[0].nonzero()[0, 0]
        force = torch.zeros(16, dtype=torch.bool)
        force[top] = True
        forced = hsa_select_pages(q, pmin, pmax, valid, 64, num_pages, force)
        assert bool((forced.sum(1) == num_pages + 1).all()) and bool(forced[:, top].all())
        assert bool((forced | ~plain).all())


def _reference_token_probs(q, keys, page_size, topr):
    """NVlabs/RocketKV's HSA scores, transcribed from the math of
    pipeline/inf_stream_llm/inf_llm/attention/rocket.py (steps 1-3 of its
    hybrid sparse attention): per-channel min/max over chunks of page_size
    tokens counted from 0 (the last chunk partial), the chunk score given to
    every token of the chunk, softmax over the len_k TOKENS with the SparQ
    temperature, mean over the GQA group. keys [T, Hkv, d] -> [Hkv, T]."""
    t, hkv, d = keys.shape
    g = q.shape[0] // hkv
    qf = q.double().view(hkv, g, d)
    out = torch.empty(hkv, t, dtype=torch.float64)
    for h in range(hkv):
        sign = torch.where(qf[h].sum(0) > 0, 1.0, -1.0)
        chans = qf[h].abs().sum(0).topk(topr).indices
        kh = keys[:, h].double() * sign  # max of sign * k = bound in q's direction
        chunk_max = torch.stack([kh[i : i + page_size].amax(0) for i in range(0, t, page_size)])
        per_token = chunk_max.repeat_interleave(page_size, 0)[:t]
        probs = []
        for gi in range(g):
            q_hat = (qf[h, gi] * sign)[chans]
            s = per_token[:, chans] @ q_hat
            tau = math.sqrt(d * float(qf[h, gi, chans].abs().sum()) / float(qf[h, gi].abs().sum()))
            probs.append(torch.softmax(s / tau, 0))
        out[h] = torch.stack(probs).mean(0)
    return out


@pytest.mark.parametrize(
    "hkv,g,d,ps,topr", [(1, 4, 64, 4, 16), (3, 3, 64, 2, 64), (2, 2, 32, 8, 8), (1, 1, 64, 4, 64)]
)
def test_page_probs_reproduce_the_reference_token_softmax(hkv, g, d, ps, topr):
    """Token-count weighting makes the page probability equal the reference's
    per-token probability (a partly filled last page included), so a top-k
    over pages picks what the reference's top-k over tokens picks."""
    gen = torch.Generator().manual_seed(hkv * 10 + ps)
    for _trial in range(6):
        t = int(torch.randint(3 * ps + 1, 12 * ps, (1,), generator=gen))
        keys = torch.randn(t, hkv, d, generator=gen) * 2
        q = torch.randn(hkv * g, d, generator=gen)
        ref = _reference_token_probs(q, keys, ps, topr)
        num_pages = -(-t // ps)
        padded = torch.cat([keys, keys[-1:].expand(num_pages * ps - t, -1, -1)])
        pages = padded.view(num_pages, ps, hkv, d)
        pmin, pmax = pages.amin(1), pages.amax(1)
        tokens = torch.full((num_pages,), ps)
        tokens[-1] = t - (num_pages - 1) * ps
        valid = torch.ones(num_pages, dtype=torch.bool)
        got = hsa_page_probs(q, pmin, pmax, valid, topr, tokens)
        page_of = torch.arange(t) // ps
        torch.testing.assert_close(got.double()[:, page_of], ref, rtol=1e-4, atol=1e-7)
        # Unweighted (the old page softmax) differs once a page is partial
        # and the group has several heads; weighted selection == reference.
        for n_sel in (1, 2, 3):
            sel = hsa_select_pages(q, pmin, pmax, valid, topr, n_sel, None, tokens)
            for h in range(hkv):
                # reference: pages in order of their tokens' probability
                order = ref[h, torch.arange(num_pages) * ps].argsort(descending=True)
                assert set(sel[h].nonzero()[:, 0].tolist()) == set(order[:n_sel].tolist())


def test_page_size_one_scores_are_exact_attention():
    """page_size 1 and topr = d: a page's bound is its key, tau = sqrt(d), so
    the page probabilities are the exact attention weights (group mean) and
    the selection is the exact top-k (the "oracle" method)."""
    torch.manual_seed(11)
    t, hkv, g, d = 90, 3, 3, 64
    keys = torch.randn(t, hkv, d)
    q = torch.randn(hkv * g, d)
    valid = torch.ones(t, dtype=torch.bool)
    probs = hsa_page_probs(q, keys, keys, valid, d, torch.ones(t, dtype=torch.long))
    exact = torch.einsum("kgd,tkd->kgt", q.view(hkv, g, d), keys) * d**-0.5
    exact = exact.softmax(-1).mean(1)
    torch.testing.assert_close(probs, exact, rtol=1e-5, atol=1e-7)
    sel = hsa_select_pages(q, keys, keys, valid, d, 10)
    for h in range(hkv):
        assert set(sel[h].nonzero()[:, 0].tolist()) == set(exact[h].topk(10).indices.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sparse_attention_matches_loops(dtype):
    torch.manual_seed(1)
    hkv, g, d, t = 3, 3, 64, 50
    q = torch.randn(hkv * g, d, dtype=dtype)
    k = torch.randn(t, hkv, d, dtype=dtype)
    v = torch.randn(t, hkv, d, dtype=dtype)
    mask = torch.rand(hkv, t) < 0.4
    mask[:, 0] = True
    out = sparse_attention(q, k, v, mask, d**-0.5)
    for h in range(hkv * g):
        kvh = h // g
        idx = mask[kvh].nonzero()[:, 0]
        logits = (k[idx, kvh].double() @ q[h].double()) * d**-0.5
        ref = logits.softmax(0) @ v[idx, kvh].double()
        torch.testing.assert_close(out[h].double(), ref, rtol=1e-4, atol=1e-5)
