"""ROCKETKV on an fp8 KV cache (``fp8_kv``), below the engine.

vLLM's CPU_ATTN stores fp8 only on CPUs with AVX-512 or AMX; elsewhere these
tests skip (say so). The oracles: CPU_ATTN's own cache write and attention
kernel over the same bytes, and RocketKV's reference path (``paged``) on a
float cache that holds the values the fp8 cache decodes to.
"""

from types import SimpleNamespace

import pytest
import torch
from conftest import cpu_attn_decode
from reference import paged

from rocketkv_vllm.fp8_kv import FP8_FORMATS, KVQuant, kv_quant_for
from rocketkv_vllm.kernels.rows import DecodeRows
from rocketkv_vllm.layout import kt_cache_view, kt_row_bytes, split_kv
from rocketkv_vllm.ops import cpu as cpu_ops
from rocketkv_vllm.ops import pytorch as torch_ops
from rocketkv_vllm.ops.pytorch import TorchStage1

ops = pytest.importorskip("vllm._custom_ops")
from rocketkv_vllm.backend.native import cpu_kv_layout  # noqa: E402

AMX = torch.cpu._is_amx_tile_supported()
needs_fp8_cpu = pytest.mark.skipif(
    not (AMX or torch.cpu._is_avx512_supported()),
    reason="vLLM's CPU_ATTN stores fp8 KV only with AVX-512 or AMX",
)
ISAS = [
    (torch.float32, "vec", "cpu_vec"),
    (torch.bfloat16, "vec", "cpu_vec"),
    pytest.param(
        torch.bfloat16,
        "amx",
        "cpu_amx",
        marks=pytest.mark.skipif(not AMX, reason="no AMX on this CPU"),
    ),
]
K_SCALE, V_SCALE = 0.05, 0.03  # ~ amax / 448 of unit-variance keys: calibrated-like


def _fp8_cache(num_blocks, hkv, bs, d, pages):
    """A padded uint8 cache as the ROCKETKV spec allocates it (KT rows after
    each block's K/V)."""
    block_bytes = hkv * bs * 2 * d + hkv * pages * kt_row_bytes(d, torch.uint8, "auto")
    storage = torch.zeros(num_blocks * block_bytes, dtype=torch.uint8)
    return storage.as_strided((num_blocks, hkv, bs, 2 * d), (block_bytes, bs * 2 * d, 2 * d, 1))


def _store(kv, keys, values, slots, isa, cache_dtype):
    """CPU_ATTN's own cache write (quantizes with the scales)."""
    num_blocks, hkv, bs, d2 = kv.shape
    rows = kv.view(num_blocks, hkv, 2 * bs, d2 // 2)
    ops.cpu_attn_reshape_and_cache(
        keys,
        values,
        rows[:, :, :bs],
        rows[:, :, bs:],
        slots,
        isa,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
        kv_cache_dtype=cache_dtype,
    )


@needs_fp8_cpu
@pytest.mark.parametrize("cache_dtype", list(FP8_FORMATS))
@pytest.mark.parametrize("dtype,isa,expected", ISAS)
def test_views_decode_what_cpu_attn_stores_as_its_kernel_does(cache_dtype, dtype, isa, expected):
    """CPU_ATTN writes fp8 codes with the layer's scales; its attention
    kernel over those bytes equals dense attention over our dequantized
    views, and each value read is the stored one to fp8's precision."""
    hkv, g, d, bs, num_blocks, n = 2, 3, 64, 32, 10, 150
    layout = cpu_kv_layout(isa, dtype, d, bs, cache_dtype)
    assert layout == expected
    quant = KVQuant(FP8_FORMATS[cache_dtype], K_SCALE, V_SCALE)
    kv = _fp8_cache(num_blocks, hkv, bs, d, bs // 8)
    gen = torch.Generator().manual_seed(5)
    row = torch.randperm(num_blocks, generator=gen)[: -(-n // bs)]
    slots = row[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    keys = torch.randn(n, hkv, d, generator=gen).to(dtype)
    values = torch.randn(n, hkv, d, generator=gen).to(dtype)
    _store(kv, keys, values, slots, isa, cache_dtype)
    k_cache, v_cache = split_kv(kv, layout, quant)
    read_k, read_v = paged.gather_kv(k_cache, v_cache, row, torch.arange(n))
    # e4m3 keeps 3 mantissa bits, e5m2 2: within one step of the stored value.
    step = 2.0**-3 if quant.fp8_dtype == torch.float8_e4m3fn else 2.0**-2
    for read, want in ((read_k, keys.float()), (read_v, values.float())):
        assert ((read - want).abs() <= step * want.abs() + 1e-2).all()
        assert not torch.equal(read, want)  # really quantized
    q = torch.randn(1, hkv * g, d, generator=gen).to(dtype)
    out = cpu_attn_decode(q, kv, row, n, isa, cache_dtype, K_SCALE, V_SCALE)
    ref = paged.dense_attention(q.float(), torch.tensor([n - 1]), k_cache, v_cache, row, n, d**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@needs_fp8_cpu
@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dtype,isa,layout", ISAS)
def test_stages_on_fp8_equal_the_reference_on_the_decoded_values(cache_dtype, dtype, isa, layout):
    """Stage 1 (window scores, compaction, KT pages) and the batched Stage 2
    on the fp8 cache give what the per-request reference gives on a float
    cache holding the decoded values (KT rows in fp8 there too: an fp8 KV
    cache always has fp8 KT rows); compaction moves the stored codes."""
    hkv, g, d, bs, ps, num_blocks, n = 2, 3, 64, 32, 4, 40, 1000
    budget, w, kernel = 300, 32, 7
    quant = KVQuant(FP8_FORMATS[cache_dtype], K_SCALE, V_SCALE)
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(n + 1, hkv, d, generator=gen).to(dtype)
    values = torch.randn(n + 1, hkv, d, generator=gen).to(dtype)
    q_win = torch.randn(w, hkv * g, d, generator=gen)
    query = torch.randn(1, hkv * g, d, generator=gen)
    row = torch.randperm(num_blocks, generator=gen)[: -(-(n + 1) // bs)]
    slots = row[torch.arange(n + 1) // bs] * bs + torch.arange(n + 1) % bs

    kv8 = _fp8_cache(num_blocks, hkv, bs, d, bs // ps)
    _store(kv8, keys[:n], values[:n], slots[:n], isa, cache_dtype)
    k8, v8 = split_kv(kv8, layout, quant)
    kt8 = kt_cache_view(kv8, ps)
    assert kt8.dtype == torch.uint8  # fp8 rows, though kt_dtype is "auto"
    codes_before = split_kv(kv8.clone(), layout, quant)

    # fp32, room for fp8 KT rows behind each block
    block_elems = hkv * bs * 2 * d + hkv * (bs // ps) * kt_row_bytes(d, torch.uint8, "auto")
    twin = torch.zeros(num_blocks * block_elems).as_strided(
        (num_blocks, hkv, bs, 2 * d), (block_elems, bs * 2 * d, 2 * d, 1)
    )
    kf, vf = split_kv(twin, "token")
    ktf = kt_cache_view(twin, ps, "fp8_e4m3")
    paged.write_kv(kf, vf, *paged.gather_kv(k8, v8, row, torch.arange(n)), slots[:n])

    tail = n // bs * bs
    kept = TorchStage1().compress(k8, v8, kt8, row, q_win, n, budget, tail, kernel, ps, 0.125)
    want = paged.snapkv_compress(kf, vf, ktf, row, q_win, n, budget, tail, kernel, ps, 0.125)
    assert torch.equal(kept, want)
    num_compact = budget - (n - tail)
    # Head h's j-th kept token now sits at slot j: its codes, moved as stored.
    src_k, src_v = (c.codes for c in codes_before)
    dst_k, dst_v = k8.codes, v8.codes
    for h in range(hkv):
        src_blocks, src_off = row[kept[h, :num_compact] // bs], kept[h, :num_compact] % bs
        dst = torch.arange(num_compact)
        dst_blocks, dst_off = row[dst // bs], dst % bs
        assert torch.equal(dst_k[dst_blocks, h, dst_off], src_k[src_blocks, h, src_off])
        assert torch.equal(dst_v[dst_blocks, h, dst_off], src_v[src_blocks, h, src_off])

    # One decode token (CPU_ATTN writes it), then Stage 2 on both.
    _store(kv8, keys[n:], values[n:], slots[n:], isa, cache_dtype)
    paged.write_kv(kf, vf, *paged.gather_kv(k8, v8, row, torch.tensor([n])), slots[n:])
    nc, ts, seq = torch.tensor([num_compact]), torch.tensor([tail]), torch.tensor([n + 1])
    max_pages = int(-(-nc // ps) + -(-(seq - ts) // ps))
    pages = torch_ops.view_pages(row[None].int(), nc, ts, seq, ps, bs, max_pages)
    topk, topr = 64, 32
    before_stage2 = torch.as_strided(kv8._base.clone(), kv8.shape, kv8.stride())
    topk_t, topr_t = torch.tensor([topk]), torch.tensor([topr])
    rows = DecodeRows(row[None].int(), nc, ts, seq, topk_t, topr_t, max_pages, topk // ps)
    num_select = torch.tensor([topk // ps])
    out = torch_ops.hsa_decode(query, k8, v8, kt8, rows, pages, num_select, ps, 0.125, True)
    ref = paged.hsa_decode(
        query[0], kf, vf, ktf, row, num_compact, tail, n + 1, topk, topr, ps, 0.125, True
    )
    torch.testing.assert_close(out[0], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(kt8[row], ktf[row])  # KT pages, the decode's update included
    # The C++ Stage 2 reads the codes itself: the same output and KT update.
    kt_native = kt_cache_view(before_stage2, ps)
    native = cpu_ops.hsa_decode(
        query, before_stage2, kt_native, layout, rows, num_select, ps, 0.125, True, quant=quant
    )
    torch.testing.assert_close(native, out, rtol=1e-5, atol=1e-5)
    assert torch.equal(kt_native[row], kt8[row])


def test_layer_scales_and_formats():
    layer = SimpleNamespace(_k_scale_float=0.25, _v_scale_float=4.0)
    assert kv_quant_for("auto", layer) is None
    assert kv_quant_for("fp8", layer) == KVQuant(torch.float8_e4m3fn, 0.25, 4.0)
    assert kv_quant_for("fp8_e4m3", layer) == KVQuant(torch.float8_e4m3fn, 0.25, 4.0)
    assert kv_quant_for("fp8_e5m2", layer) == KVQuant(torch.float8_e5m2, 0.25, 4.0)


def test_fp8_codes_are_never_read_as_numbers():
    """A uint8 (fp8) cache split without its quantization, or a float cache
    with one, is refused: reading codes as values would be silently wrong."""
    codes = torch.zeros(2, 1, 32, 128, dtype=torch.uint8)
    with pytest.raises(ValueError, match="fp8 caches"):
        split_kv(codes, "cpu_vec")
    with pytest.raises(ValueError, match="fp8 caches"):
        split_kv(codes.float(), "cpu_vec", KVQuant(torch.float8_e4m3fn, 1.0, 1.0))
    k, v = split_kv(codes, "cpu_vec", KVQuant(torch.float8_e4m3fn, 1.0, 1.0))
    assert k.dtype == torch.float32 and k.codes.dtype == torch.uint8


class _NvidiaPlatform:
    """What ``engine.cache_dtype_refusals`` asks of vLLM's platform, for an
    NVIDIA GPU of the given compute capability (no GPU here)."""

    device_name = "cuda"

    def __init__(self, capability: int) -> None:
        self.capability = capability

    def is_cuda(self) -> bool:
        return True

    def is_cpu(self) -> bool:
        return False

    def has_device_capability(self, capability: int) -> bool:
        return self.capability >= capability

    def get_device_name(self) -> str:
        return {80: "NVIDIA A100", 90: "NVIDIA H200"}[self.capability]


@pytest.mark.parametrize("capability", [80, 90])
def test_fp8_on_nvidia_is_refused_below_compute_capability_8_9(monkeypatch, capability):
    """On NVIDIA an fp8 cache is read by TRITON_ATTN and ROCKETKV's Triton
    kernels, from compute capability 8.9 on; below, the refusal names the
    setting and the GPU. The CPU-only conditions (block size, head size) do
    not apply there."""
    import vllm.platforms

    from rocketkv_vllm.engine import cache_dtype_refusals

    monkeypatch.setattr(vllm.platforms, "current_platform", _NvidiaPlatform(capability))
    model = SimpleNamespace(dtype=torch.bfloat16, get_head_size=lambda: 80)
    for dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        reasons = cache_dtype_refusals(SimpleNamespace(cache_dtype=dtype, block_size=16), model)
        if capability >= 89:
            assert reasons == []
        else:
            assert len(reasons) == 1
            assert f"kv_cache_dtype={dtype} on NVIDIA A100" in reasons[0]
            assert "8.9" in reasons[0]
    for other in ("fp8_inc", "fp8_per_token_head"):  # not per-tensor scales: refused
        reasons = cache_dtype_refusals(SimpleNamespace(cache_dtype=other, block_size=16), model)
        assert len(reasons) == 1 and f"kv_cache_dtype={other}" in reasons[0]
        assert "allowed: auto, bfloat16, fp8, fp8_e4m3, fp8_e5m2" in reasons[0]


def test_native_call_gets_the_query_vllm_would_quantize():
    """With an fp8 e4m3 cache and a native impl that takes fp8 queries (TRITON_ATTN
    and FLASH_ATTN on NVIDIA), the native call gets the query quantized with the
    layer's q scale (per tensor, or per KV head), as vLLM's attention layer
    quantizes it for its own backend; other cache dtypes and impls get the
    query itself. (ROCKETKV's impl keeps the model's query for its stages.)"""
    from vllm.config import VllmConfig, set_current_vllm_config

    from rocketkv_vllm.backend.native import NativeQuery

    heads, kv_heads, d = 6, 2, 32
    query = torch.randn(5, heads, d, generator=torch.Generator().manual_seed(0)).bfloat16()
    takes_fp8 = SimpleNamespace(supports_quant_query_input=True)
    cpu_native = SimpleNamespace(supports_quant_query_input=False)
    with set_current_vllm_config(VllmConfig()):
        for native, cache_dtype in (
            (takes_fp8, "auto"),
            (takes_fp8, "fp8_e5m2"),
            (cpu_native, "fp8"),
        ):
            same = NativeQuery(native, cache_dtype, heads, kv_heads, d)(SimpleNamespace(), query)
            assert same is query
        quant = NativeQuery(takes_fp8, "fp8", heads, kv_heads, d)
    per_tensor = SimpleNamespace(q_scale=torch.tensor(0.02), _q_scale=torch.tensor(0.02))
    q8 = quant(per_tensor, query)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == query.shape
    torch.testing.assert_close(q8.float() * 0.02, query.float(), rtol=0.07, atol=1e-3)
    scales = torch.tensor([0.01, 0.05])  # one per KV head: query heads 0-2, then 3-5
    per_head = SimpleNamespace(q_scale=scales, _q_scale=scales)
    q8 = quant(per_head, query)
    head_scale = scales.repeat_interleave(heads // kv_heads)[None, :, None]
    torch.testing.assert_close(q8.float() * head_scale, query.float(), rtol=0.07, atol=1e-3)
