"""Typed cache views (``cache_view``): what ``layout.split_kv`` returns for
each layout and quantization, and how the callers dispatch on it (whole-block
reads, compaction's stored elements, the Triton kernels' operand) without
asking objects what attributes they have. Runs on any CPU: the fp8 and AMX
caches here are written through the views themselves, not by vLLM."""

import pytest
import torch

from rocketkv_vllm.cache_view import CacheView, KVView, read_blocks, read_blocks_into, stored
from rocketkv_vllm.fp8_kv import FP8_FORMATS, Fp8KV, KVQuant
from rocketkv_vllm.layout import split_kv
from rocketkv_vllm.ops import pytorch as torch_ops
from rocketkv_vllm.packed_kv import PackedKV

HKV, BS, D, NUM_BLOCKS = 2, 32, 32, 6
QUANT = KVQuant(torch.float8_e4m3fn, 0.5, 2.0)


def _cache(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.uint8:  # finite e4m3 codes (0x7f / 0xff are NaN)
        codes = torch.randint(0, 0x7F, (NUM_BLOCKS, HKV, BS, 2 * D), generator=gen)
        sign = torch.randint(0, 2, codes.shape, generator=gen) * 0x80
        return (codes | sign).to(torch.uint8)
    return torch.randn(NUM_BLOCKS, HKV, BS, 2 * D, generator=gen).to(dtype)


def _per_token(cache: KVView, blocks: torch.Tensor) -> torch.Tensor:
    """Whole blocks [n, Hkv, bs, d] read one slot at a time."""
    slots = torch.arange(BS)
    return torch.stack([cache[b.expand(BS), :, slots].transpose(0, 1) for b in blocks])


@pytest.mark.parametrize(
    "layout, quant, kind",
    [
        ("token", None, torch.Tensor),
        ("head_rows", None, torch.Tensor),
        ("cpu_vec", None, torch.Tensor),
        ("cpu_amx", None, PackedKV),
        ("token", QUANT, Fp8KV),
        ("cpu_vec", QUANT, Fp8KV),
        ("cpu_amx", QUANT, Fp8KV),
    ],
)
def test_split_kv_views_and_whole_block_reads(layout, quant, kind):
    """Each view is a strided tensor or a ``CacheView`` of the declared kind,
    and whole-block reads through the views equal per-token indexing."""
    kv = _cache(torch.uint8 if quant else torch.bfloat16)
    blocks = torch.tensor([4, 1, 5])
    for view in split_kv(kv, layout, quant):
        assert type(view) is kind or (kind is torch.Tensor and isinstance(view, torch.Tensor))
        assert isinstance(view, CacheView) != isinstance(view, torch.Tensor)
        assert view.shape == (NUM_BLOCKS, HKV, BS, D)
        want = _per_token(view, blocks)
        assert want.dtype == (torch.float32 if quant else torch.bfloat16)
        assert torch.equal(read_blocks(view, blocks), want)
        out = torch.empty(len(blocks), HKV, D, BS, dtype=torch.float64).transpose(2, 3)
        read_blocks_into(view, blocks, out)  # any strides, any dtype
        assert torch.equal(out, want.double())


@pytest.mark.parametrize("layout", ["token", "cpu_amx"])
def test_fp8_views_store_codes_and_compaction_moves_them(layout):
    """An fp8 view's elements are stored as codes (``stored``): compaction
    moves the codes bit for bit, and the values read afterwards are the
    kept tokens' values (scale applied once, on read)."""
    kv = _cache(torch.uint8)
    k, v = split_kv(kv, layout, QUANT)
    assert stored(k) is k.codes and stored(v) is v.codes
    assert isinstance(stored(k), PackedKV if layout == "cpu_amx" else torch.Tensor)
    row = torch.tensor([3, 0, 5], dtype=torch.int32)
    kept = torch.tensor([[1, 40, 70, 95], [0, 33, 34, 64]])
    src_b, src_o = row[kept // BS].long(), kept % BS
    heads = torch.arange(HKV)[:, None]
    want_k, want_v = k[src_b, heads, src_o], v[src_b, heads, src_o]
    want_codes = stored(k)[src_b, heads, src_o].clone()
    torch_ops.compact_kept_tokens(k, v, row, kept)
    dst = torch.arange(kept.shape[1]).expand_as(kept)
    dst_b, dst_o = row[dst // BS].long(), dst % BS
    assert torch.equal(stored(k)[dst_b, heads, dst_o], want_codes)
    assert torch.equal(k[dst_b, heads, dst_o], want_k)
    assert torch.equal(v[dst_b, heads, dst_o], want_v)


def test_plain_tensors_are_their_own_storage():
    kv = _cache(torch.bfloat16)
    for layout in ("token", "cpu_amx"):
        for view in split_kv(kv, layout):
            assert stored(view) is view


def test_kernel_operands():
    """What the Triton kernels take for each view (``kernels._utils.kv_operand``):
    a float tensor itself; an fp8 view's codes, format and scale; refused for
    raw uint8 codes and for AMX tiles (no strided tensor holds them)."""
    pytest.importorskip("triton")
    from rocketkv_vllm.kernels._utils import kv_operand
    from rocketkv_vllm.kernels.formats import FORMAT_CODES

    k, _ = split_kv(_cache(torch.bfloat16), "token")
    tensor, fp8, scale = kv_operand(k)
    assert tensor is k and (fp8, scale) == (0, 1.0)
    for name, fp8_dtype in FP8_FORMATS.items():
        quant = KVQuant(fp8_dtype, 0.25, 4.0)
        k8, v8 = split_kv(_cache(torch.uint8), "cpu_vec", quant)
        for view, want_scale in ((k8, 0.25), (v8, 4.0)):
            tensor, fp8, scale = kv_operand(view)
            assert tensor is view.codes and tensor.dtype == torch.uint8, name
            assert (fp8, scale) == (FORMAT_CODES[fp8_dtype], want_scale), name
    assert FORMAT_CODES == {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
    with pytest.raises(AssertionError, match="Fp8KV"):
        kv_operand(k8.codes)
    amx_k, _ = split_kv(_cache(torch.bfloat16), "cpu_amx")
    amx8_k, _ = split_kv(_cache(torch.uint8), "cpu_amx", QUANT)
    for view in (amx_k, amx8_k):
        with pytest.raises(TypeError, match="AMX"):
            kv_operand(view)
