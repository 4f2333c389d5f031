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


def _start(page: str) -> dict[str, int]:
    import re

    block = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    assert block is not None
    return json.loads(block.group(1))["start"]


def test_the_viewer_opens_on_the_head_that_looks_hardest_from_the_token(runner: CliRunner, tmp_path: Path) -> None:
    """The rule of qkv.viz.viewer.opening_head, recomputed here in plain loops: for the rows of
    --token's pieces, the largest weight on another word's token, averaged; the best head."""
    import numpy as np

    from qkv.models import load_encoder

    inspection = load_encoder().inspect(TEXT)
    rows = inspection.find("it")
    weights = inspection.attentions.numpy()
    best, where = -1.0, None
    for layer in range(inspection.num_layers):
        for head in range(inspection.num_heads):
            strongest = [
                max(weights[layer, head, i, j] for j in range(len(inspection.tokens))
                    if inspection.word_ids[j] is not None and j != i)
                for i in rows
            ]
            if float(np.mean(strongest)) > best:
                best, where = float(np.mean(strongest)), {"layer": layer, "head": head}
    path = tmp_path / "it.html"
    result = runner.invoke(app, ["inspect", TEXT, "--token", "it", "--html", str(path)])
    assert result.exit_code == 0, result.output
    assert _start(path.read_text(encoding="utf-8")) == where
    assert where != {"layer": 0, "head": 0}  # where the viewer used to open, every line faint
    chosen = runner.invoke(app, ["inspect", TEXT, "--token", "it", "--html", str(path), "--layer", "0", "--head", "3"])
    assert chosen.exit_code == 0 and _start(path.read_text(encoding="utf-8")) == {"layer": 0, "head": 3}
