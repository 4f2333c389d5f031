"""Which tokens of a sequence each rank holds: the contiguous and zigzag layouts.

A sequence of T tokens is cut into chunks; a rank's shard is one chunk ("contiguous") or
two ("zigzag"). With P ranks:

- ``contiguous``: P chunks, rank r holds chunk r.
- ``zigzag``: 2P chunks, rank r holds chunks r and 2P-1-r, in that order. Under a causal
  mask an early chunk sees few keys and a late one many, so pairing them gives every rank
  the same work (the load balancing of Brandon et al. 2023, "Striped Attention", and of the
  "zigzag" ring-flash-attention implementations; Liu et al. 2023, "Ring Attention", use the
  contiguous layout). With P = 2 and T = 8::

      position    0 1 2 3 4 5 6 7
      contiguous  0 0 0 0 1 1 1 1
      zigzag      0 0 1 1 1 1 0 0

Uneven lengths are handled: chunks are cut like ``torch.tensor_split`` (the first
T mod n chunks hold one token more), so any T works as long as every chunk holds at least
one token (T >= P contiguous, T >= 2P zigzag); shorter sequences are rejected with a
ValueError. `shard`, `unshard` and `positions` are the bookkeeping; `positions` gives the
global position ids of a shard, which RoPE needs under the zigzag layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from qkv._checks import positive_int

__all__ = [
    "LAYOUTS",
    "Chunk",
    "Layout",
    "check_layout",
    "positions",
    "shard",
    "shard_chunks",
    "shard_lengths",
    "unshard",
]

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Chunk:
    """A run of consecutive tokens: global positions [start, stop), at `offset` in the shard."""

    start: int  # global position of the chunk's first token
    stop: int  # one past the global position of its last token
    offset: int  # index of its first token inside the rank's shard

    @property
    def length(self) -> int:
        return self.stop - self.start


def check_layout(layout: object) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(repr(x) for x in LAYOUTS)}; got {layout!r}")


def _check_world(rank: int, world_size: int) -> None:
    positive_int(world_size, "world_size")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")


def _chunk_count(world_size: int, layout: str) -> int:
    return world_size if layout == "contiguous" else 2 * world_size


def _chunk_bounds(seq_len: int, world_size: int, layout: str) -> list[tuple[int, int]]:
    """Global [start, stop) of every chunk, cut like torch.tensor_split."""
    n = _chunk_count(world_size, layout)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < n:
        raise ValueError(
            f"the {layout!r} layout over {world_size} rank(s) cuts the sequence into {n} chunks of at "
            f"least one token, so it needs at least {n} tokens; got a sequence length of {seq_len!r}"
        )
    base, extra = divmod(seq_len, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard_chunks(seq_len: int, rank: int, world_size: int, layout: Layout = "contiguous") -> tuple[Chunk, ...]:
    """The chunks rank `rank` holds, in shard order, with their global and local positions."""
    check_layout(layout)
    _check_world(rank, world_size)
    bounds = _chunk_bounds(seq_len, world_size, layout)
    owned = [rank] if layout == "contiguous" else [rank, 2 * world_size - 1 - rank]
    chunks, offset = [], 0
    for index in owned:
        start, stop = bounds[index]
        chunks.append(Chunk(start, stop, offset))
        offset += stop - start
    return tuple(chunks)


def shard_lengths(seq_len: int, world_size: int, layout: Layout = "contiguous") -> list[int]:
    """Number of tokens each rank holds."""
    return [sum(c.length for c in shard_chunks(seq_len, r, world_size, layout)) for r in range(world_size)]


def positions(seq_len: int, rank: int, world_size: int, layout: Layout = "contiguous") -> torch.Tensor:
    """Global position ids (L_r,) of the tokens in rank `rank`'s shard, int64 (for RoPE).

    >>> positions(8, 0, 2, "zigzag")
    tensor([0, 1, 6, 7])
    """
    chunks = shard_chunks(seq_len, rank, world_size, layout)
    return torch.cat([torch.arange(c.start, c.stop) for c in chunks])  # (L_r,)


def _check_dim(x: torch.Tensor, dim: int, name: str) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim={dim} is out of range for {name} of shape {tuple(x.shape)}")
    return dim % x.ndim


def shard(x: torch.Tensor, rank: int, world_size: int, layout: Layout = "contiguous", dim: int = -2) -> torch.Tensor:
    """Rank `rank`'s shard of a full sequence tensor, cut along `dim` (the sequence axis).

    Args:
        x: e.g. (B, H, T, E) with dim=-2: the whole sequence.
        rank, world_size: which shard, out of how many.
        layout: "contiguous" or "zigzag" (see the module docstring).

    Returns:
        (B, H, L_r, E): a view of x for "contiguous", a new tensor for "zigzag" (two chunks
        concatenated). Differentiable.

    >>> shard(torch.arange(8), 1, 2, "zigzag", dim=0)
    tensor([2, 3, 4, 5])
    """
    d = _check_dim(x, dim, "x")
    chunks = shard_chunks(x.shape[d], rank, world_size, layout)
    pieces = [x.narrow(d, c.start, c.length) for c in chunks]  # each (..., chunk length, ...)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=d)  # (..., L_r, ...)


def unshard(parts: Sequence[torch.Tensor], layout: Layout = "contiguous", dim: int = -2) -> torch.Tensor:
    """Inverse of `shard`: the full sequence from every rank's shard, given in rank order.

    Args:
        parts: P tensors, part r being rank r's shard, e.g. (B, H, L_r, E) with dim=-2.
        layout: the layout the parts were cut with.

    Returns:
        (B, H, T, E) with T = sum of the L_r. Raises ValueError when the part lengths are not
        those `shard` produces for T tokens over P ranks.
    """
    check_layout(layout)
    if isinstance(parts, torch.Tensor) or len(parts) == 0:
        raise ValueError("parts must be a non-empty sequence of tensors, one per rank, in rank order")
    dims = {_check_dim(p, dim, f"parts[{i}]") for i, p in enumerate(parts)}
    if len(dims) != 1:
        raise ValueError(f"parts must have the same number of dimensions, got {[p.ndim for p in parts]}")
    d = dims.pop()
    world_size = len(parts)
    lengths = [p.shape[d] for p in parts]
    seq_len = sum(lengths)
    expected = shard_lengths(seq_len, world_size, layout)
    if lengths != expected:
        raise ValueError(
            f"part lengths {lengths} along dim {dim} are not the {layout!r} shards of a {seq_len}-token "
            f"sequence over {world_size} ranks, which are {expected}"
        )
    pieces: list[tuple[int, torch.Tensor]] = []
    for rank, part in enumerate(parts):
        for c in shard_chunks(seq_len, rank, world_size, layout):
            pieces.append((c.start, part.narrow(d, c.offset, c.length)))  # (..., chunk length, ...)
    pieces.sort(key=lambda item: item[0])
    return torch.cat([p for _, p in pieces], dim=d)  # (..., T, ...)
