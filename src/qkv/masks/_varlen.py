"""Variable-length sequences: `varlen` (packed one after another) and `padded` (a padded batch).

Each document or row has positions of its own: causal masks and windows align bottom-right
to its own query and key lengths, as FlashAttention's varlen kernels do. Both know every
query's key interval, so their layouts and the engine's plans come from those intervals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from qkv._private import torch as private_torch
from qkv.masks._base import Device, Mask, batch_index, check_count
from qkv.masks._interval import _FAR
from qkv.masks._layout import states_from_intervals


def _check_lengths(lengths: object, name: str) -> torch.Tensor:
    if isinstance(lengths, (list, tuple)):
        if any(isinstance(x, bool) or not isinstance(x, int) for x in lengths):
            raise TypeError(f"{name} must hold ints, got {list(lengths)!r}")
        # checked as Python ints (no tensor read, so torch.compile traces a mask built inside it)
        if not lengths:
            raise ValueError(f"{name} must be a non-empty 1-D tensor, got shape (0,)")
        if min(lengths) < 0:
            raise ValueError(f"{name} must be >= 0, got {list(lengths)}")
        if sum(lengths) > _FAR:
            raise ValueError(
                f"{name} add up to {float(sum(lengths)):.4g} positions, more than 2**62: positions are int64, and no "
                "sequence is that long"
            )
        return torch.tensor(list(lengths), dtype=torch.long)
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {type(lengths).__name__}")
    if lengths.dtype == torch.bool or lengths.is_floating_point() or lengths.is_complex():
        raise TypeError(f"{name} must hold integer lengths, got dtype {lengths.dtype}")
    if lengths.ndim != 1 or lengths.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 1-D tensor, got shape {tuple(lengths.shape)}")
    if private_torch.host_unreadable(lengths):
        gate = private_torch.require((lengths >= 0).all(), f"qkv.masks: {name} must be >= 0 (checked inside a traced graph)")
        return lengths.long() * gate.long()  # times 1: the check runs with the graph
    if bool((lengths < 0).any()):
        raise ValueError(f"{name} must be >= 0, got {lengths.tolist()}")
    # in float64: an int64 sum of such lengths could wrap around to a small one
    total = float(lengths.double().sum())
    if total > _FAR:
        raise ValueError(
            f"{name} add up to {total:.4g} positions, more than 2**62: positions are int64, and no "
            "sequence is that long"
        )
    return lengths.long()


def _check_window(window: object) -> tuple[int, int] | None:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a pair (left, right) of ints >= 0, got {window!r}")
    # clamped as `sliding_window` clamps: the same mask, and p +- the size stays inside int64
    # (sys.maxsize wrapped around and hid keys; 10**30 did not fit int64 at all)
    return min(check_count(window[0], "window left"), _FAR), min(check_count(window[1], "window right"), _FAR)


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


@dataclass(frozen=True, eq=False)
class _Lengths(Mask):
    """What `Varlen` and `Padded` share: per-document (per-row) query and key lengths, the
    options applied at each document's own positions, and a layout from the row intervals."""

    q_lengths: torch.Tensor
    k_lengths: torch.Tensor
    causal: bool = False
    window: tuple[int, int] | None = None
    # the lengths as Python ints when they were given so: sizes known without reading a tensor,
    # which torch.compile guards on instead of breaking its graph to read them
    known: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    constructor: ClassVar[str]  # the function that builds the mask, for its name

    def to(self, device: torch.device | str) -> _Lengths:
        return type(self)(self.q_lengths.to(device), self.k_lengths.to(device), self.causal, self.window, self.known)

    def spec_fields(self) -> tuple[object, ...]:
        return (self.constructor, self.q_lengths, self.k_lengths, self.causal, self.window, self.known)

    def block_states(self, L: int, S: int, block_q: int, block_k: int, device: Device = None) -> torch.Tensor:
        intervals = self.row_intervals(L, S, device)
        assert intervals is not None  # a varlen mask always knows its rows' key intervals
        return states_from_intervals(*intervals, S, block_q, block_k)

    def describe(self) -> str:
        if self.known is not None:
            lengths = _known_text(*self.known)
        elif private_torch.host_unreadable(self.q_lengths, self.k_lengths):
            lengths = "lengths"  # their values exist only when the traced graph runs
        else:
            lengths = _lengths_text(self.q_lengths, self.k_lengths)
        return f"{self.constructor}({lengths}{_options_text(self.causal, self.window)})"


@dataclass(frozen=True, eq=False)
class Varlen(_Lengths):
    """Documents packed one after another along L and S (FlashAttention's varlen layout).

    Document d holds q_lengths[d] queries and k_lengths[d] keys; its queries see only its
    keys, at positions of its own: query i of the document sits at p = i + k_len - q_len
    (bottom-right), and ``causal`` / ``window`` apply to those positions.
    """

    constructor: ClassVar[str] = "varlen"

    def _tables(self, L: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per query (1, L) each: its first and last visible key and its position, in packed
        coordinates. Built on first use, after `check_size` has matched the lengths to the
        inputs (L queries): the lengths alone may describe far more tokens than any input holds.
        Where the host cannot read the lengths (torch.compile, export, vmap) the tables are
        built anew each time: a traced graph keeps no Python cache."""
        traced = private_torch.host_unreadable(self.q_lengths, self.k_lengths)
        cached = None if traced else self.__dict__.get("_cache")
        if cached is not None:
            return cached
        q_starts = torch.cumsum(self.q_lengths, 0) - self.q_lengths  # (docs,)
        k_starts = torch.cumsum(self.k_lengths, 0) - self.k_lengths  # (docs,)
        docs = torch.arange(self.q_lengths.numel(), device=self.q_lengths.device)
        if private_torch.onnx_exporting():
            # ONNX's exporter takes no output_size: each row counts the documents that start at or before it
            doc = (torch.arange(L, device=docs.device)[:, None] >= q_starts[None, 1:]).sum(dim=-1)  # (L,)
        else:
            doc = torch.repeat_interleave(docs, self.q_lengths, output_size=L)  # (L,): the output size needs no read
        i = torch.arange(doc.numel(), device=doc.device) - q_starts[doc]  # (L,): row inside the document
        k_len, k0 = self.k_lengths[doc], k_starts[doc]
        p = i + k_len - self.q_lengths[doc]
        lo, hi = _local_interval(p, k_len, self.causal, self.window)
        tables = (lo + k0)[None], (hi + k0)[None], (p + k0)[None]  # (1, L) each
        if not traced:
            object.__setattr__(self, "_cache", tables)
        return tables

    @property
    def total_q(self) -> int:
        return sum(self.known[0]) if self.known is not None else int(self.q_lengths.sum())

    @property
    def total_k(self) -> int:
        return sum(self.known[1]) if self.known is not None else int(self.k_lengths.sum())

    def check_size(self, L: int, S: int) -> None:
        if self.known is None and private_torch.host_unreadable(self.q_lengths, self.k_lengths):
            # tensor lengths cannot be read while tracing (lengths given as Python ints are
            # checked below); the tables are built for exactly L queries (`_tables`), and
            # repeat_interleave refuses lengths that do not add up to L when the graph runs
            return
        if self.total_q != L or self.total_k != S:
            raise ValueError(
                f"varlen() packs {self.total_q} queries and {self.total_k} keys "
                f"({self.q_lengths.numel()} documents), the inputs have L={L} and S={S}"
            )

    def visible(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, L: int, S: int
    ) -> torch.Tensor:
        lo, hi, _ = self._tables(L)
        lo, hi = lo[0].to(q_idx.device), hi[0].to(q_idx.device)
        return (kv_idx >= lo[q_idx]) & (kv_idx <= hi[q_idx])

    def row_intervals(self, L: int, S: int, device: Device = None) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi, _ = self._tables(L)
        return lo.to(device), hi.to(device)

    def query_positions(self, L: int, S: int, device: Device = None) -> torch.Tensor:
        return self._tables(L)[2].to(device)


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


@dataclass(frozen=True, eq=False)
class Padded(_Lengths):
    """A padded batch: row b holds q_lengths[b] real queries and k_lengths[b] real keys first.

    Query i of row b sits at p = i + k_len - q_len (bottom-right to the row's own lengths);
    ``causal`` / ``window`` apply to those positions; padded queries see nothing (zero rows).
    """

    constructor: ClassVar[str] = "padded"

    @property
    def batch(self) -> int | None:
        return self.q_lengths.numel() if self.q_lengths.numel() > 1 else None

    def check_size(self, L: int, S: int) -> None:
        if self.known is not None:
            q_top, k_top = max(self.known[0]), max(self.known[1])
        elif private_torch.host_unreadable(self.q_lengths, self.k_lengths):
            return  # not readable while tracing; a longer row than L or S hides no more than L or S
        else:
            q_top, k_top = int(self.q_lengths.max()), int(self.k_lengths.max())
        if q_top > L or k_top > S:
            raise ValueError(
                f"padded() has rows of up to {q_top} queries and {k_top} "
                f"keys, the inputs have L={L} and S={S}"
            )

    def _rows(
        self, b: torch.Tensor, q_idx: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(p, lo, hi) of queries q_idx in rows b; lo > hi for padded queries."""
        q_lengths, k_lengths = self.q_lengths.to(q_idx.device), self.k_lengths.to(q_idx.device)
        rows = batch_index(b, q_lengths.shape[0])
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


def _lengths_text(q_lengths: torch.Tensor, k_lengths: torch.Tensor) -> str:
    def short(x: torch.Tensor) -> str:
        return str(x.tolist()) if x.numel() <= 8 else f"{x.numel()} lengths, total {int(x.sum())}"

    same = q_lengths.shape == k_lengths.shape and bool((q_lengths == k_lengths).all())
    return short(q_lengths) if same else f"{short(q_lengths)}, {short(k_lengths)}"


def _known_text(q_lengths: tuple[int, ...], k_lengths: tuple[int, ...]) -> str:
    """`_lengths_text` of lengths given as Python ints, without making tensors of them."""
    def short(x: tuple[int, ...]) -> str:
        # f-strings, not str(list): Dynamo formats a length it traces as symbolic, but has no repr for it
        return "[" + ", ".join(f"{n}" for n in x) + "]" if len(x) <= 8 else f"{len(x)} lengths, total {sum(x)}"

    return short(q_lengths) if q_lengths == k_lengths else f"{short(q_lengths)}, {short(k_lengths)}"


def _options_text(causal: bool, window: tuple[int, int] | None) -> str:
    return (", causal=True" if causal else "") + (f", window={window}" if window is not None else "")


def _variable_lengths(
    q_lengths: object, k_lengths: object, causal: object, window: object, name: str
) -> tuple[torch.Tensor, torch.Tensor, bool, tuple[int, int] | None, tuple[tuple[int, ...], tuple[int, ...]] | None]:
    q = _check_lengths(q_lengths, "q_lengths")
    k = q if k_lengths is None else _check_lengths(k_lengths, "k_lengths")
    if k.shape != q.shape:
        raise ValueError(f"{name}: q_lengths has {q.numel()} entries but k_lengths has {k.numel()}")
    if k.device != q.device:
        raise ValueError(f"{name}: q_lengths are on {q.device} but k_lengths on {k.device}")
    if not isinstance(causal, bool):
        raise TypeError(f"{name}: causal must be a bool, got {causal!r}")
    known = None
    if isinstance(q_lengths, (list, tuple)) and (k_lengths is None or isinstance(k_lengths, (list, tuple))):
        known = tuple(q_lengths), tuple(q_lengths if k_lengths is None else k_lengths)
    return q, k, causal, _check_window(window), known
