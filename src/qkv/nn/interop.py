"""Interoperability with PyTorch's `nn.MultiheadAttention`: its masks.

Its weights are copied by `qkv.MultiHeadAttention.from_torch`, whose docstring says what
differs and what is refused.

PyTorch's bool masks say True = *ignore*; qkv's say True = *may attend*. Float masks are
added to the scaled scores in both. `masks_from_torch` converts one to the other: PyTorch's
``attn_mask`` (L, S) or (B*H, L, S) and ``key_padding_mask`` (B, S) become one bool or
float tensor that broadcasts to (B, H, L, S).
"""

from __future__ import annotations

import torch

__all__ = ["masks_from_torch"]


def _check_mask(mask: object, name: str) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"masks_from_torch: {name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"masks_from_torch: {name} must be bool (True = ignore) or floating point (added), got {mask.dtype}"
        )
    return mask


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A qkv mask as a float mask: bool True (may attend) -> 0, False -> -inf."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def masks_from_torch(
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    *,
    num_heads: int | None = None,
) -> torch.Tensor | None:
    """Convert `nn.MultiheadAttention`'s masks into one mask for qkv (True = may attend).

    Args:
        attn_mask: (L, S), or (B*H, L, S) per batch row and head (``num_heads`` is then
            required), bool with True = ignore, or float added to the scaled scores.
        key_padding_mask: (B, S), bool with True = ignore (a padding key), or float added.
        num_heads: H, to split the B*H axis of a 3-D attn_mask.

    Returns:
        None when both are None; otherwise a tensor broadcastable to (B, H, L, S) for
        `qkv.attention` and `qkv.MultiHeadAttention`: bool (True = may attend) when both
        masks are bool, else float (a bool part becoming 0 / -inf, then the two added, as
        PyTorch does).

    Example:
        >>> padding = torch.tensor([[False, False, True]])  # PyTorch: the third key is padding
        >>> masks_from_torch(key_padding_mask=padding)[0, 0, 0].tolist()
        [True, True, False]
    """
    parts: list[torch.Tensor] = []
    if attn_mask is not None:
        attn_mask = _check_mask(attn_mask, "attn_mask")
        if attn_mask.ndim == 2:
            part = attn_mask  # (L, S)
        elif attn_mask.ndim == 3:
            if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
                raise ValueError(
                    f"masks_from_torch: a 3-D attn_mask {tuple(attn_mask.shape)} is (B*H, L, S); "
                    f"pass num_heads (a positive int), got {num_heads!r}"
                )
            if attn_mask.shape[0] % num_heads != 0:
                raise ValueError(
                    f"masks_from_torch: attn_mask's first dim {attn_mask.shape[0]} is not a multiple of num_heads={num_heads}"
                )
            part = attn_mask.reshape(-1, num_heads, *attn_mask.shape[1:])  # (B, H, L, S)
        else:
            raise ValueError(f"masks_from_torch: attn_mask must be (L, S) or (B*H, L, S), got {tuple(attn_mask.shape)}")
        parts.append(~part if part.dtype == torch.bool else part)
    if key_padding_mask is not None:
        key_padding_mask = _check_mask(key_padding_mask, "key_padding_mask")
        if key_padding_mask.ndim != 2:
            raise ValueError(f"masks_from_torch: key_padding_mask must be (B, S), got {tuple(key_padding_mask.shape)}")
        part = key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
        parts.append(~part if part.dtype == torch.bool else part)
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    first, second = parts
    if first.shape[-1] != second.shape[-1]:
        raise ValueError(
            f"masks_from_torch: attn_mask has S={first.shape[-1]} keys but key_padding_mask has S={second.shape[-1]}"
        )
    if first.dtype == torch.bool and second.dtype == torch.bool:
        return first & second
    dtype = first.dtype if first.is_floating_point() else second.dtype
    return _additive(first, dtype) + _additive(second, dtype)
