"""Run this machine as a CPU without AVX-512 (AVX2 + FMA only), for timing
and testing what such a CPU runs, e.g. the demo on a fresh clone:

    EMULATE_AVX2=1 PYTHONPATH=scripts/emulate_avx2 ATEN_CPU_CAPABILITY=avx2 \\
        ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        TORCH_EXTENSIONS_DIR=/tmp/avx2-ext ROCKETKV_DEMO_CPU_FLAGS="... avx avx2 fma ..." \\
        make demo

Python imports this file at start-up in every process (vLLM's spawned
engine and workers too) when its folder is on PYTHONPATH. With
EMULATE_AVX2=1 it makes torch's CPU-capability queries answer no for AVX-512
and AMX, so vLLM's CPU build loads its AVX2 kernels (``vllm._C_AVX2``) and
picks its non-AVX-512 attention, and it builds ROCKETKV's C++ kernel for
Haswell instead of ``-march=native``. The environment variables above keep
torch's, oneDNN's and MKL's own dispatch to AVX2; ROCKETKV_DEMO_CPU_FLAGS
gives the demo an AVX2 machine's flags. The clock, cores and caches stay
this machine's.
"""

import os


def _emulate() -> None:
    try:
        import torch
    except ImportError:  # pip, before torch is installed
        return
    import torch.cpu
    import torch.utils.cpp_extension as cpp_extension

    for name in (
        "_is_avx512_supported",
        "_is_avx512_bf16_supported",
        "_is_avx512_vnni_supported",
        "_is_amx_tile_supported",
        "_is_amx_fp16_supported",
    ):
        for module in (torch.cpu, torch._C._cpu):
            if hasattr(module, name):
                setattr(module, name, lambda: False)
    load = cpp_extension.load

    def load_for_haswell(*args, **kwargs):
        flags = kwargs.get("extra_cflags") or []
        flags = ["-march=haswell" if f == "-march=native" else f for f in flags]
        kwargs["extra_cflags"] = [f for f in flags if f != "-mprefer-vector-width=512"]
        kwargs["name"] = kwargs["name"] + "_haswell"
        return load(*args, **kwargs)

    cpp_extension.load = load_for_haswell


if os.environ.get("EMULATE_AVX2") == "1":
    _emulate()
