"""The exact merge of two partial softmaxes over disjoint key sets, by their log-sum-exp.

A partial result over keys K_a is its normalized output out_a and lse_a = log sum_{j in K_a}
exp(s_j). Over K_a and K_b together (FlashAttention's rescaling, Dao et al. 2022, algorithm 1):

    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

Used by the CPU block engine for rows whose keys are split over several pieces, and by ring
attention for the key blocks arriving from other ranks.
"""

from __future__ import annotations

import torch

__all__ = ["merge_partial"]

_NEG_INF = float("-inf")


def merge_partial(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """In place: (out, lse) <- the softmax over both key sets of (out, lse) and (out_b, lse_b).

    out, out_b: (..., R, Ev); lse, lse_b: (..., R), float32 or wider. A running lse of -inf
    (no key seen yet) takes the other result as it is; two -inf give zeros, never NaN.
    """
    merged = torch.logaddexp(lse, lse_b)  # (..., R)
    shift = merged.masked_fill(merged == _NEG_INF, 0.0)  # rows still empty: both weights are exp(-inf) = 0
    out.mul_((lse - shift).exp_().unsqueeze(-1))  # (..., R, Ev) *= (..., R, 1)
    out.add_(out_b * (lse_b - shift).exp_().unsqueeze(-1))  # (..., R, Ev)
    lse.copy_(merged)
