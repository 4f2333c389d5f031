"""我 吃 苹果: the reconstructed matrices reproduce 0.807, 0.855, 0.048 and, on 苹果 发布 手机,
0.807 and tech."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qkv import reference
from qkv.examples import apple


@pytest.fixture(scope="module")
def result() -> apple.Result:
    return apple.run()


def weight_on_verb(c: float) -> float:
    """苹果's weight on the only verb: scaled scores (0, c / sqrt(2), 0)."""
    e = math.exp(c / math.sqrt(2))
    return e / (e + 2)


def test_matrices() -> None:
    np.testing.assert_array_equal(apple.W_K, [[1, 0], [0, 1], [0, 0], [0, 0]])  # keeps verb, noun
    np.testing.assert_array_equal(apple.W_Q, [[0, 3], [3, 0], [0, 0], [0, 0]])  # crossed
    np.testing.assert_array_equal(apple.W_V, [[0, 0], [0, 0], [1, 0], [0, 1]])  # keeps food, tech


def test_apple_looks_at_eat(result: apple.Result) -> None:
    weights, output = result.focus_row(0)
    tokens = result.sentences[0].tokens
    assert tokens == ("我", "吃", "苹果")
    assert round(float(weights[tokens.index("吃")]), 3) == 0.807
    assert [round(float(x), 3) for x in output] == [0.855, 0.048]


def test_apple_by_hand(result: apple.Result) -> None:
    w = weight_on_verb(3.0)
    rest = (1 - w) / 2  # on 我 and on 苹果 itself
    weights, output = result.focus_row(0)
    np.testing.assert_allclose(weights, [rest, w, rest], rtol=1e-14)
    # 吃's value is [1, 0] (food), 我's [0, 0], 苹果's own [0.5, 0.5]
    np.testing.assert_allclose(output, [w + 0.5 * rest, 0.5 * rest], rtol=1e-14)
    assert round(w, 5) == 0.80662


def test_apple_releases_phones(result: apple.Result) -> None:
    weights, output = result.focus_row(1)
    tokens = result.sentences[1].tokens
    assert tokens == ("苹果", "发布", "手机")
    assert round(float(weights[tokens.index("发布")]), 3) == 0.807
    assert [round(float(x), 3) for x in output] == [0.048, 0.952]
    w = weight_on_verb(3.0)
    rest = (1 - w) / 2  # on 苹果 ([0.5, 0.5]) and on 手机 ([0, 1])
    np.testing.assert_allclose(output, [0.5 * rest, 0.5 * rest + w + rest], rtol=1e-14)
    assert output[1] > output[0]  # 苹果 became tech


def test_the_article_pins_the_question_strength() -> None:
    # 0.807 rounds out of c = 3 only in a narrow range, as the module docstring says
    assert round(weight_on_verb(2.999), 3) == 0.807
    assert round(weight_on_verb(3.0079), 3) == 0.807
    assert round(weight_on_verb(2.998), 3) != 0.807
    assert round(weight_on_verb(3.0081), 3) != 0.807


def test_every_token_matches_the_reference_formula(result: apple.Result) -> None:
    for run in result.sentences:
        t = run.trace
        np.testing.assert_array_equal(t.q, run.x @ apple.W_Q)
        np.testing.assert_array_equal(t.k, run.x @ apple.W_K)
        np.testing.assert_array_equal(t.v, run.x @ apple.W_V)
        direct = reference.attention(t.q, t.k, t.v)
        np.testing.assert_allclose(t.output, direct.output, rtol=1e-15)
        np.testing.assert_allclose(run.exponentials / run.exponentials.sum(axis=1, keepdims=True), t.weights, rtol=1e-14)
