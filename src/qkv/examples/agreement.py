"""The address book through three implementations: `qkv.reference` (NumPy, the article's
steps one by one), `qkv.attention` (each of its PyTorch paths) and PyTorch's own
`torch.nn.functional.scaled_dot_product_attention`, all in float64.

Both of the book's questions go in as one batch of L = 2 queries: q (1, 1, 2, 4),
k (1, 1, 3, 4), v (1, 1, 3, 3). The three must give the same outputs (and qkv the same
weights) to rounding error, about 1e-16.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Group, RenderableType
from rich.text import Text

from qkv.examples import address_book
from qkv.examples._result import ExampleResult
from qkv.examples._tables import table, vector
from qkv.reference import Array

__all__ = ["Agreement", "PathOutput", "run"]

NAME = "agreement"
TITLE = "The address book through three implementations: qkv.reference, qkv.attention, PyTorch's SDPA"
SUMMARY = (
    "The book's two questions as one batch, in float64, through the NumPy reference, each of "
    "qkv.attention's paths and torch's scaled_dot_product_attention: all give the same answer."
)


@dataclass(frozen=True)
class PathOutput:
    """One implementation's output (2, 3) and, when it returns them, weights (2, 3)."""

    name: str
    output: Array
    weights: Array | None
    max_difference: float  # max |output - reference output|, and of the weights when present


@dataclass(frozen=True)
class Agreement(ExampleResult):
    """The reference's output and weights, and every other path compared with them."""

    questions: tuple[str, ...]
    reference_output: Array
    reference_weights: Array
    paths: tuple[PathOutput, ...]

    @property
    def max_difference(self) -> float:
        return max(p.max_difference for p in self.paths)

    def to_json(self) -> dict[str, Any]:
        return super().to_json() | {"max_difference": self.max_difference}

    def headline(self) -> str:
        names = ", ".join(p.name for p in self.paths)
        return f"qkv.reference, {names} agree to {self.max_difference:.1g} (float64)"

    def render(self) -> RenderableType:
        legend = "; ".join(f"q{i + 1}: {q}" for i, q in enumerate(self.questions))
        rows = [["qkv.reference", *(vector(o) for o in self.reference_output), ""]]
        rows += [[p.name, *(vector(o) for o in p.output), f"{p.max_difference:.1g}"] for p in self.paths]
        columns = ["implementation", *(f"q{i + 1} output" for i in range(len(self.questions))), "max |diff|"]
        return Group(
            Text(f"The address book through three implementations, float64 ({legend})", style="italic"),
            table(columns, rows),
            Text(f"All agree with the reference to {self.max_difference:.1g}.\n"),
        )


def run() -> Agreement:
    """Run the book's two questions through the reference, qkv.attention and SDPA."""
    import torch
    import torch.nn.functional as F

    from qkv import reference
    from qkv.attention.functional import attention

    questions = np.array([q for _, q in address_book.QUESTIONS])  # (2, 4)
    expected = reference.attention(questions, address_book.KEYS, address_book.VALUES)
    q, k, v = (
        torch.tensor(a, dtype=torch.float64)[None, None]
        for a in (questions, address_book.KEYS, address_book.VALUES)
    )  # (1, 1, 2, 4), (1, 1, 3, 4), (1, 1, 3, 3)

    def compare(name: str, output: torch.Tensor, weights: torch.Tensor | None) -> PathOutput:
        out = output[0, 0].numpy()  # (2, 3)
        w = None if weights is None else weights[0, 0].numpy()  # (2, 3)
        difference = np.abs(out - expected.output).max()
        if w is not None:
            difference = max(difference, np.abs(w - expected.weights).max())
        return PathOutput(name=name, output=out, weights=w, max_difference=float(difference))

    paths = []
    for backend in ("auto", "fused", "math"):
        out, weights = attention(q, k, v, backend=backend, return_weights=True)
        paths.append(compare(f"qkv {backend}", out, weights))
    paths.append(compare("torch SDPA", F.scaled_dot_product_attention(q, k, v), None))
    return Agreement(
        questions=tuple(question for question, _ in address_book.QUESTIONS),
        reference_output=expected.output,
        reference_weights=expected.weights,
        paths=tuple(paths),
    )
