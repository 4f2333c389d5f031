"""var(q.k) grows like d_k and is back to 1 after scaling; the article's two softmax rows."""

from __future__ import annotations

import math

import pytest

from qkv.examples import scaling


@pytest.fixture(scope="module")
def result() -> scaling.Result:
    return scaling.run()


def test_variance_grows_like_d_k(result: scaling.Result) -> None:
    assert [r.d_k for r in result.variances] == list(scaling.DIMENSIONS)
    for r in result.variances:
        # 20 000 samples: the estimate is within a few percent (kurtosis 9 at d_k = 1)
        assert r.var_raw == pytest.approx(r.d_k, rel=0.06)
        assert r.var_scaled == pytest.approx(1.0, rel=0.06)
        assert r.var_scaled == pytest.approx(r.var_raw / r.d_k, rel=1e-12)
        assert r.std_raw == pytest.approx(math.sqrt(r.var_raw), rel=1e-12)


def test_about_eight_at_64(result: scaling.Result) -> None:
    row = result.row(64)
    assert round(row.std_raw) == 8  # "±8"
    assert round(row.std_scaled) == 1


def test_softmax_rows(result: scaling.Result) -> None:
    small, large = result.softmax_outputs
    assert [round(float(p), 2) for p in small] == [0.09, 0.24, 0.67]
    assert [round(float(p), 2) for p in large] == [0.0, 0.0, 1.0]
    total = sum(math.exp(x) for x in (1, 2, 3))
    assert small.tolist() == pytest.approx([math.exp(x) / total for x in (1, 2, 3)], rel=1e-14)
    assert large[2] == pytest.approx(1 / (1 + math.exp(-10) + math.exp(-20)), rel=1e-14)


def test_seeded(result: scaling.Result) -> None:
    assert scaling.run().variances == result.variances
