"""`qkv inspect --html FILE --png FILE` writes the viewer and the heatmap for any text."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qkv.cli import app

TEXT = "The trophy did not fit into the suitcase because it was too big."


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


def test_inspect_writes_viewer_and_heatmaps(runner: CliRunner, tmp_path: Path) -> None:
    html, png, svg = tmp_path / "v.html", tmp_path / "h.png", tmp_path / "h.svg"
    result = runner.invoke(app, ["inspect", TEXT, "--json", "--html", str(html), "--png", str(png)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["files"] == [str(html), str(png)]
    page = html.read_text(encoding="utf-8")
    assert page.lstrip().lower().startswith("<!doctype html>")
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", header[16:24])
    assert width > 300 and height > 300

    result = runner.invoke(app, ["inspect", TEXT, "--layer", "3", "--head", "1", "--png", str(svg)])
    assert result.exit_code == 0, result.output
    assert svg.read_text(encoding="utf-8").lstrip().startswith("<?xml")
    assert "wrote" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--png", "heatmap.jpg"], ".png or .svg"),
        (["--html", "viewer.txt"], ".html"),
        (["--html", "no/such/folder/v.html"], "does not exist"),
    ],
)
def test_inspect_refuses_bad_output_paths_before_running(
    runner: CliRunner, tmp_path: Path, args: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["inspect", TEXT, *args])
    assert result.exit_code == 2
    assert message in result.output
    assert list(tmp_path.iterdir()) == []


def test_written_paths_are_printed_whole_on_a_narrow_terminal(runner: CliRunner, tmp_path: Path) -> None:
    from qkv.cli._app import console

    folder = tmp_path / ("a-folder-name-wider-than-forty-columns-" * 2) / "and-deeper"
    folder.mkdir(parents=True)
    html = folder / "viewer.html"
    console.width = 40  # the autouse fixture sets it back for the next test
    result = runner.invoke(app, ["inspect", "a short text", "--html", str(html)])
    assert result.exit_code == 0, result.output
    assert f"wrote {html} (" in result.stdout
