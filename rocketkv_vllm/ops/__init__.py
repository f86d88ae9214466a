"""The implementations of RocketKV's steps, one module each, with the same
function names: ``triton`` (the Triton kernels' launchers, NVIDIA),
``cpu`` (the C++ CPU kernel's binding, Stage 2 on vLLM's CPU build),
``pytorch`` (batched PyTorch: Stage 1 on CPU, Stage 2 where the C++ kernel
is not built). ``backend.stages`` chooses one per engine for each stage; the
kernels themselves live in ``rocketkv_vllm.kernels``; ``tests/reference/paged`` is
the per-request reference they are all tested against.
"""
