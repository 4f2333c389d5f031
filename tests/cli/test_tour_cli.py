"""`qkv tour`: every example in order with the address book's three-way agreement; --json, --quiet."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from qkv import examples
from qkv.cli import app
from qkv.cli.tour import SECTIONS, Section, TourContext, run_tour


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


def test_tour_json(runner: CliRunner) -> None:
    result = runner.invoke(app, ["tour", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    section = data["sections"]["examples"]
    assert list(section["examples"]) == examples.names()
    weights = section["examples"]["address-book"]["result"]["lookups"][0]["trace"]["weights"][0]
    assert [round(w, 3) for w in weights] == [0.691, 0.154, 0.154]
    agreement = section["agreement"]
    assert [p["name"] for p in agreement["paths"]] == ["qkv auto", "qkv fused", "qkv math", "torch SDPA"]
    assert agreement["max_difference"] < 1e-14


def test_tour_quiet(runner: CliRunner) -> None:
    result = runner.invoke(app, ["tour", "--quiet"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.split(":")[0] in [*examples.names(), "agreement"]]
    assert [line.split(":")[0] for line in lines] == ["address-book", "agreement", *examples.names()[1:]]
    assert "69.1% Xi'an" in result.stdout


def test_sections_extend() -> None:
    assert SECTIONS[0].name == "examples"
    extra = Section("extra", "An extra section", lambda context: {"quiet": context.quiet})
    assert run_tour(TourContext(out=None, quiet=True), [extra]) == {"extra": {"quiet": True}}
