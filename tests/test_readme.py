"""The README's code runs: every ```python block is executed, in order, in a fresh namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)


def test_readme_has_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert "uv run qkv tour" in text
    assert "uv run pytest" in text


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index: int) -> None:
    # each block states what it shows with an assert, so running it checks the claim
    assert "assert " in BLOCKS[index], f"README block {index} checks nothing"
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), {"__name__": f"readme_{index}"})


def test_readme_images_are_absolute_links_to_files_in_docs() -> None:
    """The package index shows the README away from the repository: every image is an absolute
    URL, and the file it names exists under docs/."""
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README.read_text(encoding="utf-8"))
    assert images
    raw = "https://raw.githubusercontent.com/qkv-dev/qkv/main/"
    for url in images:
        assert url.startswith(raw), url
        assert (README.parent / url.removeprefix(raw)).is_file(), url


def test_every_command_is_in_the_readme() -> None:
    """`qkv heads` was missing from the command list; each command shows how it is run."""
    import typer

    from qkv.cli import app

    text = README.read_text(encoding="utf-8")
    names = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert "heads" in names and "inspect" in names
    assert [name for name in names if f"uv run qkv {name}" not in text] == []
