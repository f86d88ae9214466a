"""Typed views of one layer's K or V cache, as ``layout.split_kv`` gives them.

Each of K and V is a ``KVView`` [num_blocks, Hkv, block_size, d]:

* a plain strided ``torch.Tensor`` (the "token", "head_rows" and "cpu_vec"
  layouts in a float dtype): what every implementation reads, the Triton
  kernels included (``kernels``: all four strides arbitrary);
* a ``CacheView`` where no strided tensor of numbers holds the elements:
  ``packed_kv.PackedKV`` (CPU_ATTN's AMX tiles, read and written per token)
  and ``fp8_kv.Fp8KV`` (fp8 codes, read as fp32 values; over a tensor or a
  ``PackedKV`` of codes).

A ``CacheView`` is addressed like the tensor it stands for
(``view[blocks, heads, slots]``), and says how whole blocks are read, where
its elements are stored (what compaction moves), and what a Triton kernel
takes in its place (``kernel_operand``, the protocol of
``kernels._utils.kv_operand``). ``read_blocks_into`` and ``stored`` below
take either kind of ``KVView``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class CacheView(ABC):
    """K or V of a layer's cache as [num_blocks, Hkv, block_size, d] that is
    not a strided tensor of numbers."""

    shape: torch.Size  # [num_blocks, Hkv, block_size, d]
    dtype: torch.dtype  # of the elements as read
    device: torch.device

    @abstractmethod
    def __getitem__(self, index) -> torch.Tensor:
        """Elements at ``[blocks, heads, slots]`` (heads a tensor or ``:``)
        as a new tensor, like indexing the tensor this view stands for."""

    @abstractmethod
    def read_blocks_into(self, blocks: torch.Tensor, out: torch.Tensor) -> None:
        """Whole blocks into ``out`` [len(blocks), Hkv, bs, d] (any strides)."""

    @abstractmethod
    def stored(self) -> KVView:
        """What holds the elements: compaction moves tokens there, so kept
        tokens stay bit for bit what vLLM's backend wrote."""

    def kernel_operand(self) -> tuple[torch.Tensor, int, float]:
        """(tensor, FP8, scale) a Triton kernel reads for this view
        (``kernels._utils.kv_operand``); none by default."""
        raise TypeError(
            f"the Triton kernels read strided tensors, not a {type(self).__name__} "
            "(CPU_ATTN's AMX layout is read by the PyTorch path only)"
        )


KVView = torch.Tensor | CacheView


def read_blocks_into(cache: KVView, blocks: torch.Tensor, out: torch.Tensor) -> None:
    """Whole blocks of ``cache`` into ``out`` [len(blocks), Hkv, bs, d]."""
    if isinstance(cache, CacheView):
        cache.read_blocks_into(blocks, out)
    else:
        out.copy_(cache[blocks])


def read_blocks(cache: KVView, blocks: torch.Tensor) -> torch.Tensor:
    """Whole blocks of ``cache`` as a new tensor [len(blocks), Hkv, bs, d]."""
    if isinstance(cache, CacheView):
        out = torch.empty((len(blocks), *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
        cache.read_blocks_into(blocks, out)
        return out
    return cache[blocks]


def stored(cache: KVView) -> KVView:
    """Where ``cache``'s elements are stored (a tensor: itself)."""
    return cache.stored() if isinstance(cache, CacheView) else cache
