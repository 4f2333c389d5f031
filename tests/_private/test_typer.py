"""qkv._private.typer, checked against typer 0.29: the vendored click exceptions the CLI catches."""

from __future__ import annotations

from qkv._private import typer as private_typer
from tests._private._bounds import assert_checked_release_is_allowed


def test_checked_release_is_inside_the_declared_range() -> None:
    assert private_typer.CHECKED_WITH == "0.29"
    assert_checked_release_is_allowed("typer", private_typer.CHECKED_WITH)


def test_click_exceptions_the_cli_catches() -> None:
    errors = private_typer.click_errors
    assert issubclass(errors.UsageError, errors.ClickException)
    assert issubclass(errors.NoArgsIsHelpError, errors.UsageError)
    assert errors.ClickException("x").format_message() == "x"
