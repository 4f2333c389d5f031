"""The gradient of the log-sum-exp through PyTorch's CPU flash-attention backward.

lse_i = log sum_j exp(s_ij), so d lse_i / d s_ij = p_ij and a loss that reads lse adds
dlse_i * p_ij to the gradient of every score. The flash backward (FlashAttention-2,
algorithm 2) computes, from the saved output O and lse,

    dS = P * (dP - delta),   dP = dO V^T,   delta_i = rowsum(dO_i * O_i),

so the lse term is dS = P * (dP - (delta - dlse)): it is enough to lower delta_i by dlse_i.
The kernel reads O only to form delta, so one extra head column does it exactly, with no
other change: q and k get a zero column (scores unchanged), v a zero column (dP unchanged),
the output the column -dlse and the output's gradient a column of ones; then
delta'_i = delta_i + 1 * (-dlse_i). The extra columns of dq, dk, dv are dropped.

The padded copies are made in the accumulation dtype (float32 for float16 / bfloat16 inputs,
whose values convert exactly), so dlse keeps float32 precision inside the kernel.

Reference: Dao, "FlashAttention-2" (2023), algorithm 2 (backward from the saved lse).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qkv.backends.softmax import accumulation_dtype

__all__ = ["with_lse_gradient"]


def with_lse_gradient(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (N, H, L, D), k and v (N, H, S, D), out and grad_out (N, H, L, D), grad_lse (N, H, L)
    -> the same with one more head column (D + 1), in the accumulation dtype, such that the
    flash backward of them returns the gradients of out and lse together (module docstring)."""
    acc = accumulation_dtype(q.dtype)
    pad = (0, 1)
    q_ = F.pad(q.to(acc), pad)  # (N, H, L, D + 1): zero column, scores unchanged
    k_ = F.pad(k.to(acc), pad)  # (N, H, S, D + 1)
    v_ = F.pad(v.to(acc), pad)  # (N, H, S, D + 1): zero column, dP unchanged
    out_ = torch.cat((out.to(acc), -grad_lse.to(acc).unsqueeze(-1)), dim=-1)  # (N, H, L, D + 1)
    ones = torch.ones(*grad_out.shape[:-1], 1, dtype=acc, device=grad_out.device)  # (N, H, L, 1)
    grad_out_ = torch.cat((grad_out.to(acc), ones), dim=-1)  # (N, H, L, D + 1)
    return q_, k_, v_, out_, grad_out_
