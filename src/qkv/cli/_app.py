"""The typer application that every `qkv` subcommand registers on, and the CLI's error rule.

Commands import their heavy dependencies (PyTorch, the model) inside the command body, so
that `qkv --help` stays instant.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.text import Text

app = typer.Typer(
    name="qkv",
    help="Attention as the seed articles teach it: worked examples, a real model's attention, benchmarks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

console = Console()
err_console = Console(stderr=True)

USAGE_ERROR = 2


def fail(message: str, code: int = USAGE_ERROR) -> NoReturn:
    """Print a clear message to stderr and exit (2 = usage error) instead of a traceback."""
    # Text, not markup: the message quotes user input (paths, texts, names) that may hold "[".
    err_console.print(
        Text.assemble(("error:", "bold red"), " ", message), highlight=False, soft_wrap=True
    )
    raise typer.Exit(code)


def check_output_file(path: Path | None, option: str, suffixes: tuple[str, ...]) -> None:
    """Refuse an output file before any work (a model run, minutes of benchmarks): a wrong
    suffix, a missing folder, a folder given as the file, or no permission to write."""
    if path is None:
        return
    if path.suffix.lower() not in suffixes:
        fail(f"{option} {path}: the file name must end with {' or '.join(suffixes)}")
    if not path.parent.is_dir():
        fail(f"{option} {path}: the folder {path.parent} does not exist")
    if path.is_dir():
        fail(f"{option} {path} is a folder; give a file name")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        fail(f"{option} {path} cannot be written (permission denied)")
