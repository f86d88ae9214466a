"""fp8 KT rows (``algorithm.kt_fp8``) against the e4m3 grid enumerated by
torch's own float8 type: bounds stay bounds, as tight as e4m3 allows, and
updating a row key by key gives the row of the page's true min/max."""

import pytest
import torch

from rocketkv_vllm.algorithm import kt_fp8

# Every finite e4m3fn value, ascending (from torch's float8 type, not ours).
GRID = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
GRID = GRID[torch.isfinite(GRID)].unique().sort().values


def _keys(gen, magnitude, pages=400, tokens=4, d=64):
    k = torch.randn(pages, tokens, d, generator=gen) * magnitude
    k[0] = 0.0  # an all-zero page
    k[1, :, :8] = 0.0
    return k.to(torch.bfloat16).float()


@pytest.mark.parametrize("magnitude", [1e-5, 0.02, 1.0, 37.0, 900.0, 3e6])
def test_rows_are_the_tightest_outward_bounds(magnitude):
    gen = torch.Generator().manual_seed(int(magnitude * 1000) % 9973)
    keys = _keys(gen, magnitude)
    kmin, kmax = keys.amin(1), keys.amax(1)
    rows = kt_fp8.encode_rows(kmin, kmax)
    assert rows.dtype == torch.uint8 and rows.shape[-1] == kt_fp8.row_bytes(64)
    assert not rows[..., 2 * 64 + 4 :].any()
    lo, hi = kt_fp8.decode_rows(rows, 64)
    assert torch.isfinite(lo).all() and torch.isfinite(hi).all()
    assert (lo <= kmin).all() and (hi >= kmax).all()

    scale = rows[..., 128:132].contiguous().view(torch.float32)[..., 0]
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all()  # powers of two
    maxabs = torch.maximum(kmin.abs().amax(-1), kmax.abs().amax(-1))
    nonzero = maxabs > 0
    assert (maxabs <= 448 * scale).all()
    assert (maxabs[nonzero] > 224 * scale[nonzero]).all()  # the smallest such
    assert (scale[~nonzero] == 1).all()

    # Tightest: the next grid value inward would cut into the bound.
    y_max, y_min = kmax / scale[:, None], kmin / scale[:, None]
    up = GRID[torch.searchsorted(GRID, y_max.contiguous())]
    down = GRID[torch.searchsorted(GRID, y_min.contiguous(), right=True) - 1]
    torch.testing.assert_close(hi / scale[:, None], up, rtol=0, atol=0)
    torch.testing.assert_close(lo / scale[:, None], down, rtol=0, atol=0)


@pytest.mark.parametrize("magnitude", [0.003, 1.0, 600.0])
def test_key_by_key_update_equals_encoding_the_true_bounds(magnitude):
    gen = torch.Generator().manual_seed(7)
    # Growing keys, so the row's scale changes while it is updated.
    keys = _keys(gen, magnitude, tokens=16) * torch.logspace(0, 3, 16)[None, :, None]
    keys = keys.to(torch.bfloat16).float()
    rows = kt_fp8.encode_rows(keys[:, 0], keys[:, 0])
    for t in range(1, keys.shape[1]):
        lo, hi = kt_fp8.decode_rows(rows, 64)
        rows = kt_fp8.encode_rows(torch.minimum(lo, keys[:, t]), torch.maximum(hi, keys[:, t]))
        want = kt_fp8.encode_rows(keys[:, : t + 1].amin(1), keys[:, : t + 1].amax(1))
        assert torch.equal(rows, want), t
