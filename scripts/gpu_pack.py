#!/usr/bin/env python3
"""Packing for the GPU check, run HERE by scripts/gpu_bundle.sh (standard library only).

    gpu_pack.py trim DIR          slim the unpacked vLLM bundle DIR (the recipe's vllm32/) in place
    gpu_pack.py split --bundle ARCHIVE --model PAYLOAD --out DIR --cap BYTES
                                  lay ARCHIVE (the bundle's .tar.xz) and PAYLOAD (the model's
                                  .tar.xz) out over device calls DIR/t1..tN, each under BYTES

``trim`` removes what a dense Llama-style model on an H200 never loads, on top of the shared
recipe's own slimming (see TRIM below: every removed import is guarded in vLLM 0.32, and
install.sh imports only the extensions that are there). It saves ~47 MiB of the ~135 MiB xz, so
bundle + model travel in 3 calls instead of 4.

``split`` writes, per call K, the folder tK that is that call's only `carry`:
  tK/partsK/       one chunk of the bundle archive in the shared recipe's format (stage.sh reads
                   it: the chunk, SHA256SUMS, BUNDLE_INFO with the whole archive's size and sha256)
  tK/model/        one slice of the model payload (model.NN, SHA256SUMS, MODEL_INFO)
  tK/tools/        the recipe's stage.sh and install.sh
  tK/TRANSFER_INFO CALL=K NCALLS=N
The layout (gpu_plan.layout) fills the calls in order, bundle first, so vLLM can be installed
while the model's last slice is still on its way.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import os
import shutil
import sys
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_plan  # noqa: E402

# (path glob inside the bundle's top folder, why it can go)
TRIM_FILES = [
    (
        "site/vllm/_moe_C_stable_libtorch.abi3.so",
        "fused-MoE kernels (36 MiB of xz); imported under contextlib.suppress(ImportError) in "
        "platforms/cuda.py, used by MoE layers only",
    ),
    ("site/vllm/_flashmla_C.abi3.so", "FlashMLA (MLA models, which ROCKETKV refuses); guarded"),
    ("site/vllm/_flashmla_extension_C.abi3.so", "FlashMLA extension; guarded"),
    ("site/vllm/_flashkda_C.abi3.so", "Kimi/GLM KDA kernels; imported by those models only"),
    ("site/vllm/_deepselect_C.abi3.so", "DeepSeek sparse-attention indexer; guarded"),
]
# (wheel glob, member glob, why)
TRIM_MEMBERS = [
    (
        "wheels/mistral_common-*.whl",
        "mistral_common/data/tekken_*.json",
        "Tekken vocabularies of Mistral models (loaded only for a Mistral tokenizer)",
    ),
    (
        "wheels/pycountry-*.whl",
        "pycountry/locales/*",
        "translations of country names (gettext catalogues; the databases stay)",
    ),
]


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                return h.hexdigest()
            h.update(b)


def trim_id() -> str:
    """What the trim removes, as a short hash (gpu_bundle.sh redoes the trim when it changes)."""
    return hashlib.sha256(repr((TRIM_FILES, TRIM_MEMBERS)).encode()).hexdigest()[:16]


def rewrite_wheel(path: str, member_glob: str) -> int:
    """Drop the members matching member_glob (and their RECORD lines); returns bytes dropped.
    Entries keep their order, time stamps, modes and ZIP_STORED compression."""
    tmp = path + ".tmp"
    dropped, names = 0, set()
    with zipfile.ZipFile(path) as zin:
        for info in zin.infolist():
            if fnmatch.fnmatch(info.filename, member_glob):
                dropped += info.file_size
                names.add(info.filename)
        if not names:
            return 0
        with zipfile.ZipFile(tmp, "w") as zout:
            for info in zin.infolist():
                if info.filename in names:
                    continue
                data = zin.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(ln for ln in lines if ln.split(",", 1)[0] not in names).encode()
                new = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                new.external_attr, new.create_system = info.external_attr, info.create_system
                new.compress_type = info.compress_type
                zout.writestr(new, data)
    os.replace(tmp, path)
    return dropped


def trim(top: str) -> list[str]:
    """Slim the unpacked bundle folder ``top`` in place; returns the MANIFEST lines added."""
    import glob

    notes = []
    for pattern, why in TRIM_FILES:
        for p in sorted(glob.glob(os.path.join(top, pattern))):
            size = os.path.getsize(p)
            os.remove(p)
            notes.append(f"{os.path.relpath(p, top)} ({size / 2**20:.1f} MiB): {why}")
    for wheel_glob, member_glob, why in TRIM_MEMBERS:
        for w in sorted(glob.glob(os.path.join(top, wheel_glob))):
            n = rewrite_wheel(w, member_glob)
            if n:
                notes.append(f"{os.path.basename(w)}: {member_glob} ({n / 2**20:.1f} MiB): {why}")
    if not notes:
        raise SystemExit(f"gpu_pack trim: nothing to trim in {top} (not the recipe's bundle?)")
    manifest = os.path.join(top, "MANIFEST.txt")
    with open(manifest, "a", encoding="utf-8") as f:
        f.write(
            "--- trimmed further by rocketkv-vllm scripts/gpu_pack.py (dense models on "
            "Hopper only):\n"
        )
        for line in notes:
            f.write(f"    {line}\n")
    return notes


def copy_range(src: str, dst: str, offset: int, length: int) -> str:
    """Copy length bytes of src from offset into dst; returns their sha256."""
    h = hashlib.sha256()
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fi.seek(offset)
        left = length
        while left:
            b = fi.read(min(left, 1 << 20))
            if not b:
                raise SystemExit(f"gpu_pack split: {src} is shorter than expected")
            fo.write(b)
            h.update(b)
            left -= len(b)
    return h.hexdigest()


def split(
    bundle: str, model: str, out: str, cap: int, tools: list[str], tree: int = 0
) -> list[dict]:
    """Write out/t1..tN (see the module docstring); returns one dict per call."""
    sizes = {"bundle": os.path.getsize(bundle), "model": os.path.getsize(model)}
    calls = gpu_plan.layout([("bundle", sizes["bundle"]), ("model", sizes["model"])], cap)
    info = {
        "bundle": ("vllm32.tar.xz", sha256_file(bundle)),
        "model": ("model", sha256_file(model)),
    }
    count = {k: sum(1 for c in calls for s in c if s[0] == k) for k in sizes}
    for old in os.listdir(out) if os.path.isdir(out) else []:
        if old[:1] == "t" and old[1:].isdigit():
            shutil.rmtree(os.path.join(out, old))
    index = {"bundle": 0, "model": 0}
    result = []
    for k, pieces in enumerate(calls, start=1):
        t = os.path.join(out, f"t{k}")
        os.makedirs(os.path.join(t, "tools"))
        for tool in tools:
            shutil.copy(tool, os.path.join(t, "tools"))
        for stream, offset, length in pieces:
            index[stream] += 1
            prefix, whole_sha = info[stream]
            name = f"{prefix}.{index[stream]:02d}"
            if stream == "bundle":
                d = os.path.join(t, f"parts{k}")
                meta = (
                    f"PREFIX={prefix}\nNPARTS={count[stream]}\nBYTES={sizes[stream]}\n"
                    f"SHA256={whole_sha}\n"
                )
                meta_name = "BUNDLE_INFO"
            else:
                d = os.path.join(t, "model")
                meta = (
                    f"PREFIX={prefix}\nNPIECES={count[stream]}\nBYTES={sizes[stream]}\n"
                    f"SHA256={whole_sha}\n"
                )
                meta_name = "MODEL_INFO"
            os.makedirs(d)
            sha = copy_range(
                bundle if stream == "bundle" else model, os.path.join(d, name), offset, length
            )
            with open(os.path.join(d, "SHA256SUMS"), "w") as f:
                f.write(f"{sha}  {name}\n")
            with open(os.path.join(d, meta_name), "w") as f:
                f.write(meta)
        result.append({"call": k, "pieces": pieces})
    # what each call sends (its carry + the working tree), for the device's time limits
    for c in result:
        c["bytes"] = gpu_plan.tree_bytes(os.path.join(out, f"t{c['call']}")) + 256
    sends = " ".join(str(tree + c["bytes"]) for c in result)
    for c in result:
        with open(os.path.join(out, f"t{c['call']}", "TRANSFER_INFO"), "w") as f:
            f.write(f'CALL={c["call"]}\nNCALLS={len(result)}\nTREE={tree}\nSENDS="{sends}"\n')
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trim")
    t.add_argument("dir")
    sub.add_parser("trim-id", help="print the hash of what trim removes")
    s = sub.add_parser("split")
    s.add_argument("--bundle", required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--cap", type=int, required=True, help="payload bytes per call")
    s.add_argument("--tools", nargs="*", default=[])
    s.add_argument("--tree", type=int, default=0, help="bytes of the working tree")
    a = ap.parse_args(argv)
    if a.cmd == "trim-id":
        print(trim_id())
        return 0
    if a.cmd == "trim":
        for line in trim(a.dir):
            print("gpu_pack: trimmed", line)
        return 0
    for c in split(a.bundle, a.model, a.out, a.cap, a.tools, a.tree):
        what = ", ".join(f"{s} {n / 2**20:.1f} MiB" for s, _, n in c["pieces"])
        print(f"gpu_pack: t{c['call']}: {c['bytes'] / 2**20:.1f} MiB ({what})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
