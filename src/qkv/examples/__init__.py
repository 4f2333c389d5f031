"""The seed articles' worked examples, runnable: data, every step, and the printed numbers.

Each example is a module with a ``run()`` that computes every intermediate in float64 with
`qkv.reference` and returns a typed result; the result renders itself as rich tables
(rounded as the articles round) and converts to JSON (unrounded). The registry below keeps
them in the order a reader meets them; `qkv examples [NAME]` runs them from the command line.

    >>> from qkv import examples
    >>> result = examples.get("address-book").run()
    >>> [round(float(w), 3) for w in result.lookups[0].trace.weights[0]]
    [0.691, 0.154, 0.154]

Only `agreement`, `quadratic` and `learned` import PyTorch, inside their ``run()``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from qkv.examples import (
    address_book,
    agreement,
    apple,
    context,
    cross_attention,
    learned,
    multi_head,
    permutation,
    quadratic,
    scaling,
)
from qkv.examples._result import ExampleResult, jsonable

__all__ = ["EXAMPLES", "Example", "ExampleResult", "get", "jsonable", "names"]


@dataclass(frozen=True)
class Example:
    """One worked example: its command-line name, a title, a short explanation and its steps."""

    name: str
    title: str
    summary: str
    run: Callable[[], ExampleResult]


def _example(module: ModuleType) -> Example:
    return Example(name=module.NAME, title=module.TITLE, summary=module.SUMMARY, run=module.run)


EXAMPLES: dict[str, Example] = {
    e.name: e
    for e in map(
        _example,
        (address_book, agreement, apple, scaling, permutation, cross_attention, multi_head, quadratic, context, learned),
    )
}


def names() -> list[str]:
    """The examples' names, in order."""
    return list(EXAMPLES)


def get(name: str) -> Example:
    """The example called ``name``; KeyError naming the valid names otherwise."""
    if name not in EXAMPLES:
        raise KeyError(f"no example named {name!r}; the examples are: {', '.join(EXAMPLES)}")
    return EXAMPLES[name]
