"""Checks of user arguments shared across qkv, so that one kind of bad value reads the same everywhere."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["broadcasts", "positive_int", "size_broadcasts"]


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


def size_broadcasts(size: int, target: int) -> bool:
    """Whether one dimension of ``size`` broadcasts to ``target``: 1 or equal.

    Two ``==``, never ``size in (1, target)``: while torch.compile traces with
    ``dynamic=True``, Dynamo in PyTorch 2.10 to 2.13 takes ``4 not in (1, H)`` as true for a
    symbolic H that is 4 (``4 not in (None, H)`` too; 2.14 and 2.15 answer right), and would
    raise on a valid input. qkv writes every check of a size that may be symbolic this way.

    >>> size_broadcasts(1, 7), size_broadcasts(7, 7), size_broadcasts(3, 7)
    (True, True, False)
    """
    return size == 1 or size == target


def broadcasts(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target``: no more dimensions, and each
    trailing size 1 or the target's.

    A plain loop over indices, of ``!=``, because it runs while torch.compile traces, where
    sizes may be symbolic: Dynamo in PyTorch 2.7 to 2.9 cannot follow ``any()`` over a
    generator there, 2.9's treats ``zip(..., strict=False)`` of unequal lengths as an error,
    and 2.10 to 2.13 answer ``in`` wrongly on symbolic sizes (`size_broadcasts`).

    >>> broadcasts((1, 4), (2, 3, 4))
    True
    >>> broadcasts((3, 1), (2, 4, 1))
    False
    """
    skipped = len(target) - len(shape)  # the target's leading dimensions that shape lacks
    if skipped < 0:
        return False
    for i in range(len(shape)):  # noqa: SIM110  (a loop, not all() over a generator: see above)
        if not size_broadcasts(shape[i], target[skipped + i]):
            return False
    return True
