"""Compile the Triton kernels for NVIDIA GPUs on a machine without one.

Triton's active driver is replaced by a stand-in whose target is an NVIDIA
GPU (sm_80, sm_90, sm_100: ``GPUTarget("cuda", 90, 32)`` ...), device and
current stream 0. The project's own launchers (``kernels/*.py``, called as
``rocketkv_vllm.ops.triton`` and the backend call them) then run on CPU
tensors laid out like vLLM's KV cache (FLASH_ATTN's per-token K|V, blocks
padded with their KT pages, ``split_kv`` / ``kt_cache_view``),
so Triton's own binder picks every constexpr and argument specialization,
and Triton compiles each kernel to PTX and a cubin with its bundled ptxas.
The stand-in's launcher records the launch and returns: nothing runs.

Per compiled kernel it reports registers (the cubin's own count, and
``ptxas -v`` rerun on the PTX with Triton's flags), spill stores / loads,
stack, shared memory (Triton's dynamic allocation) and the resident blocks
per SM these allow; a kernel that fails to compile, or needs more shared
memory than the target has, is an error.

    .venv/bin/python scripts/compile_kernels.py                 # full sweep
    .venv/bin/python scripts/compile_kernels.py --subset ci     # the test's
    .venv/bin/python scripts/compile_kernels.py --head-dims 128 --dtypes bf16

Writes ``results/kernels-compile.json`` (``--json`` elsewhere, ``--json ''``
not at all); ``--baseline OLD.json`` adds OLD's registers / spills per
(kernel, config, target) as "before" columns. Exit status 1 on any compile
error, and with ``--fail-on-spill`` on any spill in a 16-bit configuration.
Runs with Triton 3.6 - 3.9, also without the packages installed (the
checkout's root goes first on ``sys.path`` for ``rocketkv_vllm``; this module
comes from ``eval/``: ``PYTHONPATH=eval`` where ``rocketkv_eval`` is not
installed). ``scripts/compile_kernels.py`` is its command line.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import inspect
import itertools
import json
import multiprocessing
import os
import re
import shlex
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

# Compiled kernels only: the interpreter decides at import time.
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from rocketkv_eval.ptx import grid_wait_first  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]  # the checkout: eval/rocketkv_eval/ -> ../..
DEFAULT_JSON = ROOT / "results" / "kernels-compile.json"


# --------------------------------------------------------------------------
# Targets


@dataclass(frozen=True)
class Target:
    name: str
    capability: int
    gpu: str
    sms: int
    max_smem_block: int  # opt-in shared memory per block (bytes)
    smem_sm: int  # shared memory per SM (bytes)
    regs_sm: int = 65536
    threads_sm: int = 2048
    blocks_sm: int = 32
    smem_reserved: int = 1024  # per resident block (CUDA's reservation)


TARGETS = {
    "sm_80": Target("sm_80", 80, "A100", 108, 166912, 167936),
    "sm_90": Target("sm_90", 90, "H100/H200", 132, 232448, 233472),
    "sm_100": Target("sm_100", 100, "B200", 148, 232448, 233472),
}


def supported_targets() -> list[str]:
    """Targets this Triton's NVIDIA backend compiles for."""
    names = ["sm_80", "sm_90"]
    try:
        from triton.backends.nvidia import compiler as nv

        if "ptxas_blackwell" in dir(nv.knobs.nvidia) or hasattr(nv, "get_ptxas"):
            names.append("sm_100")
    except Exception:  # noqa: BLE001
        pass
    return names


def blocks_per_sm(t: Target, regs: int, num_warps: int, smem: int) -> int:
    """Resident blocks per SM allowed by registers, threads and shared memory
    (the occupancy calculator's rules: registers per warp in units of 256)."""
    warp_regs = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = t.regs_sm // (warp_regs * num_warps)
    by_threads = t.threads_sm // (32 * num_warps)
    by_smem = t.smem_sm // (smem + t.smem_reserved) if smem else t.blocks_sm
    return min(by_regs, by_threads, by_smem, t.blocks_sm)


# --------------------------------------------------------------------------
# The stand-in driver


class _Launcher:
    """Stands in for the driver's kernel launcher: records, runs nothing."""

    log: list = []
    caller = ""  # the project launcher being called

    def __init__(self, src, metadata):
        self.name = metadata.name
        self.hash = getattr(metadata, "hash", None)

    def __call__(self, gx, gy, gz, *args, **kwargs):
        _Launcher.log.append((self.name, self.hash, (gx, gy, gz), _Launcher.caller))


class _Utils:
    def __init__(self, target: Target):
        self.target = target

    def load_binary(self, name, kernel, shared, device):
        # (module, function, n_regs, n_spills, n_max_threads): nothing loads
        return object(), None, cubin_registers(kernel, name) or 0, 0, 1024

    def get_device_properties(self, device):
        t = self.target
        return {
            "max_shared_mem": t.max_smem_block,
            "multiprocessor_count": t.sms,
            "max_num_regs": t.regs_sm,
            "warpSize": 32,
        }

    def unload_module(self, module):
        pass

    def set_printf_fifo_size(self, size):
        pass


class StandinDriver:
    """Triton's active driver for a GPU that is not there: target, device 0,
    stream 0, launches recorded (``_Launcher``)."""

    def __init__(self, target: Target):
        self.target_info = target
        self.utils = _Utils(target)
        self.launcher_cls = _Launcher

    @staticmethod
    def is_active():
        return True

    def get_current_target(self):
        return GPUTarget("cuda", self.target_info.capability, 32)

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_device_capability(self, device=None):
        return divmod(self.target_info.capability, 10)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def map_python_to_cpp_type(self, ty):
        return ty

    def get_benchmarker(self):
        raise RuntimeError("the stand-in driver cannot benchmark")


# --------------------------------------------------------------------------
# Compiled artefacts: registers from the cubin, ptxas -v on the PTX


def cubin_registers(cubin: bytes, name: str) -> int | None:
    """Registers per thread of kernel ``name`` in an sm_xx cubin (ELF64): the
    top byte of its ``.text.<name>`` section's sh_info."""
    if not isinstance(cubin, (bytes, bytearray)) or cubin[:4] != b"\x7fELF":
        return None
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i):
        return struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)

    strtab = header(shstrndx)
    names = cubin[strtab[4] : strtab[4] + strtab[5]]
    for i in range(shnum):
        h = header(i)
        end = names.index(b"\0", h[0])
        if names[h[0] : end].decode() == f".text.{name}":
            return h[7] >> 24
    return None


def _ptxas_path(capability: int) -> str:
    from triton.backends.nvidia import compiler as nv

    if hasattr(nv, "get_ptxas"):
        try:
            return nv.get_ptxas(capability).path
        except TypeError:  # older signature without the arch
            return nv.get_ptxas().path
    return nv.knobs.nvidia.ptxas.path


def _arch(capability: int) -> str:
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    return sm_arch_from_capability(capability)


def _ptxas_flags() -> list[str]:
    """The flags of Triton's own ptxas call that change code generation."""
    from triton.backends.nvidia.compiler import CUDABackend

    src = inspect.getsource(CUDABackend.make_cubin)
    flags = ["-lineinfo"]
    if "regAllocOptLevel=2" in src:
        flags.append("--regAllocOptLevel=2")
    return flags


_PTXAS_RE = {
    "regs": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "static_smem": re.compile(r"(\d+) bytes smem"),
}


def ptxas_report(ptx: str, capability: int, fp_fusion: bool) -> dict:
    """``ptxas -v`` on a kernel's PTX: registers, stack, spills."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [
            _ptxas_path(capability),
            *_ptxas_flags(),
            "-v",
            *([] if fp_fusion else ["--fmad=false"]),
            f"--gpu-name={_arch(capability)}",
            str(src),
            "-o",
            str(Path(tmp) / "k.o"),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode:
        return {"ptxas_error": log[-2000:]}
    out = {}
    for key, pattern in _PTXAS_RE.items():
        m = pattern.search(log)
        out[key] = int(m.group(1)) if m else 0
    return out


def ptxas_version(capability: int) -> str:
    out = subprocess.run(
        [_ptxas_path(capability), "--version"], capture_output=True, text=True
    ).stdout
    m = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return m.group(2) if m else out.strip().splitlines()[-1:]


# --------------------------------------------------------------------------
# The project's kernels


def import_kernels():
    """The kernel modules of this checkout (its root first on sys.path;
    ``rocketkv_vllm/kernels`` is a symlink to ./kernels), Stage 2's
    composition (``ops.triton``) and the dense baseline of the benchmarks
    (``rocketkv_eval.dense_decode``)."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(1, str(ROOT / "eval"))
    names = ["window_scores", "compact", "kt_update", "hsa_score", "page_select", "sparse_decode"]
    mods = {n: importlib.import_module(f"rocketkv_vllm.kernels.{n}") for n in names}
    mods["dense_decode"] = importlib.import_module("rocketkv_eval.dense_decode")
    mods["ops"] = importlib.import_module("rocketkv_vllm.ops.triton")
    return mods


def jit_kernels(modules) -> dict[str, object]:
    """Every launched @triton.jit kernel of the modules, by name."""
    from triton.runtime.jit import JITFunction

    found = {}
    for mod in modules.values():
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                found[name] = obj
    return found


# --------------------------------------------------------------------------
# Configurations (what engines run)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIMS = (32, 64, 80, 96, 128, 160, 192, 256)  # vLLM FLASH_ATTN's head sizes
ENGINE_HEAD_DIMS = (64, 128)
PAGE_SIZES = (4, 16)
KT_DTYPES = ("auto", "fp8")
FP8_KVS = ("fp8_e4m3", "fp8_e5m2")  # fp8 kv_cache_dtypes (per-tensor scales)
LAYOUTS = ("graph", "eager")

HKV, GROUP, BLOCK_SIZE = 8, 4, 16  # Llama-3 style GQA, vLLM's default block size
WINDOW, PROMPT, KEPT = 32, 4096, 1000  # Stage 1: window, prompt tokens, kept
MAX_MODEL_LEN, TOPK = 32768, 1024  # FULL decode graphs: launch shapes from these
GRAPH_ROWS, EAGER_ROWS, EAGER_CONTEXT = 4, 128, 4096


@dataclass(frozen=True)
class Config:
    d: int
    dtype: str
    ps: int
    kt: str
    layout: str
    kv: str = "auto"  # kv_cache_dtype: auto (the model's dtype) or an fp8 format

    @property
    def name(self) -> str:
        kv = "" if self.kv == "auto" else f"-kv{self.kv}"
        return f"d{self.d}-{self.dtype}-ps{self.ps}-{self.kt}kt-{self.layout}{kv}"

    def compiles_for(self, target: Target) -> bool:
        """fp8 caches only where ROCKETKV accepts them: compute capability 8.9+
        (TRITON_ATTN's fp8 reads, ``engine.cache_dtype_refusals``)."""
        return self.kv == "auto" or target.capability >= 89

    @property
    def sixteen_bit(self) -> bool:
        return self.dtype in ("bf16", "fp16")


def sweep(head_dims, dtypes, page_sizes, kts, layouts, kvs=("auto",)) -> list[Config]:
    return [Config(*c) for c in itertools.product(head_dims, dtypes, page_sizes, kts, layouts, kvs)]


def default_sweep() -> list[Config]:
    """Engine head dims in every dtype, both layouts; the other FLASH_ATTN
    head sizes in the 16-bit dtypes, graph layout (eager differs only in the
    split / select constexprs, which do not depend on d); fp8 caches (their KT
    rows are always fp8) at the engine head dims in the 16-bit dtypes."""
    other = tuple(d for d in HEAD_DIMS if d not in ENGINE_HEAD_DIMS)
    return (
        sweep(ENGINE_HEAD_DIMS, DTYPES, PAGE_SIZES, KT_DTYPES, LAYOUTS)
        + sweep(other, ("bf16", "fp16"), PAGE_SIZES, KT_DTYPES, ("graph",))
        + sweep(ENGINE_HEAD_DIMS, ("bf16", "fp16"), PAGE_SIZES, ("fp8",), LAYOUTS, FP8_KVS)
    )


# The test's subset: every kernel in each 16-bit dtype, both KT formats,
# both layouts, both page sizes, engine and new head dims; one fp32 config
# (compile errors only: fp32 spills are allowed).
CI_SUBSET = [
    Config(128, "bf16", 16, "fp8", "graph"),
    Config(128, "fp16", 4, "auto", "eager"),
    Config(64, "bf16", 4, "auto", "graph"),
    Config(256, "bf16", 16, "auto", "eager"),
    Config(80, "fp16", 16, "fp8", "graph"),
    Config(128, "fp32", 4, "fp8", "eager"),
    Config(128, "bf16", 16, "fp8", "graph", "fp8_e4m3"),  # sm_90 only
    Config(64, "fp16", 4, "fp8", "eager", "fp8_e5m2"),
]


class Tensors:
    """CPU tensors laid out like the engine's: one padded vLLM KV cache
    (TRITON_ATTN's per-token K|V, the KT pages in each block's padding); an
    fp8 cache is uint8 codes read through ``fp8_kv.Fp8KV`` views."""

    def __init__(self, cfg: Config):
        from rocketkv_vllm.fp8_kv import FP8_FORMATS, KVQuant
        from rocketkv_vllm.layout import kt_cache_view, kt_row_bytes, split_kv

        dtype = DTYPES[cfg.dtype]
        cache_dtype = dtype if cfg.kv == "auto" else torch.uint8
        d, ps = cfg.d, cfg.ps
        self.cfg, self.dtype = cfg, dtype
        kt_dtype = "fp8_e4m3" if cfg.kt == "fp8" else "auto"
        num_blocks = 4
        kt_bytes = HKV * (BLOCK_SIZE // ps) * kt_row_bytes(d, cache_dtype, kt_dtype)
        block_elems = HKV * BLOCK_SIZE * 2 * d + -(-kt_bytes // cache_dtype.itemsize)
        storage = torch.zeros(num_blocks * block_elems, dtype=cache_dtype)
        self.kv = torch.as_strided(
            storage,
            (num_blocks, HKV, BLOCK_SIZE, 2 * d),
            (block_elems, BLOCK_SIZE * 2 * d, 2 * d, 1),
        )
        quant = None if cfg.kv == "auto" else KVQuant(FP8_FORMATS[cfg.kv], 0.5, 0.25)
        self.k, self.v = split_kv(self.kv, "token", quant)
        self.kt = kt_cache_view(self.kv, ps, kt_dtype)

    def rows(self, batch: int):
        ints = lambda: torch.zeros(batch, dtype=torch.int32)  # noqa: E731
        return dict(
            block_table=torch.zeros(batch, MAX_MODEL_LEN // BLOCK_SIZE, dtype=torch.int32),
            num_compact=ints(),
            tail_start=ints(),
            seq_lens=ints(),
            topk=ints(),
            topr=ints(),
        )

    def query(self, batch: int):
        return torch.zeros(batch, HKV * GROUP, self.cfg.d, dtype=self.dtype)


def launch_config(
    cfg: Config, target: Target, mods, only: set[str] | None = None
) -> list[tuple[str, str]]:
    """Call every launcher for one configuration; [(launcher, error)] of those
    that raised (compile errors, out of resources)."""
    t = Tensors(cfg)
    d, ps, scale = cfg.d, cfg.ps, cfg.d**-0.5
    ws, cp, ku = mods["window_scores"], mods["compact"], mods["kt_update"]
    hs, pg, sd = mods["hsa_score"], mods["page_select"], mods["sparse_decode"]
    dd, ops = mods["dense_decode"], mods["ops"]
    from rocketkv_vllm.kernels._utils import pdl_capable  # this checkout's (import_kernels)

    pdl = pdl_capable(target.capability // 10)
    graph = cfg.layout == "graph"
    batch = GRAPH_ROWS if graph else EAGER_ROWS
    if graph:  # backend.graphs.shape_for: fixed by max_model_len and the budget
        max_pages = -(-MAX_MODEL_LEN // ps) + 1
        max_select = min(max(TOPK // ps, 1), max_pages)
        max_seq = MAX_MODEL_LEN
    else:  # the backend's eager step: powers of two above the batch's rows
        max_pages = 1 << (EAGER_CONTEXT // ps - 1).bit_length()
        max_select = 1 << (max(TOPK // ps, 1) - 1).bit_length()
        max_seq = EAGER_CONTEXT
    r = t.rows(batch)
    q = t.query(batch)
    out = torch.zeros_like(q) if graph else None
    block_row = torch.zeros(PROMPT // BLOCK_SIZE, dtype=torch.int32)
    q_win = torch.zeros(WINDOW, HKV * GROUP, d, dtype=t.dtype)
    kept = torch.zeros(HKV, KEPT, dtype=torch.int64)
    probs = torch.zeros(batch, HKV, max_pages, dtype=torch.float32)
    n_sel = min(max_select + 1, max_pages)
    sel = torch.zeros(batch, HKV, n_sel, dtype=torch.int32)
    new = torch.zeros(batch, HKV, d, dtype=t.dtype)
    sinks = torch.zeros(HKV * GROUP, dtype=torch.float32)  # gpt-oss attention sinks
    bt, nc, ts, seq = r["block_table"], r["num_compact"], r["tail_start"], r["seq_lens"]
    rows = ops.DecodeRows(bt, nc, ts, seq, r["topk"], r["topr"], max_pages, max_select)
    attend = (q, t.k, t.v, rows, sel, ps, scale)

    def decode(force, **kw):
        """Stage 2 as the backend runs it: three launches on a workspace."""
        ws = ops.DecodeWorkspace(
            "cpu", batch, HKV * GROUP, HKV, d, max_pages, max_select, force, sms=target.sms
        )
        return ops.hsa_decode(q, t.k, t.v, t.kt, rows, ps, scale, force, out, workspace=ws, **kw)

    calls = {
        # Stage 2 (ops.triton.hsa_decode: _score_kernel with the KT update,
        # _select_kernel, _sparse_decode_kernel with its split merge); the
        # trtllm preset forces no page, the others do (FORCE constexpr)
        "hsa_decode": lambda: decode(False),
        "hsa_decode_sinks": lambda: decode(True, sinks=sinks),
        # Stage 1 (ops.triton.TritonStage1's steps)
        "window_scores": lambda: ws.window_scores(q_win, t.k, block_row, PROMPT, scale),
        # sinks join the host's merge of the row statistics: the same kernels
        "window_scores_sinks": lambda: ws.window_scores(
            q_win, t.k, block_row, PROMPT, scale, sinks=sinks
        ),
        "compact_kept_tokens": lambda: cp.compact_kept_tokens(t.k, t.v, block_row, kept),
        "write_kt_pages": lambda: cp.write_kt_pages(t.k, t.kt, block_row, 0, KEPT, ps),
        # Stage 2's pieces on their own (tests, benchmarks)
        "kt_update": lambda: ku.kt_update(t.k, t.kt, bt, seq, ps),
        # the fused store writes caches in the model dtype only
        "write_kv_and_kt": None
        if cfg.kv != "auto"
        else lambda: ku.write_kv_and_kt(t.k, t.v, t.kt, bt, seq, ps, new, new),
        "hsa_page_probs": lambda: pg.hsa_page_probs(
            q, t.kt, bt, nc, ts, seq, r["topr"], ps, max_pages, True
        ),
        "select_pages": lambda: pg.select_pages(
            probs, max_select, nc, ts, seq, r["topk"], ps, "auto", True
        ),
        "sparse_decode": lambda: sd.sparse_decode(*attend, out=out, extra_pages=1),
        # SINKS variants: the sink's term where the result is final (one
        # split: the attention kernel, eager rows; several: the merge, graph)
        "sparse_decode_sinks": lambda: sd.sparse_decode(
            *attend, out=out, extra_pages=1, sinks=sinks
        ),
        # the dense baseline
        "dense_decode": lambda: dd.dense_decode(q, t.k, t.v, bt, seq, scale, max_seq, out=out),
        "dense_decode_sinks": lambda: dd.dense_decode(
            q, t.k, t.v, bt, seq, scale, max_seq, out=out, sinks=sinks
        ),
    }
    errors = []
    with (
        mock.patch.object(hs, "num_sms", lambda device: target.sms),
        mock.patch.object(pg, "num_sms", lambda device: target.sms),
        mock.patch.object(sd, "num_sms", lambda device: target.sms),
        mock.patch.object(dd, "num_sms", lambda device: target.sms),
        # the decode's PDL launch where the target has it (uses_pdl's rule)
        mock.patch.object(hs, "uses_pdl", lambda device: pdl),
        mock.patch.object(pg, "uses_pdl", lambda device: pdl),
        mock.patch.object(sd, "uses_pdl", lambda device: pdl),
    ):
        for name, call in calls.items():
            if call is None or (only and name not in only):
                continue
            _Launcher.caller = name
            try:
                call()
            except Exception as exc:  # noqa: BLE001
                msg = f"{type(exc).__name__}: {exc}"
                errors.append((name, msg[-3000:]))
    return errors


def compile_configs(
    configs: list[Config], target_names: list[str], only: set[str] | None = None
) -> dict:
    """Compile ``configs`` for each target in this process."""
    mods = import_kernels()
    kernels = jit_kernels(mods)
    records, errors, reports = [], [], {}
    for tname in target_names:
        target = TARGETS[tname]
        driver.set_active(StandinDriver(target))
        for cfg in configs:
            if not cfg.compiles_for(target):
                continue
            for fn in kernels.values():  # binders (and their target) per config
                fn.device_caches.clear()
            _Launcher.log = []
            t0 = time.time()
            for launcher, msg in launch_config(cfg, target, mods, only):
                errors.append(dict(launcher=launcher, config=cfg.name, target=tname, error=msg))
            grids, callers = {}, {}
            for name, khash, grid, caller in _Launcher.log:
                grids.setdefault((name, khash), grid)
                callers.setdefault((name, khash), caller)
            for kname, fn in kernels.items():
                for compiled in list(fn.device_caches[0][0].values()):
                    md = compiled.metadata
                    key = (tname, compiled.hash)
                    if key not in reports:
                        reports[key] = ptxas_report(
                            compiled.asm["ptx"],
                            target.capability,
                            getattr(md, "enable_fp_fusion", True),
                        )
                        reports[key]["cubin_regs"] = cubin_registers(compiled.asm["cubin"], md.name)
                        reports[key]["grid_wait_first"] = grid_wait_first(compiled.asm["ptx"])
                    rep = reports[key]
                    if "ptxas_error" in rep:
                        errors.append(
                            dict(
                                launcher=kname,
                                config=cfg.name,
                                target=tname,
                                error=rep["ptxas_error"],
                            )
                        )
                        continue
                    regs = rep["cubin_regs"] or rep["regs"]
                    launch = (md.name, getattr(md, "hash", None))
                    records.append(
                        dict(
                            kernel=kname,
                            config=cfg.name,
                            target=tname,
                            **asdict(cfg),
                            launcher=callers.get(launch, ""),
                            hash=compiled.hash,
                            num_warps=md.num_warps,
                            num_stages=md.num_stages,
                            smem=md.shared,
                            regs=regs,
                            ptxas_regs=rep["regs"],
                            spill_stores=rep["spill_stores"],
                            spill_loads=rep["spill_loads"],
                            stack=rep["stack"],
                            blocks_per_sm=blocks_per_sm(target, regs, md.num_warps, md.shared),
                            pdl=bool(getattr(md, "launch_pdl", False)),
                            grid_wait_first=rep["grid_wait_first"],
                            grid=grids.get(launch),
                            launched=launch in grids,
                        )
                    )
            print(f"  {tname} {cfg.name}: {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    return dict(records=records, errors=errors)


def _worker(args):
    configs, target_names, only = args
    with contextlib.redirect_stdout(sys.stderr):
        try:
            return compile_configs(configs, target_names, only)
        except Exception:  # noqa: BLE001
            return dict(
                records=[],
                errors=[
                    dict(
                        launcher="*",
                        config="*",
                        target=",".join(target_names),
                        error=traceback.format_exc()[-3000:],
                    )
                ],
            )


def run(
    configs: list[Config], target_names: list[str], jobs: int, only: set[str] | None = None
) -> dict:
    tasks = [
        (configs[i::jobs], [t], only) for t in target_names for i in range(jobs) if configs[i::jobs]
    ]
    if jobs <= 1:
        results = [_worker((configs, target_names, only))]
    else:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(min(jobs, len(tasks))) as pool:
            results = pool.map(_worker, tasks)
    merged = dict(records=[], errors=[])
    for res in results:
        merged["records"] += res["records"]
        merged["errors"] += res["errors"]
    return merged


# --------------------------------------------------------------------------
# Report


def spills(rec) -> int:
    return rec["spill_stores"] + rec["spill_loads"]


def unique_rows(records: list[dict], configs: list[Config]) -> list[dict]:
    """One row per (target, compiled kernel): the configs it serves, with each
    config dimension shown as '*' where it takes every swept value."""
    dims = ["d", "dtype", "ps", "kt", "layout"]
    swept = {k: {getattr(c, k) for c in configs} for k in dims}
    groups: dict = {}
    for rec in records:
        groups.setdefault((rec["target"], rec["hash"]), []).append(rec)
    rows = []
    for recs in groups.values():
        first = recs[0]
        parts = []
        for k in dims:
            vals = sorted({r[k] for r in recs}, key=str)
            if len(swept[k]) > 1 and set(vals) == swept[k]:
                parts.append(f"{k}=*" if k != "layout" else "*")
            else:
                txt = "/".join(map(str, vals))
                parts.append(
                    {
                        "d": f"d{txt}",
                        "dtype": txt,
                        "ps": f"ps{txt}",
                        "kt": f"{txt}kt",
                        "layout": txt,
                    }[k]
                )
        row = dict(first, config=" ".join(parts), configs=sorted({r["config"] for r in recs}))
        for k in ("before_regs", "before_spills"):
            vals = [r.get(k) for r in recs if r.get(k) is not None]
            row[k] = max(vals) if vals else None
        rows.append(row)
    rows.sort(
        key=lambda r: (r["launcher"], r["kernel"], r["d"], r["dtype"], r["config"], r["target"])
    )
    return rows


def print_table(rows: list[dict], with_before: bool, out=sys.stdout) -> None:
    head = [
        "launcher",
        "kernel",
        "config",
        "target",
        "warps",
        "regs",
        "spills st/ld B",
        "smem B",
        "blk/SM",
    ]
    if with_before:
        head += ["regs before", "spills before"]
    table = [head]
    for r in rows:
        line = [
            r["launcher"],
            r["kernel"],
            r["config"],
            r["target"],
            str(r["num_warps"]),
            str(r["regs"]),
            f"{r['spill_stores']}/{r['spill_loads']}",
            str(r["smem"]),
            str(r["blocks_per_sm"]),
        ]
        if with_before:
            line += [
                str(r.get("before_regs") if r.get("before_regs") is not None else "-"),
                str(r.get("before_spills") if r.get("before_spills") is not None else "-"),
            ]
        table.append(line)
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=out)
        if i == 0:
            print("  ".join("-" * w for w in widths), file=out)


def summary(records: list[dict]) -> dict:
    worst: dict = {}
    for r in records:
        key = f"{r['target']} {r['kernel']} {'16-bit' if r['dtype'] != 'fp32' else 'fp32'}"
        w = worst.setdefault(
            key, dict(max_regs=0, max_spill_bytes=0, min_blocks_per_sm=99, max_smem=0)
        )
        w["max_regs"] = max(w["max_regs"], r["regs"])
        w["max_spill_bytes"] = max(w["max_spill_bytes"], spills(r))
        w["min_blocks_per_sm"] = min(w["min_blocks_per_sm"], r["blocks_per_sm"])
        w["max_smem"] = max(w["max_smem"], r["smem"])
    return dict(sorted(worst.items()))


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--subset",
        choices=["default", "ci", "all"],
        default="default",
        help="default: engine head dims (64, 128) in bf16/fp16/fp32 and the other "
        "FLASH_ATTN head sizes in bf16/fp16 (graph layout), fp8 caches at the "
        "engine head dims in bf16/fp16; all: every head size, dtype and layout "
        "(model-dtype caches) plus the default's fp8 ones; ci: the test's eight "
        "configurations",
    )
    p.add_argument(
        "--targets",
        default=None,
        help="comma list of " + ", ".join(TARGETS) + " (default: all this Triton "
        "supports; ci: sm_90,sm_80)",
    )
    p.add_argument("--head-dims", default=None, help="comma list, filters the subset")
    p.add_argument("--dtypes", default=None, help="comma list of bf16, fp16, fp32")
    p.add_argument("--page-sizes", default=None)
    p.add_argument("--kt", default=None, help="comma list of auto, fp8")
    p.add_argument("--layouts", default=None, help="comma list of graph, eager")
    p.add_argument(
        "--kv", default=None, help="comma list of kv_cache_dtypes: auto, fp8_e4m3, fp8_e5m2"
    )
    p.add_argument(
        "--launchers",
        default=None,
        help="comma list: only these launchers (hsa_decode, hsa_decode_sinks, window_scores, "
        "window_scores_sinks, compact_kept_tokens, write_kt_pages, kt_update, write_kv_and_kt, "
        "hsa_page_probs, select_pages, sparse_decode, sparse_decode_sinks, dense_decode, "
        "dense_decode_sinks)",
    )
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument(
        "--json", default=str(DEFAULT_JSON), help="where to write the results ('' for nowhere)"
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="an earlier JSON of this script: its regs / spills per (kernel, "
        "config, target) become 'before' columns",
    )
    p.add_argument(
        "--fail-on-spill",
        action="store_true",
        help="exit 1 on any register spill in a bf16 / fp16 configuration",
    )
    p.add_argument("--quiet", action="store_true", help="no table")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.subset == "ci":
        configs = list(CI_SUBSET)
    elif args.subset == "all":
        configs = sweep(HEAD_DIMS, DTYPES, PAGE_SIZES, KT_DTYPES, LAYOUTS) + [
            c for c in default_sweep() if c.kv != "auto"
        ]
    else:
        configs = default_sweep()

    def keep(attr, text, conv=str):
        nonlocal configs
        if text:
            allowed = {conv(x) for x in text.split(",")}
            configs = [c for c in configs if getattr(c, attr) in allowed]

    keep("d", args.head_dims, int)
    keep("dtype", args.dtypes)
    keep("ps", args.page_sizes, int)
    keep("kt", args.kt)
    keep("layout", args.layouts)
    keep("kv", args.kv)
    available = supported_targets()
    if args.targets:
        target_names = args.targets.split(",")
    else:
        target_names = ["sm_90", "sm_80"] if args.subset == "ci" else available
    for t in target_names:
        if t not in TARGETS:
            raise SystemExit(f"unknown target {t!r}: one of {sorted(TARGETS)}")
        if t not in available:
            raise SystemExit(f"this Triton ({triton.__version__}) cannot compile for {t}")
    if not configs:
        raise SystemExit("no configuration left after the filters")

    t0 = time.time()
    print(
        f"compiling {len(configs)} configurations for {', '.join(target_names)} "
        f"(Triton {triton.__version__}, jobs {args.jobs})",
        file=sys.stderr,
        flush=True,
    )
    only = set(args.launchers.split(",")) if args.launchers else None
    result = run(configs, target_names, max(1, args.jobs), only)
    records, errors = result["records"], result["errors"]
    wall = time.time() - t0

    if args.baseline:
        old = json.loads(Path(args.baseline).read_text())
        before = {(r["kernel"], r["config"], r["target"]): r for r in old["records"]}
        for r in records:
            b = before.get((r["kernel"], r["config"], r["target"]))
            if b is not None:
                r["before_regs"], r["before_spills"] = b["regs"], spills(b)
    rows = unique_rows(records, configs)
    if not args.quiet:
        print_table(rows, bool(args.baseline))
    spilled = [r for r in records if r["dtype"] != "fp32" and spills(r) > 0]
    for e in errors:
        print(f"ERROR {e['target']} {e['config']} {e['launcher']}: {e['error']}", file=sys.stderr)
    for r in spilled:
        print(
            f"SPILL {r['target']} {r['config']} {r['kernel']}: {r['spill_stores']} B "
            f"stores / {r['spill_loads']} B loads",
            file=sys.stderr,
        )
    print(
        f"{len(records)} kernel compilations ({len(rows)} distinct), {len(errors)} "
        f"errors, {len(spilled)} spilling in 16-bit configurations, {wall:.0f}s",
        file=sys.stderr,
    )

    if args.json:
        doc = dict(
            command=" ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            triton_version=triton.__version__,
            torch_version=torch.__version__,
            ptxas={t: ptxas_version(TARGETS[t].capability) for t in target_names},
            ptxas_flags=_ptxas_flags(),
            wall_seconds=round(wall),
            targets={t: asdict(TARGETS[t]) for t in target_names},
            shapes=dict(
                hkv=HKV,
                group=GROUP,
                block_size=BLOCK_SIZE,
                window=WINDOW,
                prompt=PROMPT,
                kept=KEPT,
                max_model_len=MAX_MODEL_LEN,
                topk=TOPK,
                graph_rows=GRAPH_ROWS,
                eager_rows=EAGER_ROWS,
                eager_context=EAGER_CONTEXT,
                kv_layout="token",
            ),
            configs=[c.name for c in configs],
            errors=errors,
            summary=summary(records),
            kernels=[
                {
                    k: r[k]
                    for k in (
                        "launcher",
                        "kernel",
                        "config",
                        "target",
                        "num_warps",
                        "regs",
                        "spill_stores",
                        "spill_loads",
                        "stack",
                        "smem",
                        "blocks_per_sm",
                        "before_regs",
                        "before_spills",
                    )
                    if k in r
                }
                for r in rows
            ],
            records=records,
        )
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    failed = bool(errors) or (args.fail_on_spill and bool(spilled))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
