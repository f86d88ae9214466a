"""Where RocketKV's data sits in vLLM's paged KV cache: views, no math.

One attention layer's cache (LBHNC, what vLLM hands the backend):
  kv_cache [num_blocks, Hkv, block_size, 2*d], shared with vLLM's own
      attention backend, which decides where K and V sit inside a block
      (``split_kv``). Every implementation works on the two views
      k_cache / v_cache [num_blocks, Hkv, block_size, d] with any strides.
  kt_cache [num_blocks, Hkv, block_size // page_size, 2*d]: per page of
      page_size slots, element-wise min key in [..., :d], max key in [..., d:].
      It lives in the padding vLLM allocates after each block (see
      ``kt_cache_view``), so it is counted and freed with the block; the KT
      page table of a sequence is therefore its block table. With
      kt_dtype "fp8_e4m3", or with an fp8 KV cache (uint8: ``fp8_kv``), it
      is uint8 [..., 2*d + 16] instead: rows of ``algorithm.kt_fp8``
      (outward-rounded fp8 codes and a scale); every implementation tells
      the two apart by the tensor's dtype.

A request's logical slot s lives at block ``block_row[s // bs]``, offset
``s % bs``. After compression the slots a request attends to are its
*view*: [0, num_compact) (kept tokens, compacted per head) and
[tail_start, seq_len) (last prompt block kept in place, then generated
tokens). Pages of the view start at 0 and at tail_start, page_size apart.

Torch only (no vLLM import): the scheduler's block manager sizes blocks
with ``kt_row_bytes``; the stages and the reference read through the views.
"""

from __future__ import annotations

import torch

from rocketkv_vllm.algorithm import kt_fp8
from rocketkv_vllm.cache_view import KVView
from rocketkv_vllm.fp8_kv import KVQuant, dequantized


def kt_format(cache_dtype: torch.dtype, kt_dtype: str) -> str:
    """The KT rows' format: the setting, except that an fp8 KV cache (uint8
    codes, whose dtype cannot hold min/max keys) always has fp8 rows."""
    return "fp8_e4m3" if cache_dtype == torch.uint8 else kt_dtype


def kt_row_bytes(head_dim: int, dtype: torch.dtype, kt_dtype: str) -> int:
    """Bytes of one KT row (one page, one KV head) of a cache of ``dtype``."""
    if kt_format(dtype, kt_dtype) == "fp8_e4m3":
        return kt_fp8.row_bytes(head_dim)
    assert kt_dtype == "auto", kt_dtype
    return 2 * head_dim * dtype.itemsize


def kt_cache_view(kv_cache: torch.Tensor, page_size: int, kt_dtype: str = "auto") -> torch.Tensor:
    """The KT pages stored in the per-block padding behind ``kv_cache``:
    [num_blocks, Hkv, pages, 2d] in the cache dtype, or uint8
    [num_blocks, Hkv, pages, 2d + 16] fp8 rows (``algorithm.kt_fp8``)."""
    num_blocks, num_heads, block_size, width = kv_cache.shape
    pages = block_size // page_size
    size = kv_cache.element_size()
    kv_bytes = num_heads * block_size * width * size
    row = kt_row_bytes(width // 2, kv_cache.dtype, kt_dtype)
    assert kv_cache.stride(0) * size >= kv_bytes + num_heads * pages * row, (
        "KV block has no room for the KT cache: was the ROCKETKV spec used?"
    )
    rows = torch.as_strided(
        kv_cache.view(torch.uint8),  # its last dim is contiguous
        size=(num_blocks, num_heads, pages, row),
        stride=(kv_cache.stride(0) * size, pages * row, row, 1),
        storage_offset=kv_cache.storage_offset() * size + kv_bytes,
    )
    return rows if kt_format(kv_cache.dtype, kt_dtype) == "fp8_e4m3" else rows.view(kv_cache.dtype)


def kt_bounds(kt_rows: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) keys [..., d] of KT rows gathered from a ``kt_cache_view``
    (fp32 for fp8 rows, the cache dtype otherwise)."""
    if kt_rows.dtype == torch.uint8:
        return kt_fp8.decode_rows(kt_rows, head_dim)
    return kt_rows[..., :head_dim], kt_rows[..., head_dim:]


def kt_rows_of(kt_cache: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """KT rows in ``kt_cache``'s format for min and max keys [..., d]."""
    if kt_cache.dtype == torch.uint8:
        return kt_fp8.encode_rows(kmin, kmax)
    return torch.cat([kmin, kmax], dim=-1).to(kt_cache.dtype)


KV_LAYOUTS = ("token", "head_rows", "cpu_vec", "cpu_amx")


def split_kv(
    kv_cache: torch.Tensor, layout: str, quant: KVQuant | None = None
) -> tuple[KVView, KVView]:
    """K and V views [num_blocks, Hkv, block_size, d] of a layer's cache
    (``cache_view.KVView``: strided tensors, or ``CacheView`` objects where
    no strided tensor of numbers holds them); with ``quant`` (an
    ``fp8_kv.KVQuant``: the cache holds fp8 codes) the views read fp32
    values (``fp8_kv.Fp8KV``; their ``codes`` are the bytes).

    "token": K|V on the last dim of every token (vLLM's FLASH_ATTN and
    TRITON_ATTN); "head_rows": each head's block is [2 * block_size, d], K
    rows first, then V rows; "cpu_vec": the same halves, but K stored
    transposed, [d, block_size] (what vLLM's CPU_ATTN writes with its vec
    and vec16 kernels; the K view's last dim then has stride block_size);
    "cpu_amx": CPU_ATTN's AMX tiles (``packed_kv.PackedKV`` accessors, not
    tensors: the PyTorch path only).
    """
    if (kv_cache.dtype == torch.uint8) != (quant is not None):
        # Reading fp8 codes as numbers would be silently wrong.
        raise ValueError(
            f"split_kv: a {kv_cache.dtype} cache with quant={quant}: fp8 caches "
            "(uint8) are read with their KVQuant, others without"
        )
    if quant is not None:
        return dequantized(*_split(kv_cache, layout), quant)
    return _split(kv_cache, layout)


def _split(kv_cache: torch.Tensor, layout: str) -> tuple[KVView, KVView]:
    num_blocks, num_heads, block_size, width = kv_cache.shape
    d = width // 2
    if layout == "token":
        return kv_cache[..., :d], kv_cache[..., d:]
    if layout == "head_rows":
        rows = kv_cache.view(num_blocks, num_heads, 2 * block_size, d)
        return rows[:, :, :block_size], rows[:, :, block_size:]
    if layout == "cpu_vec":
        block_stride, head_stride = kv_cache.stride(0), kv_cache.stride(1)
        shape = (num_blocks, num_heads, block_size, d)
        offset = kv_cache.storage_offset()
        k = kv_cache.as_strided(shape, (block_stride, head_stride, 1, block_size), offset)
        v = kv_cache.as_strided(shape, (block_stride, head_stride, d, 1), offset + block_size * d)
        return k, v
    if layout == "cpu_amx":
        # Tile-packed (CPU_ATTN's AMX kernels): per-token accessors, PyTorch only.
        from rocketkv_vllm.packed_kv import split_amx

        return split_amx(kv_cache)
    raise ValueError(f"unknown KV layout {layout!r}: allowed {KV_LAYOUTS}")


def physical_slots(block_row: torch.Tensor, slots: torch.Tensor, block_size: int):
    """(block ids, offsets) of logical slots of one request."""
    return block_row[slots // block_size].long(), slots % block_size
