"""`qkv examples`: exit 0 for every name, JSON with every intermediate, exit 2 for a bad name."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from qkv import examples
from qkv.cli import app

DETERMINISTIC = ["address-book", "agreement", "apple", "scaling", "permutation", "cross-attention", "multi-head", "context", "learned"]


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


@pytest.mark.parametrize("name", examples.names())
def test_json_for_each_name(runner: CliRunner, name: str) -> None:
    result = runner.invoke(app, ["examples", name, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # nothing but JSON on stdout
    assert list(data["examples"]) == [name]
    entry = data["examples"][name]
    assert entry["title"] == examples.get(name).title
    if name in DETERMINISTIC:
        # every intermediate, unrounded: exactly what the library computes
        assert entry["result"] == examples.get(name).run().to_json()
    else:  # quadratic: timings differ from run to run, the counts do not
        assert [row["scores"] for row in entry["result"]["sizes"]] == [n * n for n in (256, 512, 1024, 2048)]


def test_json_holds_the_articles_numbers_unrounded(runner: CliRunner) -> None:
    result = runner.invoke(app, ["examples", "address-book", "--json"])
    lookup = json.loads(result.stdout)["examples"]["address-book"]["result"]["lookups"][0]
    assert lookup["trace"]["scaled"] == [[3.0, 1.5, 1.5]]
    assert lookup["exponentials"][0] == pytest.approx(np.exp(3.0), rel=1e-15)
    assert lookup["total"] == pytest.approx(np.exp(3.0) + 2 * np.exp(1.5), rel=1e-15)
    assert round(lookup["trace"]["weights"][0][0], 3) == 0.691


def test_all_examples_render(runner: CliRunner) -> None:
    result = runner.invoke(app, ["examples"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    rules = [line.strip("─ ") for line in out.splitlines() if line.startswith("─")]  # each example's title rule
    assert rules == examples.names()
    for number in ("20.086", "4.482", "29.049", "0.691", "0.807", "0.855", "0.048", "0.952", "[0.09, 0.24, 0.67]"):
        assert number in out


def test_unknown_name_exits_2_with_the_names(runner: CliRunner) -> None:
    result = runner.invoke(app, ["examples", "no-such-example"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert "no-such-example" in result.stderr
    for name in examples.names():
        assert name in result.stderr.replace("\n", " ")
