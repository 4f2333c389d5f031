"""`Encoder.encode` and `Encoder.inspect` on all-MiniLM-L6-v2 against independent references.

- encode: sentence-transformers' own output for this model (cosine >= 0.99999 per sentence).
- inspect: Hugging Face transformers' BertModel with eager attention (the explicit softmax),
  attentions and hidden states to 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from qkv.models import Encoder, TextTooLongError, builtin_model_dir, load_encoder, resolve_model_dir
from qkv.models import encoder as encoder_module

# Varied lengths (one token to ~240 tokens), subwords, punctuation, CJK, accents, digits and
# an empty text, deliberately unsorted so that the length sort inside encode must be undone.
LONG = " ".join(
    f"Sentence {i} of a long paragraph about attention, tokenization and unbelievably long words."
    for i in range(12)
)
SENTENCES = [
    "The trophy did not fit into the suitcase because it was too big.",
    "hi",
    LONG,
    "苹果 发布 手机",
    "I sat on the bank of the river.",
    "",
    "Déjà vu: 3.14159 is π, isn't it?!",
    "A man is playing a guitar.",
    "Transformers replaced recurrent networks for most sequence tasks in 2018 and after.",
    "ok",
    "The quick brown fox jumps over the lazy dog " * 3,
]


def _st_encode(st_model, texts: list[str], batch_size: int = 32) -> torch.Tensor:
    return torch.from_numpy(np.asarray(st_model.encode(texts, batch_size=batch_size)))


@pytest.fixture(scope="module")
def st_embeddings(st_model) -> torch.Tensor:
    return _st_encode(st_model, SENTENCES)


def test_long_sentence_is_long_but_within_sentence_transformers_limit(encoder: Encoder, st_model) -> None:
    n = len(encoder.tokenizer.encode(LONG))
    assert 200 < n <= st_model.max_seq_length  # else the reference would cut it


@pytest.mark.parametrize("batch_size", [3, 32])
def test_encode_matches_sentence_transformers(
    encoder: Encoder, st_embeddings: torch.Tensor, batch_size: int
) -> None:
    ours = encoder.encode(SENTENCES, batch_size=batch_size)
    assert ours.shape == (len(SENTENCES), 384) and ours.dtype == torch.float32
    cosine = F.cosine_similarity(ours, st_embeddings, dim=1)
    assert cosine.min() >= 0.99999, cosine
    torch.testing.assert_close(ours, st_embeddings, atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch_size", [4, 32])
def test_packed_encode_matches_sentence_transformers(
    encoder: Encoder, st_embeddings: torch.Tensor, batch_size: int
) -> None:
    # each batch runs as one sequence: documents mask, positions restarting per text, no padding
    ours = encoder.encode(SENTENCES, batch_size=batch_size, packed=True)
    assert F.cosine_similarity(ours, st_embeddings, dim=1).min() >= 0.99999
    torch.testing.assert_close(ours, st_embeddings, atol=1e-5, rtol=0)


def test_packed_is_a_bool(encoder: Encoder) -> None:
    with pytest.raises(TypeError, match="packed must be a bool"):
        encoder.encode(["a"], packed="yes")  # type: ignore[arg-type]


def test_one_token_text_matches_sentence_transformers(encoder: Encoder, st_model) -> None:
    assert len(encoder.tokenizer.encode("hi")) == 3  # [CLS] hi [SEP]
    ours = encoder.encode("hi")
    assert ours.shape == (1, 384)
    assert F.cosine_similarity(ours, _st_encode(st_model, ["hi"]))[0] >= 0.99999


def test_embeddings_have_unit_norm_unless_told(encoder: Encoder, hf_model) -> None:
    texts = ["a short one", "and a somewhat longer sentence to pad against"]
    normalized = encoder.encode(texts)
    torch.testing.assert_close(normalized.norm(dim=1), torch.ones(2))
    raw = encoder.encode(texts, normalize=False)
    # Mean pooling computed by hand from transformers' BertModel, one text at a time (no padding).
    for i, text in enumerate(texts):
        ids = torch.tensor([encoder.tokenizer.encode(text).ids])
        with torch.no_grad():
            hidden = hf_model(ids).last_hidden_state[0]  # (T, D)
        torch.testing.assert_close(raw[i], hidden.mean(dim=0), atol=1e-5, rtol=1e-5)


def test_past_512_positions_raises_unless_truncate(encoder: Encoder, st_model) -> None:
    text = "attention " * 600  # 602 tokens with [CLS] and [SEP]
    with pytest.raises(ValueError, match=r"512 positions.*truncate=True"):
        encoder.encode(["short", text])
    ours = encoder.encode(["short", text], truncate=True)
    # sentence-transformers keeps [CLS], the first 510 tokens and [SEP] at max_seq_length=512
    previous = st_model.max_seq_length
    st_model.max_seq_length = 512
    try:
        reference = _st_encode(st_model, ["short", text])
    finally:
        st_model.max_seq_length = previous
    assert F.cosine_similarity(ours, reference).min() >= 0.99999


def test_progress_callback_sees_every_batch(encoder: Encoder) -> None:
    seen: list[tuple[int, int]] = []
    texts = [f"text number {i}" for i in range(11)]
    encoder.encode(texts, batch_size=4, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(4, 11), (8, 11), (11, 11)]


def test_progress_bar_leaves_results_unchanged(encoder: Encoder, st_embeddings: torch.Tensor) -> None:
    short = [i for i, text in enumerate(SENTENCES) if len(text) < 100]
    ours = encoder.encode([SENTENCES[i] for i in short], batch_size=2, progress=True)
    torch.testing.assert_close(ours, st_embeddings[short], atol=1e-5, rtol=0)


def test_no_texts_gives_an_empty_matrix(encoder: Encoder) -> None:
    assert encoder.encode([]).shape == (0, 384)


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True])
def test_bad_batch_size(encoder: Encoder, batch_size: object) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        encoder.encode(["a"], batch_size=batch_size)  # type: ignore[arg-type]


def test_non_string_text_is_a_type_error(encoder: Encoder) -> None:
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str"):
        encoder.encode(["fine", 3])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        (None, "texts must be a str or a sequence of str, got NoneType"),
        (3, "texts must be a str or a sequence of str, got int"),
        (b"abc", r"got bytes; decode bytes first"),  # not the three texts 97, 98, 99
        (bytearray(b"abc"), "got bytearray"),
        ({"a": 1}, "got dict"),
    ],
)
def test_texts_of_the_wrong_type_are_named(encoder: Encoder, texts: object, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        encoder.encode(texts)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=message):
        encoder.tokenize(texts)  # type: ignore[arg-type]


def test_too_long_error_carries_the_numbers(encoder: Encoder) -> None:
    with pytest.raises(TextTooLongError) as raised:
        encoder.encode(["short", "attention " * 600, "attention " * 700])
    error = raised.value
    assert (error.count, error.index, error.tokens, error.limit) == (2, 1, 602, 512)
    assert isinstance(error, ValueError) and "truncate=True" in str(error)


# -- inspect ---------------------------------------------------------------------------------

INSPECTED = [
    "The trophy did not fit into the suitcase because it was too big.",
    "Unbelievably, 苹果 released a phone.",
    "x",
]


@pytest.mark.parametrize("text", INSPECTED)
def test_inspect_matches_transformers_eager(encoder: Encoder, hf_model, model_dir: Path, text: str) -> None:
    from transformers import AutoTokenizer

    reference_tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    batch = reference_tokenizer(text, return_tensors="pt", return_offsets_mapping=True)
    with torch.no_grad():
        out = hf_model(
            batch["input_ids"], attention_mask=batch["attention_mask"],
            output_attentions=True, output_hidden_states=True,
        )
    inspection = encoder.inspect(text)
    T = batch["input_ids"].shape[1]
    assert inspection.tokens == reference_tokenizer.convert_ids_to_tokens(batch["input_ids"][0])
    assert inspection.offsets == [tuple(span) for span in batch["offset_mapping"][0].tolist()]
    assert inspection.word_ids == batch.word_ids(0)
    assert inspection.attentions.shape == (6, 12, T, T)
    assert inspection.hidden_states.shape == (7, T, 384)
    torch.testing.assert_close(inspection.attentions, torch.stack(out.attentions)[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(inspection.hidden_states, torch.stack(out.hidden_states)[:, 0], atol=1e-5, rtol=0)
    assert inspection.model_name == "all-MiniLM-L6-v2"


def test_inspect_rows_are_probabilities(encoder: Encoder) -> None:
    attentions = encoder.inspect(INSPECTED[0]).attentions
    assert attentions.min() >= 0
    torch.testing.assert_close(attentions.sum(dim=-1), torch.ones(attentions.shape[:-1]))


@pytest.mark.parametrize("text", ["", "   \n"])
def test_inspect_empty_text(encoder: Encoder, text: str) -> None:
    with pytest.raises(ValueError, match="empty"):
        encoder.inspect(text)


def test_context_matches_cosines_of_transformers_hidden_states(encoder: Encoder, hf_model) -> None:
    # "bank" is token 5 in both texts: same word, position and segment -> the embeddings agree
    # exactly, and attention makes them drift apart.
    river, money = "I sat on the bank of the river.", "I paid at the bank with cash."
    similarity = encoder.context("bank", river, money)
    assert similarity.shape == (7,)
    states = []
    for text in (river, money):
        ids = torch.tensor([encoder.tokenizer.encode(text).ids])
        with torch.no_grad():
            states.append(torch.stack(hf_model(ids, output_hidden_states=True).hidden_states)[:, 0, 5])
    expected = F.cosine_similarity(states[0], states[1], dim=-1)
    torch.testing.assert_close(similarity, expected, atol=1e-5, rtol=0)
    assert similarity[0] == pytest.approx(1.0, abs=1e-6)
    assert similarity[-1] < 0.95


def test_context_missing_word(encoder: Encoder) -> None:
    with pytest.raises(ValueError, match="'bank' is not a word of the text"):
        encoder.context("bank", "I sat on the bank.", "I paid in cash.")


# -- loading ---------------------------------------------------------------------------------


def test_builtin_names_and_directory_load_the_same_model(encoder: Encoder, model_dir: Path) -> None:
    assert resolve_model_dir("sentence-transformers/all-MiniLM-L6-v2") == model_dir
    assert resolve_model_dir("all-MiniLM-L6-v2") == model_dir
    by_path = load_encoder(model_dir)
    for (name, a), (_, b) in zip(encoder.model.state_dict().items(), by_path.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert by_path.name == str(model_dir)


def test_builtin_model_is_found_without_importing_its_package(model_dir: Path) -> None:
    """The built-in model's directory comes from the import path (find_spec), so qkv_minilm's
    code never runs; here the test imported it only for the independent MODEL_DIR."""
    assert builtin_model_dir() == model_dir
    assert all((model_dir / name).is_file() for name in ("config.json", "tokenizer.json", "model.safetensors"))


def test_builtin_model_package_missing_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encoder_module, "_BUILTIN_MODULE", "qkv_minilm_not_installed")
    with pytest.raises(FileNotFoundError, match=r"package qkv-minilm, which is not installed: pip install qkv-minilm"):
        load_encoder()


def test_builtin_model_package_incomplete_names_the_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model_dir: Path
) -> None:
    package = tmp_path / "qkv_minilm_damaged"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('qkv must not import the model package')\n")
    (package / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(encoder_module, "_BUILTIN_MODULE", "qkv_minilm_damaged")
    with pytest.raises(FileNotFoundError, match=r"lacks tokenizer\.json, model\.safetensors; reinstall it"):
        resolve_model_dir("all-MiniLM-L6-v2")


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="neither a directory nor a built-in model"):
        load_encoder(tmp_path / "nope")


def test_file_instead_of_directory(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="is a file"):
        load_encoder(model_dir / "config.json")


def test_directory_missing_files(tmp_path: Path, model_dir: Path) -> None:
    (tmp_path / "config.json").write_bytes((model_dir / "config.json").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"lacks tokenizer\.json, model\.safetensors"):
        load_encoder(tmp_path)


def test_pickle_only_directory_is_refused(tmp_path: Path, model_dir: Path) -> None:
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    torch.save({"embeddings.word_embeddings.weight": torch.zeros(2, 2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"only pickle weights \(pytorch_model\.bin\)"):
        load_encoder(tmp_path)


def test_bin_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pickle checkpoint"):
        load_encoder(tmp_path / "pytorch_model.bin")


def test_token_ids_are_the_reference_tokenizers(encoder: Encoder, st_model) -> None:
    # encode reads ids only (Encoder.token_ids); they must be the ids of tokenize and of
    # sentence-transformers' own tokenizer, cut the same way past 512 positions
    texts = ["A man is playing a guitar.", "苹果 发布 手机", "attention " * 600, ""]
    want = st_model.tokenizer(texts, truncation=True, max_length=512)["input_ids"]
    assert encoder.token_ids(texts, truncate=True) == want
    assert [t.ids for t in encoder.tokenize(texts, truncate=True)] == want
    assert encoder.tokenizer.lengths(texts[:2]) == [len(ids) for ids in want[:2]]
    with pytest.raises(ValueError, match=r"512 positions"):
        encoder.token_ids(texts)


@pytest.mark.parametrize("text", ["caf\udce9", "a\ud800b", "\udcff" + "x" * 60])
def test_a_lone_surrogate_is_refused_naming_the_text(encoder: Encoder, text: str) -> None:
    """Python makes lone surrogates from bytes that were not UTF-8; the tokenizer would answer
    with its own TypeError, naming neither the text nor the cause."""
    bad = next(i for i, c in enumerate(text) if 0xD800 <= ord(c) <= 0xDFFF)
    with pytest.raises(ValueError, match=rf"lone surrogate \(U\+{ord(text[bad]):04X}\) at character {bad}"):
        encoder.inspect(text)
    with pytest.raises(ValueError, match=r"^text 1 .*lone surrogate"):
        encoder.encode(["fine", text])
    with pytest.raises(ValueError, match="lone surrogate"):
        encoder.token_counts([text])


def test_token_counts_include_cls_and_sep(encoder: Encoder) -> None:
    # "the cat sat" is three WordPiece tokens of the uncased vocabulary, plus [CLS] and [SEP]
    assert encoder.token_counts(["the cat sat", "hello"]) == [5, 3]
