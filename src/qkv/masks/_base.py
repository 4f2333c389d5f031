"""The `Mask` base class every mask implements, and `Combined` (``&`` and ``|`` of two masks).

Also the helpers the mask families share: the index grid `Mask.visible` is evaluated on and
the checks of counts.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from qkv._checks import positive_int, size_broadcasts
from qkv.masks._layout import EMPTY, FULL, BlockLayout, compose_states

Align = Literal["bottom-right", "top-left"]

Device = torch.device | str | None

# Tile size of `Mask.layout` when none is given: FlexAttention's 128 x 128 (its BlockMask
# default). The CPU block engine plans its own tiles (192 queries x 64 keys by default).
DEFAULT_BLOCK = 128

# `Mask.draw` picks a tile size that keeps the drawing at most this many characters wide.
_DRAW_COLUMNS = 48
# Points a drawing or a path decision may evaluate one by one (`Mask.evaluated_points`):
# 8192 x 8192, about a second of a simple predicate on one core. Beyond it `draw` refuses and
# the dispatcher decides without evaluating (qkv.attention.dispatch).
POINTWISE_BUDGET = 1 << 26


class Mask(ABC):
    """Base class of structured masks. Combine with ``&`` (both allow) and ``|`` (either allows)."""

    # visible(q + t, k + t) == visible(q, k): every tile on a diagonal is the same
    shift_invariant: ClassVar[bool] = False

    @property
    def batch(self) -> int | None:
        """Batch size the mask varies over, or None when it is the same for every batch row."""
        return None

    @property
    def heads(self) -> int | None:
        """Number of heads the mask varies over, or None when it is the same for every head."""
        return None

    @abstractmethod
    def visible(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, L: int, S: int
    ) -> torch.Tensor:
        """Whether query q_idx may see key kv_idx: a bool tensor, broadcast of the index tensors.

        b, h, q_idx, kv_idx are int64 tensors that broadcast against each other (scalars
        under FlexAttention's vmap); b and h are 0 where the mask does not vary over them.
        """

    @abstractmethod
    def block_states(self, L: int, S: int, block_q: int, block_k: int, device: Device = None) -> torch.Tensor:
        """Tile states (B | 1, H | 1, nQ, nK) uint8: EMPTY, PARTIAL or FULL (`qkv.masks.BlockLayout`)."""

    @abstractmethod
    def describe(self) -> str:
        """A short name such as ``sliding_window(left=256, right=0)``."""

    def row_intervals(self, L: int, S: int, device: Device = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(lo, hi), each (B | 1, L) int64: query i sees exactly the keys lo <= t <= hi (none
        when lo > hi), or None when some query's visible keys are not one interval (or the
        mask varies over heads). O(L) work; the block engine plans exact key ranges from it."""
        del L, S, device
        return None

    def query_positions(self, L: int, S: int, device: Device = None) -> torch.Tensor | None:
        """(B | 1, L) int64: each query's absolute position in key coordinates, for the
        position-dependent score terms (`qkv.bias`); None means bottom-right, i + S - L.
        Masks over packed documents or padded rows give each document its own positions."""
        del L, S, device
        return None

    def evaluated_points(self, L: int, S: int) -> int:
        """How many (query, key) points the layout at this size evaluates one by one: 0 when
        the tiles follow from the mask's structure in O(tiles) work (every mask but
        `predicate`), B x H x L x S for a predicate, the sum for a combination."""
        del L, S
        return 0

    def visible_pairs(self, L: int, S: int) -> int | None:
        """How many (query, key) pairs the mask leaves visible at this size, per batch row and
        head, by arithmetic on its Python parameters (no tensor is read: torch.compile can
        decide from it while tracing); an upper bound for a combination (``&``: the smaller
        known side; ``|``: the sum); None when its data decides (documents, lengths, a tensor,
        a predicate)."""
        del L, S
        return None

    def key_span(self, first: int, last: int, L: int, S: int) -> tuple[int, int]:
        """(lo, hi): the keys lo <= t <= hi that queries ``first``..``last`` may see between them,
        at most, by arithmetic on the mask's Python parameters (no tensor is read: torch.compile
        decides from it while tracing), clamped to 0..S - 1; lo > hi when they see none. All
        keys where the mask's data decides (documents, lengths, a tensor, a predicate)."""
        del first, last, L
        return 0, S - 1

    def spec_fields(self) -> tuple[object, ...] | None:
        """The mask's spec name and constructor arguments, for `qkv._private.spec` (the block
        engine's operators rebuild it from them); None when it cannot be rebuilt from text."""
        return None

    def check_size(self, L: int, S: int) -> None:
        """Raise ValueError when the mask's data (ids, lengths, a tensor) does not fit an L x S
        score matrix; `to_dense`, `layout` and `validate` call it so that a mismatch is named
        instead of indexing the data out of range (or, worse, wrapping around silently)."""
        del L, S

    def validate(self, batch: int, heads: int, L: int, S: int) -> None:
        """Raise ValueError when the mask cannot apply to a (batch, heads, L, S) problem."""
        # size_broadcasts, not `in (None, 1, batch)`: the sizes may be symbolic while torch.compile traces
        if self.batch is not None and not size_broadcasts(self.batch, batch):
            raise ValueError(f"{self.describe()} has batch size {self.batch}, the inputs have {batch}")
        if self.heads is not None and not size_broadcasts(self.heads, heads):
            raise ValueError(f"{self.describe()} covers {self.heads} heads, the inputs have {heads}")
        self.check_size(L, S)

    def __str__(self) -> str:
        return self.describe()

    def to(self, device: torch.device | str) -> Mask:
        """The same mask with its data (ids, lengths, tensors) on ``device``."""
        del device
        return self

    def to_dense(self, L: int, S: int, *, device: Device = None) -> torch.Tensor:
        """Render as a bool tensor (B | 1, H | 1, L, S), True = may attend."""
        self.check_size(L, S)
        shape = (self.batch or 1, self.heads or 1, L, S)
        b, h, q, k = index_grid(shape, device)
        return torch.broadcast_to(self.visible(b, h, q, k, L, S), shape)

    def layout(
        self, L: int, S: int, block_q: int = DEFAULT_BLOCK, block_k: int | None = None, *, device: Device = None
    ) -> BlockLayout:
        """The mask's tiles at this size: which are empty (skipped), full or partial."""
        block_k = block_q if block_k is None else block_k
        for name, value in (("L", L), ("S", S), ("block_q", block_q), ("block_k", block_k)):
            positive_int(value, name)
        self.check_size(L, S)
        states = self.block_states(L, S, block_q, block_k, device)
        return BlockLayout(states, L, S, block_q, block_k, name=self.describe())

    def draw(self, L: int, S: int, *, block: int | None = None, batch: int = 0, head: int = 0) -> str:
        """A text drawing of the tiles (see `BlockLayout.draw`); ``print(mask.draw(64, 64))``.

        ``block`` defaults to the smallest power of two that keeps the drawing at most 48
        tiles wide, so small problems are drawn point by point. A `predicate` is evaluated at
        every point, so its drawing is refused beyond `POINTWISE_BUDGET` points (8192 x 8192).
        """
        positive_int(L, "L"), positive_int(S, "S")
        points = self.evaluated_points(L, S)
        if points > POINTWISE_BUDGET:
            raise ValueError(
                f"drawing {self.describe()} at {L} x {S} evaluates its function at {points:,} points, more than "
                f"draw evaluates ({POINTWISE_BUDGET:,}, e.g. 8192 x 8192); draw a smaller size, or call "
                "mask.layout(L, S, block) and draw that layout if you want to wait for every point"
            )
        if block is None:
            block = 1 << max(0, math.ceil(math.log2(max(L, S) / _DRAW_COLUMNS)))
        return self.layout(L, S, block, block).draw(batch, head)

    def __and__(self, other: Mask) -> Mask:
        return _combine("and", self, other)

    def __or__(self, other: Mask) -> Mask:
        return _combine("or", self, other)


def index_grid(shape: tuple[int, int, int, int], device: Device) -> tuple[torch.Tensor, ...]:
    """Index tensors b (B,1,1,1), h (1,H,1,1), q (1,1,L,1), k (1,1,1,S) for `Mask.visible`."""
    B, H, L, S = shape
    return (
        torch.arange(B, device=device).view(B, 1, 1, 1),  # (B, 1, 1, 1)
        torch.arange(H, device=device).view(1, H, 1, 1),  # (1, H, 1, 1)
        torch.arange(L, device=device).view(1, 1, L, 1),  # (1, 1, L, 1)
        torch.arange(S, device=device).view(1, 1, 1, S),  # (1, 1, 1, S)
    )


def batch_index(b: torch.Tensor, size: int) -> torch.Tensor:
    """b where the data has a batch axis, 0 (broadcast) where it has one row."""
    return b if size > 1 else torch.zeros_like(b)


def check_count(value: object, name: str, minimum: int = 0) -> int:
    """``value`` when it is an int >= ``minimum`` (a bool is not): TypeError for another type, ValueError below."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _combine(op: Literal["and", "or"], left: object, right: object) -> Mask:
    if not isinstance(left, Mask) or not isinstance(right, Mask):
        raise TypeError(
            f"masks combine only with other qkv.masks objects, got {type(left).__name__} "
            f"and {type(right).__name__}; wrap a tensor with qkv.masks.dense(tensor)"
        )
    for axis in ("batch", "heads"):
        a, b = getattr(left, axis), getattr(right, axis)
        if a is not None and b is not None and a != b:
            raise ValueError(f"cannot combine {left.describe()} ({axis} {a}) with {right.describe()} ({axis} {b})")
    return Combined(op, left, right)


@dataclass(frozen=True)
class Combined(Mask):
    """Two masks joined by ``&`` or ``|``.

    The layout combines the two layouts tile by tile (``&``: empty if either is empty, full
    if both are full; ``|``: full if either is full, empty if both are empty). It stays
    sound, but a tile partial in both may in truth be empty or full.
    """

    op: Literal["and", "or"]
    left: Mask
    right: Mask

    @property
    def shift_invariant(self) -> bool:  # type: ignore[override]
        return self.left.shift_invariant and self.right.shift_invariant

    @property
    def batch(self) -> int | None:
        return self.left.batch or self.right.batch

    @property
    def heads(self) -> int | None:
        return self.left.heads or self.right.heads

    def check_size(self, L: int, S: int) -> None:
        self.left.check_size(L, S)
        self.right.check_size(L, S)

    def evaluated_points(self, L: int, S: int) -> int:
        return self.left.evaluated_points(L, S) + self.right.evaluated_points(L, S)

    def spec_fields(self) -> tuple[object, ...] | None:
        return ("combined", self.op, self.left, self.right)

    def visible_pairs(self, L: int, S: int) -> int | None:
        a, b = self.left.visible_pairs(L, S), self.right.visible_pairs(L, S)
        if self.op == "and":  # at most what either side leaves: an upper bound when one is known
            known = [x for x in (a, b) if x is not None]
            return min(known) if known else None
        return None if a is None or b is None else min(L * S, a + b)

    def key_span(self, first: int, last: int, L: int, S: int) -> tuple[int, int]:
        a_lo, a_hi = self.left.key_span(first, last, L, S)
        b_lo, b_hi = self.right.key_span(first, last, L, S)
        if self.op == "and":
            return max(a_lo, b_lo), min(a_hi, b_hi)
        if a_lo > a_hi:  # an empty side adds nothing to the union
            return b_lo, b_hi
        if b_lo > b_hi:
            return a_lo, a_hi
        return min(a_lo, b_lo), max(a_hi, b_hi)

    def validate(self, batch: int, heads: int, L: int, S: int) -> None:
        self.left.validate(batch, heads, L, S)
        self.right.validate(batch, heads, L, S)

    def to(self, device: torch.device | str) -> Combined:
        return Combined(self.op, self.left.to(device), self.right.to(device))

    def query_positions(self, L: int, S: int, device: Device = None) -> torch.Tensor | None:
        left = self.left.query_positions(L, S, device)
        return left if left is not None else self.right.query_positions(L, S, device)

    def row_intervals(self, L: int, S: int, device: Device = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        a = self.left.row_intervals(L, S, device)
        b = self.right.row_intervals(L, S, device)
        if a is None or b is None:
            return None
        if self.op == "and":  # the intersection of two intervals is an interval
            return torch.maximum(a[0], b[0]), torch.minimum(a[1], b[1])
        # the union is an interval when the two touch, or when one of them is empty
        a_empty, b_empty = (a[0] > a[1]), (b[0] > b[1])
        touching = (torch.maximum(a[0], b[0]) <= torch.minimum(a[1], b[1]) + 1) | a_empty | b_empty
        if not bool(touching.all()):
            return None
        lo = torch.where(a_empty, b[0], torch.where(b_empty, a[0], torch.minimum(a[0], b[0])))
        hi = torch.where(a_empty, b[1], torch.where(b_empty, a[1], torch.maximum(a[1], b[1])))
        return lo, hi

    def visible(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, L: int, S: int
    ) -> torch.Tensor:
        a = self.left.visible(b, h, q_idx, kv_idx, L, S)
        c = self.right.visible(b, h, q_idx, kv_idx, L, S)
        return (a & c) if self.op == "and" else (a | c)

    def to_dense(self, L: int, S: int, *, device: Device = None) -> torch.Tensor:
        a = self.left.to_dense(L, S, device=device)
        b = self.right.to_dense(L, S, device=device)
        return (a & b) if self.op == "and" else (a | b)

    def block_states(self, L: int, S: int, block_q: int, block_k: int, device: Device = None) -> torch.Tensor:
        a = self.left.block_states(L, S, block_q, block_k, device)
        b = self.right.block_states(L, S, block_q, block_k, device)
        if self.op == "and":
            return compose_states((a == FULL) & (b == FULL), (a != EMPTY) & (b != EMPTY))
        return compose_states((a == FULL) | (b == FULL), (a != EMPTY) | (b != EMPTY))

    def describe(self) -> str:
        return f"({self.left.describe()} {'&' if self.op == 'and' else '|'} {self.right.describe()})"
