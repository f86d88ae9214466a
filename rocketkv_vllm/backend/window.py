"""The observation-window queries of prompts whose window spans several
prefill chunks, carried from the chunks that hold them to the chunk with
the prompt's end, where Stage 1 scores the prompt with them.

One store per engine (``WorkerState.window_queries``), a buffer per
request and layer. A request's buffers are dropped when it leaves the
worker: finished, aborted or preempted (V1: the ids vLLM's scheduler
sends; V2: when its slot is taken again), so the store holds at most one
entry per running request and none is ever evicted to make room.
"""

from __future__ import annotations

import torch


class WindowQueries:
    def __init__(self, window_size: int) -> None:
        self.window_size = window_size
        # request key (``PromptChunkRow.key``) -> layer -> [window_size, H, d]
        self._buffers: dict[int | str, dict[object, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._buffers)

    def _here(self, r, query):
        """(window offset of the first, queries) of this chunk's window part."""
        n = r.plan.num_prompt_tokens
        window_start = n - self.window_size
        end = min(r.q_end, r.q_start + n - r.context_len)
        first = max(r.q_start, r.q_start + window_start - r.context_len)
        return r.context_len + first - r.q_start - window_start, query[first:end]

    def keep(self, layer, r, query) -> None:
        """Remember this chunk's queries that fall in the prompt's window."""
        offset, q = self._here(r, query)
        layers = self._buffers.setdefault(r.key, {})
        buf = layers.get(layer)
        if buf is None:
            buf = layers[layer] = q.new_zeros(self.window_size, *q.shape[1:])
        buf[offset : offset + q.shape[0]] = q

    def take(self, layer, r, query) -> tuple[torch.Tensor, bool]:
        """(the window queries Stage 1 scores with, whether all w are there):
        earlier chunks' from the buffer and this chunk's. Without the buffer
        (never expected: see the module's doc) this chunk's part alone, a
        shorter window, rather than stopping the engine."""
        offset, here = self._here(r, query)
        if offset == 0:
            return here, True
        layers = self._buffers.get(r.key)
        earlier = None if layers is None else layers.pop(layer, None)
        if layers is not None and not layers:
            del self._buffers[r.key]
        if earlier is None:
            return here, False
        return torch.cat([earlier[:offset], here]), True

    def forget(self, keys) -> None:
        """Drop the buffers of requests that left (finished, aborted,
        preempted) or whose V2 slot was taken again."""
        for key in keys:
            self._buffers.pop(key, None)
