"""Plugin registration: idempotent, parseable, pickle-safe, selectable on CPU."""

import base64
import os
import pickle
import subprocess
import sys

import pytest

from rocketkv_vllm.plugin import BACKEND_PATH, register


def test_registration_is_idempotent_and_the_name_parses():
    register()
    register()
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    member = AttentionBackendEnum["ROCKETKV"]
    assert member is AttentionBackendEnum.CUSTOM
    assert member.get_path() == BACKEND_PATH
    assert AttentionConfig(backend="rocketkv").backend is member


def test_choice_unpickles_in_a_process_without_plugins():
    """A spawned process unpickles the config before it loads plugins."""
    register()
    from vllm.config.attention import AttentionConfig

    blob = base64.b64encode(pickle.dumps(AttentionConfig(backend="ROCKETKV"))).decode()
    code = (
        "import base64, pickle, sys\n"
        f"cfg = pickle.loads(base64.b64decode('{blob}'))\n"
        "print(cfg.backend.name)\n"
    )
    env = dict(os.environ, VLLM_PLUGINS="")  # load no plugin at all
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "CUSTOM"


def test_cpu_platform_honours_an_explicit_rocketkv_choice():
    register()
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert current_platform.is_cpu()
    chosen = current_platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector())
    assert chosen == BACKEND_PATH
    # Everything else still goes the CPU platform's own way.
    assert current_platform.get_attn_backend_cls(None, _selector()) != BACKEND_PATH


def _selector(**kw):
    import torch
    from vllm.v1.attention.selector import AttentionSelectorConfig

    args = dict(head_size=64, dtype=torch.float32, kv_cache_dtype=None, block_size=16)
    args.update(kw)
    return AttentionSelectorConfig(**args)


@pytest.mark.parametrize(
    "bad,reason",
    [
        (dict(head_size=72), "head_size not supported"),
        (dict(block_size=8), "block_size not supported"),
        (dict(use_mla=True), "MLA not supported"),
        # multimodal Gemma 3 / PaliGemma: image tokens attend both ways
        (dict(use_mm_prefix=True), "partial multimodal token full attention not supported"),
    ],
)
def test_vllm_backend_validation_runs_on_cpu_and_names_rocketkv(bad, reason):
    """vLLM's CPU selection validates nothing; ROCKETKV runs vLLM's own
    backend checks on every platform, with its own name in the error."""
    register()
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    with pytest.raises(ValueError) as err:
        current_platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector(**bad))
    assert "ROCKETKV" in str(err.value) and reason in str(err.value)


def _engine_config(model_path, **kw):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(dtype="float32", max_model_len=4096, enforce_eager=True)
    args.update(kw)
    return EngineArgs(model=model_path, attention_backend="ROCKETKV", **args).create_engine_config()


def test_requests_rocketkv_cannot_serve_are_refused_per_request(model_path):
    """A streaming-input session would grow a compressed request's prompt,
    and a seeded request can stop vLLM's CPU engine: vLLM's own input
    processor refuses both with a validation error (a 400 at the server);
    ordinary requests still pass."""
    register()
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    processor = InputProcessor(_engine_config(model_path))
    prompt = {"prompt_token_ids": list(range(1, 40))}
    with pytest.raises(VLLMValidationError) as err:
        processor.process_inputs(
            request_id="s",
            prompt=prompt,
            params=SamplingParams(),
            supported_tasks=("generate",),
            resumable=True,
        )
    assert "ROCKETKV" in str(err.value) and "streaming" in str(err.value)
    # vLLM's CPU runner dies on a seeded request prefilled in chunks.
    with pytest.raises(VLLMValidationError) as err:
        processor.process_inputs("t", prompt, SamplingParams(seed=7), supported_tasks=("generate",))
    assert "ROCKETKV" in str(err.value) and "seed" in str(err.value)
    # Malformed per-request input (issue 57, finding 5): the error names the field.
    for extra_args, field, says in (
        (5, "vllm_xargs", "must be an object"),
        ({"rocketkv_tokens_budget": 512}, "vllm_xargs.rocketkv_tokens_budget", "known: "),
        ({"rocketkv_token_budget": 8}, "vllm_xargs.rocketkv_token_budget", "allowed 0"),
    ):
        with pytest.raises(VLLMValidationError) as err:
            processor.process_inputs(
                "x", prompt, SamplingParams(extra_args=extra_args), supported_tasks=("generate",)
            )
        assert err.value.parameter == field and says in str(err.value), err.value
    request = processor.process_inputs(
        request_id="r", prompt=prompt, params=SamplingParams(), supported_tasks=("generate",)
    )
    assert request.prompt_token_ids == prompt["prompt_token_ids"]


def test_kv_offloading_is_served_by_the_host_tier_only(model_path):
    """ROCKETKV takes vLLM's offloading flag on CPU (its host-tier
    connector) and refuses, naming the setting, what would bypass its
    prefix-cache rules."""
    from rocketkv_vllm.host_tier import CONNECTOR_NAME

    register()
    config = _engine_config(model_path, kv_offloading_size=1.0)
    assert config.kv_transfer_config.kv_connector == CONNECTOR_NAME

    def refused(**kw) -> str:
        with pytest.raises(Exception) as err:
            _engine_config(model_path, **kw)
        assert "ROCKETKV" in str(err.value)
        return str(err.value)

    assert "lmcache" in refused(kv_offloading_size=1.0, kv_offloading_backend="lmcache")
    assert "prefix caching" in refused(kv_offloading_size=1.0, enable_prefix_caching=False)
    for connector in ("OffloadingConnector", "SimpleCPUOffloadConnector", "NixlPushConnector"):
        transfer = {"kv_connector": connector, "kv_role": "kv_both"}
        assert connector in refused(kv_transfer_config=transfer)
    lazy = {
        "kv_connector": CONNECTOR_NAME,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lazy_offload": True},
    }
    assert "lazy_offload" in refused(kv_transfer_config=lazy)


@pytest.mark.parametrize(
    "kw,reason",
    [
        (
            dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
            "speculative decoding (drafts would be verified",
        ),
        # DCP needs more TP ranks than KV heads (SmolLM2: 3) in vLLM's own check.
        (dict(decode_context_parallel_size=3, tensor_parallel_size=9), "decode context parallel"),
    ],
)
def test_engine_features_rocketkv_cannot_serve_are_refused_at_startup(model_path, kw, reason):
    register()
    with pytest.raises(Exception) as err:
        _engine_config(model_path, **kw)
    assert "ROCKETKV attention backend does not support" in str(err.value)
    assert reason in str(err.value)


def test_pipeline_parallel_in_eager_mode_is_refused_on_cpu(model_path, monkeypatch):
    """vLLM 0.32's CPU worker fails a later pipeline rank's first request in
    eager mode (any backend): refused at startup, naming the fix; the traced
    engine tests/test_parallel.py runs is accepted."""
    register()
    monkeypatch.delenv("VLLM_CPU_CI_ENV", raising=False)
    with pytest.raises(Exception) as err:
        _engine_config(model_path, pipeline_parallel_size=2)
    assert "ROCKETKV" in str(err.value)
    assert "pipeline_parallel_size=2 with eager mode" in str(err.value)
    assert "-cc.mode=1" in str(err.value)
    traced = dict(enforce_eager=False, compilation_config={"mode": 1, "backend": "eager"})
    assert _engine_config(model_path, pipeline_parallel_size=2, **traced)
    monkeypatch.setenv("VLLM_CPU_CI_ENV", "1")
    with pytest.raises(Exception, match="VLLM_CPU_CI_ENV=1"):
        _engine_config(model_path, pipeline_parallel_size=2, **traced)


def _config_only_model(tmp_path, config) -> str:
    """A model directory vLLM can configure (no weights): ``config`` and the
    tiny Llama's tokenizer."""
    import shutil
    from pathlib import Path

    from rocketkv_eval.tiny_model import prepare_tiny_model

    src = Path(prepare_tiny_model(64, num_heads=3, num_kv_heads=1))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp_path / f.name)
    config.save_pretrained(tmp_path)
    return str(tmp_path)


# A 2-layer attention geometry the configs below share (no weights are made).
_TINY = dict(
    vocab_size=49152,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=8192,
)


def _chunked_local_llama():
    from transformers import LlamaConfig

    return LlamaConfig(**_TINY, attention_chunk_size=64, architectures=["LlamaForCausalLM"])


def _gemma2():
    from transformers import Gemma2Config

    return Gemma2Config(
        **_TINY,
        head_dim=64,
        sliding_window=64,
        attn_logit_softcapping=50.0,
        architectures=["Gemma2ForCausalLM"],
    )


def _mamba_hybrid():
    from transformers import JambaConfig

    return JambaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        mamba_d_state=8,
        mamba_expand=2,
        max_position_embeddings=8192,
        architectures=["JambaForCausalLM"],
    )


@pytest.mark.parametrize(
    "make_config,reason",
    [
        (_chunked_local_llama, "chunked local attention (attention_chunk_size"),
        (_mamba_hybrid, "hybrid models with Mamba / linear-attention layers"),
        (_gemma2, "attention logit soft-capping (attn_logit_softcapping=50.0, e.g. Gemma 2)"),
    ],
)
def test_unsupported_model_kinds_are_refused_at_startup(tmp_path, make_config, reason):
    """What ROCKETKV cannot compress is refused while vLLM builds the
    engine's config, naming it (before any weight is loaded)."""
    register()
    model = _config_only_model(tmp_path, make_config())
    with pytest.raises(Exception) as err:
        _engine_config(model)
    assert "ROCKETKV attention backend does not support" in str(err.value)
    assert reason in str(err.value)


# -- register() never stops an engine -------------------------------------------


def test_a_failing_register_step_refuses_rocketkv_engines_only_naming_it(monkeypatch, model_path):
    """vLLM runs register() in every process: a step that raises is recorded,
    not raised; a ROCKETKV engine then refuses at startup naming it (its
    config, and its backend selection), a dense engine starts."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from rocketkv_vllm.vllm_patches import check

    register()

    def broken(cls, vllm_config=None):
        raise KeyError("vLLM changed its spec registry")

    monkeypatch.setattr(KVCacheSpecRegistry, "_ensure_registered", classmethod(broken))
    monkeypatch.setattr(check, "_failures", {})
    register()  # does not raise
    step = "rocketkv_vllm.plugin.register (register ROCKETKV's KV cache spec)"
    assert check._failures == {step: "KeyError: 'vLLM changed its spec registry'"}
    with pytest.raises(RuntimeError, match="vLLM changed its spec registry") as err:
        _engine_config(model_path)
    assert step in str(err.value)
    with pytest.raises(RuntimeError, match="vLLM changed its spec registry"):
        current_platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, _selector())
    # Dense engines: unaffected.
    from vllm.engine.arg_utils import EngineArgs

    dense = EngineArgs(
        model=model_path, attention_backend="CPU_ATTN", dtype="float32", max_model_len=4096
    ).create_engine_config()
    assert dense.attention_config.backend == AttentionBackendEnum.CPU_ATTN
    assert current_platform.get_attn_backend_cls(None, _selector()) != BACKEND_PATH


def test_a_taken_custom_slot_is_recorded_and_rocketkv_is_no_name(monkeypatch):
    """Another plugin holds vLLM's CUSTOM backend: register() does not raise,
    the name ROCKETKV is not added (vLLM refuses it as unknown; the log and
    require() name why), and the other plugin's CUSTOM engines are not
    treated as ROCKETKV."""
    from vllm.v1.attention.backends import registry

    from rocketkv_vllm.engine import is_rocketkv
    from rocketkv_vllm.vllm_patches import check

    register()
    custom = registry.AttentionBackendEnum.CUSTOM
    monkeypatch.setitem(registry._ATTN_OVERRIDES, custom, "other_plugin.Backend")
    monkeypatch.delitem(registry.AttentionBackendEnum._member_map_, "ROCKETKV")
    monkeypatch.setattr(check, "_failures", {})
    register()  # does not raise
    assert "ROCKETKV" not in registry.AttentionBackendEnum._member_map_
    [(step, why)] = check._failures.items()
    assert "CUSTOM attention backend" in step and "other_plugin.Backend" in why
    with pytest.raises(RuntimeError, match="other_plugin.Backend"):
        check.require()
    assert not is_rocketkv(custom)


def test_without_its_startup_check_rocketkv_is_no_name(monkeypatch):
    """A vLLM whose check_and_update_config ROCKETKV cannot wrap: nothing
    would refuse a ROCKETKV engine at startup, so the name ROCKETKV is not
    added (vLLM refuses it as an unknown backend), and the failure is named."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rocketkv_vllm.vllm_patches import check

    register()
    platform = type(current_platform)
    original = check._function(platform, "check_and_update_config").__wrapped__

    def check_and_update_config(cls, vllm_config, new_argument=None):
        return original(cls, vllm_config)

    monkeypatch.setattr(platform, "check_and_update_config", classmethod(check_and_update_config))
    monkeypatch.delitem(AttentionBackendEnum._member_map_, "ROCKETKV")
    monkeypatch.setattr(check, "_failures", {})
    register()  # does not raise
    assert "ROCKETKV" not in AttentionBackendEnum._member_map_
    target = "vllm.platforms.<platform>.check_and_update_config"
    assert "new_argument" in check._failures[target]
    assert any("add the name ROCKETKV" in step for step in check._failures)
