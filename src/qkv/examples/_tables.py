"""Rich tables for the examples, with numbers rounded the way the articles print them.

The articles print three decimals and drop trailing zeros ("3, 1.5, 1.5", "20.086",
"0.807"); `fmt` does the same, so the printed digits can be compared with the text.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike
from rich.columns import Columns
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

__all__ = ["fmt", "matrix_table", "shape", "side_by_side", "table", "vector"]


def fmt(x: float, digits: int = 3) -> str:
    """Round to ``digits`` decimals and drop trailing zeros: 3.0 -> "3", 0.8066 -> "0.807"."""
    text = f"{float(x):.{digits}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def vector(values: ArrayLike, digits: int = 3) -> str:
    """A vector as the articles write it: [0.855, 0.048]."""
    return "[" + ", ".join(fmt(v, digits) for v in np.ravel(values)) + "]"


def shape(array: ArrayLike) -> str:
    """A shape as "(3, 4)"."""
    return str(tuple(np.shape(array)))


def matrix_table(
    title: str,
    matrix: ArrayLike,
    rows: Sequence[str],
    columns: Sequence[str],
    digits: int = 3,
    corner: str = "",
) -> RenderableType:
    """A title line over a table with one cell per matrix entry, rows and columns labelled."""
    array = np.atleast_2d(np.asarray(matrix, dtype=np.float64))
    if array.shape != (len(rows), len(columns)):
        raise ValueError(f"{title}: matrix of shape {array.shape} does not fit {len(rows)} x {len(columns)} labels")
    cells = [[label, *(fmt(v, digits) for v in row)] for label, row in zip(rows, array, strict=True)]
    grid = table([corner, *columns], cells, numeric=True)
    # A separate title line: a table title would wrap to the width of a narrow table.
    return Group(Text(title, style="italic"), grid)


def table(columns: Sequence[str], rows: Sequence[Sequence[str]], numeric: bool = False) -> Table:
    """A plain table; cells are text, never rich markup (so "[1, 0]" prints as written).

    ``numeric``: right-align every column but the first (the row labels).
    """
    grid = Table(show_edge=False)
    for i, column in enumerate(columns):
        right = numeric and i > 0
        grid.add_column(Text(column), justify="right" if right else "left", style="bold" if numeric and i == 0 else None)
    for row in rows:
        grid.add_row(*(Text(cell) for cell in row))
    return grid


def side_by_side(*parts: RenderableType) -> Columns:
    """Small tables next to each other, wrapping to the terminal width."""
    return Columns(parts, padding=(0, 4))
