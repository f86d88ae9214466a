"""The host tier's ordering rules under asynchronous copies, as pure functions
(no vLLM, no torch; docs/design.md, "Host tier under asynchronous copies").

vLLM's CUDA worker copies on its own streams and completes a step's stores
and loads one or more steps later; the ``async`` copy mode of vLLM's CPU
build (``async_cpu_worker``) does the same in time. What must then hold:

- a store reads a block only while the block holds what it held when the
  store was issued: a step whose forward writes into a block with a pending
  store waits for that store first (``stores_to_wait``). ROCKETKV's only such
  write is Stage 1's (``stage1_write_blocks``): it compacts the kept tokens
  into the targets, whose dense K/V were stored from an earlier step, and
  rewrites KT pages;
- a load completes before any forward reads its blocks, and a block being
  loaded or stored is never handed to another request: vLLM's scheduler half
  (refs held until the completion is reported, requests waiting for their
  loads) with the worker reporting a transfer only once it is done.

And the copy mode's settings (``copy_settings``) and its step arithmetic
(``due_step``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rocketkv_vllm.plan import RequestPlan

COPY_MODES = ("sync", "async")
DEFAULT_MAX_DELAY_STEPS = 3


def stage1_write_blocks(plan: RequestPlan, block_size: int) -> list[int]:
    """The logical block indices a prompt's Stage 1 writes (``ops.base``
    ``Stage1.compress``): none uncompressed; with eviction the compaction
    targets ``[0, cdiv(num_compact, bs))`` (K/V and KT pages) and the tail
    block from ``tail_start`` (KT pages); without eviction (identity
    compaction, ``prompt_budget >= n``) the KT pages of every prompt block."""
    if not plan.compress:
        return []
    end = -(-plan.num_prompt_tokens // block_size)
    if plan.prompt_budget >= plan.num_prompt_tokens:
        return list(range(end))
    targets = -(-plan.num_compact // block_size)
    return list(range(targets)) + list(range(plan.tail_start // block_size, end))


def stores_to_wait(written: Iterable[int], pending: Mapping[int, Sequence[int]]) -> int:
    """The store event a step's forward must wait for: the highest pending
    store event (``pending``: event index -> the device block ids it copies)
    that copies a block the forward writes (``written``: device block ids),
    or -1 for none. Stores complete in event order (one stream), so waiting
    for it waits for every earlier one too."""
    written = set(written)
    if not written:
        return -1
    hits = [event for event, blocks in pending.items() if not written.isdisjoint(blocks)]
    return max(hits, default=-1)


def due_step(issue_step: int, delay: int, previous_due: int) -> int:
    """The step a transfer issued in ``issue_step`` with ``delay`` steps of
    latency completes in: never before the transfer issued before it on the
    same stream (``previous_due``), as CUDA events on one stream complete in
    order (vLLM's worker reports a stream's completions by a high-water
    mark)."""
    return max(issue_step + delay, previous_due)


@dataclass(frozen=True)
class CopySettings:
    """How the host tier's worker copies on vLLM's CPU build
    (``kv_connector_extra_config``): ``copy_mode`` "sync" (each copy done in
    the call that issues it) or "async" (a background thread; each copy done
    ``0..async_max_delay_steps`` steps after its issue, drawn from
    ``random.Random(async_seed)``)."""

    mode: str = "sync"
    max_delay_steps: int = DEFAULT_MAX_DELAY_STEPS
    seed: int = 0


def copy_settings(extra: Mapping[str, object], default_seed: int | None) -> CopySettings:
    """The copy settings of a host tier's ``kv_connector_extra_config``
    (``default_seed``: the engine's seed, used without ``async_seed``);
    ValueError naming the field and what it allows."""
    mode = extra.get("copy_mode", "sync")
    if mode not in COPY_MODES:
        raise ValueError(
            f"kv_connector_extra_config.copy_mode={mode!r} is not a host-tier copy mode; "
            f"allowed: {', '.join(repr(m) for m in COPY_MODES)}"
        )
    given = [k for k in ("async_max_delay_steps", "async_seed") if k in extra]
    if mode == "sync":
        if given:
            raise ValueError(
                f"kv_connector_extra_config.{given[0]} is read with copy_mode='async' only "
                f"(copy_mode is 'sync'); allowed: copy_mode='async', or leave it out"
            )
        return CopySettings()
    delay = extra.get("async_max_delay_steps", DEFAULT_MAX_DELAY_STEPS)
    if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay <= 64:
        raise ValueError(
            f"kv_connector_extra_config.async_max_delay_steps={delay!r}; "
            f"allowed: an integer from 0 to 64 (steps a copy may take)"
        )
    seed = extra.get("async_seed", default_seed if default_seed is not None else 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(
            f"kv_connector_extra_config.async_seed={seed!r}; allowed: an integer "
            f"(default: the engine's seed)"
        )
    return CopySettings("async", delay, seed)
