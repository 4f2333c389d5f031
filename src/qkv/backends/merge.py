"""The exact merge of two partial softmaxes over disjoint key sets, by their log-sum-exp.

A partial result over keys K_a is its normalized output out_a and lse_a = log sum_{j in K_a}
exp(s_j). Over K_a and K_b together (FlashAttention's rescaling, Dao et al. 2022, algorithm 1):

    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

Used by the CPU block engine for rows whose keys are split over several pieces, and by ring
attention for the key blocks arriving from other ranks.

`merge_split` keeps each lse as two parts, a row offset and a moderate rest (lse = shift + rest):
a bias of -1e20 or finfo.min (padding) puts a row's lse out where float32 has no digits left
for log(number of keys), so one rounded lse per piece would give two pieces of such a row equal
weights (their outputs summed, not averaged). Offsets cancel before anything is exponentiated.
"""

from __future__ import annotations

import torch

__all__ = ["merge_partial", "merge_split"]

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


def merge_split(
    out: torch.Tensor, shift: torch.Tensor, rest: torch.Tensor, out_b: torch.Tensor, shift_b: torch.Tensor, rest_b: torch.Tensor
) -> None:
    """`merge_partial` on lse given in two parts, lse = shift + rest, in place.

    out, out_b: (..., R, Ev); shift, rest, shift_b, rest_b: (..., R). ``shift`` is a row offset
    of any size (the row's largest score, -inf for a row with no key yet), ``rest`` the moderate
    log-sum-exp relative to it. The merged offset is the larger one; only differences of
    offsets are exponentiated, so offsets near the float32 limits lose nothing.
    """
    top = torch.maximum(shift, shift_b)  # (..., R)
    top = top.masked_fill(top == _NEG_INF, 0.0)  # rows still empty: both parts stay -inf
    a = (shift - top).add_(rest)  # (..., R): this side's lse relative to the merged offset
    b = (shift_b - top).add_(rest_b)  # (..., R)
    merged = torch.logaddexp(a, b)  # (..., R)
    safe = merged.masked_fill(merged == _NEG_INF, 0.0)
    out.mul_((a - safe).exp_().unsqueeze(-1))  # (..., R, Ev) *= (..., R, 1)
    out.add_(out_b * (b - safe).exp_().unsqueeze(-1))  # (..., R, Ev)
    shift.copy_(top)
    rest.copy_(merged)
