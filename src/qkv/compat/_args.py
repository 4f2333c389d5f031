"""Argument checks shared by the drop-ins: flags, FlashAttention's window and softcap, layouts.

Each drop-in takes its peer's arguments; these turn them into qkv's (a `qkv.masks` object,
``softcap=None`` for "off") or raise a ValueError / TypeError that names the argument, before
any work. FlashAttention's conventions (``flash_attn_interface.py``): ``window_size=(-1, -1)``
means no window, -1 on one side means that side is unbounded; ``softcap=0.0`` means no cap;
``causal=True`` keeps the window's left side and sets its right side to 0.
"""

from __future__ import annotations

import math
import numbers

import torch

from qkv import masks

__all__ = ["check_flag", "flash_mask_options", "flash_softcap", "flash_window", "real_number", "tensor_of_rank"]


def check_flag(value: object, name: str) -> bool:
    """``value`` when it is a bool (TypeError otherwise: a flag given a tensor or a string is a slip)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def real_number(value: object, name: str) -> float:
    """A Python, NumPy or one-element-tensor real number as a float (TypeError otherwise)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a real number, got a {value.dtype} tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def tensor_of_rank(x: object, rank: int, name: str, layout: str) -> torch.Tensor:
    """x when it is a tensor with ``rank`` dims; ValueError naming the expected ``layout`` otherwise."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.ndim != rank:
        raise ValueError(f"{name} must have the layout {layout}, got shape {tuple(x.shape)}")
    return x


def flash_softcap(softcap: object) -> float | None:
    """FlashAttention's softcap: 0.0 means none, a positive finite number caps the scores."""
    value = real_number(softcap, "softcap")
    if value == 0.0:
        return None
    if not (0.0 < value < math.inf):
        raise ValueError(f"softcap must be 0.0 (no cap) or a positive finite number, got {softcap!r}")
    return value


def flash_window(window_size: object) -> tuple[int | None, int | None]:
    """(left, right) with None for an unbounded side (FlashAttention's -1)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints, -1 meaning unbounded; got {window_size!r}")
    sides: list[int | None] = []
    for name, side in zip(("left", "right"), window_size, strict=True):
        if isinstance(side, bool) or not isinstance(side, int):
            raise TypeError(f"window_size {name} must be an int, got {type(side).__name__} {side!r}")
        if side < -1:
            raise ValueError(f"window_size {name} must be -1 (unbounded) or >= 0, got {side}")
        sides.append(None if side == -1 else side)
    return sides[0], sides[1]


def flash_mask_options(causal: object, window_size: object, reach: int) -> tuple[bool, tuple[int, int] | None]:
    """FlashAttention's causal / window_size as (causal, window) for `qkv.masks.varlen` / `padded`.

    ``reach`` stands for an unbounded side: a distance no query needs to look beyond (the
    largest of L and S will do). With ``causal`` the right side is 0, as FlashAttention sets it.
    """
    causal = check_flag(causal, "causal")
    left, right = flash_window(window_size)
    if causal:
        right = 0
    if left is None and (right is None or causal):
        return causal, None
    return causal, (reach if left is None else left, reach if right is None else right)


def flash_mask(causal: object, window_size: object, L: int, S: int) -> masks.Mask | None:
    """FlashAttention's causal / window_size on one (L, S) problem, aligned bottom-right, as a qkv mask."""
    is_causal, window = flash_mask_options(causal, window_size, max(L, S))
    if window is not None:
        return masks.sliding_window(window[0], window[1])
    return masks.causal() if is_causal else None
