"""The startup checker: installs the patch table on the installed vLLM and
refuses ROCKETKV engines whose vLLM is not the one the tables were written
for.

- ``install`` wraps each ``Patch`` target once per process, after checking
  the wrapped method's parameters against the ones its wrapper was written
  for (``signature_problem``); a mismatch installs nothing for that entry
  and is recorded.
- ``relied_problems`` checks every ``RELIED_ON`` entry (``relied_problem``).
- ``require`` (run by the wrappers at a ROCKETKV engine's start) raises,
  naming each, if a patch could not be installed, a step of
  ``plugin.register`` failed (``record_failure``) or a ``RELIED_ON`` entry
  fails; engines with other backends never run it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
import types
from collections.abc import Callable
from dataclasses import dataclass

from rocketkv_vllm.vllm_patches.relied import RELIED_ON, Relied

_MARK = "__rocketkv_patch__"


@dataclass(frozen=True)
class Patch:
    module: str
    owner: str  # a class in the module, or "<platform>" (the current platform's)
    name: str
    params: tuple[str, ...]  # the original's parameters (names) the wrapper relies on
    wrap: Callable[[Callable], Callable]  # original -> replacement
    why: str
    classmethod: bool = False
    exact: bool = True  # params is the whole list, not just its start
    also: tuple[str, ...] = ()  # parameters the wrapper uses beyond the leading ones

    @property
    def target(self) -> str:
        return f"{self.module}.{self.owner}.{self.name}"


def params_mismatch(actual: list[str], expected: list[str], exact: bool) -> str | None:
    """Why a callable's parameter names ``actual`` are not ``expected`` (the
    whole list, or its start where not ``exact``), or None."""
    if exact and actual != expected:
        return f"expected parameters {expected}, found {actual}"
    if not exact and actual[: len(expected)] != expected:
        return f"expected parameters starting {expected}, found {actual}"
    return None


# -- RELIED_ON ------------------------------------------------------------------


def _resolve(module: str, owner: str):
    mod = importlib.import_module(module)
    return getattr(mod, owner) if owner else mod


@functools.cache
def _function_source(func) -> str:
    try:
        return inspect.getsource(func)
    except (OSError, TypeError):
        return ""


def _methods_source(klass) -> str:
    """The source of every function defined in ``klass`` itself."""
    parts = []
    for attr in vars(klass).values():
        func = getattr(attr, "__func__", attr)
        func = getattr(func, "fget", func)  # a property's getter
        if isinstance(func, types.FunctionType):
            parts.append(_function_source(func))
    return "\n".join(parts)


def assigned_pattern(name: str) -> re.Pattern:
    """``self.<name> = ...`` / ``self.<name>: ... =`` in a method's source:
    where a class sets an instance attribute it cannot show."""
    return re.compile(rf"\bself\.{re.escape(name)}\s*(?::[^=]+?)?=(?!=)")


def _has_attr(owner, name: str) -> bool:
    if isinstance(owner, types.ModuleType):
        return hasattr(owner, name)
    try:
        inspect.getattr_static(owner, name)
        return True
    except AttributeError:
        pass
    assigned = assigned_pattern(name)
    for klass in owner.__mro__:
        if klass is object:
            continue
        if name in vars(klass).get("__annotations__", {}):
            return True
        if assigned.search(_methods_source(klass)):
            return True
    return False


def _params_problem(func, params: tuple[str, ...], exact: bool) -> str | None:
    try:
        actual = list(inspect.signature(func).parameters)
    except (TypeError, ValueError) as e:
        return f"no signature ({e})"
    return params_mismatch(actual, list(params), exact)


def _callable(owner, name: str):
    if isinstance(owner, types.ModuleType):
        attr = getattr(owner, name)
    else:
        attr = inspect.getattr_static(owner, name)
    func = attr.__func__ if isinstance(attr, classmethod | staticmethod) else attr
    return func if callable(func) else None


ABSENT_PROBLEM = "vLLM's class has it now: ours and vLLM's would clobber each other"


def relied_problem(entry: Relied) -> str | None:
    """Why the installed vLLM lacks what ``entry`` relies on, or None."""
    try:
        owner = _resolve(entry.module, entry.owner)
        if entry.kind == "attr":
            return None if _has_attr(owner, entry.name) else "not found"
        if entry.kind == "absent":
            if _has_attr(owner, entry.name):
                return ABSENT_PROBLEM
            return None
        if entry.kind == "swap":
            probe = type("_SwapProbe", (owner,), {})
            obj = object.__new__(owner)
            obj.__class__ = probe
            obj._rocketkv_probe = True  # the subclass adds attributes
            return None
        func = _callable(owner, entry.name)
        if func is None:
            return "not callable"
        if entry.params is not None:
            problem = _params_problem(func, entry.params, entry.exact)
            if problem is not None:
                return problem
        if entry.kind == "replace":
            if not owner.__dictoffset__:
                return "its instances have no __dict__ (the method cannot be replaced)"
            module, cls, method = entry.caller.rsplit(".", 2)
            caller = _callable(_resolve(module, cls), method)
            if f".{entry.name}(" not in inspect.getsource(caller):
                return f"{entry.caller} no longer calls it through the instance"
        return None
    except Exception as e:  # noqa: BLE001 -- any failure is a refusal, named
        return f"{type(e).__name__}: {e}"


def relied_problems() -> dict[str, str]:
    """Every ``RELIED_ON`` entry the installed vLLM fails, by target."""
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    problems = {}
    for entry in RELIED_ON:
        if entry.platform == "cpu" and not cpu:
            continue
        problem = relied_problem(entry)
        if problem is not None:
            problems[entry.target] = f"{problem} (relied on by {entry.used_by}: {entry.why})"
    return problems


# -- PATCHES and the startup check -----------------------------------------------

_failures: dict[str, str] = {}  # target or register step -> why it failed
_relied_checked = False  # relied_problems() added to _failures (once per process)


def _owner(patch: Patch):
    module = importlib.import_module(patch.module)
    if patch.owner == "<platform>":
        return type(module.current_platform)
    return getattr(module, patch.owner)


def _function(owner, name: str):
    attr = inspect.getattr_static(owner, name)
    return attr.__func__ if isinstance(attr, classmethod) else attr


def signature_problem(patch: Patch, func: Callable) -> str | None:
    """Why ``func`` is not the method this patch was written for, or None."""
    actual = list(inspect.signature(func).parameters)
    problem = params_mismatch(actual, list(patch.params), patch.exact)
    if problem is not None:
        return problem
    missing = [p for p in patch.also if p not in actual]
    if missing:
        return f"expected parameters {missing} among {actual}"
    return None


def _install_one(patch: Patch) -> None:
    owner = _owner(patch)
    current = _function(owner, patch.name)
    if getattr(current, _MARK, False):
        return
    problem = signature_problem(patch, current)
    if problem is not None:
        _failures[patch.target] = problem
        return
    replacement = patch.wrap(current)
    setattr(replacement, _MARK, True)
    replacement.__wrapped__ = current
    setattr(owner, patch.name, classmethod(replacement) if patch.classmethod else replacement)


def install(patches: tuple[Patch, ...]) -> None:
    """Install every patch once in this process (idempotent)."""
    for patch in patches:
        try:
            _install_one(patch)
        except Exception as e:  # noqa: BLE001 -- recorded, refused at startup
            _failures[patch.target] = f"{type(e).__name__}: {e}"


def record_failure(what: str, why: str) -> None:
    """Remember what failed (a step of ``plugin.register``): ROCKETKV engines
    then refuse to start, naming it (``require``)."""
    _failures[what] = why


def require() -> None:
    """Raise, naming each, if any patch could not be installed, any step of
    ``plugin.register`` failed, or any ``RELIED_ON`` entry fails on the
    installed vLLM (a ROCKETKV engine needs all). The ``RELIED_ON`` check runs
    once per process, on the first call."""
    global _relied_checked
    if not _relied_checked:
        _failures.update(relied_problems())
        _relied_checked = True
    if _failures:
        import vllm

        lines = "; ".join(f"{target}: {why}" for target, why in _failures.items())
        raise RuntimeError(
            f"ROCKETKV cannot run on vLLM {vllm.__version__}: it relies on vLLM "
            f"internals that are not what it was written for, or its plugin failed "
            f"to register ({lines}). This ROCKETKV release supports vLLM 0.32."
        )


def installed(patch: Patch) -> bool:
    return bool(getattr(_function(_owner(patch), patch.name), _MARK, False))
