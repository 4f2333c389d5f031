"""Interoperability with PyTorch's `nn.MultiheadAttention`: its weights and its masks.

`multi_head_from_torch` (also `qkv.MultiHeadAttention.from_torch`) copies the weights of an
`nn.MultiheadAttention` into a `qkv.MultiHeadAttention` that computes the same outputs:

    theirs = nn.MultiheadAttention(D, H, batch_first=True)
    ours = qkv.MultiHeadAttention.from_torch(theirs)
    theirs(x, x, x, need_weights=False)[0]  ==  ours(x)
    theirs(x, c, c, need_weights=False)[0]  ==  ours(x, c)     (kdim == vdim == c's width)

What differs and what is refused:
- The layout follows ``batch_first``: a module with ``batch_first=False`` (PyTorch's
  default) becomes a qkv module with ``batch_first=False`` that takes and returns (L, B, D)
  tensors, as the original does.
- qkv reads keys and values from one context, so ``kdim != vdim`` is refused, and calls with
  different ``key`` and ``value`` tensors have no equivalent.
- ``add_bias_kv`` and ``add_zero_attn`` (extra learned / zero key positions) are refused.
- PyTorch's weights are averaged over heads by default (B, L, S); qkv returns them per head
  (B, H, L, S): ``weights.mean(dim=1)`` gives PyTorch's.
- A query row whose keys are all masked gives NaN in PyTorch (need_weights=True and its
  inference path) and an attention output of zeros in qkv (DESIGN.md), so the layer returns
  ``out_proj``'s bias there.

Masks: PyTorch's bool masks say True = *ignore*; qkv's say True = *may attend*. Float masks
are added to the scaled scores in both. `masks_from_torch` converts one to the other.

Layout of PyTorch's weights: when kdim == vdim == embed_dim, q, k and v projections are
packed in ``in_proj_weight`` (3D, D) as rows [W_q; W_k; W_v]; otherwise they are separate
``q_proj_weight`` (D, D), ``k_proj_weight`` (D, kdim), ``v_proj_weight`` (D, vdim). The bias
is always packed in ``in_proj_bias`` (3D,). Head h owns rows [h*D/H, (h+1)*D/H) of each,
the same convention as qkv's projections.
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.modules import MultiHeadAttention

__all__ = ["masks_from_torch", "multi_head_from_torch"]


def multi_head_from_torch(module: nn.MultiheadAttention) -> MultiHeadAttention:
    """A `qkv.MultiHeadAttention` with ``module``'s weights, dtype, device, dropout and mode.

    Raises TypeError for anything but an `nn.MultiheadAttention`, and ValueError for the
    configurations qkv cannot reproduce (see the module docstring).
    """
    if not isinstance(module, nn.MultiheadAttention):
        raise TypeError(f"from_torch takes a torch.nn.MultiheadAttention, got {type(module).__name__}")
    if module.bias_k is not None or module.bias_v is not None:
        raise ValueError("from_torch: nn.MultiheadAttention(add_bias_kv=True) is not supported by qkv")
    if module.add_zero_attn:
        raise ValueError("from_torch: nn.MultiheadAttention(add_zero_attn=True) is not supported by qkv")
    if module.kdim != module.vdim:
        raise ValueError(
            f"from_torch: kdim={module.kdim} != vdim={module.vdim}; qkv reads keys and values from "
            "one context, so their widths must be equal"
        )
    D, H = module.embed_dim, module.num_heads
    if module._qkv_same_embed_dim:
        w_q, w_k, w_v = module.in_proj_weight.chunk(3, dim=0)  # (D, D) each
    else:
        w_q, w_k, w_v = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight  # (D, D), (D, kdim), (D, vdim)
    has_bias = module.in_proj_bias is not None
    if has_bias != (module.out_proj.bias is not None):
        raise ValueError("from_torch: in_proj_bias and out_proj.bias must both exist or both be None")
    ours = MultiHeadAttention(
        D, H, d_context=module.kdim, bias=has_bias, dropout=float(module.dropout), batch_first=bool(module.batch_first)
    )
    ours.to(device=w_q.device, dtype=w_q.dtype)
    with torch.no_grad():
        ours.q_proj.weight.copy_(w_q)
        ours.k_proj.weight.copy_(w_k)
        ours.v_proj.weight.copy_(w_v)
        ours.out_proj.weight.copy_(module.out_proj.weight)
        if has_bias:
            b_q, b_k, b_v = module.in_proj_bias.chunk(3)  # (D,) each
            ours.q_proj.bias.copy_(b_q)
            ours.k_proj.bias.copy_(b_k)
            ours.v_proj.bias.copy_(b_v)
            ours.out_proj.bias.copy_(module.out_proj.bias)
    ours.train(module.training)
    return ours


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
