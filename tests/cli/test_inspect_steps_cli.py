"""`qkv inspect TEXT --token WORD --steps`: the four steps of one head, checked against
transformers' eager BertModel (its attention probabilities), and its usage errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import qkv_minilm
import torch
from typer.testing import CliRunner

from qkv.cli import app

os.environ["HF_HUB_OFFLINE"] = "1"

TROPHY = "The trophy did not fit into the suitcase because it was too big."
MODEL_DIR = qkv_minilm.MODEL_DIR


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="module")
def hf_attentions() -> torch.Tensor:
    from transformers import AutoTokenizer, BertModel

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    model = BertModel.from_pretrained(str(MODEL_DIR), attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(tokenizer(TROPHY, return_tensors="pt")["input_ids"], output_attentions=True)
    return torch.stack(out.attentions)[:, 0]  # (layers, H, T, T)


def test_steps_json_is_the_models_row(runner: CliRunner, hf_attentions: torch.Tensor) -> None:
    result = runner.invoke(app, ["inspect", TROPHY, "--token", "it", "--steps", "--layer", "2", "--head", "7", "--json"])
    assert result.exit_code == 0, result.output
    steps = json.loads(result.stdout)["steps"]
    assert (steps["layer"], steps["head"], steps["query"], steps["token"]) == (2, 7, 10, "it")
    q, k, v = np.array(steps["q"]), np.array(steps["k"]), np.array(steps["v"])
    assert q.shape == (32,) and k.shape == (16, 32) and v.shape == (16, 32)
    np.testing.assert_allclose(steps["scores"], k @ q, rtol=1e-12)
    np.testing.assert_allclose(steps["scaled"], k @ q / np.sqrt(32), rtol=1e-12)
    np.testing.assert_allclose(steps["exponentials"], np.exp(k @ q / np.sqrt(32)), rtol=1e-12)
    assert steps["total"] == pytest.approx(sum(steps["exponentials"]))
    np.testing.assert_allclose(steps["weights"], hf_attentions[2, 7, 10].double().numpy(), atol=2e-6)
    np.testing.assert_allclose(steps["output"], np.array(steps["weights"]) @ v, rtol=1e-10)


def test_steps_tables_show_every_key_of_a_short_text(runner: CliRunner, hf_attentions: torch.Tensor) -> None:
    result = runner.invoke(app, ["inspect", TROPHY, "--token", "it", "--steps", "--layer", "2", "--head", "7"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    flat = " ".join(out.split())  # the title may be wrapped at any terminal width
    assert "layer 2 head 7: query token 10 'it'" in flat and "all 16 keys" in flat
    assert "/ sqrt(32)" in out
    cls_row = next(line for line in out.splitlines() if line.strip().startswith("0 [CLS]"))
    assert f"{float(hf_attentions[2, 7, 10, 0]):.3f}" in cls_row  # the softmax weight of [CLS]
    assert "4. output = weights @ V" in flat


def test_long_texts_show_the_heaviest_keys(runner: CliRunner) -> None:
    text = " ".join(["The trophy did not fit into the suitcase because it was too big."] * 3)
    result = runner.invoke(app, ["inspect", text, "--token", "suitcase", "--steps"])
    assert result.exit_code == 0, result.output
    flat = " ".join(result.stdout.split())  # whatever width rich wrapped the lines to
    assert "layer 0 head 0" in flat
    assert "the 16 keys with the largest weights of 44; --json has all" in flat
    assert "28 other keys" in flat


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps"], "--steps needs --token WORD"),
        (["--steps", "--token", "it", "--layer", "6"], "--layer 6 is out of range"),
    ],
)
def test_steps_usage_errors_exit_2(runner: CliRunner, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["inspect", TROPHY, *args])
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.output


def test_compare_writes_one_viewer_with_both_texts(runner: CliRunner, tmp_path: Path) -> None:
    import re

    small = TROPHY.replace("big", "small")
    path = tmp_path / "compare.html"
    args = ["inspect", TROPHY, "--compare", small, "--html", str(path), "--layer", "2", "--head", "7"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    block = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', path.read_text(encoding="utf-8"), re.S)
    data = json.loads(block.group(1))
    assert data["text"] == TROPHY and data["compare"]["text"] == small
    assert data["start"] == {"layer": 2, "head": 7}
    assert data["compare"]["tokens"][13] == "small" and data["tokens"][13] == "big"
    pairs = data["alignment"]
    assert [13, 13] not in pairs and [12, 12] in pairs and [14, 14] in pairs  # every word but big / small


def test_compare_needs_html(runner: CliRunner) -> None:
    result = runner.invoke(app, ["inspect", TROPHY, "--compare", "another text"])
    assert result.exit_code == 2
    assert "--compare needs --html FILE" in result.stderr
