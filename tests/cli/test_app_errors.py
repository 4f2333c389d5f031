"""The CLI's error rules, on the real `qkv` console script where the terminal matters: no
traceback, exit 2 for usage errors, and no message hard-wrapped at the terminal's width, at
COLUMNS=40 with paths far longer than that.

The subprocess tests run commands that stop before PyTorch is imported, so each takes about
a second.
"""

from __future__ import annotations

import enum
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from qkv.cli import app
from qkv.cli._app import QkvGroup, undecodable_argument

QKV = Path(sys.executable).with_name("qkv")  # the console script that `uv sync` installs
NARROW = 40
# a folder name longer than the terminal is wide, nested: a path that any wrapping would split
LONG = "a-folder-name-much-wider-than-a-narrow-terminal-of-forty-columns"


def run_qkv(args: list[str | bytes], stdout: int | object = subprocess.PIPE) -> subprocess.CompletedProcess[bytes]:
    assert QKV.is_file(), f"the qkv console script is not installed next to {sys.executable}"
    env = {**os.environ, "COLUMNS": str(NARROW), "LINES": "20"}
    return subprocess.run(
        [str(QKV), *args], stdout=stdout, stderr=subprocess.PIPE, env=env, timeout=120, check=False
    )


def test_a_missing_folder_in_a_long_path_is_named_unbroken(tmp_path: Path) -> None:
    plot = tmp_path / LONG / LONG / "missing" / "bench.png"
    completed = run_qkv(["bench", "--quick", "--plot", str(plot)])
    stderr = completed.stderr.decode()
    assert completed.returncode == 2, stderr
    assert str(plot) in stderr  # on one line: not split at 40 columns
    assert "Traceback" not in stderr


@pytest.mark.parametrize("command", [["tour"], ["inspect", "a text"], ["bench"]])
def test_click_usage_errors_are_plain_and_unwrapped(command: list[str]) -> None:
    option = "--" + "no-such-option-" * 6  # 90 characters, more than twice the terminal width
    completed = run_qkv([*command, option])
    stderr = completed.stderr.decode()
    assert completed.returncode == 2, stderr
    assert f"Usage: qkv {command[0]}" in stderr
    assert f"No such option: {option}" in stderr
    assert not set("╭╰│") & set(stderr)  # no rich panel: its border wraps the message
    assert "Traceback" not in stderr


def test_a_bad_value_is_a_plain_usage_error() -> None:
    completed = run_qkv(["inspect", "a text", "--layer", LONG])
    stderr = completed.stderr.decode()
    assert completed.returncode == 2, stderr
    line = next(line for line in stderr.splitlines() if line.startswith("error:"))
    assert "--layer" in line and "integer" in line  # the reason on the same line as the option
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    "args",
    [
        [b"inspect", b"caf\xe9"],
        [b"inspect", b"a text", b"--token", b"\xff"],
        [b"embed", b"fine", b"caf\xe9 au lait"],
        [b"context", b"bank", b"the bank", b"the \xe9 bank"],
        [b"embed", b"--file", b"texts-\xe9.txt"],
    ],
)
def test_arguments_that_are_not_utf8_exit_2(args: list[bytes]) -> None:
    completed = run_qkv(list(args))
    stderr = completed.stderr.decode()
    assert completed.returncode == 2, stderr
    bad = next(a for a in args if not _is_utf8(a))
    assert f"argument {args.index(bad) + 1} ({bad!r}) is not valid UTF-8" in stderr
    assert "Traceback" not in stderr


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_undecodable_argument_names_the_first_one() -> None:
    assert undecodable_argument(["inspect", "café"]) is None
    assert undecodable_argument(["a", "caf\udce9", "\udcff"]) == "argument 2 (b'caf\\xe9') is not valid UTF-8"
    assert "argument 1" in str(undecodable_argument(["\ud800"]))  # a surrogate that was no byte


@pytest.mark.parametrize("args", [["examples", "address-book"], ["--help"], ["--version"], ["examples", "address-book", "--json"]])
def test_a_full_disk_is_a_message_and_exit_1(args: list[str]) -> None:
    with open("/dev/full", "wb") as full:
        completed = run_qkv(args, stdout=full)
    stderr = completed.stderr.decode()
    assert completed.returncode == 1, stderr
    assert "could not write the output: No space left on device" in stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr


def test_version() -> None:
    completed = run_qkv(["--version"])
    assert completed.returncode == 0
    assert completed.stdout.decode().strip() == f"qkv {version('qkv')}"
    assert CliRunner().invoke(app, ["--version"]).stdout.strip() == f"qkv {version('qkv')}"


# -- output files that cannot be written, found before the model runs -----------------------


@pytest.fixture
def model_must_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    import qkv.cli.inspect as inspect_cli

    def refuse(model: str) -> None:
        raise AssertionError("the model was loaded before the output files were checked")

    monkeypatch.setattr(inspect_cli, "load_or_fail", refuse)


@pytest.mark.parametrize(
    "args", [["--html", "/proc/x.html"], ["--html", "/sys/x.html"], ["--png", "/proc/x.png"], ["--png", "/sys/x.svg"]]
)
@pytest.mark.usefixtures("model_must_not_run")
def test_unwritable_outputs_are_refused_before_the_model_runs(args: list[str]) -> None:
    # /proc and /sys take no new files, even from root, for whom permission bits say yes
    result = CliRunner().invoke(app, ["inspect", "a text", *args])
    assert result.exit_code == 2, result.output
    assert f"{args[0]} {args[1]} cannot be written" in result.stderr
    assert not isinstance(result.exception, AssertionError)


def test_the_check_leaves_no_file_behind_and_keeps_an_existing_one(tmp_path: Path) -> None:
    html, png = tmp_path / "viewer.html", tmp_path / "heatmap.png"
    png.write_bytes(b"an older heatmap")
    result = CliRunner().invoke(
        app, ["inspect", "a text", "--html", str(html), "--png", str(png), "--model", str(tmp_path / "none")]
    )
    assert result.exit_code == 2 and "cannot load model" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heatmap.png"]
    assert png.read_bytes() == b"an older heatmap"



# qkv's own commands have no choice option yet: a small app on the same group class shows that
# click's choice errors take the same plain, unwrapped path (exit 2, no panel)
class Dtype(str, enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


demo = typer.Typer(cls=QkvGroup)


@demo.command()
def run(dtype: Annotated[Dtype, typer.Option("--dtype")] = Dtype.float32) -> None:
    typer.echo(dtype.value)


@demo.command()
def other() -> None:
    typer.echo("other")


def test_a_bad_choice_is_a_plain_usage_error() -> None:
    value = "float-" + "sixty-four-" * 8
    result = CliRunner().invoke(demo, ["run", "--dtype", value])
    assert result.exit_code == 2, result.output
    error_line = next(line for line in result.stderr.splitlines() if line.startswith("error:"))
    assert "--dtype" in error_line and value in error_line and "float32" in error_line
    assert not set("╭╰│") & set(result.stderr)
    assert CliRunner().invoke(demo, ["run", "--dtype", "bfloat16"]).stdout == "bfloat16\n"
