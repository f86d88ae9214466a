"""The implementations of RocketKV's steps, one module each, with the same
function names: ``triton`` (the Triton kernels' launchers, NVIDIA),
``cpu`` (the C++ CPU kernel's binding, Stage 2 on vLLM's CPU build),
``pytorch`` (batched PyTorch: Stage 1 on CPU, Stage 2 where the C++ kernel
is not built). Each module also holds its Stage classes (``TritonStage1``,
``TritonStage2``; ``CpuStage2``; ``TorchStage1``, ``TorchStage2``) beside the
launchers they call, on the interfaces of ``base`` (``Stage1``, ``Stage2``,
``HsaRows``); ``backend.stages`` chooses one per engine for each stage. The
kernels themselves live in ``rocketkv_vllm.kernels``; ``tests/reference/paged``
is the per-request reference they are all tested against. No module here
imports vLLM.
"""
