"""ROCKETKV's state in a worker process, one object per engine.

The runner hooks (``vllm_patches``) record what vLLM tells the model runner
about requests; the attention builder and impl of the same engine read it.
Both sides reach the same ``WorkerState`` through the engine's
``VllmConfig`` object (``worker_state``), which the model runner hands to
its attention builders and sets as the current config while the model's
layers are built.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from rocketkv_vllm.requests import planned_budget


class WorkerRequests:
    """What the worker knows of each batch row's request beyond vLLM's
    attention metadata: its prompt length and its own token budget
    (``requests``), and whether the step is a dummy run.

    Model Runner V2 gives each row's slot in its request table
    (``CommonAttentionMetadata.req_idx``): budgets and prompt lengths are
    kept per slot, set when a request takes the slot (``v2_add``). The V1
    runner reorders its persistent batch in ``_update_states``: the rows'
    budgets are read off its order right after, and its prompt-length
    tensor, kept in that order, is remembered (``v1_after_update``).
    Dummy runs (profiling, CUDA graph capture, idle data-parallel ranks) are
    marked by the runner hooks (``dummy``): their rows are no requests.
    """

    def __init__(self) -> None:
        self.by_request: dict[str, int] = {}  # V1: requests with a budget
        self.rows: list[int | None] = []  # V1: this step's rows' budgets
        self.row_ids: list[str | None] = []  # V1: this step's rows' request ids
        self.by_slot: dict[int, int | None] = {}  # V2: budget by slot
        self.v2_generation: dict[int, int] = {}  # V2: requests that took each slot
        self._prompt_lens = np.full(0, -1, dtype=np.int64)  # V2: by slot
        self.v1_prompt_lens: torch.Tensor | None = None  # V1: the runner's, by row
        self.dummy = False  # the step being run is a dummy run
        # Called with the keys of requests that left the worker (V1: ids of
        # finished, aborted and preempted requests; V2: slots taken again),
        # for per-request buffers to be dropped (``backend.window``).
        self.on_leave: list[Callable[[Iterable[int | str]], None]] = []

    def _left(self, keys) -> None:
        if keys:
            for forget in self.on_leave:
                forget(keys)

    def v1_before_update(self, scheduler_output) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.by_request.pop(req_id, None)
        # A preempted request is recomputed from its start when resumed.
        self._left(
            set(scheduler_output.finished_req_ids) | (scheduler_output.preempted_req_ids or set())
        )
        for new in scheduler_output.scheduled_new_reqs:
            budget = planned_budget(new.sampling_params)
            if budget is None:
                self.by_request.pop(new.req_id, None)
            else:
                self.by_request[new.req_id] = budget

    def v1_after_update(self, req_ids: list[str | None], prompt_lens: torch.Tensor) -> None:
        """``prompt_lens``: the V1 input batch's persistent host tensor of
        prompt lengths by row (vLLM's ``num_prompt_tokens_cpu_tensor``)."""
        self.v1_prompt_lens = prompt_lens
        by_request = self.by_request
        self.rows = [by_request.get(r) for r in req_ids] if by_request else []
        self.row_ids = list(req_ids)

    def v2_add(self, scheduler_output, req_id_to_index: dict[str, int]) -> None:
        taken = []
        for new in scheduler_output.scheduled_new_reqs:
            slot = req_id_to_index.get(new.req_id)
            if slot is None:
                continue
            taken.append(slot)
            self.by_slot[slot] = planned_budget(new.sampling_params)
            self.v2_generation[slot] = self.v2_generation.get(slot, 0) + 1
            if slot >= self._prompt_lens.size:
                grown = np.full(max(2 * self._prompt_lens.size, slot + 1), -1, dtype=np.int64)
                grown[: self._prompt_lens.size] = self._prompt_lens
                self._prompt_lens = grown
            self._prompt_lens[slot] = new.prompt_len
        self._left(taken)

    def prompt_lens_for_slots(self, slots: np.ndarray) -> np.ndarray:
        """V2: each slot's prompt length, -1 where none was recorded."""
        out = np.full(slots.shape, -1, dtype=np.int64)
        known = slots < self._prompt_lens.size
        out[known] = self._prompt_lens[slots[known]]
        return out

    def budgets_for_slots(self, slots) -> list[int | None]:
        return [self.by_slot.get(s) for s in slots]

    def budgets_for_rows(self, cm) -> list[int | None]:
        n = cm.num_reqs
        if cm.req_idx is not None:
            return self.budgets_for_slots(np.asarray(cm.req_idx[:n]).tolist())
        rows = self.rows[:n]
        return rows + [None] * (n - len(rows))


class PromptLengths:
    """Each batch row's prompt length, on the host, from the runner hooks
    (``WorkerRequests``): under V1 the input batch's own tensor, under V2
    the length recorded when the row's request took its slot, so no step
    waits for the device. None for a dummy run (its rows are all dense). A
    V2 slot the hook has not seen (not expected) counts as a prompt too
    short to compress, counted in ``unknown_slots``.
    """

    def __init__(self, requests: WorkerRequests) -> None:
        self.requests = requests
        self.unknown_slots = 0

    def get(self, cm, num_reqs: int) -> np.ndarray | None:
        requests = self.requests
        if requests.dummy:
            return None
        if cm.req_idx is None:
            if requests.v1_prompt_lens is None:
                return None  # no step has run yet: a warm-up batch
            return requests.v1_prompt_lens[:num_reqs].numpy().astype(np.int64)
        slots = np.asarray(cm.req_idx[:num_reqs], dtype=np.int64)
        lens = requests.prompt_lens_for_slots(slots)
        unknown = lens < 0
        if unknown.any():
            self.unknown_slots += int(unknown.sum())
            lens[unknown] = 0
        return lens


@dataclass
class Counters:
    """Process-local counts (read by the benchmarks). Counting is always on
    (a few integer adds per step); timing Stage 1 needs a device sync on
    GPUs, so it is opt-in: ROCKETKV_TIMING=1."""

    prompts_compressed: int = 0
    prompt_tokens_evicted: int = 0  # per KV head
    decode_tokens_compressed: int = 0  # Stage 2 tokens (all layers count once)
    decode_selections_reused: int = 0  # ... that reused a selection (reselect_every)
    # Stage 1 calls (request x layer) that found their earlier window
    # queries gone and scored with this chunk's only (never expected)
    stage1_short_windows: int = 0
    # Stage 1 calls under keep_rule h2o whose scores missed a prompt chunk
    # (their buffer was gone) and kept by the chunks they hold (never expected)
    stage1_partial_h2o_scores: int = 0
    stage1_seconds: float = 0.0  # all layers, only with ROCKETKV_TIMING=1
    timing: bool = field(
        default_factory=lambda: os.environ.get("ROCKETKV_TIMING", "0") not in ("", "0"), repr=False
    )

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("timing")
        return d

    @contextmanager
    def stage1_timer(self, device: torch.device):
        if not self.timing:
            yield
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.stage1_seconds += time.perf_counter() - start


class WorkerState:
    def __init__(self) -> None:
        self.requests = WorkerRequests()
        # FULL CUDA graph guard (backend.graphs), set by the builder when this
        # engine's decode steps replay FULL graphs; the runner hooks read it.
        self.graph_guard = None
        self.counters = Counters()
        # The engine's ``backend.window.WindowQueries``, made by its first layer.
        self.window_queries = None
        # The engine's ``backend.h2o.H2OScores`` (keep_rule h2o), made by its first layer.
        self.h2o_scores = None
        # Test aid record_kept_positions: (prompt tokens, kept [Hkv, budget]) of
        # every Stage 1, one entry per layer, in layer order.
        self.kept_positions: list[tuple[int, torch.Tensor]] = []
        # ... and under keep_rule h2o the scores each kept by ([Hkv, N] fp32).
        self.kept_h2o_scores: list[torch.Tensor] = []
        # rocketkv.stage1_lead_layer: the Stage 1 rows of this step's layers
        # before the lead, by request key, each (impl, row, kv_cache, quant),
        # compacted by the lead layer's forward in the same step.
        self.stage1_followers: dict[int | str, list[tuple]] = {}


_WORKERS: dict[int, WorkerState] = {}


def worker_state(vllm_config) -> WorkerState:
    """The ``WorkerState`` of the engine this ``VllmConfig`` belongs to
    (created on first use; gone with the config object)."""
    key = id(vllm_config)
    state = _WORKERS.get(key)
    if state is None:
        state = _WORKERS[key] = WorkerState()
        weakref.finalize(vllm_config, _WORKERS.pop, key, None)
    return state


def existing_worker_state(vllm_config) -> WorkerState | None:
    """The state if a ROCKETKV builder or impl made one for this engine (so
    the runner hooks leave engines with other backends alone)."""
    return _WORKERS.get(id(vllm_config))
