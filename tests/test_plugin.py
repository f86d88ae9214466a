"""Plugin registration: idempotent, parseable, pickle-safe, selectable on CPU."""

import base64
import os
import pickle
import subprocess
import sys

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
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "CUSTOM"


def test_cpu_platform_honours_an_explicit_rocketkv_choice():
    register()
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    assert current_platform.is_cpu()
    chosen = current_platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, None)
    assert chosen == BACKEND_PATH
    # Everything else still goes the CPU platform's own way.
    assert current_platform.get_attn_backend_cls(None, _selector()) != BACKEND_PATH


def _selector():
    import torch
    from vllm.v1.attention.selector import AttentionSelectorConfig

    return AttentionSelectorConfig(head_size=64, dtype=torch.float32,
                                   kv_cache_dtype=None, block_size=16)
