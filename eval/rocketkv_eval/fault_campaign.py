"""Fault campaign for the host tier and the scheduler (issue 36).

1. An abort storm with preemptions on a ROCKETKV engine with a host tier,
   in process: requests of compressed documents (a device pool for about
   two of them, a host tier for a few) are added in waves; at random steps
   some are aborted while waiting, prefilling or decoding. Every request
   either completes with all its tokens or was aborted by us (nothing lost,
   nothing errored), preemptions happen, and the device and host pools end
   at their starting free counts. Requests carry their own budgets (0:
   uncompressed) or the engine's, some ask for 2 parallel samples, and some
   are a chat's next turn (a finished request's prompt and answer, then a
   new message).
   ``--oracle``: every completed request is then run alone on an engine
   without prefix caching, host tier or preemption, and each sample's
   tokens and logprobs must be the lone run's (``oracle_check``): silent
   wrongness from hits, host loads, preemptions or batching shows there.
   ``--policy priority``: vLLM's priority scheduling, whose preemptions may
   withdraw a request scheduled earlier in the same step. ``--runner
   v2-async``: NVIDIA's defaults, Model Runner V2 and async scheduling
   (``rocketkv_eval.runners``), with the host tier copying asynchronously
   as vLLM's CUDA worker does (``--async-copies``; without it, no host
   tier); its ``--records`` are then checked by lone runs on V1
   (``--check-records``), much faster than on V2's interpreted kernels.
   ``--reselect-every R``: the storm's and the lone runs' engines reuse a
   page selection for up to R decode steps; the store's slots pass between
   requests as they come, finish, are aborted and preempted, and every
   sample must still equal its lone run, a preempted one up to its
   preemption (after its recompute it selects anew, by design).
2. Servers (``--servers``): two ROCKETKV ``vllm serve`` processes with host
   tiers on one machine at once, the second run by another local user
   (``--second-user UID``: setpriv; this Python, the venv and the model must
   be readable by that user); the first is killed with SIGKILL (its whole
   process group) while requests are in flight and restarted on the same
   port. Requests in flight on the killed server get an error, every other
   request completes, and both servers' /metrics carry the rocketkv:*
   counters (the scheduler's account travels in vLLM's own stats: no file
   or folder is shared between servers or users).

    .venv/bin/python scripts/fault_campaign.py --servers --second-user 65534 \
        --json results/fault-campaign-cpu.json
    .venv/bin/python scripts/fault_campaign.py --oracle \
        --json results/fault-campaign-oracle-cpu.json
    .venv/bin/python scripts/fault_campaign.py --model tiny-gemma3 \
        --runner v2-async --requests 24 --records R.json
    .venv/bin/python scripts/fault_campaign.py --model tiny-gemma3 --check-records R.json
    .venv/bin/python scripts/fault_campaign.py --chaos --model tiny-gemma3 --requests 512

3. The abort-and-chaos campaign (``--chaos``, issue 57): storms at
   ``max_num_seqs`` 2, 3, 4 and vLLM's default, with and without the host
   tier, under FCFS and priority scheduling (``CHAOS_CELLS``), prompts
   around the window's and the chunks' edges, 1-4 samples, aborts aimed
   at every phase of a request (``PHASES``); every completed sample checked
   against its lone run (``chaos_campaign``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from rocketkv_eval.runners import RUNNERS, use_runner

# SmolLM2-135M fp32: 30 layers x 3 KV heads x 64 x (K, V) x 4 bytes a token.
SMOLLM2_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4

MAX_MODEL_LEN = 2100
CHUNK = 256  # the storm's prefill chunks, and the first lone run's

# Per model: the storm's pool (about two of its long requests at once) and
# host tier, and the lone runs' cache (four of the longest requests).
MODELS = {
    "smollm2": dict(
        storm=dict(kv_cache_memory_bytes=SMOLLM2_BYTES_PER_TOKEN * 2800, kv_offloading_size=0.1),
        alone=dict(kv_cache_memory_bytes=SMOLLM2_BYTES_PER_TOKEN * 8400),
    ),
    # Hybrid: 2 full-attention layers and 4 sliding-window layers of 64
    # tokens, three KV cache groups of 2 layers drawing on one pool (a
    # 1,000-token request holds ~32 full-attention blocks, a few sliding).
    "tiny-gemma3": dict(
        storm=dict(
            kv_cache_memory_bytes=1 << 27, num_gpu_blocks_override=110, kv_offloading_size=0.02
        ),
        alone=dict(kv_cache_memory_bytes=1 << 27, num_gpu_blocks_override=600),
    ),
}


def _model_path(model: str) -> str:
    from rocketkv_eval.model import prepare_default_model
    from rocketkv_eval.tiny_model import prepare_tiny_gemma3

    return prepare_default_model() if model == "smollm2" else prepare_tiny_gemma3()


def _engine(
    model: str,
    role: str,
    host_tier: bool = True,
    device_blocks: int | None = None,
    reselect_every: int = 1,
    host_copies: dict | None = None,
    **kw,
):
    from vllm import LLM

    settings = dict(MODELS[model][role])
    if not host_tier:
        settings.pop("kv_offloading_size", None)
    if host_tier and host_copies:  # the host tier's copy mode (host_tier.ordering.copy_settings)
        from vllm.config import KVTransferConfig

        settings["kv_transfer_config"] = KVTransferConfig(
            kv_connector_extra_config=dict(host_copies)
        )
    if device_blocks:
        settings["num_gpu_blocks_override"] = device_blocks
    return LLM(
        model=_model_path(model),
        attention_backend="ROCKETKV",
        dtype="float32",
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        block_size=32,
        additional_config={"rocketkv": {"prompt_budget": 256, "reselect_every": reselect_every}},
        **settings,
        **kw,
    )


def abort_storm(
    num_requests: int,
    seed: int,
    model: str = "smollm2",
    policy: str = "fcfs",
    host_tier: bool = True,
    device_blocks: int | None = None,
    reselect_every: int = 1,
    max_num_seqs: int | None = 8,
    chaos: bool = False,
    host_copies: dict | None = None,
) -> dict:
    """``policy`` "priority": vLLM's priority scheduling, requests of three
    priorities; a request short of blocks then preempts the running request
    of lowest priority, which may be one scheduled earlier in the same step
    (its chunk withdrawn after its blocks were allocated and hashed).
    ``host_tier`` False: no host tier (as on NVIDIA, where ROCKETKV refuses
    one); ``device_blocks``: the device pool's size instead of ``MODELS``'s;
    ``reselect_every``: the engine's ``rocketkv.reselect_every`` (the
    selection store's slots then pass between requests as they come, finish,
    are aborted and preempted). ``max_num_seqs`` None: vLLM's default.
    ``chaos``: the abort-and-chaos storm (issue 57): prompt lengths around
    the observation window's and the chunks' boundaries, 1-4 parallel
    samples, two prompts' chunks a step (so several windows span chunks at
    once), each abort aimed at a phase (``PHASES``) chosen among those some
    live request is in, and an engine that dies recorded, not raised.
    ``host_copies``: the host tier's ``kv_connector_extra_config`` copy
    settings, e.g. ``{"copy_mode": "async", "async_seed": 0}`` (copies that
    complete 0-3 steps after their issue, as on NVIDIA)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process

    from vllm.inputs import TokensPrompt

    from rocketkv_eval.engines import scheduler
    from rocketkv_vllm.state import worker_state

    sizes = dict(max_num_batched_tokens=CHUNK)
    if chaos:  # two prompts' chunks of CHUNK a step
        sizes = dict(max_num_batched_tokens=2 * CHUNK, long_prefill_token_threshold=CHUNK)
    if max_num_seqs is not None:
        sizes["max_num_seqs"] = max_num_seqs
    llm = _engine(
        model,
        "storm",
        host_tier,
        device_blocks,
        reselect_every,
        host_copies=host_copies,
        scheduling_policy=policy,
        **sizes,
    )
    engine = llm.llm_engine
    sched = scheduler(llm)
    pool = sched.kv_cache_manager.block_pool
    host = sched.connector.scheduler_manager if host_tier else None
    free_at_start = pool.get_num_free_blocks()
    withdrawn = _count_withdrawn_chunks(sched)
    rng = random.Random(seed)
    documents = [[rng.randrange(100, 40000) for _ in range(1800)] for _ in range(6)]

    live: dict[str, int] = {}  # request id -> max_tokens
    records: dict[str, dict] = {}  # completed request id -> what was asked and answered
    asked: dict[str, dict] = {}
    aborted: set[str] = set()
    preempted: dict[str, int] = {}  # internal request id -> its preemptions so far
    # (request id, sample index) -> its tokens when first preempted
    preempted_at: dict[tuple[str, int], int] = {}
    errors: list[str] = []
    aborted_in: dict[str, int] = {}  # phase -> aborts aimed at it
    deaths = 0
    added = 0
    steps = 0
    started = time.perf_counter()
    while added < num_requests or live:
        while added < num_requests and len(live) < 12 and rng.random() < 0.5:
            doc = documents[rng.randrange(len(documents))]
            if chaos and rng.random() < 0.5:
                # A document of its own: no hit, so its chunks start at 0 and
                # a prompt just past a chunk's end holds its window across two.
                doc = [rng.randrange(100, 40000) for _ in range(1800)]
            # Shared documents with other tails: prefix hits on the device and the host.
            prompt = doc[: _prefix_length(rng, chaos)] + [rng.randrange(100, 40000)] * 40
            turn_of = None
            if records and rng.random() < 0.3:
                # A chat's next turn: a finished request's prompt and answer, a new
                # message; hits must stop where the compressed answer began.
                turn_of = rng.choice(sorted(records))
                turn = records[turn_of]
                after = turn["prompt"] + turn["outputs"][0]["tokens"] + prompt[-40:]
                if len(after) <= MAX_MODEL_LEN - 100:
                    prompt = after
                else:
                    turn_of = None
            # (chaos: short answers, so the storm's steps go to its phases, not long decodes)
            longest = rng.randrange(8, 64) if chaos else rng.randrange(100, 400)
            max_tokens = min(longest, MAX_MODEL_LEN - len(prompt))
            # Own budgets (0: uncompressed) and parallel samples beside the engine's.
            budget = [None, 0, None, 128, None, 512][added % 6]
            n = _samples(added, rng, chaos)
            rid = f"req-{added}"
            priority = added % 3 if policy == "priority" else 0
            engine.add_request(
                rid,
                TokensPrompt(prompt_token_ids=prompt),
                _params(max_tokens, budget, n),
                priority=priority,
            )
            live[rid] = max_tokens
            asked[rid] = dict(
                prompt=prompt,
                max_tokens=max_tokens,
                budget=budget,
                n=n,
                turn_of=turn_of,
                priority=priority,
            )
            added += 1
        # Preempted in the last step, if at all (counted before the abort,
        # which may take a preempted request).
        for request in sched.requests.values():
            if request.num_preemptions:
                sample = (_caller_id(request.request_id), _sample_index(request.request_id))
                preempted_at.setdefault(sample, request.num_output_tokens)
            preempted[request.request_id] = request.num_preemptions
        # The storm: a third of the requests aborted, at any stage (chaos:
        # aimed, and a phase's first abort whatever the third, so rare phases
        # such as a preempted request's are reached).
        room = len(aborted) < num_requests // 3
        victim = None
        if live and chaos:
            phase, victim = _aimed_abort(sched, live, aborted_in, rng)
            if phase not in aborted_in or (room and rng.random() < 0.08):
                aborted_in[phase] = aborted_in.get(phase, 0) + 1
            else:
                victim = None
        elif live and room and rng.random() < 0.04:
            victim = rng.choice(sorted(live))
        if victim is not None:
            engine.abort_request([victim])
            aborted.add(victim)
            del live[victim]
        try:
            outputs = engine.step()
        except Exception as e:  # noqa: BLE001 - the campaign counts engine deaths
            errors.append(f"engine died at step {steps}: {e!r}")
            deaths += 1
            break
        for out in outputs:
            if out.finished and out.request_id in live:
                produced = [len(sample.token_ids) for sample in out.outputs]
                if produced != [live[out.request_id]] * asked[out.request_id]["n"]:
                    errors.append(f"{out.request_id}: {produced} of {live[out.request_id]} tokens")
                records[out.request_id] = dict(
                    asked[out.request_id],
                    outputs=_traces(out),
                    cached=out.num_cached_tokens or 0,
                    preemptions=sum(
                        count
                        for internal, count in preempted.items()
                        if _caller_id(internal) == out.request_id
                    ),
                    # Per sample: how many tokens it had when first preempted (None: never).
                    first_preempted_at=[
                        preempted_at.get((out.request_id, k))
                        for k in range(asked[out.request_id]["n"])
                    ],
                )
                del live[out.request_id]
        steps += 1
        if steps > 20000:
            errors.append("did not finish")
            break
    free_at_end = pool.get_num_free_blocks()
    host_in_use = sum(b.ref_cnt for b in host.cpu_block_pool.blocks) if host else 0
    result = {
        "requests": num_requests,
        "completed": len(records),
        "aborted": len(aborted),
        "lost": num_requests - len(records) - len(aborted),
        "errors": errors,
        "engine_deaths": deaths,
        "max_num_seqs": max_num_seqs,
        "host_tier": host_tier,
        "aborted_in_phase": aborted_in,
        "steps": steps,
        "seconds": round(time.perf_counter() - started, 1),
        "device_free_at_start": free_at_start,
        "device_free_at_end": free_at_end,
        "host_blocks_in_use_at_end": host_in_use,
        "preemptions": sum(preempted.values()),
        "preempted_in_the_step_that_scheduled_them": withdrawn[0],
        "reselect_every": reselect_every,
        "decode_selections_reused": worker_state(
            engine.vllm_config
        ).counters.decode_selections_reused,
        "completed_with": {
            "a prefix hit": sum(bool(r["cached"]) for r in records.values()),
            "a chat turn's prompt": sum(bool(r["turn_of"]) for r in records.values()),
            "2 samples": sum(r["n"] == 2 for r in records.values()),
            "3-4 samples": sum(r["n"] > 2 for r in records.values()),
            "budget 0": sum(r["budget"] == 0 for r in records.values()),
            "a preemption": sum(bool(r["preemptions"]) for r in records.values()),
        },
        "host_account": {
            k: v
            for k, v in (vars(host.rocketkv.prefix_account) if host else {}).items()
            if k.startswith("host_")
        },
    }
    if deaths:  # what was live went down with the engine
        result["lost"] += len(live)
    result["ok"] = (
        not errors
        and result["lost"] == 0
        and result["preemptions"] > 0
        and free_at_end == free_at_start
        and host_in_use == 0
        and (reselect_every == 1 or result["decode_selections_reused"] > 0)
    )
    if not deaths:
        llm.llm_engine.engine_core.shutdown()
    return result, records


WINDOW = 32  # the storm engines' observation window (rocketkv.window_size's default)

# Where a chaos storm aims an abort, by what the scheduler holds of a request
# (its first sample's): not yet scheduled; back in the queue after a
# preemption; prefilling before its window; prefilling inside its window (its
# window queries span chunks: issue 57's finding); its next chunk ends the
# prompt (the Stage 1 step); Stage 1 just ran (its evicted blocks being given
# back); decoding.
PHASES = ("waiting", "preempted", "prefill", "window", "stage 1 next", "compressed", "decode")


def _phase(request) -> str:
    n, done = request.num_prompt_tokens, request.num_computed_tokens
    if request.status.name == "PREEMPTED":
        return "preempted"
    if done == 0:
        return "waiting"
    if done < n:
        return _prefill_phase(n, done)
    return "compressed" if request.num_output_tokens <= 1 else "decode"


def _prefill_phase(n: int, done: int) -> str:
    if n - done <= CHUNK:
        return "window" if done > n - WINDOW else "stage 1 next"
    return "prefill"


def _aimed_abort(
    sched, live: dict[str, int], aborted_in: dict[str, int], rng: random.Random
) -> tuple[str, str]:
    """(phase, caller id): of the phases some live request is in, one aimed
    at least so far (a request spends a step or two in the prefill phases
    and many decoding), then one of its requests. The storm aborts it at
    once where no abort has hit that phase yet, else one step in 12."""
    by_phase: dict[str, list[str]] = {}
    seen = set()
    for request in sched.requests.values():
        caller = _caller_id(request.request_id)
        if caller in live and caller not in seen and not request.is_finished():
            seen.add(caller)
            by_phase.setdefault(_phase(request), []).append(caller)
    # Added this step, not yet in the scheduler's table: waiting.
    by_phase.setdefault("waiting", []).extend(sorted(set(live) - seen))
    present = [p for p, ids in by_phase.items() if ids]
    fewest = min(aborted_in.get(p, 0) for p in present)
    phase = rng.choice(sorted(p for p in present if aborted_in.get(p, 0) == fewest))
    return phase, rng.choice(sorted(by_phase[phase]))


def _prefix_length(rng: random.Random, chaos: bool) -> int:
    """A prompt's document part (40 tokens of its own follow): 400-1000
    tokens, or in a chaos storm half the time a prompt length just around a
    chunk's end or its window's start (1-3 chunks)."""
    if not chaos or rng.random() < 0.5:
        return rng.randrange(400, 1000)
    edge = rng.choice((0, WINDOW))
    return rng.randrange(1, 4) * CHUNK + edge + rng.choice((-2, -1, 0, 1, 2, 5)) - 40


def _samples(added: int, rng: random.Random, chaos: bool) -> int:
    if _on_model_runner_v2():
        return 1
    if chaos:
        return rng.choice((1, 1, 1, 2, 3, 4))
    return 2 if added % 5 == 2 else 1


# The chaos campaign's cells: (max_num_seqs, host tier, scheduling policy);
# None: vLLM's default. Each size meets both policies and the host tier both
# ways; priority scheduling preempts the running request of lowest priority,
# so its cells are where aborts of preempted requests happen.
CHAOS_CELLS = (
    (2, True, "fcfs"),
    (3, False, "priority"),
    (4, True, "priority"),
    (None, False, "fcfs"),
    (2, False, "priority"),
    (3, True, "fcfs"),
    (4, False, "fcfs"),
    (None, True, "priority"),
)


def chaos_campaign(
    num_requests: int, seed: int, model: str = "smollm2", partial: str | None = None
) -> dict:
    """The abort-and-chaos campaign (issue 57): ``num_requests`` shared
    among ``CHAOS_CELLS`` (on Model Runner V2 the host tier copies
    asynchronously, as on NVIDIA), each a chaos storm (``abort_storm(chaos=True)``) whose completed
    requests are then checked against lone runs (``oracle_check``). Passes
    with no engine death, no request lost or errored, every pool back at its
    starting count, every completed sample equal to its lone run, and, over
    the campaign, preemptions and an abort aimed at every phase. ``partial``:
    a file rewritten with the cells done after each."""
    per_cell = -(-num_requests // len(CHAOS_CELLS))
    results = []
    for i, (seqs, host, policy) in enumerate(CHAOS_CELLS):
        copies = None
        if host and _on_model_runner_v2():
            copies = {"copy_mode": "async", "async_seed": seed + i}
        storm, records = abort_storm(
            per_cell,
            seed + i,
            model,
            policy,
            host,
            max_num_seqs=seqs,
            chaos=True,
            host_copies=copies,
        )
        storm["policy"] = policy
        oracle = oracle_check(records, 1e-3, 1e-3, model=model) if records else {"ok": True}
        storm["oracle"] = {k: v for k, v in oracle.items() if k != "tie_divergences"}
        storm["ok"] = (
            not storm["errors"]
            and storm["lost"] == 0
            and storm["device_free_at_end"] == storm["device_free_at_start"]
            and storm["host_blocks_in_use_at_end"] == 0
            and oracle["ok"]
        )
        results.append(storm)
        print(
            json.dumps({k: storm[k] for k in ("max_num_seqs", "host_tier", "policy", "ok")}),
            flush=True,
        )
        if partial:  # the cells so far, in case the campaign is cut short
            with open(partial, "w") as f:
                json.dump({"cells": results}, f, indent=1)
    phases: dict[str, int] = {}
    for r in results:
        for phase, count in r["aborted_in_phase"].items():
            phases[phase] = phases.get(phase, 0) + count
    total = {
        key: sum(r[key] for r in results)
        for key in ("requests", "completed", "aborted", "lost", "engine_deaths", "preemptions")
    }
    total["samples_compared"] = sum(r["oracle"].get("samples", 0) for r in results)
    total["tokens_compared"] = sum(r["oracle"].get("tokens_compared", 0) for r in results)
    total["mismatches"] = sum(len(r["oracle"].get("mismatches", ())) for r in results)
    total["aborted_in_phase"] = phases
    return {
        "cells": results,
        "total": total,
        "ok": all(r["ok"] for r in results)
        and total["preemptions"] > 0
        and set(phases) == set(PHASES),
    }


def _count_withdrawn_chunks(sched) -> list[int]:
    """A counter (in a list) of the requests preempted in the very step
    that had just allocated blocks for them (priority scheduling's victims)."""
    count, allocated = [0], set()
    schedule, allocate, preempt = (
        sched.schedule,
        sched.kv_cache_manager.allocate_slots,
        sched._preempt_request,
    )

    def scheduling(*args, **kwargs):
        allocated.clear()
        return schedule(*args, **kwargs)

    def allocating(request, *args, **kwargs):
        blocks = allocate(request, *args, **kwargs)
        if blocks is not None:
            allocated.add(request.request_id)
        return blocks

    def preempting(request, *args, **kwargs):
        count[0] += request.request_id in allocated
        return preempt(request, *args, **kwargs)

    sched.schedule = scheduling
    sched.kv_cache_manager.allocate_slots = allocating
    sched._preempt_request = preempting
    return count


def _on_model_runner_v2() -> bool:
    """Model Runner V2 (``rocketkv_eval.runners``) samples top-k in a Triton
    kernel that Triton's interpreter cannot run, and vLLM samples n > 1 only
    at a temperature of at least 0.01, far from greedy: there every request
    asks for one greedy sample."""
    return os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1"


def _caller_id(internal: str) -> str:
    """The id a request was added under, from vLLM's internal id of it or of
    one of its parallel samples ("<index>_<id>-<8 random chars>")."""
    return internal.rsplit("-", 1)[0].split("_", 1)[-1]


def _sample_index(internal: str) -> int:
    """Which of its request's parallel samples vLLM's internal id names (0
    for a request of one sample)."""
    head = internal.rsplit("-", 1)[0]
    index, _, rest = head.partition("_")
    return int(index) if rest and index.isdigit() else 0


def _params(max_tokens: int, budget: int | None, n: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    extra = None if budget is None else {"rocketkv_token_budget": budget}
    # vLLM refuses n > 1 with greedy sampling; top-k 1 samples greedily too
    # (never asked for on V2: _on_model_runner_v2).
    greedy = dict(temperature=1.0, top_k=1) if n > 1 else dict(temperature=0.0)
    return SamplingParams(
        **greedy,
        max_tokens=max_tokens,
        ignore_eos=True,
        n=n,
        logprobs=2,
        extra_args=extra,
        output_kind=RequestOutputKind.FINAL_ONLY,  # all n samples at once
    )


def _traces(out) -> list[dict]:
    """Each sample's tokens, their logprobs and the gap between the two
    likeliest tokens at each position."""
    traces = []
    for sample in out.outputs:
        chosen, gaps = [], []
        for token, top in zip(sample.token_ids, sample.logprobs):
            chosen.append(top[token].logprob)
            best = sorted((lp.logprob for lp in top.values()), reverse=True)
            gaps.append(best[0] - best[1] if len(best) > 1 else float("inf"))
        traces.append(dict(tokens=list(sample.token_ids), logprobs=chosen, gaps=gaps))
    return traces


def _lone_runs(
    records: dict[str, dict], chunk: int, model: str, fillers: int = 0, reselect_every: int = 1
) -> dict[str, dict]:
    """Each request (one sample) on a fresh engine without prefix caching,
    with this chunk size; alone, or beside ``fillers`` other requests of
    random tokens that decode as long as it does."""
    from vllm.inputs import TokensPrompt

    llm = _engine(
        model,
        "alone",
        reselect_every=reselect_every,
        max_num_batched_tokens=chunk,
        max_num_seqs=1 + fillers,
        enable_prefix_caching=False,
    )
    rng = random.Random(1)
    runs = {}
    for rid, record in records.items():
        params = _params(record["max_tokens"], record["budget"], 1)
        others = [
            TokensPrompt(prompt_token_ids=[rng.randrange(100, 40000) for _ in range(400)])
            for _ in range(fillers)
        ]
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=record["prompt"]), *others],
            [params] * (1 + fillers),
            use_tqdm=False,
        )
        [runs[rid]] = _traces(outs[0])
    llm.llm_engine.engine_core.shutdown()
    return runs


def _difference(
    got: dict, ref: dict, tie: float, tolerance: float
) -> tuple[str | None, int, float]:
    """What sets a sample apart from a lone run: None, "tie" (the tokens part
    after a near tie of the lone run's two likeliest tokens) or a finding;
    the tokens compared and the largest logprob difference up to there."""
    upto = next(
        (i for i, (a, b) in enumerate(zip(got["tokens"], ref["tokens"])) if a != b),
        len(ref["tokens"]),
    )
    drifts = [abs(a - b) for a, b in zip(got["logprobs"][:upto], ref["logprobs"][:upto])]
    drift = max(drifts, default=0.0)
    if drift > tolerance:
        first = next(i for i, d in enumerate(drifts) if d > tolerance)
        return f"logprob drift {drift:.2e} (above {tolerance} from token {first})", upto, drift
    if upto < len(ref["tokens"]):
        if ref["gaps"][upto] < tie:
            return "tie", upto, drift
        return f"token {upto} differs (gap {ref['gaps'][upto]:.3f})", upto, drift
    return None, upto, drift


def _comparable(record: dict, k: int, reselect_every: int) -> int | None:
    """How many of sample k's tokens a lone run must reproduce (None: all).
    With a reused selection, a request preempted with m >= 1 tokens
    recomputes them and its next step forgets its stored selection (by
    design), so from token m on (token 2 for m = 1: token 1 comes from a
    first decode step, which selects in both) it may select where the lone
    run reused. Preempted before its first token, it decodes as the lone
    run does. Uncompressed requests (budget 0) select nothing."""
    m = record["first_preempted_at"][k] if reselect_every > 1 and record["budget"] != 0 else None
    return max(m, 2) if m else None


def _cut(trace: dict, n: int | None) -> dict:
    return trace if n is None else {key: values[:n] for key, values in trace.items()}


# Lone runs a sample that differs from the first is also compared with:
# (name, chunk size, other requests decoding beside it).
OTHER_RUNS = (("chunks of 512", 512, 0), ("chunks of 96", 96, 0), ("beside 3 others", CHUNK, 3))


def oracle_check(
    records: dict[str, dict],
    tie: float,
    tolerance: float,
    model: str = "smollm2",
    reselect_every: int = 1,
) -> dict:
    """Each completed request of the storm again, alone, on an engine without
    prefix caching, host tier or preemption, in the storm's chunks
    (``CHUNK``): the storm's batching, cache hits, host loads, preemptions
    and parallel samples must change no token, except
    after a near tie of the lone run's two likeliest tokens, and no logprob
    up to there. Float noise alone can flip a near tie in Stage 1's choice of
    tokens or Stage 2's of pages (a request alone differs so from the same
    request in other chunk sizes, or decoding beside others, by up to ~0.02
    in a logprob on SmolLM2): a sample that differs is also compared with
    the runs of ``OTHER_RUNS``, and is a finding only if it matches none.
    With ``reselect_every`` > 1 the lone runs reuse selections as the storm
    did, except where a preemption made the storm's request select anew
    (its recomputed tokens forget its selection, by design): such a sample
    is compared up to there (``_comparable``)."""
    started = time.perf_counter()
    order = sorted(records, key=lambda rid: int(rid.split("-")[1]))
    lone = _lone_runs({rid: records[rid] for rid in order}, CHUNK, model, 0, reselect_every)
    differing, ties, cut, worst, compared = {}, [], [], 0.0, 0
    for rid in order:
        record = records[rid]
        for k, got in enumerate(record["outputs"]):
            n = _comparable(record, k, reselect_every)
            where = (
                f"{rid}/{k} (budget {record['budget']}, n {record['n']}, "
                f"{len(record['prompt'])} prompt tokens, {record['cached']} cached, "
                f"{record['preemptions']} preemptions"
                + ("" if n is None else f", compared up to token {n}")
                + ")"
            )
            if n is not None:
                cut.append(where)
            finding, upto, drift = _difference(_cut(got, n), _cut(lone[rid], n), tie, tolerance)
            if finding == "tie":
                ties.append(f"{where} at token {upto}")
            elif finding:
                differing.setdefault(rid, []).append((k, n, where, finding))
            worst, compared = max(worst, drift), compared + upto
    mismatches, noise = [], []
    if differing:
        others = [
            _lone_runs(
                {rid: records[rid] for rid in differing}, chunk, model, fillers, reselect_every
            )
            for _, chunk, fillers in OTHER_RUNS
        ]
        for rid, samples in differing.items():
            for k, n, where, finding in samples:
                got = _cut(records[rid]["outputs"][k], n)
                matched = [
                    (name, runs)
                    for (name, _, _), runs in zip(OTHER_RUNS, others)
                    if _difference(got, _cut(runs[rid], n), tie, tolerance)[0] in (None, "tie")
                ]
                line = f"{where}: {finding} against the run alone in chunks of {CHUNK}"
                if matched:
                    name, runs = matched[0]
                    spread = _difference(_cut(lone[rid], n), _cut(runs[rid], n), tie, tolerance)[0]
                    noise.append(
                        f"{line}; matches the run {name}, which differs from the first "
                        f"as much: {spread}"
                    )
                else:
                    names = ", ".join(name for name, _, _ in OTHER_RUNS)
                    mismatches.append(f"{line}; matches no other run ({names})")
    return {
        "requests": len(records),
        "samples": sum(len(r["outputs"]) for r in records.values()),
        "tokens_compared": compared,
        "max_logprob_drift": worst,
        "tie_divergences": ties,
        "compared_up_to_their_preemption": cut,
        "float_noise": noise,
        "mismatches": mismatches,
        "seconds": round(time.perf_counter() - started, 1),
        "ok": not mismatches,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_user(uid: int, model: str) -> tuple[list[str], dict, str]:
    """The command prefix, environment and model path of a process run by
    local user ``uid``, with a home of its own holding copies of the model
    and of our built C++ kernel."""
    home = tempfile.mkdtemp(prefix=f"rocketkv-user{uid}-")
    built = os.path.expanduser("~/.cache/torch_extensions")
    if os.path.isdir(built):
        shutil.copytree(built, os.path.join(home, ".cache", "torch_extensions"))
    model = shutil.copytree(model, os.path.join(home, "model"))
    for root, dirs, files in os.walk(home):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.chown(name, uid, uid)
    prefix = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return prefix, {"HOME": home, "XDG_CACHE_HOME": os.path.join(home, ".cache")}, model


SERVED_NAME = "smollm2"


def _start_server(model: str, port: int, log, user: int | None = None) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    prefix = []
    if user is not None:
        prefix, user_env, model = _as_user(user, model)
        env |= user_env
    cmd = prefix + [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--attention-backend", "ROCKETKV", "--max-model-len", "2100",
        "--enforce-eager", "--dtype", "float32", "--kv-cache-memory-bytes", str(1 << 28),
        "--kv-offloading-size", "0.1", "--max-num-seqs", "4",
        "--additional-config", json.dumps({"rocketkv": {"prompt_budget": 256}}),
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)


def _wait_ready(proc: subprocess.Popen, port: int, timeout: float = 600.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"server on port {port} not ready in {timeout} s")


def _complete(port: int, tokens: list[int], max_tokens: int) -> str:
    """'ok' with all tokens, else the error (what a client sees)."""
    body = json.dumps(
        {"model": SERVED_NAME, "prompt": tokens, "max_tokens": max_tokens, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            out = json.loads(r.read())
        n = out["usage"]["completion_tokens"]
        return "ok" if n == max_tokens else f"{n} of {max_tokens} tokens"
    except (OSError, urllib.error.HTTPError, ValueError) as e:
        return f"error: {type(e).__name__}"


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
    )


def servers(seed: int, second_user: int | None) -> dict:
    from rocketkv_eval.model import prepare_default_model

    model = prepare_default_model()
    rng = random.Random(seed)
    doc = [rng.randrange(100, 40000) for _ in range(1500)]
    ports = {"a": _free_port(), "b": _free_port()}
    logs = {
        k: tempfile.NamedTemporaryFile("w+", prefix=f"fault-{k}-", suffix=".log") for k in ports
    }
    users = {"a": None, "b": second_user}
    procs = {k: _start_server(model, ports[k], logs[k], users[k]) for k in ports}
    result: dict = {
        "ports": ports,
        "uids": {k: os.getuid() if u is None else u for k, u in users.items()},
    }
    try:
        started = time.perf_counter()
        for k in ports:
            _wait_ready(procs[k], ports[k])
        result["start_seconds"] = round(time.perf_counter() - started, 1)
        # Requests in flight on both; A is killed with SIGKILL meanwhile.
        answers: dict[str, str] = {}

        def ask(name: str, port: int, tail: int) -> None:
            answers[name] = _complete(port, doc + [tail] * 20, 200)

        threads = [
            threading.Thread(target=ask, args=(f"{k}-{i}", ports[k], 30000 + i))
            for k in ports
            for i in range(3)
        ]
        for t in threads:
            t.start()
        time.sleep(8)
        os.killpg(procs["a"].pid, signal.SIGKILL)
        procs["a"].wait()
        for t in threads:
            t.join()
        result["in_flight"] = dict(sorted(answers.items()))
        # A again, on the same port.
        started = time.perf_counter()
        procs["a"] = _start_server(model, ports["a"], logs["a"])
        _wait_ready(procs["a"], ports["a"])
        result["restart_seconds"] = round(time.perf_counter() - started, 1)
        after = {
            f"a-again-{i}": _complete(ports["a"], doc + [31000 + i] * 20, 16) for i in range(2)
        }
        after |= {
            f"b-again-{i}": _complete(ports["b"], doc + [32000 + i] * 20, 16) for i in range(2)
        }
        result["after_restart"] = after
        result["prompts_compressed"] = {
            k: _metric(ports[k], "rocketkv:prompts_compressed_total") for k in ports
        }
        result["host_blocks_stored"] = {
            k: _metric(ports[k], "rocketkv:host_blocks_stored_total") for k in ports
        }
        result["ok"] = (
            all(v == "ok" for k, v in answers.items() if k.startswith("b-"))
            and all(v == "ok" for v in after.values())
            and all(v > 0 for v in result["prompts_compressed"].values())
            and all(v > 0 for v in result["host_blocks_stored"].values())
        )
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="storm's model")
    parser.add_argument(
        "--policy", choices=("fcfs", "priority"), default="fcfs", help="storm's scheduling policy"
    )
    parser.add_argument(
        "--runner",
        choices=RUNNERS,
        default="v1",
        help="vLLM's model runner (rocketkv_eval.runners); v2-async is NVIDIA's defaults; "
        "on V2 the storm has a host tier only with --async-copies (as on NVIDIA)",
    )
    parser.add_argument(
        "--device-blocks", type=int, default=None, help="the storm's device pool, in blocks"
    )
    parser.add_argument(
        "--reselect-every",
        type=int,
        default=1,
        help="rocketkv.reselect_every of the storm's and the lone runs' engines",
    )
    parser.add_argument(
        "--chaos",
        action="store_true",
        help="the abort-and-chaos campaign: --requests shared among CHAOS_CELLS, each "
        "storm checked against lone runs",
    )
    parser.add_argument(
        "--async-copies",
        type=int,
        default=None,
        metavar="SEED",
        help="the storm's host tier copies asynchronously (copy_mode async, this async_seed)",
    )
    parser.add_argument("--servers", action="store_true", help="also the server phase")
    parser.add_argument("--second-user", type=int, default=None, help="uid of server B")
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="also run each completed request alone and compare its tokens and logprobs",
    )
    parser.add_argument("--records", default=None, help="write the storm's requests and outputs")
    parser.add_argument(
        "--check-records",
        default=None,
        help="no storm: run the oracle on the records of an earlier one (--records), in "
        "--runner's engines (a storm on Model Runner V2 checked by lone runs on V1)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    use_runner(args.runner)
    if args.check_records:
        with open(args.check_records) as f:
            records = json.load(f)
        # The storm's model: the one its records were made on.
        result = {
            "oracle": oracle_check(
                records, 1e-3, 1e-3, model=args.model, reselect_every=args.reselect_every
            )
        }
        _report(result, args.json)
        return
    if args.chaos:
        partial = f"{args.json}.partial" if args.json else None
        _report({"chaos": chaos_campaign(args.requests, args.seed, args.model, partial)}, args.json)
        return
    storm, records = abort_storm(
        args.requests,
        args.seed,
        args.model,
        args.policy,
        host_tier=args.runner == "v1" or args.async_copies is not None,
        device_blocks=args.device_blocks,
        reselect_every=args.reselect_every,
        host_copies=None
        if args.async_copies is None
        else {"copy_mode": "async", "async_seed": args.async_copies},
    )
    storm["runner"] = args.runner
    result = {"abort_storm": storm}
    if args.records:
        with open(args.records, "w") as f:
            json.dump(records, f)
    if args.oracle:
        result["oracle"] = oracle_check(
            records, 1e-3, 1e-3, model=args.model, reselect_every=args.reselect_every
        )
    if args.servers:
        result["servers"] = servers(args.seed, args.second_user)
    _report(result, args.json)


def _report(result: dict, path: str | None) -> None:
    print(json.dumps(result, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    raise SystemExit(0 if all(part["ok"] for part in result.values()) else 1)


if __name__ == "__main__":
    main()
