"""The demo's dtype rule (rocketkv_eval.demo.choose_dtype): float32 on an x86-64
CPU without native bf16, the checkpoint's dtype elsewhere; and the README's
length. Pure functions, no engine."""

import platform
from pathlib import Path

import pytest

from rocketkv_eval import demo

# /proc/cpuinfo excerpts: a 2-core AVX2-only machine (the one that took 8.5
# minutes in bf16), an AVX-512 machine without bf16 (Skylake-SP), Sapphire Rapids.
AVX2 = "fpu vme sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2"
AVX512 = AVX2 + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"
SPR = AVX512 + " avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8"


@pytest.mark.parametrize("flags", [AVX2, AVX512, ""])
def test_no_native_bf16_gives_float32_and_says_why(flags):
    dtype, why = demo.choose_dtype(None, "x86_64", flags.split())
    assert dtype == "float32"
    assert "no native bf16" in why and "avx512_bf16" in why and "amx_bf16" in why


@pytest.mark.parametrize(
    "flags", [AVX512 + " avx512_bf16", SPR, AVX2 + " amx_bf16"], ids=["avx512_bf16", "spr", "amx"]
)
def test_native_bf16_keeps_the_checkpoint_dtype(flags):
    dtype, why = demo.choose_dtype(None, "x86_64", flags.split())
    assert dtype == "auto"
    assert "native bf16" in why and "no native" not in why


def test_requested_dtype_wins_both_ways():
    assert demo.choose_dtype("bfloat16", "x86_64", AVX2.split())[0] == "bfloat16"
    assert demo.choose_dtype("float32", "x86_64", SPR.split())[0] == "float32"


@pytest.mark.parametrize("machine", ["aarch64", "ppc64le", "s390x"])
def test_other_architectures_keep_the_checkpoint_dtype(machine):
    assert demo.choose_dtype(None, machine, set())[0] == "auto"


def test_unknown_flags_keep_the_checkpoint_dtype():
    assert demo.choose_dtype(None, "x86_64", None)[0] == "auto"


def test_cpuinfo_flags_parsed():
    text = (
        "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: " + AVX2 + "\nbugs\t\t: spectre\n"
        "\nprocessor\t: 1\nflags\t\t: " + AVX2 + "\n"
    )
    flags = demo.cpu_flags(text)
    assert "avx2" in flags and "avx512_bf16" not in flags and "spectre" not in flags
    assert demo.choose_dtype(None, "x86_64", flags)[0] == "float32"
    assert demo.cpu_flags("processor\t: 0\n") == set()


def test_flags_can_be_forced(monkeypatch):
    monkeypatch.setenv("ROCKETKV_DEMO_CPU_FLAGS", "avx2 fma")
    assert demo.read_cpu_flags() == {"avx2", "fma"}
    args = demo.parse_args([])
    assert args.dtype is None
    x86 = platform.machine().lower() in demo.X86_64
    assert demo.dtype_for(args, on_cpu=True)[0] == ("float32" if x86 else "auto")
    monkeypatch.setenv("ROCKETKV_DEMO_CPU_FLAGS", "avx2 avx512f avx512_bf16")
    assert demo.dtype_for(args, on_cpu=True)[0] == "auto"
    assert demo.dtype_for(args, on_cpu=False)[0] == "auto"
    assert demo.dtype_for(demo.parse_args(["--dtype", "half"]), on_cpu=False)[0] == "half"


def test_readme_at_most_200_lines():
    """Users read the README's first screen; the support matrix, refusals,
    design and dated results live in docs/ (issue 37)."""
    readme = Path(__file__).resolve().parents[1] / "README.md"
    n = len(readme.read_text().splitlines())
    assert n <= 200, f"README.md has {n} lines (at most 200; move details to docs/)"
