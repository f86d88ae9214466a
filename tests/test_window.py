"""The window-query store (``backend/window.py``) and the runner hooks that
drop a request's buffers when it leaves the worker (``state``): no engine.
The engine cases (aborts mid-window on both runners) are in
test_model_runner_v2."""

from types import SimpleNamespace

import torch

from rocketkv_vllm.backend.window import WindowQueries
from rocketkv_vllm.state import WorkerState

W = 8  # window
N = 40  # prompt tokens: the window is tokens 32..39


def _row(key, context_len, q_len, q_start=0):
    plan = SimpleNamespace(num_prompt_tokens=N)
    return SimpleNamespace(
        key=key, q_start=q_start, q_end=q_start + q_len, context_len=context_len, plan=plan
    )


def _queries(first_token, count):
    """Queries [count, 1, 1] whose value is their token position."""
    return torch.arange(first_token, first_token + count, dtype=torch.float32).view(-1, 1, 1)


def test_a_window_across_chunks_comes_back_whole():
    store = WindowQueries(W)
    store.keep("layer", _row("a", 0, 35), _queries(0, 35))  # tokens 0..34: 32..34 in the window
    window, whole = store.take("layer", _row("a", 35, 5), _queries(35, 5))
    assert whole
    assert window.flatten().tolist() == list(range(32, 40))
    assert len(store) == 0  # taken: nothing left behind


def test_buffers_are_per_request_and_layer_and_never_evicted():
    store = WindowQueries(W)
    for key in range(50):  # far more than any max_num_seqs
        for layer in ("l0", "l1"):
            store.keep(layer, _row(key, 0, 35), _queries(0, 35) + key)
    assert len(store) == 50
    window, whole = store.take("l1", _row(7, 35, 5), _queries(35, 5) + 7)
    assert whole and window.flatten().tolist() == [t + 7 for t in range(32, 40)]


def test_a_lost_buffer_scores_with_this_chunk_alone():
    store = WindowQueries(W)
    window, whole = store.take("layer", _row("gone", 35, 5), _queries(35, 5))
    assert not whole
    assert window.flatten().tolist() == list(range(35, 40))


def test_v1_hook_drops_finished_aborted_and_preempted_requests():
    state = WorkerState()
    store = WindowQueries(W)
    state.requests.on_leave.append(store.forget)
    for key in ("done", "aborted", "preempted", "running"):
        store.keep("layer", _row(key, 0, 35), _queries(0, 35))
    out = SimpleNamespace(
        finished_req_ids={"done", "aborted"},  # vLLM reports aborts as finished
        preempted_req_ids={"preempted"},
        scheduled_new_reqs=[],
    )
    state.requests.v1_before_update(out)
    assert len(store) == 1
    assert store.take("layer", _row("running", 35, 5), _queries(35, 5))[1]


def test_v2_hook_drops_a_slot_taken_again():
    state = WorkerState()
    store = WindowQueries(W)
    state.requests.on_leave.append(store.forget)
    store.keep("layer", _row(3, 0, 35), _queries(0, 35))
    store.keep("layer", _row(4, 0, 35), _queries(0, 35))
    new = SimpleNamespace(req_id="x", sampling_params=None, prompt_len=N)
    state.requests.v2_add(SimpleNamespace(scheduled_new_reqs=[new]), {"x": 3})
    assert store.take("layer", _row(3, 35, 5), _queries(35, 5))[1] is False
    assert store.take("layer", _row(4, 35, 5), _queries(35, 5))[1] is True
