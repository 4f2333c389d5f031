"""The seeds' claims about attention, checked as properties on random inputs (hypothesis)."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

import qkv

sizes = st.integers(1, 12)
backends = st.sampled_from(["auto", "fused", "math"])
seeds = st.integers(0, 2**16)


def _qkv(L: int, S: int, seed: int, E: int = 5, Ev: int = 3) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, 2, L, E, generator=g, dtype=torch.float64),
        torch.randn(1, 2, S, E, generator=g, dtype=torch.float64),
        torch.randn(1, 2, S, Ev, generator=g, dtype=torch.float64),
    )


@given(L=sizes, S=sizes, seed=seeds, backend=backends)
def test_permuting_queries_permutes_outputs(L: int, S: int, seed: int, backend: str) -> None:
    q, k, v = _qkv(L, S, seed)
    perm = torch.randperm(L, generator=torch.Generator().manual_seed(seed))
    out = qkv.attention(q, k, v, backend=backend)
    torch.testing.assert_close(qkv.attention(q[:, :, perm], k, v, backend=backend), out[:, :, perm])


@given(L=sizes, S=sizes, seed=seeds, backend=backends)
def test_permuting_keys_and_values_together_changes_nothing(L: int, S: int, seed: int, backend: str) -> None:
    q, k, v = _qkv(L, S, seed)
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(
        qkv.attention(q, k[:, :, perm], v[:, :, perm], backend=backend), qkv.attention(q, k, v, backend=backend)
    )


@given(L=sizes, S=sizes, seed=seeds, backend=backends, density=st.floats(0.0, 1.0))
def test_weight_rows_sum_to_one_or_zero(L: int, S: int, seed: int, backend: str, density: float) -> None:
    q, k, v = _qkv(L, S, seed)
    mask = torch.rand(1, 1, L, S, generator=torch.Generator().manual_seed(seed)) < density
    _, weights = qkv.attention(q, k, v, mask, return_weights=True, backend=backend)
    expected = mask.any(-1).double().expand(1, 2, L)  # 1 where the row sees a key, else 0
    torch.testing.assert_close(weights.sum(-1), expected)
    assert (weights >= 0).all()


@given(L=sizes, S=sizes, seed=seeds, backend=backends, shift=st.floats(-50.0, 50.0))
def test_adding_a_constant_to_a_row_of_scores_changes_nothing(
    L: int, S: int, seed: int, backend: str, shift: float
) -> None:
    q, k, v = _qkv(L, S, seed)
    row_shift = torch.full((1, 1, L, 1), shift, dtype=torch.float64)  # the same constant across a row
    torch.testing.assert_close(
        qkv.attention(q, k, v, row_shift.expand(1, 1, L, S), backend=backend), qkv.attention(q, k, v, backend=backend)
    )


def test_reference_scores_have_variance_d_k_and_scaled_scores_variance_one() -> None:
    """The seeds' reason for 1/sqrt(d_k), on qkv.reference's own scores: for unit-variance
    entries var(q.k) = d_k (about +-8 at d_k = 64), and the scaled scores have variance 1."""
    from qkv import reference

    g = torch.Generator().manual_seed(0)
    for d_k in (16, 64, 256):
        q = torch.randn(1000, d_k, generator=g, dtype=torch.float64).numpy()
        k = torch.randn(1000, d_k, generator=g, dtype=torch.float64).numpy()
        trace = reference.attention(q, k, k[:, :1])
        # 10^6 scores, correlated through the 2,000 shared vectors: the sample variance is
        # within sqrt(2 * 2 / (d_k * 1000)) (1.6 % at d_k = 16) of d_k per standard deviation
        assert math.isclose(trace.scores.var(), d_k, rel_tol=0.08)
        assert math.isclose(trace.scaled.var(), 1.0, rel_tol=0.08)
