"""Triton kernels for RocketKV on vLLM's paged KV layout (``rocketkv_vllm.kernels``).

One concern per module, each a kernel or two plus its launcher:

* ``window_scores`` -- Stage 1 observation-window attention mass per key;
* ``compact``       -- in-place compaction of kept tokens, KT page builds;
* ``kt_update``     -- decode-time KT page refresh (optionally fused with
                       the K/V store), batched;
* ``rows``          -- the decode rows as the kernels read them: view
                       geometry, selection size, selection-store slot
                       (shared by the three decode kernels), and
                       ``DecodeRows``, the rows the launchers take whole;
* ``hsa_score``     -- HSA page scoring (logits, softmax partials; KT
                       update fused), batched, and the plan of the
                       scoring + selection pair;
* ``page_select``   -- page probabilities and top-n page selection (radix
                       search), batched;
* ``sparse_decode`` -- split-K decode attention over selected pages, batched;
* ``kt_fp8``        -- jit helpers that encode / decode fp8 KT rows;
* ``formats``       -- fp8 format codes and KT row sizes, shared with the
                       package (which imports them from here).

Every kernel reads / writes the KV cache through two views, ``k_cache`` and
``v_cache`` [num_blocks, Hkv, block_size, d]: block / head / slot /
channel strides arbitrary and passed per tensor (keys-only steps take just
``k_cache``). So the cache vLLM allocates for its own backend can be shared
whatever its K/V placement -- per token K|V on the last dim (FLASH_ATTN /
TRITON_ATTN), per head K rows then V rows, or with K transposed per head
block ([d, block_size], CPU_ATTN's vec layouts) -- and blocks may be
padded (the KT pages live in that padding): nothing outside
the two views' rows is touched. ``kt_cache`` [num_blocks, Hkv,
block_size // page_size, 2d] keeps min keys in [..., :d], max in [..., d:]
(kt_dtype "fp8_e4m3": uint8 rows of 2d + 16 bytes instead, see
``rocketkv_vllm.algorithm.kt_fp8``; the kernels tell them apart by dtype).

The channel stride is an ordinary integer argument: Triton specializes
integers equal to 1, so the contiguous case compiles exactly as with a
hard-coded unit stride.

No vLLM import anywhere here, and nothing from the package outside
``rocketkv_vllm.kernels``: the kernels are leaves (``tests/test_import_graph``);
``rocketkv_vllm.ops.triton`` composes them.
"""
