"""Gradient descent learns the article's mechanism: the noun's weight goes to the verb."""

from __future__ import annotations

import numpy as np
import pytest

from qkv.examples import learned


@pytest.fixture(scope="module")
def result() -> learned.Result:
    return learned.run()


def test_training_learns_the_sense(result: learned.Result) -> None:
    assert result.accuracy_before < 0.7
    assert result.accuracy_after >= 0.99
    assert result.verb_weight_after > 0.9 > result.verb_weight_before
    assert result.losses[-1] < 0.01 < result.losses[0]


def test_article_sentences(result: learned.Result) -> None:
    senses = []
    for reading in result.readings:
        verb = next(i for i, t in enumerate(reading.tokens) if learned.KIND_OF[t].endswith("verb"))
        assert int(np.argmax(reading.noun_weights)) == verb
        assert reading.noun_weights[verb] > 0.9
        senses.append(learned.SENSES[int(np.argmax(reading.probabilities))])
        np.testing.assert_allclose(reading.probabilities.sum(), 1.0, rtol=1e-14)
    # 我 吃 苹果 / 苹果 发布 手机 / 他 在 电脑 前 吃 小米 (the other noun is tech; the verb wins)
    assert senses == ["food", "tech", "food"]
    assert result.module_difference < 1e-5  # float32 module vs float64 reference


def test_deterministic(result: learned.Result) -> None:
    again = learned.run()
    np.testing.assert_array_equal(again.losses, result.losses)
    np.testing.assert_array_equal(again.w_q, result.w_q)


def test_generated_sentences() -> None:
    batch = learned.generate(np.random.default_rng(1), 500, 6, max_other_nouns=2)
    words = np.array(learned.VOCABULARY)[batch.ids]  # (N, L)
    rows = np.arange(500)
    assert all(learned.KIND_OF[w] == "ambiguous" for w in words[rows, batch.noun])
    verb_kinds = [learned.KIND_OF[w] for w in words[rows, batch.verb]]
    assert verb_kinds == [("food verb", "tech verb")[s] for s in batch.sense]
    for sentence in words:
        kinds = [learned.KIND_OF[w] for w in sentence]
        assert kinds.count("ambiguous") == 1
        assert kinds.count("food verb") + kinds.count("tech verb") == 1
        assert kinds.count("food noun") + kinds.count("tech noun") <= 2
    # the verb stands anywhere
    assert set(batch.verb.tolist()) == set(range(6))
