"""The CPU block engine in bfloat16, every mask kind, forward and backward, by docs/design.md's
tolerance rule: error against the float64 reference at most 2x (output) / 3x (gradients)
the error of a naive implementation computed entirely in bfloat16, plus a floor of 1e-3.

The naive implementation has no empty-row rule (a row with no visible key is NaN there);
those rows are zero in the reference, and the naive rows are set to zero to match it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from tests.kernels.test_blocks import MASKS, SIZES, _problem, _reference

DTYPE = torch.bfloat16
FLOOR = 1e-3


def _naive(q, k, v, dense: torch.Tensor, scale: float):  # type: ignore[no-untyped-def]
    """softmax(q k^T * scale) v with every op in q's dtype; GQA by repeating kv heads."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~dense, float("-inf"))
    return torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0) @ v


def _err(a: torch.Tensor, b: np.ndarray) -> float:
    return float(np.abs(a.detach().double().numpy() - b).max())


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("kind", MASKS)
def test_bfloat16_by_the_tolerance_rule(kind: str, size: str) -> None:
    L, S = SIZES[size]
    if kind.startswith("documents") and L > S:
        L, S = S, L  # documents(ids) needs L <= S
    N, H, G, E = 2, 4, 2, 16
    q, k, v, d_out = _problem(N, H, G, L, S, E, E, seed=11)
    mask = MASKS[kind](N, S)
    _check_blocks_by_the_rule(q, k, v, mask, d_out, 0.25)


def _check_blocks_by_the_rule(q, k, v, mask, d_out, scale: float) -> None:  # type: ignore[no-untyped-def]
    """The engine in bf16 (forward and gradients) against the float64 reference, by the rule."""
    trace, ref_grads = _reference(q, k, v, mask, d_out, scale)
    dense = mask.to_dense(q.shape[2], k.shape[2])
    results = {}
    for name, fn in {
        "blocks": lambda a, b, c: qkv.attention(a, b, c, mask, backend="blocks", scale=scale),
        "naive": lambda a, b, c: _naive(a, b, c, dense, scale),
    }.items():
        ql, kl, vl = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
        out = fn(ql, kl, vl)
        results[name] = out, torch.autograd.grad(out, (ql, kl, vl), d_out.to(DTYPE))
    assert_by_the_rule(*results["blocks"], *results["naive"], trace.output, ref_grads)


def assert_by_the_rule(out, grads, naive_out, naive_grads, want_out, want_grads) -> None:  # type: ignore[no-untyped-def]
    """bf16 results, output within 2x and gradients within 3x the naive error (+ FLOOR)."""
    assert out.dtype == DTYPE and all(g.dtype == DTYPE for g in grads)
    assert _err(out, want_out) <= 2 * _err(naive_out, want_out) + FLOOR
    for got, naive, want in zip(grads, naive_grads, want_grads, strict=True):
        assert not torch.isnan(got).any()
        assert _err(got, want) <= 3 * _err(naive, want) + FLOOR


def test_a_long_sliding_window_in_bfloat16() -> None:
    # many rows per call, items over strided views, tiles shared between items and reused
    # by the backward in float32: the same rule at n = 1000 with the default tiles
    n = 1000
    q, k, v, d_out = _problem(1, 2, 2, n, n, 32, 32, seed=3)
    mask = qkv.masks.sliding_window(100, 60)
    trace, ref_grads = _reference(q, k, v, mask, d_out, 32**-0.5)
    dense = mask.to_dense(n, n)
    ql, kl, vl = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
    assert qkv.explain(ql, kl, vl, mask).path == "blocks"
    out = qkv.attention(ql, kl, vl, mask)
    grads = torch.autograd.grad(out, (ql, kl, vl), d_out.to(DTYPE))
    qn, kn, vn = (t.to(DTYPE).requires_grad_(True) for t in (q, k, v))
    naive = _naive(qn, kn, vn, dense, 32**-0.5)
    naive_grads = torch.autograd.grad(naive, (qn, kn, vn), d_out.to(DTYPE))
    assert _err(out, trace.output) <= 2 * _err(naive, trace.output) + FLOOR
    for got, nv, want in zip(grads, naive_grads, ref_grads, strict=True):
        assert _err(got, want) <= 3 * _err(nv, want) + FLOOR


def test_few_merging_rows_on_the_per_tile_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # causal & window(1100) at n = 1300: the rows past masked_span (1024) keys merge pieces, the
    # rest do not, so the bf16 output keeps its dtype and those rows merge in float32 buffers
    # of their own (block_calls._MergedRows); the fused kernel is off so the per-tile path runs
    from qkv.backends.blocks import calls as block_calls
    used = []
    real = block_calls._MergedRows.of

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = real(*args, **kwargs)
        used.append(result is not None)
        return result

    monkeypatch.setattr(block_calls._MergedRows, "of", spy)
    n = 1300
    q, k, v, d_out = _problem(1, 2, 2, n, n, 16, 16, seed=8)
    mask = qkv.masks.sliding_window(1100) & qkv.masks.causal()
    with qkv.backends.disabled("interval_bf16"):
        _check_blocks_by_the_rule(q, k, v, mask, d_out, 0.25)
    assert used == [True]
