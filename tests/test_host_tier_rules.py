"""What the host tier stores (``host_tier.store_rules``), rule by rule, on
small hand-worked cases: no engine, no vLLM.

The cases use 16-token blocks and a 300-token compressed prompt whose kept
tokens are compacted into its first 4 blocks (targets end at token 64) and
which gives back blocks 4 to 17 (its tail block, 18, holds tokens 288-299).
"""

import ast
from pathlib import Path

from rocketkv_vllm.host_tier import store_rules
from rocketkv_vllm.host_tier.store_rules import (
    fit_host_pool,
    handoff_stores,
    host_hit_limit,
    stage1_step,
    target_stores,
)

BS = 16
N = 300  # prompt tokens
TARGETS_END = 64  # blocks 0-3 are the compaction targets
FREED = (4, 18)  # blocks given back after Stage 1


def test_the_rules_need_neither_vllm_nor_the_package():
    tree = ast.parse(Path(store_rules.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"__future__", "collections.abc"}


def test_stage1_step_is_the_step_whose_chunk_holds_the_prompts_last_token():
    assert stage1_step(0, 300, N)  # one chunk
    assert stage1_step(256, 44, N)  # the last of three chunks, ending at the prompt's end
    assert stage1_step(299, 1, N)  # a chunk of only the last prompt token
    assert stage1_step(256, 128, N)  # a budget larger than what is left
    assert not stage1_step(0, 128, N)  # an earlier chunk
    assert not stage1_step(128, 171, N)  # ends one token short
    assert not stage1_step(300, 1, N)  # decode


def test_targets_are_stored_from_the_step_that_completes_them():
    every_target = [0, 1, 2, 3]
    assert list(target_stores(0, 128, N, TARGETS_END, BS)) == every_target
    assert list(target_stores(0, 64, N, TARGETS_END, BS)) == every_target  # exactly
    assert list(target_stores(48, 48, N, TARGETS_END, BS)) == every_target  # the last one
    assert list(target_stores(0, 48, N, TARGETS_END, BS)) == []  # not complete yet
    assert list(target_stores(64, 128, N, TARGETS_END, BS)) == []  # completed before
    assert list(target_stores(256, 44, N, TARGETS_END, BS)) == []  # the Stage 1 step
    assert list(target_stores(300, 1, N, TARGETS_END, BS)) == []  # decode


def test_targets_are_never_stored_from_the_stage1_step():
    # One chunk: the forward that completes the targets compacts them too.
    assert list(target_stores(0, 300, N, TARGETS_END, BS)) == []
    # Targets ending at the prompt's end (64 tokens, 4 targets): their last
    # block is written in the Stage 1 step, so none reaches the host.
    assert list(target_stores(0, 64, 64, 64, BS)) == []
    assert list(target_stores(48, 16, 64, 64, BS)) == []
    # A request without targets (not compressed, or evict off) stores none.
    assert list(target_stores(0, 128, N, 0, BS)) == []


def test_targets_are_stored_once_in_a_prompts_life_at_any_chunk_size():
    """Chunks of c tokens, then two decode steps: all four targets go out
    together from the chunk holding token 63, unless that chunk also holds
    the prompt's last token (299); then never."""
    for chunk in (16, 48, 64, 100, 128, 240, 256, 299, 300, 512):
        steps = [(s, min(chunk, N - s)) for s in range(0, N, chunk)] + [(N, 1), (N + 1, 1)]
        stored = {s: list(target_stores(s, n, N, TARGETS_END, BS)) for s, n in steps}
        stored = {s: blocks for s, blocks in stored.items() if blocks}
        holds_63, holds_299 = 63 // chunk * chunk, 299 // chunk * chunk
        assert stored == ({} if holds_63 == holds_299 else {holds_63: [0, 1, 2, 3]}), chunk


def test_given_back_blocks_are_stored_from_the_stage1_step_only():
    assert list(handoff_stores(256, 44, N, FREED)) == list(range(4, 18))
    assert list(handoff_stores(0, 300, N, FREED)) == list(range(4, 18))
    assert list(handoff_stores(128, 128, N, FREED)) == []  # before: not given back yet
    assert list(handoff_stores(300, 1, N, FREED)) == []  # after: vLLM's own store
    assert list(handoff_stores(0, 300, N, (0, 0))) == []  # nothing given back


def test_the_host_pool_takes_the_wanted_blocks_in_order_while_it_has_room():
    wanted = [True, False, True, True]
    assert fit_host_pool(wanted, 3) == ([0, 2, 3], None)
    assert fit_host_pool(wanted, 10) == ([0, 2, 3], None)
    assert fit_host_pool(wanted, 2) == ([0, 2], 3)  # the chain is cut at block 3
    assert fit_host_pool(wanted, 0) == ([], 0)
    assert fit_host_pool([False, True], 0) == ([], 1)  # cut at the first one wanted
    assert fit_host_pool([False, False], 0) == ([], None)  # nothing wanted: no cut
    assert fit_host_pool([], 5) == ([], None)


def test_a_host_hit_adds_at_most_what_the_window_cap_leaves_after_the_device_hit():
    # Window 32: a 300-token prompt's hit may cover (300 - 32) // 16 * 16 = 256 tokens.
    assert host_hit_limit(0, 256) == 256  # nothing on the device: all from the host
    assert host_hit_limit(64, 256) == 192
    assert host_hit_limit(256, 256) == 0
    assert host_hit_limit(288, 256) == 0  # never negative
