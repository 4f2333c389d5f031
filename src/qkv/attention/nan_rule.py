"""The one rule for non-finite inputs, the same on every path.

PyTorch's kernels disagree about a NaN: the fused CPU kernel returns a zero row for a NaN
query, the explicit formula a NaN row; a NaN value at a masked key poisons other rows in one
(0 * NaN in the weights-times-values product) and not in another. qkv decides once, before
and after the kernel, so that every path returns the same thing:

    A NaN or an infinity in q, k or v makes NaN the output row, the weights row and the lse of
    every query that reads it: query i of head h when q[h, i] holds one, and every query that
    may see key j (mask and causality applied) when k[g, j] or v[g, j] holds one. Every other
    row is exact, as if the non-finite entries were not there. The NaN rows pass no gradient.

How: the affected rows are found from the non-finite positions (O(L x number of bad keys)),
the non-finite entries are replaced by 0 for the kernel, and the affected rows are set to NaN
afterwards.
"""

from __future__ import annotations

import dataclasses
from typing import overload

import torch

from qkv._private import torch as private_torch
from qkv.attention.problem import AttentionProblem
from qkv.masks import Causal, Combined, Documents, Mask, Padded, PrefixLM, SlidingWindow, Varlen

__all__ = ["affected_rows", "finite_problem", "poison"]


def _visible_columns(problem: AttentionProblem, cols: torch.Tensor, first: int = 0, stop: int | None = None) -> torch.Tensor:
    """Whether the queries first..stop - 1 (default: all L) may see the keys ``cols`` (c,):
    (N | 1, H | 1, rows, c) bool."""
    mask, L, S = problem.mask, problem.L, problem.S
    stop = L if stop is None else stop
    device = problem.q.device
    if mask is None:
        return torch.ones(1, 1, stop - first, cols.numel(), dtype=torch.bool, device=device)
    if isinstance(mask, Mask):
        B, Hm = mask.batch or 1, mask.heads or 1
        b = torch.arange(B, device=device).view(B, 1, 1, 1)  # (B | 1, 1, 1, 1)
        h = torch.arange(Hm, device=device).view(1, Hm, 1, 1)  # (1, H | 1, 1, 1)
        q_idx = torch.arange(first, stop, device=device).view(1, 1, -1, 1)  # (1, 1, rows, 1)
        k_idx = cols.to(device).view(1, 1, 1, -1)  # (1, 1, 1, c)
        visible = mask.to(device).visible(b, h, q_idx, k_idx, L, S)
        return torch.broadcast_to(visible, (B, Hm, stop - first, cols.numel()))
    picked = mask[..., first:stop, :][..., cols]  # (N | 1, H | 1, rows, c)
    return picked if picked.dtype == torch.bool else picked != float("-inf")


def affected_rows(problem: AttentionProblem) -> torch.Tensor:
    """(N, H, L) bool: the query rows that read a non-finite entry of q, k or v (module docstring)."""
    q, k, v = problem.q, problem.k, problem.v
    with torch.no_grad():
        rows = private_torch.nonfinite_rows(q)  # (N, H, L)
        bad_keys = private_torch.nonfinite_rows(k) | private_torch.nonfinite_rows(v)  # (N, G, S)
        if private_torch.host_unreadable(q, k, v):
            return rows | _traced_key_rows(problem, bad_keys.repeat_interleave(problem.H // problem.G, dim=1))
        cols = torch.nonzero(bad_keys.any(dim=0).any(dim=0)).flatten()  # (c,) keys bad somewhere
        if cols.numel() > 0:
            per_head = bad_keys[:, :, cols].repeat_interleave(problem.H // problem.G, dim=1)  # (N, H, c)
            sees = _visible_columns(problem, cols)  # (N | 1, H | 1, L, c)
            rows = rows | (sees & per_head[:, :, None, :]).any(dim=-1)
    return rows


# query rows per piece of a rendered mask in `_traced_key_rows`
_RULE_ROWS = 512


def _traced_key_rows(problem: AttentionProblem, bad: torch.Tensor) -> torch.Tensor:
    """(N, H, L) bool: the rows that may see a bad key, ``bad`` (N, H, S) bool, without asking
    the host which keys are bad (torch.compile, export, vmap): every key column is considered.
    Without a mask a row sees them all; a mask of key intervals (causal, windows, prefix-LM,
    varlen, padded, and ``&`` of them: their intervals are tensor operations on Python
    parameters) counts the bad keys of each interval by a prefix sum, O(L + S); documents count
    them per document (`_document_rows`, but for ONNX exports); any other mask is rendered (N | 1, H | 1, L, S), as
    the dense paths render it anyway (the block engine's operator does not: a mask rendered
    here would cost what the engine saves)."""
    mask, L, S = problem.mask, problem.L, problem.S
    N, H = bad.shape[0], bad.shape[1]
    if mask is None:
        return bad.any(dim=-1, keepdim=True).expand(N, H, L)  # (N, H, L)
    if isinstance(mask, Documents) and not private_torch.onnx_exporting():  # ONNX has no searchsorted
        return _document_rows(mask, bad, L, S)
    if isinstance(mask, Mask) and _intervals_traceable(mask):
        intervals = mask.row_intervals(L, S, bad.device)
        assert intervals is not None  # interval masks and their intersections always give them
        lo, hi = intervals  # (N | 1, L) each; lo > hi: no key
        before = torch.nn.functional.pad(bad.long().cumsum(dim=-1), (1, 0))  # (N, H, S + 1): bad keys before j
        first = lo.clamp(0, S)[:, None, :].expand(N, H, L)  # (N, H, L)
        stop = torch.maximum((hi + 1).clamp(0, S)[:, None, :].expand(N, H, L), first)  # (N, H, L)
        # dim 2, not -1: ONNX's reference evaluator mishandles GatherElements with a negative axis
        return before.gather(2, stop) > before.gather(2, first)
    # any other mask: evaluated by chunks of query rows, (N | 1, H | 1, rows, S) at a time, so
    # that the path by query chunks (`qkv.backends.query_chunks`) holds no L x S tensor here either
    keys = torch.arange(S, device=bad.device)
    if private_torch.onnx_exporting():
        # one piece: a loop over L would fix the exported length (the dense path renders L x S anyway)
        return (_visible_columns(problem, keys, 0, L) & bad[:, :, None, :]).any(dim=-1)  # (N, H, L)
    parts = [
        (_visible_columns(problem, keys, first, min(L, first + _RULE_ROWS)) & bad[:, :, None, :]).any(dim=-1)
        for first in range(0, L, _RULE_ROWS)
    ]  # (N, H, rows) each
    return torch.cat(parts, dim=-1)  # (N, H, L)


# masks whose key intervals per query are tensor operations on their Python parameters
_INTERVAL_MASKS = (Causal, SlidingWindow, PrefixLM, Varlen, Padded)


def _intervals_traceable(mask: Mask) -> bool:
    """An interval mask, or an intersection of them (its intervals are their max / min)."""
    if isinstance(mask, Combined):
        return mask.op == "and" and _intervals_traceable(mask.left) and _intervals_traceable(mask.right)
    return isinstance(mask, _INTERVAL_MASKS)


def _document_rows(mask: Documents, bad: torch.Tensor, L: int, S: int) -> torch.Tensor:
    """(N, H, L) bool: the rows whose document holds a bad key, ``bad`` (N, H, S), by tensor
    operations whatever the order of the ids: the keys sorted by id, the bad keys counted along
    that order by a prefix sum, and each query's document found in it by binary search
    (O((L + S) log S), never L x S)."""
    N, H = bad.shape[0], bad.shape[1]
    keys = (mask.ids if mask.kv_ids is None else mask.kv_ids).to(bad.device)  # (B | 1, S)
    queries = (mask.ids[:, S - L :] if mask.kv_ids is None else mask.ids).to(bad.device)  # (B | 1, L)
    keys, queries = keys.expand(N, S).contiguous(), queries.expand(N, L).contiguous()  # (N, S), (N, L)
    sorted_keys, order = keys.sort(dim=-1)  # (N, S) each
    bad_sorted = bad.gather(-1, order[:, None, :].expand(N, H, S))  # (N, H, S): bad flags in id order
    before = torch.nn.functional.pad(bad_sorted.long().cumsum(dim=-1), (1, 0))  # (N, H, S + 1)
    first = torch.searchsorted(sorted_keys, queries)[:, None, :].expand(N, H, L)  # (N, H, L): the document's first key
    stop = torch.searchsorted(sorted_keys, queries, right=True)[:, None, :].expand(N, H, L)  # (N, H, L)
    return before.gather(-1, stop) > before.gather(-1, first)


def finite_problem(problem: AttentionProblem) -> AttentionProblem:
    """The problem with every non-finite entry of q, k, v replaced by 0 (gradient 0 there)."""
    clean = private_torch.finite_entries
    return dataclasses.replace(problem, q=clean(problem.q), k=clean(problem.k), v=clean(problem.v), nonfinite=False)


@overload
def poison(x: torch.Tensor, rows: torch.Tensor, per_row: bool) -> torch.Tensor: ...
@overload
def poison(x: None, rows: torch.Tensor, per_row: bool) -> None: ...
@overload
def poison(x: torch.Tensor | None, rows: torch.Tensor, per_row: bool) -> torch.Tensor | None: ...


def poison(x: torch.Tensor | None, rows: torch.Tensor, per_row: bool) -> torch.Tensor | None:
    """x (N, H, L, ...) with the affected rows (N, H, L) set to NaN; ``per_row``: x is (N, H, L)."""
    if x is None:
        return None
    return x.masked_fill(rows if per_row else rows.unsqueeze(-1), float("nan"))
