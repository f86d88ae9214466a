"""RocketKV as pure functions on tensors (the reference path and the test oracle).

No vLLM imports here: the functions see plain tensors, one request at a time.
"""

from rocketkv_vllm.algorithm import kt_fp8
from rocketkv_vllm.algorithm.h2o import (
    h2o_accumulate,
    h2o_chunk_scores,
    h2o_keep_positions,
    h2o_scores,
)
from rocketkv_vllm.algorithm.hsa import hsa_page_probs, hsa_select_pages, sparse_attention
from rocketkv_vllm.algorithm.sinks import softmax_with_sinks
from rocketkv_vllm.algorithm.snapkv import (
    pool_scores,
    snapkv_keep_positions,
    window_attention_scores,
)
from rocketkv_vllm.algorithm.streaming import streaming_keep_positions

__all__ = [
    "h2o_accumulate",
    "h2o_chunk_scores",
    "h2o_keep_positions",
    "h2o_scores",
    "hsa_page_probs",
    "kt_fp8",
    "hsa_select_pages",
    "pool_scores",
    "snapkv_keep_positions",
    "softmax_with_sinks",
    "sparse_attention",
    "streaming_keep_positions",
    "window_attention_scores",
]
