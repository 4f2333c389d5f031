"""Block layouts: which tiles of the L x S score matrix a mask leaves empty, full or partial.

The score matrix is cut into tiles of ``block_q`` query rows by ``block_k`` key columns (the
last row and column of tiles may be smaller). A tile is

- EMPTY when the mask hides every (query, key) pair in it: the tile is never computed;
- FULL when the mask shows every pair: the tile is computed without a mask;
- PARTIAL otherwise: the tile is computed with its slice of the mask.

This is the block-sparse description that FlashAttention's block-sparse variant and
PyTorch's FlexAttention ``BlockMask`` use (kv_num_blocks / kv_indices for partial tiles,
full_kv_num_blocks / full_kv_indices for full ones). A layout is only required to be
*sound*: EMPTY and FULL must be exact, PARTIAL may be reported for a tile that turns out to
be empty or full (combined masks do this); the kernels stay exact either way.

Each mask computes its own layout (`Mask.layout`) from its structure; the kernels only read
layouts (FlexAttention's BlockMask, the CPU block engine's plan), never the reverse.

References:
- Dao et al., "FlashAttention", NeurIPS 2022, section 3.3 (block-sparse FlashAttention).
- PyTorch, ``torch.nn.attention.flex_attention.BlockMask`` documentation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import torch

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockLayout",
    "block_bounds",
    "compose_states",
    "states_from_dense",
    "states_from_intervals",
]

EMPTY: Final = 0
PARTIAL: Final = 1
FULL: Final = 2

# Characters of `BlockLayout.draw`, one per tile state.
_GLYPHS: Final = {EMPTY: "·", PARTIAL: "▒", FULL: "█"}


def block_bounds(length: int, block: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last index of every block of ``block`` positions over ``length``: two (n_blocks,) tensors."""
    first = torch.arange(0, length, block, device=device)  # (n,)
    last = torch.clamp(first + block - 1, max=length - 1)  # (n,)
    return first, last


def states_from_dense(visible: torch.Tensor, block_q: int, block_k: int) -> torch.Tensor:
    """Tile states (B | 1, H | 1, nQ, nK) uint8 of an explicit bool mask (B | 1, H | 1, l, s).

    This evaluates every point; the masks that have structure never call it on the whole
    matrix (only `dense` masks, predicates block row by block row, and the tests do).
    """
    b, h, length_q, length_k = visible.shape
    n_q, n_k = math.ceil(length_q / block_q), math.ceil(length_k / block_k)
    pad = (0, n_k * block_k - length_k, 0, n_q * block_q - length_q)
    tiles_any = torch.nn.functional.pad(visible, pad, value=False)
    tiles_all = torch.nn.functional.pad(visible, pad, value=True)
    shape = (b, h, n_q, block_q, n_k, block_k)
    any_visible = tiles_any.reshape(shape).any(dim=5).any(dim=3)  # (B | 1, H | 1, nQ, nK)
    all_visible = tiles_all.reshape(shape).all(dim=5).all(dim=3)  # (B | 1, H | 1, nQ, nK)
    return compose_states(all_visible, any_visible)


def compose_states(all_visible: torch.Tensor, any_visible: torch.Tensor) -> torch.Tensor:
    """FULL where every pair of a tile is visible, EMPTY where none is, PARTIAL elsewhere (uint8)."""
    partial_or_empty = torch.where(any_visible, PARTIAL, EMPTY)
    return torch.where(all_visible, FULL, partial_or_empty).to(torch.uint8)


def states_from_intervals(lo: torch.Tensor, hi: torch.Tensor, S: int, block_q: int, block_k: int) -> torch.Tensor:
    """Tile states (B | 1, 1, nQ, nK) of per-query key intervals lo..hi (B | 1, L) (empty when lo > hi).

    A tile is full when every row of its query block sees all its keys, and reported
    non-empty when the union bounds of the block's rows reach it (sound, see above).
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
class BlockLayout:
    """Tile states of one mask at one problem size.

    ``states`` is (B | 1, H | 1, nQ, nK) uint8 with values EMPTY, PARTIAL, FULL; a size-1
    batch or head axis means the layout is the same for every batch row or head.
    """

    states: torch.Tensor
    L: int
    S: int
    block_q: int
    block_k: int
    name: str = "mask"

    @property
    def n_q(self) -> int:
        return self.states.shape[-2]

    @property
    def n_k(self) -> int:
        return self.states.shape[-1]

    def count(self, state: int) -> int:
        """Number of tiles in ``state`` over every batch row and head of the layout."""
        return int((self.states == state).sum())

    @property
    def visited_block_fraction(self) -> float:
        """Fraction of tiles that are not EMPTY."""
        return 1.0 - self.count(EMPTY) / self.states.numel()

    def visited_pairs(self) -> float:
        """(query, key) pairs inside non-empty tiles, averaged over the layout's batch and head axes.

        Edge tiles are smaller than block_q x block_k; they are counted by their true size.
        """
        first_q, last_q = block_bounds(self.L, self.block_q, self.states.device)
        first_k, last_k = block_bounds(self.S, self.block_k, self.states.device)
        rows = (last_q - first_q + 1).double()  # (nQ,)
        cols = (last_k - first_k + 1).double()  # (nK,)
        area = rows[:, None] * cols[None, :]  # (nQ, nK)
        visited = (self.states != EMPTY).double() * area  # (B | 1, H | 1, nQ, nK)
        return float(visited.sum(dim=(-1, -2)).mean())

    def draw(self, batch: int = 0, head: int = 0) -> str:
        """The tiles as text: one character per tile, a row per query block.

        █ full (computed without a mask), ▒ partial (computed with the mask's tile), · empty
        (skipped). Rows are labelled with their first query index. ``batch`` and ``head``
        pick the row and head to draw; any index is accepted on an axis of size 1, the
        layout being the same for every row or head there.
        """
        for name, index, size in (("batch", batch, self.states.shape[0]), ("head", head, self.states.shape[1])):
            if isinstance(index, bool) or not isinstance(index, int) or index < 0 or (size > 1 and index >= size):
                raise ValueError(f"{name} must be an int in [0, {size}) for the layout of {self.name}, got {index!r}")
        b = min(batch, self.states.shape[0] - 1)
        h = min(head, self.states.shape[1] - 1)
        grid = self.states[b, h].tolist()
        label_width = len(str(max(0, (self.n_q - 1) * self.block_q)))
        lines = [
            f"{self.name}: L={self.L} S={self.S}, tiles of {self.block_q} queries x {self.block_k} keys",
            f"{'q':>{label_width}}  keys 0..{self.S - 1} →",
        ]
        for i, row in enumerate(grid):
            lines.append(f"{i * self.block_q:>{label_width}}  " + "".join(_GLYPHS[s] for s in row))
        total = self.states[b, h].numel()
        empty = int((self.states[b, h] == EMPTY).sum())
        full = int((self.states[b, h] == FULL).sum())
        lines.append(
            f"{_GLYPHS[FULL]} full {full}, {_GLYPHS[PARTIAL]} partial {total - empty - full}, "
            f"{_GLYPHS[EMPTY]} empty {empty}: {total - empty} of {total} tiles visited "
            f"({(total - empty) / total:.1%})"
        )
        return "\n".join(lines)
