"""Additive score terms that combine with any mask: ALiBi, T5's relative bias, a dense tensor.

A bias adds ``bias[b, h, i, j]`` to the (scaled, possibly soft-capped) score of query i and
key j before the mask removes pairs and the row is softmaxed (docs/design.md's score order). Like a
mask, a bias is a description, not an L x S tensor: it answers

- ``terms(b, h, q_idx, kv_idx, q_pos)``: the bias on broadcasting index tensors (float), where
  ``q_pos`` is the absolute position of each query in key coordinates;
- ``to_dense(L, S)``: the tensor (B | 1, H | 1, L, S) for the explicit paths and tests.

Positions are bottom-right aligned as everywhere in qkv: query i of L against S keys sits at
p_i = i + S - L, so a decoding step continues the positions of its cache. Inside a packed
document of `qkv.masks.varlen` (or a row of `qkv.masks.padded`) the positions are the
document's own; the kernels take ``q_pos`` from the mask.

Biases add with ``+``; a float tensor passed as ``bias=`` means ``dense(tensor)``. The tensors
a bias holds (ALiBi slopes, the relative table, the dense tensor) may require grad: every path
differentiates through them.

References: Press et al., "Train Short, Test Long: Attention with Linear Biases" (ALiBi,
2022), section 3 for the slopes; Raffel et al., "Exploring the Limits of Transfer Learning
with a Unified Text-to-Text Transformer" (T5, 2020), section 2.1 for the bucketed relative
position bias; Dao, FlashAttention's ``alibi_slopes`` (bias -slope * |i + S - L - j|).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from qkv._checks import broadcasts, positive_int
from qkv._private import torch as private_torch

__all__ = [
    "ALiBi",
    "Bias",
    "Dense",
    "Relative",
    "Sum",
    "alibi",
    "alibi_slopes",
    "as_bias",
    "dense",
    "relative",
    "relative_bucket",
]


class Bias(ABC):
    """Base class of additive score terms. Combine with ``+``."""

    # terms depend on kv_idx - q_pos (and the head) only: a tile's bias moves with the diagonal
    shift_invariant: ClassVar[bool] = False

    @property
    def batch(self) -> int | None:
        """Batch size the bias varies over, or None when it is the same for every batch row."""
        return None

    @property
    def heads(self) -> int | None:
        """Number of heads the bias varies over, or None when it is the same for every head."""
        return None

    @abstractmethod
    def terms(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, q_pos: torch.Tensor
    ) -> torch.Tensor:
        """The bias of each (b, h, q_idx, kv_idx): a float tensor, broadcast of the index tensors.

        b is the (flattened) batch row, h the query head, q_idx and kv_idx the row and column
        of the score matrix, q_pos the query's absolute position in key coordinates.
        """

    @abstractmethod
    def describe(self) -> str:
        """A short name such as ``alibi(8 heads)``."""

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the bias reads (slopes, table, dense values): gradients reach them."""
        return ()

    def with_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Bias:
        """The same bias reading ``tensors`` (as many as `tensors()` returns, same shapes) instead
        of its own: kernels swap in detached copies to differentiate one tile at a time."""
        del tensors
        return self

    def spec_fields(self) -> tuple[object, ...] | None:
        """The bias's spec name and constructor arguments, for `qkv._private.spec` (the block
        engine's operators rebuild it from them); None when it cannot be rebuilt from text."""
        return None

    def bind(self, batch_shape: tuple[int, ...], H: int, L: int, S: int) -> Bias:
        """The bias ready for a (*batch_shape, H, L, S) problem: validated (ValueError naming
        the mismatch), defaults resolved (ALiBi's slopes for H heads), tensors brought to one
        flattened batch axis."""
        del batch_shape, L, S
        if self.heads is not None and self.heads != H:  # not `in (None, H)`: H may be symbolic (qkv._checks.size_broadcasts)
            raise ValueError(f"{self.describe()} covers {self.heads} heads, the queries have H={H}")
        return self

    def flops_per_pair(self) -> int:
        """Floating-point operations per (query, key) pair and head, the final add included."""
        return 1

    def largest(self, L: int, S: int) -> float | torch.Tensor:
        """An upper bound (>= 0) of the values the bias adds to a score of an L x S problem:
        the input checks add it to the scores' bound against overflow to +inf. ValueError when
        a tensor holds NaN or +inf (-inf hides a pair, as in a float mask). Where the host cannot
        read the tensors (torch.compile, export, vmap): a 0-d float64 tensor, and the check
        raises when the graph runs."""
        del L, S
        return 0.0

    def to_dense(self, L: int, S: int, *, H: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The bias as a tensor (B | 1, H | 1, L, S) with bottom-right positions p_i = i + S - L.

        ``H`` is needed only by ALiBi without explicit slopes (its default slopes depend on it).
        """
        heads = H if H is not None else (self.heads or 1)
        bound = self.bind((self.batch or 1,), heads, L, S)
        shape = (bound.batch or 1, bound.heads or (heads if H is not None else 1), L, S)
        b = torch.arange(shape[0]).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
        h = torch.arange(shape[1]).view(1, -1, 1, 1)  # (1, H, 1, 1)
        q = torch.arange(L).view(1, 1, L, 1)  # (1, 1, L, 1)
        k = torch.arange(S).view(1, 1, 1, S)  # (1, 1, 1, S)
        return torch.broadcast_to(bound.terms(b, h, q, k, q + (S - L)).to(dtype), shape)

    def __add__(self, other: object) -> Bias:
        right = as_bias(other)
        if right is None:
            return NotImplemented
        return Sum((*_parts(self), *_parts(right)))

    def __radd__(self, other: object) -> Bias:
        left = as_bias(other)
        if left is None:
            return NotImplemented
        return Sum((*_parts(left), *_parts(self)))

    def __str__(self) -> str:
        return self.describe()


def _parts(bias: Bias) -> tuple[Bias, ...]:
    return bias.parts if isinstance(bias, Sum) else (bias,)


def _largest_value(t: torch.Tensor, what: str, hide: bool = True) -> float | torch.Tensor:
    """max(0, largest finite value of t); ValueError naming ``what`` when t holds NaN or +inf
    (or -inf, unless ``hide``: there -inf hides a pair, as in a float mask). Where the host
    cannot read t (torch.compile, export, vmap) the same, as a 0-d float64 tensor and a check
    that raises ValueError when the graph runs."""
    with torch.no_grad():
        values = t.detach()
        bad = torch.isnan(values) | torch.isposinf(values)
        if not hide:
            bad |= torch.isneginf(values)
        if private_torch.host_unreadable(values):
            allowed = "finite values, or -inf to hide a pair" if hide else "finite values"
            gate = private_torch.require(~bad.any(), f"qkv: {what} holds NaN or +inf{'' if hide else ' or -inf'}; it must hold {allowed}")
            if values.numel() == 0:
                return gate.to(torch.float64) * 0.0
            # times the gate (1): the bound feeds the overflow check, which gates q, so the check runs
            # every dim named: ONNX's exporter has no amax over all dims without them
            top = values.amax(dim=tuple(range(values.dim())))
            return top.to(torch.float64).clamp(min=0.0) * gate.to(torch.float64)
        if bool(bad.any()):
            first = torch.nonzero(bad)[:3].tolist()
            got = "NaN" if bool(torch.isnan(values).any()) else "+inf" if bool(torch.isposinf(values).any()) else "-inf"
            allowed = "finite values, or -inf to hide a pair" if hide else "finite values"
            raise ValueError(f"{what} holds {got} (first at indices {first}); it must hold {allowed}")
        if values.numel() == 0:
            return 0.0
        return max(0.0, float(values.max()))


def as_bias(value: object) -> Bias | None:
    """A `Bias`, None, or a float tensor (meaning ``dense(tensor)``) as a Bias (or None)."""
    if value is None or isinstance(value, Bias):
        return value
    if isinstance(value, torch.Tensor):
        return dense(value)
    return None


def _take(values: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    """values[i0, i1, ...] for index tensors that broadcast together, one per axis of values.

    Advanced indexing would do, but its gradient adds repeated indices with
    index_put_(accumulate=True), whose CPU kernel adds them in an order that depends on the
    threads' timing (a T5 table's gradient took 6 different values in 8 identical calls at 2
    threads); index_select's gradient is index_add_, which adds them in index order: two runs
    give the same bits.
    """
    index = torch.broadcast_tensors(*index)
    flat = index[0]
    for i, size in zip(index[1:], values.shape[1:], strict=True):
        flat = flat * size + i
    return values.reshape(-1).index_select(0, flat.reshape(-1)).reshape(flat.shape)


def _head_values(values: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """values[h] for a per-head tensor (H,) and an index tensor h (any shape)."""
    return _take(values, h)


# ALiBi ------------------------------------------------------------------------------------------


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's head slopes (num_heads,) float64.

    For H a power of two: the geometric sequence 2^(-8/H), 2^(-16/H), ..., 2^(-8). Otherwise
    (section 3 of the paper): the slopes of the largest power of two n < H, followed by every
    other slope of 2n heads, the first H - n of them.

    >>> alibi_slopes(4).tolist()
    [0.25, 0.0625, 0.015625, 0.00390625]
    """
    positive_int(num_heads, "alibi_slopes: num_heads")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    n = 1 << (num_heads.bit_length() - 1)  # largest power of two <= H
    slopes = geometric(n)
    if n < num_heads:
        slopes += geometric(2 * n)[0::2][: num_heads - n]
    return torch.tensor(slopes, dtype=torch.float64)


@dataclass(frozen=True, eq=False)
class ALiBi(Bias):
    """ALiBi: head h adds ``-slopes[h] * |p_i - j|`` (FlashAttention's symmetric convention).

    With a causal mask only keys j <= p_i remain, and this is the paper's -slope * (p_i - j).
    ``slopes`` (H,) may require grad; None means the paper's slopes for the problem's H.
    """

    slopes: torch.Tensor | None = None
    shift_invariant: ClassVar[bool] = True

    @property
    def heads(self) -> int | None:
        return None if self.slopes is None else self.slopes.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return () if self.slopes is None else (self.slopes,)

    def with_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Bias:
        return ALiBi(tensors[0]) if tensors else self

    def spec_fields(self) -> tuple[object, ...]:
        return ("alibi", self.slopes)

    def bind(self, batch_shape: tuple[int, ...], H: int, L: int, S: int) -> Bias:
        super().bind(batch_shape, H, L, S)
        if self.slopes is not None:
            return self
        # the TorchScript ONNX exporter traces sizes as tensors: the slopes are constants of the head count
        return ALiBi(alibi_slopes(int(H) if isinstance(H, torch.Tensor) else H))

    def terms(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, q_pos: torch.Tensor
    ) -> torch.Tensor:
        if self.slopes is None:
            raise ValueError("alibi() without slopes must be bound to a number of heads first (Bias.bind)")
        slopes = self.slopes.to(q_pos.device)
        return -_head_values(slopes, h) * (q_pos - kv_idx).abs().to(slopes.dtype)

    def flops_per_pair(self) -> int:
        return 4  # subtract, absolute value, multiply, add

    def largest(self, L: int, S: int) -> float | torch.Tensor:
        if self.slopes is None:
            return 0.0  # the paper's slopes are positive: the bias is <= 0
        # -slope * distance: a negative slope adds up to |slope| * the longest distance
        checked = _largest_value(self.slopes, "the alibi slopes tensor", hide=False)
        if private_torch.host_unreadable(self.slopes):
            if self.slopes.numel() == 0:
                return checked
            slopes = self.slopes.detach()
            steepest = (-slopes.amin(dim=tuple(range(slopes.dim())))).to(torch.float64).clamp(min=0.0)  # every dim named, for ONNX
            return steepest * max(L, S) + 0.0 * checked  # + 0 * the gated check: compilers keep the check
        with torch.no_grad():
            steepest_host = max(0.0, -float(self.slopes.detach().min())) if self.slopes.numel() else 0.0
        return steepest_host * max(L, S)

    def describe(self) -> str:
        return "alibi()" if self.slopes is None else f"alibi({self.slopes.shape[0]} heads)"


def alibi(slopes: torch.Tensor | None = None) -> ALiBi:
    """ALiBi (BLOOM, MPT): a linear penalty ``-slope_h * |p_i - j|`` on the distance to each key.

    Args:
        slopes: (H,) float tensor, one slope per query head (it may require grad); default
            the paper's slopes for the problem's number of heads (`alibi_slopes`), also when H
            is not a power of two.

    With slope 0.5, query 2 of 3 sees keys 0, 1, 2 at distances 2, 1, 0:

    >>> print(alibi(torch.tensor([0.5])).to_dense(3, 3)[0, 0])
    tensor([[-0.0000, -0.5000, -1.0000],
            [-0.5000, -0.0000, -0.5000],
            [-1.0000, -0.5000, -0.0000]])
    """
    if slopes is not None:
        if not isinstance(slopes, torch.Tensor) or not slopes.is_floating_point():
            got = slopes.dtype if isinstance(slopes, torch.Tensor) else type(slopes).__name__
            raise TypeError(f"alibi(slopes) takes a float tensor (H,), got {got}")
        if slopes.ndim != 1 or slopes.numel() == 0:
            raise ValueError(f"alibi(slopes) takes a non-empty (H,) tensor, got shape {tuple(slopes.shape)}")
    return ALiBi(slopes)


# T5 relative position bias ----------------------------------------------------------------------


def relative_bucket(
    relative_position: torch.Tensor, *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> torch.Tensor:
    """T5's bucket of each relative position ``j - p_i`` (key minus query), int64 in [0, num_buckets).

    Half of the buckets (of each direction when bidirectional) hold the exact distances
    0 .. n/2 - 1; the other half cover distances up to ``max_distance`` on a log scale, and
    every larger distance shares the last bucket. Bidirectional: keys after the query
    (j > p_i) use the upper half of the buckets. Unidirectional: keys after the query all fall
    in bucket 0 (the distance is clamped at 0), as in T5's decoder.

    >>> relative_bucket(torch.tensor([-200, -20, -3, 0, 3, 20, 200])).tolist()
    [15, 10, 3, 0, 19, 26, 31]
    """
    buckets = torch.zeros_like(relative_position, dtype=torch.long)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    exact = num_buckets // 2
    # the log-spaced buckets, computed in float32 as T5 does, so that bucket edges agree
    ratio = distance.clamp(min=1).float() / exact
    spread = torch.log(ratio) / math.log(max_distance / exact) * (num_buckets - exact)
    far = (exact + spread.long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance.long(), far)


@dataclass(frozen=True, eq=False)
class Relative(Bias):
    """T5's relative position bias: head h adds ``table[h, bucket(j - p_i)]``."""

    table: torch.Tensor
    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = True
    shift_invariant: ClassVar[bool] = True

    @property
    def heads(self) -> int | None:
        return self.table.shape[0]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.table,)

    def with_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Bias:
        return Relative(tensors[0], self.num_buckets, self.max_distance, self.bidirectional)

    def spec_fields(self) -> tuple[object, ...]:
        return ("relative", self.table, self.num_buckets, self.max_distance, self.bidirectional)

    def terms(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, q_pos: torch.Tensor
    ) -> torch.Tensor:
        bucket = relative_bucket(
            kv_idx - q_pos, bidirectional=self.bidirectional, num_buckets=self.num_buckets, max_distance=self.max_distance
        )
        return _take(self.table.to(q_pos.device), h, bucket)

    def largest(self, L: int, S: int) -> float | torch.Tensor:
        return _largest_value(self.table, "the relative bias table")

    def flops_per_pair(self) -> int:
        return 8  # the bucket (difference, comparisons, a log) and the add; the lookup is a gather

    def describe(self) -> str:
        kind = "bidirectional" if self.bidirectional else "unidirectional"
        return (
            f"relative({self.table.shape[0]} heads, {self.num_buckets} buckets, "
            f"max_distance={self.max_distance}, {kind})"
        )


def relative(
    table: torch.Tensor, *, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True
) -> Relative:
    """T5's bucketed relative position bias ``table[h, relative_bucket(j - p_i)]``.

    Args:
        table: (H, num_buckets) float tensor, usually a learnable parameter. (transformers'
            T5 keeps it as an embedding (num_buckets, H): pass ``embedding.weight.T``.)
        num_buckets, max_distance, bidirectional: T5's bucketing (`relative_bucket`);
            encoders are bidirectional, decoders not.

    A 2-bucket unidirectional table: bucket 0 for the query itself and later keys, bucket 1
    for every earlier key:

    >>> table = torch.tensor([[0.0, -1.0]])
    >>> print(relative(table, num_buckets=2, bidirectional=False).to_dense(3, 3)[0, 0])
    tensor([[ 0.,  0.,  0.],
            [-1.,  0.,  0.],
            [-1., -1.,  0.]])
    """
    if not isinstance(table, torch.Tensor) or not table.is_floating_point():
        got = table.dtype if isinstance(table, torch.Tensor) else type(table).__name__
        raise TypeError(f"relative(table) takes a float tensor (H, num_buckets), got {got}")
    for name, value, low in (("num_buckets", num_buckets, 2 if not bidirectional else 4), ("max_distance", max_distance, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"relative: {name} must be an int >= {low}, got {value!r}")
    if not isinstance(bidirectional, bool):
        raise TypeError(f"relative: bidirectional must be a bool, got {bidirectional!r}")
    if table.ndim != 2 or table.shape[1] != num_buckets or table.shape[0] == 0:
        raise ValueError(
            f"relative(table) takes a (H, num_buckets={num_buckets}) tensor, got shape {tuple(table.shape)}"
        )
    exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if max_distance <= exact:
        raise ValueError(f"relative: max_distance={max_distance} must exceed the {exact} exact buckets")
    return Relative(table, num_buckets, max_distance, bidirectional)


# Dense ------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Dense(Bias):
    """An explicit float tensor broadcastable to (*batch, H, L, S)."""

    tensor: torch.Tensor

    def _4d(self) -> torch.Tensor:
        t = self.tensor
        return t.reshape((1,) * (4 - t.ndim) + tuple(t.shape)) if t.ndim < 4 else t  # (B | 1, H | 1, L | 1, S | 1)

    @property
    def batch(self) -> int | None:
        size = self._4d().shape[0]
        return size if size > 1 else None

    @property
    def heads(self) -> int | None:
        size = self.tensor.shape[-3] if self.tensor.ndim >= 3 else 1
        return size if size > 1 else None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.tensor,)

    def with_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Bias:
        return Dense(tensors[0])

    def spec_fields(self) -> tuple[object, ...]:
        return ("dense_bias", self.tensor)

    def bind(self, batch_shape: tuple[int, ...], H: int, L: int, S: int) -> Bias:
        t = self.tensor
        target = (*batch_shape, H, L, S)
        if not broadcasts(t.shape, target):
            raise ValueError(f"bias of shape {tuple(t.shape)} does not broadcast to (*batch, H, L, S) = {target}")
        full = t.reshape((1,) * (len(target) - t.ndim) + tuple(t.shape))  # (*batch | 1, H | 1, L | 1, S | 1)
        lead = full.shape[: len(batch_shape)]
        tail = full.shape[len(batch_shape) :]
        if all(n == 1 for n in lead):
            # contiguous: the kernels read it flat (`_take`), and tile by tile
            return Dense(full.reshape(1, *tail).contiguous())  # (1, H | 1, L | 1, S | 1)
        expanded = full.expand(*batch_shape, *tail)
        return Dense(expanded.reshape(-1, *tail))  # (N, H | 1, L | 1, S | 1)

    def terms(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, q_pos: torch.Tensor
    ) -> torch.Tensor:
        t = self._4d().to(q_idx.device)
        index = [i if size > 1 else torch.zeros_like(i) for i, size in zip((b, h, q_idx, kv_idx), t.shape, strict=True)]
        return _take(t, *index)

    def largest(self, L: int, S: int) -> float | torch.Tensor:
        return _largest_value(self.tensor, "the bias tensor")

    def describe(self) -> str:
        return f"dense bias {tuple(self.tensor.shape)}"


def dense(tensor: torch.Tensor) -> Dense:
    """A float tensor broadcastable to (B, H, L, S), added to the scores as it is.

    >>> print(dense(torch.tensor([[0.0, -2.0]])).to_dense(2, 2)[0, 0])
    tensor([[ 0., -2.],
            [ 0., -2.]])
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"bias.dense() takes a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"a bias must be a floating-point tensor (added to the scores), got dtype {tensor.dtype}")
    if tensor.ndim == 0:
        raise ValueError("a bias tensor needs at least one dimension (broadcastable to (B, H, L, S))")
    return Dense(tensor)


# Sums -------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Sum(Bias):
    """Several biases added together."""

    parts: tuple[Bias, ...]

    @property
    def shift_invariant(self) -> bool:  # type: ignore[override]
        return all(p.shift_invariant for p in self.parts)

    @property
    def batch(self) -> int | None:
        sizes = {p.batch for p in self.parts if p.batch is not None}
        return max(sizes) if sizes else None

    @property
    def heads(self) -> int | None:
        sizes = {p.heads for p in self.parts if p.heads is not None}
        if len(sizes) > 1:
            raise ValueError(f"cannot add biases over different numbers of heads: {sorted(sizes)}")
        return sizes.pop() if sizes else None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for p in self.parts for t in p.tensors())

    def with_tensors(self, tensors: tuple[torch.Tensor, ...]) -> Bias:
        parts, start = [], 0
        for p in self.parts:
            count = len(p.tensors())
            parts.append(p.with_tensors(tensors[start : start + count]))
            start += count
        return Sum(tuple(parts))

    def spec_fields(self) -> tuple[object, ...]:
        return ("sum", self.parts)

    def bind(self, batch_shape: tuple[int, ...], H: int, L: int, S: int) -> Bias:
        return Sum(tuple(p.bind(batch_shape, H, L, S) for p in self.parts))

    def terms(
        self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor, q_pos: torch.Tensor
    ) -> torch.Tensor:
        total = self.parts[0].terms(b, h, q_idx, kv_idx, q_pos)
        for p in self.parts[1:]:
            total = total + p.terms(b, h, q_idx, kv_idx, q_pos)
        return total

    def flops_per_pair(self) -> int:
        return sum(p.flops_per_pair() for p in self.parts)

    def largest(self, L: int, S: int) -> float | torch.Tensor:
        return sum(p.largest(L, S) for p in self.parts)

    def describe(self) -> str:
        return " + ".join(p.describe() for p in self.parts)
