"""`flash_attn_varlen_func`: FlashAttention 2's ``flash_attn_varlen_func`` on qkv's dispatcher.

Sequences packed without padding: q (total_q, H, E), k and v (total_k, G, E), sequence d
holding rows cu_seqlens[d] .. cu_seqlens[d + 1] - 1. Each sequence sees only its own keys,
and ``causal``, ``window_size`` and ``alibi_slopes`` apply at its own positions, aligned
bottom-right to its own lengths (FlashAttention's docstring): this is `qkv.masks.varlen` on
one packed batch row, as `qkv.attention_varlen` runs it. ``block_table`` (a paged KV cache)
is refused here: `flash_attn_with_kvcache` reads one, and `qkv.PagedKVCache` keeps one.
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from qkv.attention.functional import attention
from qkv.attention.varlen import lengths_from_cu_seqlens
from qkv.compat._alibi import alibi_from_slopes
from qkv.compat._args import (
    check_flag,
    flash_mask_options,
    flash_softcap,
    real_number,
    tensor_of_rank,
)
from qkv.masks import varlen

__all__ = ["flash_attn_varlen_func", "refuse_block_table"]


def refuse_block_table(block_table: object) -> None:
    """A paged KV cache is read by flash_attn_with_kvcache, not here: say so instead of reading pages wrongly."""
    if block_table is not None:
        raise ValueError(
            "block_table (a paged KV cache) is not supported by flash_attn_varlen_func here: use flash_attn_with_kvcache "
            "(which reads a paged cache, e.g. qkv.PagedKVCache's) or pass contiguous key/value tensors"
        )


def _max_seqlen(value: object, lengths: torch.Tensor, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    longest = int(lengths.max())
    if value < longest:
        raise ValueError(f"{name}={value} is below the longest sequence ({longest} rows)")
    return value


@overload
def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = ...,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    alibi_slopes: torch.Tensor | None = ...,
    deterministic: bool = ...,
    return_attn_probs: Literal[False] = ...,
    block_table: torch.Tensor | None = ...,
) -> torch.Tensor: ...


@overload
def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = ...,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    alibi_slopes: torch.Tensor | None = ...,
    deterministic: bool = ...,
    *,
    return_attn_probs: Literal[True],
    block_table: torch.Tensor | None = ...,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@overload
def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = ...,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    alibi_slopes: torch.Tensor | None = ...,
    deterministic: bool = ...,
    return_attn_probs: bool = ...,
    block_table: torch.Tensor | None = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention's ``flash_attn_varlen_func``, computed by `qkv.attention` with `qkv.masks.varlen`.

    Args:
        q: (total_q, H, E) the queries of every sequence, one after another.
        k: (total_k, G, E), H a multiple of G.
        v: (total_k, G, Ev).
        cu_seqlens_q, cu_seqlens_k: (docs + 1,) int32 or int64 cumulative lengths [0, ..., total].
        max_seqlen_q, max_seqlen_k: ints at least the longest sequence (checked).
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic: as
            `flash_attn_func`, per sequence (i, j, L, S its own positions and lengths).
        alibi_slopes: None, (H,) or (docs, H) float.
        return_attn_probs: also return softmax_lse and the probabilities.
        block_table: must be None (ValueError otherwise; `flash_attn_with_kvcache` reads paged caches).

    Returns:
        out (total_q, H, Ev); with ``return_attn_probs`` (out, softmax_lse (H, total_q),
        probs (docs, H, max_seqlen_q, max_seqlen_k)): each sequence's exact probabilities in
        the top-left corner of its slice, zeros elsewhere (FlashAttention's own third value
        is described at `flash_attn_func`).

    Example: two sequences of 3 and 2 tokens, causal inside each:
        >>> import torch
        >>> from qkv.compat import flash_attn_varlen_func
        >>> q, k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
        >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)
        >>> out = flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, causal=True)
        >>> torch.allclose(out[3], v[3])  # the first token of the second sequence sees itself only
        True
    """
    refuse_block_table(block_table)
    q = tensor_of_rank(q, 3, "q", "(total_q, nheads, headdim)")
    k = tensor_of_rank(k, 3, "k", "(total_k, nheads_k, headdim)")
    v = tensor_of_rank(v, 3, "v", "(total_k, nheads_k, headdim)")
    check_flag(deterministic, "deterministic")
    want_probs = check_flag(return_attn_probs, "return_attn_probs")
    q_lengths = lengths_from_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    k_lengths = lengths_from_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if q_lengths.numel() != k_lengths.numel():
        raise ValueError(f"cu_seqlens_q describes {q_lengths.numel()} sequences, cu_seqlens_k {k_lengths.numel()}")
    max_q = _max_seqlen(max_seqlen_q, q_lengths, "max_seqlen_q")
    max_k = _max_seqlen(max_seqlen_k, k_lengths, "max_seqlen_k")
    is_causal, window = flash_mask_options(causal, window_size, max(max_q, max_k))
    docs, H = q_lengths.numel(), q.shape[1]
    doc_of_query = torch.repeat_interleave(torch.arange(docs, device=q.device), q_lengths.to(q.device))  # (total_q,)
    result = attention(
        q.transpose(0, 1)[None],  # (1, H, total_q, E)
        k.transpose(0, 1)[None],  # (1, G, total_k, E)
        v.transpose(0, 1)[None],  # (1, G, total_k, Ev)
        varlen(q_lengths, k_lengths, causal=is_causal, window=window),
        bias=alibi_from_slopes(alibi_slopes, docs, H, doc_of_query),
        softcap=flash_softcap(softcap),
        scale=softmax_scale,
        dropout=real_number(dropout_p, "dropout_p"),
        return_weights=want_probs,
        return_lse=want_probs,
    )
    if not want_probs:
        assert isinstance(result, torch.Tensor)
        return result[0].transpose(0, 1).contiguous()  # (total_q, H, Ev)
    out, packed, lse = result
    probs = packed.new_zeros(docs, H, max_q, max_k)  # (docs, H, max_seqlen_q, max_seqlen_k)
    q_starts = (torch.cumsum(q_lengths, 0) - q_lengths).tolist()
    k_starts = (torch.cumsum(k_lengths, 0) - k_lengths).tolist()
    for d, (q0, k0, lq, lk) in enumerate(zip(q_starts, k_starts, q_lengths.tolist(), k_lengths.tolist(), strict=True)):
        probs[d, :, :lq, :lk] = packed[0, :, q0 : q0 + lq, k0 : k0 + lk]
    return out[0].transpose(0, 1).contiguous(), lse[0], probs  # (total_q, H, Ev), (H, total_q), (docs, H, Lq, Lk)
