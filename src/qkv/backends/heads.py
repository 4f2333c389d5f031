"""Grouped-query attention bookkeeping shared by the kernels: key/value heads served to
several query heads, and their gradients gathered back.

Head h of H reads key/value head h // (H // G) (docs/design.md), so copies of kv head g sit at
query heads g*r .. g*r + r - 1 with r = H // G.
"""

from __future__ import annotations

import torch

__all__ = ["expand_kv_heads", "sum_kv_heads"]


def expand_kv_heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """(N, G, S, D) -> (N, H, S, D) for kernels that want one key/value head per query head."""
    N, G, S, D = x.shape
    if G == H:
        return x
    return x.unsqueeze(2).expand(N, G, H // G, S, D).reshape(N, H, S, D)  # (N, H, S, D)


def sum_kv_heads(grad: torch.Tensor, G: int) -> torch.Tensor:
    """(N, H, S, D) -> (N, G, S, D): the gradient of an expanded head, summed over its copies."""
    N, H, S, D = grad.shape
    if G == H:
        return grad
    return grad.reshape(N, G, H // G, S, D).sum(dim=2)  # (N, G, S, D)
