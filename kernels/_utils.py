"""Small helpers shared by the kernels and their launchers."""

from __future__ import annotations

import functools
import os
from typing import Protocol

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_upcast(dtype: torch.dtype) -> bool:
    """Whether ``mma`` must upcast its operands to fp32.

    Triton 3.9's interpreter multiplies bf16 operands as their raw uint16
    bits (``create_dot`` feeds numpy the storage view), so under the
    interpreter bf16 tiles go through fp32; bf16 x bf16 products are exact in
    fp32, so this matches the GPU's bf16 MMA with fp32 accumulation.
    """
    return interpreting() and dtype == torch.bfloat16


@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation; fp32 operands use exact IEEE products
    (no TF32), 16-bit operands the tensor cores."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


class KernelOperand(Protocol):
    """A K or V cache view that is not itself a strided tensor (the package's
    ``cache_view.CacheView``): it says what a kernel reads in its place."""

    def kernel_operand(self) -> tuple[torch.Tensor, int, float]:
        """(uint8 codes, FP8 code of ``formats.FORMAT_CODES``, scale) of an
        fp8 view; raises TypeError where no strided tensor holds the view."""
        ...


def kv_operand(cache: torch.Tensor | KernelOperand) -> tuple[torch.Tensor, int, float]:
    """(tensor, FP8, scale) a kernel takes for one K or V cache view: an
    ``fp8_kv.Fp8KV`` (``split_kv`` with the layer's quant) gives its uint8
    codes, its format (FP8 1: e4m3, 2: e5m2) and scale; a view in a float
    dtype is itself, 0, 1.0. Raw uint8 views are refused: fp8 codes read as
    numbers would be silently wrong."""
    if not isinstance(cache, torch.Tensor):
        return cache.kernel_operand()
    assert cache.dtype != torch.uint8, (
        "an fp8 KV cache is read through fp8_kv.Fp8KV views (split_kv with the layer's quant)"
    )
    return cache, 0, 1.0


@triton.jit
def kv_values(x, scale, FP8: tl.constexpr):
    """Loaded cache elements as numbers: fp8 codes (FP8 1: e4m3, 2: e5m2)
    times the layer's scale in fp32, as vLLM's TRITON_ATTN reads them; a
    cache in a float dtype as stored."""
    if FP8 == 1:
        return x.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    elif FP8 == 2:
        return x.to(tl.float8e5, bitcast=True).to(tl.float32) * scale
    else:
        return x


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (1 for x <= 1)."""
    x = int(x)
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a small constant elsewhere,
    which keeps grids small under the Triton interpreter)."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 2


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_capable(major: int) -> bool:
    """Whether GPUs of this compute capability major have programmatic
    dependent launch (griddepcontrol: Hopper, sm_90, and later)."""
    return major >= 9


def uses_pdl(device: torch.device) -> bool:
    """Launch Stage 2's decode kernels with programmatic dependent launch:
    on compute capability 9.0 and later, the next kernel's programs start
    while this one's last programs drain, and every program waits for the
    kernels before it first (``grid_dependency``). ``ROCKETKV_PDL=0`` turns
    it off (for timing with and without)."""
    if device.type != "cuda" or torch.version.hip or interpreting():
        return False  # (ROCm's devices are "cuda" too: no griddepcontrol there)
    if os.environ.get("ROCKETKV_PDL", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return pdl_capable(_cuda_capability(index)[0])


@triton.jit
def grid_dependency(PDL: tl.constexpr):
    """First thing in every program of a kernel launched with PDL: wait until
    the kernels before it in the stream have finished and their writes are
    visible (every program waits, also one with nothing to do: the next
    kernel's wait on this one must cover those before it), then let the next
    kernel's programs launch (they wait the same way)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def group_pad(group: int) -> int:
    """GQA group padded to a power of two and to tl.dot's minimum M of 16."""
    return max(16, next_pow2(group))


def head_pad(head_dim: int) -> int:
    return max(16, next_pow2(head_dim))


def row_vectors(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-row scalars as contiguous 1-D tensors (kernels read element b at
    ptr + b); a no-op for the usual contiguous int32 vectors."""
    return tuple(
        t if t.dim() == 1 and t.stride(0) == 1 else t.reshape(-1).contiguous() for t in tensors
    )


def check_kv_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor | None = None
) -> tuple[int, int, int]:
    """(Hkv, block_size, head_dim) of a K/V cache view pair.

    k_cache, v_cache: [num_blocks, Hkv, block_size, d] views with arbitrary
    strides, the channel (last) dim included: K and V may interleave per
    token, sit in separate row ranges of a block, K may be stored transposed
    per head block ([d, block_size], vLLM's CPU_ATTN), blocks may be padded;
    the kernels take all four strides per tensor. v_cache None: a keys-only
    caller.
    """
    assert k_cache.dim() == 4, "k_cache must be [num_blocks, Hkv, block_size, d]"
    if v_cache is not None:
        assert v_cache.shape == k_cache.shape, (
            f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ"
        )
        assert v_cache.dtype == k_cache.dtype and v_cache.device == k_cache.device
    _, hkv, bs, d = k_cache.shape
    return hkv, bs, d


def cache_strides(cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(block, head, slot, channel) strides of a [num_blocks, Hkv, bs, d] view.

    The channel stride is a plain (non-constexpr) kernel argument: Triton
    specializes integer arguments equal to 1, so a contiguous last dim
    compiles to the same unit-stride, vectorised loads as before, and a
    strided one (e.g. K transposed per head block) to its own variant.
    """
    return cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3)
