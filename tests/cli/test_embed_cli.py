"""`qkv embed`: embeddings from the command line, checked against the library call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qkv.cli import app
from qkv.models import load_encoder


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


def test_embed_json_equals_encode(runner: CliRunner, tmp_path: Path) -> None:
    texts = ["I ate an apple.", "Apple released a phone.", "We sat on the bank of the river."]
    file = tmp_path / "texts.txt"
    file.write_text("\n".join(texts[1:]) + "\n\n", encoding="utf-8")
    result = runner.invoke(app, ["embed", texts[0], "--file", str(file), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["texts"] == texts
    expected = load_encoder().encode(texts)
    torch.testing.assert_close(torch.tensor(data["embeddings"]), expected, atol=1e-6, rtol=0)


def test_embed_prints_similarities(runner: CliRunner) -> None:
    result = runner.invoke(app, ["embed", "I ate an apple.", "I ate a pear."])
    assert result.exit_code == 0, result.output
    assert "cosine similarity" in result.stdout
    assert "1.000" in result.stdout  # the diagonal


def test_embed_prints_texts_as_written_not_as_markup(runner: CliRunner) -> None:
    result = runner.invoke(app, ["embed", "[/b] closes nothing", "[bold]not bold[/bold]"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "0: [/b] closes nothing" in result.stdout
    assert "1: [bold]not bold[/bold]" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "at least one text"),
        (["--file", "missing.txt"], "does not exist"),
        (["--file", "[/missing].txt"], "--file [/missing].txt does not exist"),  # not read as markup
        (["  "], "empty"),
        (["x", "--batch-size", "0"], "--batch-size"),
        (["x", "--model", "/no/such/model"], "cannot load model"),
    ],
)
def test_embed_usage_errors_exit_2(runner: CliRunner, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["embed", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_embed_file_splits_at_newlines_only(runner: CliRunner, tmp_path: Path) -> None:
    file = tmp_path / "texts.txt"
    texts = ["a form\x0cfeed stays inside", "so do U+0085\x85 and U+2028\u2028 and U+2029\u2029", "a Windows line"]
    file.write_bytes(f"{texts[0]}\n{texts[1]}\n\n{texts[2]}\r\n".encode())
    result = runner.invoke(app, ["embed", "--file", str(file), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["texts"] == texts
    assert len(data["embeddings"]) == 3


def test_embed_file_with_a_byte_order_mark(runner: CliRunner, tmp_path: Path) -> None:
    file = tmp_path / "texts.txt"
    file.write_bytes("\ufeffone\ntwo\n".encode())
    result = runner.invoke(app, ["embed", "--file", str(file), "--json"])
    assert json.loads(result.stdout)["texts"] == ["one", "two"]


def test_embed_too_long_names_the_flag(runner: CliRunner) -> None:
    result = runner.invoke(app, ["embed", "short", "word " * 600, "word " * 700])
    assert result.exit_code == 2
    assert "text 1 has 602 tokens, more than the model's 512 positions" in result.stderr
    assert "pass --truncate" in result.stderr and "(2 texts are too long)" in result.stderr
    assert "truncate=True" not in result.stderr


def test_embed_in_bfloat16_equals_the_bfloat16_encoder(runner: CliRunner) -> None:
    texts = ["I ate an apple.", "Apple released a phone."]
    result = runner.invoke(app, ["embed", *texts, "--dtype", "bfloat16", "--json"])
    assert result.exit_code == 0, result.output
    expected = load_encoder(dtype=torch.bfloat16).encode(texts)
    torch.testing.assert_close(torch.tensor(json.loads(result.stdout)["embeddings"]), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("command", [["embed", "a cat"], ["inspect", "a cat"], ["context", "cat", "a cat", "the cat"]])
def test_other_dtypes_are_a_usage_error(runner: CliRunner, command: list[str]) -> None:
    result = runner.invoke(app, [*command, "--dtype", "float16"])
    assert result.exit_code == 2
    assert "--dtype must be one of float32, bfloat16, got 'float16'" in result.output
    assert "Traceback" not in result.output
