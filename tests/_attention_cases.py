"""Shared helpers for attention tests: random problems and the float64 reference as oracle."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qkv import reference as R


@dataclass(frozen=True)
class Case:
    B: int
    H: int
    G: int
    L: int
    S: int
    E: int
    Ev: int

    def tensors(self, dtype: torch.dtype = torch.float64, seed: int = 0) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(self.B, self.H, self.L, self.E, generator=gen, dtype=torch.float64)
        k = torch.randn(self.B, self.G, self.S, self.E, generator=gen, dtype=torch.float64)
        v = torch.randn(self.B, self.G, self.S, self.Ev, generator=gen, dtype=torch.float64)
        return q.to(dtype), k.to(dtype), v.to(dtype)


def reference_mask(mask: object, L: int, S: int) -> np.ndarray | None:
    """A mask as the NumPy reference takes it (tensor or qkv.masks object rendered densely)."""
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        return mask.double().numpy() if mask.is_floating_point() else mask.numpy()
    return mask.to_dense(L, S).numpy()  # type: ignore[attr-defined]


def reference_forward_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object, d_out: torch.Tensor, scale: float | None = None
) -> tuple[R.Trace, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    L, S = q.shape[-2], k.shape[-2]
    trace = R.attention(q.double().numpy(), k.double().numpy(), v.double().numpy(), reference_mask(mask, L, S), scale)
    return trace, R.attention_grads(trace, d_out.double().numpy())
