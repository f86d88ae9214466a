"""K and V of vLLM CPU_ATTN's AMX layout, addressed per token.

With AMX (x86, bf16, blocks of a multiple of 32 tokens) CPU_ATTN stores each
head's block as ``[2 * block_size, d]`` elements, K first, then V, both
packed in tiles for its matrix units (offsets inside the K or V half, token
s, channel c; found by writing known values with vLLM's own cache write and
reading them back, ``backend.cpu_kv_layout``):

    K: (s // 16) * 16 * d + (c // 2) * 32 + (s % 16) * 2 + c % 2
    V: (c // 16) * 16 * block_size + (s // 2) * 32 + (c % 16) * 2 + s % 2

Both are plain strided 6-D views. ``PackedKV`` exposes one of them the way
``ops.pytorch`` (and the tests' reference) address a cache (a
``cache_view.CacheView``), ``cache[blocks, heads, slots]``
(heads a tensor or ``:``), for reads and writes, so the PyTorch path runs
unchanged on it; the Triton kernels (NVIDIA) never see this layout.
"""

from __future__ import annotations

import torch

from rocketkv_vllm.cache_view import CacheView


class PackedKV(CacheView):
    """K or V of an AMX-packed CPU_ATTN cache as [num_blocks, Hkv, bs, d]."""

    def __init__(self, kv_cache: torch.Tensor, kind: str) -> None:
        num_blocks, num_heads, block_size, width = kv_cache.shape
        d = width // 2
        if block_size % 32 or d % 16:
            raise ValueError(
                f"AMX packing needs block_size % 32 == 0 and d % 16 == 0, "
                f"got block_size {block_size}, d {d}"
            )
        outer = (kv_cache.stride(0), kv_cache.stride(1))
        offset = kv_cache.storage_offset()
        if kind == "k":
            self.packed = kv_cache.as_strided(
                (num_blocks, num_heads, block_size // 16, d // 2, 16, 2),
                (*outer, 16 * d, 32, 2, 1),
                offset,
            )
        elif kind == "v":
            self.packed = kv_cache.as_strided(
                (num_blocks, num_heads, d // 16, block_size // 2, 16, 2),
                (*outer, 16 * block_size, 32, 2, 1),
                offset + block_size * d,
            )
        else:
            raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
        self.kind = kind
        self.shape = torch.Size((num_blocks, num_heads, block_size, d))
        self.dtype = kv_cache.dtype
        self.device = kv_cache.device

    def _index(self, index):
        blocks, heads, slots = index
        if self.kind == "k":
            return (blocks, heads, slots // 16, slice(None), slots % 16, slice(None))
        return (blocks, heads, slice(None), slots // 2, slice(None), slots % 2)

    def read_blocks_into(self, blocks: torch.Tensor, out: torch.Tensor) -> None:
        """Whole blocks into ``out`` [len(blocks), Hkv, bs, d] (any strides,
        any dtype): one gather of the tiles, one copy that unpacks them."""
        tiles = self.packed[blocks]
        bs, d = self.shape[2], self.shape[3]
        if self.kind == "k":  # tiles [n, H, bs/16, d/2, 16, 2]
            dst = out.unflatten(2, (bs // 16, 16)).unflatten(4, (d // 2, 2))
            dst = dst.permute(0, 1, 2, 4, 3, 5)
        else:  # tiles [n, H, d/16, bs/2, 16, 2]
            dst = out.unflatten(2, (bs // 2, 2)).unflatten(4, (d // 16, 16))
            dst = dst.permute(0, 1, 4, 2, 5, 3)
        dst.copy_(tiles)

    def stored(self) -> PackedKV:
        """Itself: it takes writes (``view[blocks, heads, slots] = values``)."""
        return self

    def __getitem__(self, index) -> torch.Tensor:
        out = self.packed[self._index(index)]
        return out.reshape(*out.shape[:-2], self.shape[-1])

    def __setitem__(self, index, value: torch.Tensor) -> None:
        inner = (self.shape[-1] // 2, 2) if self.kind == "k" else (self.shape[-1] // 16, 16)
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value, dtype=self.dtype)
        self.packed[self._index(index)] = value.reshape(*value.shape[:-1], *inner)


def split_amx(kv_cache: torch.Tensor) -> tuple[PackedKV, PackedKV]:
    return PackedKV(kv_cache, "k"), PackedKV(kv_cache, "v")
