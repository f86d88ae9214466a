"""Every change ROCKETKV makes to vLLM is in ``vllm_patches.PATCHES``, is
installed by ``plugin.register``, and matches the installed vLLM."""

import inspect
import subprocess
from pathlib import Path

import pytest

from rocketkv_vllm import vllm_patches
from rocketkv_vllm.plugin import register
from rocketkv_vllm.vllm_patches import bump_report, check

ROOT = Path(__file__).resolve().parents[1]


def test_every_patch_target_matches_the_installed_vllm():
    register()
    vllm_patches.require()  # nothing failed to install
    for patch in vllm_patches.PATCHES:
        original = check._function(check._owner(patch), patch.name)
        assert vllm_patches.installed(patch), patch.target
        # The wrapped original has the parameters the wrapper was written for.
        assert vllm_patches.signature_problem(patch, original.__wrapped__) is None, patch.target


def test_install_is_idempotent():
    register()
    before = [check._function(check._owner(p), p.name) for p in vllm_patches.PATCHES]
    register()
    after = [check._function(check._owner(p), p.name) for p in vllm_patches.PATCHES]
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
    saved = dict(check._failures)
    try:
        check._failures[patch.target] = problem
        with pytest.raises(RuntimeError) as err:
            vllm_patches.require()
    finally:
        check._failures.clear()
        check._failures.update(saved)
    assert f"vLLM {vllm.__version__}" in str(err.value)
    assert "tests.Owner.method" in str(err.value) and "renamed" in str(err.value)


def test_vllm_is_changed_in_this_package_only():
    """No module of rocketkv_vllm outside vllm_patches/ assigns to vLLM
    classes or modules."""
    out = subprocess.run(
        ["git", "grep", "--untracked", "-nE", r"(setattr\(|\b[A-Z]\w*\.\w+ = )"]
        + ["--", "rocketkv_vllm"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    hits = [
        line
        for line in out.stdout.splitlines()
        if not line.startswith("rocketkv_vllm/vllm_patches/")
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
        assert issubclass(ours, check._resolve(entry.module, entry.owner)), entry.target
        assert entry.name in vars(ours), (entry.target, "not overridden by", entry.used_by)
        params = list(inspect.signature(check._callable(ours, entry.name)).parameters)
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
            re.findall(assigned, check._methods_source(ours))
        )
        names = {n for n in names if not n.startswith("__")} - {"_abc_impl"}
        listed = {
            (e.name, e.kind)
            for e in vllm_patches.RELIED_ON
            if e.used_by.endswith(f".{ours.__name__}") and e.owner == base.__name__
        }
        for name in names:
            kind = "override" if check._has_attr(base, name) else "absent"
            assert (name, kind) in listed, f"{ours.__name__}.{name}: add a {kind!r} entry"
        stale = {name for name, kind in listed if kind == "absent"} - names
        assert stale == set(), f"{ours.__name__} no longer has {sorted(stale)}"


def _mutate(monkeypatch, entry) -> None:
    """``entry``'s name renamed in vLLM (``_rename``); for an "absent"
    entry, the name added to vLLM's class."""
    if entry.kind == "absent":
        owner = check._resolve(entry.module, entry.owner)
        monkeypatch.setattr(owner, entry.name, "added by vLLM", raising=False)
    else:
        _rename(monkeypatch, entry)


def _rename(monkeypatch, entry) -> None:
    """What vLLM renaming ``entry``'s name would look like: the name moved to
    ``<name>_renamed`` on its owner (and bases), in their annotations, and in
    the ``self.<name>`` assignments of their source."""
    import re

    new = f"{entry.name}_renamed"
    owner = check._resolve(entry.module, entry.owner)
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
    source = check._methods_source
    pattern = re.compile(rf"\bself\.{re.escape(entry.name)}\b")
    renamed_in = set(owner.__mro__)

    def methods_source(klass):
        # Only the owner and its bases rename: another class with an attribute
        # of the same name (LLMEngine's and AsyncLLM's output_processor) keeps it.
        text = source(klass)
        return pattern.sub(f"self.{new}", text) if klass in renamed_in else text

    monkeypatch.setattr(check, "_methods_source", methods_source)


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
    monkeypatch.setattr(check, "_failures", {})
    monkeypatch.setattr(check, "_relied_checked", False)
    with pytest.raises(RuntimeError) as err:
        vllm_patches.require()
    assert f"vLLM {vllm.__version__}" in str(err.value)
    assert f"({entry.target}: " in str(err.value)
    assert set(check._failures) == expected


def test_every_relied_on_name_renamed_alone_is_found_alone():
    """The random pick above, over every entry at once: the check names exactly
    the renamed entry (and the methods calling it), never a neighbour that
    shares its name on another class."""
    from vllm.platforms import current_platform

    wrong = {}
    for entry in vllm_patches.RELIED_ON:
        if entry.kind == "swap" or entry.name == "_member_map_":
            continue
        if entry.platform == "cpu" and not current_platform.is_cpu():
            continue
        expected = {entry.target} | {
            e.target for e in vllm_patches.RELIED_ON if e.caller == entry.target
        }
        with pytest.MonkeyPatch.context() as mp:
            _mutate(mp, entry)
            found = set(vllm_patches.relied_problems())
        if found != expected:
            wrong[entry.target] = sorted(found ^ expected)
    assert not wrong, wrong


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


# -- the version-bump report (scripts/vllm_bump_report.py) ------------------------


@pytest.fixture(scope="module")
def installed_reader():
    return bump_report.Reader(bump_report.SourceTree(bump_report.installed_tree()))


def test_the_bump_report_finds_nothing_to_port_on_the_installed_vllm(capsys):
    """Read from the installed vLLM's source (not imported), every entry of
    both tables holds, and every method ROCKETKV wraps or overrides is the
    one whose fingerprint is recorded (none missing, none stale)."""
    assert bump_report.main([str(bump_report.installed_tree())]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("nothing to port."), out
    assert len(bump_report.wrapped_targets()) >= 60


def _breaks(entry):
    """``entry`` as a vLLM that breaks it would need it to be."""
    from dataclasses import replace

    if entry.kind == "swap":
        return replace(entry, owner=f"{entry.owner}Renamed")
    if entry.kind == "absent":
        return replace(entry, name="__init__")  # a name vLLM's class has
    if entry.kind == "attr" or entry.params is None:
        return replace(entry, name=f"{entry.name}_renamed")
    return replace(entry, params=(*entry.params, "renamed"), exact=True)


def test_the_bump_report_finds_each_table_entry_broken(installed_reader):
    """Each entry of both tables, broken on purpose (a renamed attribute, a
    parameter more, a name vLLM has, a class gone): the report names it."""
    from dataclasses import replace

    reader = installed_reader
    for patch, target in bump_report.patch_targets():
        assert bump_report.patch_problem(reader, patch, target) is None, target.label
        broken = replace(patch, params=(*patch.params, "renamed"), exact=True)
        why = bump_report.patch_problem(reader, broken, target)
        assert why and why.startswith("expected parameters"), (target.label, why)
    for entry in vllm_patches.RELIED_ON:
        if not entry.module.startswith("vllm."):
            continue
        assert bump_report.relied_problem(reader, entry) is None, entry.target
        why = bump_report.relied_problem(reader, _breaks(entry))
        assert why is not None, (entry.target, entry.kind)


def _copy_with(tmp_path, source, edits):
    """The vLLM tree at ``source`` as links, but for ``edits`` (path -> text)."""
    import os
    import shutil

    copy = tmp_path / "vllm"
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(source, copy, ignore=ignore, copy_function=os.symlink)
    for rel, text in edits.items():
        (copy / rel).unlink()
        (copy / rel).write_text(text)
    return copy


def _def(text, cls, name):
    import ast

    [klass] = [n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == cls]
    [func] = [n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return func


def test_the_bump_report_finds_a_changed_signature_and_a_changed_body(tmp_path):
    """A vLLM tree whose wrapped KVCacheManager.get_computed_blocks takes a
    parameter more and whose FullAttentionManager.free (overridden by
    ROCKETKV's block manager) has a line more: the report names exactly
    these two, the body with a diff against the installed vLLM's."""
    installed = bump_report.installed_tree()
    manager = "v1/core/kv_cache_manager.py"
    text = (installed / manager).read_text()
    last = _def(text, "KVCacheManager", "get_computed_blocks").args.args[-1]
    lines = text.splitlines(keepends=True)
    line = lines[last.end_lineno - 1]
    cut = len(line.encode()[: last.end_col_offset].decode())
    lines[last.end_lineno - 1] = line[:cut] + ", max_cache_hit_length: int = 0" + line[cut:]
    single = "v1/core/single_type_kv_cache_manager.py"
    single_text = (installed / single).read_text()
    free = _def(single_text, "SingleTypeKVCacheManager", "free").body[-1]
    single_lines = single_text.splitlines(keepends=True)
    single_lines.insert(free.lineno - 1, " " * free.col_offset + "self.freed_twice = None\n")
    edits = {manager: "".join(lines), single: "".join(single_lines)}
    tree = _copy_with(tmp_path, installed, edits)

    result = bump_report.report(tree)
    prefix = "vllm.v1.core."
    assert result.problems == [
        (
            "PATCHES",
            f"{prefix}kv_cache_manager.KVCacheManager.get_computed_blocks",
            "expected parameters ['self', 'request'], "
            "found ['self', 'request', 'max_cache_hit_length']",
        )
    ]
    [(target, diff)] = result.changed
    assert target == f"{prefix}single_type_kv_cache_manager.FullAttentionManager.free"
    assert "+        self.freed_twice = None" in diff.splitlines(), diff
    assert bump_report.main([str(tree), "--no-diff"]) == 1
