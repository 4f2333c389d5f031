"""The same 苹果 vector leaves attention as food, tech or undecided, depending on the verb."""

from __future__ import annotations

import math

import numpy as np

from qkv.examples import context


def test_same_input_different_outputs() -> None:
    result = context.run()
    np.testing.assert_array_equal(result.inputs, [[0, 1, 0.5, 0.5]] * 3)
    assert [[round(float(x), 3) for x in out] for out in result.outputs] == [[0.855, 0.048], [0.048, 0.952], [0.048, 0.048]]
    for run, weights in zip(result.sentences, result.focus_weights, strict=True):
        verb = int(np.argmax(weights))
        assert run.x[verb, 0] == 1  # the largest weight is on the verb
        assert round(float(weights[verb]), 3) == 0.807
    np.testing.assert_allclose(np.diag(result.cosine), 1.0, rtol=1e-15)
    np.testing.assert_allclose(result.cosine, result.cosine.T, rtol=1e-15)
    assert result.cosine[0, 1] < 0.2  # food and tech 苹果 point different ways


def test_undecided_apple_by_hand() -> None:
    # 我 买 苹果: weight w = e^(3/sqrt 2) / (e^(3/sqrt 2) + 2) on 买, (1 - w) / 2 on 我 and on 苹果.
    # Values [food, tech]: 买 [0, 0], 我 [0, 0], 苹果 [0.5, 0.5]; so the output is 0.5 * (1 - w) / 2 twice.
    e = math.exp(3 / math.sqrt(2))
    rest = (1 - e / (e + 2)) / 2
    np.testing.assert_allclose(context.run().outputs[2], [0.5 * rest, 0.5 * rest], rtol=1e-14)
