"""KT pages in fp8 (``rocketkv.kt_dtype = "fp8_e4m3"``): a row codec.

A KT row holds one page's element-wise min and max key for one KV head.
Stored in fp8 it must stay a *bound*: the stored min may only be lower and
the stored max only higher than the true ones, or HSA's upper bound
q . bound(page) could undershoot and a page that should win could lose.

Row format (``row_bytes(d)`` = 2d + 16 bytes, 16-byte aligned rows):

    [0, d)       min codes, e4m3fn (1 sign, 4 exponent bits with bias 7, 3
                 mantissa bits; 0x7f / 0xff are NaN, 448 is the largest)
    [d, 2d)      max codes
    [2d, 2d+4)   the row's scale, fp32, a power of two
    [2d+4, 2d+16) zero

value = e4m3(code) * scale. The scale is the smallest power of two with
max|x| / scale <= 448 (1.0 for an all-zero row), so x / scale is exact and
never saturates; codes round *outward* (min toward -inf, max toward +inf)
to the nearest e4m3 value.

Power-of-two scales keep e4m3's grid binade-aligned: a row's grid at a
larger scale is a subset of its grid at a smaller one. So folding a new key
into a decoded row and encoding again (the decode-time KT update) gives
exactly the row that encoding the page's true min/max would: every
implementation (this oracle, batched PyTorch, C++, Triton) can update KT
incrementally and still agree bit for bit.

Decoded values have at most 4 significant bits and fp32's exponent range,
so they are exact in bf16 (the Triton scoring path relies on this).
"""

from __future__ import annotations

import torch

# The row geometry is shared with the Triton codec, which may not import
# this package: it is defined beside the kernels (``kernels.formats``).
from rocketkv_vllm.kernels.formats import FP8_KT_SCALE_BYTES as SCALE_BYTES
from rocketkv_vllm.kernels.formats import fp8_kt_row_bytes as row_bytes

__all__ = [
    "E4M3_MAX",
    "SCALE_BYTES",
    "decode_rows",
    "encode",
    "encode_rows",
    "row_bytes",
    "row_scale",
]

E4M3_MAX = 448.0


def _round_toward_zero(m: torch.Tensor) -> torch.Tensor:
    """e4m3 code (sign bit clear) of the largest value <= m, for 0 <= m <= 448."""
    frac, exp = torch.frexp(m)  # m = frac * 2**exp, frac in [0.5, 1)
    # normal: biased exponent (exp - 1) + 7, mantissa floor(frac * 16) - 8
    normal = ((exp + 6) << 3) | (torch.floor(frac * 16).to(torch.int32) - 8)
    subnormal = torch.floor(m * 512).to(torch.int32)  # multiples of 2**-9
    return torch.where(m >= 2.0**-6, normal, subnormal)


def row_scale(kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale per row [...]: smallest 2**e with max|x| <= 448 * 2**e."""
    maxabs = torch.maximum(kmin.abs().amax(-1), kmax.abs().amax(-1)).float()
    frac, exp = torch.frexp(maxabs / E4M3_MAX)
    # ratio = frac * 2**exp: a power of two itself when frac == 0.5
    e = torch.where(frac == 0.5, exp - 1, exp)
    return torch.where(maxabs > 0, torch.exp2(e.float()), torch.ones_like(maxabs))


def encode(x: torch.Tensor, scale: torch.Tensor, upward: bool) -> torch.Tensor:
    """e4m3 codes (uint8) of x / scale rounded up (``upward``) or down."""
    y = x.float() / scale[..., None]
    m = y.abs()
    code = _round_toward_zero(m)
    inexact = code.to(torch.uint8).view(torch.float8_e4m3fn).float() != m
    # Up means away from zero for positive y and toward zero for negative y.
    away = (y >= 0) if upward else (y < 0)
    code = code + (inexact & away).to(torch.int32)
    return (code | torch.where(y < 0, 0x80, 0)).to(torch.uint8)


def encode_rows(kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """KT rows [..., row_bytes(d)] uint8 from min and max keys [..., d]."""
    scale = row_scale(kmin, kmax)
    head = torch.cat([encode(kmin, scale, upward=False), encode(kmax, scale, upward=True)], dim=-1)
    tail = torch.zeros(*head.shape[:-1], SCALE_BYTES, dtype=torch.uint8, device=head.device)
    tail[..., :4] = scale.float()[..., None].view(torch.uint8)
    return torch.cat([head, tail], dim=-1)


def decode_rows(rows: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) fp32 [..., d] of KT rows [..., row_bytes(d)] uint8."""
    d = head_dim
    codes = rows[..., : 2 * d].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[..., 2 * d : 2 * d + 4].contiguous().view(torch.float32)
    values = codes * scale
    return values[..., :d], values[..., d:]
