"""`qkv.attention_varlen`: packed variable-length sequences in FlashAttention's varlen layout.

Sequences are packed one after another without padding: q (total_q, H, E) holds the queries
of every sequence, row cu_seqlens_q[d] .. cu_seqlens_q[d + 1] - 1 those of sequence d (the
layout of ``flash_attn_varlen_func``). This is `qkv.attention` on one batch row, (1, H,
total_q, E), with the mask `qkv.masks.varlen`: each sequence sees only its own keys, at
positions of its own, causal and windows aligned bottom-right to its own lengths. The CPU
engine visits only the tiles of the block diagonal, so the work is sum_d q_len_d * k_len_d,
not total_q * total_k.
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from qkv._private import torch as private_torch
from qkv.attention.dispatch import Backend
from qkv.attention.functional import attention
from qkv.bias import Bias
from qkv.masks import varlen
from qkv.scores import ScoreMod

__all__ = ["attention_varlen", "lengths_from_cu_seqlens"]


def lengths_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int, name: str) -> torch.Tensor:
    """Per-sequence lengths (docs,) int64 from cumulative lengths (docs + 1,), checked."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D int32 or int64 tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64 (cumulative lengths), got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries [0, ..., total], got shape {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    if private_torch.host_unreadable(cu):
        # traced (torch.compile, export, vmap): the same checks, made when the graph runs; the
        # lengths carry the gate (1) so that no compiler drops it
        valid = (cu[0] == 0) & (lengths >= 0).all() & (cu[-1] == total)
        message = f"{name} must start at 0, never decrease and end at the packed tensor's {total} rows"
        return lengths * private_torch.require(valid, message).to(lengths.dtype)
    if int(cu[0]) != 0 or bool((lengths < 0).any()):
        raise ValueError(f"{name} must start at 0 and never decrease, got {cu_seqlens.tolist()}")
    if int(cu[-1]) != total:
        raise ValueError(f"{name} ends at {int(cu[-1])} but the packed tensor holds {total} rows")
    return lengths


@overload
def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = ...,
    *,
    causal: bool = ...,
    window: tuple[int, int] | None = ...,
    bias: Bias | torch.Tensor | None = ...,
    softcap: float | None = ...,
    score_mod: ScoreMod | None = ...,
    scale: float | None = ...,
    return_lse: Literal[False] = ...,
    backend: Backend = ...,
) -> torch.Tensor: ...


@overload
def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = ...,
    *,
    causal: bool = ...,
    window: tuple[int, int] | None = ...,
    bias: Bias | torch.Tensor | None = ...,
    softcap: float | None = ...,
    score_mod: ScoreMod | None = ...,
    scale: float | None = ...,
    return_lse: Literal[True],
    backend: Backend = ...,
) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = ...,
    *,
    causal: bool = ...,
    window: tuple[int, int] | None = ...,
    bias: Bias | torch.Tensor | None = ...,
    softcap: float | None = ...,
    score_mod: ScoreMod | None = ...,
    scale: float | None = ...,
    return_lse: bool = ...,
    backend: Backend = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None = None,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    bias: Bias | torch.Tensor | None = None,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: Backend = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed sequences of different lengths (``flash_attn_varlen_func``'s layout).

    Args:
        q: (total_q, H, E) the queries of every sequence, one after another.
        k: (total_k, G, E) keys; H must be a multiple of G (grouped-query attention).
        v: (total_k, G, Ev) values.
        cu_seqlens_q: (docs + 1,) int32 or int64 cumulative query lengths [0, ..., total_q].
        cu_seqlens_k: (docs + 1,) cumulative key lengths; default cu_seqlens_q.
        causal: query i of a sequence with q_len queries and k_len keys sees its keys
            0 .. i + k_len - q_len (bottom-right, as FlashAttention).
        window: (left, right): it sees its keys p - left .. p + right, p = i + k_len - q_len.
        bias, softcap, score_mod, scale, backend: as `qkv.attention`. Position-dependent
            biases (ALiBi, relative) use each sequence's own positions; a dense bias and
            score_mod index the packed rows and columns.
        return_lse: also return the log-sum-exp (H, total_q), float32 or wider (the layout of
            FlashAttention's softmax_lse).

    Returns:
        output (total_q, H, Ev), or (output, lse).

    Example: two sequences of 3 and 2 tokens, causal inside each; the first token of the
    second sequence sees only itself, so its output is its own value:

        >>> import torch, qkv
        >>> q, k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 4)
        >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)
        >>> out = qkv.attention_varlen(q, k, v, cu, causal=True)
        >>> out.shape, torch.allclose(out[3], v[3])
        (torch.Size([5, 2, 4]), True)
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.ndim != 3:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"attention_varlen: {name} must have shape (total, heads, dim), got {got}")
    q_lengths = lengths_from_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    if cu_seqlens_k is None:
        k_lengths = q_lengths
        if k.shape[0] != q.shape[0]:
            raise ValueError(
                f"attention_varlen: k has {k.shape[0]} rows and q {q.shape[0]}; pass cu_seqlens_k for other key lengths"
            )
    else:
        k_lengths = lengths_from_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
        if k_lengths.numel() != q_lengths.numel():
            raise ValueError(
                f"attention_varlen: cu_seqlens_q describes {q_lengths.numel()} sequences, cu_seqlens_k {k_lengths.numel()}"
            )
    mask = varlen(q_lengths, k_lengths, causal=causal, window=window)
    result = attention(
        q.transpose(0, 1).unsqueeze(0),  # (1, H, total_q, E)
        k.transpose(0, 1).unsqueeze(0),  # (1, G, total_k, E)
        v.transpose(0, 1).unsqueeze(0),  # (1, G, total_k, Ev)
        mask, bias=bias, softcap=softcap, score_mod=score_mod, scale=scale, return_lse=return_lse, backend=backend,
    )
    if return_lse:
        out, lse = result
        return out[0].transpose(0, 1), lse[0]  # (total_q, H, Ev), (H, total_q)
    assert isinstance(result, torch.Tensor)
    return result[0].transpose(0, 1)  # (total_q, H, Ev)
