"""Texts from files for the CLI: split at "\\n" only, decoded as UTF-8 with or without a
byte-order mark; a bad file exits 2 naming the option that gave it."""

from __future__ import annotations

from pathlib import Path

from qkv.cli._app import fail

__all__ = ["read_text_lines", "split_lines"]


def split_lines(content: str) -> list[str]:
    r"""One text per line: split at "\n" only, dropping one "\r" before it (Windows line ends).

    `str.splitlines` would also split at a form feed, U+0085, U+2028 and the other Unicode line
    boundaries, cutting a text that holds one in two.

        >>> split_lines("one\r\ntwo\x0cstill two\u2028and still\n")
        ['one', 'two\x0cstill two\u2028and still', '']
    """
    return [line.removesuffix("\r") for line in content.split("\n")]


def read_text_lines(path: Path, option: str, *, allow_none: bool = False) -> list[str]:
    """The non-blank lines of a UTF-8 file, split at "\\n" only (a form feed or U+2028 inside
    a line stays in its text); exit 2 when the file is missing, not UTF-8, or (unless
    ``allow_none``) has no text."""
    if not path.is_file():
        fail(f"{option} {path} does not exist or is not a file")
    try:
        # bytes, then decode: reading as text would turn a lone "\r" into a line end too;
        # utf-8-sig drops the byte-order mark that some editors write first
        content = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as error:
        fail(f"{option} {path} is not UTF-8 text: {error}")
    except OSError as error:
        fail(f"{option} {path} cannot be read: {error.strerror or error}")
    texts = [line for line in split_lines(content) if line.strip()]
    if not texts and not allow_none:
        fail(f"{option} {path} holds no text (every line is blank)")
    return texts
