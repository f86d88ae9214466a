"""vLLM's model runners on vLLM's CPU build, chosen before vLLM is imported.

``v1`` is the V1 runner of vLLM's CPU build, which every engine test uses.
``v2`` runs vLLM's Model Runner V2, NVIDIA's default: vLLM's CPU build has
it (``vllm/v1/worker/cpu/model_runner.py``) but turns it down unless Triton
has a CPU backend, because the runner prepares its inputs and samples in
Triton kernels. Here Triton's interpreter runs them (``TRITON_INTERPRET=1``),
so no driver is ever used, and Triton's NVIDIA backend is entered under the
name "cpu" only so that vLLM's import-time check finds a backend.
``v2-async`` adds NVIDIA's other default, async scheduling (vLLM's
``AsyncScheduler`` schedules a step while the one before it runs), which
vLLM's CPU platform turns off: its config hook is wrapped to turn it back on.
"""

from __future__ import annotations

import os

RUNNERS = ("v1", "v2", "v2-async")


def use_runner(runner: str) -> None:
    """Make this process's vLLM engines run ``runner``; call it before
    anything imports vLLM (engine core and worker run in this process)."""
    if runner not in RUNNERS:
        raise SystemExit(f"unknown runner {runner!r}: one of {', '.join(RUNNERS)}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker here
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if runner == "v1":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        return
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.backends

    triton.backends.backends.setdefault("cpu", triton.backends.backends["nvidia"])
    if runner == "v2-async":
        from vllm.platforms.cpu import CpuPlatform

        platform_hook = CpuPlatform.check_and_update_config.__func__

        def with_async_scheduling(cls, vllm_config):
            platform_hook(cls, vllm_config)  # sets async_scheduling False
            # vLLM reads it after this hook ("the platform has the last word").
            vllm_config.scheduler_config.async_scheduling = True

        CpuPlatform.check_and_update_config = classmethod(with_async_scheduling)
