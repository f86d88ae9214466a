"""The package's import graph has no circle: every import in every module,
those inside functions included, points one way, between modules and between
the parts of the package (its top-level modules and subpackages)."""

import ast
import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rocketkv_vllm"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_files() -> dict[str, Path]:
    """Every module of the package and its file."""
    paths = [
        Path(d) / f
        for d, _, names in os.walk(PACKAGE, followlinks=True)  # kernels/ is a symlink
        for f in names
        if f.endswith(".py")
    ]
    return {module_name(p): p for p in paths}


def import_graph() -> dict[str, set[str]]:
    files = package_files()
    graph = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from pkg import mod`` names a module when mod is one
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    targets.add(full if full in files else node.module)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert "rocketkv_vllm.config" in graph["rocketkv_vllm.plan"]  # the graph is read
    assert "rocketkv_vllm.kernels.compact" in graph["rocketkv_vllm.ops.triton"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def part_of(name: str) -> str:
    """The part of the package a module belongs to: its top-level module or
    subpackage (a row of docs/design.md's module table)."""
    return ".".join(name.split(".")[:2])


def parts_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between the parts of the package."""
    parts: dict[str, set[str]] = {}
    for name, targets in graph.items():
        part = part_of(name)
        parts.setdefault(part, set()).update(part_of(t) for t in targets if part_of(t) != part)
    return parts


def test_parts_graph_joins_the_modules_of_a_part():
    graph = {"p": set(), "p.a": set(), "p.a.x": {"p.b"}, "p.b": {"p.a.y"}, "p.a.y": set()}
    parts = parts_graph(graph)
    assert parts == {"p": set(), "p.a": {"p.b"}, "p.b": {"p.a"}}
    assert find_cycle(graph) is None and find_cycle(parts) == ["p.a", "p.b", "p.a"]


def test_no_upward_import_between_the_parts_of_the_package():
    """The parts of the package (docs/design.md's module table) import each
    other one way only, none excepted: no part imports a part that imports
    it back, directly or not, though no module would import itself (as
    ``host_tier.connector`` importing ``engine``, which imports
    ``host_tier.pool``, once did)."""
    parts = parts_graph(import_graph())
    assert "rocketkv_vllm.host_tier" in parts["rocketkv_vllm.engine"]  # the graph is read
    assert "rocketkv_vllm.kv_cache" in parts["rocketkv_vllm.host_tier"]
    cycle = find_cycle(parts)
    assert cycle is None, "an upward import: " + " -> ".join(cycle)


KERNELS = "rocketkv_vllm.kernels"


def imported_modules(source: str, package: str) -> set[str]:
    """Every module a file's imports name (inside functions too), relative
    ones resolved against the file's ``package``; ``from pkg import name``
    counts as ``pkg.name`` (a module or a name in pkg: either way it reaches
    into pkg)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                # the file's package, minus level - 1 more parts
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def outside_kernels(names: set[str]) -> set[str]:
    """The package modules in ``names`` that are not kernels."""
    return {
        n
        for n in names
        if (n == "rocketkv_vllm" or n.startswith("rocketkv_vllm."))
        and n != KERNELS
        and not n.startswith(KERNELS + ".")
    }


def test_imported_modules_sees_every_import_form():
    source = """
import torch
import rocketkv_vllm.layout
from rocketkv_vllm import fp8_kv
from rocketkv_vllm.kernels._utils import cdiv
from . import compact
from .._x import y
def f():
    from rocketkv_vllm.algorithm.kt_fp8 import row_bytes
"""
    names = imported_modules(source, KERNELS)  # as in kernels/hsa_score.py
    assert outside_kernels(names) == {
        "rocketkv_vllm.layout",
        "rocketkv_vllm.fp8_kv",
        "rocketkv_vllm._x.y",
        "rocketkv_vllm.algorithm.kt_fp8.row_bytes",
    }


def test_kernels_are_leaves():
    """Nothing under kernels/ imports the package outside kernels/: the
    package imports the kernels, never the other way round."""
    kernels = PACKAGE / "kernels"
    paths = sorted(kernels.glob("*.py"))
    assert kernels / "kt_fp8.py" in paths  # the folder is read (through its symlink)
    reached = {}
    for path in paths:
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        bad = outside_kernels(imported_modules(path.read_text(), package))
        if bad:
            reached[path.name] = sorted(bad)
    assert not reached, f"kernels importing the rest of the package: {reached}"


OPS = "rocketkv_vllm.ops"


def vllm_imports(names: set[str]) -> list[str]:
    return sorted(n for n in names if n == "vllm" or n.startswith("vllm."))


def reached_from(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    """The modules importing ``start`` runs: those, every package module
    they import (inside functions too), and the packages above each."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(graph.get(name, ()))
        parent = name.rpartition(".")[0]
        if parent:
            todo.append(parent)
    return seen


def test_reached_from_follows_imports_and_parent_packages():
    graph = {"p": set(), "p.a": {"p.b"}, "p.b": {"q.c"}, "q": set(), "q.c": set(), "p.x": set()}
    assert reached_from(graph, {"p.a"}) == {"p", "p.a", "p.b", "q", "q.c"}


def test_ops_are_free_of_vllm():
    """Nothing under ops/ imports vllm, directly or through the package
    modules it imports: the stages (``ops.base`` and the Stage classes beside
    their launchers), ``ops`` and ``kernels`` run with only torch + triton."""
    files = package_files()
    graph = import_graph()
    ops = {n for n in files if n == OPS or n.startswith(OPS + ".")}
    assert {f"{OPS}.base", f"{OPS}.triton", f"{OPS}.cpu", f"{OPS}.pytorch"} <= ops
    reached = reached_from(graph, ops)
    assert "rocketkv_vllm.layout" in reached  # the imports are followed
    found = {}
    for name in sorted(reached):
        path = files[name]
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        bad = vllm_imports(imported_modules(path.read_text(), package))
        if bad:
            found[name] = bad
    assert not found, f"modules that ops/ imports (or ops/ itself) importing vllm: {found}"
