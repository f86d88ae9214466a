"""Reading a compiled kernel's PTX (no import side effects: the compile
check's ``compile_kernels`` drops TRITON_INTERPRET when imported, this does
not, so tests import it in process)."""

from __future__ import annotations

_MEMORY_SPACES_BEFORE_WAIT = ("param", "shared", "local", "const")


def grid_wait_first(ptx: str) -> bool | None:
    """Whether the PTX's ``griddepcontrol.wait`` comes before its first
    global memory access (load, store, atomic; parameters, shared and local
    memory excepted), so a PDL launch touches nothing of the kernels before
    it until they are done. None: no wait in the kernel."""
    wait = access = None
    for n, line in enumerate(ptx.splitlines()):
        code = line.split("//")[0].strip()
        if code.startswith("@"):  # a predicate
            code = code.split(None, 1)[1] if " " in code else ""
        op = code.split(None, 1)[0] if code else ""
        parts = op.split(".")
        if op.startswith("griddepcontrol.wait") and wait is None:
            wait = n
        elif parts[0] in ("ld", "st", "atom", "red", "cp", "prefetch") and len(parts) > 1:
            if access is None and not parts[1].startswith(_MEMORY_SPACES_BEFORE_WAIT):
                access = n
    if wait is None:
        return None
    return access is None or wait < access
