"""The typer application that every `qkv` subcommand registers on, and the CLI's error rules.

Commands import their heavy dependencies (PyTorch, the model) inside the command body, so
that `qkv --help` stays instant.

Every way a command can end badly ends in one message on stderr, never a traceback, and no
message is ever hard-wrapped at the terminal's width (a path in it stays copy-pasteable):
- `fail`: the commands' own refusals, exit 2 (usage) or 1;
- click's usage errors (an unknown option, a value that is not a number or not a choice):
  printed plain, click's way, instead of typer's rich panels that wrap at the terminal width;
- an argument that is not valid UTF-8 (``qkv inspect $'caf\\xe9'``): exit 2 before parsing;
- output that cannot be written (``qkv examples > /dev/full``, a disk filling up): exit 1.

The library's notes (the ``qkv`` logger: a kernel compiled on first use, a fallback, a dtype
this CPU emulates; each once per process) are printed on stderr as ``qkv: ...`` lines.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console, RenderableType
from rich.text import Text
from typer.core import TyperGroup

from qkv._private.typer import click_errors  # typer's vendored click

__all__ = [
    "USAGE_ERROR",
    "app",
    "check_output_file",
    "console",
    "err_console",
    "fail",
    "print_whole",
    "say",
    "undecodable_argument",
]

# Wider than any table: the width a table is measured in to find the width it needs.
_UNBOUNDED_WIDTH = 100_000
USAGE_ERROR = 2
OUTPUT_ERROR = 1  # the work was fine, its output could not be written


def undecodable_argument(args: Sequence[str]) -> str | None:
    """A description of the first argument that is not valid UTF-8, or None.

    Python hands such bytes over as lone surrogates (PEP 383); they cannot be printed, matched
    or tokenized, so they are refused up front. The description shows the bytes escaped.
    """
    for position, arg in enumerate(args, start=1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            try:
                raw = arg.encode("utf-8", "surrogateescape")  # the bytes as the shell passed them
            except UnicodeEncodeError:  # a surrogate that did not come from a byte
                raw = arg.encode("utf-8", "backslashreplace")
            return f"argument {position} ({raw!r}) is not valid UTF-8"
    return None


def _print_error(message: str) -> None:
    # Text, not markup: the message quotes user input (paths, texts, names) that may hold "[".
    err_console.print(
        Text.assemble(("error:", "bold red"), " ", message), highlight=False, soft_wrap=True
    )


def _show_click_error(error: click_errors.ClickException) -> None:
    """Click's usage error output, unwrapped: the usage line, the help hint, the message."""
    if isinstance(error, click_errors.NoArgsIsHelpError):
        error.show()  # plain `qkv`: the help, as typer draws it
        return
    ctx = getattr(error, "ctx", None)
    if ctx is not None:
        usage = " ".join([ctx.command_path, *ctx.command.collect_usage_pieces(ctx)])
        err_console.print(Text(f"Usage: {usage}"), highlight=False, soft_wrap=True)
        err_console.print(
            Text(f"Try '{ctx.command_path} --help' for help.\n"), highlight=False, soft_wrap=True
        )
    _print_error(error.format_message())


def _silence_stdout() -> None:
    """Point the stdout file descriptor at /dev/null, so that the interpreter's final flush of
    what could not be written does not fail a second time (as Python's docs advise for EPIPE)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (a test runner)
        return


class _StderrNotes(logging.Handler):
    """The ``qkv`` logger's notes as one unwrapped line each on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            err_console.print(Text(f"qkv: {record.getMessage()}"), highlight=False, soft_wrap=True)
        except Exception:  # logging's rule: a handler that fails reports it and goes on
            self.handleError(record)


_NOTES = _StderrNotes(logging.INFO)


def _show_library_notes() -> None:
    """Print the library's notes from here on (once per process, however often main runs)."""
    library = logging.getLogger("qkv")
    if _NOTES not in library.handlers:
        library.addHandler(_NOTES)
    library.setLevel(logging.INFO)


class QkvGroup(TyperGroup):
    """The `qkv` command group, with the error rules of the module docstring."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        args = sys.argv[1:] if args is None else list(args)
        _show_library_notes()
        try:
            bad = undecodable_argument(args)
            if bad is not None:
                _print_error(f"{bad}; qkv reads texts, words and paths as UTF-8")
                sys.exit(USAGE_ERROR)
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            sys.stdout.flush()  # a full disk shows here, not in the interpreter's exit
        except click_errors.ClickException as error:
            _show_click_error(error)
            code = error.exit_code
        except typer.Abort:
            _print_error("aborted")
            code = 1
        except OSError as error:
            _silence_stdout()
            if error.errno != errno.EPIPE:  # a closed pipe (`qkv examples | head`) is no error to report
                where = f" ({error.filename})" if error.filename else ""
                _print_error(f"could not write the output{where}: {error.strerror or error}")
            code = OUTPUT_ERROR
        sys.exit(code if isinstance(code, int) else 0)


def _package_version() -> str:
    try:
        return version("qkv")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"qkv {_package_version()}")
        raise typer.Exit()


app = typer.Typer(
    name="qkv",
    cls=QkvGroup,
    help="Attention as the seed articles teach it: worked examples, a real model's attention, benchmarks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root(
    show_version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print qkv's version and exit."),
    ] = False,
) -> None:
    # The group's own options; its help text is the Typer's above.
    return None


console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = USAGE_ERROR) -> NoReturn:
    """Print a clear message to stderr and exit (2 = usage error) instead of a traceback."""
    _print_error(message)
    raise typer.Exit(code)


def print_whole(renderable: RenderableType, out: Console | None = None) -> None:
    """Print a table (or any renderable) on stdout without cutting a cell: written to a file
    or a pipe, where no terminal width applies, it gets all the width it needs (rich would
    fit it to 80 columns, cutting numbers to "42939…"); on a terminal, the terminal's width."""
    out = console if out is None else out
    needed = out.measure(renderable, options=out.options.update_width(_UNBOUNDED_WIDTH)).maximum  # not clamped
    if out.is_terminal or needed <= out.width:
        out.print(renderable)
        return
    wide = Console(file=out.file, width=needed, color_system=None, force_terminal=False)
    wide.print(renderable)


def say(message: str) -> None:
    """Print one line to stdout as it is: no markup, never wrapped (it may hold a path)."""
    console.print(Text(message), highlight=False, soft_wrap=True)


def check_output_file(path: Path | None, option: str, suffixes: tuple[str, ...]) -> None:
    """Refuse an output file before any work (a model run, minutes of benchmarks): a wrong
    suffix, a missing folder, a folder given as the file, or a file that cannot be written.

    Writability is tried for real, by opening the file for appending (which changes nothing in
    a file that exists) and removing it again if this check created it: permission bits and
    `os.access` say yes to root for /proc and /sys, where no file can be created.
    """
    if path is None:
        return
    if path.suffix.lower() not in suffixes:
        fail(f"{option} {path}: the file name must end with {' or '.join(suffixes)}")
    if not path.parent.is_dir():
        fail(f"{option} {path}: the folder {path.parent} does not exist")
    if path.is_dir():
        fail(f"{option} {path} is a folder; give a file name")
    existed = path.exists()
    try:
        with path.open("ab"):
            pass
    except OSError as error:
        fail(f"{option} {path} cannot be written: {error.strerror or error}")
    if not existed:
        with contextlib.suppress(OSError):  # if it stays, the command writes it later anyway
            path.unlink()
