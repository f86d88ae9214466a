"""Every change ROCKETKV makes to vLLM is in ``vllm_patches.PATCHES``, is
installed by ``plugin.register``, and matches the installed vLLM."""

import inspect
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


# -- RELIED_ON: every other vLLM internal the package relies on ------------------


def test_every_relied_on_entry_holds_on_the_installed_vllm():
    """No false refusal, and the table says what our code does: each
    override's class subclasses the vLLM class and defines the method with
    the parameters in the table."""
    import importlib

    assert vllm_patches.relied_problems() == {}
    targets = [p.target for p in vllm_patches.PATCHES] + [e.target for e in vllm_patches.RELIED_ON]
    assert len(set(vllm_patches.RELIED_ON)) == len(vllm_patches.RELIED_ON)
    assert len({e.target for e in vllm_patches.RELIED_ON}) == len(vllm_patches.RELIED_ON)
    assert not {e.target for e in vllm_patches.RELIED_ON} & {p.target for p in vllm_patches.PATCHES}
    assert len(targets) >= 80
    kinds = {e.kind for e in vllm_patches.RELIED_ON}
    assert kinds == {"attr", "method", "override", "swap", "replace", "absent"}
    for entry in vllm_patches.RELIED_ON:
        if entry.kind != "override":
            continue
        module, cls = entry.used_by.rsplit(".", 1)
        ours = getattr(importlib.import_module(module), cls)
        assert issubclass(ours, vllm_patches._resolve(entry.module, entry.owner)), entry.target
        assert entry.name in vars(ours), (entry.target, "not overridden by", entry.used_by)
        params = list(inspect.signature(vllm_patches._callable(ours, entry.name)).parameters)
        expected = list(entry.params)
        assert (params == expected) if entry.exact else (params[: len(expected)] == expected), (
            entry.target,
            params,
        )


def test_every_name_our_block_manager_and_host_scheduler_add_or_override_is_listed():
    """RocketKVManager and RocketKVHostScheduler live on vLLM's instances
    (the host scheduler by a class swap): each name they define or assign
    is an "override" of vLLM's or an "absent" entry (vLLM must not have it)."""
    import re

    from rocketkv_vllm.host_tier.scheduler import RocketKVHostScheduler
    from rocketkv_vllm.kv_cache import RocketKVManager

    for ours in (RocketKVManager, RocketKVHostScheduler):
        [base] = ours.__bases__
        assigned = r"\b(?:self|manager)\.([A-Za-z_]\w*)\s*(?::[^=\n]+)?=(?!=)"
        names = {n for n in vars(ours) if not n.startswith("__")} | set(
            re.findall(assigned, vllm_patches._methods_source(ours))
        )
        names = {n for n in names if not n.startswith("__")} - {"_abc_impl"}
        listed = {
            (e.name, e.kind)
            for e in vllm_patches.RELIED_ON
            if e.used_by.endswith(f".{ours.__name__}") and e.owner == base.__name__
        }
        for name in names:
            kind = "override" if vllm_patches._has_attr(base, name) else "absent"
            assert (name, kind) in listed, f"{ours.__name__}.{name}: add a {kind!r} entry"
        stale = {name for name, kind in listed if kind == "absent"} - names
        assert stale == set(), f"{ours.__name__} no longer has {sorted(stale)}"


def _mutate(monkeypatch, entry) -> None:
    """``entry``'s name renamed in vLLM (``_rename``); for an "absent"
    entry, the name added to vLLM's class."""
    if entry.kind == "absent":
        owner = vllm_patches._resolve(entry.module, entry.owner)
        monkeypatch.setattr(owner, entry.name, "added by vLLM", raising=False)
    else:
        _rename(monkeypatch, entry)


def _rename(monkeypatch, entry) -> None:
    """What vLLM renaming ``entry``'s name would look like: the name moved to
    ``<name>_renamed`` on its owner (and bases), in their annotations, and in
    the ``self.<name>`` assignments of their source."""
    import re

    new = f"{entry.name}_renamed"
    owner = vllm_patches._resolve(entry.module, entry.owner)
    if inspect.ismodule(owner):
        monkeypatch.setattr(owner, new, getattr(owner, entry.name), raising=False)
        monkeypatch.delattr(owner, entry.name)
        return
    for klass in owner.__mro__:
        if klass is object:
            continue
        if entry.name in vars(klass):
            monkeypatch.setattr(klass, new, vars(klass)[entry.name], raising=False)
            monkeypatch.delattr(klass, entry.name)
        annotations = vars(klass).get("__annotations__", {})
        if entry.name in annotations:
            monkeypatch.setitem(annotations, new, annotations[entry.name])
            monkeypatch.delitem(annotations, entry.name)
    source = vllm_patches._methods_source
    pattern = re.compile(rf"\bself\.{re.escape(entry.name)}\b")
    monkeypatch.setattr(
        vllm_patches, "_methods_source", lambda klass: pattern.sub(f"self.{new}", source(klass))
    )


def _seed() -> int:
    import os
    import random

    return int(os.environ.get("ROCKETKV_RELIED_SEED") or random.SystemRandom().randrange(10**6))


@pytest.mark.parametrize(
    "pick",
    [
        "vllm.v1.simple_kv_offload.manager.SimpleCPUOffloadScheduler._pending_cpu_hits",
        "vllm.v1.core.single_type_kv_cache_manager.FullAttentionManager.pop_blocks_for_free",
        "random",
    ],
)
def test_a_renamed_relied_on_name_refuses_rocketkv_engines_naming_exactly_it(monkeypatch, pick):
    """One entry renamed in vLLM (a random one: its seed is printed, rerun it
    with ROCKETKV_RELIED_SEED): the check finds exactly that one, and a
    ROCKETKV engine's startup check refuses naming it."""
    import random

    import vllm
    from vllm.platforms import current_platform

    candidates = [
        e
        for e in vllm_patches.RELIED_ON
        if e.kind != "swap"  # test_a_class_that_no_longer_takes_the_swap_is_refused
        and e.name != "_member_map_"  # the Enum itself stops working without it
        and (e.platform != "cpu" or current_platform.is_cpu())
    ]
    if pick == "random":
        seed = _seed()
        entry = random.Random(seed).choice(candidates)
        print(f"ROCKETKV_RELIED_SEED={seed}: {entry.target}")
    else:
        [entry] = [e for e in candidates if e.target == pick]
    _mutate(monkeypatch, entry)
    # A method that calls a replaced one takes the replacement with it.
    expected = {entry.target} | {
        e.target for e in vllm_patches.RELIED_ON if e.caller == entry.target
    }
    problems = vllm_patches.relied_problems()
    assert set(problems) == expected, problems
    monkeypatch.setattr(vllm_patches, "_failures", {})
    monkeypatch.setattr(vllm_patches, "_relied_checked", False)
    with pytest.raises(RuntimeError) as err:
        vllm_patches.require()
    assert f"vLLM {vllm.__version__}" in str(err.value)
    assert f"({entry.target}: " in str(err.value)
    assert set(vllm_patches._failures) == expected


def test_a_class_that_no_longer_takes_the_swap_is_refused():
    """The host tier's ``manager.__class__ = RocketKVHostScheduler``: a vLLM
    class whose instances cannot become a subclass with attributes of its
    own (``__slots__``) fails the check, naming why."""

    class Slotted:
        __slots__ = ("x",)

    class Plain:
        pass

    globals()["Slotted"], globals()["Plain"] = Slotted, Plain
    try:
        swap = dict(kind="swap", why="test", used_by="tests")
        bad = vllm_patches.Relied(__name__, "Slotted", "__class__", **swap)
        good = vllm_patches.Relied(__name__, "Plain", "__class__", **swap)
        assert vllm_patches.relied_problem(good) is None
        assert "layout differs" in vllm_patches.relied_problem(bad)
    finally:
        del globals()["Slotted"], globals()["Plain"]


def test_a_method_replaced_on_the_instance_must_still_be_called_through_it(monkeypatch):
    """The host tier replaces the host coordinator's find_longest_cache_hit on
    the instance: it counts only while vLLM's scheduler calls it there."""
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    [entry] = [e for e in vllm_patches.RELIED_ON if e.kind == "replace"]
    assert vllm_patches.relied_problem(entry) is None
    original = SimpleCPUOffloadScheduler.get_num_new_matched_tokens

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return original(self, request, num_computed_tokens)  # no direct call

    monkeypatch.setattr(
        SimpleCPUOffloadScheduler, "get_num_new_matched_tokens", get_num_new_matched_tokens
    )
    assert "no longer calls it" in vllm_patches.relied_problem(entry)
