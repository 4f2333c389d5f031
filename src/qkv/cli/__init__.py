"""The `qkv` command: one module per subcommand, all registered on one typer app."""

from __future__ import annotations

import qkv.cli.bench  # registers `qkv bench`
import qkv.cli.doctor  # registers `qkv doctor`
import qkv.cli.embed  # registers `qkv embed`
import qkv.cli.examples  # registers `qkv examples`
import qkv.cli.heads  # registers `qkv heads`
import qkv.cli.inspect  # registers `qkv inspect` and `qkv context`
import qkv.cli.tour  # registers `qkv tour`
from qkv.cli._app import app

# Each import registers its subcommands on `app`.

__all__ = ["app", "main"]


def main() -> None:
    """Entry point of the `qkv` console script and of `python -m qkv`."""
    app()
