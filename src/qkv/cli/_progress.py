"""Progress bars for the `qkv` commands that take a while: one rich bar on stderr, drawn only
where someone watches it.

A bar is drawn when stderr is a terminal and the command was not given ``--quiet`` or
``--json``; it is transient (it leaves no line behind), so the output on stdout is the same
with and without it. Redirected to a file or a pipe, stderr stays silent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from qkv.cli import _app

__all__ = ["QuietOption", "progress"]

QuietOption = Annotated[bool, typer.Option("--quiet", help="No progress bar on stderr.")]


@contextmanager
def progress(what: str, total: int, *, shown: bool = True, console: Console | None = None) -> Iterator[Callable[..., None]]:
    """Yield ``report(done, step="")``, which moves a bar of ``total`` steps labelled ``what``
    (and the name of the step running now, when given).

    ``shown``: False for --quiet / --json. The bar is drawn only when ``console`` (default:
    the CLI's stderr) is a terminal; otherwise ``report`` does nothing.
    """
    console = _app.err_console if console is None else console
    if not shown or not console.is_terminal or total < 1:
        yield lambda done, step="": None
        return
    columns = (
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task(what, total=total)

        def report(done: int, step: str = "") -> None:
            bar.update(task, completed=done, description=f"{what}: {step}" if step else what)

        yield report
