"""Example 4, attention cannot see word order (first article, detail 3; second article's
"狗咬人 / 人咬狗").

Every step of attention uses only the vectors' contents, never their positions. Permuting
the input rows (X -> P X for a permutation matrix P) therefore permutes the output rows the
same way, softmax(P Q K^T P^T) P V = P softmax(Q K^T) V, and each token's new vector is
unchanged. With the apple example's matrices, "我 吃 苹果" and "苹果 吃 我" give every word
the same output: attention alone cannot tell who eats whom.

Adding a positional encoding to X before attention breaks this on purpose. Here it is the
original paper's sinusoidal table, PE(pos, 2i) = sin(pos / 10000^(2i/d)),
PE(pos, 2i+1) = cos(pos / 10000^(2i/d)), computed in NumPy (the same table as
`qkv.nn.positional.SinusoidalEncoding`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.console import Group, RenderableType
from rich.text import Text

from qkv.examples._result import ExampleResult
from qkv.examples._tables import fmt, matrix_table, side_by_side
from qkv.examples.apple import FEATURES, VALUE_AXES, WORDS, SentenceRun, run_sentence
from qkv.reference import Array

__all__ = ["Result", "run", "sinusoidal_table"]

NAME = "permutation"
TITLE = "Attention cannot see order: shuffle the tokens, the outputs shuffle the same way"
SUMMARY = (
    "Permuting the inputs permutes the outputs and leaves each token's new vector unchanged; "
    "adding a positional encoding first makes the order matter."
)

SENTENCE = ("我", "吃", "苹果")
ORDER = (2, 1, 0)  # shuffled sentence i-th token = original token ORDER[i]: 苹果 吃 我
BASE = 10000.0  # the original paper's wavelength base


def sinusoidal_table(length: int, d_model: int) -> Array:
    """PE (length, d_model): PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(same)."""
    positions = np.arange(length, dtype=np.float64)[:, None]  # (L, 1)
    even = np.arange(0, d_model, 2, dtype=np.float64)  # the 2i of each sin/cos pair
    angles = positions / BASE ** (even / d_model)  # (L, ceil(d/2))
    table = np.zeros((length, d_model))
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles[:, : d_model // 2])
    return table


@dataclass(frozen=True)
class Comparison:
    """One sentence and its shuffle; ``max_difference`` = max |out_shuffled - out[order]|."""

    original: SentenceRun
    shuffled: SentenceRun
    max_difference: float

    def render(self, title: str) -> list[RenderableType]:
        order = list(ORDER)
        words = list(self.shuffled.tokens)
        return [
            Text(title, style="bold underline"),
            side_by_side(
                matrix_table(" ".join(self.original.tokens), self.original.trace.output, list(self.original.tokens), VALUE_AXES),
                matrix_table(" ".join(words), self.shuffled.trace.output, words, VALUE_AXES),
                matrix_table("original outputs, reordered", self.original.trace.output[order], words, VALUE_AXES),
            ),
            Text(f"max |difference| per token: {self.max_difference:.3g}\n"),
        ]


@dataclass(frozen=True)
class Result(ExampleResult):
    """Without and with the sinusoidal positional encoding ``positional`` (L, 4)."""

    order: tuple[int, ...]
    positional: Array
    plain: Comparison
    encoded: Comparison

    def headline(self) -> str:
        return (
            f"shuffled: max |difference| {self.plain.max_difference:.1g} without positions, "
            f"{fmt(self.encoded.max_difference)} with sinusoidal positions"
        )

    def render(self) -> RenderableType:
        positions = [str(p) for p in range(len(self.order))]
        return Group(
            *self.plain.render("Without positions: each word's output is unchanged"),
            matrix_table("Sinusoidal positional encoding PE (added to X)", self.positional, positions, FEATURES),
            *self.encoded.render("With X + PE: the same word gets a different output in another place"),
        )


def _compare(x: Array, shuffled_x: Array) -> Comparison:
    original = run_sentence(SENTENCE, x=x)
    shuffled = run_sentence([SENTENCE[i] for i in ORDER], x=shuffled_x)
    difference = np.abs(shuffled.trace.output - original.trace.output[list(ORDER)]).max()
    return Comparison(original=original, shuffled=shuffled, max_difference=float(difference))


def run() -> Result:
    """Shuffle "我 吃 苹果" into "苹果 吃 我", without and then with positional encoding."""
    x = np.array([WORDS[t] for t in SENTENCE])  # (L, 4)
    order = list(ORDER)
    pe = sinusoidal_table(len(SENTENCE), x.shape[1])  # (L, 4)
    return Result(
        order=ORDER,
        positional=pe,
        plain=_compare(x, x[order]),
        # the words move, the positions stay: PE is added after the shuffle
        encoded=_compare(x + pe, x[order] + pe),
    )
