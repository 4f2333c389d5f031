"""The one mask vocabulary of qkv: True = may attend, everywhere.

A mask object describes which keys each query may see without materializing the L x S
matrix. `to_dense(L, S)` renders it as a boolean tensor of shape (B | 1, H | 1, L, S)
for the explicit paths and for tests; the fast paths use its structure instead.

Causal alignment is bottom-right when L != S: query i sits at absolute position
i + S - L, so a decoding step (L = 1) sees the whole cache. With L = 2, S = 4::

    bottom-right (default)    top-left (PyTorch's is_causal)
        k0 k1 k2 k3               k0 k1 k2 k3
    q0   1  1  1  .           q0   1  .  .  .
    q1   1  1  1  1           q1   1  1  .  .

When L > S bottom-right alignment leaves the first L - S queries with no visible key:
their output rows are zeros (see `qkv.attention`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["Causal", "Dense", "Mask", "causal", "dense"]

Align = Literal["bottom-right", "top-left"]


class Mask(ABC):
    """Base class of structured masks. Combine with ``&`` (both allow) and ``|`` (either allows)."""

    @abstractmethod
    def to_dense(self, L: int, S: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Render as a bool tensor (B | 1, H | 1, L, S), True = may attend."""

    def __and__(self, other: Mask) -> Mask:
        return _combine("and", self, other)

    def __or__(self, other: Mask) -> Mask:
        return _combine("or", self, other)


def _combine(op: Literal["and", "or"], left: object, right: object) -> Mask:
    if not isinstance(left, Mask) or not isinstance(right, Mask):
        raise TypeError(
            f"masks combine only with other qkv.masks objects, got {type(left).__name__} "
            f"and {type(right).__name__}; wrap a tensor with qkv.masks.dense(tensor)"
        )
    return Combined(op, left, right)


@dataclass(frozen=True)
class Combined(Mask):
    """Two masks joined by ``&`` or ``|``."""

    op: Literal["and", "or"]
    left: Mask
    right: Mask

    def to_dense(self, L: int, S: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        a = self.left.to_dense(L, S, device=device)
        b = self.right.to_dense(L, S, device=device)
        return (a & b) if self.op == "and" else (a | b)


@dataclass(frozen=True)
class Causal(Mask):
    """A query may see keys at its own absolute position and before."""

    align: Align = "bottom-right"

    def offset(self, L: int, S: int) -> int:
        """Absolute position of query 0: S - L bottom-right, 0 top-left."""
        return S - L if self.align == "bottom-right" else 0

    def to_dense(self, L: int, S: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        q_pos = torch.arange(L, device=device)[:, None] + self.offset(L, S)  # (L, 1)
        k_pos = torch.arange(S, device=device)[None, :]  # (1, S)
        return (k_pos <= q_pos)[None, None]  # (1, 1, L, S)


@dataclass(frozen=True, eq=False)
class Dense(Mask):
    """An explicit bool tensor broadcastable to (B, H, L, S), wrapped to combine with others."""

    tensor: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.tensor, torch.Tensor):
            raise TypeError(f"dense() takes a torch.Tensor, got {type(self.tensor).__name__}")
        if self.tensor.dtype != torch.bool:
            raise TypeError(f"dense() takes a bool tensor (True = may attend), got dtype {self.tensor.dtype}")
        if not 2 <= self.tensor.ndim <= 4:
            raise ValueError(f"dense() takes a tensor of shape (L, S) up to (B, H, L, S), got {tuple(self.tensor.shape)}")

    def to_dense(self, L: int, S: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        t = self.tensor
        if t.shape[-2] not in (1, L) or t.shape[-1] not in (1, S):
            raise ValueError(f"dense mask of shape {tuple(t.shape)} does not broadcast to (..., {L}, {S})")
        t = t.reshape((1,) * (4 - t.ndim) + tuple(t.shape))  # (B | 1, H | 1, L | 1, S | 1)
        t = t.expand(t.shape[0], t.shape[1], L, S)  # (B | 1, H | 1, L, S)
        return t.to(device) if device is not None else t


def causal(align: Align = "bottom-right") -> Causal:
    """Causal mask: query at absolute position p sees keys 0..p (see the module docstring)."""
    if align not in ("bottom-right", "top-left"):
        raise ValueError(f"align must be 'bottom-right' or 'top-left', got {align!r}")
    return Causal(align)


def dense(tensor: torch.Tensor) -> Dense:
    """Wrap a bool tensor (True = may attend) broadcastable to (B, H, L, S)."""
    return Dense(tensor)
