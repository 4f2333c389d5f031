"""The one mask vocabulary of qkv: True = may attend, everywhere.

A mask object describes which keys each query may see without materializing the L x S
matrix. Every mask answers three questions:

- ``visible(b, h, q_idx, kv_idx, L, S)``: a vectorized predicate on broadcasting index
  tensors (the ``mask_mod`` of PyTorch's FlexAttention), used for the tiles the kernels
  compute and for `to_dense`;
- ``to_dense(L, S)``: the bool tensor (B | 1, H | 1, L, S) for the explicit paths and tests;
- ``layout(L, S, block_q, block_k)``: which tiles of the score matrix are empty, full or
  partial (`qkv.kernels.layout`), computed from the mask's structure: causal, sliding
  windows and prefix-LM from their per-query key intervals, documents from the smallest and
  largest id of each block, key padding from each key block. Only `dense` (a tensor that
  exists anyway) and `predicate` (an opaque function) evaluate every point, block row by
  block row. ``print(mask.draw(L, S))`` shows the layout.

Variable-length sequences (`varlen`, `padded`) align causal masks and windows bottom-right
to each document's own query and key lengths, as FlashAttention's varlen kernels do.

Positions are absolute and aligned bottom-right when L != S: query i sits at absolute
position i + S - L, so a decoding step (L = 1) sees the whole cache. With L = 2, S = 4::

    bottom-right (default)    top-left (PyTorch's is_causal)
        k0 k1 k2 k3               k0 k1 k2 k3
    q0   1  1  1  .           q0   1  .  .  .
    q1   1  1  1  1           q1   1  1  .  .

When L > S bottom-right alignment leaves the first L - S queries with no visible key:
their output rows are zeros (see `qkv.attention`).

References: Beltagy et al., "Longformer" (2020) for sliding windows; Raffel et al., "T5"
(2020) for prefix-LM; Krell et al., "Efficient sequence packing without cross-contamination"
(2021) for packed documents; PyTorch's FlexAttention ``mask_mod`` / ``BlockMask`` API.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from qkv.kernels.layout import (
    EMPTY,
    FULL,
    BlockLayout,
    block_bounds,
    compose_states,
    states_from_dense,
)

__all__ = [
    "Causal",
    "Combined",
    "Dense",
    "Documents",
    "KeyPadding",
    "Mask",
    "Padded",
    "Predicate",
    "PrefixLM",
    "SlidingWindow",
    "Varlen",
    "causal",
    "dense",
    "documents",
    "key_padding",
    "padded",
    "predicate",
    "prefix_lm",
    "sliding_window",
    "varlen",
]

Align = Literal["bottom-right", "top-left"]
Device = torch.device | str | None

# Tile sizes of `Mask.layout` when none are given: the CPU tile engine's query block.
DEFAULT_BLOCK = 128
# `Mask.draw` picks a tile size that keeps the drawing at most this many characters wide.
_DRAW_COLUMNS = 48
# `predicate` and `dense` layouts evaluate this many points at most per step (bounded memory).
_EVAL_POINTS = 1 << 22
# Points a drawing or a path decision may evaluate one by one (`Mask.evaluated_points`):
# 8192 x 8192, about a second of a simple predicate on one core. Beyond it `draw` refuses and
# the dispatcher decides without evaluating (qkv.functional).
POINTWISE_BUDGET = 1 << 26
# Window sizes and prefix lengths are clamped to this many positions at construction: no
# sequence is that long, so the mask is unchanged, and positions +- the size stay far inside
# int64 (sys.maxsize would wrap around and hide every key).
_FAR = 1 << 62


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
        """Tile states (B | 1, H | 1, nQ, nK) uint8: EMPTY, PARTIAL or FULL (`qkv.kernels.layout`)."""

    @abstractmethod
    def describe(self) -> str:
        """A short name such as ``sliding_window(left=256, right=0)``."""

    def row_intervals(self, L: int, S: int, device: Device = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(lo, hi), each (B | 1, L) int64: query i sees exactly the keys lo <= t <= hi (none
        when lo > hi), or None when some query's visible keys are not one interval (or the
        mask varies over heads). O(L) work; the tile engine plans exact key ranges from it."""
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

    def check_size(self, L: int, S: int) -> None:
        """Raise ValueError when the mask's data (ids, lengths, a tensor) does not fit an L x S
        score matrix; `to_dense`, `layout` and `validate` call it so that a mismatch is named
        instead of indexing the data out of range (or, worse, wrapping around silently)."""
        del L, S

    def validate(self, batch: int, heads: int, L: int, S: int) -> None:
        """Raise ValueError when the mask cannot apply to a (batch, heads, L, S) problem."""
        if self.batch not in (None, 1, batch):
            raise ValueError(f"{self.describe()} has batch size {self.batch}, the inputs have {batch}")
        if self.heads not in (None, 1, heads):
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
        b, h, q, k = _grid(shape, device)
        return torch.broadcast_to(self.visible(b, h, q, k, L, S), shape)

    def layout(
        self, L: int, S: int, block_q: int = DEFAULT_BLOCK, block_k: int | None = None, *, device: Device = None
    ) -> BlockLayout:
        """The mask's tiles at this size: which are empty (skipped), full or partial."""
        block_k = block_q if block_k is None else block_k
        _check_sizes(L=L, S=S, block_q=block_q, block_k=block_k)
        self.check_size(L, S)
        states = self.block_states(L, S, block_q, block_k, device)
        return BlockLayout(states, L, S, block_q, block_k, name=self.describe())

    def draw(self, L: int, S: int, *, block: int | None = None, batch: int = 0, head: int = 0) -> str:
        """A text drawing of the tiles (see `BlockLayout.draw`); ``print(mask.draw(64, 64))``.

        ``block`` defaults to the smallest power of two that keeps the drawing at most 48
        tiles wide, so small problems are drawn point by point. A `predicate` is evaluated at
        every point, so its drawing is refused beyond `POINTWISE_BUDGET` points (8192 x 8192).
        """
        _check_sizes(L=L, S=S)
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


def _check_sizes(**sizes: object) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _grid(shape: tuple[int, int, int, int], device: Device) -> tuple[torch.Tensor, ...]:
    """Index tensors b (B,1,1,1), h (1,H,1,1), q (1,1,L,1), k (1,1,1,S) for `Mask.visible`."""
    B, H, L, S = shape
    return (
        torch.arange(B, device=device).view(B, 1, 1, 1),  # (B, 1, 1, 1)
        torch.arange(H, device=device).view(1, H, 1, 1),  # (1, H, 1, 1)
        torch.arange(L, device=device).view(1, 1, L, 1),  # (1, 1, L, 1)
        torch.arange(S, device=device).view(1, 1, 1, S),  # (1, 1, 1, S)
    )


def _offset(align: Align, L: int, S: int) -> int:
    """Absolute position of query 0: S - L bottom-right, 0 top-left."""
    return S - L if align == "bottom-right" else 0


def _check_align(align: object) -> None:
    if align not in ("bottom-right", "top-left"):
        raise ValueError(f"align must be 'bottom-right' or 'top-left', got {align!r}")


def _check_count(value: object, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


# Masks that give each query an interval of keys ------------------------------------------------


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
    """A query may see keys at its own absolute position and before."""

    align: Align = "bottom-right"
    shift_invariant: ClassVar[bool] = True

    def offset(self, L: int, S: int) -> int:
        """Absolute position of query 0: S - L bottom-right, 0 top-left."""
        return _offset(self.align, L, S)

    def bounds(self, q_idx: torch.Tensor, L: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros_like(q_idx), q_idx + self.offset(L, S)

    def describe(self) -> str:
        return "causal()" if self.align == "bottom-right" else "causal(align='top-left')"


@dataclass(frozen=True)
class SlidingWindow(_Interval):
    """A query at absolute position p sees the keys p - left <= t <= p + right."""

    left: int
    right: int = 0
    align: Align = "bottom-right"
    shift_invariant: ClassVar[bool] = True

    def bounds(self, q_idx: torch.Tensor, L: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = q_idx + _offset(self.align, L, S)
        return p - self.left, p + self.right

    def describe(self) -> str:
        extra = "" if self.align == "bottom-right" else ", align='top-left'"
        return f"sliding_window(left={self.left}, right={self.right}{extra})"


@dataclass(frozen=True)
class PrefixLM(_Interval):
    """Every query sees the first ``n`` keys (the prefix, bidirectional) and keys up to its own position."""

    n: int
    align: Align = "bottom-right"

    def bounds(self, q_idx: torch.Tensor, L: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = q_idx + _offset(self.align, L, S)
        return torch.zeros_like(q_idx), torch.clamp(p, min=self.n - 1)

    def describe(self) -> str:
        extra = "" if self.align == "bottom-right" else ", align='top-left'"
        return f"prefix_lm({self.n}{extra})"


# Masks given by per-position data ---------------------------------------------------------------


def _batch_index(b: torch.Tensor, size: int) -> torch.Tensor:
    """b where the data has a batch axis, 0 (broadcast) where it has one row."""
    return b if size > 1 else torch.zeros_like(b)


def _block_min_max(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Smallest and largest value of each block of ``block`` positions of x (B, T): two (B, n)."""
    B, T = x.shape
    n = math.ceil(T / block)
    padded = torch.cat([x, x[:, -1:].expand(B, n * block - T)], dim=1)  # (B, n * block): the last value repeated
    blocks = padded.view(B, n, block)  # (B, n, block)
    return blocks.amin(dim=2), blocks.amax(dim=2)


@dataclass(frozen=True, eq=False)
class Documents(Mask):
    """Packed sequences: a query sees only the keys of its own document.

    ``ids`` (B | 1, S) gives the document of every key position; queries take the ids of
    the last L positions (bottom-right, so a decoding step continues its document). With
    ``kv_ids`` (B | 1, S), ``ids`` (B | 1, L) are the queries' own ids (cross-attention).

    The layout compares each block's smallest and largest id: exact when the documents lie
    one after another (ids sorted), otherwise a block may be reported partial while empty.
    """

    ids: torch.Tensor
    kv_ids: torch.Tensor | None = None

    @property
    def batch(self) -> int | None:
        sizes = {self.ids.shape[0]} | ({self.kv_ids.shape[0]} if self.kv_ids is not None else set())
        size = max(sizes)
        return size if size > 1 else None

    def _key_ids(self) -> torch.Tensor:
        return self.ids if self.kv_ids is None else self.kv_ids

    def to(self, device: torch.device | str) -> Documents:
        return Documents(self.ids.to(device), None if self.kv_ids is None else self.kv_ids.to(device))

    def check_size(self, L: int, S: int) -> None:
        keys = self._key_ids()
        if keys.shape[1] != S:
            raise ValueError(f"documents() has ids for {keys.shape[1]} key positions, the keys have length S={S}")
        if self.kv_ids is None and L > S:
            raise ValueError(
                f"documents(ids) places the L={L} queries on the last positions of the S={S} keys; "
                "L > S needs documents(q_ids, kv_ids)"
            )
        if self.kv_ids is not None and self.ids.shape[1] != L:
            raise ValueError(f"documents(q_ids, kv_ids) has {self.ids.shape[1]} query ids, the queries have L={L}")

    def _query_ids(self, L: int, S: int) -> torch.Tensor:
        return self.ids[:, S - L :] if self.kv_ids is None else self.ids  # (B | 1, L)

    def row_intervals(self, L: int, S: int, device: Device = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        keys = self._key_ids().to(device)  # (B | 1, S)
        if bool((keys[:, 1:] < keys[:, :-1]).any()):
            return None  # a document in several places: not one interval per query
        queries = self._query_ids(L, S).to(device)  # (B | 1, L)
        B = max(keys.shape[0], queries.shape[0])
        keys, queries = keys.expand(B, -1).contiguous(), queries.expand(B, -1).contiguous()  # (B, S), (B, L)
        lo = torch.searchsorted(keys, queries)  # first key of the query's document
        hi = torch.searchsorted(keys, queries, right=True) - 1  # its last key (lo > hi: no key)
        return lo, hi

    def visible(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, L: int, S: int
    ) -> torch.Tensor:
        keys = self._key_ids().to(kv_idx.device)
        queries = self.ids.to(q_idx.device)
        q_pos = q_idx + (S - L) if self.kv_ids is None else q_idx
        q_doc = queries[_batch_index(b, queries.shape[0]), q_pos]
        k_doc = keys[_batch_index(b, keys.shape[0]), kv_idx]
        return q_doc == k_doc

    def block_states(self, L: int, S: int, block_q: int, block_k: int, device: Device = None) -> torch.Tensor:
        q_min, q_max = _block_min_max(self._query_ids(L, S).to(device), block_q)  # (B | 1, nQ) each
        k_min, k_max = _block_min_max(self._key_ids().to(device), block_k)  # (B | 1, nK) each
        one_doc = (q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :]  # (B | 1, nQ, nK)
        full = one_doc & (q_min[:, :, None] == k_min[:, None, :])
        overlap = (q_max[:, :, None] >= k_min[:, None, :]) & (k_max[:, None, :] >= q_min[:, :, None])
        return compose_states(full, overlap)[:, None]  # (B | 1, 1, nQ, nK)

    def describe(self) -> str:
        rows = self.ids.sort(dim=1).values  # (B | 1, L): each row's ids in order
        n_docs = int((rows[:, 1:] != rows[:, :-1]).sum()) + rows.shape[0]  # distinct ids, counted per row
        where = f" in {rows.shape[0]} rows" if rows.shape[0] > 1 else ""
        return f"documents({n_docs} documents{where}, ids {tuple(self.ids.shape)})"


@dataclass(frozen=True, eq=False)
class KeyPadding(Mask):
    """Every query of batch row b sees the valid keys of row b: ``valid`` (B, S) or ``lengths`` (B,)."""

    valid: torch.Tensor | None = None
    lengths: torch.Tensor | None = None

    @property
    def batch(self) -> int | None:
        data = self.valid if self.valid is not None else self.lengths
        assert data is not None  # the constructor key_padding() sets exactly one of them
        return data.shape[0] if data.shape[0] > 1 else None

    def check_size(self, L: int, S: int) -> None:
        if self.valid is not None and self.valid.shape[1] != S:
            raise ValueError(f"key_padding(valid) has shape {tuple(self.valid.shape)}, the keys have length S={S}")
        if self.lengths is not None and int(self.lengths.max()) > S:
            raise ValueError(f"key_padding(lengths) has a length {int(self.lengths.max())} > S={S}")

    def to(self, device: torch.device | str) -> KeyPadding:
        return KeyPadding(
            None if self.valid is None else self.valid.to(device), None if self.lengths is None else self.lengths.to(device)
        )

    def _valid(self, S: int, device: Device) -> torch.Tensor:
        """(B | 1, S) bool."""
        if self.valid is not None:
            return self.valid.to(device)
        assert self.lengths is not None
        return torch.arange(S, device=device)[None, :] < self.lengths.to(device)[:, None]

    def row_intervals(self, L: int, S: int, device: Device = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        valid = self._valid(S, device)  # (B | 1, S)
        positions = torch.arange(S, device=device)
        first = torch.where(valid, positions, S).amin(dim=1)  # (B | 1,): S when no key is valid
        last = torch.where(valid, positions, -1).amax(dim=1)
        if bool((valid.sum(dim=1) != (last - first + 1).clamp(min=0)).any()):
            return None  # holes between valid keys
        return first[:, None].expand(-1, L), last[:, None].expand(-1, L)  # (B | 1, L) each

    def visible(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, L: int, S: int
    ) -> torch.Tensor:
        if self.valid is not None:
            valid = self.valid.to(kv_idx.device)
            return valid[_batch_index(b, valid.shape[0]), kv_idx]
        assert self.lengths is not None
        lengths = self.lengths.to(kv_idx.device)
        return kv_idx < lengths[_batch_index(b, lengths.shape[0])]

    def block_states(self, L: int, S: int, block_q: int, block_k: int, device: Device = None) -> torch.Tensor:
        valid = self._valid(S, device)  # (B | 1, S)
        per_key_block = states_from_dense(valid[:, None, None, :], 1, block_k)  # (B | 1, 1, 1, nK)
        n_q = math.ceil(L / block_q)
        return per_key_block.expand(-1, -1, n_q, -1)  # (B | 1, 1, nQ, nK)

    def describe(self) -> str:
        if self.valid is not None:
            return f"key_padding(valid {tuple(self.valid.shape)})"
        assert self.lengths is not None
        return f"key_padding(lengths {self.lengths.tolist() if self.lengths.numel() <= 8 else tuple(self.lengths.shape)})"


# Masks evaluated point by point ---------------------------------------------------------------


def _states_by_rows(mask: Mask, L: int, S: int, block_q: int, block_k: int, device: Device) -> torch.Tensor:
    """Layout of a mask without structure: evaluate it one block row of queries at a time."""
    B, H = mask.batch or 1, mask.heads or 1
    rows_per_step = max(1, _EVAL_POINTS // (B * H * S * block_q)) * block_q
    b, h, _, k = _grid((B, H, 1, S), device)
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
        if t.shape[-2] not in (1, L) or t.shape[-1] not in (1, S):
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
        index = [_batch_index(i, size) for i, size in zip((b, h, q_idx, kv_idx), t.shape, strict=True)]
        return t[index[0], index[1], index[2], index[3]]

    def block_states(self, L: int, S: int, block_q: int, block_k: int, device: Device = None) -> torch.Tensor:
        t = self._4d().to(device)
        # a broadcast axis (size 1) is one block of its own; expand the states afterwards
        states = states_from_dense(t, block_q if t.shape[2] > 1 else 1, block_k if t.shape[3] > 1 else 1)
        return states.expand(-1, -1, math.ceil(L / block_q), math.ceil(S / block_k))  # (B | 1, H | 1, nQ, nK)

    def describe(self) -> str:
        return f"dense({tuple(self.tensor.shape)})"


# Combinations ----------------------------------------------------------------------------------


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


# Constructors ----------------------------------------------------------------------------------


def causal(align: Align = "bottom-right") -> Causal:
    """Causal mask: query at absolute position p sees keys 0..p (see the module docstring).

    >>> print(causal().to_dense(2, 4).int()[0, 0])
    tensor([[1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    _check_align(align)
    return Causal(align)


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
    left, right = _check_count(left, "left"), _check_count(right, "right")
    return SlidingWindow(min(left, _FAR), min(right, _FAR), align)


def _check_ids(ids: object, name: str) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(ids).__name__}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{name} must hold integer document ids, got dtype {ids.dtype}")
    if ids.ndim not in (1, 2) or ids.numel() == 0:
        raise ValueError(f"{name} must have shape (L,) or (B, L) and be non-empty, got {tuple(ids.shape)}")
    return ids.long().reshape(-1, ids.shape[-1])  # (B | 1, L)


def documents(ids: torch.Tensor, kv_ids: torch.Tensor | None = None) -> Documents:
    """Packed sequences: query and key see each other only within one document.

    Args:
        ids: (S,) or (B, S) integer document id of every position (per batch row if 2-D).
            Queries take the ids of the last L positions (bottom-right alignment).
        kv_ids: optional (S,) or (B, S) ids of the keys; ``ids`` are then the queries' own
            (L,) or (B, L) ids.

    >>> print(documents(torch.tensor([0, 0, 1, 1, 1])).to_dense(5, 5).int()[0, 0])
    tensor([[1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 1, 1],
            [0, 0, 1, 1, 1],
            [0, 0, 1, 1, 1]], dtype=torch.int32)
    """
    q_ids = _check_ids(ids, "ids")
    k_ids = None if kv_ids is None else _check_ids(kv_ids, "kv_ids")
    if k_ids is not None:
        if k_ids.device != q_ids.device:
            raise ValueError(f"ids are on {q_ids.device} but kv_ids on {k_ids.device}")
        if q_ids.shape[0] != k_ids.shape[0] and 1 not in (q_ids.shape[0], k_ids.shape[0]):
            raise ValueError(f"ids {tuple(ids.shape)} and kv_ids {tuple(k_ids.shape)} have different batch sizes")
    return Documents(q_ids, k_ids)


def key_padding(valid: torch.Tensor) -> KeyPadding:
    """Hide padded keys: ``valid`` is bool (B, S) (True = real token) or integer lengths (B,).

    >>> print(key_padding(torch.tensor([2, 3])).to_dense(1, 4).int()[:, 0, 0])
    tensor([[1, 1, 0, 0],
            [1, 1, 1, 0]], dtype=torch.int32)
    """
    if not isinstance(valid, torch.Tensor):
        raise TypeError(f"key_padding() takes a torch.Tensor, got {type(valid).__name__}")
    if valid.dtype == torch.bool:
        if valid.ndim != 2:
            raise ValueError(f"key_padding(valid) takes a bool tensor (B, S), got shape {tuple(valid.shape)}")
        return KeyPadding(valid=valid)
    if valid.is_floating_point() or valid.is_complex():
        raise TypeError(f"key_padding() takes bool (B, S) or integer lengths (B,), got dtype {valid.dtype}")
    if valid.ndim != 1 or valid.numel() == 0:
        raise ValueError(f"key_padding(lengths) takes a (B,) integer tensor, got shape {tuple(valid.shape)}")
    if bool((valid < 0).any()):
        raise ValueError(f"key_padding(lengths) must be >= 0, got {valid.tolist()}")
    return KeyPadding(lengths=valid.long())


def prefix_lm(n: int, *, align: Align = "bottom-right") -> PrefixLM:
    """Prefix-LM (T5): the first n positions are seen by every query, the rest causally.

    >>> print(prefix_lm(2).to_dense(4, 4).int()[0, 0])
    tensor([[1, 1, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 1, 1]], dtype=torch.int32)
    """
    _check_align(align)
    return PrefixLM(min(_check_count(n, "n"), _FAR), align)


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
            _check_count(value, name, minimum=1)
    return Predicate(fn, batch, heads)


def dense(tensor: torch.Tensor) -> Dense:
    """Wrap a bool tensor (True = may attend) broadcastable to (B, H, L, S)."""
    return Dense(tensor)


# Variable-length sequences ----------------------------------------------------------------------


def _check_lengths(lengths: object, name: str) -> torch.Tensor:
    if isinstance(lengths, (list, tuple)):
        if any(isinstance(x, bool) or not isinstance(x, int) for x in lengths):
            raise TypeError(f"{name} must hold ints, got {list(lengths)!r}")
        lengths = torch.tensor(list(lengths), dtype=torch.long)
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {type(lengths).__name__}")
    if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
        raise TypeError(f"{name} must hold integer lengths, got dtype {lengths.dtype}")
    if lengths.ndim != 1 or lengths.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D tensor, got shape {tuple(lengths.shape)}")
    if bool((lengths < 0).any()):
        raise ValueError(f"{name} must be >= 0, got {lengths.tolist()}")
    return lengths.long()


def _check_window(window: object) -> tuple[int, int] | None:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of ints >= 0, got {window!r}")
    return _check_count(window[0], "window left"), _check_count(window[1], "window right")


def _local_interval(
    p: torch.Tensor, k_len: torch.Tensor, causal: bool, window: tuple[int, int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last visible key, in the document's own key positions, of queries at
    document positions p (bottom-right: p = i + k_len - q_len) over k_len keys."""
    lo, hi = torch.zeros_like(p), k_len - 1
    if causal:
        hi = torch.minimum(hi, p)
    if window is not None:
        lo, hi = torch.maximum(lo, p - window[0]), torch.minimum(hi, p + window[1])
    return lo, hi


def _states_from_intervals(lo: torch.Tensor, hi: torch.Tensor, S: int, block_q: int, block_k: int) -> torch.Tensor:
    """Tile states (B | 1, 1, nQ, nK) of per-query key intervals lo..hi (B | 1, L) (empty when lo > hi).

    A tile is full when every row of its query block sees all its keys, and reported
    non-empty when the union bounds of the block's rows reach it (sound, see `qkv.kernels.layout`).
    """
    B, L = lo.shape
    n_q = math.ceil(L / block_q)
    pad = n_q * block_q - L
    nonempty = lo <= hi
    big = S + 1
    lo_any = torch.nn.functional.pad(torch.where(nonempty, lo, big), (0, pad), value=big).view(B, n_q, block_q)
    hi_any = torch.nn.functional.pad(torch.where(nonempty, hi, -1), (0, pad), value=-1).view(B, n_q, block_q)
    lo_all = torch.nn.functional.pad(torch.where(nonempty, lo, big), (0, pad), value=-1).view(B, n_q, block_q)
    hi_all = torch.nn.functional.pad(torch.where(nonempty, hi, -1), (0, pad), value=big).view(B, n_q, block_q)
    first_k, last_k = block_bounds(S, block_k, lo.device)
    k0, k1 = first_k[None, None, :], last_k[None, None, :]  # (1, 1, nK)
    any_visible = (k1 >= lo_any.amin(dim=2)[:, :, None]) & (k0 <= hi_any.amax(dim=2)[:, :, None])  # (B, nQ, nK)
    all_visible = (k0 >= lo_all.amax(dim=2)[:, :, None]) & (k1 <= hi_all.amin(dim=2)[:, :, None])  # (B, nQ, nK)
    return compose_states(all_visible & any_visible, any_visible)[:, None]  # (B | 1, 1, nQ, nK)


@dataclass(frozen=True, eq=False)
class Varlen(Mask):
    """Documents packed one after another along L and S (FlashAttention's varlen layout).

    Document d holds q_lengths[d] queries and k_lengths[d] keys; its queries see only its
    keys, at positions of its own: query i of the document sits at p = i + k_len - q_len
    (bottom-right), and ``causal`` / ``window`` apply to those positions.
    """

    q_lengths: torch.Tensor
    k_lengths: torch.Tensor
    causal: bool = False
    window: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        # per query: its first and last visible key and its position, in packed coordinates
        q_starts = torch.cumsum(self.q_lengths, 0) - self.q_lengths  # (docs,)
        k_starts = torch.cumsum(self.k_lengths, 0) - self.k_lengths  # (docs,)
        doc = torch.repeat_interleave(torch.arange(self.q_lengths.numel(), device=self.q_lengths.device), self.q_lengths)
        i = torch.arange(doc.numel(), device=doc.device) - q_starts[doc]  # (L,): row inside the document
        k_len, k0 = self.k_lengths[doc], k_starts[doc]
        p = i + k_len - self.q_lengths[doc]
        lo, hi = _local_interval(p, k_len, self.causal, self.window)
        object.__setattr__(self, "_lo", (lo + k0)[None])  # (1, L)
        object.__setattr__(self, "_hi", (hi + k0)[None])  # (1, L)
        object.__setattr__(self, "_pos", (p + k0)[None])  # (1, L)

    @property
    def total_q(self) -> int:
        return int(self.q_lengths.sum())

    @property
    def total_k(self) -> int:
        return int(self.k_lengths.sum())

    def to(self, device: torch.device | str) -> Varlen:
        return Varlen(self.q_lengths.to(device), self.k_lengths.to(device), self.causal, self.window)

    def check_size(self, L: int, S: int) -> None:
        if self.total_q != L or self.total_k != S:
            raise ValueError(
                f"varlen() packs {self.total_q} queries and {self.total_k} keys "
                f"({self.q_lengths.numel()} documents), the inputs have L={L} and S={S}"
            )

    def row_intervals(self, L: int, S: int, device: Device = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._lo.to(device), self._hi.to(device)  # type: ignore[attr-defined]

    def query_positions(self, L: int, S: int, device: Device = None) -> torch.Tensor:
        return self._pos.to(device)  # type: ignore[attr-defined]

    def visible(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, L: int, S: int
    ) -> torch.Tensor:
        lo, hi = self._lo[0].to(q_idx.device), self._hi[0].to(q_idx.device)  # type: ignore[attr-defined]
        return (kv_idx >= lo[q_idx]) & (kv_idx <= hi[q_idx])

    def block_states(self, L: int, S: int, block_q: int, block_k: int, device: Device = None) -> torch.Tensor:
        return _states_from_intervals(*self.row_intervals(L, S, device), S, block_q, block_k)

    def describe(self) -> str:
        return f"varlen({_lengths_text(self.q_lengths, self.k_lengths)}{_options_text(self.causal, self.window)})"


@dataclass(frozen=True, eq=False)
class Padded(Mask):
    """A padded batch: row b holds q_lengths[b] real queries and k_lengths[b] real keys first.

    Query i of row b sits at p = i + k_len - q_len (bottom-right to the row's own lengths);
    ``causal`` / ``window`` apply to those positions; padded queries see nothing (zero rows).
    """

    q_lengths: torch.Tensor
    k_lengths: torch.Tensor
    causal: bool = False
    window: tuple[int, int] | None = None

    @property
    def batch(self) -> int | None:
        return self.q_lengths.numel() if self.q_lengths.numel() > 1 else None

    def to(self, device: torch.device | str) -> Padded:
        return Padded(self.q_lengths.to(device), self.k_lengths.to(device), self.causal, self.window)

    def check_size(self, L: int, S: int) -> None:
        if int(self.q_lengths.max()) > L or int(self.k_lengths.max()) > S:
            raise ValueError(
                f"padded() has rows of up to {int(self.q_lengths.max())} queries and {int(self.k_lengths.max())} "
                f"keys, the inputs have L={L} and S={S}"
            )

    def _rows(
        self, b: torch.Tensor, q_idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(p, lo, hi) of queries q_idx in rows b; lo > hi for padded queries."""
        q_lengths, k_lengths = self.q_lengths.to(q_idx.device), self.k_lengths.to(q_idx.device)
        rows = _batch_index(b, q_lengths.shape[0])
        q_len, k_len = q_lengths[rows], k_lengths[rows]
        p = q_idx + k_len - q_len
        lo, hi = _local_interval(p, k_len, self.causal, self.window)
        return p, lo, torch.where(q_idx < q_len, hi, lo - 1)

    def row_intervals(self, L: int, S: int, device: Device = None) -> tuple[torch.Tensor, torch.Tensor]:
        b = torch.arange(self.q_lengths.numel(), device=device)[:, None]  # (B, 1)
        _, lo, hi = self._rows(b, torch.arange(L, device=device)[None, :])
        return lo.clamp(min=0), hi.clamp(max=S - 1)  # (B, L) each

    def query_positions(self, L: int, S: int, device: Device = None) -> torch.Tensor:
        b = torch.arange(self.q_lengths.numel(), device=device)[:, None]  # (B, 1)
        return self._rows(b, torch.arange(L, device=device)[None, :])[0]  # (B, L)

    def visible(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, L: int, S: int
    ) -> torch.Tensor:
        _, lo, hi = self._rows(b, q_idx)
        return (kv_idx >= lo) & (kv_idx <= hi)

    def block_states(self, L: int, S: int, block_q: int, block_k: int, device: Device = None) -> torch.Tensor:
        return _states_from_intervals(*self.row_intervals(L, S, device), S, block_q, block_k)

    def describe(self) -> str:
        return f"padded({_lengths_text(self.q_lengths, self.k_lengths)}{_options_text(self.causal, self.window)})"


def _lengths_text(q_lengths: torch.Tensor, k_lengths: torch.Tensor) -> str:
    def short(x: torch.Tensor) -> str:
        return str(x.tolist()) if x.numel() <= 8 else f"{x.numel()} lengths, total {int(x.sum())}"

    same = q_lengths.shape == k_lengths.shape and bool((q_lengths == k_lengths).all())
    return short(q_lengths) if same else f"{short(q_lengths)}, {short(k_lengths)}"


def _options_text(causal: bool, window: tuple[int, int] | None) -> str:
    return (", causal=True" if causal else "") + (f", window={window}" if window is not None else "")


def _variable_lengths(
    q_lengths: object, k_lengths: object, causal: object, window: object, name: str
) -> tuple[torch.Tensor, torch.Tensor, bool, tuple[int, int] | None]:
    q = _check_lengths(q_lengths, "q_lengths")
    k = q if k_lengths is None else _check_lengths(k_lengths, "k_lengths")
    if k.shape != q.shape:
        raise ValueError(f"{name}: q_lengths has {q.numel()} entries but k_lengths has {k.numel()}")
    if k.device != q.device:
        raise ValueError(f"{name}: q_lengths are on {q.device} but k_lengths on {k.device}")
    if not isinstance(causal, bool):
        raise TypeError(f"{name}: causal must be a bool, got {causal!r}")
    return q, k, causal, _check_window(window)


def varlen(
    q_lengths: torch.Tensor | list[int],
    k_lengths: torch.Tensor | list[int] | None = None,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
) -> Varlen:
    """Documents packed one after another along L and S, each with positions of its own.

    Args:
        q_lengths: (docs,) queries of each document, in packing order.
        k_lengths: (docs,) keys of each document; default q_lengths.
        causal: query i of a document with q_len queries and k_len keys sees its keys
            0 .. i + k_len - q_len (bottom-right to the document, FlashAttention's varlen
            semantics and xformers' BlockDiagonalCausalFromBottomRightMask).
        window: (left, right): that query sees its keys p - left .. p + right, p = i + k_len - q_len.

    Two documents of 2 and 3 tokens, causal inside each:

    >>> print(varlen([2, 3], causal=True).to_dense(5, 5).int()[0, 0])
    tensor([[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1]], dtype=torch.int32)
    """
    return Varlen(*_variable_lengths(q_lengths, k_lengths, causal, window, "varlen"))


def padded(
    q_lengths: torch.Tensor | list[int],
    k_lengths: torch.Tensor | list[int] | None = None,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
) -> Padded:
    """A padded batch: row b's first q_lengths[b] queries and k_lengths[b] keys are real.

    Causal and window align bottom-right to each row's own lengths (as `varlen`); padded
    keys are hidden and padded queries see nothing (their output rows are zeros).

    Row 0 holds 2 queries over 3 keys, row 1 one query over 2 keys, causal:

    >>> print(padded([2, 1], [3, 2], causal=True).to_dense(2, 3).int()[:, 0])
    tensor([[[1, 1, 0],
             [1, 1, 1]],
    <BLANKLINE>
            [[1, 1, 0],
             [0, 0, 0]]], dtype=torch.int32)
    """
    return Padded(*_variable_lengths(q_lengths, k_lengths, causal, window, "padded"))
