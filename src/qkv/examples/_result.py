"""What every worked example returns: a typed result that can render itself and become JSON.

A result holds every intermediate in float64 (NumPy arrays, `qkv.reference.Trace`s, plain
numbers). `render()` rounds them the way the articles print them; `to_json()` keeps them
unrounded, as nested lists, so a learner can check any number with another tool.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
from rich.console import RenderableType

__all__ = ["ExampleResult", "jsonable"]


class ExampleResult(ABC):
    """Base of the examples' result dataclasses."""

    @abstractmethod
    def render(self) -> RenderableType:
        """Every step as rich tables and sentences, rounded as the articles round."""

    @abstractmethod
    def headline(self) -> str:
        """One line with the example's main finding (what `qkv tour --quiet` prints)."""

    def to_json(self) -> dict[str, Any]:
        """Every field, unrounded, as JSON-compatible values."""
        value = jsonable(self)
        assert isinstance(value, dict)
        return value


def _number(x: float) -> float | str:
    # Strict JSON has no inf/nan; spell them as strings rather than emit invalid JSON.
    return x if math.isfinite(x) else str(x)


def jsonable(value: Any) -> Any:
    """Convert dataclasses, NumPy arrays and scalars, tuples and dicts to JSON-compatible data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return _number(float(value))
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"cannot convert {type(value).__name__} to JSON")
