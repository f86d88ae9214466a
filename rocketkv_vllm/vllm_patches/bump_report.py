"""What another vLLM's source tree breaks or changes of ROCKETKV's two tables.

Reads a vLLM source tree (a directory: an unpacked wheel or sdist, or a git
checkout; the ``vllm/`` package or the folder that holds it) with ``ast``,
never importing or installing it, and reports:

- every ``PATCHES`` target and every ``RELIED_ON`` entry that the tree
  breaks, with what ``check`` would say at a ROCKETKV engine's start: a
  module or class gone (and where a class or function of that name is
  defined now), a method's parameters changed, an attribute gone, a name
  our subclasses add that vLLM now has too;
- every method ROCKETKV wraps (``PATCHES``) or overrides or replaces
  (``RELIED_ON`` "override", "replace") whose code changed since the vLLM
  the tables were written for: its fingerprint (``fingerprints``) differs,
  with a diff against that vLLM's method where its source is at hand
  (``--base``, by default the installed vLLM if it is that version).

Entries outside vLLM (torch, prometheus_client) are not read. The
``<platform>`` patches are read on the platforms ROCKETKV runs on
(``PLATFORMS``). ``--record`` prints ``fingerprints.py`` for a tree of
the supported vLLM, for a release that moves to a new vLLM.

``python scripts/vllm_bump_report.py PATH`` exits 0 when nothing is reported,
1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import hashlib
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rocketkv_vllm.vllm_patches import PATCHES, RELIED_ON
from rocketkv_vllm.vllm_patches.check import ABSENT_PROBLEM, assigned_pattern, params_mismatch

# The current platform's class, on the platforms ROCKETKV runs on.
PLATFORMS = (("vllm.platforms.cpu", "CpuPlatform"), ("vllm.platforms.cuda", "NvmlCudaPlatform"))

# Members a class gets from a base outside vLLM (parameters, or None).
_SYNTHESIZED = {
    "NamedTuple": {"_replace": None, "_asdict": ["self"], "_make": None, "_fields": None},
    "Enum": {"_member_map_": None, "_value2member_map_": None, "_member_names_": None},
}
_SYNTHESIZED["IntEnum"] = _SYNTHESIZED["StrEnum"] = _SYNTHESIZED["Enum"]

_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


# -- the source tree ----------------------------------------------------------------


@dataclass
class Module:
    name: str
    path: Path
    rel: str  # the path from the tree's root, as vllm/...
    lines: list[str]
    tree: ast.Module


@dataclass
class Definition:
    """Where a name is defined: a class or function node in a module."""

    module: Module
    node: ast.AST

    @property
    def where(self) -> str:
        return f"{self.module.rel}:{self.node.lineno}"


class SourceTree:
    """A vLLM package on disk, read with ``ast`` (nothing imported)."""

    def __init__(self, path: str | Path):
        root = Path(path)
        if (root / "vllm" / "__init__.py").is_file():
            root = root / "vllm"
        if root.name != "vllm" or not (root / "__init__.py").is_file():
            raise ValueError(f"{path}: no vllm package (vllm/__init__.py) there")
        self.root = root
        self._modules: dict[str, Module | None] = {}
        self._texts: dict[Path, str] | None = None

    def version(self) -> str:
        path = self.root / "_version.py"
        text = path.read_text() if path.is_file() else ""
        found = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)", text)
        return found.group(1) if found else "unknown"

    def module(self, name: str) -> Module | None:
        if name not in self._modules:
            self._modules[name] = self._read(name)
        return self._modules[name]

    def _read(self, name: str) -> Module | None:
        parts = name.split(".")
        if parts[0] != "vllm":
            return None
        base = self.root.joinpath(*parts[1:])
        paths = [base / "__init__.py"] + ([base.with_suffix(".py")] if parts[1:] else [])
        for path in paths:  # a package first, as Python finds it
            if path.is_file():
                rel = "vllm/" + path.relative_to(self.root).as_posix()
                stat = path.stat()
                lines, tree = _parsed(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
                return Module(name, path, rel, lines, tree)
        return None

    def is_module(self, name: str) -> bool:
        return self.module(name) is not None

    def defined_at(self, name: str, kind: str) -> list[str]:
        """Every file of the tree that defines a top-level class or function
        ``name`` (a text search: for a name the table no longer finds)."""
        if self._texts is None:
            self._texts = {p: p.read_text(errors="replace") for p in self.root.rglob("*.py")}
        pattern = re.compile(
            rf"^(?:async\s+def|def)\s+{re.escape(name)}\b"
            if kind == "def"
            else rf"^class\s+{re.escape(name)}\b",
            re.M,
        )
        return sorted(
            "vllm/" + p.relative_to(self.root).as_posix()
            for p, text in self._texts.items()
            if pattern.search(text)
        )


@functools.cache
def _parsed(path: str, mtime_ns: int, size: int) -> tuple[list[str], ast.Module]:
    """A file's lines and syntax tree, read once per process (the trees
    the report compares share most files)."""
    text = Path(path).read_text()
    return text.splitlines(), ast.parse(text, path)


def _statements(body: list[ast.stmt]):
    """A module's or class's statements, those inside if/try/with included."""
    for stmt in body:
        yield stmt
        for block in ("body", "orelse", "finalbody"):
            if isinstance(stmt, ast.If | ast.Try | ast.With) and getattr(stmt, block, None):
                yield from _statements(getattr(stmt, block))
        for handler in getattr(stmt, "handlers", ()):
            yield from _statements(handler.body)


def _bound_names(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [
            n.id
            for target in stmt.targets
            for n in ast.walk(target)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        ]
    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
        return [stmt.target.id]
    return []


def _absolute(module: Module, stmt: ast.ImportFrom) -> str:
    if not stmt.level:
        return stmt.module or ""
    package = module.name.split(".")
    if module.path.name != "__init__.py":
        package = package[:-1]
    package = package[: len(package) - stmt.level + 1]
    return ".".join(package + ([stmt.module] if stmt.module else []))


class Resolver:
    """Names, classes and their members in a ``SourceTree``."""

    def __init__(self, tree: SourceTree):
        self.tree = tree

    def lookup(self, module_name: str, name: str, depth: int = 0) -> Definition | str | None:
        """What ``name`` is in the module: a Definition, the dotted name of
        something outside the tree (or of a module), or None."""
        module = self.tree.module(module_name)
        if module is None or depth > 20:
            return None
        found, stars = None, []
        for stmt in _statements(module.tree.body):
            if name in _bound_names(stmt):
                found = Definition(module, stmt)
            elif isinstance(stmt, ast.ImportFrom):
                source = _absolute(module, stmt)
                for alias in stmt.names:
                    if alias.name == "*":
                        stars.append(source)
                    elif (alias.asname or alias.name) == name:
                        found = ("from", source, alias.name)
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname == name:
                        found = ("module", alias.name, None)
                    elif alias.asname is None and alias.name.split(".")[0] == name:
                        found = ("module", name, None)
        if isinstance(found, tuple):
            how, source, original = found
            if how == "module":
                return source
            if self.tree.is_module(f"{source}.{original}"):
                return f"{source}.{original}"
            if self.tree.is_module(source):
                return self.lookup(source, original, depth + 1)
            return f"{source}.{original}"  # outside the tree
        if found is not None:
            return self._alias(found, depth)
        for source in stars:
            result = self.lookup(source, name, depth + 1)
            if result is not None:
                return result
        return None

    def _alias(self, found: Definition, depth: int) -> Definition | str | None:
        """``Name = Other`` at module level: what ``Other`` is."""
        node = found.node
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            return self.lookup(found.module.name, node.value.id, depth + 1)
        return found

    def expression(self, module: Module, expr: ast.expr) -> Definition | str | None:
        """A class expression (a base): Name, dotted attribute, subscript."""
        if isinstance(expr, ast.Subscript):
            return self.expression(module, expr.value)
        if isinstance(expr, ast.Name):
            result = self.lookup(module.name, expr.id)
            return expr.id if result is None else result
        if isinstance(expr, ast.Attribute):
            owner = self.expression(module, expr.value)
            if isinstance(owner, str) and self.tree.is_module(owner):
                result = self.lookup(owner, expr.attr)
                return f"{owner}.{expr.attr}" if result is None else result
            return f"{owner if isinstance(owner, str) else '?'}.{expr.attr}"
        return None

    def mro(self, cls: Definition) -> tuple[list[Definition], list[str]]:
        """The class and its bases in the tree (depth first), and the names
        of its bases outside the tree."""
        classes, outside, todo = [], [], [cls]
        while todo:
            current = todo.pop(0)
            if any(c.node is current.node for c in classes):
                continue
            classes.append(current)
            for base in current.node.bases:
                found = self.expression(current.module, base)
                if isinstance(found, Definition) and isinstance(found.node, ast.ClassDef):
                    todo.append(found)
                elif found is not None:
                    outside.append(found if isinstance(found, str) else "?")
        return classes, outside


def _params(node: ast.AST) -> list[str]:
    a = node.args
    names = [p.arg for p in a.posonlyargs + a.args]
    names += [a.vararg.arg] if a.vararg else []
    names += [p.arg for p in a.kwonlyargs]
    return names + ([a.kwarg.arg] if a.kwarg else [])


def _is_dataclass(node: ast.ClassDef) -> bool:
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


def _dataclass_fields(node: ast.ClassDef) -> list[str]:
    fields = []
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            annotation = ast.unparse(stmt.annotation)
            value = ast.unparse(stmt.value) if stmt.value else ""
            if "ClassVar" in annotation or "KW_ONLY" in annotation or "init=False" in value:
                continue
            fields.append(stmt.target.id)
    return fields


@dataclass
class Member:
    """A class member as the tree defines it."""

    node: ast.AST | None  # its def, its assignment, or None (synthesized)
    module: Module | None
    params: list[str] | None  # a callable's parameters, where known


def _own_member(cls: Definition, name: str) -> Member | None:
    found = None
    for stmt in _statements(cls.node.body):
        if name in _bound_names(stmt):
            params = _params(stmt) if isinstance(stmt, _FUNCTIONS) else None
            found = Member(stmt, cls.module, params)
    return found


def _first_line(node: ast.AST) -> int:
    """A definition's first line, its decorators' included."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", ())])


def _function_source(module: Module, node: ast.AST) -> str:
    return "\n".join(module.lines[_first_line(node) - 1 : node.end_lineno])


def _methods_source(cls: Definition) -> str:
    """The source of every function defined in the class itself."""
    return "\n".join(
        _function_source(cls.module, stmt)
        for stmt in _statements(cls.node.body)
        if isinstance(stmt, _FUNCTIONS)
    )


def _annotated(cls: Definition, name: str) -> bool:
    return any(
        isinstance(s, ast.AnnAssign) and getattr(s.target, "id", None) == name
        for s in _statements(cls.node.body)
    )


# -- checking the tables ---------------------------------------------------------------


@dataclass
class Target:
    """One name the tables rely on, to look up in a tree."""

    label: str  # as the table names it (a <platform> patch: its concrete class)
    module: str
    owner: str
    name: str


@dataclass
class Report:
    version: str
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # table, target, why
    changed: list[tuple[str, str]] = field(default_factory=list)  # target, diff or note
    skipped: list[str] = field(default_factory=list)  # outside vLLM

    @property
    def clean(self) -> bool:
        return not self.problems and not self.changed


class Reader:
    """Answers the questions ``check`` asks of the installed vLLM, of a tree."""

    def __init__(self, tree: SourceTree):
        self.tree = tree
        self.names = Resolver(tree)

    def owner(self, target: Target) -> Definition | Module | str:
        """The class (or module) a target lives in, or why it is not there."""
        module = self.tree.module(target.module)
        if module is None:
            where = self._elsewhere(target.owner or target.name, "class" if target.owner else "def")
            return f"module {target.module} is gone{where}"
        if not target.owner:
            return module
        found = self.names.lookup(target.module, target.owner)
        if isinstance(found, Definition) and isinstance(found.node, ast.ClassDef):
            return found
        where = self._elsewhere(target.owner, "class")
        return f"class {target.owner} is not in {target.module} ({module.rel}){where}"

    def _elsewhere(self, name: str, kind: str) -> str:
        places = self.tree.defined_at(name, kind)
        shown = ", ".join(places[:4]) + (", ..." if len(places) > 4 else "")
        return f"; {kind} {name} is defined in {shown}" if places else ""

    def member(self, owner: Definition | Module, name: str) -> Member | None:
        """``name`` on the class (its bases in the tree included) or module."""
        if isinstance(owner, Module):
            found = self.names.lookup(owner.name, name)
            if isinstance(found, Definition):
                params = _params(found.node) if isinstance(found.node, _FUNCTIONS) else None
                return Member(found.node, found.module, params)
            return Member(None, None, None) if isinstance(found, str) else None
        classes, outside = self.names.mro(owner)
        for cls in classes:
            found = _own_member(cls, name)
            if found is not None:
                return found
        if name == "__init__":
            dataclasses = [c for c in classes if _is_dataclass(c.node)]
            if dataclasses:
                fields = [f for c in reversed(dataclasses) for f in _dataclass_fields(c.node)]
                return Member(None, None, ["self", *fields])
        for base in outside:
            synthesized = _SYNTHESIZED.get(base.rsplit(".", 1)[-1], {})
            if name in synthesized:
                return Member(None, None, synthesized[name])
        return None

    def has_attr(self, owner: Definition | Module, name: str) -> bool:
        """As ``check._has_attr``: a member, an annotation, or an assignment
        ``self.<name> = ...`` in a method of the class or a base."""
        if self.member(owner, name) is not None:
            return True
        if isinstance(owner, Module):
            return False
        assigned = assigned_pattern(name)
        classes, _ = self.names.mro(owner)
        return any(
            _annotated(cls, name) or assigned.search(_methods_source(cls)) for cls in classes
        )

    def has_slots(self, owner: Definition) -> bool:
        classes, _ = self.names.mro(owner)
        return any(_own_member(cls, "__slots__") is not None for cls in classes)

    def method(self, target: Target) -> tuple[Member | None, str | None]:
        """The target's method, or why it is not there."""
        owner = self.owner(target)
        if isinstance(owner, str):
            return None, owner
        member = self.member(owner, target.name)
        if member is None:
            return None, self.not_found(owner, target.name)
        return member, None

    def not_found(self, owner: Definition | Module, name: str) -> str:
        """Not found, and for a module's function where it is defined now."""
        return "not found" + (self._elsewhere(name, "def") if isinstance(owner, Module) else "")


def _params_problem(member: Member, params, exact: bool, also=()) -> str | None:
    if params is None:
        return None
    if member.params is None:
        return None if member.node is None else "not a function (its parameters unknown)"
    problem = params_mismatch(member.params, list(params), exact)
    if problem is not None:
        return problem
    missing = [p for p in also if p not in member.params]
    return f"expected parameters {missing} among {member.params}" if missing else None


def patch_targets() -> list[tuple[object, Target]]:
    """Each patch with the class it patches (``<platform>``: one per platform)."""
    targets = []
    for patch in PATCHES:
        if patch.owner == "<platform>":
            for module, owner in PLATFORMS:
                label = f"{module}.{owner}.{patch.name}"
                targets.append((patch, Target(label, module, owner, patch.name)))
        else:
            targets.append((patch, Target(patch.target, patch.module, patch.owner, patch.name)))
    return targets


def relied_target(entry) -> Target:
    return Target(entry.target, entry.module, entry.owner, entry.name)


def patch_problem(reader: Reader, patch, target: Target) -> str | None:
    """As ``check.signature_problem`` at install, read from the tree."""
    member, why = reader.method(target)
    if member is None:
        return why
    return _params_problem(member, patch.params, patch.exact, patch.also)


def relied_problem(reader: Reader, entry) -> str | None:
    """As ``check.relied_problem``, read from the tree."""
    target = relied_target(entry)
    owner = reader.owner(target)
    if isinstance(owner, str):
        return owner
    if entry.kind == "attr":
        return None if reader.has_attr(owner, entry.name) else "not found"
    if entry.kind == "absent":
        return ABSENT_PROBLEM if reader.has_attr(owner, entry.name) else None
    if entry.kind == "swap":
        if reader.has_slots(owner):
            return "defines __slots__: its instances cannot become a subclass with attributes"
        return None
    member = reader.member(owner, entry.name)
    if member is None:
        return reader.not_found(owner, entry.name)
    problem = _params_problem(member, entry.params, entry.exact)
    if problem is not None or entry.kind != "replace":
        return problem
    if reader.has_slots(owner):
        return "its instances have no __dict__ (the method cannot be replaced)"
    module, cls, method = entry.caller.rsplit(".", 2)
    caller, why = reader.method(Target(entry.caller, module, cls, method))
    if caller is None or caller.node is None:
        return f"{entry.caller}: {why or 'not found'}"
    if f".{entry.name}(" not in _function_source(caller.module, caller.node):
        return f"{entry.caller} no longer calls it through the instance"
    return None


def fingerprint(member: Member) -> str:
    """A method's code, as a hash: its lines stripped, without blank lines,
    comment lines or its docstring (a change of formatting or comments is
    no change)."""
    node = member.node
    skip = set()
    body = getattr(node, "body", [])
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            skip = set(range(body[0].lineno, body[0].end_lineno + 1))
    start = _first_line(node)
    lines = [
        line.strip()
        for number, line in enumerate(member.module.lines[start - 1 : node.end_lineno], start)
        if number not in skip
    ]
    code = "\n".join(line for line in lines if line and not line.startswith("#"))
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def wrapped_targets() -> list[Target]:
    """Every vLLM method ROCKETKV wraps, overrides or replaces."""
    targets = [target for _, target in patch_targets()]
    kinds = ("override", "replace")
    targets += [relied_target(e) for e in RELIED_ON if e.kind in kinds and _in_vllm(e.module)]
    return targets


def _in_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def fingerprints(tree: SourceTree) -> dict[str, str]:
    """The fingerprint of every wrapped method the tree has, by target."""
    reader, found = Reader(tree), {}
    for target in wrapped_targets():
        member, _ = reader.method(target)
        if member is not None and member.node is not None:
            found[target.label] = fingerprint(member)
    return found


def installed_tree() -> Path | None:
    """The installed vLLM's package folder (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def report(path, base=None, recorded: dict[str, str] | None = None, diffs: bool = True) -> Report:
    """Everything the tree at ``path`` breaks or changes of the tables.
    ``base``: a tree of the vLLM the fingerprints were recorded on, to diff
    against (None: the installed vLLM, when it is that one)."""
    from rocketkv_vllm.vllm_patches.fingerprints import FINGERPRINTS

    recorded = FINGERPRINTS if recorded is None else recorded
    tree = SourceTree(path)
    reader = Reader(tree)
    result = Report(tree.version())
    broken = set()
    for patch, target in patch_targets():
        why = patch_problem(reader, patch, target)
        if why is not None:
            result.problems.append(("PATCHES", target.label, why))
            broken.add(target.label)
    for entry in RELIED_ON:
        if not _in_vllm(entry.module):
            result.skipped.append(entry.target)
            continue
        why = relied_problem(reader, entry)
        if why is not None:
            result.problems.append(("RELIED_ON", entry.target, why))
            broken.add(entry.target)
    bases: list[Reader | None] = []  # the tree to diff against, read once if needed
    for target in wrapped_targets():
        if target.label in broken:
            continue
        if target.label not in recorded:
            note = "no recorded fingerprint: run this report with --record on the supported vLLM"
            result.problems.append(("fingerprints", target.label, note))
            continue
        member, _ = reader.method(target)
        if member is None or member.node is None or fingerprint(member) == recorded[target.label]:
            continue
        if diffs and not bases:
            bases.append(_base_reader(base, recorded))
        diff = _diff(bases[0], target, member, recorded) if diffs else ""
        result.changed.append((target.label, diff))
    stale = set(recorded) - {t.label for t in wrapped_targets()}
    for label in sorted(stale):
        result.problems.append(("fingerprints", label, "recorded, but in neither table"))
    return result


def _base_reader(base, recorded: dict[str, str]) -> Reader | None:
    path = base if base is not None else installed_tree()
    if path is None:
        return None
    try:
        reader = Reader(SourceTree(path))
    except ValueError:
        return None
    # Only a tree of the recorded vLLM: its methods are the ones recorded.
    if base is None and fingerprints(reader.tree) != recorded:
        return None
    return reader


def _diff(base: Reader | None, target: Target, member: Member, recorded) -> str:
    if base is None:
        return ""
    old, _ = base.method(target)
    if old is None or old.node is None or fingerprint(old) != recorded[target.label]:
        return ""
    before = _function_source(old.module, old.node).splitlines()
    after = _function_source(member.module, member.node).splitlines()
    lines = difflib.unified_diff(
        before,
        after,
        f"{base.tree.version()} {old.module.rel}:{old.node.lineno}",
        f"{member.module.rel}:{member.node.lineno}",
        n=2,
        lineterm="",
    )
    return "\n".join(lines)


def render(result: Report, path, diffs: bool = True) -> str:
    from rocketkv_vllm.vllm_patches.fingerprints import VLLM_VERSION

    out = [
        f"vLLM {result.version} at {path}, against the tables written for vLLM {VLLM_VERSION}:",
        f"{len(PATCHES)} patches, {len(RELIED_ON)} relied-on entries "
        f"({len(result.skipped)} outside vLLM, not read).",
    ]
    for table in ("PATCHES", "RELIED_ON", "fingerprints"):
        rows = [(target, why) for t, target, why in result.problems if t == table]
        if rows:
            out += ["", f"{table}: {len(rows)} broken"]
            out += [f"  {target}: {why}" for target, why in rows]
    if result.changed:
        out += ["", f"changed code of wrapped or overridden methods: {len(result.changed)}"]
        for target, diff in result.changed:
            note = "" if diff or not diffs else " (no source of the recorded vLLM to diff: --base)"
            out.append(f"  {target}{note}")
            if diff and diffs:
                out += [f"    {line}" for line in diff.splitlines()]
    if result.clean:
        out += ["", "nothing to port."]
    return "\n".join(out)


def record(path) -> str:
    """The text of ``fingerprints.py`` for the tree at ``path``."""
    tree = SourceTree(path)
    found = fingerprints(tree)
    missing = [t.label for t in wrapped_targets() if t.label not in found]
    if missing:
        raise ValueError(f"not in {path}: {missing}")
    rows = "".join(f'    "{label}": "{value}",\n' for label, value in sorted(found.items()))
    return (
        "# ruff: noqa: E501\n"
        f'"""Generated by ``scripts/vllm_bump_report.py --record`` on vLLM {tree.version()}:\n'
        "the fingerprint (``bump_report.fingerprint``) of each vLLM method ROCKETKV\n"
        'wraps, overrides or replaces, as that vLLM writes it. Do not edit."""\n\n'
        f'VLLM_VERSION = "{tree.version()}"\n\n'
        f"FINGERPRINTS: dict[str, str] = {{\n{rows}}}\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", help="a vLLM source tree (its vllm/ package or the folder above)")
    parser.add_argument(
        "--base", help="a tree of the recorded vLLM to diff changed methods against"
    )
    parser.add_argument("--no-diff", action="store_true", help="name changed methods only")
    parser.add_argument(
        "--record", action="store_true", help="print fingerprints.py for this tree instead"
    )
    args = parser.parse_args(argv)
    try:
        if args.record:
            print(record(args.tree), end="")
            return 0
        result = report(args.tree, args.base, diffs=not args.no_diff)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    print(render(result, args.tree, diffs=not args.no_diff))
    return 0 if result.clean else 1
