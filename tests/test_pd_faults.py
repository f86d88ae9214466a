"""Disaggregated prefill and decode when something goes wrong (issue 60,
item 3): the decode engine D never pulls what the prefill engine P offered,
the pull fails, P is gone before D pulls, or D is vLLM without this
package. ROCKETKV on both sides (but in that last case), the
tiny model, compressed prompts (P offers the kept blocks only, with the
compression state), vLLM's NixlConnector in pull mode as in
``test_pd_nixl`` (whose helpers this module reuses).

One module fixture runs every case once, in order, on one oracle engine (a
single ROCKETKV engine, no connector) and one P/D pair whose P runs a short
KV lease (``kv_lease_duration``); P is shut down for the last case. Every
call into D runs in a thread with a wall-clock bound (a hang is recorded,
not waited for), P's reaping is driven with small local requests until a
deadline. The tests read the fixture's record.

What vLLM 0.32 does (observed on the CPU build, UCX loopback): a pull that
fails ends the request with finish reason "error" and no token
(``kv_load_failure_policy`` "fail", which ROCKETKV requires for a
compressed request); ``LLM.generate`` returns it like any other output, it
raises nothing. An engine nobody listens for fails its handshake after the
connector's 5 s receive timeout; blocks P does not have fail the transfer
setup at once (NIXL refuses the descriptors); a P that shut down fails it
at once too (NIXL_ERR_REMOTE_DISCONNECT). P frees offered blocks nobody
pulled when its lease runs out, and at once when D aborts a request before
pulling it (vLLM's D side notifies P of a request it will not pull). A
decode engine without this package pulls into a whole prompt's blocks and
vLLM's worker refuses fewer offered blocks than that (an assertion in its
prefix-caching trim, caught as a failed transfer): "error" again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ids_and_logprobs, make_llm, same_completion, shutdown
from test_pd_nixl import (
    MAX_TOKENS,
    PREFILL,
    ROCKETKV_SETTINGS,
    _free_blocks,
    _prompts,
    _sampling,
    _start_pair,
)

pytestmark = pytest.mark.engine

PLAIN_DECODE_CHILD = Path(__file__).with_name("pd_plain_decode_child.py")
LEASE = 12  # seconds P keeps blocks it offered and nobody pulled (D: its heartbeats, every 2 s)
BOUND = 90  # seconds any one call into D may take before it counts as a hang


def _bounded(fn, seconds: float = BOUND):
    """``fn()`` in a thread: (result, None, seconds taken), or (None, the
    exception, ...), or (None, "hang", seconds) if it has not returned."""
    box = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as err:  # recorded: the test asserts on it
            box["err"] = err

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    took = time.monotonic() - start
    if thread.is_alive():
        return None, "hang", took
    return box.get("out"), box.get("err"), took


def _outcome(out) -> dict:
    """What a RequestOutput of D says: its finish reason, tokens (and
    logprobs where it has them)."""
    o = out.outputs[0]
    rec = {"finish_reason": o.finish_reason, "token_ids": list(o.token_ids)}
    if o.token_ids and o.logprobs:
        rec["completion"] = ids_and_logprobs(out)
    return rec


def _prefill(prefill, prompts, names):
    """P's one token of each prompt, decoding elsewhere: the params P
    returned, by name."""
    outs = prefill.generate(
        [{"prompt_token_ids": prompts[n]} for n in names],
        _sampling(1, None, PREFILL["kv_transfer_params"]),
        use_tqdm=False,
    )
    return {n: dict(o.kv_transfer_params) for n, o in zip(names, outs)}


def _decode(decode, prompts, requests: dict):
    """D's batch, bounded: name -> (prompt name, kv params or None)."""
    names = list(requests)

    def run():
        return decode.generate(
            [{"prompt_token_ids": prompts[requests[n][0]]} for n in names],
            [_sampling(MAX_TOKENS, None, requests[n][1]) for n in names],
            use_tqdm=False,
        )

    outs, err, took = _bounded(run)
    if err is not None:
        return {"error": repr(err), "seconds": took}
    return {"seconds": took, **{n: _outcome(o) for n, o in zip(names, outs)}}


def _wait_free(prefill, prompts, start: int, deadline: float) -> float | None:
    """Drive P's steps (P reaps expired leases and reads D's notifications
    in its steps) with small local requests until its free block count is
    back at ``start``: the time it was, or None past ``deadline``."""
    while time.monotonic() < deadline:
        if _free_blocks(prefill) == start:
            return time.monotonic()
        prefill.generate(
            [{"prompt_token_ids": prompts["probe"]}], _sampling(2, logprobs=None), use_tqdm=False
        )
        time.sleep(0.05)
    return time.monotonic() if _free_blocks(prefill) == start else None


def _decode_free(decode, seconds: float = 15.0) -> bool:
    """D holds no block (its prefix-cache reset succeeds), polled while D's
    processes finish what they were told."""
    deadline = time.monotonic() + seconds
    while True:
        free, err, _ = _bounded(decode.reset_prefix_cache, 30)
        if err is None and free:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def _plain_decode(model: str, folder, requests) -> dict:
    """``requests`` ((prompt ids, kv params or None), ...) in one batch of a
    decode engine without this package (``pd_plain_decode_child.py``)."""
    from vllm.utils.network_utils import get_open_port

    src, out = folder / "requests.json", folder / "out.json"
    src.write_text(json.dumps([{"prompt": p, "kv": kv} for p, kv in requests]))
    env = dict(os.environ, VLLM_NIXL_SIDE_CHANNEL_PORT=str(get_open_port()))
    proc = subprocess.run(
        [sys.executable, str(PLAIN_DECODE_CHILD), model, str(src), str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def faults(tiny, tokenizer, tmp_path_factory):
    from vllm.utils.network_utils import get_open_port

    prompts = _prompts(tokenizer)
    rec = {"lease": LEASE}
    local = ("c300", "short", "probe")
    llm = make_llm(tiny, "ROCKETKV", ROCKETKV_SETTINGS)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": prompts[n]} for n in local],
            _sampling(MAX_TOKENS),
            use_tqdm=False,
        )
        rec["single"] = {n: ids_and_logprobs(o) for n, o in zip(local, outs)}
    finally:
        shutdown(llm)
    # both leases set: P's, how long it holds an offer; D's, its heartbeats
    # come every sixth of it and it refuses what arrives too late for one
    prefill, decode = _start_pair(tiny, "ROCKETKV", ROCKETKV_SETTINGS, lease=LEASE)
    try:
        start = rec["start"] = _free_blocks(prefill)
        # 1. D never pulls: P holds the kept blocks it offered until its
        # lease runs out, then frees them in a step.
        prefilled = time.monotonic()  # P's lease starts in this call
        (lost,) = _prefill(prefill, prompts, ["c600"]).values()
        rec["lost_offered"] = len(lost["remote_block_ids"][0])
        rec["lost_held"] = start - _free_blocks(prefill)
        rec["lost_compressed"] = "rocketkv" in lost
        freed = _wait_free(prefill, prompts, start, prefilled + LEASE + 30)
        rec["lost_freed_after"] = None if freed is None else freed - prefilled
        # ... and D, given those params after the lease, refuses them (the
        # blocks may hold another request's K/V now) before it pulls.
        rec["late"] = _decode(decode, prompts, {"late": ("c600", lost)})

        # 3. Failed transfers beside a good one, in one batch of D's: P's
        # params pointing at an engine nobody listens for, and at blocks P
        # does not have; a pulled request and a local one served as usual.
        params = _prefill(prefill, prompts, ["c300", "c230", "c150"])
        nowhere = dict(params["c230"], remote_engine_id="nowhere", remote_port=get_open_port())
        beyond = dict(params["c150"])
        beyond["remote_block_ids"] = [[10**6 + i for i in beyond["remote_block_ids"][0]]]
        rec["batch"] = _decode(
            decode,
            prompts,
            {
                "good": ("c300", params["c300"]),
                "local": ("short", None),
                "nowhere": ("c230", nowhere),
                "beyond": ("c150", beyond),
            },
        )
        rec["batch_decode_free"] = _decode_free(decode)
        # An offer one block short (a client's doing): refused when it
        # arrives, and D serves on (the cases below); its scheduler would
        # have failed on it.
        short = dict(params["c300"], remote_block_ids=[params["c300"]["remote_block_ids"][0][:-1]])
        short["rocketkv"] = dict(short["rocketkv"], offered_at=time.time())
        rec["short_offer"] = _decode(decode, prompts, {"short": ("c300", short)})
        # P held c230's and c150's kept blocks for pulls that never came.
        freed = _wait_free(prefill, prompts, start, time.monotonic() + LEASE + 30)
        rec["batch_prefill_free"] = freed is not None

        # 1b. D aborts a request before it pulls (or while it does): D
        # holds nothing after, P gets its blocks back.
        before = _free_blocks(prefill)
        (aborted,) = _prefill(prefill, prompts, ["evicted"]).values()
        prefilled = time.monotonic()
        rec["abort_held"] = before - _free_blocks(prefill)
        # D busy with a local request's prefill while the request and its
        # abort arrive: D's engine core takes both in between two steps,
        # before it schedules the request (P's own lease would free them
        # otherwise only after LEASE seconds).
        engine = decode.llm_engine
        engine.add_request("busy", {"prompt_token_ids": prompts["c600"]}, _sampling(16))
        time.sleep(0.2)
        engine.add_request(
            "abort-me",
            {"prompt_token_ids": prompts["evicted"]},
            _sampling(MAX_TOKENS, None, aborted),
        )
        engine.abort_request(["abort-me"])

        def drain():
            while engine.has_unfinished_requests():
                engine.step()

        rec["abort_drained"] = _bounded(drain)[1] is None
        rec["abort_decode_free"] = _decode_free(decode)
        freed = _wait_free(prefill, prompts, before, prefilled + LEASE + 30)
        rec["abort_freed_after"] = None if freed is None else freed - prefilled

        # 4. A decode engine without this package (vLLM alone, in a process
        # of its own) given a compressed offer, beside a local request.
        before = _free_blocks(prefill)
        (plain,) = _prefill(prefill, prompts, ["c600"]).values()
        prefilled = time.monotonic()
        rec["plain_compressed"] = "rocketkv" in plain
        rec["plain"] = _plain_decode(
            tiny,
            tmp_path_factory.mktemp("plain"),
            [(prompts["c600"], plain), (prompts["short"], None)],
        )
        # vLLM's D heartbeats P's lease while it holds the request
        ended = time.monotonic()
        freed = _wait_free(prefill, prompts, before, ended + LEASE + 30)
        rec["plain_decode_s"] = ended - prefilled
        rec["plain_prefill_free_after"] = None if freed is None else freed - ended

        # 2. P gone before D pulls: P prefilled and returned its params,
        # then shut down (its NIXL agent gone), then D gets the request.
        (orphan,) = _prefill(prefill, prompts, ["kept"]).values()
        rec["orphan_compressed"] = "rocketkv" in orphan
        shutdown(prefill)
        prefill = None
        # The shutdown takes seconds (15 s under load): hand the params on as
        # if at once, or D refuses them for P's lease before any pull.
        orphan["rocketkv"] = dict(orphan["rocketkv"], offered_at=time.time())
        rec["orphan"] = _decode(decode, prompts, {"orphan": ("kept", orphan)})
        rec["orphan_decode_free"] = _decode_free(decode)
        rec["after"] = _decode(decode, prompts, {"probe": ("probe", None), "c300": ("c300", None)})
        rec["after_decode_free"] = _decode_free(decode)
    finally:
        shutdown(decode)
        if prefill is not None:
            shutdown(prefill)
    return rec


def _errored(outcome: dict) -> bool:
    """D gave up on the request: vLLM's finish reason "error" (its KV load
    failure policy "fail"), and no token."""
    return outcome["finish_reason"] == "error" and not outcome["token_ids"]


def test_prefill_frees_what_nobody_pulled_after_its_lease(faults):
    """P prefilled a compressed prompt for D and D never pulled it: P held
    exactly the kept blocks it offered, and has them back once its lease
    ran out (not before), within a few seconds of it. Those params sent to
    D afterwards are refused by name (vLLM's pull would read blocks P may
    have reused)."""
    rec = faults
    assert rec["lost_compressed"]
    assert rec["lost_held"] == rec["lost_offered"] > 0
    took = rec["lost_freed_after"]
    assert took is not None, "P still holds the blocks it offered"
    assert rec["lease"] <= took < rec["lease"] + 15, took
    # D refuses the request when it arrives, naming the field and the lease
    assert "offered_at" in rec["late"].get("error", ""), rec["late"]
    assert "kv_lease_duration 12" in rec["late"]["error"], rec["late"]


def test_decode_abort_before_the_pull_leaks_nothing(faults):
    """D got P's params and aborted the request at once: D holds no block,
    and P got its blocks back before its lease ran out: D told it (vLLM's
    D side notifies P of a request it will not pull, or of the pull it
    finished)."""
    assert faults["abort_held"] > 0 and faults["abort_drained"]
    assert faults["abort_decode_free"]
    took = faults["abort_freed_after"]
    assert took is not None and took < faults["lease"] - 0.5, took


def test_failed_pulls_error_their_requests_and_spare_the_batch(faults):
    """In one batch of D's: a compressed request whose params name an
    engine nobody serves (the handshake times out) and one naming blocks P
    does not have end with vLLM's "error" finish reason and no token, in
    bounded time; the pulled request beside them and a local one equal the
    single engine's tokens and logprobs; D holds no block afterwards, and P
    none of the blocks it offered for the failed pulls."""
    batch, single = faults["batch"], faults["single"]
    assert "error" not in batch, batch.get("error")
    assert batch["seconds"] < 60, batch["seconds"]
    assert _errored(batch["nowhere"]), batch["nowhere"]
    assert _errored(batch["beyond"]), batch["beyond"]
    assert same_completion(batch["good"]["completion"], single["c300"]), batch["good"]
    assert same_completion(batch["local"]["completion"], single["short"]), batch["local"]
    assert faults["batch_decode_free"]
    assert faults["batch_prefill_free"]
    # params whose block list does not match the plan are refused by name
    # when they arrive (D serves on: every case after this one)
    assert "kv_transfer_params.remote_block_ids" in faults["short_offer"].get("error", "")


def test_prefill_gone_before_the_pull(faults):
    """P prefilled a compressed prompt, returned its params and shut down;
    then D got the request: it ends with vLLM's "error" finish reason and
    no token (no wrong answer, no hang), D holds no block after it, and
    still serves fresh local requests as the single engine does."""
    assert faults["orphan_compressed"]
    orphan = faults["orphan"]
    assert "error" not in orphan, orphan.get("error")
    assert orphan["seconds"] < 60, orphan["seconds"]
    assert _errored(orphan["orphan"]), orphan["orphan"]
    assert faults["orphan_decode_free"]
    after, single = faults["after"], faults["single"]
    assert "error" not in after, after.get("error")
    for name in ("probe", "c300"):
        assert same_completion(after[name]["completion"], single[name]), (name, after[name])
    assert faults["after_decode_free"]


def test_decode_engine_without_the_package_errors_the_compressed_request(faults):
    """A ROCKETKV P's compressed offer sent to a decode engine that never
    installed this package (vLLM alone, its own backend): vLLM's pull finds
    fewer offered blocks than the prompt's and fails the transfer, so the
    request ends with "error" and no token, never with tokens decoded from
    compacted K/V it cannot read; the local request beside it is served,
    and P gets the offered blocks back (after its lease)."""
    assert faults["plain_compressed"]
    plain = faults["plain"]
    assert plain["rocketkv_modules"] == []  # nothing of ours ran there
    compressed, local = plain["outputs"]
    assert _errored(compressed), compressed
    assert local["finish_reason"] == "length" and len(local["token_ids"]) == 8, local
    assert faults["plain_prefill_free_after"] is not None, faults["plain_decode_s"]
