"""The address book: every number the article prints, from the computed values and by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from rich.console import Console

from qkv.examples import address_book


@pytest.fixture(scope="module")
def result() -> address_book.Result:
    return address_book.run()


def test_the_book_is_the_articles(result: address_book.Result) -> None:
    # keys over [about Zhang San, about Li Si, is address, is phone]; one-hot values
    np.testing.assert_array_equal(result.keys, [[1, 0, 1, 0], [1, 0, 0, 1], [0, 1, 1, 0]])
    np.testing.assert_array_equal(result.values, np.eye(3))
    np.testing.assert_array_equal(result.lookups[0].trace.q, [[3, 0, 3, 0]])


def test_where_does_zhang_san_live(result: address_book.Result) -> None:
    first = result.lookups[0]
    t = first.trace
    np.testing.assert_array_equal(t.scores, [[6, 3, 3]])  # 3+3, 3, 3
    np.testing.assert_array_equal(t.scaled, [[3, 1.5, 1.5]])  # / sqrt(4)
    assert [round(float(e), 3) for e in first.exponentials] == [20.086, 4.482, 4.482]
    assert round(first.total, 3) == 29.049
    assert [round(float(w), 3) for w in t.weights[0]] == [0.691, 0.154, 0.154]
    assert round(100 * float(t.output[0, 0])) == 69  # "69 % Xi'an"
    assert first.answer == "Xi'an"


def test_where_does_zhang_san_live_by_hand(result: address_book.Result) -> None:
    first = result.lookups[0]
    e3, e15 = math.exp(3.0), math.exp(1.5)
    np.testing.assert_allclose(first.exponentials, [e3, e15, e15], rtol=1e-15)
    assert first.total == pytest.approx(e3 + 2 * e15, rel=1e-15)
    total = e3 + 2 * e15
    # one-hot values: the output is the weights themselves
    np.testing.assert_allclose(first.trace.output, [[e3 / total, e15 / total, e15 / total]], rtol=1e-14)
    np.testing.assert_allclose(first.exponentials / first.total, first.trace.weights[0], rtol=1e-14)


def test_another_question_gets_another_answer(result: address_book.Result) -> None:
    second = result.lookups[1]
    np.testing.assert_array_equal(second.trace.k, result.lookups[0].trace.k)  # same book
    np.testing.assert_array_equal(second.trace.v, result.lookups[0].trace.v)
    np.testing.assert_array_equal(second.trace.scaled, [[1.5, 3, 0]])
    e = np.exp([1.5, 3.0, 0.0])
    np.testing.assert_allclose(second.trace.weights[0], e / e.sum(), rtol=1e-14)
    assert [round(float(w), 3) for w in second.trace.weights[0]] == [0.175, 0.786, 0.039]
    assert second.answer == "138xxxx"


def test_render_prints_the_articles_numbers(result: address_book.Result) -> None:
    console = Console(record=True, width=120)
    console.print(result.render())
    text = console.export_text()
    for number in ("20.086", "4.482", "29.049", "0.691", "0.154", "69% Xi'an"):
        assert number in text


def test_json_holds_every_intermediate_unrounded(result: address_book.Result) -> None:
    data = json.loads(json.dumps(result.to_json(), allow_nan=False))
    lookup = data["lookups"][0]
    for step in ("q", "k", "v", "scores", "scaled", "weights", "output", "lse"):
        np.testing.assert_array_equal(lookup["trace"][step], getattr(result.lookups[0].trace, step))
    assert lookup["exponentials"] == result.lookups[0].exponentials.tolist()
    assert lookup["total"] == result.lookups[0].total
