"""Worker half of the host tier on NVIDIA: vLLM's CUDA worker plus the one
ordering rule it lacks for ROCKETKV (docs/design.md, "Host tier under
asynchronous copies", rule (a)): before a step's forward, the compute stream
waits on the CUDA event of the store the scheduler half names
(``RocketKVHostMetadata.wait_store_event``: the latest pending store of a
block that step's Stage 1 writes), so compaction runs after that store has
read the block's dense K/V. The CPU worker waits for its copy thread instead
(``async_cpu_worker``).

The connector adopts it for every engine on CUDA that runs the host tier
(ROCKETKV engines: ``select_host_tier_connector``; a dense engine naming the
connector waits for nothing). Interpreted on CPU with fake streams and events
(tests/test_host_tier_async.py); not yet run on a device: the GPU check's
host-tier test (tests/test_gpu.py, docs/gpu-check.md) is its first run.
"""

from __future__ import annotations

import time

import torch
from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

# The copy thread records a store's event right after it launches the copy
# (no device wait): seconds would already mean it is stuck.
RECORD_TIMEOUT_S = 60.0


class HostTierCudaWorker(SimpleCPUOffloadWorker):
    """vLLM's ``SimpleCPUOffloadWorker`` (its instance's class is swapped:
    ``adopt``) whose compute stream waits for the stores the step names."""

    @classmethod
    def adopt(cls, worker: SimpleCPUOffloadWorker) -> HostTierCudaWorker:
        worker.__class__ = cls
        worker.waits = []  # store events the compute stream waited on (tests read it)
        return worker

    def bind_connector_metadata(self, metadata) -> None:
        super().bind_connector_metadata(metadata)
        wait = getattr(metadata, "wait_store_event", -1)
        if wait > self._store_hwm:
            event = self._recorded_store_event(wait)
            if event is not None:
                # Orders the forward's kernels (Stage 1's compaction among
                # them) after the store's copy on the store stream.
                torch.cuda.current_stream().wait_event(event)
                self.waits.append(wait)

    def _recorded_store_event(self, event_idx: int):
        """The CUDA event recorded after store ``event_idx``'s copy, or after a
        later store on the same stream (stream order covers it); None once
        the store is known complete. The copy thread records it right after
        launching the copy, from the queue the store entered in an earlier
        step: waiting here is for the thread, never for the copy, and a wait
        on an event not yet recorded would not wait at all. A copy thread
        that died, or no record within ``RECORD_TIMEOUT_S``, stops the step
        with an error naming the store: compacting without the wait would
        cache compacted K/V under a dense hash (a wrong answer later)."""
        deadline = time.monotonic() + RECORD_TIMEOUT_S
        while True:
            for idx, event in list(self._store_events):
                if idx >= event_idx:
                    return event
            if self._store_hwm >= event_idx:
                return None
            thread = getattr(self._backend, "_thread", None)
            if thread is not None and not thread.is_alive():
                raise RuntimeError(
                    f"host tier: store {event_idx} was never recorded: vLLM's copy thread "
                    "has stopped (see the error it logged)"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"host tier: store {event_idx} not recorded by the copy thread within "
                    f"{RECORD_TIMEOUT_S:.0f} s (stores recorded up to "
                    f"{max((i for i, _ in self._store_events), default=self._store_hwm)})"
                )
            time.sleep(0.0001)
