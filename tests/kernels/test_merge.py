"""`merge_partial` against the float64 reference: two key halves merge to the whole softmax."""

from __future__ import annotations

import math

import numpy as np
import torch

from qkv import reference as R
from qkv.backends.merge import merge_partial, merge_split

NEG_INF = float("-inf")


def _partial(q: np.ndarray, k: np.ndarray, v: np.ndarray, keys: slice, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized output and lse of q over the keys ``keys`` only, from the reference's scores."""
    trace = R.attention(q, k[keys], v[keys], scale=scale)
    scaled = trace.scaled  # (L, S_part)
    lse = np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1)) + scaled.max(-1)
    return torch.from_numpy(trace.output), torch.from_numpy(lse)


def test_two_key_halves_merge_to_the_reference() -> None:
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(7, 5)), rng.normal(size=(13, 5)), rng.normal(size=(13, 3))
    out = torch.zeros(7, 3, dtype=torch.float64)
    lse = torch.full((7,), NEG_INF, dtype=torch.float64)
    for keys in (slice(0, 4), slice(4, 13)):
        merge_partial(out, lse, *_partial(q, k, v, keys, 0.4))
    whole = R.attention(q, k, v, scale=0.4)
    np.testing.assert_allclose(out.numpy(), whole.output, atol=1e-13, rtol=0)
    scaled = whole.scaled
    np.testing.assert_allclose(lse.numpy(), np.log(np.exp(scaled).sum(-1)), atol=1e-13, rtol=0)


def test_extreme_scores_and_empty_rows() -> None:
    # lse far apart: the smaller side's weight underflows to 0, no inf or NaN
    out = torch.tensor([[1.0, 2.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    lse = torch.tensor([1000.0, NEG_INF, NEG_INF], dtype=torch.float64)
    out_b = torch.tensor([[5.0, 6.0], [3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    lse_b = torch.tensor([-1000.0, 2.0, NEG_INF], dtype=torch.float64)
    merge_partial(out, lse, out_b, lse_b)
    # row 0: the first side alone; row 1: nothing seen yet takes the other side; row 2: stays empty
    assert torch.equal(out, torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]], dtype=torch.float64))
    assert lse.tolist() == [1000.0, 2.0, NEG_INF]


def test_equal_halves_average() -> None:
    # hand calculation: equal lse on both sides -> the outputs average, lse grows by log 2
    out, lse = torch.tensor([[2.0]]), torch.tensor([0.5])
    merge_partial(out, lse, torch.tensor([[4.0]]), torch.tensor([0.5]))
    assert torch.allclose(out, torch.tensor([[3.0]])) and torch.allclose(lse, torch.tensor([0.5 + float(np.log(2.0))]))


def test_merge_split_keeps_log_counts_under_offsets_near_the_float32_limit() -> None:
    # two pieces of a row that a bias of finfo.min hides: 3 and 5 keys of equal score. One
    # rounded float32 lse per piece is the offset alone, and merge_partial weighs them 1:1;
    # the split lse keeps log 3 and log 5, so the outputs average 3:5 as the softmax does.
    big = torch.finfo(torch.float32).min
    out = torch.tensor([[1.0, 0.0]])
    shift, rest = torch.tensor([big]), torch.tensor([math.log(3.0)])
    merge_split(out, shift, rest, torch.tensor([[0.0, 1.0]]), torch.tensor([big]), torch.tensor([math.log(5.0)]))
    torch.testing.assert_close(out, torch.tensor([[3 / 8, 5 / 8]]))
    assert float(shift) == big and math.isclose(float(rest), math.log(8.0), rel_tol=1e-6)
    # a piece that sees nothing (-inf, -inf) leaves the other as it is, and two give zeros
    out = torch.tensor([[2.0, 4.0], [0.0, 0.0]])
    shift, rest = torch.tensor([big, float("-inf")]), torch.tensor([0.5, float("-inf")])
    empty = torch.tensor([float("-inf")] * 2)
    merge_split(out, shift, rest, torch.tensor([[9.0, 9.0], [9.0, 9.0]]), empty, empty.clone())
    torch.testing.assert_close(out, torch.tensor([[2.0, 4.0], [0.0, 0.0]]))
    assert float(shift[0]) == big and float(rest[0]) == 0.5 and math.isinf(float(shift[1] + rest[1]))
