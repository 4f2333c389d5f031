"""transformers' mask functions, read back as qkv.masks objects.

transformers builds every mask from a ``mask_function(batch_idx, head_idx, q_idx, kv_idx)``
composed in ``transformers.masking_utils`` (causal, sliding-window overlay, packed sequences,
chunks, joined by ``and_masks`` / ``or_masks``) plus a 2-D padding mask, and hands them to
the mask interface registered for the attention implementation. The ``sdpa`` interface
evaluates the function on every (query, key) pair; qkv's reads the composition instead and
returns a structured mask, so the CPU block engine skips the tiles the mask hides and nothing
L x S is built.

Coordinates. transformers' indices are absolute: query i of this call sits at ``i + q_offset``
and key j at ``j + kv_offset`` (a sliding-window cache keeps only the last keys). qkv's masks
align bottom-right (query i at key position ``i + S - L``); the two agree when
``q_offset - kv_offset == S - L``, which is the case for the dynamic and sliding-window caches
of `generate`. Other offsets try top-left alignment, and otherwise fall back to a dense mask.

The off-by-one. transformers' ``sliding_window=W`` (``sliding_window_overlay``: visible when
``kv_idx > q_idx - W``) lets a query see itself and the W - 1 keys before it, W keys in all;
qkv's ``sliding_window(left)`` counts the keys before the query, so HF's W is
``qkv.masks.sliding_window(W - 1)``.

A function qkv does not recognise (a model's own ``or_mask_function``, blockwise image
masks, a newer transformers) is rendered by transformers' own ``sdpa_mask`` and wrapped in
``qkv.masks.dense``: exact, but dense; `StructuredMask.recognised` and the recorded
`qkv.explain` say so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import masking_utils as hf_masks

from qkv import masks
from qkv._private import torch as private_torch
from qkv.masks import Mask

__all__ = ["StructuredMask", "structured_mask"]

_HF_MODULE = hf_masks.__name__


@dataclass(frozen=True, eq=False)
class StructuredMask:
    """The mask of one attention call, as qkv's mask interface returns it to the model.

    ``mask`` is None when every query sees every key. ``recognised`` is False when the
    transformers mask function was not understood and ``mask`` is its dense rendering.
    ``source`` says what transformers asked for, in words.

    ``ndim`` and ``shape`` describe it as the prepared (B, 1, L, S) mask it stands for:
    transformers' code reads them (``generate`` with a static cache builds the mask once and
    hands it back to ``create_causal_mask``, which then returns it unchanged).
    """

    mask: Mask | None
    recognised: bool
    source: str
    batch_size: int
    q_length: int
    kv_length: int

    @property
    def ndim(self) -> int:
        return 4

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, 1, self.q_length, self.kv_length)

    def contiguous(self) -> StructuredMask:
        """Itself: transformers before 5.24 (5.20 on Python 3.10) makes each prepared mask
        contiguous before handing it back (``generate`` with a static cache); a structured mask
        has no memory layout."""
        return self

    def __repr__(self) -> str:
        shown = "no mask" if self.mask is None else self.mask.describe()
        dense = "" if self.recognised else ", not recognised: dense"
        return f"StructuredMask({shown}; from {self.source}{dense})"


class _Unrecognised(Exception):
    """A part of the mask function that qkv cannot express structurally."""


@dataclass(frozen=True)
class _Band:
    """Visible when lo <= kv_abs - q_abs <= hi (None: unbounded), in transformers' absolute indices."""

    lo: int | None
    hi: int | None

    def __and__(self, other: _Band) -> _Band:
        lo = self.lo if other.lo is None else other.lo if self.lo is None else max(self.lo, other.lo)
        hi = self.hi if other.hi is None else other.hi if self.hi is None else min(self.hi, other.hi)
        return _Band(lo, hi)


@dataclass(frozen=True)
class _Ids:
    """Visible when the query's and the key's ids are equal: ids over absolute positions (B, T)."""

    ids: torch.Tensor
    kind: str  # "packed sequences" or "chunks"


@dataclass(frozen=True)
class _Remapped:
    """``remap_positions_for_packed_sequence``: the inner term on per-sequence positions."""

    inner: _Band
    position_ids: torch.Tensor


_Term = _Band | _Ids | _Remapped | tuple[str, list["_Term"]]


def _closure(fn: Callable) -> dict[str, Any]:
    """The variables a nested function closed over, by name (whatever they hold: Any)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        raise _Unrecognised(f"{fn!r} is not a Python function")
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, fn.__closure__ or (), strict=True)}


def _parse(fn: Callable) -> _Term:
    """The structure of a transformers mask function, or _Unrecognised."""
    if getattr(fn, "__module__", None) != _HF_MODULE:
        raise _Unrecognised(f"{getattr(fn, '__qualname__', fn)!r} is not one of transformers.masking_utils' functions")
    if fn is hf_masks.causal_mask_function:
        return _Band(None, 0)
    if fn is hf_masks.bidirectional_mask_function:
        return _Band(None, None)
    name, free = fn.__qualname__, _closure(fn)
    if name == "and_masks.<locals>.and_mask":
        return ("and", [_parse(f) for f in free["mask_functions"]])
    if name == "or_masks.<locals>.or_mask":
        return ("or", [_parse(f) for f in free["mask_functions"]])
    if name == "sliding_window_overlay.<locals>.inner_mask":
        # kv_idx > q_idx - W: the query and the W - 1 keys before it
        return _Band(1 - int(free["sliding_window"]), None)
    if name == "sliding_window_bidirectional_overlay.<locals>.inner_mask":
        window = int(free["sliding_window"])
        return _Band(-window, window)
    if name == "packed_sequence_mask_function.<locals>.inner_mask":
        return _Ids(free["packed_sequence_mask"], "packed sequences")
    if name == "remap_positions_for_packed_sequence.<locals>.inner_mask":
        inner = _parse(free["mask_function"])
        if not isinstance(inner, _Band):
            inner = _flatten_band(inner)
        return _Remapped(inner, free["position_ids"])
    if name == "chunked_overlay.<locals>.inner_mask":
        return ("chunks", [free["chunk_size"], free["left_padding"]])
    raise _Unrecognised(f"transformers mask function {name!r}")


def _flatten_band(term: _Term) -> _Band:
    """An AND of bands as one band, or _Unrecognised."""
    if isinstance(term, _Band):
        return term
    if isinstance(term, tuple) and term[0] == "and":
        band = _Band(None, None)
        for part in term[1]:
            band = band & _flatten_band(part)
        return band
    raise _Unrecognised("a remapped packed-sequence mask that is not a band")


@dataclass(frozen=True)
class _Sizes:
    batch: int
    L: int
    S: int
    q_offset: int
    kv_offset: int
    device: torch.device


def _band_mask(band: _Band, sizes: _Sizes) -> Mask | None:
    """A band in absolute indices as causal / sliding_window over this call's local indices."""
    L, S = sizes.L, sizes.S
    shift = sizes.q_offset - sizes.kv_offset  # local j - i = absolute (kv - q) + shift
    lo = None if band.lo is None else band.lo + shift
    hi = None if band.hi is None else band.hi + shift
    for align, start in (("bottom-right", S - L), ("top-left", 0)):
        # local j - i ranges over [-(L - 1), S - 1]; a bound outside it hides nothing
        left = None if lo is None or lo <= -(L - 1) else start - lo
        right = None if hi is None or hi >= S - 1 else hi - start
        if (left is not None and left < 0) or (right is not None and right < 0):
            continue  # not expressible with this alignment
        if left is None and right is None:
            return None
        if left is None and right == 0:
            return masks.causal(align=align)  # type: ignore[arg-type]
        return masks.sliding_window(
            start + L - 1 if left is None else left,  # far enough to reach key 0
            S - 1 - start if right is None else right,  # far enough to reach key S - 1
            align=align,  # type: ignore[arg-type]
        )
    raise _Unrecognised(f"a band {band} at q_offset={sizes.q_offset}, kv_offset={sizes.kv_offset}")


def _ids_mask(ids: torch.Tensor, sizes: _Sizes) -> Mask:
    """Equal ids over absolute positions as documents(query ids, key ids) of this call."""
    ids = ids.to(sizes.device).expand(sizes.batch, -1)  # (B, T)
    if ids.shape[1] < max(sizes.q_offset + sizes.L, sizes.kv_offset + sizes.S):
        raise _Unrecognised(f"sequence ids of length {ids.shape[1]} do not cover the call")
    q_ids = ids[:, sizes.q_offset : sizes.q_offset + sizes.L]  # (B, L)
    kv_ids = ids[:, sizes.kv_offset : sizes.kv_offset + sizes.S]  # (B, S)
    return masks.documents(q_ids, kv_ids)


def _chunk_mask(chunk_size: int, left_padding: torch.Tensor, sizes: _Sizes) -> Mask:
    """``chunked_overlay``: (position - left_padding[b]) // chunk_size equal for query and key."""
    lp = left_padding.to(sizes.device).reshape(-1, 1)  # (B | 1, 1)
    q_pos = torch.arange(sizes.L, device=sizes.device) + sizes.q_offset  # (L,)
    kv_pos = torch.arange(sizes.S, device=sizes.device) + sizes.kv_offset  # (S,)
    q_ids = torch.div(q_pos[None] - lp, chunk_size, rounding_mode="floor")  # (B | 1, L)
    kv_ids = torch.div(kv_pos[None] - lp, chunk_size, rounding_mode="floor")  # (B | 1, S)
    return masks.documents(q_ids, kv_ids)


def _check_remap(remapped: _Remapped, factors: list[_Term]) -> _Band:
    """A remapped band equals the plain band inside each packed sequence when positions run
    on by one within every sequence; it must come with the packed-sequence mask itself."""
    packed = [f for f in factors if isinstance(f, _Ids) and f.kind == "packed sequences"]
    if not packed:
        raise _Unrecognised("per-sequence positions without the packed-sequence mask")
    position_ids = remapped.position_ids  # (B, T)
    ids = packed[0].ids.to(position_ids.device).expand_as(position_ids)  # (B, T)
    same = ids[:, 1:] == ids[:, :-1]
    step = position_ids[:, 1:] - position_ids[:, :-1]
    if not bool((step[same] == 1).all()):
        raise _Unrecognised("positions that do not run on by one inside a packed sequence")
    return remapped.inner


def _to_mask(term: _Term, sizes: _Sizes) -> Mask | None:
    if isinstance(term, _Band):
        return _band_mask(term, sizes)
    if isinstance(term, _Ids):
        return _ids_mask(term.ids, sizes)
    if isinstance(term, _Remapped):
        raise _Unrecognised("per-sequence positions outside an and_masks")
    op, parts = term
    if op == "chunks":
        return _chunk_mask(int(parts[0]), parts[1], sizes)  # type: ignore[arg-type, call-overload]
    if op == "and":
        # the bands (plain or remapped inside packed sequences) intersect into one band
        band = _Band(None, None)
        others: list[Mask] = []
        for part in parts:
            if isinstance(part, _Remapped):
                band = band & _check_remap(part, parts)
            elif isinstance(part, _Band):
                band = band & part
            else:
                mask = _to_mask(part, sizes)
                if mask is not None:
                    others.append(mask)
        result = _band_mask(band, sizes)
        for mask in others:
            result = mask if result is None else result & mask
        return result
    assert op == "or"
    union: Mask | None = None
    for part in parts:
        mask = _to_mask(part, sizes)
        if mask is None:
            return None  # one part sees everything: so does the union
        union = mask if union is None else union | mask
    return union


def _describe_source(term: _Term | None) -> str:
    if term is None:
        return "a mask function qkv did not recognise"
    if isinstance(term, _Band):
        if term.lo is None:
            return "bidirectional" if term.hi is None else "causal"
        if term.hi is None:
            return f"sliding window {1 - term.lo}"
        return f"window |q - k| <= {term.hi}"
    if isinstance(term, _Ids):
        return term.kind
    if isinstance(term, _Remapped):
        return "per-sequence positions"
    op, parts = term
    if op == "chunks":
        return f"chunks of {parts[0]}"
    return f" {op} ".join(_describe_source(p) for p in parts)


def _int(value: int | torch.Tensor) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def structured_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable = hf_masks.causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **unused: object,
) -> StructuredMask | None:
    """qkv's entry in transformers' ``AttentionMaskInterface``.

    Called by ``create_causal_mask`` and its siblings with the keyword arguments of
    ``transformers.masking_utils.sdpa_mask`` (its other keywords, ``dtype``, ``config``,
    ``local_size`` and the skip flags, do not change the mask and are ignored). Returns None
    when nothing is hidden, else a `StructuredMask`: the mask function read as qkv masks,
    and the 2-D padding mask ``attention_mask`` (B, >= kv_offset + kv_length), True = real
    token, as ``key_padding``. Padding is never dropped.
    """
    del unused
    if isinstance(attention_mask, StructuredMask):
        return attention_mask  # prepared earlier for this very call (generate with a static cache)
    sizes = _Sizes(batch_size, q_length, kv_length, _int(q_offset), _int(kv_offset), torch.device(device))
    term: _Term | None = None
    mask: Mask | None = None
    try:
        parsed = _parse(mask_function)
        mask = _to_mask(parsed, sizes)
        term, recognised = parsed, True
    except _Unrecognised:
        term, recognised = None, False
    padding = _padding(attention_mask, sizes)
    source = _describe_source(term) + (", padding" if padding is not None else "")
    if not recognised:
        dense = hf_masks.sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length,
            q_offset=q_offset,  # type: ignore[arg-type]  # transformers annotates int; its callers pass tensors too
            kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
            allow_is_causal_skip=False, allow_is_bidirectional_skip=False, use_vmap=use_vmap, device=device,
        )  # (B, 1, L, S) bool, padding included
        assert dense is not None  # None only where a skip is allowed, and both are off
        return StructuredMask(masks.dense(dense), False, source, batch_size, q_length, kv_length)
    if padding is not None:
        mask = padding if mask is None else mask & padding
    if mask is None:
        return None
    return StructuredMask(mask, True, source, batch_size, q_length, kv_length)


def _padding(attention_mask: torch.Tensor | None, sizes: _Sizes) -> Mask | None:
    """The keys of this call that are real tokens, as key_padding, or None when all are."""
    if attention_mask is None:
        return None
    end = sizes.kv_offset + sizes.S
    valid = attention_mask.to(device=sizes.device, dtype=torch.bool)  # (B, T)
    if valid.shape[-1] < end:
        # keys past the 2-D mask (a static cache's empty slots) are not real tokens, as in sdpa_mask
        valid = torch.nn.functional.pad(valid, (0, end - valid.shape[-1]))  # (B, end)
    valid = valid[:, sizes.kv_offset : end]  # (B, S)
    # a mask without padding adds nothing; while torch.compile traces, its values are unknown
    # (reading them would break the graph), so it is kept: an all-true key padding hides nothing
    if not private_torch.host_unreadable(valid) and bool(valid.all()):
        return None
    return masks.key_padding(valid.expand(sizes.batch, -1).contiguous())
