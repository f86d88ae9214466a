"""Which Stage 1 and Stage 2 an engine runs, chosen once per engine.

The stages themselves live beside the launchers they call (``ops.triton``:
``TritonStage1``, ``TritonStage2``; ``ops.cpu``: ``CpuStage2``;
``ops.pytorch``: ``TorchStage1``, ``TorchStage2``) on the interfaces of
``ops.base``. The impl calls both the same way: ``stage1.compress(...)`` per
prompt, ``stage2.decode(...)`` per step.
"""

from __future__ import annotations

import functools

from vllm.logger import init_logger

from rocketkv_vllm.config import RocketKVSettings
from rocketkv_vllm.ops import cpu as cpu_ops
from rocketkv_vllm.ops.base import Stage1, Stage2
from rocketkv_vllm.ops.pytorch import TorchStage1, TorchStage2

logger = init_logger(f"vllm.{__name__}")


def uses_triton(settings: RocketKVSettings) -> bool:
    """Triton kernels on NVIDIA GPUs (or anywhere when forced), else CPU."""
    if settings.kernel != "auto":
        return settings.kernel == "triton"
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


@functools.cache
def stage1_for(settings: RocketKVSettings) -> Stage1:
    """The engine's Stage 1: the Triton kernels with Triton's Stage 2, else
    PyTorch."""
    if uses_triton(settings):
        from rocketkv_vllm.ops.triton import TritonStage1

        impl: Stage1 = TritonStage1()
    else:
        impl = TorchStage1()
    logger.info_once("ROCKETKV: Stage 1 runs in the %s.", impl.name)
    return impl


@functools.cache
def stage2_for(settings: RocketKVSettings, kv_layout: str) -> Stage2:
    """The engine's Stage 2: Triton where it runs, on CPU the C++ kernel for
    CPU_ATTN's layouts with kernel 'auto' (if it builds here), else PyTorch.
    Every implementation reads fp8 caches."""
    if uses_triton(settings):
        if kv_layout == "cpu_amx":
            raise ValueError(
                "rocketkv.kernel='triton' is invalid with CPU_ATTN's AMX cache layout "
                "(bf16, block_size a multiple of 32): allowed 'auto' or 'torch', or "
                "block_size 16"
            )
        from rocketkv_vllm.ops.triton import TritonStage2

        impl: Stage2 = TritonStage2(settings, kv_layout)
    elif settings.kernel == "auto" and kv_layout in cpu_ops.LAYOUT_CODES:
        error = cpu_ops.build_error()
        if error is None:
            impl = cpu_ops.CpuStage2(settings, kv_layout)
        else:
            logger.warning(
                "ROCKETKV: the native CPU Stage 2 kernel is unavailable "
                "(%s); decoding with the slower PyTorch path.",
                error,
            )
            impl = TorchStage2(settings, kv_layout)
    else:
        impl = TorchStage2(settings, kv_layout)
    logger.info_once("ROCKETKV: Stage 2 runs in the %s.", impl.name)
    return impl
