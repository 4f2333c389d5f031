"""The questions asked of an `Inspection` (find a word, top attended tokens, a word's vectors,
context similarity) on an inspection built by hand, with answers worked out by hand."""

from __future__ import annotations

import pytest
import torch

from qkv.inspect import Inspection, context_similarity

#           0        1      2       3    4     5        6     7     8       9
TOKENS = ["[CLS]", "it", "fits", "the", "un", "##bel", "##ie", "it", "bank", "[SEP]"]
TEXT = "It fits the unbeliE it bank"
OFFSETS = [(0, 0), (0, 2), (3, 7), (8, 11), (12, 14), (14, 17), (17, 19), (20, 22), (23, 27), (0, 0)]
WORD_IDS = [None, 0, 1, 2, 3, 3, 3, 4, 5, None]
T, D = len(TOKENS), 2


def _inspection(hidden: torch.Tensor | None = None) -> Inspection:
    attentions = torch.zeros(2, 3, T, T)  # (layers, heads, T, T)
    attentions[..., 0] = 1.0  # every query looks at [CLS] ...
    attentions[1, 2, 1] = torch.tensor([0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.7, 0.0])  # ... but this one
    attentions[1, 2, 7] = torch.tensor([0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.2])
    if hidden is None:
        hidden = torch.arange(3 * T * D, dtype=torch.float32).reshape(3, T, D)  # (layers + 1, T, D)
    return Inspection(TEXT, TOKENS, OFFSETS, WORD_IDS, attentions, hidden, "hand-made")


def test_find_single_token_words_case_insensitively() -> None:
    inspection = _inspection()
    assert inspection.find("it") == [1]  # "It" at the start; never the "it" inside "fits"
    assert inspection.find("IT", occurrence=1) == [7]
    assert inspection.find("bank") == [8]


def test_find_a_word_of_several_pieces_and_a_phrase() -> None:
    inspection = _inspection()
    assert inspection.find("unbelie") == [4, 5, 6]
    assert inspection.find("the unbelie") == [3, 4, 5, 6]


@pytest.mark.parametrize("word", ["its", "unbel", "ank", "[CLS]", "river"])
def test_find_refuses_partial_and_absent_words(word: str) -> None:
    with pytest.raises(ValueError, match="is not a word of the text; its words are"):
        _inspection().find(word)


def test_find_bad_arguments() -> None:
    inspection = _inspection()
    with pytest.raises(ValueError, match="occurs 2 time"):
        inspection.find("it", occurrence=2)
    with pytest.raises(ValueError, match="non-empty"):
        inspection.find("  ")


def test_top_attended_by_hand() -> None:
    inspection = _inspection()
    top = inspection.top_attended(1, layer=1, head=2, k=2)
    assert [i for i, _ in top] == [8, 7]
    assert [w for _, w in top] == pytest.approx([0.7, 0.2])
    # a word of two tokens looks the way its rows look on average: [CLS] (0.1+0.5)/2, bank (0.7+0.3)/2
    top = inspection.top_attended([1, 7], layer=1, head=2, k=2)
    assert [i for i, _ in top] == [8, 0]
    assert [w for _, w in top] == pytest.approx([0.5, 0.3])
    assert len(inspection.top_attended(1, 0, 0, k=50)) == T


@pytest.mark.parametrize(
    ("args", "message"),
    [((10, 0, 0), "query must be token indices"), ((1, 2, 0), "layer must be in"),
     ((1, 0, 3), "head must be in"), (([], 0, 0), "query must be token indices")],
)
def test_top_attended_bad_arguments(args: tuple[object, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _inspection().top_attended(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((True, 0, 0), "query must be a token index"),  # True is not token 1
        (([1, False], 0, 0), "query must be a token index"),
        ((1.0, 0, 0), "query must be a token index"),
        (("it", 0, 0), "query must be a token index"),
        ((1, True, 0), "layer must be an int"),
        ((1, 0, 1.5), "head must be an int"),
    ],
)
def test_top_attended_refuses_wrong_types(args: tuple[object, object, object], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        _inspection().top_attended(*args)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="k must be an int"):
        _inspection().top_attended(1, 0, 0, k=True)


def test_occurrences_and_find_by_occurrence() -> None:
    inspection = _inspection()
    assert inspection.occurrences("it") == [[1], [7]]
    assert inspection.occurrences("river") == []
    assert inspection.find("it", 1) == [7]
    with pytest.raises(TypeError, match="occurrence must be an int"):
        inspection.find("it", True)  # type: ignore[arg-type]


def test_word_vectors_average_the_pieces() -> None:
    hidden = torch.zeros(3, T, D)
    hidden[:, 4] = torch.tensor([1.0, 2.0])
    hidden[:, 5] = torch.tensor([3.0, 4.0])
    hidden[:, 6] = torch.tensor([5.0, 9.0])
    vectors = _inspection(hidden).word_vectors("unbelie")
    assert vectors.shape == (3, D)
    torch.testing.assert_close(vectors, torch.tensor([[3.0, 5.0]] * 3))


def test_context_similarity_by_hand() -> None:
    a, b = torch.zeros(3, T, D), torch.zeros(3, T, D)
    a[:, 8] = torch.tensor([1.0, 0.0])
    b[:, 8] = torch.tensor([[2.0, 0.0], [1.0, 1.0], [0.0, 3.0]])  # same direction, 45 degrees, 90 degrees
    similarity = context_similarity(_inspection(a), _inspection(b), "bank")
    torch.testing.assert_close(similarity, torch.tensor([1.0, 2**-0.5, 0.0]))


def test_context_similarity_refuses_different_models() -> None:
    with pytest.raises(ValueError, match="different models"):
        context_similarity(_inspection(), _inspection(torch.zeros(5, T, D)), "bank")


def test_existing_word_aggregation_still_holds() -> None:
    # the viewers' contract: rows of word attention still sum to 1
    words = _inspection().word_attentions()
    torch.testing.assert_close(words.sum(-1), torch.ones(words.shape[:-1]))


def test_words_of_a_byte_level_bpe_tokenizer_whose_offsets_hold_the_space() -> None:
    """GPT-2's tokenizer counts the space before a word into its first token ("Ġit" spans
    " it"); every occurrence is still found, with or without the space in the query."""
    text = "it said it is New York it"
    #          it      Ġsaid     Ġit      Ġis      ĠNew      ĠYork      Ġit
    offsets = [(0, 2), (2, 7), (7, 10), (10, 13), (13, 17), (17, 22), (22, 25)]
    tokens = ["it", "Ġsaid", "Ġit", "Ġis", "ĠNew", "ĠYork", "Ġit"]
    inspection = Inspection(
        text, tokens, offsets, list(range(7)), torch.full((1, 1, 7, 7), 1 / 7), torch.zeros(2, 7, 1), "bpe"
    )
    assert inspection.occurrences("it") == [[0], [2], [6]]
    assert inspection.occurrences(" it") == [[0], [2], [6]]
    assert inspection.find("new york") == [4, 5]
    assert inspection.occurrences("is") == [[3]]  # a whole word
    assert inspection.words == ["it", "said", "it", "is", "New", "York", "it"]
    with pytest.raises(ValueError, match=r"its words are \['it', 'said', 'it', 'is', 'New', 'York', 'it'\]"):
        inspection.find("cat")
