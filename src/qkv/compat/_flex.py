"""`flex_attention`, `create_block_mask`, `and_masks`, `or_masks`: PyTorch's FlexAttention API
(``torch.nn.attention.flex_attention``) on qkv's dispatcher, and `from_block_mask`, which turns
one of PyTorch's own ``BlockMask`` objects into a qkv mask.

A ``mask_mod(b, h, q_idx, kv_idx) -> bool`` says which keys a query may see and a
``score_mod(score, b, h, q_idx, kv_idx) -> score`` rewrites the scaled score; qkv calls both
on broadcasting index tensors (FlexAttention calls them under vmap on scalars), so a mod
written with elementwise tensor operations works in both. `create_block_mask` returns a
`BlockMask` that holds a `qkv.masks.predicate`: nothing is evaluated until attention runs,
and qkv finds the empty and full tiles itself. A row that sees no key gives zeros and lse
-inf, as FlexAttention.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, overload

import torch

from qkv.attention.functional import attention
from qkv.compat._args import check_flag
from qkv.masks import Mask, predicate
from qkv.scores import ScoreMod

__all__ = ["BlockMask", "and_masks", "create_block_mask", "flex_attention", "from_block_mask", "or_masks"]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, eq=False)
class BlockMask:
    """What `create_block_mask` returns: qkv's counterpart of FlexAttention's ``BlockMask``.

    ``mask`` is the qkv mask (it also works with `qkv.attention` directly); ``seq_lengths``
    is (Q_LEN, KV_LEN), the sizes it was made for; ``shape`` is (B, H, Q_LEN, KV_LEN) with 1
    for a dim the mask does not vary over.
    """

    mask: Mask
    seq_lengths: tuple[int, int]
    mask_mod: MaskMod

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.mask.batch or 1, self.mask.heads or 1, *self.seq_lengths)

    def to_dense(self) -> torch.Tensor:
        """The mask at its sizes as a bool tensor (B, H, Q_LEN, KV_LEN), True = may attend."""
        return self.mask.to_dense(*self.seq_lengths).expand(self.shape)


def _size(value: object, name: str, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, got {value!r}")
    return value


def create_block_mask(
    mask_mod: MaskMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,
    _compile: bool = False,
) -> BlockMask:
    """FlexAttention's ``create_block_mask``: the mask of ``mask_mod`` for (B, H, Q_LEN, KV_LEN).

    B or H None (or 1) means the mask is the same for every batch row or head (mask_mod is
    then called with b = 0 or h = 0). ``device``, ``BLOCK_SIZE`` and ``_compile`` tune
    FlexAttention's own block table and change nothing here: qkv lays out its tiles itself.

    >>> from qkv.compat import create_block_mask
    >>> block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 3, 3)
    >>> block_mask.to_dense()[0, 0].int().tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function (b, h, q_idx, kv_idx) -> bool tensor, got {type(mask_mod).__name__}")
    batch, heads = _size(B, "B", True), _size(H, "H", True)
    q_len, kv_len = _size(Q_LEN, "Q_LEN", False), _size(KV_LEN, "KV_LEN", False)
    assert q_len is not None and kv_len is not None
    check_flag(_compile, "_compile")
    mask = predicate(mask_mod, batch=batch if batch != 1 else None, heads=heads if heads != 1 else None)
    return BlockMask(mask, (q_len, kv_len), mask_mod)


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod that allows a pair when every one of ``mask_mods`` does (all pairs for none)."""
    _check_mods(mask_mods, "and_masks")

    def both(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        result = b.new_ones((), dtype=torch.bool)
        for mod in mask_mods:
            result = result & mod(b, h, q_idx, kv_idx)
        return result

    return both


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """A mask_mod that allows a pair when any one of ``mask_mods`` does (no pair for none)."""
    _check_mods(mask_mods, "or_masks")

    def either(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        result = b.new_zeros((), dtype=torch.bool)
        for mod in mask_mods:
            result = result | mod(b, h, q_idx, kv_idx)
        return result

    return either


def _check_mods(mods: tuple[object, ...], name: str) -> None:
    bad = [type(m).__name__ for m in mods if not callable(m)]
    if bad:
        raise TypeError(f"{name} takes mask_mod functions (b, h, q_idx, kv_idx) -> bool tensor, got {bad}")


def _block_table(counts: torch.Tensor, indices: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """(B, H, nQ, nK) bool: the key blocks listed (the first counts[...] of indices) per query block."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < counts[..., None]  # (B, H, nQ, width)
    columns = torch.where(listed, indices.long().clamp(0, n_blocks), n_blocks)  # unlisted -> a spare column
    table = torch.zeros(*indices.shape[:-1], n_blocks + 1, dtype=torch.bool, device=indices.device)
    return table.scatter_(-1, columns, True)[..., :n_blocks]  # (B, H, nQ, nK)


def from_block_mask(block_mask: Any) -> BlockMask:
    """FlexAttention's own ``BlockMask`` (from its ``create_block_mask`` or ``from_kv_blocks``) as a qkv `BlockMask`.

    Its exact semantics are kept: a pair is visible when its tile is one of the block
    mask's full blocks, or one of its partial blocks and ``mask_mod`` allows the pair (tiles
    of BLOCK_SIZE, read from kv_num_blocks / kv_indices and full_kv_num_blocks /
    full_kv_indices).
    """
    needed = ("mask_mod", "seq_lengths", "BLOCK_SIZE", "kv_num_blocks", "kv_indices")
    missing = [name for name in needed if not hasattr(block_mask, name)]
    if missing:
        raise TypeError(
            f"from_block_mask takes a torch.nn.attention.flex_attention.BlockMask, got {type(block_mask).__name__} "
            f"(it lacks {', '.join(missing)})"
        )
    q_len, kv_len = (int(n) for n in block_mask.seq_lengths)
    block_q, block_k = (int(n) for n in block_mask.BLOCK_SIZE)
    n_q, n_k = math.ceil(q_len / block_q), math.ceil(kv_len / block_k)
    partial = _block_table(block_mask.kv_num_blocks, block_mask.kv_indices, n_k)[..., :n_q, :]  # (B, H, nQ, nK)
    if getattr(block_mask, "full_kv_num_blocks", None) is not None:
        full = _block_table(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n_k)[..., :n_q, :]
    else:
        full = torch.zeros_like(partial)
    mask_mod = block_mask.mask_mod
    B, H = partial.shape[0], partial.shape[1]

    def visible(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        bb = b if B > 1 else torch.zeros_like(b)
        hh = h if H > 1 else torch.zeros_like(h)
        tile = (bb, hh, q_idx // block_q, kv_idx // block_k)
        full_here, partial_here = full.to(q_idx.device)[tile], partial.to(q_idx.device)[tile]
        return full_here | (partial_here & mask_mod(b, h, q_idx, kv_idx))

    mask = predicate(visible, batch=B if B > 1 else None, heads=H if H > 1 else None)
    return BlockMask(mask, (q_len, kv_len), mask_mod)


def _as_mask(block_mask: object, L: int, S: int) -> Mask | None:
    if block_mask is None or isinstance(block_mask, Mask):
        return block_mask
    if not isinstance(block_mask, BlockMask):
        block_mask = from_block_mask(block_mask)
    if block_mask.seq_lengths != (L, S):
        raise ValueError(
            f"block_mask was made for (Q_LEN, KV_LEN) = {block_mask.seq_lengths}, the inputs have L={L} and S={S}"
        )
    return block_mask.mask


@overload
def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: ScoreMod | None = ...,
    block_mask: BlockMask | Mask | Any | None = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    return_lse: Literal[False] = ...,
    kernel_options: dict[str, Any] | None = ...,
    *,
    return_aux: None = ...,
) -> torch.Tensor: ...


@overload
def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: ScoreMod | None = ...,
    block_mask: BlockMask | Mask | Any | None = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    *,
    return_lse: Literal[True],
    kernel_options: dict[str, Any] | None = ...,
    return_aux: None = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: ScoreMod | None = ...,
    block_mask: BlockMask | Mask | Any | None = ...,
    scale: float | None = ...,
    enable_gqa: bool = ...,
    return_lse: bool = ...,
    kernel_options: dict[str, Any] | None = ...,
    *,
    return_aux: Any = ...,
) -> torch.Tensor | tuple[torch.Tensor, Any]: ...


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | Mask | Any | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict[str, Any] | None = None,
    *,
    return_aux: Any = None,
) -> torch.Tensor | tuple[torch.Tensor, Any]:
    """FlexAttention's ``flex_attention``, computed by `qkv.attention`.

    Args:
        query: (B, H, L, E) (any qkv layout (..., H, L, E) works).
        key: (B, G, S, E); G = H, or with ``enable_gqa`` a divisor of H.
        value: (B, G, S, Ev).
        score_mod: None or fn(score, b, h, q_idx, kv_idx) -> score, on the scaled score.
        block_mask: None, a `BlockMask` from `create_block_mask`, PyTorch's own BlockMask
            (converted by `from_block_mask`), or any `qkv.masks` object.
        scale: factor of q k^T; default 1 / sqrt(E).
        enable_gqa: allow G to divide H.
        return_lse: also return the log-sum-exp (B, H, L) (PyTorch deprecates it for
            return_aux; here it keeps working).
        kernel_options: FlexAttention's kernel tuning; accepted and unused.
        return_aux: None, or FlexAttention's ``AuxRequest(lse=True)`` (``max_scores=True``
            is refused: qkv does not return the row maxima).

    Returns:
        (B, H, L, Ev); (out, lse) with ``return_lse``; (out, AuxOutput(lse=lse)) with
        ``return_aux``. lse is float32 (float64 for float64 inputs), -inf for a row that
        sees no key (whose output is zeros).

    Example (the one-line switch from ``torch.nn.attention.flex_attention``):
        >>> import torch
        >>> from qkv.compat import create_block_mask, flex_attention
        >>> def causal(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> q = k = v = torch.randn(1, 2, 6, 8)
        >>> out = flex_attention(q, k, v, block_mask=create_block_mask(causal, None, None, 6, 6))
        >>> torch.allclose(out[:, :, 0], v[:, :, 0])
        True
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"flex_attention: {name} must be a torch.Tensor, got {type(x).__name__}")
    check_flag(enable_gqa, "enable_gqa")
    want_lse = check_flag(return_lse, "return_lse")
    want_aux = return_aux is not None
    if want_aux:
        if not (hasattr(return_aux, "lse") and hasattr(return_aux, "max_scores")):
            raise TypeError(f"return_aux must be FlexAttention's AuxRequest or None, got {type(return_aux).__name__}")
        if return_aux.max_scores:
            raise ValueError("flex_attention: return_aux with max_scores=True is not supported (qkv returns no row maxima)")
        if want_lse:
            raise ValueError("flex_attention: pass return_lse or return_aux, not both")
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {type(kernel_options).__name__}")
    if query.ndim >= 3 and key.ndim >= 3 and not enable_gqa and query.shape[-3] != key.shape[-3]:
        raise ValueError(
            f"flex_attention: query has {query.shape[-3]} heads and key {key.shape[-3]}; pass enable_gqa=True "
            "for grouped-query attention"
        )
    L, S = query.shape[-2], key.shape[-2]
    need_lse = want_lse or (want_aux and bool(return_aux.lse))
    mask = _as_mask(block_mask, L, S)
    lse: torch.Tensor | None = None
    if need_lse:
        out, lse = attention(query, key, value, mask, score_mod=score_mod, scale=scale, return_lse=True)
    else:
        out = attention(query, key, value, mask, score_mod=score_mod, scale=scale)
    if not want_aux:
        return (out, lse) if want_lse else out
    from torch.nn.attention.flex_attention import AuxOutput

    return out, AuxOutput(lse=lse)
