"""The work list of the CPU block engine: which kernel calls cover a mask's visible scores.

A *piece* is a rectangle of the score matrix: query rows [q0, q1) x keys [k0, k1), computed
without a mask when every pair in it is visible and with the mask's tile otherwise. Two
planners cut the visible part of the matrix into pieces:

- `plan_intervals`, for masks whose queries each see one interval of keys lo..hi
  (`Mask.row_intervals`: causal, sliding windows, prefix-LM, sorted documents, key padding
  and their intersections). Rows are grouped greedily, at most ``block_q`` per group, and a
  new group starts where a row's keys begin after the group's first row's keys end (a new
  document); each group's keys are exactly the union of its rows' intervals.
- `plan_layout`, for any mask, from its `BlockLayout` (query blocks of ``block_q`` rows x
  key blocks of ``block_k``): each query block's runs of consecutive non-empty key blocks.

A piece with partial visibility wider than ``masked_span`` keys is split into the part that
every row sees (no mask) and the masked rest; pieces of the same rows are merged exactly
through their log-sum-exp. With score terms every piece carries a per-head tile, so pieces
whose tile would not fit a share of ``call_bytes`` are cut along their keys as well. Where the rows' last keys follow the diagonal (causal masks, the
causal part of documents and windows), the square under the diagonal is a *causal* piece:
row i of it sees its keys 0..i, which the kernel's own ``is_causal`` computes without a tile
(and without the blocks above the diagonal). Pieces of consecutive row groups with the same shape whose keys
start at evenly spaced positions (a sliding window moves by block_q keys per block, a
prefix stays at 0) become *one* kernel call over strided views: no copy, one Python round
trip for many tiles.

This module only plans; `qkv.backends.blocks.engine` runs the plan. The problem's sizes arrive as one
`BlockSizes` (keyword-only fields), never as loose positional integers.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from qkv.masks import EMPTY, FULL, BlockLayout

__all__ = ["BlockConfig", "BlockPlan", "BlockSizes", "Call", "Piece", "plan_intervals", "plan_layout"]


@dataclass(frozen=True)
class BlockConfig:
    """Tile and call sizes of the CPU block engine (measured with benchmarks/sparse.py)."""

    # Query rows per kernel item (at most). PyTorch's CPU flash kernel works on chunks of 32
    # query rows below 192 rows and of 64 from 192: 192 is the smallest item with the larger
    # chunks, and it keeps the keys wasted at a window's edges small. On 1 and 2 cores it
    # beat 64, 96, 128, 160 and 256 for packed documents by 5-15 % and tied for windows.
    block_q: int = 192
    # Key granularity of `plan_layout`: a run's edges waste at most block_k - 1 keys per side.
    block_k: int = 64
    # A partially visible piece up to this many keys is one masked item (one kernel pass
    # over long rows beats several short passes and a merge); wider ones are split.
    masked_span: int = 1024
    # A new row group starts at a document boundary only once the group has this many rows:
    # a kernel call costs tens of microseconds, as much as a few thousand wasted scores.
    min_rows: int = 16
    # Bound on the temporaries of one kernel call (mask tiles, outputs, gradients of k and v).
    call_bytes: int = 32 * 2**20


@dataclass(frozen=True)
class Piece:
    """Query rows [q0, q1) x keys [k0, k1), computed with the mask's tile when ``masked``."""

    q0: int
    q1: int
    k0: int
    k1: int
    masked: bool
    # a square (k1 - k0 == q1 - q0) whose row i sees exactly its keys k0 .. k0 + i: the
    # kernel's is_causal (top-left), no tile
    causal: bool = False


@dataclass(frozen=True)
class Call:
    """One kernel call: ``items`` pieces of equal shape.

    Item j covers query rows [q0 + j * q_len, + q_len) of batch row ``n`` and keys
    [k0 + j * k_step, + width). With ``over_batch`` the items are instead batch rows
    n, n + 1, ... of the same rows [q0, q0 + q_len) and keys [k0, k0 + width).
    """

    n: int
    q0: int
    items: int
    q_len: int
    k0: int
    k_step: int
    width: int
    masked: bool
    merge: bool  # some item's rows have several pieces: merge by log-sum-exp
    over_batch: bool = False
    causal: bool = False  # causal pieces (`Piece.causal`): the kernel's is_causal, no tile


@dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """The sizes of one problem that the planner needs, named (keyword-only): L and S, or N and
    H, cannot be swapped unnoticed. Ep is the one head size the kernel sees."""

    N: int  # batch rows (the caller's batch dims flattened)
    H: int  # query heads; key/value heads are expanded to H before the kernel runs
    L: int  # query length
    S: int  # key length
    Ep: int  # max(E, Ev): q, k and v are zero-padded to one head size for the kernel
    itemsize: int  # bytes per element of q, k and v
    mask_heads: int = 1  # heads (or head-sized tensors) each masked or scored tile carries
    need_grad: bool = True  # size the calls for a backward pass too (smaller calls)
    # a bias, softcap or score_mod: every piece carries per-head tiles in the accumulation
    # dtype, full pieces too, and causal squares save nothing (their tiles are built anyway)
    score_terms: bool = False

    def __post_init__(self) -> None:
        for name in ("N", "H", "L", "S", "Ep", "itemsize", "mask_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockSizes.{name} must be a positive int, got {value!r}")


@dataclass(eq=False)
class TileStore:
    """Mask tiles kept for reuse (`qkv.backends.blocks.calls.mask_tile`), by tile shape and
    dtype, and the bytes they hold, at most ``limit``."""

    limit: int
    tiles: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    bytes: int = 0


@dataclass(frozen=True)
class BlockPlan:
    """Every kernel call of one problem, and the pieces of each (plan batch row)."""

    config: BlockConfig
    sizes: BlockSizes
    calls: tuple[Call, ...]
    pieces: tuple[tuple[Piece, ...], ...]  # [plan batch row (1 or N)], sorted by rows
    uncovered: tuple[tuple[tuple[int, int], ...], ...]  # [plan batch row]: row ranges with no piece
    # the exact key interval lo..hi of every query, (B | 1, L) each, when the plan comes from them
    intervals: tuple[torch.Tensor, torch.Tensor] | None = None
    # the mask tiles that every run of this plan shares: only on a plan kept for a mask given by
    # its parameters alone (`qkv.backends.blocks.ops.kept_plan`), whose tiles are the same on
    # every call; None: each run keeps its own
    tile_store: TileStore | None = field(default=None, compare=False, repr=False)

    def computed_pairs(self) -> int:
        """(query, key) pairs the calls compute, summed over batch rows (per head); a causal
        square counts its lower triangle, the part the kernel computes."""
        return sum(c.items * (c.q_len * (c.q_len + 1) // 2 if c.causal else c.q_len * c.width) for c in self.calls)

    def max_call_bytes(self) -> int:
        """Largest forward temporaries of one call: its output, lse and mask tile (with score
        terms: the per-head tile of every call, in the accumulation dtype)."""
        z = self.sizes

        def tile(c: Call) -> int:
            if z.score_terms:
                return c.items * c.width * _tile_bytes_per_key(z, c.q_len)
            return c.items * z.mask_heads * c.q_len * c.width * (z.itemsize + 1) if c.masked else 0

        return max((c.items * z.H * c.q_len * (z.Ep * z.itemsize + 4) + tile(c) for c in self.calls), default=0)


def _split(q0: int, q1: int, kmin: int, kmax: int, full_lo: int, full_hi: int, config: BlockConfig) -> list[Piece]:
    """Pieces of rows [q0, q1) whose keys are kmin..kmax, all of them visible to every row
    in full_lo..full_hi (empty when full_lo > full_hi)."""
    if full_lo == kmin and full_hi == kmax:
        return [Piece(q0, q1, kmin, kmax + 1, masked=False)]
    if kmax - kmin + 1 <= config.masked_span:
        return [Piece(q0, q1, kmin, kmax + 1, masked=True)]
    span = config.masked_span
    if full_lo > full_hi:  # no key seen by every row: masked spans only
        return [Piece(q0, q1, a, min(a + span, kmax + 1), True) for a in range(kmin, kmax + 1, span)]
    pieces = [Piece(q0, q1, full_lo, full_hi + 1, masked=False)]
    pieces += [Piece(q0, q1, a, min(a + span, full_lo), True) for a in range(kmin, full_lo, span)]
    pieces += [Piece(q0, q1, a, min(a + span, kmax + 1), True) for a in range(full_hi + 1, kmax + 1, span)]
    return pieces


def _uncovered(pieces: list[Piece], L: int) -> tuple[tuple[int, int], ...]:
    covered = np.zeros(L + 1, dtype=np.int64)
    for p in pieces:
        covered[p.q0] += 1
        covered[p.q1] -= 1
    return tuple(_runs(np.cumsum(covered)[:L] == 0))


def _monotone_pieces(lo: np.ndarray, hi: np.ndarray, config: BlockConfig, causal: bool) -> list[Piece]:
    """`_interval_pieces` for rows that all see some key through intervals whose ends never
    decrease (every interval mask of qkv, sorted documents): each group's end is found by
    binary search instead of row by row. With ``causal``, rows whose last keys follow the
    diagonal get causal squares (`_diagonal_pieces`)."""
    L = len(lo)
    bq = config.block_q
    pieces: list[Piece] = []
    q0 = 0
    # runs of rows that share their first key and whose last key moves by one per row (a
    # causal document): each becomes one causal square, whatever its length, without merges
    run_starts = np.append(np.flatnonzero((np.diff(lo) != 0) | (np.diff(hi) != 1)) + 1, L)
    while q0 < L:
        run_end = int(run_starts[np.searchsorted(run_starts, q0, side="right")])
        run = _diagonal_pieces(q0, run_end, lo, hi, config) if causal and run_end - q0 >= config.min_rows else None
        if run is not None:
            pieces += run
            q0 = run_end
            continue
        # a new document: the first row whose keys begin after the first row's keys end
        new_document = max(int(np.searchsorted(lo, hi[q0], side="right")), q0 + config.min_rows)
        drift = min(int(np.searchsorted(lo, lo[q0] + bq, side="left")), int(np.searchsorted(hi, hi[q0] + bq, side="left")))
        end = max(q0 + 1, min(L, q0 + bq, new_document, drift))
        last = end - 1
        diagonal = _diagonal_pieces(q0, end, lo, hi, config) if causal else None
        if diagonal is None:
            diagonal = _split(q0, end, int(lo[q0]), int(hi[last]), int(lo[last]), int(hi[q0]), config)
        pieces += diagonal
        q0 = end
    return pieces


def _diagonal_pieces(q0: int, q1: int, lo: np.ndarray, hi: np.ndarray, config: BlockConfig) -> list[Piece] | None:
    """Rows [q0, q1) whose last keys follow the diagonal, hi[r] = r + c, and who all see the
    key q0 + c: the causal square [q0 + c, q1 + c) and the pieces of the keys left of it.
    None when the rows do not have that shape."""
    first_key = int(hi[q0])
    if q1 - q0 < 2 or int(lo[q1 - 1]) > first_key or not bool((np.diff(hi[q0:q1]) == 1).all()):
        return None
    square = Piece(q0, q1, first_key, first_key + (q1 - q0), masked=False, causal=True)
    if int(lo[q0]) >= first_key:
        return [square]  # a document's or sequence's first rows: nothing left of the square
    left_last = first_key - 1
    return [*_split(q0, q1, int(lo[q0]), left_last, int(lo[q1 - 1]), left_last, config), square]


def _interval_pieces(lo: list[int], hi: list[int], config: BlockConfig) -> list[Piece]:
    """Greedy row groups over one batch row's intervals (module docstring)."""
    L = len(lo)
    pieces: list[Piece] = []
    r = 0
    while r < L:
        if lo[r] > hi[r]:  # a row with no visible key belongs to no piece
            r += 1
            continue
        q0 = r
        kmin, kmax, full_lo, full_hi = lo[r], hi[r], lo[r], hi[r]
        r += 1
        while r < L and r - q0 < config.block_q and lo[r] <= hi[r]:
            new_document = lo[r] > hi[q0] and r - q0 >= config.min_rows
            drift = abs(lo[r] - lo[q0]) >= config.block_q or abs(hi[r] - hi[q0]) >= config.block_q
            if new_document or drift:
                break
            kmin, kmax = min(kmin, lo[r]), max(kmax, hi[r])
            full_lo, full_hi = max(full_lo, lo[r]), min(full_hi, hi[r])
            r += 1
        pieces += _split(q0, r, kmin, kmax, full_lo, full_hi, config)
    return pieces


# Plans of the last few interval masks, keyed by the intervals' exact bytes (no hash of them
# alone: a collision would be a wrong plan): a model calls the engine with the same mask in
# every layer and step, and planning n = 16,384 rows takes ~4.6 ms of Python (one thread),
# as much as a sixth of the fused bf16 kernel's sliding_window(256, 256) forward at 2 threads.
# Intervals over more than _PLAN_CACHE_BYTES are planned anew each time.
_PLAN_CACHE: OrderedDict[tuple[object, ...], BlockPlan] = OrderedDict()
_PLAN_CACHE_ENTRIES = 8
_PLAN_CACHE_BYTES = 1 << 20
_PLAN_CACHE_LOCK = threading.Lock()  # encoder batches plan from several threads


def plan_intervals(lo: torch.Tensor, hi: torch.Tensor, sizes: BlockSizes, config: BlockConfig) -> BlockPlan:
    """Plan from the per-query key intervals lo, hi (N | 1, L) of `Mask.row_intervals`.

    Without ``sizes.need_grad`` the calls are sized for the forward pass alone (fewer, larger).
    The plans of the last few (intervals, sizes, config) are kept and returned again (plans
    are immutable)."""
    if lo.shape != hi.shape or lo.dim() != 2 or lo.shape[1] != sizes.L or lo.shape[0] not in (1, sizes.N):
        raise ValueError(f"key intervals of shape {tuple(lo.shape)} / {tuple(hi.shape)} do not fit (N | 1, L) for {sizes}")
    lo, hi = lo.clamp(min=0).cpu(), hi.clamp(max=sizes.S - 1).cpu()
    a, b = lo.to(torch.long).numpy(), hi.to(torch.long).numpy()
    if a.nbytes + b.nbytes > _PLAN_CACHE_BYTES:
        return _plan_intervals(lo, hi, sizes, config)
    key = (sizes, config, a.shape, a.tobytes(), b.tobytes())
    with _PLAN_CACHE_LOCK:
        plan = _PLAN_CACHE.get(key)
        if plan is not None:
            _PLAN_CACHE.move_to_end(key)
            return plan
    plan = _plan_intervals(lo, hi, sizes, config)
    with _PLAN_CACHE_LOCK:
        _PLAN_CACHE[key] = plan
        while len(_PLAN_CACHE) > _PLAN_CACHE_ENTRIES:
            _PLAN_CACHE.popitem(last=False)
    return plan


def _plan_intervals(lo: torch.Tensor, hi: torch.Tensor, sizes: BlockSizes, config: BlockConfig) -> BlockPlan:
    """`plan_intervals` without the cache, from clamped CPU intervals."""
    rows = []
    for a, b in zip(lo.numpy(), hi.numpy(), strict=True):
        nonempty = a <= b
        monotone = bool((np.diff(a[nonempty]) >= 0).all() and (np.diff(b[nonempty]) >= 0).all())
        if monotone:
            # causal squares save the tile of a mask; tiles of score terms are built anyway
            causal = not sizes.score_terms
            pieces = []
            for first, stop in _runs(nonempty):  # rows with no visible key belong to no piece
                pieces += [dataclasses.replace(p, q0=p.q0 + first, q1=p.q1 + first)
                           for p in _monotone_pieces(a[first:stop], b[first:stop], config, causal)]
            rows.append(pieces)
        else:
            rows.append(_interval_pieces(a.tolist(), b.tolist(), config))
    plan = _plan(rows, sizes, config)
    return dataclasses.replace(plan, intervals=(lo, hi))


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """The [first, stop) ranges of consecutive True entries."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], flags.astype(np.int8), [0]))))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _layout_pieces(nonempty: np.ndarray, full: np.ndarray, L: int, S: int, config: BlockConfig) -> list[Piece]:
    """Pieces of every query block from the states of its key blocks (nQ, nK)."""
    bq, bk = config.block_q, config.block_k
    pieces: list[Piece] = []
    for i in range(nonempty.shape[0]):
        q0, q1 = i * bq, min(L, (i + 1) * bq)
        idx = np.flatnonzero(nonempty[i])
        if idx.size == 0:
            continue
        breaks = np.flatnonzero(np.diff(idx) > 1)
        starts = np.concatenate(([idx[0]], idx[breaks + 1]))
        stops = np.concatenate((idx[breaks] + 1, [idx[-1] + 1]))
        for a, b in zip(starts.tolist(), stops.tolist(), strict=True):
            run = full[i, a:b]
            # the keys every row sees: the longest stretch of full blocks, if any
            best, best_len, j = (0, -1), 0, 0
            while j < len(run):
                if run[j]:
                    k = j
                    while k < len(run) and run[k]:
                        k += 1
                    if k - j > best_len:
                        best, best_len = (j, k - 1), k - j
                    j = k
                else:
                    j += 1
            kmin, kmax = a * bk, min(b * bk, S) - 1
            if best_len:
                full_lo, full_hi = (a + best[0]) * bk, min((a + best[1] + 1) * bk, S) - 1
            else:
                full_lo, full_hi = kmax + 1, kmax  # nothing seen by every row
            pieces += _split(q0, q1, kmin, kmax, full_lo, full_hi, config)
    return pieces


def plan_layout(layout: BlockLayout, sizes: BlockSizes, config: BlockConfig) -> BlockPlan:
    """Plan the non-empty tiles of ``layout`` for ``sizes.N`` batch rows (any mask)."""
    if layout.block_q != config.block_q or layout.block_k != config.block_k:
        raise ValueError(
            f"layout tiles {layout.block_q}x{layout.block_k} differ from the engine's {config.block_q}x{config.block_k}"
        )
    if (layout.L, layout.S) != (sizes.L, sizes.S) or layout.states.shape[0] not in (1, sizes.N):
        raise ValueError(f"a layout of {layout.L}x{layout.S} scores, batch {layout.states.shape[0]}, does not fit {sizes}")
    states = layout.states.cpu().numpy()  # (B | 1, H | 1, nQ, nK)
    nonempty = (states != EMPTY).any(axis=1)  # (B | 1, nQ, nK): union over the heads
    full = (states == FULL).all(axis=1)  # (B | 1, nQ, nK)
    rows = [_layout_pieces(nonempty[b], full[b], layout.L, layout.S, config) for b in range(nonempty.shape[0])]
    return _plan(rows, sizes, config)


# With score terms a per-head tile (bias, or the own kernel's scores) may take at most this
# share of call_bytes: the own kernel's backward holds several tiles of that size at once
# (scores, probabilities, dP, dS), and a call may carry more than one item.
_TILE_SHARE = 4


def _tile_bytes_per_key(sizes: BlockSizes, rows: int) -> int:
    """Bytes per key of one item's tile with score terms: mask_heads x rows values in the
    accumulation dtype (float32 or wider, whatever the inputs' dtype) and a bool mask byte."""
    return sizes.mask_heads * rows * (max(sizes.itemsize, 4) + 1)


def _narrow(pieces: list[Piece], sizes: BlockSizes, config: BlockConfig) -> list[Piece]:
    """With score terms every piece carries a per-head tile, also a full one: pieces whose tile
    would exceed call_bytes / _TILE_SHARE are cut along their keys into equal parts that fit,
    merged by log-sum-exp as any pieces of the same rows are."""
    if not sizes.score_terms:
        return pieces
    out: list[Piece] = []
    for p in pieces:
        width = p.k1 - p.k0
        limit = max(config.block_k, config.call_bytes // _TILE_SHARE // _tile_bytes_per_key(sizes, p.q1 - p.q0))
        if p.causal or width <= limit:
            out.append(p)
            continue
        parts = -(-width // limit)
        step = -(-width // parts)
        out += [dataclasses.replace(p, k0=a, k1=min(a + step, p.k1)) for a in range(p.k0, p.k1, step)]
    return out


def _plan(rows: list[list[Piece]], sizes: BlockSizes, config: BlockConfig) -> BlockPlan:
    rows = [_narrow(pieces, sizes, config) for pieces in rows]
    per_batch = len(rows) > 1
    calls: list[Call] = []
    for b, pieces in enumerate(rows):
        calls += _group(pieces, b if per_batch else None, sizes, config)
    return BlockPlan(
        config, sizes, tuple(calls), tuple(tuple(sorted(p, key=lambda x: (x.q0, x.k0))) for p in rows),
        tuple(_uncovered(p, sizes.L) for p in rows),
    )


@dataclass(frozen=True)
class _Shape:
    """What the pieces of one call share."""

    q_len: int
    width: int
    masked: bool
    causal: bool


def _item_bytes(sizes: BlockSizes, shape: _Shape) -> int:
    """Temporaries of one item: output and lse, its mask tile, and for the backward pass the
    gradients of its queries, keys and values."""
    H, Ep, itemsize = sizes.H, sizes.Ep, sizes.itemsize
    out = H * shape.q_len * (Ep * itemsize + 4)
    # a masked tile carries its mask (per head when the mask varies over heads); with score
    # terms every tile carries per-head biases or scores, masked or not
    if sizes.score_terms:
        mask = shape.width * _tile_bytes_per_key(sizes, shape.q_len)  # in the accumulation dtype
    else:
        mask = sizes.mask_heads * shape.q_len * shape.width * (itemsize + 1) if shape.masked else 0
    grads = (2 * H * shape.width * Ep * itemsize + H * shape.q_len * Ep * itemsize) if sizes.need_grad else 0
    return out + mask + grads


def _group(pieces: list[Piece], n: int | None, sizes: BlockSizes, config: BlockConfig) -> list[Call]:
    """Batch pieces of adjacent row groups with evenly spaced keys into calls.

    ``n`` is the batch row when the plan has one per row; None when it holds for all rows.
    """
    per_rows: dict[tuple[int, int], int] = {}
    for p in pieces:
        per_rows[(p.q0, p.q1)] = per_rows.get((p.q0, p.q1), 0) + 1
    merged = {rows for rows, count in per_rows.items() if count > 1}
    groups: dict[_Shape, list[Piece]] = {}
    for p in pieces:
        groups.setdefault(_Shape(p.q1 - p.q0, p.k1 - p.k0, p.masked, p.causal), []).append(p)
    calls: list[Call] = []
    for shape, members in groups.items():
        members.sort(key=lambda p: (p.q0, p.k0))
        budget = max(1, config.call_bytes // _item_bytes(sizes, shape))
        run: list[Piece] = []
        step = 0
        for p in members:
            if run:
                gap = p.k0 - run[-1].k0
                evenly = gap >= 0 and (len(run) == 1 or gap == step)
                if p.q0 == run[-1].q1 and len(run) < budget and evenly:
                    step = gap
                    run.append(p)
                    continue
                calls += _calls_of_run(run, step, shape, n, sizes.N, budget, merged)
            run, step = [p], 0
        calls += _calls_of_run(run, step, shape, n, sizes.N, budget, merged)
    return calls


def _calls_of_run(
    run: list[Piece], step: int, shape: _Shape, n: int | None, N: int, budget: int, merged: set[tuple[int, int]]
) -> list[Call]:
    """The calls of one run of evenly spaced pieces, for batch row n or (n None) for every row."""
    merge = any((p.q0, p.q1) in merged for p in run)
    first = run[0]
    if n is None and N > 1 and len(run) == 1:
        # one row group: its batch rows become the items of the call
        return [
            Call(row, first.q0, min(budget, N - row), shape.q_len, first.k0, 0, shape.width, shape.masked, merge,
                 over_batch=True, causal=shape.causal)
            for row in range(0, N, budget)
        ]
    return [
        Call(row, first.q0, len(run), shape.q_len, first.k0, step, shape.width, shape.masked, merge, causal=shape.causal)
        for row in ([n] if n is not None else range(N))
    ]
