"""The address book gives the same answer through the reference, qkv.attention and SDPA."""

from __future__ import annotations

import numpy as np

from qkv.examples import agreement


def test_three_implementations_agree() -> None:
    result = agreement.run()
    names = [p.name for p in result.paths]
    assert names == ["qkv auto", "qkv fused", "qkv math", "torch SDPA"]
    assert result.max_difference < 1e-14
    assert [round(float(w), 3) for w in result.reference_output[0]] == [0.691, 0.154, 0.154]
    for p in result.paths:
        np.testing.assert_allclose(p.output, result.reference_output, atol=1e-14)
        if p.weights is not None:
            np.testing.assert_allclose(p.weights, result.reference_weights, atol=1e-14)
