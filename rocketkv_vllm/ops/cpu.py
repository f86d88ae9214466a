"""Stage 2 on CPU as one native call (``kernels/cpu_hsa_decode.cpp``).

Built on first use with PyTorch's C++ extension loader (g++; cached per
machine under ``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) and loaded in every process that needs it.
Same math as ``ops.pytorch.hsa_decode``, its test oracle; it reads the KV
cache in CPU_ATTN's own layouts (``layout.split_kv``: head_rows, cpu_vec,
cpu_amx) through the raw per-layer cache tensor, fp8 codes included.
``CpuStage2`` is the stage the impl calls (``ops.base.Stage2``).
"""

from __future__ import annotations

import functools
from importlib import resources

import torch

from rocketkv_vllm.fp8_kv import KVQuant
from rocketkv_vllm.kernels.formats import FORMAT_CODES
from rocketkv_vllm.kernels.rows import DecodeRows
from rocketkv_vllm.ops.base import HsaRows, Stage2

LAYOUT_CODES = {"head_rows": 0, "cpu_vec": 1, "cpu_amx": 2}


@functools.cache
def _extension():
    from torch.utils.cpp_extension import load

    source = resources.files("rocketkv_vllm.kernels") / "cpu_hsa_decode.cpp"
    return load(
        name="rocketkv_cpu_hsa_decode",
        sources=[str(source)],
        # -fopenmp-simd: vectorize the marked loops, no OpenMP runtime;
        # 512-bit vectors where the CPU has them (GCC prefers 256 by default;
        # measured 1.5x faster Stage 2 on this AVX-512 machine).
        extra_cflags=["-O3", "-march=native", "-fopenmp-simd", "-mprefer-vector-width=512"],
        verbose=False,
    )


def build_error() -> str | None:
    """None when the extension builds and loads here, else why not."""
    try:
        _extension()
    except Exception as exc:  # compiler missing, build failure, ...
        return f"{type(exc).__name__}: {exc}"
    return None


def hsa_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    kt_cache: torch.Tensor,
    layout: str,
    rows: DecodeRows,
    num_select: torch.Tensor,
    page_size: int,
    scale: float,
    force_current_page: bool,
    sinks: torch.Tensor | None = None,
    quant: KVQuant | None = None,
    selections: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [B, Hq, d]; kv_cache the layer's [num_blocks, Hkv, bs, 2d] cache;
    kt_cache ``layout.kt_cache_view``; rows the decode rows (``DecodeRows``:
    block_table, num_compact, tail_start, seq_lens, topr, and sel_slot,
    reuse with a store; topk and the bounds are not read) and num_select
    ([B], ``HsaRows``'); sinks: optional [Hq] sink logits (fp32, or any
    float dtype: converted), in the exact attention's softmax only
    (``algorithm.sinks``); quant: the layer's fp8 format and scales when
    kv_cache holds fp8 codes (``fp8_kv``); selections: the selection store
    int32 [S, Hkv, W] (``Stage2.decode``), read with the rows' slots and
    reuse flags (None: they are not read). Updates the KT pages of each
    row's newest token; returns [B, Hq, d]."""
    if layout not in LAYOUT_CODES:
        raise ValueError(f"CPU Stage 2 reads layouts {sorted(LAYOUT_CODES)}, not {layout!r}")
    sel_slot, reuse = rows.store_columns(selections)  # the kernel checks the rest
    return _extension().hsa_decode(
        query,
        kv_cache,
        kt_cache,
        rows.block_table,
        rows.num_compact,
        rows.tail_start,
        rows.seq_lens,
        rows.topr,
        num_select,
        page_size,
        scale,
        force_current_page,
        LAYOUT_CODES[layout],
        sinks,
        0 if quant is None else FORMAT_CODES[quant.fp8_dtype],
        1.0 if quant is None else quant.k_scale,
        1.0 if quant is None else quant.v_scale,
        selections,
        sel_slot,
        reuse,
    )


class CpuStage2(Stage2):
    name = "native CPU kernel"

    def decode(
        self,
        query,
        kv_cache,
        rows: HsaRows,
        scale,
        out=None,
        sinks=None,
        quant=None,
        selections=None,
    ):
        assert out is None, "the FULL-graph layout runs the Triton kernels only"
        s = self.settings
        return hsa_decode(
            query,
            kv_cache,
            self._kt(kv_cache),
            self.kv_layout,
            rows.decode_rows,
            rows.num_select,
            s.page_size,
            scale,
            s.force_current_page,
            sinks=sinks,
            quant=quant,
            selections=selections,
        )
