"""Cross-attention: decoder queries, encoder keys and values, an L x S weight matrix."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qkv import reference
from qkv.examples import cross_attention


def test_decoder_reads_encoder() -> None:
    result = cross_attention.run()
    t = result.trace
    assert result.x.shape == (2, 3) and result.context.shape == (3, 4)  # L, D and S, Dc
    assert t.q.shape == (2, 3) and t.k.shape == (3, 3) and t.v.shape == (3, 4)  # E = 3, Ev = 4
    assert t.weights.shape == (2, 3) and t.output.shape == (2, 4)
    e = math.exp(3 / math.sqrt(3))
    assert t.weights[0, 0] == pytest.approx(e / (e + 2), rel=1e-15)
    assert round(float(t.weights[0, 0]), 3) == 0.739
    assert [(d, s) for d, s, _ in result.read()] == [("我", "I"), ("吃", "eat")]
    np.testing.assert_allclose(t.weights.sum(axis=1), 1.0, rtol=1e-15)


def test_queries_only_from_the_decoder() -> None:
    result = cross_attention.run()
    # the source read in reverse order: the queries stay, and since attention is a weighted sum
    # over keys, the output is the same while the weights' columns are reversed
    other = reference.cross_attention(result.x, result.context[::-1], result.w_q, result.w_k, result.w_v)
    np.testing.assert_array_equal(other.q, result.trace.q)
    np.testing.assert_allclose(other.output, result.trace.output, atol=1e-15)  # a permuted source: same answer
    np.testing.assert_allclose(other.weights, result.trace.weights[:, ::-1], atol=1e-15)
