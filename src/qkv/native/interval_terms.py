"""The score terms the fused interval kernels apply, as their C entry points take them.

Both kernels (`qkv.native.interval_bf16` and `interval_bf16_backward`) apply, in qkv.scores'
order after the scale, a softcap and a bias by diagonal (``score_terms_bf16.h``): the pair
(query i of batch row n, key j) adds ``table[h, positions[n, i] - j + offset]``, the table
(H | 1, D) float32 and the positions (N | 1, L) int64 built by
`qkv.backends.blocks.diagonals`. This module checks them against the kernels' reads (the
kernels read raw memory: a table too short must be refused before they run), packs them
for ctypes and applies them in float64 for the self-checks.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

__all__ = ["ARGUMENT_TYPES", "NO_TERMS", "IntervalTerms", "self_check_terms"]

# the kernels read the table for query rows padded to 64 (positions continued past the last
# row) and keys from 0 to S - 1
_PADDED_ROWS = 63
# positions and table entries are int32 inside the kernels
_INT32_LIMIT = 2**30


@dataclass(frozen=True, eq=False)
class IntervalTerms:
    """A softcap (0: none) and a bias by diagonal (``table`` None: none)."""

    softcap: float = 0.0
    table: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    offset: int = 0

    @property
    def active(self) -> bool:
        return self.softcap > 0.0 or self.table is not None

    def problem(self, N: int, H: int, L: int, S: int) -> str | None:
        """What is wrong with the terms for q (N, H, L, .) and S keys, or None."""
        if not (self.softcap >= 0.0 and math.isfinite(self.softcap)):
            return f"softcap must be 0 (none) or positive and finite, got {self.softcap!r}"
        if self.table is None:
            return None if self.positions is None else "positions come with a diagonal table only"
        table, positions = self.table, self.positions
        if table.dtype != torch.float32 or table.dim() != 2 or not table.is_contiguous() or table.shape[0] not in (1, H):
            return f"the diagonal table must be a contiguous float32 (H | 1, D) = ({H} | 1, D) tensor, not {table.dtype} {tuple(table.shape)}"
        if positions is None or positions.dtype != torch.long or positions.dim() != 2 or not positions.is_contiguous():
            return "the query positions must be a contiguous int64 (N | 1, L) tensor"
        if positions.shape[1] != L or positions.shape[0] not in (1, N):
            return f"the query positions must be (N | 1, L) = ({N} | 1, {L}), not {tuple(positions.shape)}"
        if L == 0 or S == 0:
            return None
        low, high = int(positions.min()), int(positions.max())
        first, last = low - (S - 1) + self.offset, high + _PADDED_ROWS + self.offset
        if max(abs(low), abs(high), table.shape[1]) >= _INT32_LIMIT or first < 0 or last >= table.shape[1]:
            return (
                f"the diagonal table ({table.shape[1]} entries, offset {self.offset}) does not hold entries "
                f"{first}..{last} that positions {low}..{high} and {S} keys read"
            )
        return None

    def arguments(self) -> tuple[object, ...]:
        """The entry points' arguments: softcap, table, its heads, length and offset, positions and their rows."""
        if self.table is None or self.positions is None:
            return (float(self.softcap), None, 0, 0, 0, None, 0)
        table, positions = self.table, self.positions  # contiguous (`problem`): their own memory reaches the kernel
        return (
            float(self.softcap), table.data_ptr(), table.shape[0], table.shape[1], int(self.offset),
            positions.data_ptr(), positions.shape[0],
        )  # fmt: skip

    def applied(self, s: torch.Tensor, scale: float, h: torch.Tensor, rows: torch.Tensor, n: int = 0) -> torch.Tensor:
        """Raw scores s (H, r, S) float64 of batch row n, query rows ``rows``, scaled and with
        the terms applied (the self-checks' reference)."""
        s = s * scale
        if self.softcap > 0.0:
            s = torch.tanh(s / self.softcap) * self.softcap
        if self.table is not None and self.positions is not None:
            S = s.shape[-1]
            p = self.positions[n if self.positions.shape[0] > 1 else 0, rows].view(-1, 1)  # (r, 1)
            entry = p - torch.arange(S).view(1, S) + self.offset  # (r, S)
            table = self.table.double()[h if self.table.shape[0] > 1 else torch.zeros_like(h)]  # (H, D)
            s = s + table[:, entry]  # (H, r, S)
        return s


NO_TERMS = IntervalTerms()


def self_check_terms(H: int, L: int, S: int, gen: torch.Generator) -> IntervalTerms:
    """The score terms of both kernels' self-checks, for H heads, L queries and S keys: a
    softcap of 1.5 (scores of about +-3 bend) and a random bias by diagonal whose first 32
    positions lie 2 apart (the kernels gather their entries) and the rest consecutively (one
    load per 16 queries)."""
    rows = torch.arange(L)
    positions = torch.where(rows < 32, 2 * rows, rows + 40).view(1, L)  # (1, L), from 0
    offset = S - 1 + 32  # the entry of p - j = 0, with a margin before position 0 - (S - 1)
    length = int(positions.max()) + offset + _PADDED_ROWS + 1  # the last entry padded rows read, and one more
    return IntervalTerms(1.5, torch.randn(H, length, generator=gen), positions, offset)

# ctypes types of `IntervalTerms.arguments`, in order
ARGUMENT_TYPES = (
    ctypes.c_double, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
)
