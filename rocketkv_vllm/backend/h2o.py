"""H2O's accumulated attention scores of prompts being prefilled
(``rocketkv.keep_rule="h2o"``, docs/keep-rules.md), carried from chunk to
chunk to the chunk with the prompt's end, where Stage 1 keeps by them.

One store per engine (``WorkerState.h2o_scores``), an fp32 ``[Hkv, N]``
buffer per request and layer, with the lifecycle of the observation-window
store (``backend.window``): a request's buffers are dropped when it leaves
the worker (finished, aborted, preempted: recompute starts again from its
first chunk), so the store holds at most one entry per running request.

Each chunk adds the attention its queries give every key so far
(``algorithm.h2o.h2o_accumulate``), the keys read from the paged cache
through the request's block row, in PyTorch on any device: a baseline,
O(N^2) in total. A buffer that missed a chunk (never expected) is counted
and Stage 1 keeps by what it holds; nothing raises inside a step.
"""

from __future__ import annotations

import torch

from rocketkv_vllm.algorithm.h2o import h2o_accumulate
from rocketkv_vllm.ops.pytorch import prompt_keys

# fp32 logits one accumulation call materialises at most ([Hkv, G*c, T]);
# longer chunks are split by queries (the same sum: docs/keep-rules.md).
MAX_LOGITS = 1 << 24


class H2OScores:
    def __init__(self) -> None:
        # request key (``PromptChunkRow.key``) -> layer -> [scores [Hkv, N],
        # next prompt position expected, whether every chunk so far was added]
        self._buffers: dict[int | str, dict[object, list]] = {}

    def __len__(self) -> int:
        return len(self._buffers)

    def add(self, layer, r, query, k_cache, scale: float, sinks=None) -> None:
        """Add this chunk's prompt queries (``query``: the step's [T, Hq, d])
        to the request's scores."""
        n = r.plan.num_prompt_tokens
        end = min(r.q_end, r.q_start + n - r.context_len)  # prompt tokens only
        q = query[r.q_start : end]
        layers = self._buffers.setdefault(r.key, {})
        entry = layers.get(layer)
        if entry is None:
            buf = torch.zeros(k_cache.shape[1], n, dtype=torch.float32, device=query.device)
            entry = layers[layer] = [buf, 0, True]
        if entry[1] != r.context_len:  # a chunk is missing (or came twice)
            entry[2] = False
        if q.shape[0] == 0:
            return
        total = r.context_len + q.shape[0]
        keys = prompt_keys(k_cache, r.block_row, total)
        step = max(1, MAX_LOGITS // (q.shape[1] * total))
        for a in range(0, q.shape[0], step):
            b = min(a + step, q.shape[0])
            h2o_accumulate(entry[0], q[a:b], keys[: r.context_len + b], scale, sinks)
        entry[1] = total

    def take(self, layer, r, query, k_cache, scale: float, sinks=None):
        """(the prompt's scores [Hkv, N], whether every prompt query is in
        them) after adding this chunk, the prompt's last; the buffer leaves
        the store."""
        self.add(layer, r, query, k_cache, scale, sinks)
        layers = self._buffers[r.key]
        scores, _, whole = layers.pop(layer)
        if not layers:
            del self._buffers[r.key]
        return scores, whole

    def forget(self, keys) -> None:
        """Drop the buffers of requests that left (finished, aborted,
        preempted) or whose V2 slot was taken again."""
        for key in keys:
            self._buffers.pop(key, None)
