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
    """The difference the example reports, computed apart: X + PE through the apple matrices and PyTorch's SDPA."""
    import torch
    import torch.nn.functional as F

    from qkv.examples.apple import W_K, W_Q, W_V, WORDS
    from qkv.nn.positional import sinusoidal_table

    x = torch.tensor([WORDS[t] for t in ("我", "吃", "苹果")], dtype=torch.float64)  # (L, 4)
    pe = sinusoidal_table(3, 4)  # (L, 4) float64
    shuffle = [2, 1, 0]  # 苹果 吃 我

    def outputs(rows: torch.Tensor) -> torch.Tensor:
        q, k, v = (rows @ torch.from_numpy(w) for w in (W_Q, W_K, W_V))  # (L, 2) each
        return F.scaled_dot_product_attention(q[None], k[None], v[None])[0]  # (L, 2)

    expected = float((outputs(x[shuffle] + pe) - outputs(x + pe)[shuffle]).abs().max())
    assert expected > 0.1
    assert result.encoded.max_difference == pytest.approx(expected, rel=1e-12)


def test_sinusoidal_table_by_hand(result: permutation.Result) -> None:
    pe = result.positional
    assert pe.shape == (3, 4)
    for pos in range(3):
        expected = [math.sin(pos), math.cos(pos), math.sin(pos / 100), math.cos(pos / 100)]  # 10000^(2/4) = 100
        np.testing.assert_allclose(pe[pos], expected, rtol=1e-15, atol=1e-16)


def test_sinusoidal_table_matches_qkv_positional() -> None:
    from qkv.nn.positional import sinusoidal_table

    for length, d in ((3, 4), (17, 10), (5, 7)):
        np.testing.assert_allclose(permutation.sinusoidal_table(length, d), sinusoidal_table(length, d).numpy(), atol=1e-15)
