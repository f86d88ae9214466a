"""Attention sinks (gpt-oss): one learned logit per query head that takes a
share of each softmax's denominator and has no value vector.

With sinks s [Hq] (fp32), query head h's weights over its keys j are
exp(l_j - m) / (sum_j exp(l_j - m) + exp(s_h - m)), m = max(max_j l_j, s_h).
The sink is compared with the already scaled logits l_j = scale * q.k: it is
never multiplied by the softmax scale (vLLM's TRITON_ATTN starts its online
softmax at M = s_h, L = 1; CPU_ATTN's ``s_aux``; gpt-oss's reference
concatenates s_h to ``QK * sm_scale``).
"""

from __future__ import annotations

import torch


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of fp32 ``logits``; ``sinks`` (broadcast
    against logits.shape[:-1]) adds one term to each row's denominator.
    None: ``logits.softmax(-1)``. A row with every logit -inf gets zeros."""
    if sinks is None:
        return logits.softmax(dim=-1)
    lse = torch.logaddexp(logits.logsumexp(dim=-1), sinks.float())
    probs = logits - lse[..., None]  # one full-size temporary, as softmax's output
    return probs.exp_()
