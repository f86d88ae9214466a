"""Triton kernels for RocketKV on vLLM's paged KV layout (``rocketkv_vllm.kernels``).

One concern per module, each a kernel or two plus its launcher:

* ``window_scores`` -- Stage 1 observation-window attention mass per key;
* ``compact``       -- in-place compaction of kept tokens, KT page builds;
* ``kt_update``     -- decode-time KT page refresh (optionally fused with
                       the K/V store), batched;
* ``hsa_score``     -- HSA page probabilities and page selection, batched;
* ``sparse_decode`` -- split-K decode attention over selected pages, batched;
* ``dense_decode``  -- the dense paged decode baseline.

No vLLM import anywhere here; ``rocketkv_vllm.triton_ops`` composes them.
"""
