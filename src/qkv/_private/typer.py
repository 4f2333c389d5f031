"""The click exceptions that typer vendors (checked against typer 0.29).

Since 0.29, typer ships its own copy of click as ``typer._click`` instead of depending on
click; the CLI catches click's usage errors to print them in one line (`qkv.cli._app`).
pyproject.toml allows typer < 0.30; tests/_private/test_typer.py checks the names.
"""

from __future__ import annotations

from typer._click import exceptions as click_errors

__all__ = ["CHECKED_WITH", "click_errors"]

# The typer release this module was checked against.
CHECKED_WITH = "0.29"
