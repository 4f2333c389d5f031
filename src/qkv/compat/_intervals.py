"""`KeyIntervals`: a mask given by one interval of keys per query, lo_i <= j <= hi_i.

It holds what xformers' block-diagonal biases describe and `qkv.masks.varlen` cannot: a
causal diagonal aligned top-left inside each block when a block has more keys than queries
(``BlockDiagonalCausalMask``), and key blocks with unused slots between them
(``...PaddedKeysMask``, ``...GappyKeysMask``). The intervals come from the bias's own
lengths in O(L) work; the tiles and the block engine's key ranges come from them, as for
`qkv.masks.varlen`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.masks import Mask
from qkv.masks._base import Device
from qkv.masks._layout import states_from_intervals

__all__ = ["KeyIntervals"]


@dataclass(frozen=True, eq=False)
class KeyIntervals(Mask):
    """Query i sees the keys lo[i] <= j <= hi[i] (none when lo[i] > hi[i]).

    ``lo``, ``hi``, ``positions``: (L,) int64; ``positions`` is each query's position in key
    coordinates (for position-dependent biases); ``name`` is what `describe` prints.
    """

    lo: torch.Tensor
    hi: torch.Tensor
    positions: torch.Tensor
    S: int
    name: str

    def check_size(self, L: int, S: int) -> None:
        if self.lo.shape[0] != L or self.S != S:
            raise ValueError(f"{self.name} covers {self.lo.shape[0]} queries and {self.S} keys, the inputs have L={L} and S={S}")

    def to(self, device: torch.device | str) -> KeyIntervals:
        return KeyIntervals(self.lo.to(device), self.hi.to(device), self.positions.to(device), self.S, self.name)

    def visible(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, L: int, S: int
    ) -> torch.Tensor:
        lo, hi = self.lo.to(q_idx.device)[q_idx], self.hi.to(q_idx.device)[q_idx]
        return (kv_idx >= lo) & (kv_idx <= hi)

    def row_intervals(self, L: int, S: int, device: Device = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lo.clamp(min=0).to(device)[None], self.hi.clamp(max=S - 1).to(device)[None]  # (1, L) each

    def query_positions(self, L: int, S: int, device: Device = None) -> torch.Tensor:
        return self.positions.to(device)[None]  # (1, L)

    def block_states(self, L: int, S: int, block_q: int, block_k: int, device: Device = None) -> torch.Tensor:
        return states_from_intervals(*self.row_intervals(L, S, device), S, block_q, block_k)

    def describe(self) -> str:
        return self.name
