"""Permuting tokens permutes outputs; with sinusoidal positions added it no longer does."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qkv.examples import permutation


@pytest.fixture(scope="module")
def result() -> permutation.Result:
    return permutation.run()


def test_plain_attention_is_permutation_equivariant(result: permutation.Result) -> None:
    plain = result.plain
    assert plain.shuffled.tokens == ("苹果", "吃", "我")
    np.testing.assert_allclose(plain.shuffled.trace.output, plain.original.trace.output[list(result.order)], atol=1e-15)
    assert plain.max_difference < 1e-15
    # the same weights, rows and columns permuted
    order = list(result.order)
    np.testing.assert_allclose(plain.shuffled.trace.weights, plain.original.trace.weights[order][:, order], atol=1e-15)


def test_positions_break_it(result: permutation.Result) -> None:
    assert result.encoded.max_difference > 0.1
    assert round(result.encoded.max_difference, 3) == round(
        float(np.abs(result.encoded.shuffled.trace.output - result.encoded.original.trace.output[list(result.order)]).max()), 3
    )


def test_sinusoidal_table_by_hand(result: permutation.Result) -> None:
    pe = result.positional
    assert pe.shape == (3, 4)
    for pos in range(3):
        expected = [math.sin(pos), math.cos(pos), math.sin(pos / 100), math.cos(pos / 100)]  # 10000^(2/4) = 100
        np.testing.assert_allclose(pe[pos], expected, rtol=1e-15, atol=1e-16)


def test_sinusoidal_table_matches_qkv_positional() -> None:
    from qkv.positional import sinusoidal_table

    for length, d in ((3, 4), (17, 10), (5, 7)):
        np.testing.assert_allclose(permutation.sinusoidal_table(length, d), sinusoidal_table(length, d).numpy(), atol=1e-15)
