"""Every Triton kernel compiles for NVIDIA GPUs (sm_90, sm_80) on this CPU
machine, without register spills in 16-bit configurations.

Runs ``scripts/compile_kernels.py --subset ci`` in a subprocess (the kernels
must be imported without TRITON_INTERPRET, which conftest sets for the
interpreter tests): the project's launchers on CPU tensors laid out like the
engine's KV cache, Triton's driver replaced by a stand-in for the target, so
Triton's own binder picks every constexpr; each kernel goes to PTX and a
cubin with the bundled ptxas and nothing is launched. Eight configurations
(bf16 / fp16 at head dims 64, 128 and 80, 256, both KT formats, the FULL-graph
and the eager launch shapes, page sizes 4 and 16, one fp32, and two fp8 KV
caches, e4m3 and e5m2, compiled for sm_90 only: ROCKETKV refuses fp8 below
compute capability 8.9) for two targets; the full sweep is the script's
default. Stage 2's decode with a selection store (the REUSE specialization
of its scoring and selection kernels) compiles the same way, in a
subprocess of its own, for the same configurations on sm_80, sm_90 and
sm_100 (where this Triton targets it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compile_kernels.py"
TARGETS = {"sm_90", "sm_80"}
# every kernel the launchers start (the KT update twice: plain and fused;
# Stage 2's three decode kernels; the dense baseline's two, from eval/)
KERNELS = {
    "_window_stats_kernel",
    "_window_colsum_kernel",
    "_compact_kernel",
    "_kt_pages_kernel",
    "_kt_update_kernel",
    "_score_kernel",
    "_select_kernel",
    "_sparse_decode_kernel",
    "_merge_splits_kernel",
    "_dense_decode_kernel",
}
# Stage 2's decode launch (ops.triton.hsa_decode) and its kernels, in order
DECODE = ["_score_kernel", "_select_kernel", "_sparse_decode_kernel"]
MAX_SMEM = {"sm_90": 232448, "sm_80": 166912}


def _nvidia_backend() -> str | None:
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"Triton has no NVIDIA backend here: {exc}"
    return None


def _compile_to_json(tmp_path_factory, name: str, argv: list[str]):
    """(process, JSON document) of a compile run without the interpreter
    that writes its JSON to the path appended to ``argv``; skipped where
    Triton has no NVIDIA backend."""
    reason = _nvidia_backend()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp(name) / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, *argv, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert out.exists(), f"no JSON written (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return proc, json.loads(out.read_text())


def _assert_no_errors(doc) -> None:
    assert doc["errors"] == [], "\n".join(
        f"{e['target']} {e['config']} {e['launcher']}: {e['error'][:1500]}" for e in doc["errors"]
    )


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    argv = [str(SCRIPT), "--subset", "ci", "--jobs", "2", "--quiet", "--json"]
    return _compile_to_json(tmp_path_factory, "kernels-compile", argv)


def test_every_kernel_compiles_for_each_target(compiled):
    proc, doc = compiled
    _assert_no_errors(doc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = doc["records"]
    fp8_configs = {c for c in doc["configs"] if "-kvfp8" in c}
    assert len(fp8_configs) == 2, doc["configs"]
    for target in TARGETS:
        for config in doc["configs"]:
            if config in fp8_configs and target == "sm_80":
                assert not any(r["config"] == config and r["target"] == target for r in records)
                continue
            got = {
                r["kernel"]
                for r in records
                if r["target"] == target and r["config"] == config and r["launched"]
            }
            # eager rows (128 of them) fill the GPU without splitting the
            # dense attention: no merge there
            want = KERNELS - ({"_merge_splits_kernel"} if "-eager" in config else set())
            assert got == want, (target, config, sorted(want ^ got))
    fused = {r["launcher"] for r in records if r["kernel"] == "_kt_update_kernel"}
    assert fused == {"kt_update", "write_kv_and_kt"}
    # the decode layer compiles its three kernels and nothing else
    for target in TARGETS:
        for config in doc["configs"]:
            got = {
                r["kernel"]
                for r in records
                if r["target"] == target and r["config"] == config and r["launcher"] == "hsa_decode"
            }
            assert got in (set(), set(DECODE)), (target, config, got)
    assert any(r["launcher"] == "hsa_decode" for r in records)


# Compiles ``ops.triton.hsa_decode`` with a selection store (every row
# reusing slot 0) through the script's own machinery (its stand-in driver and
# launch shapes); writes the records, errors and the REUSE values compiled.
REUSE_SCRIPT = """
import dataclasses, json, sys
import torch
from unittest import mock
from rocketkv_eval import compile_kernels as ck

mods = ck.import_kernels()
ops = mods["ops"]
plain = ops.hsa_decode


def with_store(query, k_cache, v_cache, kt_cache, rows, *args, **kw):
    batch, hkv = query.shape[0], kt_cache.shape[1]
    store = torch.zeros(batch, hkv, 64, dtype=torch.int32)
    slots = torch.zeros(batch, dtype=torch.int32)
    rows = dataclasses.replace(rows, sel_slot=slots, reuse=slots)
    return plain(query, k_cache, v_cache, kt_cache, rows, *args, selections=store, **kw)


configs = ck.CI_SUBSET
# sm_80 and sm_90 (sm_100 builds the kernels without a store in
# test_every_kernel_compiles_for_each_target)
targets = [t for t in ("sm_80", "sm_90") if t in ck.supported_targets()]
with mock.patch.object(ops, "hsa_decode", with_store):
    doc = ck.compile_configs(configs, targets, {"hsa_decode"})
reuse = {}
for name, fn in ck.jit_kernels(mods).items():
    if "REUSE" in fn.arg_names:
        i = fn.arg_names.index("REUSE")
        reuse[name] = sorted({c.src.constants[(i,)] for c in fn.device_caches[0][0].values()})
doc.update(targets=targets, configs=[c.name for c in configs], reuse=reuse)
with open(sys.argv[1], "w") as f:
    json.dump(doc, f)
"""


@pytest.fixture(scope="module")
def compiled_reuse(tmp_path_factory):
    return _compile_to_json(tmp_path_factory, "compile-reuse", ["-c", REUSE_SCRIPT])[1]


def test_decode_with_a_selection_store_compiles(compiled_reuse):
    """The REUSE specialization of Stage 2's decode: its three kernels for
    each target and configuration, no register spill in 16-bit ones, the
    scoring and selection kernels compiled with REUSE on (and only so:
    nothing else launched)."""
    doc = compiled_reuse
    _assert_no_errors(doc)
    assert set(doc["targets"]) >= TARGETS
    assert doc["reuse"] == {"_score_kernel": [True], "_select_kernel": [True]}
    records = doc["records"]
    for target in doc["targets"]:
        for config in doc["configs"]:
            got = {
                r["kernel"]
                for r in records
                if r["target"] == target and r["config"] == config and r["launched"]
            }
            fp8_kv = "-kvfp8" in config
            want = set() if fp8_kv and target == "sm_80" else set(DECODE)
            assert got == want, (target, config, sorted(got))
    for r in records:
        where = f"{r['target']} {r['config']} {r['kernel']}"
        assert 0 < r["regs"] <= 255 and r["blocks_per_sm"] >= 1, where
        if r["dtype"] in ("bf16", "fp16"):
            assert r["spill_stores"] + r["spill_loads"] == 0, where


def test_compiled_artefacts_are_sane(compiled):
    _, doc = compiled
    for r in doc["records"]:
        where = f"{r['target']} {r['config']} {r['kernel']}"
        # the cubin's own register count and ptxas -v rerun on the PTX agree
        assert r["regs"] == r["ptxas_regs"], where
        assert 0 < r["regs"] <= 255, where
        assert 0 <= r["smem"] <= MAX_SMEM[r["target"]], where
        assert r["blocks_per_sm"] >= 1, where


def test_decode_kernels_report_registers_shared_memory_and_spills(compiled):
    """The report's rows for Stage 2's decode kernels (the summary the
    issue asks for: registers, shared memory, spills per target)."""
    _, doc = compiled
    for target in TARGETS:
        for kernel in DECODE:
            key = f"{target} {kernel} 16-bit"
            assert key in doc["summary"], sorted(doc["summary"])
            w = doc["summary"][key]
            assert 0 < w["max_regs"] <= 255 and w["max_smem"] >= 0, (key, w)
            assert w["max_spill_bytes"] == 0, (key, w)


def test_decode_kernels_keep_three_programs_resident_per_sm(compiled):
    """Occupancy proxy for the latency-bound decode (issue 38): at a Llama
    layer's shapes (d 128, bf16, FULL-graph launch) each of the three decode
    kernels fits at least 3 programs on an sm_90 SM, so a batch-1 grid of a
    few hundred programs runs in one wave (the scoring kernel took 2 with 8
    warps)."""
    _, doc = compiled
    rows = {
        r["kernel"]: r["blocks_per_sm"]
        for r in doc["records"]
        if r["target"] == "sm_90"
        and r["config"] == "d128-bf16-ps16-fp8kt-graph"
        and r["launcher"] == "hsa_decode"
    }
    assert set(rows) == set(DECODE), rows
    assert min(rows.values()) >= 3, rows


def _assert_pdl_where_the_target_has_it(records):
    """Stage 2's decode kernels are launched with PDL from sm_90 on, and their
    PTX waits for the kernels before them (griddepcontrol.wait) before its
    first global memory access; nothing else uses PDL, and below sm_90 no
    kernel waits or launches with it."""
    for r in records:
        where = f"{r['target']} {r['config']} {r['kernel']} ({r['launcher']})"
        on = r["kernel"] in DECODE and r["target"] != "sm_80"
        assert r["pdl"] == on, where
        assert r["grid_wait_first"] is (True if on else None), where


def test_decode_kernels_wait_for_the_kernels_before_them(compiled, compiled_reuse):
    _, doc = compiled
    _assert_pdl_where_the_target_has_it(doc["records"])
    _assert_pdl_where_the_target_has_it(compiled_reuse["records"])
    on = {(r["target"], r["kernel"]) for r in doc["records"] if r["pdl"]}
    assert on == {("sm_90", k) for k in DECODE}, sorted(on)


def test_grid_wait_first_reads_the_ptx():
    """The check the test above relies on, on PTX fragments (from a module
    that leaves TRITON_INTERPRET alone: ``compile_kernels`` drops it)."""
    before = os.environ.get("TRITON_INTERPRET")
    from rocketkv_eval.ptx import grid_wait_first

    assert os.environ.get("TRITON_INTERPRET") == before  # later interpreted tests need it

    head = "ld.param.u64 %rd1, [k_param_0];\n\tmov.u32 %r1, %ctaid.x;\n"
    assert grid_wait_first(head + "griddepcontrol.wait;\nld.global.b32 %r2, [%rd1];") is True
    assert grid_wait_first(head + "@%p1 ld.global.b32 %r2, [%rd1];\ngriddepcontrol.wait;") is False
    assert grid_wait_first(head + "st.shared.b32 [%r3], %r1;\ngriddepcontrol.wait;") is True
    assert grid_wait_first(head + "atom.global.gpu.acq_rel.add.u32 %r2, [%rd1], 1;") is None
    assert grid_wait_first(head + "ld.global.b32 %r2, [%rd1]; // griddepcontrol.wait") is None


def test_no_register_spills_in_16_bit_configurations(compiled):
    _, doc = compiled
    spilled = [
        f"{r['target']} {r['config']} {r['kernel']}: {r['spill_stores']} B stores, "
        f"{r['spill_loads']} B loads"
        for r in doc["records"]
        if r["dtype"] in ("bf16", "fp16") and r["spill_stores"] + r["spill_loads"]
    ]
    assert not spilled, "\n".join(spilled)
    assert {r["dtype"] for r in doc["records"]} >= {"bf16", "fp16", "fp32"}
