"""ROCKETKV reads and writes the KV cache that vLLM's own CPU kernels use.

The layout probe must pick views through which (1) what CPU_ATTN's cache
write stores reads back exactly, and (2) CPU_ATTN's attention kernel over
the cache equals our dense attention over the same views (so the kernel
reads what our compaction writes). vLLM CPU build only.
"""

import pytest
import torch

from rocketkv_vllm import paged

ops = pytest.importorskip("vllm._custom_ops")
from rocketkv_vllm.backend import cpu_kv_layout  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", ["vec", "vec16"])
def test_native_kernel_reads_what_our_views_hold(dtype, isa):
    hkv, g, d, bs, num_blocks, n = 3, 3, 64, 32, 12, 150
    layout = cpu_kv_layout(isa, dtype, d, bs)
    assert layout == "cpu_vec"
    # Padded blocks, as the ROCKETKV KV spec allocates them.
    block_elems = hkv * bs * 2 * d + 1000
    storage = torch.zeros(num_blocks * block_elems, dtype=dtype)
    kv = storage.as_strided((num_blocks, hkv, bs, 2 * d), (block_elems, bs * 2 * d, 2 * d, 1))
    k_cache, v_cache = paged.split_kv(kv, layout)
    gen = torch.Generator().manual_seed(1)
    row = torch.randperm(num_blocks, generator=gen)[: -(-n // bs)]
    # We write the cache (as compaction does); the native kernel reads it.
    # (Unwritten slots are zero: the kernel reads and masks whole blocks.)
    keys = torch.randn(n, hkv, d, generator=gen).to(dtype)
    values = torch.randn(n, hkv, d, generator=gen).to(dtype)
    slots = row[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    paged.write_kv(k_cache, v_cache, keys, values, slots)
    q = torch.randn(1, hkv * g, d, generator=gen).to(dtype)
    out = torch.empty_like(q)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    seq = torch.tensor([n], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=hkv * g, num_kv_heads=hkv, head_dim=d, seq_lens=seq,
        dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1,
        isa=isa, enable_kv_split=False)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=k_cache, value_cache=v_cache, output=out,
        query_start_loc=qsl, seq_lens=seq, scale=d**-0.5, causal=True,
        alibi_slopes=None, sliding_window=-1, block_table=row[None].int(),
        softcap=0, scheduler_metadata=meta, s_aux=None)
    ref = paged.dense_attention(q, torch.tensor([n - 1]), k_cache, v_cache, row, n,
                                d**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
