"""FlashAttention's ``alibi_slopes`` as a `qkv.bias`: (H,) slopes, or (R, H) slopes per row.

FlashAttention adds ``-slope * |i + S - L - j|`` to the score of query i and key j (its
docstrings); (H,) slopes are `qkv.bias.alibi`. (R, H) slopes give each batch row (or each
packed sequence of ``flash_attn_varlen_func``) slopes of its own: `RowALiBi`, which reads the
row of a query from the batch index, or from a (L,) table for packed sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv import bias as qbias
from qkv._checks import size_broadcasts

__all__ = ["RowALiBi", "alibi_from_slopes"]


@dataclass(frozen=True, eq=False)
class RowALiBi(qbias.Bias):
    """ALiBi with slopes (R, H) per row: ``-slopes[r, h] * |p_i - j|``.

    ``rows`` (L,) int64 gives the row of each query (packed sequences); None means the batch
    index is the row.
    """

    slopes: torch.Tensor
    rows: torch.Tensor | None = None

    @property
    def batch(self) -> int | None:
        return self.slopes.shape[0] if self.rows is None and self.slopes.shape[0] > 1 else None

    @property
    def heads(self) -> int | None:
        return self.slopes.shape[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.slopes,)

    def with_tensors(self, tensors: tuple[torch.Tensor, ...]) -> qbias.Bias:
        return RowALiBi(tensors[0], self.rows)

    def bind(self, batch_shape: tuple[int, ...], H: int, L: int, S: int) -> qbias.Bias:
        super().bind(batch_shape, H, L, S)
        n = 1
        for size in batch_shape:
            n *= size
        if self.rows is None and not size_broadcasts(self.slopes.shape[0], n):
            raise ValueError(f"alibi_slopes has {self.slopes.shape[0]} rows, the inputs have batch {n}")
        if self.rows is not None and self.rows.shape[0] != L:
            raise ValueError(f"alibi_slopes' row table has {self.rows.shape[0]} queries, the inputs have L={L}")
        return self

    def terms(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, q_pos: torch.Tensor
    ) -> torch.Tensor:
        slopes = self.slopes.to(q_pos.device)
        if self.rows is not None:
            row = self.rows.to(q_idx.device)[q_idx]
        else:
            row = b if slopes.shape[0] > 1 else torch.zeros_like(b)
        return -slopes[row, h] * (q_pos - kv_idx).abs().to(slopes.dtype)

    def flops_per_pair(self) -> int:
        return 4  # subtract, absolute value, multiply, add

    def describe(self) -> str:
        return f"alibi({self.slopes.shape[0]} rows x {self.slopes.shape[1]} heads)"


def alibi_from_slopes(
    slopes: object, rows: int, heads: int, row_of_query: torch.Tensor | None = None
) -> qbias.Bias | None:
    """FlashAttention's ``alibi_slopes`` (None, (H,) or (rows, H) float) as a qkv bias."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor) or not slopes.is_floating_point():
        got = slopes.dtype if isinstance(slopes, torch.Tensor) else type(slopes).__name__
        raise TypeError(f"alibi_slopes must be a float tensor (nheads,) or (batch_size, nheads), got {got}")
    if tuple(slopes.shape) == (heads,):
        return qbias.alibi(slopes)
    if tuple(slopes.shape) == (rows, heads):
        return RowALiBi(slopes, row_of_query)
    raise ValueError(
        f"alibi_slopes must have shape (nheads,) = ({heads},) or (batch_size, nheads) = ({rows}, {heads}), "
        f"got {tuple(slopes.shape)}"
    )
