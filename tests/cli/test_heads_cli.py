"""`qkv heads`: the role table over texts, its JSON records, the PNG grid and usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from qkv.cli import app
from qkv.inspect import HeadRoles
from qkv.inspect.roles import ROLES
from qkv.viz import role_grid, save_role_grid
from qkv.viz.roles import ROLE_COLOURS

TEXTS = ["The cat sat on the mat.", "Where did you park the car, and why?"]


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


def test_heads_json_has_a_record_per_head_and_the_strongest(runner: CliRunner, tmp_path: Path) -> None:
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join([TEXTS[0], "", TEXTS[1], "   "]) + "\n", encoding="utf-8")
    result = runner.invoke(app, ["heads", "--texts", str(texts), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["texts"] == 2 and report["roles"] == list(ROLES)
    records = report["heads"]
    assert [(r["layer"], r["head"]) for r in records] == [(layer, head) for layer in range(6) for head in range(12)]
    for record in records:
        assert sum(record[role] for role in ROLES) == pytest.approx(1.0)
        assert record["dominant"] == max(ROLES, key=lambda role: record[role])
    for best in report["strongest"]:
        top = max(records, key=lambda r: r[best["role"]])
        assert (best["layer"], best["head"], best["share"]) == (top["layer"], top["head"], top[best["role"]])


def test_heads_on_the_built_in_sentences_prints_the_table_and_writes_the_grid(runner: CliRunner, tmp_path: Path) -> None:
    png = tmp_path / "heads.png"
    result = runner.invoke(app, ["heads", "--png", str(png)])
    assert result.exit_code == 0, result.output
    flat = " ".join(result.stdout.split())
    assert "averaged over 48 texts (qkv's built-in sentences)" in flat
    assert "sends" in flat and "of its attention to the previous token" in flat
    with Image.open(png) as image:
        assert image.size[0] > 400


def test_role_grid_colours_each_cell_by_its_dominant_role(tmp_path: Path) -> None:
    shares = torch.zeros(2, 3, len(ROLES), dtype=torch.float64)
    shares[0, 0, ROLES.index("previous")] = shares[0, 1, ROLES.index("cls")] = shares[0, 2, ROLES.index("rest")] = 1.0
    shares[1, :, ROLES.index("punctuation")] = 1.0
    roles = HeadRoles(shares=shares, entropy=torch.zeros(2, 3, dtype=torch.float64))
    fig = role_grid(roles)
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3]  # (rows, columns, RGB), top row first
    ax = fig.axes[0]
    expected = {(0, 0): "previous", (0, 1): "cls", (0, 2): "rest", (1, 0): "punctuation", (1, 2): "punctuation"}
    for (layer, head), role in expected.items():
        x, y = ax.transData.transform((head - 0.3, layer - 0.3))  # off the centred label; y from the bottom
        colour = tuple(int(ROLE_COLOURS[role][i : i + 2], 16) for i in (1, 3, 5))
        assert tuple(pixels[pixels.shape[0] - round(y), round(x)]) == colour, (layer, head, role)
    with Image.open(save_role_grid(roles, tmp_path / "g.png")) as image:
        assert image.format == "PNG"


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "does not exist or is not a file"),
        ("blank", "holds no text"),
        ("bom_only", "holds no text"),  # a byte-order mark is no text (as in qkv embed --file)
        ("latin1", "is not UTF-8 text"),
        ("png", "--png"),
    ],
)
def test_heads_usage_errors_exit_2(runner: CliRunner, tmp_path: Path, setup: str, message: str) -> None:
    path = tmp_path / "texts.txt"
    args = ["heads", "--texts", str(path)]
    if setup == "blank":
        path.write_text("\n  \n", encoding="utf-8")
    elif setup == "bom_only":
        path.write_text("\n  \n", encoding="utf-8-sig")
    elif setup == "latin1":
        path.write_bytes("caf\xe9\n".encode("latin-1"))
    elif setup == "png":
        path.write_text("a cat\n", encoding="utf-8")
        args += ["--png", str(tmp_path / "no" / "such" / "grid.png")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.output
