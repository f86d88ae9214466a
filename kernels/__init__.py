"""Triton kernels for RocketKV on vLLM's paged KV layout (``rocketkv_vllm.kernels``)."""
