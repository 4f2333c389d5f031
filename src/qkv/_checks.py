"""Checks of user arguments shared across qkv, so that one kind of bad value reads the same everywhere."""

from __future__ import annotations

__all__ = ["positive_int"]


def positive_int(value: object, name: str) -> int:
    """``value`` when it is an int >= 1 (a bool is not), else a ValueError naming ``name`` and the value.

    >>> positive_int(3, "heads")
    3
    >>> positive_int(True, "heads")
    Traceback (most recent call last):
    ...
    ValueError: heads must be a positive int, got True
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value
