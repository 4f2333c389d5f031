"""`BertConfig` read from config.json and `WordPieceTokenizer` read from tokenizer.json.

The tokenizer is compared with transformers' pure-Python BertTokenizer built from the
model's vocab.txt: a separate implementation of the same WordPiece algorithm.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qkv.models import BertConfig, WordPieceTokenizer


def test_packaged_config(model_dir: Path) -> None:
    config = BertConfig.from_json(model_dir / "config.json")
    # all-MiniLM-L6-v2: 6 layers, 12 heads of 32, width 384 (its model card)
    assert (config.num_hidden_layers, config.num_attention_heads, config.hidden_size) == (6, 12, 384)
    assert config.head_dim == 32
    assert config.layer_norm_eps == 1e-12
    assert config == BertConfig()  # the documented defaults are this model's


def _write(tmp_path: Path, **changes: object) -> Path:
    raw: dict[str, object] = {
        "vocab_size": 100, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
        "intermediate_size": 16, "max_position_embeddings": 32, "type_vocab_size": 2,
        "model_type": "bert", "hidden_act": "gelu", "dropout_rate_ignored": 0.3,
    }
    raw.update(changes)
    raw = {k: v for k, v in raw.items() if v is not None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def test_unknown_training_fields_are_ignored(tmp_path: Path) -> None:
    assert BertConfig.from_json(_write(tmp_path)).hidden_size == 8


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_act": "relu"}, "hidden_act='relu' is not supported"),
        ({"model_type": "roberta"}, "model_type='roberta' is not supported"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
        ({"num_attention_heads": 3}, "hidden_size=8 is not divisible by num_attention_heads=3"),
        ({"hidden_size": None}, "missing hidden_size"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        ({"layer_norm_eps": -1.0}, "layer_norm_eps must be a positive finite number"),
        ({"layer_norm_eps": float("inf")}, "layer_norm_eps must be a positive finite number, got inf"),
        ({"layer_norm_eps": float("nan")}, "layer_norm_eps must be a positive finite number, got nan"),
        ({"layer_norm_eps": True}, "layer_norm_eps must be a positive finite number, got True"),
        ({"layer_norm_eps": "1e-12"}, "layer_norm_eps must be a positive finite number, got '1e-12'"),
        ({"pad_token_id": 0.5}, "pad_token_id must be an integer token id, got 0.5"),
        ({"pad_token_id": "0"}, "pad_token_id must be an integer token id, got '0'"),
        ({"pad_token_id": False}, "pad_token_id must be an integer token id, got False"),
        ({"pad_token_id": 30522}, "pad_token_id=30522 is outside the vocabulary"),
        ({"num_hidden_layers": 2.0}, "num_hidden_layers must be a positive integer, got 2.0"),
        ({"vocab_size": "30522"}, "vocab_size must be a positive integer, got '30522'"),
        ({"hidden_act": ["gelu"]}, "hidden_act must be a string"),
        ({"is_decoder": True}, "decoder"),
    ],
)
def test_bad_configs_name_the_field(tmp_path: Path, changes: dict[str, object], message: str) -> None:
    path = _write(tmp_path, **changes)
    with pytest.raises(ValueError, match=message) as error:
        BertConfig.from_json(path)
    assert str(path) in str(error.value)


def test_config_not_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        BertConfig.from_json(path)


def test_config_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("[1, 2]")
    with pytest.raises(TypeError, match="must be a JSON object"):
        BertConfig.from_json(path)


# -- tokenizer -------------------------------------------------------------------------------

TEXTS = [
    "The trophy did not fit into the suitcase because it was too big.",
    "Unbelievably, 苹果 released a phone! Déjà vu?",
    "",
    "word " * 300,  # longer than the file's built-in truncation to 128
]


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> WordPieceTokenizer:
    return WordPieceTokenizer.from_file(model_dir / "tokenizer.json")


def test_matches_pure_python_wordpiece(tokenizer: WordPieceTokenizer, model_dir: Path) -> None:
    from transformers import BertTokenizer

    reference = BertTokenizer(str(model_dir / "vocab.txt"), do_lower_case=True)
    for text in TEXTS:
        expected = reference(text)["input_ids"]
        assert tokenizer.encode(text).ids == expected


def test_no_padding_and_no_truncation(tokenizer: WordPieceTokenizer) -> None:
    lengths = tokenizer.lengths(TEXTS)
    assert lengths[2] == 2  # [CLS] [SEP], not padded to 128
    assert lengths[3] == 302  # 300 words + [CLS] + [SEP], not cut at 128


def test_offsets_and_word_ids(tokenizer: WordPieceTokenizer) -> None:
    text = "Unbelievably, it fits."
    t = tokenizer.encode(text)
    assert t.tokens[0] == "[CLS]" and t.tokens[-1] == "[SEP]"
    assert t.word_ids[0] is None and t.word_ids[-1] is None
    assert t.offsets[0] == (0, 0)
    # the pieces of one word share its id and tile its characters
    pieces = [i for i, w in enumerate(t.word_ids) if w == 0]
    assert len(pieces) > 1
    assert text[t.offsets[pieces[0]][0] : t.offsets[pieces[-1]][1]] == "Unbelievably"
    it = t.tokens.index("it")
    assert text[slice(*t.offsets[it])] == "it"


def test_bad_tokenizer_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer file"):
        WordPieceTokenizer.from_file(tmp_path / "tokenizer.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0"}')
    with pytest.raises(ValueError, match=r"is not a valid tokenizer\.json"):
        WordPieceTokenizer.from_file(bad)


def test_non_string_is_a_type_error(tokenizer: WordPieceTokenizer) -> None:
    with pytest.raises(TypeError, match=r"texts\[0\] must be a str, got bytes"):
        tokenizer.encode_batch([b"bytes"])  # type: ignore[list-item]
