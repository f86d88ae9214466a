"""The fault campaign's chaos storm, small, on the hybrid tiny Gemma 3
(``rocketkv_eval.fault_campaign``): requests on shared documents with
their own budgets (0: uncompressed) or the engine's, 1-4 parallel samples,
some a chat's next turn, in waves, aborts aimed at every phase of a
request, in a pool that forces preemptions and a host tier that serves
hits, under vLLM's priority scheduling (requests of three priorities: a
request short of blocks preempts the one of lowest priority, even one
already scheduled in the same step, which FCFS never does). Every
completed sample must then equal the same request run alone on an engine
without prefix caching, host tier or preemption: tokens, and logprobs to
1e-3. One storm holds what used to be two (the storm and the chaos storm):
CI time."""

from __future__ import annotations

import pytest

from rocketkv_eval.fault_campaign import PHASES, abort_storm, oracle_check

pytestmark = pytest.mark.engine


def test_chaos_storm_loses_nothing_and_answers_equal_lone_runs():
    """The abort-and-chaos storm, CI-sized (issue 57), under priority
    scheduling with a host tier: prompts around the window's and the chunks'
    edges, 1-4 samples, an abort aimed at each phase of a request as it first
    appears (a window spanning chunks among them: the abort that used to kill
    the engine; a request waiting after its preemption), preemptions of
    requests scheduled earlier in the same step, host loads, chat turns; then
    every completed sample against its lone run."""
    storm, records = abort_storm(
        24, seed=8, model="tiny-gemma3", policy="priority", max_num_seqs=None, chaos=True
    )
    assert storm["ok"], storm  # nothing lost or errored, preemptions, pools back
    assert storm["engine_deaths"] == 0
    assert set(storm["aborted_in_phase"]) == set(PHASES)
    # The storm reached what it is for.
    assert storm["preempted_in_the_step_that_scheduled_them"] > 0
    assert storm["host_account"]["host_blocks_loaded"] > 0
    assert any(r["preemptions"] for r in records.values())
    assert {r["budget"] for r in records.values()} >= {None, 0}
    assert any(r["n"] > 2 for r in records.values())
    assert any(r["turn_of"] and r["cached"] for r in records.values())

    oracle = oracle_check(records, tie=1e-3, tolerance=1e-3, model="tiny-gemma3")
    assert oracle["ok"], oracle["mismatches"]
    assert oracle["samples"] == sum(r["n"] for r in records.values())
    assert oracle["tokens_compared"] > 0.9 * sum(r["max_tokens"] * r["n"] for r in records.values())
