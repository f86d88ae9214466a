"""What the host tier stores, and how much of a host hit a request may load:
ROCKETKV's rules as pure functions on token counts and block indices (no vLLM,
no pools; ``scheduler.RocketKVHostScheduler`` applies them to vLLM's objects).

What reaches the host is the sum of three things:

- vLLM's eager store (``SimpleCPUOffloadScheduler``): after each forward,
  every *hashed* block of a running request's block table that the host
  lacks, under the device block's hash;
- ROCKETKV's hashing (``kv_cache.RocketKVManager.cache_blocks``): a
  compressed request hashes only its dense prompt blocks, never its
  compaction targets, its tail block or its generated tokens, and never
  writes a hashed block again; so whatever eager stores is dense K/V of the
  prefix its hash names;
- the two store rules below, for a compressed prompt's blocks that eager
  would miss or store too late. Each gives the block indices (into the
  request's block table) a step stores; the scheduler then skips those that
  are null, on the host or already queued, and ``fit_host_pool`` cuts the
  rest to the host pool's free blocks.

With ``targets_end = RequestPlan.compact_blocks(bs) * bs`` and
``freed = RequestPlan.freed_block_range(bs)``:

- ``target_stores``: the compaction targets, under the request's own (dense)
  block hashes, from the step whose forward completes them; never from the
  Stage 1 step, whose stores run after its forward has compacted them
  (``RocketKVManager.chunk_tokens`` keeps the last target out of that step,
  except when the targets end at the prompt's end: that prompt's targets
  reach the device cache only). So a compressed conversation's host chain
  starts at block 0;
- ``handoff_stores``: the blocks the prompt gives back after its Stage 1
  step, under their device hashes, from that step (after its forward), not
  one step later as eager would: by then another request may have reused
  one, a hole in the host chain.

And on the load side, ``host_hit_limit``: the window cap of a compressed
prompt (``RequestPlan.window_hit_cap``) holds for the device and the host
hit together.
"""

from __future__ import annotations

from collections.abc import Sequence


def stage1_step(computed: int, scheduled: int, num_prompt_tokens: int) -> bool:
    """Whether the step that computes tokens ``[computed, computed +
    scheduled)`` ends the prompt: its forward runs Stage 1 (compacts the
    kept tokens into the targets) and its prompt's blocks are given back
    after it."""
    return computed < num_prompt_tokens <= computed + scheduled


def target_stores(
    computed: int, scheduled: int, num_prompt_tokens: int, targets_end: int, block_size: int
) -> range:
    """The compaction targets (block indices ``[0, targets_end // block_size)``)
    a step stores under the request's dense block hashes: all of them in the
    step whose chunk completes them (``computed < targets_end <= computed +
    scheduled``) unless that step is the Stage 1 step; none in any other
    step, nor when the request has none (``targets_end`` 0)."""
    completes = computed < targets_end <= computed + scheduled
    if not completes or stage1_step(computed, scheduled, num_prompt_tokens):
        return range(0)
    return range(targets_end // block_size)


def handoff_stores(
    computed: int, scheduled: int, num_prompt_tokens: int, freed: tuple[int, int]
) -> range:
    """The given-back blocks (``freed``: ``[start, end)`` block indices) a
    step stores under their device hashes: all of them in the Stage 1 step,
    none in any other."""
    if not stage1_step(computed, scheduled, num_prompt_tokens):
        return range(0)
    return range(*freed)


def fit_host_pool(wanted: Sequence[bool], room: int) -> tuple[list[int], int | None]:
    """Which candidates a host pool with ``room`` free blocks takes: the
    indices of the wanted ones, in order, while it has room. Returns them and
    where the chain is cut: the index of the first wanted candidate without
    room (None when all fit); nothing from there on is stored."""
    taken: list[int] = []
    for i, want in enumerate(wanted):
        if not want:
            continue
        if len(taken) >= room:
            return taken, i
        taken.append(i)
    return taken, None


def host_hit_limit(num_local_tokens: int, capped_tokens: int) -> int:
    """The most tokens a host hit may add after a device hit of
    ``num_local_tokens``, when the window cap allows ``capped_tokens`` of
    hit in all."""
    return max(0, capped_tokens - num_local_tokens)
