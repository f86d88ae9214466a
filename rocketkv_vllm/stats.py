"""Process-local ROCKETKV counters (read by the benchmarks).

Counting is always on (a few integer adds per step). Timing Stage 1 needs a
device sync on GPUs, so it is opt-in: set ROCKETKV_TIMING=1.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch


@dataclass
class Counters:
    prompts_compressed: int = 0
    prompt_tokens_evicted: int = 0  # per KV head
    decode_tokens_compressed: int = 0  # Stage 2 tokens (all layers count once)
    stage1_seconds: float = 0.0  # all layers, only with ROCKETKV_TIMING=1

    def as_dict(self) -> dict:
        return asdict(self)


COUNTERS = Counters()
TIMING = os.environ.get("ROCKETKV_TIMING", "0") not in ("", "0")


def reset() -> None:
    global COUNTERS
    COUNTERS = Counters()


@contextmanager
def stage1_timer(device: torch.device):
    if not TIMING:
        yield
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    COUNTERS.stage1_seconds += time.perf_counter() - start
