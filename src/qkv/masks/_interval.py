"""Masks that give each query one interval of keys: `causal`, `sliding_window`, `prefix_lm`.

Their layouts come from the interval bounds of the first and last query of each block
(O(nQ x nK) work), and the CPU block engine plans exact key ranges from `row_intervals`.

References: Beltagy et al., "Longformer" (2020) for sliding windows; Raffel et al., "T5"
(2020) for prefix-LM.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch

from qkv.masks._base import Align, Device, Mask, check_count
from qkv.masks._layout import block_bounds, compose_states

# query indices: a tensor of them, or one as a Python int (the masks whose bounds are plain
# arithmetic take both: a decode step finds its key range without tensor operations)
Index = TypeVar("Index", int, torch.Tensor)

# Window sizes and prefix lengths are clamped to this many positions at construction: no
# sequence is that long, so the mask is unchanged, and positions +- the size stay far inside
# int64 (sys.maxsize would wrap around and hide every key).
_FAR = 1 << 62


def _offset(align: Align, L: int, S: int) -> int:
    """Absolute position of query 0: S - L bottom-right, 0 top-left."""
    return S - L if align == "bottom-right" else 0


def _clamped_sum(first: int, last: int, lo: int, hi: int) -> int:
    """The sum of min(max(x, lo), hi) over x = first..last (0 when last < first), lo <= hi, in O(1):
    the part below lo, the arithmetic series between, the part above hi."""
    if last < first:
        return 0
    below = max(0, min(last, lo - 1) - first + 1)
    above = max(0, last - max(first, hi + 1) + 1)
    total = below * lo + above * hi
    a, b = max(first, lo), min(last, hi)
    if a <= b:
        total += (a + b) * (b - a + 1) // 2
    return total


def _check_align(align: object) -> None:
    if align not in ("bottom-right", "top-left"):
        raise ValueError(f"align must be 'bottom-right' or 'top-left', got {align!r}")


class _Interval(Mask):
    """Query q sees the keys lo(q) <= t <= hi(q).

    lo and hi never decrease with q and consecutive intervals touch (lo(q + 1) <= hi(q) + 1,
    or lo is constant), so a tile of queries q0..q1 and keys k0..k1 is

    - full  iff k0 >= lo(q1) and k1 <= hi(q0)  (the narrowest rows still cover it),
    - empty iff k1 < lo(q0) or k0 > hi(q1)     (the union of the rows misses it),

    which costs O(nQ x nK), not O(L x S).
    """

    @abstractmethod
    def bounds(self, q_idx: torch.Tensor, L: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(lo, hi): the first and last visible key of each query, same shape as q_idx."""

    def visible(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, L: int, S: int
    ) -> torch.Tensor:
        lo, hi = self.bounds(q_idx, L, S)
        return (kv_idx >= lo) & (kv_idx <= hi)

    def row_intervals(self, L: int, S: int, device: Device = None) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.bounds(torch.arange(L, device=device), L, S)
        return lo.clamp(min=0)[None], hi.clamp(max=S - 1)[None]  # (1, L) each

    def block_states(self, L: int, S: int, block_q: int, block_k: int, device: Device = None) -> torch.Tensor:
        first_q, last_q = block_bounds(L, block_q, device)
        first_k, last_k = block_bounds(S, block_k, device)
        lo_first, hi_first = self.bounds(first_q, L, S)  # (nQ,) each
        lo_last, hi_last = self.bounds(last_q, L, S)  # (nQ,) each
        k0, k1 = first_k[None, :], last_k[None, :]  # (1, nK)
        full = (k0 >= lo_last[:, None]) & (k1 <= hi_first[:, None])  # (nQ, nK)
        empty = (k1 < lo_first[:, None]) | (k0 > hi_last[:, None])  # (nQ, nK)
        return compose_states(full, ~empty)[None, None]  # (1, 1, nQ, nK)


@dataclass(frozen=True)
class Causal(_Interval):
    """The mask `causal` builds (documented there)."""

    align: Align = "bottom-right"
    shift_invariant: ClassVar[bool] = True

    def offset(self, L: int, S: int) -> int:
        """Absolute position of query 0: S - L bottom-right, 0 top-left."""
        return _offset(self.align, L, S)

    def bounds(self, q_idx: Index, L: int, S: int) -> tuple[Index, Index]:
        return q_idx * 0, q_idx + self.offset(L, S)  # key 0 for every query

    def key_span(self, first: int, last: int, L: int, S: int) -> tuple[int, int]:
        return 0, min(last + self.offset(L, S), S - 1)  # the last query sees the most

    def describe(self) -> str:
        return "causal()" if self.align == "bottom-right" else "causal(align='top-left')"

    def spec_fields(self) -> tuple[object, ...]:
        return ("causal", self.align)

    def visible_pairs(self, L: int, S: int) -> int:
        # query at position p sees keys 0..min(p, S - 1), none when p < 0
        first = self.offset(L, S)
        return _clamped_sum(first, first + L - 1, -1, S - 1) + L


def causal(align: Align = "bottom-right") -> Causal:
    """Causal mask: the query at absolute position p sees the keys 0..p.

    Positions align bottom-right when L != S (query i sits at i + S - L, `qkv.masks`);
    ``align="top-left"`` puts query i at position i, as PyTorch's ``is_causal``.

    >>> print(causal().to_dense(2, 4).int()[0, 0])
    tensor([[1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    _check_align(align)
    return Causal(align)


@dataclass(frozen=True)
class SlidingWindow(_Interval):
    """The mask `sliding_window` builds (documented there)."""

    left: int
    right: int = 0
    align: Align = "bottom-right"
    shift_invariant: ClassVar[bool] = True

    def bounds(self, q_idx: Index, L: int, S: int) -> tuple[Index, Index]:
        p = q_idx + _offset(self.align, L, S)
        return p - self.left, p + self.right

    def key_span(self, first: int, last: int, L: int, S: int) -> tuple[int, int]:
        offset = _offset(self.align, L, S)  # the bounds never decrease with the query
        return max(first + offset - self.left, 0), min(last + offset + self.right, S - 1)

    def describe(self) -> str:
        extra = "" if self.align == "bottom-right" else ", align='top-left'"
        return f"sliding_window(left={self.left}, right={self.right}{extra})"

    def spec_fields(self) -> tuple[object, ...]:
        return ("sliding_window", self.left, self.right, self.align)

    def visible_pairs(self, L: int, S: int) -> int:
        # keys max(0, p - left)..min(S - 1, p + right): hi clamped to -1 and lo to S make an
        # empty row count 0 (left, right >= 0 keep lo <= hi + 1)
        first = _offset(self.align, L, S)
        last = first + L - 1
        highs = _clamped_sum(first + self.right, last + self.right, -1, S - 1)
        lows = _clamped_sum(first - self.left, last - self.left, 0, S)
        return highs - lows + L


def sliding_window(left: int, right: int = 0, *, align: Align = "bottom-right") -> SlidingWindow:
    """Local attention: the query at absolute position p sees keys p - left <= t <= p + right.

    ``sliding_window(w)`` is a causal window of the w previous tokens and the token itself;
    ``sliding_window(w, w)`` is the symmetric window of Longformer. Sizes above 2**62 are
    clamped to 2**62 (wider than any sequence: the same mask).

    >>> print(sliding_window(1).to_dense(4, 4).int()[0, 0])
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 0, 1, 1]], dtype=torch.int32)
    """
    _check_align(align)
    left, right = check_count(left, "left"), check_count(right, "right")
    return SlidingWindow(min(left, _FAR), min(right, _FAR), align)


@dataclass(frozen=True)
class PrefixLM(_Interval):
    """The mask `prefix_lm` builds (documented there)."""

    n: int
    align: Align = "bottom-right"

    def bounds(self, q_idx: torch.Tensor, L: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = q_idx + _offset(self.align, L, S)
        return torch.zeros_like(q_idx), torch.clamp(p, min=self.n - 1)

    def key_span(self, first: int, last: int, L: int, S: int) -> tuple[int, int]:
        # key 0 for every query; the last query's hi (its bounds take tensors only)
        return 0, min(max(last + _offset(self.align, L, S), self.n - 1), S - 1)

    def describe(self) -> str:
        extra = "" if self.align == "bottom-right" else ", align='top-left'"
        return f"prefix_lm({self.n}{extra})"

    def spec_fields(self) -> tuple[object, ...]:
        return ("prefix_lm", self.n, self.align)

    def visible_pairs(self, L: int, S: int) -> int:
        # keys 0..min(S - 1, max(p, n - 1))
        first = _offset(self.align, L, S)
        return _clamped_sum(first, first + L - 1, min(self.n - 1, S - 1), S - 1) + L


def prefix_lm(n: int, *, align: Align = "bottom-right") -> PrefixLM:
    """Prefix-LM (T5): every query sees the first n keys (the prefix, in both directions)
    and, causally, the keys up to its own absolute position.

    >>> print(prefix_lm(2).to_dense(4, 4).int()[0, 0])
    tensor([[1, 1, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    _check_align(align)
    return PrefixLM(min(check_count(n, "n"), _FAR), align)
