"""`from_xformers`: xformers' ``attn_bias`` objects (``xformers.ops.fmha.attn_bias``) as qkv masks
and biases, and `memory_efficient_attention` on qkv's dispatcher.

xformers need not be installed: a bias is recognized by its class name and read through the
attributes its documentation names (``_window_size``, ``window_left`` / ``window_right``,
``_bias``, ``q_seqinfo`` / ``k_seqinfo`` with ``seqstart_py`` and, for padded or gappy
keys, ``seqlen_py``). Their semantics, from xformers' docstrings and ``materialize``:

- a float tensor is added to the scores (a float mask in qkv);
- ``LowerTriangularMask``: query i sees keys j <= i (top-left); ``...WithTensorBias`` adds
  its tensor; ``LowerTriangularFromBottomRightMask``: j <= i + S - L (bottom-right);
  ``LowerTriangularFromBottomRightLocalAttentionMask(w)``: also j > i + S - L - w (w keys
  counting the query's own position); ``LocalAttentionFromBottomRightMask(left, right)``:
  i + S - L - left <= j <= i + S - L + right;
- ``BlockDiagonal...``: queries and keys cut into as many blocks, block d's queries see
  only block d's keys; ``Causal`` aligns the diagonal top-left inside each block,
  ``FromBottomRight`` / ``WithOffset`` bottom-right, ``LocalAttention`` keeps the last w
  positions; ``PaddedKeys`` / ``GappyKeys`` blocks use only their first seqlen keys.

Blocks whose diagonal is the same either way become `qkv.masks.varlen`; the others a mask
of one key interval per query (`KeyIntervals`). Paged biases and unknown types raise a
TypeError that names them.
"""

from __future__ import annotations

import itertools
from typing import Any, Literal, TypedDict

import torch

from qkv import masks
from qkv.attention.functional import attention
from qkv.compat._args import real_number, tensor_of_rank
from qkv.compat._intervals import KeyIntervals

__all__ = ["XformersBias", "from_xformers", "memory_efficient_attention"]

Diagonal = Literal["none", "top-left", "bottom-right"]

# class name -> (causal diagonal inside each block, local attention)
_BLOCK_DIAGONAL: dict[str, tuple[Diagonal, bool]] = {
    "BlockDiagonalMask": ("none", False),
    "BlockDiagonalCausalMask": ("top-left", False),
    "BlockDiagonalCausalFromBottomRightMask": ("bottom-right", False),
    "BlockDiagonalCausalLocalAttentionMask": ("top-left", True),
    "BlockDiagonalCausalLocalAttentionFromBottomRightMask": ("bottom-right", True),
    "BlockDiagonalPaddedKeysMask": ("none", False),
    "BlockDiagonalCausalWithOffsetPaddedKeysMask": ("bottom-right", False),
    "BlockDiagonalCausalLocalAttentionPaddedKeysMask": ("bottom-right", True),
    "BlockDiagonalGappyKeysMask": ("none", False),
    "BlockDiagonalCausalWithOffsetGappyKeysMask": ("bottom-right", False),
}


class XformersBias(TypedDict):
    """Keyword arguments of `qkv.attention`: ``qkv.attention(q, k, v, **from_xformers(attn_bias))``."""

    mask: masks.Mask | torch.Tensor | None
    bias: torch.Tensor | None


def _window(attn_bias: Any, name: str) -> int:
    w = getattr(attn_bias, "_window_size", None)
    if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
        raise ValueError(f"{name}._window_size must be a positive int, got {w!r}")
    return w


def _starts(seqinfo: Any, what: str, name: str) -> list[int]:
    starts = getattr(seqinfo, "seqstart_py", None)
    if starts is None:
        starts = getattr(seqinfo, "cu_seqlen_py", None)  # xformers before 0.0.21
    if not isinstance(starts, (list, tuple)) or len(starts) < 2 or any(not isinstance(s, int) for s in starts):
        raise TypeError(f"{name}.{what} must carry seqstart_py, a list of block starts [0, ..., total]")
    return list(starts)


def _blocks(attn_bias: Any, name: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int, int]:
    """(query blocks, key blocks) as (start, length) lists, and the totals L and S."""
    q_starts = _starts(getattr(attn_bias, "q_seqinfo", None), "q_seqinfo", name)
    k_info = getattr(attn_bias, "k_seqinfo", None)
    k_starts = _starts(k_info, "k_seqinfo", name)
    if len(q_starts) != len(k_starts):
        raise ValueError(f"{name} has {len(q_starts) - 1} query blocks and {len(k_starts) - 1} key blocks")
    q_blocks = [(a, b - a) for a, b in itertools.pairwise(q_starts)]
    used = getattr(k_info, "seqlen_py", None)
    if used is not None:  # padded or gappy keys: block d starts at seqstart_py[d] and uses seqlen_py[d] keys
        k_blocks = [(start, int(n)) for start, n in zip(k_starts[:-1], used, strict=True)]
    else:
        k_blocks = [(a, b - a) for a, b in itertools.pairwise(k_starts)]
    if len(q_blocks) != len(k_blocks):
        raise ValueError(f"{name} has {len(q_blocks)} query blocks and {len(k_blocks)} key blocks")
    if any(n < 0 for _, n in q_blocks + k_blocks):
        raise ValueError(f"{name} has a block of negative length")
    return q_blocks, k_blocks, q_starts[-1], k_starts[-1]


def _block_diagonal(attn_bias: Any, name: str) -> masks.Mask:
    diagonal, local = _BLOCK_DIAGONAL[name]
    window = _window(attn_bias, name) if local else None
    q_blocks, k_blocks, _, S = _blocks(attn_bias, name)
    ends = [start + n for start, n in k_blocks]
    contiguous = ends == [start for start, _ in k_blocks[1:]] + [S]  # no unused key between blocks
    same_diagonal = diagonal != "top-left" or all(lq == lk for (_, lq), (_, lk) in zip(q_blocks, k_blocks, strict=True))
    if contiguous and same_diagonal:
        return masks.varlen(
            [n for _, n in q_blocks], [n for _, n in k_blocks],
            causal=diagonal != "none", window=None if window is None else (window - 1, 0),
        )
    lo, hi, positions = [], [], []
    for (_, lq), (k0, lk) in zip(q_blocks, k_blocks, strict=True):
        i = torch.arange(lq)
        p = i + (lk - lq if diagonal == "bottom-right" else 0)  # the query's position among the block's keys
        last = torch.full_like(i, lk - 1) if diagonal == "none" else torch.minimum(p, torch.tensor(lk - 1))
        first = torch.zeros_like(i) if window is None else (p - window + 1).clamp(min=0)
        lo.append(first + k0)
        hi.append(last + k0)
        positions.append(p + k0)
    return KeyIntervals(torch.cat(lo), torch.cat(hi), torch.cat(positions), S, f"xformers {name} ({len(q_blocks)} blocks)")


def from_xformers(attn_bias: object) -> XformersBias:
    """xformers' ``attn_bias`` as ``{"mask": ..., "bias": ...}`` for `qkv.attention`.

    Returns:
        a dict to pass as keyword arguments: ``qkv.attention(q, k, v, **from_xformers(b))``,
        with q (B, H, L, E) (xformers' (B, L, H, E) transposed; `memory_efficient_attention`
        does that).

    Raises:
        TypeError: for a type that is not one of xformers' biases listed in this module
            (its name is in the message), a paged bias, or a non-float tensor.

    >>> class LowerTriangularMask:  # stands for xformers.ops.fmha.attn_bias.LowerTriangularMask
    ...     pass
    >>> from_xformers(LowerTriangularMask())["mask"].describe()
    "causal(align='top-left')"
    """
    if attn_bias is None:
        return {"mask": None, "bias": None}
    if isinstance(attn_bias, torch.Tensor):
        if not attn_bias.is_floating_point():
            raise TypeError(f"a tensor attn_bias is added to the scores and must be floating point, got {attn_bias.dtype}")
        return {"mask": attn_bias, "bias": None}
    name = type(attn_bias).__name__
    if name == "LowerTriangularMask":
        bottom_right = getattr(attn_bias, "from_bottom_right", False) is True
        return {"mask": masks.causal() if bottom_right else masks.causal(align="top-left"), "bias": None}
    if name == "LowerTriangularMaskWithTensorBias":
        tensor = getattr(attn_bias, "_bias", None)
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise TypeError(f"{name}._bias must be a float tensor, got {type(tensor).__name__}")
        return {"mask": masks.causal(align="top-left"), "bias": tensor}
    if name == "LowerTriangularFromBottomRightMask":
        return {"mask": masks.causal(), "bias": None}
    if name == "LowerTriangularFromBottomRightLocalAttentionMask":
        return {"mask": masks.sliding_window(_window(attn_bias, name) - 1, 0), "bias": None}
    if name == "LocalAttentionFromBottomRightMask":
        left, right = getattr(attn_bias, "window_left", None), getattr(attn_bias, "window_right", None)
        if any(isinstance(w, bool) or not isinstance(w, int) or w < 0 for w in (left, right)):
            raise ValueError(f"{name} needs window_left and window_right ints >= 0, got {left!r} and {right!r}")
        return {"mask": masks.sliding_window(left, right), "bias": None}  # type: ignore[arg-type]
    if name in _BLOCK_DIAGONAL:
        return {"mask": _block_diagonal(attn_bias, name), "bias": None}
    if "Paged" in name:
        raise TypeError(f"xformers' {name} reads a paged KV cache, which this drop-in does not read; use qkv.PagedKVCache.attend or qkv.compat.flash_attn_with_kvcache")
    raise TypeError(
        f"from_xformers does not know the attn_bias type {name}; it takes None, a float tensor, "
        "LowerTriangularMask, LowerTriangularMaskWithTensorBias, LowerTriangularFromBottomRightMask, "
        "LowerTriangularFromBottomRightLocalAttentionMask, LocalAttentionFromBottomRightMask, "
        f"and {', '.join(_BLOCK_DIAGONAL)}"
    )


def memory_efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: object = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op: object = None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """xformers' ``memory_efficient_attention`` on (B, M, H, K) tensors, computed by `qkv.attention`.

    Args:
        query: (B, L, H, E).
        key: (B, S, G, E), G dividing H (xformers' 5-D grouped layout is refused).
        value: (B, S, G, Ev).
        attn_bias: anything `from_xformers` takes.
        p: dropout probability (applied whenever > 0).
        scale: factor of q k^T; default 1 / sqrt(E).
        op: xformers' kernel choice; accepted and unused (qkv chooses its path itself).
        output_dtype: must be None (the output has query's dtype).

    Returns:
        (B, L, H, Ev), contiguous.

    >>> import torch
    >>> from qkv.compat import memory_efficient_attention
    >>> q = k = v = torch.randn(1, 5, 2, 8)
    >>> memory_efficient_attention(q, k, v).shape
    torch.Size([1, 5, 2, 8])
    """
    layout = "(batch, seqlen, heads, headdim)"
    query, key, value = (tensor_of_rank(x, 4, n, layout) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    if output_dtype is not None:
        raise ValueError("memory_efficient_attention: output_dtype is not supported; the output has query's dtype")
    del op
    converted = from_xformers(attn_bias)
    out = attention(
        query.transpose(1, 2),  # (B, H, L, E)
        key.transpose(1, 2),  # (B, G, S, E)
        value.transpose(1, 2),  # (B, G, S, Ev)
        converted["mask"],
        bias=converted["bias"],
        scale=scale,
        dropout=real_number(p, "p"),
    )
    assert isinstance(out, torch.Tensor)
    return out.transpose(1, 2).contiguous()  # (B, L, H, Ev)
