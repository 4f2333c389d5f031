"""`Inspection` of transformers models on qkv: a tiny decoder saved to a local directory (with
a word-level tokenizer built here) and the real all-MiniLM-L6-v2, against eager transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import qkv_minilm
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from typer.testing import CliRunner

from qkv.cli import app
from qkv.integrations.transformers import inspect, load_model
from tests.integrations import _tiny_models as tiny

WORDS = ["the", "cat", "sat", "on", "mat", "because", "it", "was", "warm", "."]
TEXT = "the cat sat on the mat because it was warm."


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (GQA) with safetensors weights and a fast word-level tokenizer."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")
    tokenizer.save_pretrained(directory)
    torch.manual_seed(1)
    tiny.build(tiny.llama(), "eager", transformers.AutoModel).save_pretrained(directory)
    return directory


def test_inspection_of_a_decoder_equals_eager(decoder_dir: Path) -> None:
    ours = load_model(decoder_dir)
    assert ours.model.config._attn_implementation == tiny.NAME
    inspection = ours.inspect(TEXT)
    eager = transformers.AutoModel.from_pretrained(decoder_dir, attn_implementation="eager").eval()
    ids = ours.tokenizer(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = eager(ids, output_attentions=True, output_hidden_states=True)
    T = len(WORDS) + 1  # "the" twice
    assert inspection.tokens == ["the", "cat", "sat", "on", "the", "mat", "because", "it", "was", "warm", "."]
    assert inspection.attentions.shape == (2, 4, T, T) and inspection.hidden_states.shape == (3, T, 32)
    torch.testing.assert_close(inspection.attentions, torch.stack(expected.attentions)[:, 0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(inspection.hidden_states, torch.stack(expected.hidden_states)[:, 0], rtol=1e-4, atol=1e-5)
    # a decoder's map is the lower triangle, each row a distribution
    above = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    assert torch.equal(inspection.attentions[..., above], torch.zeros_like(inspection.attentions[..., above]))
    torch.testing.assert_close(inspection.attentions.sum(-1), torch.ones(2, 4, T))
    assert inspection.words[inspection.groups.index(inspection.find("warm"))] == "warm"


def test_minilm_through_transformers_on_qkv_equals_eager_and_qkv_models() -> None:
    """The pretrained all-MiniLM-L6-v2 run by transformers' BertModel on qkv: its maps equal
    eager transformers' and qkv's own encoder's."""
    from qkv.models import load_encoder

    directory = str(qkv_minilm.MODEL_DIR)
    text = "The trophy did not fit into the suitcase because it was too big."
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    runs = {}
    for impl in ("eager", tiny.NAME):
        model = transformers.BertModel.from_pretrained(directory, attn_implementation=impl).eval()
        runs[impl] = inspect(model, tokenizer, text)
    own = load_encoder().inspect(text)
    assert runs[tiny.NAME].tokens == runs["eager"].tokens == own.tokens
    torch.testing.assert_close(runs[tiny.NAME].attentions, runs["eager"].attentions, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(runs[tiny.NAME].attentions, own.attentions, rtol=1e-4, atol=1e-5)
    assert runs[tiny.NAME].offsets == own.offsets and runs[tiny.NAME].word_ids == own.word_ids


def test_cli_inspect_a_decoder_directory(decoder_dir: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    html, png = tmp_path / "view.html", tmp_path / "layer0.png"
    result = runner.invoke(
        app, ["inspect", TEXT, "--model", str(decoder_dir), "--token", "it", "--json", "--html", str(html), "--png", str(png)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["num_layers"], report["num_heads"]) == (2, 4)
    assert [t["token"] for t in report["tokens"]][:3] == ["the", "cat", "sat"]
    # "it" (token 7) looks only at itself and earlier tokens
    assert all(entry["index"] <= 7 for row in report["heads"] for entry in row["top"])
    assert html.stat().st_size > 1000 and png.stat().st_size > 1000


def test_cli_inspect_refuses_a_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    result = CliRunner().invoke(app, ["inspect", "hello", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert "no .safetensors weights" in result.output and "Traceback" not in result.output


def test_cli_inspect_refuses_bfloat16_for_a_transformers_model(tmp_path: Path) -> None:
    # refused from config.json alone, before any weights are read (there are none here)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    result = CliRunner().invoke(app, ["inspect", "hello", "--model", str(tmp_path), "--dtype", "bfloat16"])
    assert result.exit_code == 2
    assert "--dtype bfloat16 applies to BERT-family encoders only" in result.output
    assert "'llama'" in result.output and "Traceback" not in result.output


def _damaged(source: Path, target: Path, damage) -> Path:
    shutil.copytree(source, target)
    damage(target)
    return target


def _truncate_weights(directory: Path) -> None:
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _config_value(key: str, value: object):
    def damage(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        config[key] = value
        (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")

    return damage


DAMAGE = {
    "truncated weights": (_truncate_weights, "model.safetensors is truncated: tensor"),
    "text as weights": (
        lambda d: (d / "model.safetensors").write_text("these are not weights\n", encoding="utf-8"),
        "model.safetensors is not a complete safetensors file",
    ),
    "no heads": (_config_value("num_attention_heads", 0), "num_attention_heads must be a positive integer, got 0"),
    "negative width": (_config_value("hidden_size", -32), "hidden_size must be a positive integer, got -32"),
    "heads as text": (_config_value("num_attention_heads", "4"), "num_attention_heads must be a positive integer, got '4'"),
    "broken tokenizer": (
        lambda d: (d / "tokenizer.json").write_text("{not json", encoding="utf-8"),
        "the tokenizer files of",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
@pytest.mark.parametrize("command", [["inspect", "the cat"], ["heads"]])
def test_a_damaged_model_directory_is_one_line_and_exit_2(
    decoder_dir: Path, tmp_path: Path, case: str, command: list[str]
) -> None:
    damage, message = DAMAGE[case]
    directory = _damaged(decoder_dir, tmp_path / "model", damage)
    result = CliRunner().invoke(app, [*command, "--model", str(directory)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: cannot load model '{directory}': ") and result.output.count("\n") == 1
    assert message in result.output and "Traceback" not in result.output


def test_a_damaged_directory_message_is_not_wrapped_on_a_narrow_terminal(decoder_dir: Path, tmp_path: Path) -> None:
    directory = _damaged(decoder_dir, tmp_path / ("a-long-folder-name-" * 3), _truncate_weights)
    env = {**os.environ, "COLUMNS": "40", "LINES": "20"}
    result = subprocess.run(
        [sys.executable, "-m", "qkv", "inspect", "the cat", "--model", str(directory)],
        capture_output=True, env=env, check=False,
    )
    assert result.returncode == 2 and result.stdout == b""
    lines = result.stderr.decode().splitlines()
    assert len(lines) == 1 and str(directory / "model.safetensors") in lines[0]


def test_load_model_refuses_a_lone_surrogate_in_the_text(decoder_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"'caf\\udce9' holds a lone surrogate \(U\+DCE9\) at character 3"):
        load_model(decoder_dir).inspect("caf\udce9")


def test_heads_on_a_decoder_directory_equals_the_roles_of_eager_maps(decoder_dir: Path, tmp_path: Path) -> None:
    """`qkv heads --model DIR` on a Llama: the shares are those of eager transformers' maps."""
    from qkv.inspect import HeadRoles

    texts = ["the cat sat on the mat.", "it was warm because the mat was warm."]
    file = tmp_path / "texts.txt"
    file.write_text("\n".join(texts), encoding="utf-8")
    result = CliRunner().invoke(app, ["heads", "--model", str(decoder_dir), "--texts", str(file), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    eager = transformers.AutoModel.from_pretrained(decoder_dir, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(decoder_dir)
    expected = HeadRoles.mean([inspect(eager, tokenizer, text).head_roles() for text in texts])
    assert report["texts"] == 2 and len(report["heads"]) == 2 * 4
    for record in report["heads"]:
        shares = [record[role] for role in report["roles"]]
        want = expected.shares[record["layer"], record["head"]].tolist()
        assert shares == pytest.approx(want, abs=1e-5)


def test_heads_refuses_a_text_past_the_positions_before_any_work(decoder_dir: Path, tmp_path: Path) -> None:
    file = tmp_path / "texts.txt"
    file.write_text("the cat\n" + "the " * 2100 + "\n", encoding="utf-8")  # Llama's default: 2048 positions
    result = CliRunner().invoke(app, ["heads", "--model", str(decoder_dir), "--texts", str(file)])
    assert result.exit_code == 2 and "text 1 of --texts has 2100 tokens" in result.output, result.output


STEP_MODELS = {
    "llama": tiny.llama,
    "mistral, window 3": lambda: tiny.mistral(window=3),
    "gemma2 without softcap": lambda: tiny.gemma2(window=3, softcap=None),  # sliding and full layers
    "gpt2": tiny.gpt2,
    "bert": tiny.bert,
}


@pytest.mark.parametrize("family", list(STEP_MODELS))
def test_steps_of_a_transformers_model_on_qkv_equal_eager_weights(decoder_dir: Path, family: str) -> None:
    """The per-head q, k, v captured while the model runs on qkv replay every row of every head
    to eager transformers' own weights (decoders: only the keys their mask leaves)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(decoder_dir)
    torch.manual_seed(3)
    eager = tiny.build(STEP_MODELS[family](), "eager", transformers.AutoModel)
    ours = tiny.build(STEP_MODELS[family](), tiny.NAME, transformers.AutoModel, eager)
    inspection = inspect(ours, tokenizer, TEXT)
    expected = inspect(eager, tokenizer, TEXT).attentions.double()  # (layers, H, T, T)
    assert inspection.projections is not None
    T = len(inspection.tokens)
    for layer in range(inspection.num_layers):
        for head in range(inspection.num_heads):
            for query in range(T):
                trace = inspection.steps(layer, head, query)
                assert np.abs(trace.weights - expected[layer, head, query].numpy()).max() < 1e-6
                hidden = expected[layer, head, query] == 0
                assert (trace.exponentials[hidden.numpy()] == 0).all()
    if family.startswith("mistral"):  # the window shows: query 8 sees keys 6..8 only
        assert inspection.projections.allowed_rows(0)[8].nonzero().flatten().tolist() == [6, 7, 8]


def test_steps_of_a_soft_capped_model_are_refused_with_the_reason(decoder_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(decoder_dir)
    model = tiny.build(tiny.gemma2(softcap=1.0), tiny.NAME, transformers.AutoModel)
    inspection = inspect(model, tokenizer, TEXT)
    with pytest.raises(ValueError, match=r"cannot reproduce this model's weights: soft-capping of the scores at 1 \(layer 0\)"):
        inspection.steps(0, 0, 3)


def test_an_eager_model_gives_no_projections_and_says_which_do(decoder_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(decoder_dir)
    inspection = inspect(tiny.build(tiny.llama(), "eager", transformers.AutoModel), tokenizer, TEXT)
    with pytest.raises(ValueError, match="transformers models that run on attn_implementation='qkv'"):
        inspection.steps(0, 0, 0)


def test_cli_steps_on_a_decoder_directory(decoder_dir: Path) -> None:
    args = ["inspect", TEXT, "--model", str(decoder_dir), "--token", "it", "--steps", "--layer", "1", "--head", "2"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    steps = json.loads(result.stdout)["steps"]
    eager = transformers.AutoModel.from_pretrained(decoder_dir, attn_implementation="eager").eval()
    ids = transformers.AutoTokenizer.from_pretrained(decoder_dir)(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        weights = eager(ids, output_attentions=True).attentions[1][0, 2, 7].double()  # "it" is token 7
    assert steps["token"] == "it" and steps["query"] == 7
    assert np.abs(np.array(steps["weights"]) - weights.numpy()).max() < 1e-6
    assert steps["exponentials"][8:] == [0.0] * 3  # the keys after "it"
    table = CliRunner().invoke(app, args)
    assert table.exit_code == 0 and "layer 1 head 2: query token 7 'it'" in table.output


def test_every_occurrence_of_a_word_with_a_byte_level_bpe_tokenizer() -> None:
    """GPT-2's kind of tokenizer puts the space before a word into its first token's offsets;
    `--token it` must still find both "it"s (it found only the first, at the text's start)."""
    from tokenizers import ByteLevelBPETokenizer

    text = "it fits because it is small and it is new"
    backend = ByteLevelBPETokenizer()
    backend.train_from_iterator([text] * 4, vocab_size=300, min_frequency=1, show_progress=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend._tokenizer)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64)
    inspection = inspect(tiny.build(config, tiny.NAME, transformers.AutoModel), tokenizer, text)
    second = inspection.tokens.index("Ġbecause") + 1
    assert inspection.tokens[second] == "Ġit" and text[slice(*inspection.offsets[second])] == " it"  # the premise
    found = inspection.occurrences("it")
    assert [text[inspection.offsets[g[0]][0] : inspection.offsets[g[-1]][1]].strip() for g in found] == ["it"] * 3
    assert found[1] == [second] and inspection.occurrences(" it") == found
    assert inspection.find("is small") == [second + 1, second + 2]


def test_embed_on_a_transformers_directory_is_refused_in_one_line(decoder_dir: Path) -> None:
    result = CliRunner().invoke(app, ["embed", "the cat", "--model", str(decoder_dir)])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "sentence embeddings come from BERT-family encoders only" in result.output


def test_the_viewer_of_a_decoder_carries_its_projections_and_mask(decoder_dir: Path) -> None:
    """The steps panel of `qkv inspect --model DIR --html`: q, k and each layer's causal mask
    are in the file; a soft-capped model's are left out (its steps would not be its weights)."""
    import base64
    import zlib

    from qkv.viz.viewer import payload

    inspection = load_model(decoder_dir).inspect(TEXT)
    shown = payload(inspection)["projections"]
    assert shown is not None and shown["E"] == 8
    T = len(inspection.tokens)
    allowed = np.frombuffer(zlib.decompress(base64.b64decode(shown["allowed"])), dtype=np.uint8).reshape(2, T, T)
    assert (allowed == np.tril(np.ones((T, T), dtype=np.uint8))[None]).all()
    tokenizer = transformers.AutoTokenizer.from_pretrained(decoder_dir)
    capped = inspect(tiny.build(tiny.gemma2(softcap=1.0), tiny.NAME, transformers.AutoModel), tokenizer, TEXT)
    assert payload(capped)["projections"] is None
