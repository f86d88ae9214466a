"""Every change ROCKETKV makes to vLLM, and every vLLM internal it relies on.

vLLM gives attention backends no say in request admission, scheduling or
the model runners, and no way to learn each request's prompt length or own
budget. ROCKETKV therefore wraps a few vLLM methods (``PATCHES``). Each
wrapper:

- calls the original and adds only what ROCKETKV needs, delegating the work
  to the module named in the entry (``engine``, ``state``, ``kv_cache``,
  ``metrics``, ``backend.graphs``);
- passes everything through untouched for engines with another backend
  (one exception, for every engine on vLLM's CPU build: ``--kv-offloading-size``
  selects the host-tier connector, ``host_tier``);
- is installed once per process by ``install()`` (from ``plugin.register``),
  after checking the wrapped method's parameters against the ones it was
  written for. A mismatch (another vLLM version) installs nothing for that
  entry and makes every ROCKETKV engine refuse to start with an error naming
  the method and the vLLM version (``require``); engines with other
  backends are not affected.

Besides the table, one name is added to vLLM's backend enum:
``AttentionBackendEnum["ROCKETKV"]`` is an alias of its ``CUSTOM`` member
(``alias_backend_name``).

A second table, ``RELIED_ON``, lists every other vLLM internal the package
relies on without wrapping it: private attributes and methods it reads or
calls, the methods of vLLM classes it overrides (a rename in vLLM would make
vLLM silently stop calling the override), the host tier's runtime class swap
and its replacement of a coordinator method. ``require()`` checks them all
once per process (``relied_problems``) and refuses a ROCKETKV engine naming
every one that fails; engines with other backends never run the check.

``plugin.register`` records a failure of any of its steps here too
(``record_failure``) and never raises, so a broken ROCKETKV stops only
ROCKETKV engines.

The modules, one job each (a vLLM version bump edits one at a time):

- ``startup``, ``frontend``, ``scheduler``, ``model_runner``, ``nixl``: the wrappers,
  by what they patch in vLLM, each with its rows of ``PATCHES``;
- ``relied``: the ``RELIED_ON`` table, as data;
- ``check``: the startup checker (install, ``require``, the failure record);
- ``bump_report``: what a new vLLM's source tree breaks or changes of both
  tables (``scripts/vllm_bump_report.py``), against the recorded
  ``fingerprints`` of the vLLM methods ROCKETKV wraps or overrides.
"""

from __future__ import annotations

from rocketkv_vllm.vllm_patches import check, frontend, model_runner, nixl, scheduler, startup
from rocketkv_vllm.vllm_patches.check import (
    Patch,
    installed,
    record_failure,
    relied_problem,
    relied_problems,
    require,
    signature_problem,
)
from rocketkv_vllm.vllm_patches.relied import RELIED_ON, Relied
from rocketkv_vllm.vllm_patches.startup import alias_backend_name

PATCHES: tuple[Patch, ...] = (
    *startup.PATCHES,
    *frontend.PATCHES,
    *scheduler.PATCHES,
    *model_runner.PATCHES,
    *nixl.PATCHES,
)


def install() -> None:
    """Install every patch once in this process (idempotent)."""
    check.install(PATCHES)


__all__ = [
    "PATCHES",
    "RELIED_ON",
    "Patch",
    "Relied",
    "alias_backend_name",
    "install",
    "installed",
    "record_failure",
    "relied_problem",
    "relied_problems",
    "require",
    "signature_problem",
]
