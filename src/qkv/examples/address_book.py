"""Example 1, the first article's address book: attention as a soft dictionary lookup.

The book has three records. A key says what a record is about, over four features
[about Zhang San, about Li Si, is address, is phone]; a value is what the record hands
over, one-hot over the three answers [Xi'an, 138xxxx, Beijing]:

    record                 key            value
    Zhang San's address    [1, 0, 1, 0]   [1, 0, 0]   Xi'an
    Zhang San's phone      [1, 0, 0, 1]   [0, 1, 0]   138xxxx
    Li Si's address        [0, 1, 1, 0]   [0, 0, 1]   Beijing

"Where does Zhang San live?" is q = [3, 0, 3, 0]: about Zhang San and is address, each with
strength 3. The article prints what this q gives and nothing else pins it down: raw scores
q.k = 6, 3, 3; divided by sqrt(d_k) = sqrt(4) = 2 they are 3, 1.5, 1.5; the exponentials
20.086, 4.482, 4.482 sum to 29.049; the weights 0.691, 0.154, 0.154 give an answer that is
69 % Xi'an with a little phone number and Beijing. The second question keeps K and V and
asks for Zhang San's phone, q = [3, 0, 0, 3].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from rich.console import Group, RenderableType
from rich.text import Text

from qkv import reference
from qkv.examples._result import ExampleResult
from qkv.examples._tables import fmt, matrix_table, table, vector
from qkv.reference import Array, Trace

__all__ = ["Lookup", "Result", "lookup", "run"]

NAME = "address-book"
TITLE = "The address book: attention as a soft dictionary lookup"
SUMMARY = (
    "A question (query) is matched against each record's label (key); softmax turns the "
    "matches into weights, and the answer is the values mixed by those weights."
)

KEY_FEATURES = ("about Zhang San", "about Li Si", "is address", "is phone")
RECORDS = ("Zhang San's address", "Zhang San's phone", "Li Si's address")
ANSWERS = ("Xi'an", "138xxxx", "Beijing")
KEYS = np.array(
    [
        [1.0, 0.0, 1.0, 0.0],  # Zhang San's address
        [1.0, 0.0, 0.0, 1.0],  # Zhang San's phone
        [0.0, 1.0, 1.0, 0.0],  # Li Si's address
    ]
)  # (S=3, E=4)
VALUES = np.eye(3)  # (S=3, Ev=3): record i hands over answer i
QUESTIONS: tuple[tuple[str, tuple[float, ...]], ...] = (
    ("Where does Zhang San live?", (3.0, 0.0, 3.0, 0.0)),
    ("What is Zhang San's phone number?", (3.0, 0.0, 0.0, 3.0)),
)


@dataclass(frozen=True)
class Lookup:
    """One question asked of the book, with every step.

    trace holds q (1, 4), k (3, 4), v (3, 3), scores, scaled, weights (1, 3), output (1, 3);
    exponentials (3,) are exp(scaled) before normalization and total is their sum, the
    article's 20.086, 4.482, 4.482 and 29.049.
    """

    question: str
    trace: Trace
    exponentials: Array
    total: float

    @property
    def answer(self) -> str:
        """The answer with the largest share of the output."""
        return ANSWERS[int(np.argmax(self.trace.output[0]))]


@dataclass(frozen=True)
class Result(ExampleResult):
    """The book (keys, values) and each question's lookup."""

    key_features: tuple[str, ...]
    records: tuple[str, ...]
    answers: tuple[str, ...]
    keys: Array
    values: Array
    lookups: tuple[Lookup, ...]

    def headline(self) -> str:
        first = self.lookups[0]
        shares = ", ".join(f"{fmt(100 * w, 1)}% {a}" for w, a in zip(first.trace.output[0], self.answers, strict=True))
        return f"{first.question} -> {shares}"

    def render(self) -> RenderableType:
        legend = (
            f"The book. key: [{', '.join(self.key_features)}]; "
            f"value: one-hot [{', '.join(self.answers)}]"
        )
        book = table(
            ["record", "key", "value"],
            [[r, vector(k), vector(v)] for r, k, v in zip(self.records, self.keys, self.values, strict=True)],
        )
        parts: list[RenderableType] = [Text(legend, style="italic"), book]
        for item in self.lookups:
            parts.extend(_render_lookup(item, self))
        return Group(*parts)


def _render_lookup(item: Lookup, book: Result) -> list[RenderableType]:
    t = item.trace
    d_k = t.q.shape[-1]
    rows = [
        [record, fmt(t.scores[0, j]), fmt(t.scaled[0, j]), fmt(item.exponentials[j]), fmt(t.weights[0, j])]
        for j, record in enumerate(book.records)
    ]
    rows.append(["sum", "", "", fmt(item.total), fmt(t.weights[0].sum())])
    steps = table(["record", "1. score q.k", f"2. / sqrt({d_k})", "3. exp", "softmax weight"], rows, numeric=True)
    output = matrix_table("4. output = weights @ V", t.output, ["answer"], book.answers)
    shares = ", ".join(f"{fmt(100 * w, 0)}% {a}" for w, a in zip(t.output[0], book.answers, strict=True))
    return [
        Text(f"{item.question}  q = {vector(t.q[0])}", style="bold underline"),
        steps,
        output,
        Text(f"-> {shares}: mostly {item.answer}.\n"),
    ]


def lookup(question: str, q: tuple[float, ...]) -> Lookup:
    """Ask the book one question; every step from `qkv.reference`."""
    trace = reference.attention(np.asarray([q]), KEYS, VALUES)  # q (1, 4) -> output (1, 3)
    # The article shows exp of the scaled scores themselves, before any max-shift.
    exponentials = np.exp(trace.scaled[0])  # (3,)
    return Lookup(question=question, trace=trace, exponentials=exponentials, total=float(exponentials.sum()))


def run() -> Result:
    """Both questions of the article's address book."""
    return Result(
        key_features=KEY_FEATURES,
        records=RECORDS,
        answers=ANSWERS,
        keys=KEYS,
        values=VALUES,
        lookups=tuple(lookup(question, q) for question, q in QUESTIONS),
    )
