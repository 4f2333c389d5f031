"""`scaled_dot_product_attention`: PyTorch's ``torch.nn.functional.scaled_dot_product_attention``
on qkv's dispatcher.

Semantics are SDPA's (its documentation, PyTorch 2.5+): inputs (..., L, E), (..., S, E),
(..., S, Ev), every leading dim broadcast; a bool ``attn_mask`` says True = take part in
attention, a float one is added to the scaled scores; ``is_causal`` is top-left (query i sees
keys 0..i, whatever L and S: ``qkv.masks.causal(align="top-left")``), and passing it with an
``attn_mask`` is an error; ``enable_gqa`` lets key/value have fewer heads (head h reads h //
(H // G)). What qkv adds: the call runs on `qkv.attention`'s paths (a structured top-left
causal mask reaches the block engine), and a row that sees no key gives zeros, as SDPA's math
path does since PyTorch 2.5.
"""

from __future__ import annotations

import torch

from qkv.attention.functional import attention
from qkv.compat._args import check_flag, real_number
from qkv.masks import causal

__all__ = ["scaled_dot_product_attention"]


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """SDPA's signature and semantics, computed by `qkv.attention`.

    Args:
        query: (..., H, L, E) (or (L, E)).
        key: (..., G, S, E); G = H, or G = 1 (broadcast), or with ``enable_gqa`` any divisor of H.
        value: (..., G, S, Ev).
        attn_mask: None, a bool tensor broadcastable to (..., H, L, S) with True = take part
            in attention, or a float tensor added to the scaled scores (-inf hides a key).
        dropout_p: probability of dropping a weight, applied whenever > 0 (as SDPA; pass 0.0
            in evaluation). Must be below 1.
        is_causal: query i sees keys 0..i (top-left, SDPA's convention, unlike qkv's
            bottom-right ``causal()``). An error together with ``attn_mask``.
        scale: factor of q k^T; default 1 / sqrt(E).
        enable_gqa: allow G to divide H (grouped-query attention); without it G must be H or 1.

    Returns:
        (..., H, L, Ev) in query's dtype.

    Example (the one-line switch from ``F.scaled_dot_product_attention``):
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from qkv.compat import scaled_dot_product_attention
        >>> q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
        >>> out = scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
        True
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"scaled_dot_product_attention: {name} must be a torch.Tensor, got {type(x).__name__}")
    if check_flag(is_causal, "is_causal") and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: pass attn_mask or is_causal=True, not both (as SDPA)")
    check_flag(enable_gqa, "enable_gqa")
    dropout = real_number(dropout_p, "dropout_p")
    if query.ndim == 2 and key.ndim == 2 and value.ndim == 2:  # (L, E): one head without batch
        out = scaled_dot_product_attention(
            query[None], key[None], value[None], attn_mask, dropout, is_causal, scale, enable_gqa
        )
        return out[0]  # (L, Ev)
    if query.ndim >= 3 and key.ndim >= 3:
        H, G = query.shape[-3], key.shape[-3]
        if not enable_gqa and G not in (H, 1):
            raise ValueError(
                f"scaled_dot_product_attention: query has {H} heads and key {G}; pass enable_gqa=True "
                "for grouped-query attention (as SDPA)"
            )
    mask = causal(align="top-left") if is_causal else attn_mask
    out = attention(query, key, value, mask, scale=scale, dropout=dropout)
    assert isinstance(out, torch.Tensor)
    return out
