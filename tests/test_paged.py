"""The paged PyTorch path against the same steps on plain (unpaged) tensors."""

import pytest
import torch
from reference import paged

from rocketkv_vllm.algorithm import hsa_select_pages, snapkv_keep_positions, sparse_attention
from rocketkv_vllm.layout import kt_cache_view, split_kv


def _make_request(
    n_tokens, hkv, d, bs, ps, num_blocks=64, seed=0, dtype=torch.float32, layout="token"
):
    g = torch.Generator().manual_seed(seed)
    kv_width = 2 * d
    pages = bs // ps
    block_elems = hkv * bs * kv_width + hkv * pages * kv_width
    storage = torch.full((num_blocks * block_elems,), float("nan"), dtype=dtype)
    kv_cache = torch.as_strided(
        storage, (num_blocks, hkv, bs, kv_width), (block_elems, bs * kv_width, kv_width, 1)
    )
    kt_cache = kt_cache_view(kv_cache, ps)
    k_cache, v_cache = split_kv(kv_cache, layout)
    blocks_needed = -(-n_tokens // bs) + 4
    block_row = torch.randperm(num_blocks - 1, generator=g)[:blocks_needed] + 1
    keys = torch.randn(n_tokens, hkv, d, generator=g).to(dtype)
    values = torch.randn(n_tokens, hkv, d, generator=g).to(dtype)
    slots = torch.arange(n_tokens)
    flat = block_row[slots // bs] * bs + slots % bs
    paged.write_kv(k_cache, v_cache, keys, values, flat)
    return k_cache, v_cache, kt_cache, block_row, keys, values


@pytest.mark.parametrize(
    "n,hkv,g,d,bs,ps,layout,force",
    [
        (1000, 3, 3, 64, 16, 4, "token", False),
        (1000, 3, 3, 64, 32, 4, "head_rows", True),
        (777, 2, 4, 128, 32, 8, "head_rows", False),
        (513, 1, 1, 64, 16, 1, "token", True),
        (512, 2, 3, 64, 16, 4, "token", True),  # the prompt fills its last block
        (640, 3, 3, 64, 32, 2, "head_rows", False),  # exactly, page size 2
    ],
)
def test_compress_then_decode_matches_unpaged(n, hkv, g, d, bs, ps, layout, force):
    kc, vc, kt, row, keys, values = _make_request(n, hkv, d, bs, ps, seed=n, layout=layout)
    w, budget, scale = 32, 202, d**-0.5
    q_win = torch.randn(w, hkv * g, d)
    tail_start = n // bs * bs
    kept = paged.snapkv_compress(kc, vc, kt, row, q_win, n, budget, tail_start, 63, ps, scale)
    expected = snapkv_keep_positions(q_win, keys, scale, budget, 63, min(n - w, tail_start))
    assert torch.equal(kept, expected)
    num_compact = budget - (n - tail_start)

    # Compacted slots hold the kept tokens, the tail block is untouched.
    for h in range(hkv):
        src = kept[h, :num_compact]
        got_k, got_v = paged.gather_kv(kc, vc, row, torch.arange(num_compact))
        assert torch.equal(got_k[:, h], keys[src, h])
        assert torch.equal(got_v[:, h], values[src, h])
    tail_k, _ = paged.gather_kv(kc, vc, row, torch.arange(tail_start, n))
    assert torch.equal(tail_k, keys[tail_start:n])

    # Decode a few tokens; each must equal the same math on unpaged tensors.
    view_k = [keys[kept[h, :num_compact], h] for h in range(hkv)]
    view_v = [values[kept[h, :num_compact], h] for h in range(hkv)]
    new_k = torch.randn(6, hkv, d)
    new_v = torch.randn(6, hkv, d)
    for step in range(6):
        pos = n + step
        paged.write_kv(
            kc,
            vc,
            new_k[step : step + 1],
            new_v[step : step + 1],
            (row[pos // bs] * bs + pos % bs).view(1),
        )
        q = torch.randn(hkv * g, d)
        tail_keys = torch.cat([keys[tail_start:n], new_k[: step + 1]])
        tail_vals = torch.cat([values[tail_start:n], new_v[: step + 1]])
        for topk in (ps, 4 * ps, 10_000):
            out = paged.hsa_decode(
                q, kc, vc, kt, row, num_compact, tail_start, pos + 1, topk, 16, ps, scale, force
            )
            ref = _unpaged_hsa(q, view_k, view_v, tail_keys, tail_vals, ps, topk, 16, scale, force)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def _pages(x, ps):
    """[T, d] -> page min/max [P, d] over ragged last page."""
    n_pages = -(-x.shape[0] // ps)
    mins = torch.stack([x[i * ps : (i + 1) * ps].amin(0) for i in range(n_pages)])
    maxs = torch.stack([x[i * ps : (i + 1) * ps].amax(0) for i in range(n_pages)])
    return mins, maxs


def _unpaged_hsa(q, view_k, view_v, tail_k, tail_v, ps, topk, topr, scale, force=False):
    """HSA over the view as plain tensors: compact pages, then tail pages
    (each region's last page may be partial: it weighs its token count);
    with force the newest token's page (the last) is selected on top."""
    hkv = tail_k.shape[1]
    mins, maxs = [], []
    for h in range(hkv):
        kc, kt_ = view_k[h], tail_k[:, h]
        cmin, cmax = _pages(kc, ps)
        tmin, tmax = _pages(kt_, ps)
        mins.append(torch.cat([cmin, tmin]))
        maxs.append(torch.cat([cmax, tmax]))
    pmin, pmax = torch.stack(mins, 1), torch.stack(maxs, 1)
    valid = torch.ones(pmin.shape[0], dtype=torch.bool)
    c, t = view_k[0].shape[0], tail_k.shape[0]
    tokens = torch.cat(
        [(c - torch.arange(0, c, ps)).clamp(max=ps), (t - torch.arange(0, t, ps)).clamp(max=ps)]
    )
    forced = torch.zeros_like(valid)
    forced[-1] = force
    sel = hsa_select_pages(q, pmin, pmax, valid, topr, max(topk // ps, 1), forced, tokens)
    if force:
        assert bool(sel[:, -1].all())
        assert bool((sel.sum(1) == min(max(topk // ps, 1) + 1, len(valid))).all())
    # Token list with page ids; compact part pages then tail pages.
    page_of = torch.cat([torch.arange(c) // ps, -(-c // ps) + torch.arange(tail_k.shape[0]) // ps])
    keys = torch.cat([torch.stack(view_k, 1), tail_k])
    vals = torch.cat([torch.stack(view_v, 1), tail_v])
    mask = sel[:, page_of]
    return sparse_attention(q, keys, vals, mask, scale)


def test_dense_attention_matches_sdpa_on_plain_tensors():
    n, hkv, g, d = 300, 3, 3, 64
    kc, vc, _, row, keys, values = _make_request(n, hkv, d, 32, 4, seed=5, layout="head_rows")
    q = torch.randn(40, hkv * g, d)
    positions = torch.arange(n - 40, n)
    out = paged.dense_attention(q, positions, kc, vc, row, n, d**-0.5, chunk=16)
    k = keys.repeat_interleave(g, dim=1).transpose(0, 1)
    v = values.repeat_interleave(g, dim=1).transpose(0, 1)
    mask = torch.arange(n)[None, :] <= positions[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=mask, scale=d**-0.5
    ).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ps,force", [(4, False), (16, True)])
def test_no_eviction_keeps_everything_and_decodes_over_the_prompt(ps, force):
    """rocketkv.evict=false: prompt_budget == n, identity selection, nothing
    moved, KT pages over the whole prompt; decode = HSA over all tokens."""
    n, hkv, g, d, bs = 333, 2, 3, 64, 16
    kc, vc, kt, row, keys, values = _make_request(n, hkv, d, bs, ps, seed=3)
    before_k = kc.clone()
    tail_start = n // bs * bs
    q_win = torch.randn(32, hkv * g, d)
    kept = paged.snapkv_compress(kc, vc, kt, row, q_win, n, n, tail_start, 63, ps, d**-0.5)
    assert torch.equal(kept, torch.arange(n).expand(hkv, n))
    assert torch.equal(kc.nan_to_num(7.0), before_k.nan_to_num(7.0))
    pos = n
    new_k, new_v = torch.randn(1, hkv, d), torch.randn(1, hkv, d)
    paged.write_kv(kc, vc, new_k, new_v, (row[pos // bs] * bs + pos % bs).view(1))
    q = torch.randn(hkv * g, d)
    out = paged.hsa_decode(
        q, kc, vc, kt, row, tail_start, tail_start, n + 1, 8 * ps, 16, ps, d**-0.5, force
    )
    view_k = [keys[:tail_start, h] for h in range(hkv)]
    view_v = [values[:tail_start, h] for h in range(hkv)]
    ref = _unpaged_hsa(
        q,
        view_k,
        view_v,
        torch.cat([keys[tail_start:], new_k]),
        torch.cat([values[tail_start:], new_v]),
        ps,
        8 * ps,
        16,
        d**-0.5,
        force,
    )
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_page_size_one_full_channels_is_exact_top_k_attention():
    """The "oracle" method (evict false, page 1, topr = d): decode attends to
    the exact top-k tokens by (group-averaged) true attention weight."""
    n, hkv, g, d, bs, topk = 200, 2, 2, 64, 16, 24
    kc, vc, kt, row, keys, values = _make_request(n, hkv, d, bs, 1, seed=9)
    tail_start = n // bs * bs
    paged.snapkv_compress(
        kc, vc, kt, row, torch.randn(32, hkv * g, d), n, n, tail_start, 63, 1, d**-0.5
    )
    q = torch.randn(hkv * g, d)
    # the token at n - 1 is the "current" one (already in the cache)
    out = paged.hsa_decode(q, kc, vc, kt, row, tail_start, tail_start, n, topk, d, 1, d**-0.5)
    weights = torch.einsum("kgd,tkd->kgt", q.view(hkv, g, d), keys) * d**-0.5
    top = weights.softmax(-1).mean(1).topk(topk, dim=-1).indices
    mask = torch.zeros(hkv, n, dtype=torch.bool)
    mask.scatter_(1, top, True)
    ref = sparse_attention(q, keys, values, mask, d**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
