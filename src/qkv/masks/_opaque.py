"""Masks without structure: `predicate` (any function of the indices) and `dense` (a tensor).

Their layouts evaluate every point, one block row of queries at a time (bounded memory).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qkv._checks import size_broadcasts
from qkv.masks._base import Device, Mask, batch_index, check_count, index_grid
from qkv.masks._layout import states_from_dense

# `predicate` and `dense` layouts evaluate this many points at most per step (bounded memory).
_EVAL_POINTS = 1 << 22


def _states_by_rows(mask: Mask, L: int, S: int, block_q: int, block_k: int, device: Device) -> torch.Tensor:
    """Layout of a mask without structure: evaluate it one block row of queries at a time."""
    B, H = mask.batch or 1, mask.heads or 1
    rows_per_step = max(1, _EVAL_POINTS // (B * H * S * block_q)) * block_q
    b, h, _, k = index_grid((B, H, 1, S), device)
    parts = []
    for start in range(0, L, rows_per_step):
        stop = min(L, start + rows_per_step)
        q = torch.arange(start, stop, device=device).view(1, 1, -1, 1)  # (1, 1, rows, 1)
        visible = torch.broadcast_to(mask.visible(b, h, q, k, L, S), (B, H, stop - start, S))
        parts.append(states_from_dense(visible, block_q, block_k))  # (B, H, rows / block_q, nK)
    return torch.cat(parts, dim=2)  # (B, H, nQ, nK)


@dataclass(frozen=True, eq=False)
class Predicate(Mask):
    """Any mask as a vectorized function fn(b, h, q_idx, kv_idx) -> bool tensor.

    The index tensors broadcast against each other, as FlexAttention's ``mask_mod``. Pass
    ``batch`` / ``heads`` when fn depends on b / h; otherwise fn is called with b = h = 0
    and its answer holds for every batch row and head. The layout evaluates fn on every
    point, one block row of queries at a time (O(L x S) work, bounded memory). Beyond
    `POINTWISE_BUDGET` points (8192 x 8192) nothing waits for that but `attention` itself:
    `draw` refuses, and `explain` and the dispatcher decide without evaluating fn (the block
    engine on CPU finds the tiles when attention runs).
    """

    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    batch_size: int | None = None
    num_heads: int | None = None

    @property
    def batch(self) -> int | None:
        return self.batch_size

    @property
    def heads(self) -> int | None:
        return self.num_heads

    def visible(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, L: int, S: int
    ) -> torch.Tensor:
        out = self.fn(b, h, q_idx, kv_idx)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
            raise TypeError(f"predicate fn(b, h, q_idx, kv_idx) must return a bool tensor, got {got}")
        expected = torch.broadcast_shapes(b.shape, h.shape, q_idx.shape, kv_idx.shape)
        try:
            fits = torch.broadcast_shapes(out.shape, expected) == expected
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"predicate fn(b, h, q_idx, kv_idx) returned shape {tuple(out.shape)}; it must broadcast "
                f"to the shape of its index arguments {tuple(expected)} (use elementwise operations on them)"
            )
        return out

    def block_states(self, L: int, S: int, block_q: int, block_k: int, device: Device = None) -> torch.Tensor:
        return _states_by_rows(self, L, S, block_q, block_k, device)

    def evaluated_points(self, L: int, S: int) -> int:
        return (self.batch or 1) * (self.heads or 1) * L * S

    def describe(self) -> str:
        return f"predicate({getattr(self.fn, '__name__', type(self.fn).__name__)})"


def predicate(
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    batch: int | None = None,
    heads: int | None = None,
) -> Predicate:
    """Any mask as a vectorized fn(b, h, q_idx, kv_idx) -> bool tensor (FlexAttention's mask_mod).

    >>> every_other = predicate(lambda b, h, q, k: (k % 2) == 0)
    >>> print(every_other.to_dense(1, 4).int()[0, 0])
    tensor([[1, 0, 1, 0]], dtype=torch.int32)
    """
    if not callable(fn):
        raise TypeError(f"predicate() takes a function fn(b, h, q_idx, kv_idx), got {type(fn).__name__}")
    for name, value in (("batch", batch), ("heads", heads)):
        if value is not None:
            check_count(value, name, minimum=1)
    return Predicate(fn, batch, heads)


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

    def to(self, device: torch.device | str) -> Dense:
        return Dense(self.tensor.to(device))

    def spec_fields(self) -> tuple[object, ...]:
        return ("dense", self.tensor)

    def _4d(self) -> torch.Tensor:
        t = self.tensor
        return t.reshape((1,) * (4 - t.ndim) + tuple(t.shape))  # (B | 1, H | 1, L | 1, S | 1)

    @property
    def batch(self) -> int | None:
        size = self._4d().shape[0]
        return size if size > 1 else None

    @property
    def heads(self) -> int | None:
        size = self._4d().shape[1]
        return size if size > 1 else None

    def check_size(self, L: int, S: int) -> None:
        t = self.tensor
        if not (size_broadcasts(t.shape[-2], L) and size_broadcasts(t.shape[-1], S)):
            raise ValueError(f"dense mask of shape {tuple(t.shape)} does not broadcast to (..., {L}, {S})")

    def to_dense(self, L: int, S: int, *, device: Device = None) -> torch.Tensor:
        self.check_size(L, S)
        t = self._4d()
        t = t.expand(t.shape[0], t.shape[1], L, S)  # (B | 1, H | 1, L, S)
        return t.to(device) if device is not None else t

    def visible(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, L: int, S: int
    ) -> torch.Tensor:
        t = self._4d().to(q_idx.device)
        index = [batch_index(i, size) for i, size in zip((b, h, q_idx, kv_idx), t.shape, strict=True)]
        return t[index[0], index[1], index[2], index[3]]

    def block_states(self, L: int, S: int, block_q: int, block_k: int, device: Device = None) -> torch.Tensor:
        t = self._4d().to(device)
        # a broadcast axis (size 1) is one block of its own; expand the states afterwards
        states = states_from_dense(t, block_q if t.shape[2] > 1 else 1, block_k if t.shape[3] > 1 else 1)
        return states.expand(-1, -1, math.ceil(L / block_q), math.ceil(S / block_k))  # (B | 1, H | 1, nQ, nK)

    def describe(self) -> str:
        return f"dense({tuple(self.tensor.shape)})"


def dense(tensor: torch.Tensor) -> Dense:
    """Wrap a bool tensor (True = may attend) broadcastable to (B, H, L, S)."""
    return Dense(tensor)
