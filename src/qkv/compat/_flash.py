"""`flash_attn_func`: FlashAttention 2's ``flash_attn_func`` (``flash_attn_interface.py``) on
qkv's dispatcher.

Layout (batch_size, seqlen, nheads, headdim) = (B, L, H, E) for q and (B, S, G, E) for k and
v, G dividing H (query head h reads key/value head h // (H // G)). Semantics, from its
docstring: ``causal`` aligns bottom-right (FlashAttention >= 2.1: query i sees keys j <=
i + S - L, a row with none gives zeros: `qkv.masks.causal`); ``window_size=(left, right)``
lets query i see i + S - L - left .. i + S - L + right, -1 meaning unbounded on that side,
and with ``causal`` the right side is 0; ``softcap=0.0`` means no cap, otherwise
softcap * tanh(s / softcap) on the scaled score s; ``alibi_slopes`` (H,) or (B, H) adds
-slope * |i + S - L - j|. ``deterministic`` is accepted: every qkv path is deterministic.
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from qkv.attention.functional import attention
from qkv.compat._alibi import alibi_from_slopes
from qkv.compat._args import check_flag, flash_mask, flash_softcap, real_number, tensor_of_rank

__all__ = ["flash_attn_func"]

_LAYOUT_Q = "(batch_size, seqlen, nheads, headdim)"
_LAYOUT_KV = "(batch_size, seqlen_k, nheads_k, headdim)"


@overload
def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = ...,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    alibi_slopes: torch.Tensor | None = ...,
    deterministic: bool = ...,
    return_attn_probs: Literal[False] = ...,
) -> torch.Tensor: ...


@overload
def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = ...,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    alibi_slopes: torch.Tensor | None = ...,
    deterministic: bool = ...,
    *,
    return_attn_probs: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


@overload
def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = ...,
    softmax_scale: float | None = ...,
    causal: bool = ...,
    window_size: tuple[int, int] = ...,
    softcap: float = ...,
    alibi_slopes: torch.Tensor | None = ...,
    deterministic: bool = ...,
    return_attn_probs: bool = ...,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention's ``flash_attn_func``, computed by `qkv.attention`.

    Args:
        q: (B, L, H, E).
        k: (B, S, G, E), H a multiple of G.
        v: (B, S, G, Ev).
        dropout_p: probability of dropping a weight (pass 0.0 in evaluation, as FlashAttention says).
        softmax_scale: factor of q k^T; default 1 / sqrt(E).
        causal: bottom-right causal mask (query i sees keys j <= i + S - L).
        window_size: (left, right), -1 = unbounded; query i sees keys
            i + S - L - left .. i + S - L + right.
        softcap: 0.0 = none; > 0 caps the scaled scores at +-softcap (tanh).
        alibi_slopes: None, (H,) or (B, H) float: adds -slope * |i + S - L - j|.
        deterministic: accepted for the signature; qkv's paths are always deterministic.
        return_attn_probs: also return softmax_lse and the attention probabilities.

    Returns:
        out (B, L, H, Ev), contiguous, in q's dtype; with ``return_attn_probs`` the tuple
        (out, softmax_lse (B, H, L), probs (B, H, L, S)). softmax_lse is float32 (float64 for
        float64 inputs); a row that sees no key has lse -inf (and a zero output row).
        FlashAttention's third value (S_dmask) is "for testing only": an empty tensor unless
        dropout_p > 0, and then probabilities padded to multiples of 128 with dropped entries
        negated. qkv returns instead the exact probabilities that produced ``out``, unpadded
        (after dropout when dropout_p > 0: dropped entries 0, kept ones divided by 1 - dropout_p).

    Example (the one-line switch from ``flash_attn.flash_attn_func``):
        >>> import torch
        >>> from qkv.compat import flash_attn_func
        >>> q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 7, 2, 8), torch.randn(2, 7, 2, 8)
        >>> out = flash_attn_func(q, k, v, causal=True, window_size=(3, -1))
        >>> out.shape
        torch.Size([2, 5, 4, 8])
    """
    q = tensor_of_rank(q, 4, "q", _LAYOUT_Q)
    k = tensor_of_rank(k, 4, "k", _LAYOUT_KV)
    v = tensor_of_rank(v, 4, "v", _LAYOUT_KV)
    check_flag(deterministic, "deterministic")
    want_probs = check_flag(return_attn_probs, "return_attn_probs")
    B, L, H, _ = q.shape
    mask = flash_mask(causal, window_size, L, k.shape[1])
    result = attention(
        q.transpose(1, 2),  # (B, H, L, E)
        k.transpose(1, 2),  # (B, G, S, E)
        v.transpose(1, 2),  # (B, G, S, Ev)
        mask,
        bias=alibi_from_slopes(alibi_slopes, B, H),
        softcap=flash_softcap(softcap),
        scale=softmax_scale,
        dropout=real_number(dropout_p, "dropout_p"),
        return_weights=want_probs,
        return_lse=want_probs,
    )
    if not want_probs:
        assert isinstance(result, torch.Tensor)
        return result.transpose(1, 2).contiguous()  # (B, L, H, Ev)
    out, probs, lse = result
    return out.transpose(1, 2).contiguous(), lse, probs  # (B, L, H, Ev), (B, H, L), (B, H, L, S)
