"""Every change ROCKETKV makes to vLLM is in ``vllm_patches.PATCHES``, is
installed by ``plugin.register``, and matches the installed vLLM."""

import subprocess
from pathlib import Path

import pytest

from rocketkv_vllm import vllm_patches
from rocketkv_vllm.plugin import register

ROOT = Path(__file__).resolve().parents[1]


def test_every_patch_target_matches_the_installed_vllm():
    register()
    vllm_patches.require()  # nothing failed to install
    for patch in vllm_patches.PATCHES:
        original = vllm_patches._function(vllm_patches._owner(patch), patch.name)
        assert vllm_patches.installed(patch), patch.target
        # The wrapped original has the parameters the wrapper was written for.
        assert vllm_patches.signature_problem(patch, original.__wrapped__) is None, patch.target


def test_install_is_idempotent():
    register()
    before = [vllm_patches._function(vllm_patches._owner(p), p.name) for p in vllm_patches.PATCHES]
    register()
    after = [vllm_patches._function(vllm_patches._owner(p), p.name) for p in vllm_patches.PATCHES]
    assert before == after  # not wrapped twice


def test_a_changed_signature_refuses_rocketkv_engines_naming_target_and_version():
    """Another vLLM: the entry is not installed, and a ROCKETKV engine
    refuses to start with the method and the vLLM version in the error."""
    import vllm

    class Owner:
        def method(self, renamed):
            return renamed

    patch = vllm_patches.Patch(
        "tests", "Owner", "method", ("self", "request"), lambda original: original, "test"
    )
    problem = vllm_patches.signature_problem(patch, Owner.method)
    assert problem == "expected parameters ['self', 'request'], found ['self', 'renamed']"
    saved = dict(vllm_patches._failures)
    try:
        vllm_patches._failures[patch.target] = problem
        with pytest.raises(RuntimeError) as err:
            vllm_patches.require()
    finally:
        vllm_patches._failures.clear()
        vllm_patches._failures.update(saved)
    assert f"vLLM {vllm.__version__}" in str(err.value)
    assert "tests.Owner.method" in str(err.value) and "renamed" in str(err.value)


def test_vllm_is_changed_in_this_module_only():
    """No other module of the package assigns to vLLM classes or modules."""
    out = subprocess.run(
        ["git", "grep", "-nE", r"(setattr\(|\b[A-Z]\w*\.\w+ = )", "--", "rocketkv_vllm"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    hits = [
        line
        for line in out.stdout.splitlines()
        if not line.startswith("rocketkv_vllm/vllm_patches.py")
    ]
    # Attribute writes on our own objects (metrics' per-request budget on
    # vLLM's RequestState instance) are not patches of vLLM's code.
    allowed = ("rocketkv_vllm/metrics.py",)
    assert [h for h in hits if not h.startswith(allowed)] == []
