"""`Inspection.attention_between` and `qkv.inspect.pronoun.pronoun_heads` on hand-built
inspections of "trophy suitcase it" (suitcase split into two pieces); expected weights are
the rows written here, summed and averaged by hand."""

from __future__ import annotations

import pytest
import torch

from qkv.inspect import Inspection
from qkv.inspect.pronoun import PronounHead, pronoun_heads

TOKENS = ["[CLS]", "trophy", "suit", "##case", "it", "[SEP]"]
T = len(TOKENS)


def _inspection(it_rows: list[list[float]]) -> Inspection:
    """One layer, one head per entry of ``it_rows``: the row of "it" (token 4); "suit" looks at
    "trophy" and "##case" at "it"; every other row is uniform."""
    heads = []
    for it_row in it_rows:
        a = torch.full((T, T), 1 / T)
        a[2] = torch.tensor([0, 1.0, 0, 0, 0, 0])
        a[3] = torch.tensor([0, 0, 0, 0, 1.0, 0])
        a[4] = torch.tensor(it_row)
        heads.append(a)
    return Inspection(
        text="trophy suitcase it",
        tokens=TOKENS,
        offsets=[(0, 0), (0, 6), (7, 11), (11, 15), (16, 18), (0, 0)],
        word_ids=[None, 0, 1, 1, 2, None],
        attentions=torch.stack(heads)[None],  # (layers=1, heads, T, T)
        hidden_states=torch.zeros(2, T, 4),
    )


TROPHY_HEAD = [0.1, 0.5, 0.1, 0.2, 0.1, 0.0]  # "it" -> trophy 0.5, suitcase 0.1 + 0.2
SUITCASE_HEAD = [0.2, 0.1, 0.3, 0.3, 0.1, 0.0]  # "it" -> trophy 0.1, suitcase 0.6


def test_a_key_word_receives_the_sum_of_its_pieces() -> None:
    inspection = _inspection([TROPHY_HEAD, SUITCASE_HEAD])
    torch.testing.assert_close(inspection.attention_between("it", "trophy"), torch.tensor([[0.5, 0.1]]))
    torch.testing.assert_close(inspection.attention_between("it", "suitcase"), torch.tensor([[0.3, 0.6]]))


def test_a_query_word_looks_the_way_its_pieces_look_on_average() -> None:
    inspection = _inspection([TROPHY_HEAD])
    # "suit" gives trophy 1, "##case" gives it 1: the word gives each half
    torch.testing.assert_close(inspection.attention_between("suitcase", "trophy"), torch.tensor([[0.5]]))
    torch.testing.assert_close(inspection.attention_between("suitcase", "it"), torch.tensor([[0.5]]))


def test_a_missing_word_is_named() -> None:
    with pytest.raises(ValueError, match="'box' is not a word of the text"):
        _inspection([TROPHY_HEAD]).attention_between("it", "box")


def test_pronoun_heads_rank_by_the_weight_on_trophy_in_the_big_sentence() -> None:
    big = _inspection([SUITCASE_HEAD, TROPHY_HEAD])
    small = _inspection([TROPHY_HEAD, SUITCASE_HEAD])
    rows = pronoun_heads(big, small)
    assert rows == [
        PronounHead(0, 1, big_trophy=pytest.approx(0.5), big_suitcase=pytest.approx(0.3),
                    small_trophy=pytest.approx(0.1), small_suitcase=pytest.approx(0.6)),
        PronounHead(0, 0, big_trophy=pytest.approx(0.1), big_suitcase=pytest.approx(0.6),
                    small_trophy=pytest.approx(0.5), small_suitcase=pytest.approx(0.3)),
    ]


def test_inspections_of_different_models_are_refused() -> None:
    with pytest.raises(ValueError, match=r"different models: 1 x 2 and 1 x 1 \(layers x heads\)"):
        pronoun_heads(_inspection([TROPHY_HEAD, SUITCASE_HEAD]), _inspection([TROPHY_HEAD]))
