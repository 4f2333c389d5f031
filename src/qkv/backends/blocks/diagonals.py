"""Score terms that the fused bf16 interval kernels apply themselves, and a bias as a table of diagonals.

The kernels (`qkv.native.interval_bf16` and its backward) can apply, inside their own pass, a
softcap and a bias that depends on the head and on the distance between query and key only
(`Bias.shift_invariant`: ALiBi, T5's relative buckets, and sums of them), the same for every
batch row. Such a bias has one value per head and diagonal: the pair (query i at key position
p_i, key j) reads ``table[h, p_i - j + offset]``, so the kernels need its (H | 1, D) float32
values, not an L x S tile.

`fused_terms_reason` says why a problem's terms cannot go there (`qkv.attention.dispatch` then
keeps the scored engine's kernels); `diagonal_table` builds the table, once per call: at
dispatch (`Plan.diagonals`), or where a traced graph runs (`engine._kernel_terms`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qkv.scores import ScoreTerms

__all__ = ["LARGEST_FUSED_BIAS", "TABLE_REFUSAL", "DiagonalTable", "diagonal_table", "fused_terms_reason"]

# A bias whose largest entry, or whose entry at some row's nearest visible key, is at least
# this large in size is left to the scored engine, which keeps the lse in two parts there
# (`scored._HUGE_OFFSET`); the kernels keep one float32 lse, exact to about 2^-10 here.
LARGEST_FUSED_BIAS = 2.0**14
# Entries of the table before the first and after the last diagonal a real pair reads: the
# kernels read, and then ignore, pairs of query blocks padded to 64 rows (their positions
# continue the last row's: `interval_terms` checks that these reads stay inside); the front
# is slack, no read reaches it.
_FRONT, _BACK = 32, 64
# a table longer than this many times L + S is refused (positions far apart across batch rows)
_LONGEST = 2
# positions are int32 inside the kernels
_POSITION_LIMIT = 2**30


# why `diagonal_table` returns None, in `qkv.explain`'s words
TABLE_REFUSAL = (
    f"it keeps one float32 lse and reads the bias from a table of diagonals, which this bias does not fit "
    f"(a row offset of {LARGEST_FUSED_BIAS:g} or more, a key it hides, or a table longer than {_LONGEST} (L + S))"
)


@dataclass(frozen=True)
class DiagonalTable:
    """A shift-invariant bias by diagonal: ``table`` (H | 1, D) float32 contiguous, query
    positions in key coordinates ``positions`` (N | 1, L) int64, and the entry of the pair
    (query i of batch row n, key j) at ``positions[n, i] - j + offset``."""

    table: torch.Tensor
    positions: torch.Tensor
    offset: int


def fused_terms_reason(terms: ScoreTerms, needs_grad: bool) -> str | None:
    """Why the fused bf16 interval kernels cannot apply these score terms, or None when they
    can (plain Python on the bias's parameters: no tensor is read)."""
    if terms.score_mod is not None:
        return "it applies no score_mod"
    bias = terms.bias
    if bias is None:
        return None
    if not bias.shift_invariant:
        return f"it applies a bias only when it depends on the distance to the key alone, not {bias.describe()}"
    if bias.batch is not None:
        return "it applies no bias that varies over batch rows"
    if needs_grad and any(t.requires_grad for t in bias.tensors()):
        return "it gives the bias's tensors no gradient"
    return None


def diagonal_table(terms: ScoreTerms, H: int, intervals: tuple[torch.Tensor, torch.Tensor]) -> DiagonalTable | None:
    """The bias of ``terms`` (shift-invariant, bound to H heads) as a table of diagonals, for
    the rows whose visible keys are ``intervals`` (lo, hi (N | 1, L) int64, `Mask.row_intervals`),
    or None when it does not suit the kernels (`TABLE_REFUSAL`): a row offset that may reach
    `LARGEST_FUSED_BIAS` (`_offsets_fit`), a non-finite entry, positions beyond int32, or a
    table longer than 2 (L + S) entries. Evaluates the bias once per head and diagonal with its
    tensors in float64 (a bias in bf16, such as ALiBi slopes of a bf16 module, would otherwise
    round its distances to bf16), rounded to float32, the dtype of the scored engine's tiles."""
    bias = terms.bias
    assert bias is not None and bias.shift_invariant
    L, S = terms.L, terms.S
    batch_rows = 1 if terms.positions is None else terms.positions.shape[0]
    positions = terms.q_pos(torch.arange(batch_rows).view(-1, 1), torch.arange(L).view(1, L)).to(torch.long)  # (N | 1, L)
    if positions.numel() == 0:
        return None
    low, high = int(positions.min()), int(positions.max())
    if max(abs(low), abs(high)) >= _POSITION_LIMIT:
        return None
    # distances p - j from low - (S - 1) to high, with the margins the kernels read past them
    offset = S - 1 - low + _FRONT
    length = high - low + S + _FRONT + _BACK
    if length >= _POSITION_LIMIT or length > _LONGEST * (L + S) + _FRONT + _BACK:
        return None
    wide = tuple(t.detach().to(torch.float64) if t.is_floating_point() else t.detach() for t in bias.tensors())
    bias = bias.with_tensors(wide) if wide else bias
    distance = torch.arange(length, dtype=torch.long) - offset  # (D,) p - j of each entry
    # any key index with the query at key + distance: a shift-invariant bias sees the difference only
    key = torch.full((1, 1, 1, 1), S + _BACK, dtype=torch.long)
    heads = torch.arange(bias.heads or 1).view(1, -1, 1, 1)  # (1, H | 1, 1, 1)
    q_pos = (key + distance).view(1, 1, 1, length)  # (1, 1, 1, D)
    with torch.no_grad():
        values = bias.terms(torch.zeros(1, 1, 1, 1, dtype=torch.long), heads, q_pos, key, q_pos)  # (1, H | 1, 1, D)
        values = values.to(torch.float32).reshape(-1, length)  # (H | 1, D)
    if values.shape[0] not in (1, H):
        return None
    table = DiagonalTable(values.contiguous(), positions.contiguous(), offset)
    return table if bool(torch.isfinite(values).all()) and _offsets_fit(table, *intervals, S) else None


def _offsets_fit(table: DiagonalTable, lo: torch.Tensor, hi: torch.Tensor, S: int) -> bool:
    """Whether every row's largest bias over its visible keys (its offset) lies within
    +-`LARGEST_FUSED_BIAS`: it lies between the row's entry at its visible key nearest to its own
    position and the table's largest entry, so both are checked (the first is the row's largest
    for ALiBi with slopes >= 0, whose bias falls with the distance). Rows without a visible key
    have no offset."""
    if float(table.table.max()) >= LARGEST_FUSED_BIAS:
        return False
    first, last = lo.clamp(min=0), hi.clamp(max=S - 1)  # (N | 1, L) each
    seen = first <= last
    positions = table.positions.expand(max(lo.shape[0], table.positions.shape[0]), -1)  # (N | 1, L)
    nearest = torch.minimum(torch.maximum(positions, first), last)  # (N | 1, L): the visible key nearest to p
    entries = table.table[:, (positions - nearest + table.offset)[seen.expand_as(positions)]]  # (H | 1, rows seen)
    return entries.numel() == 0 or float(entries.min()) > -LARGEST_FUSED_BIAS
