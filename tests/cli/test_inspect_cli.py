"""`qkv inspect` and `qkv context`: outputs checked against transformers' BertModel (eager),
and exit code 2 with a one-line reason (no traceback) for every bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import qkv_minilm
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from qkv.cli import app

os.environ["HF_HUB_OFFLINE"] = "1"  # the transformers reference below loads from the package, offline

TROPHY = "The trophy did not fit into the suitcase because it was too big."
MODEL_DIR = qkv_minilm.MODEL_DIR


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="module")
def reference():
    """(tokens, attentions (layers, H, T, T), hidden states (layers + 1, T, D)) of TROPHY and of
    two "bank" sentences, from transformers' eager BertModel."""
    from transformers import AutoTokenizer, BertModel

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    model = BertModel.from_pretrained(str(MODEL_DIR), attn_implementation="eager").eval()
    out = {}
    for text in (TROPHY, "I sat on the bank of the river.", "I paid at the bank with cash."):
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            result = model(ids, output_attentions=True, output_hidden_states=True)
        out[text] = (
            tokenizer.convert_ids_to_tokens(ids[0]),
            torch.stack(result.attentions)[:, 0],
            torch.stack(result.hidden_states)[:, 0],
        )
    return out


def _ok(runner: CliRunner, args: list[str]):
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result


def test_inspect_json_matches_transformers(runner: CliRunner, reference) -> None:
    result = _ok(runner, ["inspect", TROPHY, "--token", "it", "--json", "--top", "4"])
    report = json.loads(result.stdout)
    tokens, attentions, _ = reference[TROPHY]
    assert [t["token"] for t in report["tokens"]] == tokens
    it = tokens.index("it")
    assert report["query"] == {"word": "it", "occurrence": 0, "indices": [it]}
    assert len(report["heads"]) == 6 * 12
    for row in report["heads"]:
        expected = torch.topk(attentions[row["layer"], row["head"], it], 4)
        assert [t["index"] for t in row["top"]] == expected.indices.tolist()
        assert [t["weight"] for t in row["top"]] == pytest.approx(expected.values.tolist(), abs=1e-5)


def test_inspect_table_for_one_head(runner: CliRunner, reference) -> None:
    tokens, attentions, _ = reference[TROPHY]
    it = tokens.index("it")
    top = tokens[int(attentions[3, 1, it].argmax())]
    result = _ok(runner, ["inspect", TROPHY, "--token", "it", "--layer", "3", "--head", "1"])
    assert "where each head looks from 'it'" in result.stdout
    assert top in result.stdout.split("most attended tokens")[1]


def test_inspect_without_token_lists_tokens(runner: CliRunner) -> None:
    result = _ok(runner, ["inspect", "Unbelievably short."])
    assert "##bel" in result.stdout and "--token" in result.stdout


def test_context_matches_transformers(runner: CliRunner, reference) -> None:
    river, money = "I sat on the bank of the river.", "I paid at the bank with cash."
    result = _ok(runner, ["context", "bank", river, money, "--json"])
    report = json.loads(result.stdout)
    cosines = [row["cosine"] for row in report["similarity"]]
    bank_a = reference[river][0].index("bank")
    bank_b = reference[money][0].index("bank")
    expected = F.cosine_similarity(reference[river][2][:, bank_a], reference[money][2][:, bank_b], dim=-1)
    assert cosines == pytest.approx(expected.tolist(), abs=1e-5)
    assert [row["after"] for row in report["similarity"]][:2] == ["embeddings", "layer 0"]


def test_context_table(runner: CliRunner) -> None:
    result = _ok(runner, ["context", "bank", "the bank of the river", "the bank raised rates"])
    assert "embeddings" in result.stdout and "layer 5" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", ""], "text is empty"),
        (["inspect", "   "], "text is empty"),
        (["inspect", "hello", "--model", "/no/such/model"], "cannot load model"),
        (["inspect", "hello", "--model", "weights/pytorch_model.bin"], "pickle"),
        (["inspect", TROPHY, "--token", "trophies"], "'trophies' is not a word of the text"),
        (["inspect", TROPHY, "--token", "it", "--layer", "6"], "--layer 6 is out of range"),
        (["inspect", TROPHY, "--token", "it", "--head", "-1"], "--head -1 is out of range"),
        (["inspect", TROPHY, "--top", "0"], "--top must be at least 1"),
        (["inspect", "word " * 600], "the text has 602 tokens, more than the model's 512 positions"),
        (["inspect", "word " * 600], "pass --truncate to keep the first 512"),
        (["context", "word", "a word", "word " * 600], "TEXT2 has 602 tokens"),
        (["inspect", TROPHY, "--token", "it", "--occurrence", "1"], "--token 'it' occurs 1 time(s) in the text, numbered 0 to 0; --occurrence 1 is out of range"),
        (["inspect", TROPHY, "--token", "it", "--occurrence", "-1"], "--occurrence must be 0 or more"),
        (["inspect", TROPHY, "--occurrence", "1"], "give --token WORD too"),
        (["context", "bank", "the bank", "no such word here"], "TEXT2: 'bank' is not a word"),
        (["context", "bank", "", "the bank"], "TEXT1 is empty"),
        (["context", " ", "the bank", "the bank"], "WORD is empty"),
        (["context", "bank", "the bank", "the bank", "--model", "/no/such/model"], "cannot load model"),
    ],
)
def test_bad_inputs_exit_2_without_traceback(runner: CliRunner, args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "error:" in result.stderr
    assert message in result.stderr  # never wrapped, whatever the width
    assert "truncate=True" not in result.stderr  # the library's words, not the CLI's
    assert "Traceback" not in result.output


def test_truncate_flag_keeps_the_first_512_tokens(runner: CliRunner) -> None:
    long_text = "word " * 600
    report = json.loads(_ok(runner, ["inspect", long_text, "--truncate", "--json"]).stdout)
    tokens = [t["token"] for t in report["tokens"]]
    assert len(tokens) == 512 and tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    report = json.loads(_ok(runner, ["context", "word", "a word here", long_text, "--truncate", "--json"]).stdout)
    assert len(report["similarity"]) == 7


def test_occurrence_picks_the_nth_match_from_0(runner: CliRunner, reference) -> None:
    text = "The bank by the river is not the bank that lends money."
    first = json.loads(_ok(runner, ["inspect", text, "--token", "bank", "--json"]).stdout)
    second = json.loads(_ok(runner, ["inspect", text, "--token", "bank", "--occurrence", "1", "--json"]).stdout)
    tokens = [t["token"] for t in first["tokens"]]
    banks = [i for i, token in enumerate(tokens) if token == "bank"]
    assert len(banks) == 2
    assert first["query"] == {"word": "bank", "occurrence": 0, "indices": [banks[0]]}
    assert second["query"] == {"word": "bank", "occurrence": 1, "indices": [banks[1]]}
    table = _ok(runner, ["inspect", text, "--token", "bank", "--occurrence", "1", "--layer", "0", "--head", "0"])
    assert "occurrence 1 of 'bank'" in table.stdout


def test_tables_state_that_layers_count_from_0(runner: CliRunner) -> None:
    heads = _ok(runner, ["inspect", TROPHY, "--token", "it", "--layer", "5"]).stdout
    assert "layer (0-5)" in heads and "head (0-11)" in heads
    context = _ok(runner, ["context", "bank", "the bank of the river", "the bank raised rates"]).stdout
    assert "after (layers from 0)" in context
    assert "layer 6" not in context and "layer 5" in context


def test_model_directory_with_pickle_only(runner: CliRunner, tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((MODEL_DIR / name).read_bytes())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even read")
    result = runner.invoke(app, ["inspect", "hello", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert "only pickle weights" in " ".join(result.stderr.split())


def test_model_directory_loads(runner: CliRunner) -> None:
    result = _ok(runner, ["inspect", "hello", "--model", str(MODEL_DIR), "--json"])
    assert json.loads(result.stdout)["model"] == str(MODEL_DIR)
