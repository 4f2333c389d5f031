"""The second article's sketch, looped over heads, equals the reference's multi-head attention."""

from __future__ import annotations

import numpy as np

from qkv.examples import multi_head


def test_sketch_equals_reference_and_shapes() -> None:
    result = multi_head.run()
    t = result.trace
    L, D, H, E = len(multi_head.TOKENS), multi_head.D_MODEL, multi_head.HEADS, multi_head.D_HEAD
    assert t.heads.q.shape == (H, L, E) and t.heads.weights.shape == (H, L, L)
    assert t.concat.shape == (L, H * E) and t.output.shape == (L, D)
    assert result.sketch_difference < 1e-14
    np.testing.assert_allclose(result.sketch_output, t.output, atol=1e-14)
    np.testing.assert_allclose(t.concat @ result.w_o, t.output, atol=1e-14)
    np.testing.assert_allclose(t.heads.weights.sum(axis=-1), 1.0, rtol=1e-14)
    # the heads attend differently
    assert np.abs(t.heads.weights[0] - t.heads.weights[1]).max() > 0.1


def test_seeded() -> None:
    np.testing.assert_array_equal(multi_head.run().trace.output, multi_head.run().trace.output)


def test_heads_are_numbered_from_0_as_everywhere() -> None:
    import io

    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(multi_head.run().render())
    shown = console.export_text()
    H = multi_head.HEADS
    assert all(f"head {h} weights" in shown for h in range(H)) and f"head {H} weights" not in shown
    assert f"[out_0 ... out_{H - 1}]" in shown and "out_1 ..." not in shown
