"""What an engine says or refuses at startup about settings it would
otherwise ignore or run silently (issue 36, finding 8): test switches,
ROCKETKV settings on another backend, a host tier holding only vLLM's null
block, fp8 with layers skipped."""

import pytest
import torch

from rocketkv_vllm import engine
from rocketkv_vllm.plugin import register


@pytest.fixture
def warnings(monkeypatch):
    """The engine module's warning_once calls, formatted (vLLM's own
    warning_once logs each message once per process)."""
    said = []
    monkeypatch.setattr(
        engine.logger, "warning_once", lambda msg, *args, **kw: said.append(msg % args)
    )
    return said


def _config(model_path, backend="ROCKETKV", **kw):
    from vllm.engine.arg_utils import EngineArgs

    register()
    return EngineArgs(
        model=model_path,
        attention_backend=backend,
        dtype="float32",
        max_model_len=4096,
        enforce_eager=True,
        **kw,
    ).create_engine_config()


def test_test_switches_are_logged_at_startup(model_path, warnings):
    _config(model_path, additional_config={"rocketkv": {"prompt_budget": 512}})
    assert not [w for w in warnings if "tests" in w]
    _config(
        model_path,
        additional_config={
            "rocketkv": {"free_evicted_blocks": False},
            "rocketkv_testing": {"poison_evicted_blocks": True, "record_kept_positions": False},
        },
    )
    (said,) = [w for w in warnings if "tests" in w]
    assert "rocketkv_testing.poison_evicted_blocks" in said
    assert "rocketkv.free_evicted_blocks=false" in said
    assert "record_kept_positions" not in said  # off


def test_rocketkv_settings_on_another_backend_are_named_as_ignored(warnings):
    from types import SimpleNamespace

    from vllm.config.attention import AttentionConfig

    register()

    def config(backend, extra):
        return SimpleNamespace(
            attention_config=AttentionConfig(backend=backend), additional_config=extra
        )

    engine.warn_ignored_settings(config("ROCKETKV", {"rocketkv": {"token_budget": 256}}))
    engine.warn_ignored_settings(config("CPU_ATTN", {"other_plugin": {"x": 1}}))
    engine.warn_ignored_settings(config(None, {}))
    assert warnings == []
    engine.warn_ignored_settings(
        config("CPU_ATTN", {"rocketkv": {"token_budget": 256, "evict": False}})
    )
    engine.warn_ignored_settings(
        config(None, {"rocketkv_testing": {"poison_evicted_blocks": True}})
    )
    engine.warn_ignored_settings(config("CPU_ATTN", {"rocketKV": {"topk": 64}}))  # a near miss
    dense, default, near_miss = warnings
    assert "['evict', 'token_budget']" in dense and "CPU_ATTN, not ROCKETKV" in dense
    assert "rocketkv_testing" in default and "vLLM's default, not ROCKETKV" in default
    assert "rocketKV: ['topk']" in near_miss


def test_a_dense_engine_names_the_rocketkv_settings_it_ignores(model_path, warnings):
    """Through vLLM's startup (the check_and_update_config wrapper)."""
    _config(model_path, "CPU_ATTN", additional_config={"rocketkv": {"token_budget": 256}})
    (said,) = [w for w in warnings if "ignored" in w]
    assert "token_budget" in said and "CPU_ATTN, not ROCKETKV" in said


def _kv_cache_config(num_blocks, page_bytes):
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(num_blocks * page_bytes, ["layer"], 0, page_bytes)],
        kv_cache_groups=[],
    )


def test_a_host_tier_holding_only_the_null_block_is_refused(model_path, warnings):
    """vLLM sizes the pool to at least one block, its null block, and then
    stores nothing: that size is refused with the smallest one that works,
    which vLLM sizes to two blocks."""
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    page = 30 * 3 * 64 * 2 * 4 * 32  # SmolLM2-135M fp32, K and V of a 32-token block
    kv_config = _kv_cache_config(100, page)

    def host_blocks(gib):  # as vLLM's host tier sizes its pool (one rank)
        return SimpleCPUOffloadScheduler._derive_cpu_config(
            kv_config, int(gib * (1 << 30))
        ).num_blocks

    tiny = 1e-4
    config = _config(model_path, kv_offloading_size=tiny)
    assert host_blocks(tiny) == 1
    with pytest.raises(ValueError) as err:
        engine.check_host_tier_pool(config, kv_config, host_blocks(tiny))
    message = str(err.value)
    assert "kv_offloading_size=0.0001 is too small" in message and "null block" in message
    minimum = float(message.split("at least kv_offloading_size=")[1].split(" (GiB)")[0])
    assert host_blocks(minimum) == 2
    config.cache_config.kv_offloading_size = minimum
    engine.check_host_tier_pool(config, kv_config, host_blocks(minimum))
    # one block of 32 tokens: fewer than a 4096-token prompt needs
    (said,) = warnings
    assert "holds 1 blocks of 32 tokens" in said and "max_model_len=4096" in said
    enough = float(said.split("(kv_offloading_size=")[1].split(" (GiB) holds one")[0])
    assert host_blocks(enough) - 1 >= 4096 // 32
    engine.check_host_tier_pool(config, kv_config, host_blocks(enough))
    assert len(warnings) == 1


def test_fp8_with_layers_skipped_is_refused(model_path):
    """Skipped layers keep a model-dtype cache next to fp8 ones; ROCKETKV
    runs one KV cache dtype for all its layers."""
    with pytest.raises(Exception) as err:
        _config(model_path, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=["0"])
    assert "kv_cache_dtype_skip_layers=['0'] with kv_cache_dtype=fp8" in str(err.value)
    # a dense engine, and ROCKETKV without the skip list, are served
    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        _config(model_path, kv_cache_dtype="fp8")
        _config(model_path, "CPU_ATTN", kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=["0"])
