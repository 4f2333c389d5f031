"""Long commands talk: a progress bar on stderr where someone watches (a terminal), silent
under --quiet, --json and when stderr is a file or a pipe; and tables written to a file or a
pipe keep every digit (rich fits a table to 80 columns and cuts cells to "42939…")."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

import qkv.bench
from qkv.bench import QUICK, BenchReport, Comparison
from qkv.cli import _app, app
from qkv.cli._progress import progress


def _terminal() -> tuple[Console, io.StringIO]:
    """A console that says it is a terminal, writing into a buffer the test reads."""
    buffer = io.StringIO()
    return Console(file=buffer, force_terminal=True, width=100), buffer


def test_the_bar_is_drawn_on_a_terminal_only() -> None:
    terminal, drawn = _terminal()
    with progress("texts", 3, console=terminal) as report:
        for done in range(1, 4):
            report(done, f"text {done}")
    assert "texts: text" in drawn.getvalue() and "3/3" in drawn.getvalue()
    for console, shown in ((Console(file=io.StringIO(), width=100), True), (_terminal()[0], False)):
        with progress("texts", 3, shown=shown, console=console) as report:
            report(1)
        assert console.file.getvalue() == ""  # a file, or --quiet / --json


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """The CLI's stderr replaced by a terminal; what it draws lands in the returned buffer."""
    terminal, drawn = _terminal()
    monkeypatch.setattr(_app, "err_console", terminal)
    return drawn


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("texts") / "texts.txt"
    path.write_text("The cat sat on the mat.\nIt was warm.\nThe dog barked.\n", encoding="utf-8")
    return path


def _commands(texts: Path) -> dict[str, tuple[list[str], str]]:
    return {
        "heads": (["heads", "--texts", str(texts)], "texts run through the model"),
        "embed": (["embed", "--file", str(texts)], "texts embedded"),
        "inspect": (["inspect", "The cat sat on the mat.", "--token", "cat"], "inspect"),
    }


@pytest.mark.parametrize("command", ["heads", "embed", "inspect"])
def test_commands_draw_a_bar_on_a_terminal_and_not_under_quiet_or_json(
    watched: io.StringIO, texts: Path, command: str
) -> None:
    args, label = _commands(texts)[command]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert label in watched.getvalue()
    for flag in ("--quiet", "--json"):
        watched.truncate(0)
        watched.seek(0)
        again = CliRunner().invoke(app, [*args, flag])
        assert again.exit_code == 0, again.output
        assert watched.getvalue() == "", flag
    assert result.stdout == CliRunner().invoke(app, [*args, "--quiet"]).stdout  # the bar changes no output


@pytest.mark.parametrize("command", ["heads", "embed", "inspect"])
def test_stderr_that_is_no_terminal_gets_no_bar(texts: Path, command: str) -> None:
    args, _ = _commands(texts)[command]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0 and result.stderr == "", result.stderr


def _report() -> BenchReport:
    """A report with numbers too wide for 80 columns, as a slow machine gives them."""
    report = BenchReport(QUICK, 2, "2.9.0+cpu", 123.4)
    report.comparisons.append(Comparison(
        "window", "sliding_window(256, 256) forward", 16384, 42.9391234, "SDPA with a dense (L, S) bool mask",
        123456.789, None, 0.5, 1e-7,
    ))
    return report


def test_a_bench_table_in_a_file_keeps_every_digit() -> None:
    for width in (40, 80):
        file = io.StringIO()
        _report().print(Console(file=file, width=width))
        table = file.getvalue()
        assert "…" not in table
        for number in ("42939.1", "123456789.0", "SDPA with a dense (L, S) bool mask", "sliding_window(256, 256) forward"):
            assert number in table, (width, table)


def test_qkv_bench_in_a_pipe_keeps_every_digit_and_draws_a_bar_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, watched: io.StringIO
) -> None:
    def suite(config):
        yield "warm-up and matmul rate", _report()
        yield "sliding window vs SDPA", _report()

    monkeypatch.setattr(qkv.bench, "run_suite", suite)
    monkeypatch.setattr(qkv.bench, "steps", lambda config: 2)
    result = CliRunner().invoke(app, ["bench", "--quick"])
    assert result.exit_code == 0, result.output
    assert "123456789.0" in result.stdout and "…" not in result.stdout
    assert "benchmark steps: sliding window vs SDPA" in watched.getvalue()
    watched.truncate(0)
    watched.seek(0)
    quiet = CliRunner().invoke(app, ["bench", "--quick", "--quiet"])
    assert quiet.exit_code == 0 and watched.getvalue() == ""
    as_json = CliRunner().invoke(app, ["bench", "--quick", "--json"])
    assert json.loads(as_json.stdout)["comparisons"][0]["peer_s"] == 123456.789 and watched.getvalue() == ""
