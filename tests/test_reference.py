"""The NumPy reference against hand calculation: references have bugs too."""

from __future__ import annotations

import math

import numpy as np
import pytest

from qkv import reference as R


def test_softmax_of_the_articles_rows() -> None:
    # softmax([1, 2, 3]) by hand: e^1, e^2, e^3 over their sum
    e = [math.exp(1), math.exp(2), math.exp(3)]
    weights, lse = R.softmax(np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(weights, [x / sum(e) for x in e], rtol=1e-15)
    assert lse == pytest.approx(math.log(sum(e)), rel=1e-15)
    np.testing.assert_allclose(np.round(weights, 2), [0.09, 0.24, 0.67])


def test_softmax_is_stable_for_huge_scores() -> None:
    weights, lse = R.softmax(np.array([1000.0, 1000.0, -1000.0]))
    np.testing.assert_allclose(weights, [0.5, 0.5, 0.0], atol=1e-300)
    assert lse == pytest.approx(1000.0 + math.log(2.0))


def test_softmax_masked_and_empty_rows() -> None:
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = np.array([[True, False, True], [False, False, False]])
    weights, lse = R.softmax(x, mask)
    z = math.exp(1) + math.exp(3)
    np.testing.assert_allclose(weights[0], [math.exp(1) / z, 0.0, math.exp(3) / z])
    np.testing.assert_array_equal(weights[1], [0.0, 0.0, 0.0])
    assert lse[1] == -np.inf
    assert not np.isnan(weights).any()


def test_attention_by_hand_on_a_two_token_example() -> None:
    # q = [1, 0]; keys [1, 0] and [0, 1]; d_k = 2, so scaled scores are 1/sqrt(2) and 0.
    q = np.array([[1.0, 0.0]])
    k = np.array([[1.0, 0.0], [0.0, 1.0]])
    v = np.array([[10.0], [20.0]])
    trace = R.attention(q, k, v)
    a = math.exp(1 / math.sqrt(2))
    w = [a / (a + 1), 1 / (a + 1)]
    np.testing.assert_allclose(trace.scores, [[1.0, 0.0]])
    np.testing.assert_allclose(trace.scaled, [[1 / math.sqrt(2), 0.0]])
    np.testing.assert_allclose(trace.weights, [w])
    np.testing.assert_allclose(trace.output, [[10 * w[0] + 20 * w[1]]])


def test_custom_scale_and_float_mask() -> None:
    q = np.array([[1.0, 2.0]])
    k = np.array([[1.0, 1.0], [2.0, 0.0]])
    v = np.eye(2)
    trace = R.attention(q, k, v, mask=np.array([[0.0, -1.0]]), scale=0.5)
    # raw scores 3 and 2, times 0.5 -> 1.5 and 1.0, plus mask -> 1.5 and 0.0
    z = math.exp(1.5) + math.exp(0.0)
    np.testing.assert_allclose(trace.weights, [[math.exp(1.5) / z, 1 / z]])


def test_self_attention_projects_with_independent_dims() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 7))  # D = 7
    w_q, w_k, w_v = rng.standard_normal((7, 3)), rng.standard_normal((7, 3)), rng.standard_normal((7, 4))
    trace = R.self_attention(x, w_q, w_k, w_v)
    assert trace.output.shape == (5, 4)
    # one token by hand: row 2's output is sum_j softmax_j(q2 . k_j / sqrt(3)) v_j
    q2, keys, values = x[2] @ w_q, x @ w_k, x @ w_v
    logits = keys @ q2 / math.sqrt(3)
    p = np.exp(logits - logits.max())
    np.testing.assert_allclose(trace.output[2], (p / p.sum()) @ values, rtol=1e-12)


def test_cross_attention_reads_keys_and_values_from_the_context() -> None:
    rng = np.random.default_rng(1)
    x, ctx = rng.standard_normal((2, 4)), rng.standard_normal((6, 5))
    w_q, w_k, w_v = rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
    trace = R.cross_attention(x, ctx, w_q, w_k, w_v)
    assert trace.weights.shape == (2, 6)
    np.testing.assert_allclose(trace.v, ctx @ w_v)


def test_multi_head_is_concat_of_single_heads_then_w_o() -> None:
    rng = np.random.default_rng(2)
    H, G, D, E, Ev = 4, 2, 6, 3, 5
    x = rng.standard_normal((7, D))
    w_q, w_k, w_v = rng.standard_normal((H, D, E)), rng.standard_normal((G, D, E)), rng.standard_normal((G, D, Ev))
    w_o = rng.standard_normal((H * Ev, D))
    b_q, b_o = rng.standard_normal((H, E)), rng.standard_normal(D)
    mh = R.multi_head_attention(x, w_q, w_k, w_v, w_o, b_q=b_q, b_o=b_o)
    outs = []
    for h in range(H):
        g = h // (H // G)
        single = R.attention(x @ w_q[h] + b_q[h], x @ w_k[g], x @ w_v[g])
        outs.append(single.output)
    np.testing.assert_allclose(mh.concat, np.concatenate(outs, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(mh.output, np.concatenate(outs, axis=-1) @ w_o + b_o, rtol=1e-12)


def test_attention_grads_match_finite_differences() -> None:
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((1, 5, 4)), rng.standard_normal((1, 5, 2))
    mask = rng.random((3, 5)) > 0.3
    mask[1] = False  # one fully masked row
    d_out = rng.standard_normal((2, 3, 2))

    def loss(q_: np.ndarray, k_: np.ndarray, v_: np.ndarray) -> float:
        return float((R.attention(q_, k_, v_, mask=mask).output * d_out).sum())

    dq, dk, dv = R.attention_grads(R.attention(q, k, v, mask=mask), d_out)
    for analytic, arr, index in ((dq, q, 0), (dk, k, 1), (dv, v, 2)):
        numeric = np.zeros_like(arr)
        for idx in np.ndindex(arr.shape):
            args = [q.copy(), k.copy(), v.copy()]
            args[index][idx] += 1e-6
            up = loss(*args)
            args[index][idx] -= 2e-6
            numeric[idx] = (up - loss(*args)) / 2e-6
        np.testing.assert_allclose(analytic, numeric, atol=1e-7)


def test_mismatched_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="E"):
        R.attention(np.ones((2, 3)), np.ones((2, 4)), np.ones((2, 4)))
    with pytest.raises(ValueError, match="length S"):
        R.attention(np.ones((2, 3)), np.ones((2, 3)), np.ones((4, 3)))
    with pytest.raises(ValueError, match="multiple"):
        R.attention(np.ones((3, 2, 4)), np.ones((2, 2, 4)), np.ones((2, 2, 4)))
