"""fp8 KT rows in Triton: the codec of ``algorithm.kt_fp8``, bit for bit.

A uint8 KT cache (kt_dtype "fp8_e4m3") holds rows of 2d + 16 bytes
(``formats.fp8_kt_row_bytes``): d min codes (e4m3fn), d max codes, the
row's fp32 power-of-two scale in bytes [2d, 2d+4), 12 zero bytes. Codes
round outward (min toward -inf, max toward +inf) so a decoded row still
bounds the page's keys; see ``algorithm.kt_fp8`` for why, and for the
oracle these helpers must match.

Only integer and fp32 ops, no tl.float8 types: the interpreter and every GPU
generation then agree, and the rounding is explicit. Divisions use
``div_rn`` (IEEE, like PyTorch; a plain fp32 ``/`` may be approximate on a
GPU). Scale bytes go through four byte loads / a 16-byte store, so rows need
no alignment.

``store_kt_fp8_rows`` serves the two KT writers (``compact`` and
``kt_update``), ``load_kt_fp8_bounds`` the scorer (``hsa_score``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rocketkv_vllm.kernels.formats import FP8_KT_SCALE_BYTES, fp8_kt_row_bytes

assert FP8_KT_SCALE_BYTES == 16  # the tail written by store_kt_fp8_rows


def kt_row_width(kt_cache: torch.Tensor, head_dim: int) -> int:
    """Last-dim size of a KT cache: 2d values, or 2d + 16 bytes for fp8 rows."""
    return fp8_kt_row_bytes(head_dim) if kt_cache.dtype == torch.uint8 else 2 * head_dim


@triton.jit
def _row_scale(maxabs):
    """kt_fp8.row_scale: the smallest 2**e with maxabs <= 448 * 2**e
    (from fl(maxabs / 448) like the oracle), 1.0 when that ratio is 0."""
    r = tl.math.div_rn(maxabs, tl.full(maxabs.shape, 448.0, tl.float32))
    tiny = r < 1.1754943508222875e-38  # subnormal ratio: lift it by 2**64 first
    r2 = r * tl.where(tiny, 18446744073709551616.0, 1.0)
    bits = r2.to(tl.int32, bitcast=True)
    # r2's binade if r2 is a power of two, else the next one up
    ebits = (bits & 0x7F800000) + tl.where((bits & 0x7FFFFF) == 0, 0, 0x800000)
    scale = ebits.to(tl.float32, bitcast=True)
    scale = tl.where(tiny, scale * 5.421010862427522e-20, scale)  # * 2**-64
    return tl.where(r > 0, scale, 1.0)


@triton.jit
def _encode(x, scale, UPWARD: tl.constexpr):
    """kt_fp8.encode: e4m3 codes (int32 0..255) of x / scale, rounded up
    (UPWARD) or down to the e4m3 grid; |x / scale| <= 448."""
    y = tl.math.div_rn(x, scale)
    m = tl.abs(y)
    bits = m.to(tl.int32, bitcast=True)
    normal = m >= 0.015625  # 2**-6, e4m3's smallest normal
    # normal: biased exponent (fp32's - 127) + 7, top 3 fraction bits; the
    # code of the largest e4m3 value <= m, exact iff no fraction bit is lost
    code_n = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)
    exact_n = (bits & 0xFFFFF) == 0
    # subnormal: multiples of 2**-9 (m * 512 is exact; NaN lanes -> 0)
    sub = tl.where(m < 0.015625, m, 0.0) * 512.0
    code_s = sub.to(tl.int32)  # floor: sub >= 0
    exact_s = code_s.to(tl.float32) == sub
    code = tl.where(normal, code_n, code_s)
    exact = tl.where(normal, exact_n, exact_s)
    # up = away from zero for y >= 0, toward zero for y < 0 (down: mirrored);
    # +1 steps to the next e4m3 magnitude (mantissa carries into exponent)
    if UPWARD:
        away = y >= 0
    else:
        away = y < 0
    code = code + tl.where(away & (~exact), 1, 0)
    return code | tl.where(y < 0, 0x80, 0)


@triton.jit
def _decode(code, scale):
    """e4m3fn code (uint8) -> fp32 value * scale, like
    ``view(torch.float8_e4m3fn).float() * scale`` (0x7f / 0xff are NaN)."""
    c = code.to(tl.int32)
    e = (c >> 3) & 15
    mant = (c & 7).to(tl.float32)
    pow2 = ((e + 117) << 23).to(tl.float32, bitcast=True)  # 2**(e - 10)
    mag = tl.where(e == 0, mant * 0.001953125, (mant + 8.0) * pow2)
    val = tl.where(c >= 128, -mag, mag)
    val = tl.where((c & 0x7F) == 0x7F, float("nan"), val)
    return val * scale


@triton.jit
def store_kt_fp8_rows(row_ptr, kmin, kmax, row_ok, d, d_ok, D: tl.constexpr):
    """Encode pages' min / max keys (fp32 [P, D_PAD], channels d [D_PAD]) and
    store the rows at row_ptr [P] (uint8 pointers to each row's byte 0) where
    row_ok [P]: exactly ``kt_fp8.encode_rows``."""
    ok = row_ok[:, None] & d_ok[None, :]
    kmin = tl.where(ok, kmin, 0.0)  # padded channels / pages: no inf, no NaN
    kmax = tl.where(ok, kmax, 0.0)
    maxabs = tl.max(tl.maximum(tl.abs(kmin), tl.abs(kmax)), 1)
    scale = _row_scale(maxabs)[:, None]
    ptrs = row_ptr[:, None] + d[None, :]
    tl.store(ptrs, _encode(kmin, scale, False).to(tl.uint8), mask=ok)
    tl.store(ptrs + D, _encode(kmax, scale, True).to(tl.uint8), mask=ok)
    # bytes [2d, 2d+16): the scale's fp32 bits little-endian, then zeros
    t = tl.arange(0, 16)[None, :]
    bits = scale.to(tl.int32, bitcast=True)
    tail = tl.where(t < 4, (bits >> (8 * (t & 3))) & 0xFF, 0)
    tl.store(row_ptr[:, None] + 2 * D + t, tail.to(tl.uint8), mask=row_ok[:, None] & (t < 16))


@triton.jit
def _load_scale(row_ptr, row_ok, D: tl.constexpr):
    """The fp32 scales [P, 1] of the rows at row_ptr [P] (four byte loads)."""
    s = row_ptr + 2 * D
    bits = (
        tl.load(s, mask=row_ok, other=0).to(tl.int32)
        | (tl.load(s + 1, mask=row_ok, other=0).to(tl.int32) << 8)
        | (tl.load(s + 2, mask=row_ok, other=0).to(tl.int32) << 16)
        | (tl.load(s + 3, mask=row_ok, other=0).to(tl.int32) << 24)
    )
    return bits.to(tl.float32, bitcast=True)[:, None]


@triton.jit
def load_kt_fp8_bounds(row_ptr, d, mask, row_ok, max_bits, min_bits, D: tl.constexpr):
    """The bound fp32 [P, D_PAD] of the rows at row_ptr [P]: per channel the
    decoded max where max_bits [D_PAD] (int8) is -1, the min where min_bits
    is -1, 0 where both are 0 and where mask [P, D_PAD] is off. The code byte
    of each channel is chosen by bit masks before one decode (code 0 is
    +0.0): the same values as decoding both halves and selecting, in fewer
    registers (8-bit masks instead of predicate tiles)."""
    ptrs = row_ptr[:, None] + d[None, :]
    cmin = tl.load(ptrs, mask=mask, other=0)
    cmax = tl.load(ptrs + D, mask=mask, other=0)
    code = (cmax & max_bits[None, :].to(tl.uint8)) | (cmin & min_bits[None, :].to(tl.uint8))
    return _decode(code, _load_scale(row_ptr, row_ok, D))
