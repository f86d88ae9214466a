"""Worker half of the host tier on vLLM's CPU build, asynchronous in time as
vLLM's CUDA worker is (``kv_connector_extra_config: {"copy_mode": "async"}``).

vLLM's CUDA worker issues a step's loads and stores on their own streams and
reports them done steps later, through its event high-water marks
(``SimpleCPUOffloadWorker.get_finished``: loads as finished requests, stores
as worker metadata). This worker keeps that completion path unchanged and
replaces the streams: each copy gets a seeded delay of 0 to
``async_max_delay_steps`` steps, is handed to a background thread at the
start of the step it is due in (so it runs while that step's forward does),
and is reported done in that step, only once the thread has copied it. A
stream's copies complete in issue order (``ordering.due_step``).

The ordering rules it needs (``ordering``): before a step's forward it waits
for the stores the scheduler half names (``RocketKVHostMetadata.wait_store_event``:
stores of blocks that forward's Stage 1 writes), as a CUDA worker would make
the compute stream wait on those stores' events; on preemption it finishes
everything in flight, as vLLM's worker does.
"""

from __future__ import annotations

import queue
import random
import threading
from collections import deque
from dataclasses import dataclass, field

from rocketkv_vllm.host_tier.cpu_worker import HostCopyWorker, copy_blocks
from rocketkv_vllm.host_tier.ordering import CopySettings, due_step


@dataclass(eq=False)
class _Copy:
    """One load or store event's block copy."""

    event: int
    is_store: bool
    due: int  # the step it completes in (earlier if waited for)
    src_ids: list[int]
    dst_ids: list[int]
    submitted: bool = False  # handed to the copy thread
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class AsyncHostCopyWorker(HostCopyWorker):
    """``HostCopyWorker``'s copies on a background thread, each completing a
    seeded number of steps after its issue (module docstring)."""

    def __init__(self, *args, settings: CopySettings, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings
        self._rng = random.Random(settings.seed)
        self._step = 0  # steps bound so far (bind_connector_metadata)
        self._copies: dict[bool, deque[_Copy]] = {False: deque(), True: deque()}
        self._last_due = {False: -1, True: -1}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # Store events waited for before a forward, by step (tests read it).
        self.waits: list[tuple[int, int]] = []

    # -- the step's calls (vLLM's worker order) ------------------------------

    def bind_connector_metadata(self, metadata) -> None:
        super().bind_connector_metadata(metadata)
        self._step += 1
        self._submit_due()
        wait = getattr(metadata, "wait_store_event", -1)
        if wait >= 0:
            self.wait_for_stores(wait)

    def start_load_kv(self) -> None:
        meta = self._connector_metadata
        if meta is not None and meta.load_cpu_blocks:
            self._issue(False, meta.load_event, meta.load_cpu_blocks, meta.load_gpu_blocks)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if meta is not None and meta.store_gpu_blocks:
            self._issue(True, meta.store_event, meta.store_gpu_blocks, meta.store_cpu_blocks)

    def _poll_stream_events(self, is_store: bool) -> int:
        """vLLM's ``get_finished`` asks each stream's high-water mark: the
        latest event of the stream's leading run of copies that are due (or
        waited for) and copied. Copies due are waited for here, so a copy
        completes exactly in the step it is due in."""
        copies = self._copies[is_store]
        hwm = self._store_hwm if is_store else self._load_hwm
        while copies and copies[0].submitted:
            hwm = self._finish(copies.popleft())
        if is_store:
            self._store_hwm = hwm
        else:
            self._load_hwm = hwm
        return hwm

    def _flush_and_sync_all(self) -> None:
        """vLLM calls it on a step with preemptions: everything in flight
        completes now (and is reported in this step)."""
        for copies in self._copies.values():
            for copy in copies:
                copy.due = min(copy.due, self._step)
        self._submit_due()
        for copies in self._copies.values():
            for copy in copies:
                copy.done.wait()

    # -- the ordering hook ---------------------------------------------------

    def wait_for_stores(self, event: int) -> None:
        """Finish every store issued up to ``event`` now (before this step's
        forward writes into their blocks); reported in this step."""
        self.waits.append((self._step, event))
        stores = [c for c in self._copies[True] if c.event <= event]
        for copy in stores:
            copy.due = min(copy.due, self._step)
        self._submit_due()
        for copy in stores:
            copy.done.wait()

    # -- copies ----------------------------------------------------------------

    def _issue(self, is_store: bool, event: int, src_ids, dst_ids) -> None:
        assert self.cpu_kv_caches is not None and self.gpu_kv_caches is not None
        delay = self._rng.randint(0, self.settings.max_delay_steps)
        due = due_step(self._step, delay, self._last_due[is_store])
        self._last_due[is_store] = due
        self._copies[is_store].append(_Copy(event, is_store, due, list(src_ids), list(dst_ids)))
        self._submit_due()

    def _submit_due(self) -> None:
        """Hand every copy due by this step to the thread, in each stream's order."""
        for copies in self._copies.values():
            for copy in copies:
                if copy.submitted:
                    continue
                if copy.due > self._step:
                    break  # a stream's later copies are due no earlier
                copy.submitted = True
                self._start_thread()
                self._queue.put(copy)

    def _finish(self, copy: _Copy) -> int:
        copy.done.wait()
        if copy.error is not None:
            raise RuntimeError(
                f"host tier: {'store' if copy.is_store else 'load'} event {copy.event} failed"
            ) from copy.error
        return copy.event

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._copy_loop, name="rocketkv-host-copies", daemon=True
            )
            self._thread.start()

    def _copy_loop(self) -> None:
        while True:
            copy = self._queue.get()
            if copy is None:
                return
            try:
                src, dst = self.gpu_kv_caches, self.cpu_kv_caches
                if not copy.is_store:
                    src, dst = dst, src
                copy_blocks(src, dst, copy.src_ids, copy.dst_ids)
            except BaseException as error:  # reported by the step that finishes it
                copy.error = error
            finally:
                copy.done.set()
