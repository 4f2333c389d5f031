"""`qkv tour`: every example in order with the address book's three-way agreement, then the
pretrained model's attention with heatmaps and viewers written to --out; --json, --quiet."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from qkv import examples
from qkv.cli import app
from qkv.cli.tour import SECTIONS, Section, TourContext, run_tour
from qkv.cli.tour_model import SENTENCES
from qkv.inspect.pronoun import TROPHY_BIG


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="module")
def tour_json(runner: CliRunner, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("tour") / "nested" / "out"  # --out creates missing directories
    result = runner.invoke(app, ["tour", "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), out


def test_tour_json_examples(tour_json: tuple[dict[str, Any], Path]) -> None:
    data, _ = tour_json
    section = data["sections"]["examples"]
    assert list(section["examples"]) == examples.names()
    weights = section["examples"]["address-book"]["result"]["lookups"][0]["trace"]["weights"][0]
    assert [round(w, 3) for w in weights] == [0.691, 0.154, 0.154]
    assert list(section) == ["examples"]
    agreement = section["examples"]["agreement"]["result"]
    assert [p["name"] for p in agreement["paths"]] == ["qkv auto", "qkv fused", "qkv math", "torch SDPA"]
    assert agreement["max_difference"] < 1e-14


def test_tour_model_section_finds_heads_and_context(tour_json: tuple[dict[str, Any], Path]) -> None:
    model = tour_json[0]["sections"]["model"]
    assert model["sentences"]["trophy-big"] == TROPHY_BIG
    heads = model["pronoun_heads"]
    assert heads == sorted(heads, key=lambda r: -r["big_trophy"])
    assert heads[0]["big_trophy"] > 0.3  # some head sends "it" clearly to "trophy"
    for word, values in model["context_similarity"].items():
        assert len(values) == 7, word  # embeddings + 6 layers
        assert values[-1] < values[0], word  # the same word drifts apart with depth


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", header[16:24])


def test_tour_writes_every_promised_file(tour_json: tuple[dict[str, Any], Path]) -> None:
    data, out = tour_json
    files = [Path(p) for p in data["sections"]["model"]["files"]]
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in files)
    for sentence in SENTENCES:
        page = out / f"{sentence.slug}.html"
        assert page.is_file()
        assert "<script" in page.read_text(encoding="utf-8")
    pngs = [p for p in files if p.suffix == ".png"]
    assert len(pngs) >= 3
    for png in pngs:
        width, height = _png_size(png)
        assert width > 200 and height > 200


def test_tour_quiet(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["tour", "--quiet", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.split(":")[0] in examples.names()]
    assert [line.split(":")[0] for line in lines] == examples.names()
    assert examples.names()[:2] == ["address-book", "agreement"]
    assert "69.1% Xi'an" in result.stdout
    assert "trophy-big.html" in result.stdout


def test_tour_refuses_a_file_as_out_dir(runner: CliRunner, tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file.txt"
    not_a_dir.write_text("x")
    result = runner.invoke(app, ["tour", "--out", str(not_a_dir)])
    assert result.exit_code == 2
    assert "not a directory" in result.output


def test_tour_refuses_an_out_dir_it_cannot_create(runner: CliRunner, tmp_path: Path) -> None:
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    result = runner.invoke(app, ["tour", "--out", str(blocker / "sub")])
    assert result.exit_code == 2
    assert "cannot be created" in result.output
    assert "Traceback" not in result.output


def test_sections_extend() -> None:
    assert [s.name for s in SECTIONS] == ["examples", "model"]
    extra = Section("extra", "An extra section", lambda context: {"quiet": context.quiet})
    assert run_tour(TourContext(out=None, quiet=True), [extra]) == {"extra": {"quiet": True}}


def test_context_table_numbers_layers_from_0() -> None:
    from rich.console import Console

    from qkv.cli.tour_model import _context_table

    out = Console(width=300, record=True)
    out.print(_context_table({"apple": [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4]}))
    header = out.export_text().splitlines()[2]  # title, top border, header row
    assert [cell.strip() for cell in header.split("┃")[2:-1]] == [
        "embeddings", *(f"after layer {i}" for i in range(6))
    ]


def test_tour_answers_the_head_claim_and_writes_compare_viewers(tour_json: tuple[dict[str, Any], Path]) -> None:
    import re

    data, out = tour_json
    roles = data["sections"]["model"]["head_roles"]
    assert roles["texts"] == 48
    assert [row["role"] for row in roles["strongest"]] == ["previous", "next", "self", "cls", "sep", "punctuation"]
    for row in roles["strongest"]:
        assert row["sentence"].startswith(f"layer {row['layer']} head {row['head']} sends {100 * row['share']:.0f}% of its attention to ")
    for slug, a, b in (("trophy-compare", "trophy-big", "trophy-small"), ("apple-compare", "apple-fruit", "apple-company")):
        page = (out / f"{slug}.html").read_text(encoding="utf-8")
        block = json.loads(re.search(r'id="qkv-data">(.*?)</script>', page, re.S).group(1))
        sentences = data["sections"]["model"]["sentences"]
        assert (block["text"], block["compare"]["text"]) == (sentences[a], sentences[b])
        best = data["sections"]["model"]["pronoun_heads"][0]
        assert block["start"] == {"layer": best["layer"], "head": best["head"]}
