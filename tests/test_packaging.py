"""The package as users install it: a wheel built from the tree holds every
source module and imports from a non-editable install (no engine started)."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rocketkv_vllm"
ORACLES = ROOT / "tests" / "reference"


def source_modules() -> set[str]:
    """Every module and package data file of the tree (kernels/ and configs/
    through their symlinks), as paths inside a wheel."""
    found = set()
    for dirpath, _, files in os.walk(PACKAGE, followlinks=True):
        rel = Path(dirpath).relative_to(ROOT)
        if "__pycache__" in rel.parts:
            continue
        for name in files:
            if name.endswith((".py", ".cpp", ".yaml")):
                found.add((rel / name).as_posix())
    return found


def test_wheel_holds_every_module_and_imports_without_editable_install(tmp_path):
    # Built from a clean copy: a build/ left in the checkout would hand
    # setuptools stale copies of modules its package list misses.
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "results", "eval"
        ),
    )
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["--disable-pip-version-check", "-w", str(wheels), str(src)],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("rocketkv_vllm-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "rocketkv_vllm.plugin:register" in zf.read(entry_points).decode()
    expected = source_modules()
    assert "rocketkv_vllm/backend/impl.py" in expected  # the walk itself works
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    assert not any(n.startswith("rocketkv_eval/") for n in names)  # not in the product
    # The test oracles (tests/reference/) stay out of the product, under any path.
    oracles = {p.name for p in ORACLES.glob("*.py") if p.name != "__init__.py"}
    assert "paged.py" in oracles  # the glob itself works
    shipped = {n for n in names if n.endswith(".py") and n.rsplit("/", 1)[-1] in oracles}
    assert not shipped, f"test oracles in the wheel: {sorted(shipped)}"
    assert not any(n.startswith(("tests/", "reference/")) for n in names)

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
        + ["--disable-pip-version-check", "--target", str(target), str(wheel)],
        check=True,
        cwd=tmp_path,
    )
    # Import every submodule from the scratch install, not from this checkout
    # (cwd elsewhere; the target first on sys.path, before the editable finder).
    check = """
import importlib, importlib.util, pkgutil, sys
import rocketkv_vllm
root = rocketkv_vllm.__path__[0]
assert root.startswith(sys.argv[1]), root
names = [m.name for m in pkgutil.walk_packages(rocketkv_vllm.__path__, "rocketkv_vllm.")]
assert "rocketkv_vllm.paged" not in names  # the oracle lives in tests/reference
assert importlib.util.find_spec("rocketkv_vllm.paged") is None
for name in names:
    module = importlib.import_module(name)
    assert module.__file__.startswith(sys.argv[1]), (name, module.__file__)
from rocketkv_vllm.backend import RocketKVBackend
from rocketkv_vllm.engine import BACKEND_PATH
assert BACKEND_PATH == RocketKVBackend.__module__ + "." + RocketKVBackend.__name__
from importlib import resources
assert resources.files("rocketkv_vllm.configs").joinpath("budget-256.yaml").is_file()
assert resources.files("rocketkv_vllm.kernels").joinpath("cpu_hsa_decode.cpp").is_file()
print(len(names))
"""
    env = dict(os.environ, PYTHONPATH=str(target))
    result = subprocess.run(
        [sys.executable, "-c", check, str(target)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    wheel_modules = {n for n in names if n.endswith(".py") and not n.endswith("__init__.py")}
    assert int(result.stdout.split()[-1]) >= len(wheel_modules)
