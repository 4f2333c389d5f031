"""Softmax numerics shared by every path: the accumulation dtype (float32 at least, as
docs/design.md decides) and a softmax with explicit empty-row handling.

A row whose keys are all masked has a maximum of -inf; the textbook formula then computes
exp(-inf - (-inf)) = NaN. Here such a row gets zero weights and lse = -inf, and its
gradient is zero: the shift and the denominator are replaced by harmless constants (0 and 1)
before they are used, so no NaN appears in the forward or the backward pass.
"""

from __future__ import annotations

import torch

__all__ = ["accumulation_bytes", "accumulation_dtype", "causal_kernel_scale", "masked_softmax"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax state and accumulation happen in float32 at least (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulation_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of `accumulation_dtype` (the memory estimates' unit for scores)."""
    return torch.empty((), dtype=accumulation_dtype(dtype)).element_size()


def masked_softmax(scores: torch.Tensor, sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last axis of scores (..., S) where masked entries are -inf.

    Returns (weights (..., S), lse (...)), lse = log sum_j exp(scores_j), -inf for empty rows.

    ``sink`` (broadcastable to (..., 1)), an attention sink: one more logit in every row's
    denominator that carries no value, weights_j = exp(s_j - m) / (exp(sink - m) + sum_t
    exp(s_t - m)) with m the row max over the scores and the sink; the weights then sum to
    less than 1 and lse includes the sink. A row with no visible key stays empty (zero
    weights, lse = -inf, no gradient, to the sink neither).
    """
    row_max = scores.amax(dim=-1, keepdim=True).detach()  # (..., 1)
    empty = row_max == float("-inf")  # (..., 1)
    if sink is not None:
        row_max = torch.maximum(row_max, sink.detach())  # (..., 1): m over the scores and the sink
    shift = row_max.masked_fill(empty, 0.0)
    exponentials = torch.exp(scores - shift)  # (..., S), exactly 0 where masked
    sums = exponentials.sum(dim=-1, keepdim=True)  # (..., 1)
    if sink is not None:
        sums = sums + torch.exp(sink - shift)  # (..., 1)
    safe_sums = sums.masked_fill(empty, 1.0)
    weights = exponentials / safe_sums
    lse = (torch.log(safe_sums) + shift).masked_fill(empty, float("-inf"))
    return weights, lse.squeeze(-1)


def causal_kernel_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """q and scale rewritten for PyTorch's CPU flash kernel with ``is_causal``: the same scores
    scale * q.k, with a positive scale.

    That kernel writes -inf into q k^T for the hidden pairs *before* it multiplies by the scale,
    so a negative scale turns them into +inf and a zero scale into NaN (every row but the last
    becomes NaN). A negative scale is |scale| * (-q).k, exact; a zero scale is 1 * (0 q).k,
    which keeps 0 * inf = NaN where q is not finite. Differentiable: autograd carries the
    rewrite back to q.
    """
    if scale > 0.0:
        return q, scale
    if scale < 0.0:
        return -q, -scale
    return q * 0.0, 1.0
