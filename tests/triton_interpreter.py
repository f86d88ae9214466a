"""A faster Triton interpreter for the tests (TRITON_INTERPRET=1 only).

Triton's interpreter patches ``triton.language`` for a launch
(``GridExecutor.__call__``) and then again at every call of a
``@triton.jit`` helper inside the kernel (``InterpretedFunction.__call__``),
never restoring the inner patches. The inner ones change nothing: builtins
already patched are skipped (their wrappers are no longer builtins) and the
rest is set to equivalent closures. Profiled on the eager Stage 2 warm-up
test, that re-patching (``inspect.getmembers`` over ``tl``, ``tl.tensor``,
``tl.math`` per helper call) was 92 of 292 s. ``speed_up`` skips a helper's
patching while a launch whose patch already covers the helper's language
modules is running. Outputs are unchanged: every interpreted test compares
against a PyTorch oracle.
"""

import functools
import inspect
import os


def speed_up() -> bool:
    """Install the skip; returns whether it was installed (interpreter mode
    on and Triton's interpreter has the functions it wraps)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    needed = ("_patch_lang", "_LangPatchScope", "GridExecutor", "InterpretedFunction")
    if not all(hasattr(interpreter, name) for name in needed):
        return False
    if getattr(interpreter._patch_lang, "_rocketkv_skip", False):
        return True

    original_patch = interpreter._patch_lang
    original_launch = interpreter.GridExecutor.__call__
    patched: list[set[int]] = []  # per running launch: ids of the patched language modules

    langs_of: dict = {}

    def _langs(fn) -> set[int]:
        if fn not in langs_of:
            langs_of[fn] = {
                id(value)
                for value in fn.__globals__.values()
                if inspect.ismodule(value) and value in (tl, tl.core)
            }
        return langs_of[fn]

    def patch_lang(fn):
        langs = _langs(fn)
        if patched and langs <= patched[-1]:
            return interpreter._LangPatchScope()
        scope = original_patch(fn)
        if patched:
            patched[-1] |= langs
        return scope

    @functools.wraps(original_launch)  # __wrapped__: the grid loop's code stays reachable
    def launch(self, *args, **kwargs):
        patched.append(set())
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            patched.pop()

    patch_lang._rocketkv_skip = True
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch
    return True
