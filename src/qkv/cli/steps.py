"""`qkv inspect TEXT --token WORD --steps`: the seeds' four steps on one head of the real model.

The tables are those of `qkv examples address-book`, with the model's tokens as the records:
for every key, 1. the score q.k, 2. the score times the scale (1 / sqrt(d_k)), 3. its
exponential, then the softmax weight (the exponential's share of the row's total) and what the
key's value brings to the output (weight x v, its length). Long texts show the keys with the
largest weights; ``--json`` prints every number of the trace, unrounded.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rich.console import Group, RenderableType
from rich.text import Text

from qkv.examples._result import jsonable
from qkv.examples._tables import fmt, table

if TYPE_CHECKING:
    from qkv.inspect.inspection import Inspection
    from qkv.inspect.steps import StepTrace

__all__ = ["MAX_ROWS", "render_steps", "steps_json"]

MAX_ROWS = 16  # texts with more keys show only the keys with the largest weights


def _scale_label(scale: float, width: int) -> str:
    """"/ sqrt(32)" when the scale is the seeds' 1 / sqrt(d_k), else "x 0.125"."""
    return f"/ sqrt({width})" if math.isclose(scale, 1 / math.sqrt(width), rel_tol=1e-9) else f"x {fmt(scale, 4)}"


def steps_json(inspection: Inspection, trace: StepTrace) -> dict[str, Any]:
    """Every field of the trace, unrounded, with the tokens it refers to."""
    return {"token": inspection.tokens[trace.query], "keys": list(inspection.tokens), **jsonable(trace)}


def render_steps(inspection: Inspection, trace: StepTrace, word: str) -> RenderableType:
    """The four steps of ``trace`` as the address book prints them."""
    tokens = inspection.tokens
    T, E = len(tokens), trace.q.shape[0]
    lengths = [float(math.sqrt(sum(x * x for x in row))) for row in trace.contributions]
    shown = list(range(T))
    if T > MAX_ROWS:
        shown = sorted(range(T), key=lambda j: -trace.weights[j])[:MAX_ROWS]
    shift = f" - {fmt(trace.shift)}" if trace.shift else ""
    rows = [
        [
            f"{j} {tokens[j]}",
            fmt(trace.scores[j]),
            fmt(trace.scaled[j]),
            fmt(trace.exponentials[j]),
            fmt(trace.weights[j]),
            fmt(lengths[j]),
        ]
        for j in shown
    ]
    if len(shown) < T:
        rest = [j for j in range(T) if j not in set(shown)]
        rows.append([
            f"{len(rest)} other keys", "", "",
            fmt(sum(trace.exponentials[j] for j in rest)), fmt(sum(trace.weights[j] for j in rest)), "",
        ])
    rows.append(["sum", "", "", fmt(trace.total), fmt(trace.weights.sum()), ""])
    columns = [
        "key",
        "1. q.k",
        f"2. {_scale_label(trace.scale, E)}",
        f"3. exp{'(x' + shift + ')' if shift else ''}",
        "softmax",
        "|weight v|",
    ]
    note = f"the {len(shown)} keys with the largest weights of {T}; --json has all" if len(shown) < T else f"all {T} keys"
    output_length = float(math.sqrt(sum(x * x for x in trace.output)))
    top = ",  ".join(f"{tokens[j]} {fmt(lengths[j])}" for j in trace.largest[:3])
    title = (
        f"layer {trace.layer} head {trace.head}: query token {trace.query} {tokens[trace.query]!r} "
        f"(from {word!r}), d_k = {E}; {note}"
    )
    return Group(
        Text(title, style="bold underline"),
        table(columns, rows, numeric=True),
        Text(
            f"4. output = weights @ V: a vector of {trace.output.shape[0]} numbers, length {fmt(output_length)}; "
            f"the largest parts come from {top}."
        ),
    )
